"""Small ONNX models and stage-6 helpers for the TensorRT tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np


# --------------------------------------------------------------------------------------------
# Models built by the tests
# --------------------------------------------------------------------------------------------
def save(model, path: Path) -> Path:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def conv_net(opset: int = 17, names=None, dynamic_hw: bool = False, fp16: bool = False,
             input_name: str = "input"):
    """[N,3,8,8] -> 4 x (Conv+Relu) -> GlobalAveragePool -> Flatten -> Gemm(10). ``names``
    renames the nodes (to match a captured DLA log)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    dt = np.float16 if fp16 else np.float32
    inits, nodes, x = [], [], input_name
    if fp16:
        nodes.append(helper.make_node("Cast", [x], ["x16"], to=TensorProto.FLOAT16, name="cin"))
        x = "x16"
    c = 3
    for i in range(4):
        inits.append(numpy_helper.from_array((rng.standard_normal((8, c, 3, 3)) * 0.3)
                                             .astype(dt), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1] * 4,
                                   name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x, c = f"r{i}", 8
    inits += [numpy_helper.from_array((rng.standard_normal((10, 8)) * 0.3).astype(dt), "fw")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["g"], name="gap"),
              helper.make_node("Flatten", ["g"], ["f"], name="flat"),
              helper.make_node("Gemm", ["f", "fw"], ["l"], transB=1, name="fc")]
    out = "l"
    if fp16:
        nodes.append(helper.make_node("Cast", ["l"], ["logits"], to=TensorProto.FLOAT,
                                      name="cout"))
        out = "logits"
    if names:
        for n, new in zip([n for n in nodes if n.op_type != "Cast"], names):
            n.name = new
    hw = ["H", "W"] if dynamic_hw else [8, 8]
    g = helper.make_graph(nodes, "net",
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT,
                                                         ["N", 3] + hw)],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 10])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def two_input_net(image: str = "image:0", tokens: str = "tokens"):
    """Two inputs with dynamic spatial and sequence axes: image [N,3,H,W], tokens [N,L,16]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "p")]
    nodes = [helper.make_node("Conv", [image, "w"], ["c"], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("MatMul", [tokens, "p"], ["t"], name="proj"),
             helper.make_node("ReduceMean", ["t"], ["tm"], axes=[1], keepdims=0, name="pool"),
             helper.make_node("Add", ["f", "tm"], ["y"], name="add")]
    g = helper.make_graph(nodes, "two",
                          [helper.make_tensor_value_info(image, TensorProto.FLOAT,
                                                         ["N", 3, "H", "W"]),
                           helper.make_tensor_value_info(tokens, TensorProto.FLOAT,
                                                         ["N", "L", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def qdq_net(fp16: bool, opset: int = 19, input_name: str = "input",
            axes_initializer: bool = False):
    """What ModelOpt 0.47 writes for a small CNN (compare tests below with its real output):
    opset 19, per-tensor activation Q/DQ, per-channel weight Q/DQ, ReduceMean with its axes as a
    Constant input (opset 18 form); ``fp16``: float16 weights, scales and compute with fp32 I/O
    casts (``--high_precision_dtype fp16``). ``axes_initializer``: the axes as an initializer and
    ``noop_with_empty_axes=0`` on ReduceMean, as in ModelOpt's EfficientNet-Lite0 output of the
    dynamo-exported (opset 18) model."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    dt = np.float16 if fp16 else np.float32
    w0 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    w1 = (rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32)
    fw = (rng.standard_normal((10, 8)) * 0.3).astype(np.float32)

    def t(name, arr, dtype=dt):
        return numpy_helper.from_array(np.asarray(arr).astype(dtype), name)

    inits = [t("w0", w0), t("w1", w1), t("fw", fw),
             t("w0_s", np.abs(w0).reshape(8, -1).max(1) / 127), t("w1_s",
                                                                   np.abs(w1).reshape(8, -1).max(1)
                                                                   / 127),
             t("x_s", np.float32(0.03)), t("r_s", np.float32(0.02)),
             t("zp8", np.zeros(8, np.int8), np.int8), t("zp", np.int8(0), np.int8)]
    x = input_name
    nodes = []
    if fp16:
        nodes.append(helper.make_node("Cast", [x], ["x16"], to=TensorProto.FLOAT16,
                                      name="input_cast_to_fp16"))
        x = "x16"
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    if axes_initializer:
        inits.append(axes)
    else:
        nodes.append(helper.make_node("Constant", [], ["axes"], name="axes_const", value=axes))
    nodes += [
        helper.make_node("QuantizeLinear", [x, "x_s", "zp"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "x_s", "zp"], ["xd"], name="x_dq"),
        helper.make_node("QuantizeLinear", ["w0", "w0_s", "zp8"], ["w0q"], axis=0, name="w0_q"),
        helper.make_node("DequantizeLinear", ["w0q", "w0_s", "zp8"], ["w0d"], axis=0,
                         name="w0_dq"),
        helper.make_node("Conv", ["xd", "w0d"], ["c0"], pads=[1] * 4, name="conv0"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("QuantizeLinear", ["r0", "r_s", "zp"], ["rq"], name="r_q"),
        helper.make_node("DequantizeLinear", ["rq", "r_s", "zp"], ["rd"], name="r_dq"),
        helper.make_node("QuantizeLinear", ["w1", "w1_s", "zp8"], ["w1q"], axis=0, name="w1_q"),
        helper.make_node("DequantizeLinear", ["w1q", "w1_s", "zp8"], ["w1d"], axis=0,
                         name="w1_dq"),
        helper.make_node("Conv", ["rd", "w1d"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("ReduceMean", ["r1", "axes"], ["m"], keepdims=0, name="gap",
                         **({"noop_with_empty_axes": 0} if axes_initializer else {})),
        helper.make_node("Gemm", ["m", "fw"], ["l16" if fp16 else "logits"], transB=1,
                         name="fc")]
    if fp16:
        nodes.append(helper.make_node("Cast", ["l16"], ["logits"], to=TensorProto.FLOAT,
                                      name="logits_cast_to_fp32"))
    g = helper.make_graph(nodes, "qdq",
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT,
                                                         ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


def flags(c):
    return {a.split("=")[0] for a in c[1:]}


# --------------------------------------------------------------------------------------------
# Stage 7 helpers
# --------------------------------------------------------------------------------------------
def _linear_infer(w, batch_dependent: float = 0.0, calls=None):
    def infer(feed):
        x = next(iter(feed.values()))
        if calls is not None:
            calls.append(len(x))
        y = x.reshape(len(x), -1) @ w
        if batch_dependent and len(x) > 1:
            y = y + batch_dependent * np.sign(y)  # a different "kernel" at batch > 1
        return {"logits": y.astype(np.float32)}
    return infer


# --------------------------------------------------------------------------------------------
# Stage 6 as a user runs it (no TensorRT here)
# --------------------------------------------------------------------------------------------
def _env(tmp_path, model="mobilenet_v3_small") -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL=model, PATH="/usr/bin:/bin", PYTHON=sys.executable)
    env.pop("TRTEXEC", None)
    return env
