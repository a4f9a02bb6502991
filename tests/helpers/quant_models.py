"""Small Gemm/MatMul/Conv ONNX models and ModelOpt INT4 runs for the quantization tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.stages import load_stage


int4 = load_stage("5b_quantize_int4")


def gemm_model(k: int = 576, n: int = 64, trans_b: bool = True, seed: int = 0):
    """x [batch, k] -> Gemm (weight [n, k] with transB=1, as torch Linear exports) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k) if trans_b else (k, n)) * 0.05).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc", transB=int(trans_b))], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.zeros(n, np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def matmul_model(k: int = 256, n: int = 64, seed: int = 1):
    """x [batch, k] -> MatMul (weight [k, n]) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def conv_model(input_name: str = "input", size: int = 224):
    """[batch,3,size,size] -> Conv 3x3 (stem) -> depthwise Conv -> grouped (2) Conv -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), nm) for nm, s in
             (("w0", (8, 3, 3, 3)), ("w1", (8, 1, 3, 3)), ("w2", (8, 4, 1, 1)))]
    nodes = [helper.make_node("Conv", [input_name, "w0"], ["a"], name="stem", pads=[1] * 4),
             helper.make_node("Conv", ["a", "w1"], ["b"], name="dw", group=8, pads=[1] * 4),
             helper.make_node("Conv", ["b", "w2"], ["y"], name="grouped", group=2)]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT,
                                                         ["batch", 3, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def _ort_run(path_or_model, feed):
    import onnxruntime as ort

    src = path_or_model if isinstance(path_or_model, (str, Path)) else \
        path_or_model.SerializeToString()
    sess = ort.InferenceSession(str(src) if isinstance(src, Path) else src,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _modelopt_int4(src: Path, dst: Path, block: int, method: str = "awq_clip", k: int = 576):
    from modelopt.onnx.quantization import quantize

    calib = {"x": np.random.default_rng(0).standard_normal((16, k)).astype(np.float32)}
    quantize(onnx_path=str(src), quantize_mode="int4", calibration_method=method,
             calibration_data=calib if method == "awq_clip" else None,
             calibration_eps=["cpu"], block_size=block, output_path=str(dst), log_level="ERROR")
    return dst
