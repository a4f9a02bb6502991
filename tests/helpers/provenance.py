"""Tiny inputs for the provenance/staleness tests: a MatMul ONNX model with its own data
(``tests.custom_models:tiny_net`` as the model name: not a classifier), its reference outputs,
and producer records that name derived files by hash."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from deploykit.io import sha256_file, write_json
from deploykit.layout import fp32_onnx_path, model_artifacts, model_results, ref_outputs_path

MODEL = "tests.custom_models:tiny_net"


def matmul_onnx(path: Path, scale: float = 1.0) -> Path:
    """``y = x @ W`` (x float32 [N, 4], W [4, 3] seeded, times ``scale``) saved at ``path``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((4, 3)) * scale).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(path))
    return path


def reference(scale: float = 1.0, n: int = 8) -> Path:
    """``ref_outputs.npz`` of :func:`matmul_onnx` at ``scale`` on seeded inputs (stage 1's
    layout: ``in:x``, ``out:y``, ``meta:synthetic``)."""
    x = np.random.default_rng(1).standard_normal((n, 4)).astype(np.float32)
    w = (np.random.default_rng(0).standard_normal((4, 3)) * scale).astype(np.float32)
    path = ref_outputs_path(MODEL)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **{"in:x": x, "out:y": x @ w, "meta:synthetic": np.array(False)})
    return path


def export_pair(fp16_scale: float = 1.0) -> tuple[Path, Path]:
    """``fp32.onnx`` and a derived ``fp16.onnx`` (here a float copy with another weight scale,
    so its bytes differ) with the ``export.json`` stage 2 writes (sha256 per file)."""
    fp32 = matmul_onnx(fp32_onnx_path(MODEL))
    fp16 = matmul_onnx(fp32.with_name("fp16.onnx"), fp16_scale)
    write_json(model_results(MODEL) / "export.json", {
        "stage": "2_export_onnx", "status": "ok",
        "files": {k: {"path": str(p), "sha256": sha256_file(p)}
                  for k, p in (("fp32", fp32), ("fp16", fp16))},
        "provenance": {"command": f"2_export_onnx.py --model {MODEL}"}})
    return fp32, fp16


def reexport(scale: float = 2.0) -> Path:
    """Rewrite ``fp32.onnx`` with other weights (as a stage 2 rerun with other weights would)."""
    return matmul_onnx(fp32_onnx_path(MODEL), scale)


def copy_artifacts(dst: Path) -> None:
    """Copy this model's artifacts folder to another ARTIFACTS root ``dst``."""
    shutil.copytree(model_artifacts(MODEL), dst / model_artifacts(MODEL).name)
