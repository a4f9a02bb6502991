"""Small models with known faults for the verdict tests."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from onnx import helper, numpy_helper

from deploykit.runners import ort_session_options

from tests.helpers.stages import ROOT


def _ort_model(model, feed, level="all", disabled=()):
    import onnxruntime as ort

    so = ort_session_options(level)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled)).run(None, feed)[0]


def _tool(script, *argv):
    return subprocess.run([sys.executable, script, *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True)


# --------------------------------------------------------------------------------------------
# Tools that feed a model respect its static batch
# --------------------------------------------------------------------------------------------
def static_batch_model(batch=4):
    """A user's file exported with a fixed batch: x [4, 6] -> Gemm -> Relu -> y [4, 3]."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1),
         helper.make_node("Relu", ["h"], ["y"], name="relu")], "g",
        [helper.make_tensor_value_info("x", 1, [batch, 6])],
        [helper.make_tensor_value_info("y", 1, [batch, 3])],
        [numpy_helper.from_array(rng.standard_normal((3, 6)).astype(np.float32), "w"),
         numpy_helper.from_array(np.zeros(3, np.float32), "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# --------------------------------------------------------------------------------------------
# Squeeze on a dynamic axis, with or without axes
# --------------------------------------------------------------------------------------------
def _sq_model(x_shape, axes=None):
    inits, ins = [], ["x"]
    if axes is not None:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "ax"))
        ins.append("ax")
    g = helper.make_graph([helper.make_node("Squeeze", ins, ["y"], name="head/sq")], "g",
                          [helper.make_tensor_value_info("x", 1, x_shape)],
                          [helper.make_tensor_value_info("y", 1, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
