"""deploykit.quant.placement: Q/DQ placements TensorRT runs differently from ONNX Runtime (a
residual Add with a float input, a Concat of inputs at different scales; public case C33)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from deploykit.quant.health import check_model
from deploykit.quant.placement import check_trt_placement
from tests.helpers.stages import ROOT


def _c33(skip_qdq=False, cat_scales=(0.5 / 127, 5.0 / 127)):
    """C33's graph: conv1 -> relu -> conv2 (INT8) + the block input -> relu -> conv3 -> Concat
    of (conv3, relu2) -> GAP -> MatMul. ``skip_qdq``: the Add's skip input has Q/DQ too."""
    rng = np.random.default_rng(33)
    inits, nodes = [nh.from_array((rng.standard_normal((16, 5)) * .3).astype(np.float32),
                                  "fc_w")], []

    def W(name, shape):
        w = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        s = (np.abs(w).reshape(shape[0], -1).max(1) / 127).astype(np.float32)
        q = np.clip(np.round(w / s[:, None, None, None]), -127, 127).astype(np.int8)
        inits.extend([nh.from_array(q, name + "_q"), nh.from_array(s, name + "_s"),
                      nh.from_array(np.zeros(shape[0], np.int8), name + "_zp")])
        nodes.append(h.make_node("DequantizeLinear", [name + "_q", name + "_s", name + "_zp"],
                                 [name], axis=0, name=name + "_DQ"))
        return name

    def A(t, s, tag):
        inits.extend([nh.from_array(np.array(s, np.float32), tag + "_s"),
                      nh.from_array(np.array(0, np.int8), tag + "_zp")])
        nodes.extend([h.make_node("QuantizeLinear", [t, tag + "_s", tag + "_zp"], [tag + "_qi"],
                                  name=tag + "_Q"),
                      h.make_node("DequantizeLinear", [tag + "_qi", tag + "_s", tag + "_zp"],
                                  [tag + "_dq"], name=tag + "_DQ")])
        return tag + "_dq"

    x = A("input", 4.0 / 127, "x")
    nodes.append(h.make_node("Conv", [x, W("w1", (8, 8, 3, 3))], ["c1"], pads=[1] * 4,
                             name="conv1"))
    nodes.append(h.make_node("Relu", ["c1"], ["r1"], name="relu1"))
    nodes.append(h.make_node("Conv", [A("r1", 3.0 / 127, "r1"), W("w2", (8, 8, 3, 3))], ["c2"],
                             pads=[1] * 4, name="conv2"))
    skip = A("input", 4.0 / 127, "skip") if skip_qdq else "input"
    nodes.append(h.make_node("Add", ["c2", skip], ["res"], name="res_add"))
    nodes.append(h.make_node("Relu", ["res"], ["r2"], name="relu2"))
    nodes.append(h.make_node("Conv", [A("r2", 5.0 / 127, "r2"), W("w3", (8, 8, 1, 1))], ["c3"],
                             name="conv3"))
    nodes.append(h.make_node("Concat", [A("c3", cat_scales[0], "cat_a"),
                                        A("r2", cat_scales[1], "cat_b")], ["cat"], axis=1,
                             name="concat"))
    nodes += [h.make_node("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
              h.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
              h.make_node("MatMul", ["flat", "fc_w"], ["logits"], name="fc")]
    g = h.make_graph(nodes, "c33", [h.make_tensor_value_info("input", T.FLOAT, ["N", 8, 16, 16])],
                     [h.make_tensor_value_info("logits", T.FLOAT, ["N", 5])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 19)], ir_version=9)
    onnx.checker.check_model(m)
    return m


def test_c33_float_skip_input_and_concat_scales_are_named_with_the_fix():
    rep = check_model(_c33())
    kinds = {f["kind"]: f for f in rep["findings"]}
    add, cat = kinds["trt_add_float_input"], kinds["trt_concat_scales"]
    assert add["node"] == "res_add" and add["details"] == {"quantized_input": "c2",
                                                           "float_input": "input"}
    assert "INT8 Conv conv2" in add["message"] and "'input' (float, no Q/DQ)" in add["message"]
    assert "QuantizeLinear/DequantizeLinear pair on input 'input' of res_add" in add["fix"]
    assert cat["node"] == "concat" and "10x apart" in cat["message"]
    assert set(cat["details"]["inputs"]) == {"cat_a_dq", "cat_b_dq"}
    assert "one scale" in cat["fix"]
    assert rep["ok"] is False and rep["kinds"]["trt_add_float_input"] == 1


def test_the_fixed_placement_and_a_float_model_are_clean():
    assert check_trt_placement(_c33(skip_qdq=True, cat_scales=(5.0 / 127,) * 2)) == []
    # without any DequantizeLinear (the float model) there is nothing to judge
    m = _c33()
    keep = [n for n in m.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]
    assert check_trt_placement(onnx.helper.make_model(onnx.helper.make_graph(
        keep, "f", m.graph.input, m.graph.output))) == []


@pytest.mark.slow
def test_qdq_tools_check_exits_1_and_prints_the_nodes(tmp_path):
    p = tmp_path / "c33_qdq.onnx"
    onnx.save(_c33(), str(p))
    r = subprocess.run([sys.executable, "qdq_tools.py", "check", str(p)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "[trt_add_float_input] Add res_add" in r.stdout
    assert "[trt_concat_scales] Concat concat" in r.stdout
