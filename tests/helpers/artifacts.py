"""Helpers for the evaluation-stage tests: small classifier ONNX files."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.stages import run_stage


MODEL = "efficientnet_lite0"


def _classifier_onnx(path: Path, classes: int = 1000, seed: int = 0) -> Path:
    """``input [N,3,224,224] -> GlobalAveragePool -> Flatten -> Gemm -> logits [N, classes]``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((3, classes)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b")
    g = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("Gemm", ["f", "w", "b"], ["logits"])], "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], [w, b])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


FAST = ["--iters", "2", "--warmup", "0", "--model", MODEL]


def _stage3(env, onnx: str, tag: str, *extra, check=True):
    return run_stage(["3_onnx_eval.py", "--onnx", str(Path(env["ARTIFACTS"]) / MODEL / "onnx" /
                                                      onnx), "--tag", tag, *FAST, *extra],
                     env, check=check)


def _no_temporaries(*folders):
    for folder in folders:
        assert not list(Path(folder).rglob(".tmp-*")), list(Path(folder).rglob(".tmp-*"))
