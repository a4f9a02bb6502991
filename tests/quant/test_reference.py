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
    monkeypatch.setattr(reference, "unfaithful", lambda *a: "a reason")
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

    def rewire(g):  # a float op folded into the quantizer: it reads another tensor
        for n in g.node:
            if n.output[0] == "rq":
                n.input[0] = "c"
    assert "from c, not r" in unfaithful(m, edit(rewire))

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


def test_a_cast_scale_is_read_as_the_constant_it_is():
    """A scale made by a Cast of a constant (float64 to float32) in one graph and folded into an
    initializer in the other is the same value, not a change; a different value is one. FP16
    constants send the graph to the unoptimised run before any of this (ORT folds them in
    FP16)."""
    m = _conv_qdq()

    def with_scale(node_cast: bool, value):
        c = type(m)()
        c.CopyFrom(m)
        for t in c.graph.initializer:
            if t.name == "sy":
                t.CopyFrom(numpy_helper.from_array(np.asarray(value), "sy64" if node_cast
                                                   else "sy"))
        if node_cast:
            c.graph.node.insert(0, helper.make_node("Cast", ["sy64"], ["sy"],
                                                    to=TensorProto.FLOAT))
        return c

    cast = with_scale(True, np.float64(0.05))
    assert unfaithful(cast, with_scale(False, np.float32(0.05))) is None
    assert "changed the scale" in unfaithful(cast, with_scale(False, np.float32(0.051)))
    half = with_scale(False, np.float16(0.05))
    assert "FP16/BF16 constants (sy" in unfaithful(half, half)


@pytest.mark.parametrize("lo, zp, scale, redundant", [
    (0.0, -128, 0.02, True),     # Relu before int8 [-128, 127] from 0: drops nothing
    (0.0, 0, 0.02, False),       # zero point 0: Relu clamps half the range
    (0.0, -128, -0.02, False),   # negative scale: the Relu's 0 is the top of the range
    (-1.0, 0, 0.02, False)])     # a Clip whose lower bound is inside the range
def test_a_clamp_before_a_quantizer_is_redundant_only_where_it_changes_no_value(
        lo, zp, scale, redundant):
    """_clamp_redundant: a Relu/Clip folded into the QuantizeLinear after it is accepted only
    when its bounds quantize to the ends of the integer range, compared with ONNX's rounding."""
    q = helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"])
    clamp = (helper.make_node("Relu", ["x"], ["r"]) if lo == 0.0 else
             helper.make_node("Clip", ["x", "lo"], ["r"]))
    g = helper.make_graph([clamp, q], "g", [], [], [
        numpy_helper.from_array(np.array(scale, np.float32), "s"),
        numpy_helper.from_array(np.array(zp, np.int8), "z"),
        numpy_helper.from_array(np.array(lo, np.float32), "lo")])
    assert reference._clamp_redundant(clamp, "x", q, reference._Values(g)) is redundant


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


def test_a_relu_folded_into_a_quantizer_is_seen_and_the_graph_runs_unoptimised(tmp_path):
    """The stop-45 review's case: ORT's ReluQuantFusion drops a Relu in front of a
    QuantizeLinear with a negative scale (zero point -128), changing every negative input by
    up to 150 steps, and the Q/DQ session keys leave it on. The node check sees the
    QuantizeLinear read the Relu's input, so the reference runs unoptimised and computes the
    graph's numerics, while ORT's own run does not."""
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])], "g",
        [helper.make_tensor_value_info("x", 1, [4, 4, 8, 8])],
        [helper.make_tensor_value_info("y", 1, None)],
        [numpy_helper.from_array(np.array(-0.02, np.float32), "s"),
         numpy_helper.from_array(np.array(-128, np.int8), "z")])
    path = _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                 tmp_path / "relu_q.onnx")
    x = {"x": np.random.default_rng(0).uniform(-3, 3, (4, 4, 8, 8)).astype(np.float32)}
    runner, how = qdq_reference_runner(path)
    assert how["reference"] == "unoptimised" and "not r" in how["why"]
    with runner:
        ref = runner.infer(x)["y"]
    with OrtRunner(path, opt_level="disable") as r:
        plain = r.infer(x)["y"]
    with OrtRunner(path, session_config=reference.QDQ_REWRITES_OFF,
                   disabled_optimizers=reference.QDQ_OPTIMIZERS_OFF) as r:
        fused = r.infer(x)["y"]
    assert ref.tobytes() == plain.tobytes()
    assert np.abs(fused - plain).max() > 1.0  # the rewrite is real: the check is needed


