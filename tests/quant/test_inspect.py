"""deploykit.quant.inspect: FP16 underflow/bias products and activation statistics."""

from __future__ import annotations

import numpy as np

from deploykit.quant.inspect import activation_stats, inspect_model

from tests.helpers.auto_models import _save


# --------------------------------------------------------------------------------------------
# inspect, act-stats, stage 5 usage
# --------------------------------------------------------------------------------------------
def test_inspect_reports_fp16_underflow_and_bias_products():
    from onnx import TensorProto, helper, numpy_helper

    def init(name, arr):
        return numpy_helper.from_array(arr, name)

    a_s = np.array(1e-3, np.float16)
    w_s = np.array([1e-2, 1e-5, 6e-08], np.float16)  # the last is ModelOpt's replacement
    inits = [init("xs", a_s), init("xz", np.array(0, np.int8)), init("wq", np.ones((3, 3, 1, 1), np.int8)),
             init("ws", w_s), init("wz", np.zeros(3, np.int8)), init("b", np.ones(3, np.float32))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dqx"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="dqw", axis=0),
             helper.make_node("Conv", ["xd", "wd", "b"], ["y"], name="conv"),
             helper.make_node("Relu", ["y"], ["z"], name="relu"),
             # ORT's WeightBiasQuantization only rewrites a Conv whose output reaches a Q.
             helper.make_node("QuantizeLinear", ["z", "xs", "xz"], ["zq"], name="qz")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16,
                                                                     [1, 3, 4, 4])],
                          [helper.make_tensor_value_info("zq", TensorProto.INT8, None)], inits)
    rep = inspect_model(helper.make_model(g))
    assert rep["n_quantize"] == 2 and rep["n_dequantize"] == 2
    assert rep["granularity"] == {"per-tensor": 1, "per-channel": 1}
    assert rep["scale_dtypes"] == {"float16": 2}
    assert rep["n_scales_at_6e-08"] == 1 and rep["smallest_scales"][0]["node"] == "dqw"
    assert rep["quantized_nodes_by_op"] == {"Conv": 1} and rep["float_nodes_by_op"] == {"Relu": 1}
    b = rep["bias"]
    # 1e-3 * 1e-5 and 1e-3 * 6e-8 underflow to 0 in fp16; 1e-3 * 1e-2 does not.
    assert b["float_bias_wbq_candidates"] == 1 and b["n_products_zero_in_fp16"] == 2


def test_act_stats_exact_max_p999_and_outlier_ranking(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    lo, hi = numpy_helper.from_array(np.array(-1, np.float32), "lo"), \
        numpy_helper.from_array(np.array(1, np.float32), "hi")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip"),
             helper.make_node("Add", ["r", "c"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["n", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [lo, hi])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    path = _save(m, tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((20, 3, 8, 8)).astype(np.float32)
    x[0, 0, 0, 0] = 500.0  # one outlier: huge max/p99.9 after Relu, clipped away by Clip
    np.savez(tmp_path / "c.npz", x=x)
    rows = {r["tensor"]: r for r in activation_stats(path, tmp_path / "c.npz", batch=5)}
    assert set(rows) == {"r", "c", "y"}
    assert rows["r"]["max"] == 500.0 and rows["c"]["max"] == 1.0
    np.testing.assert_allclose(rows["r"]["p99.9"], np.percentile(np.maximum(x, 0), 99.9),
                               rtol=1e-6)
    order = [r["tensor"] for r in activation_stats(path, tmp_path / "c.npz")]
    assert order[-1] == "c" and rows["r"]["ratio"] > 50 and rows["c"]["ratio"] < 1.01
    assert rows["r"]["channel_spread"] > 50  # only channel 0 holds the outlier
