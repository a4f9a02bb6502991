"""Small ONNX models built inside the tests (no files, seconds to run)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def block_model(seed: int = 0, c_in: int = 4, c_mid: int = 8, c_out: int = 6, hw: int = 8,
                spread: float = 30.0) -> onnx.ModelProto:
    """conv1x1 -> Clip(0,6) -> depthwise 3x3 -> Clip(0,6) -> conv1x1 (a MobileNet/EfficientNet
    block), with per-channel weight scales spread over ``spread``x (as BN folding leaves them)."""
    r = np.random.default_rng(seed)
    g = np.exp(np.linspace(0, np.log(spread), c_mid)).astype(np.float32)
    r.shuffle(g)
    w1 = (r.normal(size=(c_mid, c_in, 1, 1)) * 0.5 * g[:, None, None, None]).astype(np.float32)
    b1 = r.normal(size=c_mid).astype(np.float32) * 0.1
    w2 = (r.normal(size=(c_mid, 1, 3, 3)) / g[:, None, None, None] * 3).astype(np.float32)
    b2 = r.normal(size=c_mid).astype(np.float32) * 0.1
    w3 = (r.normal(size=(c_out, c_mid, 1, 1)) * 0.3).astype(np.float32)
    b3 = r.normal(size=c_out).astype(np.float32) * 0.1
    inits = [numpy_helper.from_array(a, n) for a, n in
             [(w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"), (w3, "w3"), (b3, "b3"),
              (np.array(0, np.float32), "zero"), (np.array(6, np.float32), "six")]]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["y1"], name="conv1"),
        helper.make_node("Clip", ["y1", "zero", "six"], ["a1"], name="clip1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["y2"], name="dw", group=c_mid,
                         pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["y2", "zero", "six"], ["a2"], name="clip2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["out"], name="conv3"),
    ]
    gr = helper.make_graph(nodes, "block",
                           [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          ["N", c_in, hw, hw])],
                           [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                          ["N", c_out, hw, hw])], inits)
    m = helper.make_model(gr, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def run(model: onnx.ModelProto, x: np.ndarray, outputs=None) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(outputs, {"x": x})


def inputs(n: int = 16, c: int = 4, hw: int = 8, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, c, hw, hw)).astype(np.float32)
