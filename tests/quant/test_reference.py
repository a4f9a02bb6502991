"""deploykit.quant.reference: the Q/DQ graph's own numerics at ORT's speed, checked node by node."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import deploykit.quant.reference as reference
from deploykit.quant.reference import qdq_reference_runner, unfaithful
from deploykit.runners import OrtRunner

from tests.helpers.auto_models import _save


def _graph(nodes, inits, out_shape=("N", 4, 8, 8)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 4, 8, 8])],
                          [helper.make_tensor_value_info("y", 1, list(out_shape))],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _conv_qdq(w_scale=(0.01,) * 4, double: bool = False):
    """x -> Q/DQ (0.013) [-> Q/DQ (0.031): ``double``] -> Conv 3x3 (int8 weights, per-channel
    ``w_scale``, bias 5) -> Relu -> Q/DQ -> y [N, 4, 8, 8]."""
    rng = np.random.default_rng(0)
    inits = {"s1": np.array(0.013, np.float32), "s2": np.array(0.031, np.float32),
             "sy": np.array(0.05, np.float32), "z": np.array(0, np.int8),
             "wq": rng.integers(-127, 128, (4, 4, 3, 3)).astype(np.int8),
             "ws": np.asarray(w_scale, np.float32), "wz": np.zeros(4, np.int8),
             "b": np.full(4, 5.0, np.float32)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s1", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s1", "z"], ["xd"])]
    src = "xd"
    if double:
        nodes += [helper.make_node("QuantizeLinear", ["xd", "s2", "z"], ["xq2"]),
                  helper.make_node("DequantizeLinear", ["xq2", "s2", "z"], ["xd2"])]
        src = "xd2"
    nodes += [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
              helper.make_node("Conv", [src, "w", "b"], ["c"], pads=[1, 1, 1, 1]),
              helper.make_node("Relu", ["c"], ["r"]),
              helper.make_node("QuantizeLinear", ["r", "sy", "z"], ["rq"]),
              helper.make_node("DequantizeLinear", ["rq", "sy", "z"], ["y"])]
    return _graph(nodes, inits)


def _x(n=16):
    return {"x": np.random.default_rng(1).uniform(-1.5, 1.5, (n, 4, 8, 8)).astype(np.float32)}


@pytest.mark.parametrize("double", [False, True])
def test_the_fast_reference_computes_what_the_unoptimised_graph_computes(double, tmp_path):
    """ORT's default level removes one of two Q/DQ pairs in a row (DoubleQDQPairsRemover) and
    re-quantizes a Conv bias (WeightBiasQuantization: a 1e-12 weight scale under bias 5 turns
    the channel into garbage); the reference keeps both pairs and the float bias, so its outputs
    are the unoptimised run's (float32, to a few ULP of FP32 reordering) while ORT's own differ."""
    path = _save(_conv_qdq((1e-12, 0.01, 0.01, 0.01), double), tmp_path / "q.onnx")
    feed = _x()
    runner, how = qdq_reference_runner(path)
    assert how == {"reference": "qdq_rewrites_off", "why": None}
    assert runner.opt_level == "all"
    with runner:
        ref = runner.infer(feed)["y"]
    with OrtRunner(path, opt_level="disable") as r:
        plain = r.infer(feed)["y"]
    with OrtRunner(path) as r:
        ort_default = r.infer(feed)["y"]
    np.testing.assert_allclose(ref, plain, rtol=0, atol=1e-5)
    assert np.abs(ort_default - plain).max() > 0.04  # at least one output step: the test can fail


def test_a_rewrite_the_check_does_not_know_runs_unoptimised(monkeypatch, tmp_path):
    """When ORT's optimised graph fails the node check, the reference is ORT with every
    optimisation off, and says why."""
    path = _save(_conv_qdq(), tmp_path / "q.onnx")
    monkeypatch.setattr(reference, "unfaithful", lambda a, b: "a reason")
    runner, how = qdq_reference_runner(path)
    assert how == {"reference": "unoptimised", "why": "a reason"}
    assert runner.opt_level == "disable"


def test_the_node_check_names_each_kind_of_change():
    """unfaithful() passes the same graph, and names a removed activation Q/DQ, a changed
    scale or attribute, a Q/DQ the file lacks, an integer kernel, an op the check does not know
    and control flow; a folded weight DequantizeLinear and an NCHWc op pass."""
    m = _conv_qdq()
    assert unfaithful(m, m) is None

    def edit(fn):
        c = type(m)()
        c.CopyFrom(m)
        fn(c.graph)
        return c

    def drop_pair(g):  # Q/DQ of x gone: the conv reads x
        keep = [n for n in g.node if n.output[0] not in ("xq", "xd")]
        del g.node[:]
        g.node.extend(keep)
        for n in g.node:
            n.input[:] = ["x" if i == "xd" else i for i in n.input]
    assert "removed or renamed" in unfaithful(m, edit(drop_pair))

    def rescale(g):
        for t in g.initializer:
            if t.name == "sy":
                t.CopyFrom(numpy_helper.from_array(np.array(0.06, np.float32), "sy"))
    assert "changed the scale" in unfaithful(m, edit(rescale))

    def saturate_off(g):
        for n in g.node:
            if n.output[0] == "rq":
                n.attribute.append(helper.make_attribute("saturate", 0))
    assert "changed the QuantizeLinear" in unfaithful(m, edit(saturate_off))

    def extra_pair(g):
        g.node.extend([helper.make_node("QuantizeLinear", ["y", "sy", "z"], ["extra_q"])])
    assert "the file has not" in unfaithful(m, edit(extra_pair))

    def fold_weight(g):  # ORT's constant folding: the weight DQ becomes a float initializer
        keep = [n for n in g.node if n.output[0] != "w"]
        del g.node[:]
        g.node.extend(keep)
        g.initializer.append(numpy_helper.from_array(np.zeros((4, 4, 3, 3), np.float32), "w"))
    assert unfaithful(m, edit(fold_weight)) is None

    def nchwc(g):
        for n in g.node:
            if n.op_type == "Conv":
                n.domain = "com.microsoft.nchwc"
    assert unfaithful(m, edit(nchwc)) is None

    def integer_kernel(g):
        for n in g.node:
            if n.op_type == "Conv":
                n.op_type, n.domain = "QLinearConv", "com.microsoft"
    assert "QLinearConv" in unfaithful(m, edit(integer_kernel))

    def unknown_op(g):
        for n in g.node:
            if n.op_type == "Relu":
                n.op_type = "Elu"
    assert "Elu, not an op of the file" in unfaithful(m, edit(unknown_op))

    loop = edit(lambda g: g.node.extend([helper.make_node(
        "If", ["cond"], ["o"], then_branch=helper.make_graph([], "t", [], []),
        else_branch=helper.make_graph([], "e", [], []))]))
    assert "control flow" in unfaithful(loop, loop)


def test_an_fp16_scale_cast_by_ort_is_read_as_the_constant_it_is():
    """The CPU EP casts an FP16 scale to float32 at every level (a Cast of an initializer in
    the unoptimised graph) and folds it where it optimises: the same value, not a change."""
    m = _conv_qdq()
    c = type(m)()
    c.CopyFrom(m)
    for t in c.graph.initializer:
        if t.name == "sy":
            t.CopyFrom(numpy_helper.from_array(np.array(0.05, np.float16), "sy16"))
    c.graph.node.insert(0, helper.make_node("Cast", ["sy16"], ["sy"], to=TensorProto.FLOAT))
    folded = type(m)()
    folded.CopyFrom(m)
    for t in folded.graph.initializer:
        if t.name == "sy":
            t.CopyFrom(numpy_helper.from_array(np.array(np.float16(0.05), np.float32), "sy"))
    assert unfaithful(c, folded) is None
    assert "changed the scale" in unfaithful(c, m)  # 0.05 in float32 is not float16's 0.05


def test_two_qdq_pairs_in_a_row_stay_two(tmp_path):
    """The stop-42 review's case: ``session.disable_quant_qdq`` alone leaves ORT's
    DoubleQDQPairsRemover on, which drops one of two Q/DQ pairs in a row (scales 0.013 then
    0.031) and moves outputs by several steps; the reference also sets
    ``session.disable_double_qdq_remover`` and computes the unoptimised graph's outputs."""
    path = _save(_conv_qdq(double=True), tmp_path / "q.onnx")
    feed = _x()
    with OrtRunner(path, opt_level="disable") as r:
        plain = r.infer(feed)["y"]
    with OrtRunner(path, session_config={"session.disable_quant_qdq": "1"},
                   disabled_optimizers=["WeightBiasQuantization"]) as r:
        one_pair = r.infer(feed)["y"]
    runner, how = qdq_reference_runner(path)
    with runner:
        ref = runner.infer(feed)["y"]
    assert how["reference"] == "qdq_rewrites_off"
    assert np.abs(one_pair - plain).max() > 0.1
    np.testing.assert_allclose(ref, plain, rtol=0, atol=1e-5)
