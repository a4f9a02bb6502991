"""deploykit.onnx.graph.detect_precision / precision_note: the precision label follows the MACs
that compute in INT8 (deploykit.quant.macs), not the presence of Q/DQ nodes. Small graphs built
here: a float MatMul with a dead Q/DQ pair, with Q/DQ on a tensor that feeds no MAC op, with
Q/DQ on the activation only, and the INT8 MatMul they are not."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit.onnx.graph import detect_precision, precision_note, tolerance_precision


def _model(kind: str, fp16: bool = False):
    """``y = relu(x) @ W`` (x [N, 4], W [4, 3]) plus the Q/DQ nodes of ``kind``."""
    ft = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    dt = np.float16 if fp16 else np.float32
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(dt)
    inits = [numpy_helper.from_array(np.array(0.05, dt), "s"),
             numpy_helper.from_array(np.array(0, np.uint8), "zp")]
    nodes = []
    act, weight = "x", "W"
    if kind == "dead":  # x -> Q -> DQ -> nothing
        nodes += [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q"),
                  helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["dead"], name="dq")]
    if kind in ("no_mac", "act_only", "int8"):  # x -> Q -> DQ -> Relu (not a MAC op)
        nodes += [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q"),
                  helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq")]
        act = "xd"
    nodes.append(helper.make_node("Relu", [act], ["r"], name="relu"))
    mm_in = "r"
    if kind in ("act_only", "int8"):  # Q/DQ on the MatMul's data input
        nodes += [helper.make_node("QuantizeLinear", ["r", "s", "zp"], ["rq"], name="q2"),
                  helper.make_node("DequantizeLinear", ["rq", "s", "zp"], ["rd"], name="dq2")]
        mm_in = "rd"
    if kind == "int8":  # int8 weight with its DequantizeLinear
        wq = np.clip(np.round(w.astype(np.float32) / 0.05), -127, 127).astype(np.int8)
        inits += [numpy_helper.from_array(wq, "Wq"),
                  numpy_helper.from_array(np.array(0, np.int8), "wzp")]
        nodes.append(helper.make_node("DequantizeLinear", ["Wq", "s", "wzp"], ["Wd"], name="wdq"))
        weight = "Wd"
    else:
        inits.append(numpy_helper.from_array(w, "W"))
    nodes.append(helper.make_node("MatMul", [mm_in, weight], ["y"], name="mm"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", ft, ["N", 4])],
                          [helper.make_tensor_value_info("y", ft, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


@pytest.mark.parametrize("kind", ["dead", "no_mac", "act_only"])
def test_qdq_without_a_quantized_mac_is_not_int8(kind):
    m = _model(kind)
    assert detect_precision(m) == "FP32"
    note = precision_note(m)
    assert note.startswith(f"{2 if kind != 'act_only' else 4} QuantizeLinear/Dequantize")
    assert "0 of 1 MatMul/Conv/Gemm quantized" in note and "labelled FP32, not INT8" in note
    # the file runs (a real graph ORT accepts), and the label stays float in FP16 too
    x = np.ones((2, 4), np.float32)
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    assert detect_precision(_model(kind, fp16=True)) == "FP16"


def test_a_quantized_matmul_is_int8_and_a_float_model_has_no_note():
    m = _model("int8")
    assert detect_precision(m) == "INT8" and precision_note(m) is None
    assert detect_precision(_model("float")) == "FP32" and precision_note(_model("float")) is None


def _as_constants(m):
    """``m`` with its initializers moved into Constant nodes (how the legacy exporter writes
    some FP16 graphs)."""
    m2 = helper.make_model(m.graph, opset_imports=list(m.opset_import), ir_version=m.ir_version)
    consts = [helper.make_node("Constant", [], [t.name], value=t, name=f"const_{t.name}")
              for t in m2.graph.initializer]
    nodes = consts + list(m2.graph.node)
    del m2.graph.node[:], m2.graph.initializer[:]
    m2.graph.node.extend(nodes)
    return m2


@pytest.mark.parametrize("fp16", [False, True])
def test_the_float_label_counts_constant_nodes_too(fp16):
    """An FP16 graph whose weights are Constant nodes (no initializer at all) is FP16, not FP32
    (its layer-wise diff gets the FP16 tolerance); an FP32 one stays FP32."""
    m = _as_constants(_model("float", fp16=fp16))
    assert not m.graph.initializer
    assert detect_precision(m) == ("FP16" if fp16 else "FP32")
    assert tolerance_precision(m) == detect_precision(m)


@pytest.mark.parametrize("kind", ["dead", "no_mac", "act_only"])
def test_qdq_on_float_ops_is_compared_at_the_int8_tolerance(kind, tmp_path):
    """Q/DQ that quantize no MAC still round their tensors to the INT8 grid: the row label
    stays float (detect_precision) but the layer-wise comparison with the float file uses the
    INT8 tolerance, so the rounding is not reported as a divergent layer."""
    from onnx import save

    from deploykit.layerwise.diff import run_layer_diff

    m = _model(kind)
    assert detect_precision(m) == "FP32" and tolerance_precision(m) == "INT8"
    assert tolerance_precision(_model("float")) == "FP32"
    assert tolerance_precision(_model("int8")) == "INT8"
    save(_model("float"), str(tmp_path / "a.onnx"))
    save(m, str(tmp_path / "b.onnx"))
    feed = {"x": np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)}
    res = run_layer_diff(tmp_path / "a.onnx", tmp_path / "b.onnx", feed)
    assert res["precision"] == "int8"


def test_a_diff_of_an_fp16_file_on_the_cpu_ep_says_what_it_cannot_show(tmp_path):
    """ORT's CPU EP computes FP16 graphs in FP32: the layer-wise diff of an FP16 file there
    says that it cannot show FP16 overflow, and where to look instead; an FP32 diff does not."""
    from onnx import save

    from deploykit.layerwise.diff import run_layer_diff
    from deploykit.layerwise.report import render_table

    save(_model("float"), str(tmp_path / "a.onnx"))
    save(_model("float", fp16=True), str(tmp_path / "b.onnx"))
    feed = {"x": np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)}
    res = run_layer_diff(tmp_path / "a.onnx", tmp_path / "b.onnx", feed)
    assert res["precision"] == "fp16" and "fp16-audit" in res["fp16_note"]
    assert "cannot show FP16 overflow" in render_table(res)
    same = run_layer_diff(tmp_path / "a.onnx", tmp_path / "a.onnx", feed)
    assert "fp16_note" not in same and "cannot show" not in render_table(same)


def test_the_float_label_counts_values_not_tensors():
    """FP32 Resize scales (4 values each) beside FP16 weights leave an FP16 file FP16, and FP16
    scalars beside FP32 weights leave an FP32 file FP32: the label follows the values."""
    from onnx import TensorProto

    def with_constants(m, dtype, n, shape):
        extra = [helper.make_node("Constant", [], [f"c{i}"], name=f"c{i}",
                                  value=numpy_helper.from_array(np.ones(shape, dtype), f"v{i}"))
                 for i in range(n)]
        g = m.graph
        g2 = helper.make_graph(extra + list(g.node), g.name, list(g.input), list(g.output),
                               list(g.initializer))
        return helper.make_model(g2, opset_imports=list(m.opset_import), ir_version=m.ir_version)

    # 13 FP16 values in 2 tensors against 8 FP32 values in 2 tensors (a count of tensors ties)
    fp16 = with_constants(_model("float", fp16=True), np.float32, 2, (4,))
    assert sum(t.data_type == TensorProto.FLOAT for t in fp16.graph.initializer) == 0
    assert detect_precision(fp16) == "FP16"
    assert detect_precision(_as_constants(fp16)) == "FP16"  # weights in Constant nodes too
    # 5 FP16 scalars (5 tensors) against 13 FP32 values (2 tensors)
    fp32 = with_constants(_model("float"), np.float16, 5, ())
    assert detect_precision(fp32) == "FP32"
