"""deploykit.quant.auto.search: the accuracy budget, the cache, and the search on small Q/DQ
chains (NaN outputs, every output judged, reruns, too small a tuning split)."""

from __future__ import annotations

import numpy as np
import pytest

import deploykit.quant.auto.search as auto_search
from deploykit.errors import UsageError
from deploykit.evaluate import EvalData
from deploykit.quant.auto.report import render_markdown
from deploykit.quant.auto.search import (
    anchored, Budget, budget_warnings, Cache, data_digest, fmt_metrics, MODE, output_metrics,
    run_model, search,
)
from deploykit.quant.auto.space import QdqSpace
from deploykit.tools import auto_precision as auto_precision_cli
from deploykit.tools.auto_precision import budget_from_args

from tests.helpers.auto_models import _chain_qdq, _qdq


def test_budget_and_its_flags():
    ref = np.eye(4, dtype=np.float32)[[0, 1, 2, 3] * 50]
    out = ref.copy()
    out[0] = [0, 1, 0, 0]  # one flip in 200
    m = output_metrics(ref, out, np.zeros(200, np.int64))
    assert m["agreement"] == 99.5 and m["flips"] == 1
    assert Budget(99.5, None).met(m) and not Budget(99.6, None).met(m)
    assert "cosine" in Budget(None, 0.999).misses(m)[0]
    parser = auto_precision_cli.get_args_parser()
    args = parser.parse_args(["search", "--min-agreement", "off", "--min-cosine", "0.99"])
    assert budget_from_args(args) == Budget(None, 0.99, None)
    for bad, msg in ((["--min-cosine", "2"], "cosine similarity lies in"),
                     (["--min-agreement", "off", "--min-cosine", "off"], "every budget bound")):
        with pytest.raises(UsageError, match=msg):
            budget_from_args(parser.parse_args(["search", *bad]))


def test_cache_key_covers_every_input(tmp_path):
    fields = {"fp32": "a", "qdq": "b", "calib": "c", "tune": "d", "mode": MODE}
    c = Cache(tmp_path, fields)
    c.put({"n1"}, {"cosine_mean": 0.5})
    assert Cache(tmp_path, fields).get({"n1"}) == {"cosine_mean": 0.5}
    for k in fields:
        other = Cache(tmp_path, {**fields, k: "changed"})
        assert other.path != c.path and other.get({"n1"}) is None


def test_search_in_process_rerun_with_another_budget_runs_no_per_node_measurement(
        tmp_path, monkeypatch):
    fp32, q = _chain_qdq()
    space = QdqSpace(q, fp32)
    assert space.names == ["a", "dw", "fc"]
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (16, 3, 16, 16)).astype(np.float32)})
    ref = run_model(fp32, data)
    runs = []
    real = run_model
    fake = lambda m, *a, **k: runs.append(1) or real(m, *a, **k)  # noqa: E731
    monkeypatch.setattr(auto_search, "run_model", fake)
    monkeypatch.setattr(auto_precision_cli, "run_model", fake)
    fields = {"fp32": "f", "qdq": "q", "calib": None, "tune": data_digest(data),
              "mode": MODE}
    first = search(space, data, ref, Budget(None, 0.99999), Cache(tmp_path, fields))
    n_first = len(runs)
    assert n_first == first["evaluations"]["run"] >= 2 + 2 * 3
    assert len(first["path"]) == 4 and first["path"][0]["metrics"] == first["full_int8"]
    cache = Cache(tmp_path, fields)
    second = search(space, data, ref, Budget(None, 0.999), cache)
    new = len(runs) - n_first
    # per-node measurements and the path come from the cache; only pruning trials may be new
    assert new == second["evaluations"]["run"] == cache.misses <= len(second["steps"])
    assert second["evaluations"]["cached"] >= 2 + 2 * 3
    assert [p["metrics"] for p in second["path"]] == [p["metrics"] for p in first["path"]]
    before = len(runs)
    third = search(space, data, ref, Budget(None, 0.9999), Cache(tmp_path, fields),
                      prune=False)
    assert len(runs) == before and third["evaluations"]["run"] == 0  # --no-prune: nothing new
    assert third["excluded"] == sorted(third["order"][:third["path_choice"]],
                                       key=space.names.index)
    assert [r["int8_alone"] for r in first["candidates"]] == \
        [r["int8_alone"] for r in second["candidates"]]
    # deterministic: the same inputs give the same choice
    again = search(space, data, ref, Budget(None, 0.999), Cache(tmp_path, fields))
    assert again["excluded"] == second["excluded"] and again["order"] == second["order"]


