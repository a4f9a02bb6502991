"""deploykit.quant.record: a Q/DQ file in which ModelOpt quantized no MAC node is a warning in
the quant record and the printed line, never "check: clean"."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from deploykit.quant.macs import mac_summary
from deploykit.quant.record import flag_unquantized, unquantized_warning


def _mlp(quantized: bool):
    """x [1, 16] -> MatMul(16x32) -> Relu -> MatMul(32x4) -> y; with ``quantized`` the first
    MatMul's input and weight go through QuantizeLinear/DequantizeLinear (INT8)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((32, 4)).astype(np.float32), "w2")]
    nodes, a, w = [], "x", "w1"
    if quantized:
        inits += [numpy_helper.from_array(np.array(0.02, np.float32), "s"),
                  numpy_helper.from_array(np.array(0, np.int8), "z"),
                  numpy_helper.from_array(rng.integers(-127, 127, (16, 32)).astype(np.int8),
                                          "w1_q")]
        nodes += [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
                  helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
                  helper.make_node("DequantizeLinear", ["w1_q", "s", "z"], ["w1d"])]
        a, w = "xd", "w1d"
    nodes += [helper.make_node("MatMul", [a, w], ["h"], name="fc1"),
              helper.make_node("Relu", ["h"], ["r"]),
              helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                      [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_zero_quantized_nodes_is_a_warning_in_the_record_and_the_printed_line(capsys):
    macs = mac_summary(_mlp(quantized=False))
    msg = unquantized_warning(macs)
    assert msg.startswith("0 of 2 MatMul/Conv/Gemm quantized: ")
    rec = {"macs": macs, "warnings": ["modelopt: some log line"],
           "check": {"ok": True, "summary": "check: clean"}}
    assert flag_unquantized(rec, "/x/mlp_int8.onnx") == msg
    assert rec["unquantized"] == msg and rec["warnings"] == ["modelopt: some log line"]
    assert rec["check"]["summary"] == f"check: clean; WARNING: {msg}"
    assert f"WARNING: mlp_int8.onnx: {msg}" in capsys.readouterr().err


def test_a_file_with_a_quantized_node_is_not_flagged(capsys):
    macs = mac_summary(_mlp(quantized=True))
    assert macs["n_int8_nodes"] == 1, macs
    rec = {"macs": macs, "check": {"summary": "check: clean"}}
    assert flag_unquantized(rec, "q.onnx") is None
    assert rec["check"]["summary"] == "check: clean" and "unquantized" not in rec
    assert capsys.readouterr().err == ""
    assert unquantized_warning(None) is None and unquantized_warning({"n_nodes": 0}) is None