def test_fp16_constants_run_unoptimised(tmp_path):
    """A Q/DQ graph with FP16 weights and scales: ORT would fold the weight's
    DequantizeLinear in FP16 where its unoptimised run casts to FP32 first, so the reference is
    the unoptimised run, and says why."""
    rng = np.random.default_rng(0)
    inits = {"wq": rng.integers(-127, 128, (4, 4, 3, 3)).astype(np.int8),
             "ws": np.full(4, 0.013, np.float16), "wz": np.zeros(4, np.int8)}
    nodes = [helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
             helper.make_node("Conv", ["xh", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Cast", ["c"], ["y"], to=TensorProto.FLOAT)]
    path = _save(_graph(nodes, inits), tmp_path / "fp16.onnx")
    runner, how = qdq_reference_runner(path)
    assert how["reference"] == "unoptimised" and "FP16/BF16 constants (ws" in how["why"]
    assert runner.opt_level == "disable"


def test_a_model_with_external_data_takes_the_fast_path(tmp_path):
    """A Q/DQ model saved with its initializers in an external file: the graphs ORT writes
    keep theirs beside them, the check reads only the Q/DQ scales, and the fast reference gives
    the unoptimised run's outputs (no temporary folder left behind)."""
    import glob
    import onnx

    path = tmp_path / "ext.onnx"
    onnx.save(_conv_qdq(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    before = set(glob.glob("/tmp/qdq-reference-*"))
    runner, how = qdq_reference_runner(path)
    assert how == {"reference": "qdq_rewrites_off", "why": None}
    assert set(glob.glob("/tmp/qdq-reference-*")) == before
    feed = _x()
    with runner:
        ref = runner.infer(feed)["y"]
    with OrtRunner(path, opt_level="disable") as r:
        np.testing.assert_allclose(ref, r.infer(feed)["y"], rtol=0, atol=1e-5)


def test_a_layernorm_pattern_ort_fuses_runs_unoptimised(tmp_path):
    """The stop-45 review's case: ORT fuses the explicit LayerNorm pattern into
    LayerNormalization, whose variance on ill-conditioned rows (mean 300, spread 0.01) moves
    int8 values after it by a step far more often than reordering does: such a graph runs
    unoptimised, and says so."""
    d = 64
    inits = {"ax": np.array([-1], np.int64), "two": np.array(2, np.float32),
             "eps": np.array(1e-5, np.float32), "g": np.ones(d, np.float32),
             "b": np.zeros(d, np.float32), "s": np.array(0.02, np.float32),
             "z": np.array(0, np.int8)}
    nodes = [helper.make_node("ReduceMean", ["x", "ax"], ["mu"]),
             helper.make_node("Sub", ["x", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]),
             helper.make_node("ReduceMean", ["d2", "ax"], ["var"]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]),
             helper.make_node("Mul", ["n", "g"], ["ng"]),
             helper.make_node("Add", ["ng", "b"], ["l"]),
             helper.make_node("QuantizeLinear", ["l", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [32, 16, d])],
                          [helper.make_tensor_value_info("y", 1, None)],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]),
                 tmp_path / "ln.onnx")
    runner, how = qdq_reference_runner(path)
    assert how["reference"] == "unoptimised" and "LayerNormalization" in how["why"]
    x = {"x": (300 + 0.01 * np.random.default_rng(0).standard_normal((32, 16, d))).astype(
        np.float32)}
    with runner, OrtRunner(path, opt_level="disable") as plain:
        assert runner.infer(x)["y"].tobytes() == plain.infer(x)["y"].tobytes()