def test_nan_outputs_miss_the_budget_and_the_node_that_makes_them_stays_float(tmp_path):
    """A configuration whose outputs are NaN must never meet a budget (NaN < bound is False),
    and the node that makes them ranks as the most sensitive (it used to score 0)."""
    fp32, q = _chain_qdq()
    for t in q.graph.initializer:  # fc's weight scale inf: 0 * inf = NaN in DequantizeLinear
        if t.name == "wfc_scale":
            from onnx import numpy_helper
            t.CopyFrom(numpy_helper.from_array(np.full(10, np.inf, np.float32), t.name))
    space = QdqSpace(q, fp32)
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (8, 3, 16, 16)).astype(np.float32)})
    ref = run_model(fp32, data)
    full = output_metrics(ref, run_model(space.model(()), data))
    assert full["nonfinite"] == 8 and full["cosine_mean"] is None and full["agreement"] == 0
    for budget in (Budget(None, 0.9), Budget(50, None), Budget(None, None, 1.0)):
        assert not budget.met(full)
        assert any("8 of 8 samples give NaN/Inf outputs" in m for m in budget.misses(full))
    res = search(space, data, ref, Budget(None, 0.99), Cache(tmp_path, {"k": 1}))
    assert res["order"][0] == "fc" and "fc" in res["excluded"] and res["budget_met"]
    assert "undefined" in fmt_metrics(full) and "8 sample(s) NaN/Inf" in fmt_metrics(full)
    # the cache round trip (JSON: NaN is written as null) gives the same verdict
    again = search(space, data, ref, Budget(None, 0.99), Cache(tmp_path, {"k": 1}))
    assert again["excluded"] == res["excluded"] and again["evaluations"]["run"] == 0
    render_markdown({**res, "model": "m", "budget": {"min_cosine": 0.99},
                        "budget_text": "b", "semantics": "s", "tuning": {"source": "t", "n": 8},
                        "base": {"command": "c"}, "search": {"evaluations": res["evaluations"],
                                                             "wall_s": 0, "machine": "x"},
                        "exclude_regexes": anchored(res["excluded"]),
                        "outputs": {"png": str(tmp_path / "p.png")}})


def _two_outputs():
    """x -> Conv a -> GAP -> Flatten f -> Gemm fc -> y (logits), and f -> Gemm aux -> z (a
    second output); a and aux quantized, aux's weight so coarsely that z is ruined."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = {"wa": (8, 3, 3, 3), "wfc": (10, 8), "waux": (3, 8)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in w.items()]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="a", pads=[1] * 4),
             helper.make_node("GlobalAveragePool", ["a"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wfc"], ["y"], name="fc", transB=1),
             helper.make_node("Gemm", ["f", "waux"], ["z"], name="aux", transB=1)]
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("x", ["batch", 3, 16, 16])],
                          [vi("y", ["batch", 10]), vi("z", ["batch", 3])], inits)
    fp32 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    fp32.ir_version = 9
    q = type(fp32)()
    q.CopyFrom(fp32)
    _qdq(q, "x", 4.0 / 127)
    _qdq(q, "wa", np.full(8, 0.005), axis=0)
    _qdq(q, "waux", np.full(3, 0.5), axis=0)  # weights ~N(0, 0.3) -> {-1, 0, 1} x 0.5
    _qdq(q, "f", 0.01)
    return fp32, q


def test_every_output_is_judged_not_only_the_first(tmp_path):
    """A node that only feeds a second output must count (the search used to read the first
    output only, so ruining the second one met any budget)."""
    fp32, q = _two_outputs()
    space = QdqSpace(q, fp32)
    assert space.names == ["a", "fc", "aux"]  # fc: its input is quantized
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (16, 3, 16, 16)).astype(np.float32)})
    ref = run_model(fp32, data)
    assert list(ref) == ["y", "z"]
    full = output_metrics(ref, run_model(space.model(()), data))
    assert full["outputs"]["y"]["cosine_mean"] > 0.99 > full["outputs"]["z"]["cosine_mean"]
    assert full["cosine_mean"] == full["outputs"]["z"]["cosine_mean"]
    res = search(space, data, ref, Budget(None, 0.99), Cache(tmp_path, {"k": 2}))
    assert "aux" in res["excluded"] and "a" not in res["excluded"] and res["budget_met"]


def test_a_tuning_split_too_small_for_the_agreement_budget_is_named():
    """With 18 tuning images one flip is 5.6 points: a 99.5 % agreement budget then means
    "no flip", met by chance on 1-3 images; the search says so (and records it)."""
    (w,) = budget_warnings(Budget(99.5, 0.999), 18)
    assert "18 sample(s)" in w and "5.56 points" in w and ">= 200 samples" in w
    assert budget_warnings(Budget(99.5, 0.999), 200) == []
    assert budget_warnings(Budget(None, 0.999), 1) == []  # no agreement bound
    assert budget_warnings(Budget(90, None), 10) == []    # one flip of 10 = 90 %: ok
    assert len(budget_warnings(Budget(90, None), 9)) == 1
