"""deploykit.quant.auto.space: the Q/DQ configuration space (shared inputs, integer weights)."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.errors import StageError
from deploykit.onnx.graph import constants, QDQ_OPS
from deploykit.quant.auto.space import prune_unused, QdqSpace

from tests.helpers.auto_models import _qdq


def _shared_input_model():
    """x -> Q/DQ (shared) -> Conv A and Conv B (both with Q/DQ weights) -> Add -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), n)
             for n in ("wA", "wB")]
    nodes = [helper.make_node("Conv", ["x", "wA"], ["ya"], name="A"),
             helper.make_node("Conv", ["x", "wB"], ["yb"], name="B"),
             helper.make_node("Add", ["ya", "yb"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    fp32 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    fp32.ir_version = 9
    q = type(fp32)()
    q.CopyFrom(fp32)
    _qdq(q, "x", 0.1)
    _qdq(q, "wA", np.full(4, 0.02), axis=0)
    _qdq(q, "wB", np.full(4, 0.02), axis=0)
    return fp32, q


def _ort(model, x):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_configurations_follow_modelopt_a_shared_input_stays_quantized_while_one_reader_is_int8():
    fp32, q = _shared_input_model()
    space = QdqSpace(q, fp32)
    assert space.names == ["A", "B"] and space.owners == {"x_DequantizeLinear": {"A", "B"}}
    nodes = lambda m: {n.name: n for n in m.graph.node}  # noqa: E731
    only_a_float = nodes(space.model({"A"}))
    # A's weight is float again, but x is still quantized for B, so A reads it too (ModelOpt's
    # --nodes_to_exclude A gives the same: ORT's quantizer rewires every consumer of x)
    assert list(only_a_float["A"].input) == ["x_dq", "wA"]
    assert list(only_a_float["B"].input) == ["x_dq", "wB_dq"]
    assert "wA_QuantizeLinear" not in only_a_float  # dead Q/DQ pruned
    all_float = space.model({"A", "B"})
    assert not any(n.op_type in QDQ_OPS for n in all_float.graph.node)
    assert {t.name for t in all_float.graph.initializer} == {"wA", "wB"}
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(_ort(all_float, x), _ort(fp32, x))
    np.testing.assert_array_equal(_ort(space.model(()), x), _ort(q, x))
    with pytest.raises(KeyError, match="not a quantized candidate"):
        space.model({"add"})


def test_integer_weights_are_restored_from_the_fp32_model():
    """A DequantizeLinear of a constant int8 weight (ModelOpt --dq_only) has no float copy in
    the Q/DQ model: the float weight comes from the FP32 model, and without it the error says
    so."""
    from onnx import numpy_helper

    fp32, q = _shared_input_model()
    consts = constants(q)
    wq = np.clip(np.round(consts["wA"] / 0.02), -128, 127).astype(np.int8)
    q.graph.initializer.append(numpy_helper.from_array(wq, "wA_int8"))
    for n in q.graph.node:
        if n.name == "wA_DequantizeLinear":
            n.input[0] = "wA_int8"
    prune_unused(q)
    space = QdqSpace(q, fp32)
    m = space.model({"A", "B"})
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(_ort(m, x), _ort(fp32, x))
    with pytest.raises(StageError, match="--fp32"):
        QdqSpace(q, None)
