"""deploykit.compare: top-k accuracy, parity, the one comparator (output matching, per-output
comparison) and the tables every check reads; the export and mixed-precision checks are views
of it."""
from __future__ import annotations

import numpy as np
import pytest
from deploykit.compare import parity, topk_accuracy
from deploykit.errors import StageError
from deploykit.checks.base import output_problems
from deploykit.compare import (
    OUTPUT_MIN_COSINE,
    TOLERANCES,
    compare,
    match_outputs,
)
from deploykit.quant.auto.search import output_metrics


# ----------------------------------------------------------------------------- metrics
def test_topk_accuracy_by_hand():
    logits = np.array([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0],
                       [0.8, 0.1, 0.05, 0.03, 0.02, 0.0],
                       [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]], np.float32)
    labels = np.array([1, 1, 0])
    acc = topk_accuracy(logits, labels)
    assert acc["top1"] == pytest.approx(100 / 3)
    assert acc["top5"] == pytest.approx(200 / 3)  # row 3: label 0 ranks 6th


def test_parity_detects_disagreement():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 1000)).astype(np.float32)
    same = parity(a, a.copy())
    assert same["cosine_min"] == pytest.approx(1.0) and same["top1_agreement"] == 100.0
    b = a.copy()
    b[3] = -b[3]
    bad = parity(a, b)
    assert bad["cosine_min"] == pytest.approx(-1.0) and bad["top1_agreement"] == 87.5
    with pytest.raises(StageError):
        parity(a, a[:4])


def test_outputs_match_by_name_then_by_index():
    """Polygraphy's rule: names first; an unmatched reference output takes the output at its
    index unless that output is another reference output's name match."""
    assert match_outputs(["a", "b"], ["b", "a"]) == [("a", "a", "name"), ("b", "b", "name")]
    assert match_outputs(["logits"], ["output"]) == [("logits", "output", "index")]
    # "x" sits at index 0 of the other run but belongs to the reference output "x"
    assert match_outputs(["y", "x"], ["x", "z"]) == [("y", None, None), ("x", "x", "name")]
    assert match_outputs(["a", "b"], ["o0"]) == [("a", "o0", "index"), ("b", None, None)]


def test_compare_statuses():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(4, 10)).astype(np.float32)
    bad = r.copy()
    bad[2, 3] = np.nan
    ref = {"logits": r, "idx": np.arange(4), "shape": r, "nan": r, "gone": r}
    out = {"logits": r + 1e-7, "idx": np.arange(4)[::-1], "shape": r[:, :5], "nan": bad}
    by = {d.ref_name: d for d in compare(ref, out)}
    assert by["logits"].status == "compared" and by["logits"].parity["cosine_min"] > 0.9999999
    assert by["idx"].status == "integer_differs" and by["idx"].integer
    assert by["shape"].status == "shape" and by["shape"].shape_out == (4, 5)
    assert by["nan"].status == "nonfinite" and by["nan"].nonfinite == 1
    assert by["nan"].nonfinite_rows.tolist() == [False, False, True, False]
    assert by["gone"].status == "missing" and by["gone"].out_name is None


def test_export_check_view_names_each_problem():
    r = np.eye(3, dtype=np.float32)
    flipped = r[::-1].copy()
    assert output_problems({"output_0": r}, {"logits": r}, 0.99999) == []
    (p,) = output_problems({"output_0": r}, {"logits": flipped}, 0.99999)
    assert "output logits differs from PyTorch" in p and "cosine min 0.000000" in p
    p = output_problems({"a": r, "b": r}, {"a": r}, 0.99999)
    assert p == ["the file has 1 outputs, PyTorch 2"]


def test_mixed_precision_view_keeps_its_strict_name_rule():
    r = np.eye(3, dtype=np.float32)
    with pytest.raises(StageError, match="differ from the FP32 model's"):
        output_metrics({"a": r}, {"b": r})
    with pytest.raises(StageError, match="shape"):
        output_metrics({"a": r}, {"a": r[:, :2]})
    m = output_metrics({"a": r}, {"a": r})
    assert m["agreement"] == 100.0 and m["cosine_min"] == pytest.approx(1.0)


def test_cli_defaults_and_backend_checks_read_the_tables():
    """The literals that were spread over the CLIs now come from one place."""
    import importlib

    stage2 = importlib.import_module("2_export_onnx").get_args_parser()
    args = stage2.parse_args([])
    assert args.min_cosine_fp32 == OUTPUT_MIN_COSINE["fp32"]
    assert args.min_cosine_fp16 == OUTPUT_MIN_COSINE["fp16"] == TOLERANCES["fp16"]["min_cosine"]
    from deploykit.tools.export_checks import get_args_parser

    check = get_args_parser().parse_args(["check", "--onnx", "x.onnx"])
    assert check.min_cosine == OUTPUT_MIN_COSINE["fp32"]


# --------------------------------------------------------------------------------------------
# The verdict of a results row (ROW_TOLERANCES)
# --------------------------------------------------------------------------------------------
def test_row_tolerances_keep_the_existing_gates_and_order_the_bands():
    from deploykit.compare import OUTPUT_MIN_COSINE, ROW_TOLERANCES, TOLERANCES

    assert ROW_TOLERANCES["fp32"]["cosine_min"]["ok"] == OUTPUT_MIN_COSINE["fp32"]
    assert ROW_TOLERANCES["fp16"]["cosine_min"]["ok"] == OUTPUT_MIN_COSINE["fp16"]
    assert ROW_TOLERANCES["int8"]["cosine_mean"]["ok"] == TOLERANCES["int8"]["min_cosine"]
    assert ROW_TOLERANCES["int4"]["cosine_min"]["ok"] == TOLERANCES["int4"]["min_cosine"]
    for band in ROW_TOLERANCES.values():
        for b in band.values():
            if b["ok"] is not None and b["failed"] is not None:
                assert b["failed"] < b["ok"]
    # FP32 tightest, then FP16, then the quantized bands
    order = ["fp32", "fp16", "int8"]
    for m in ("top1_agreement",):
        oks = [ROW_TOLERANCES[p][m]["ok"] for p in order]
        assert oks == sorted(oks, reverse=True)
    assert ROW_TOLERANCES["fp32"]["cosine_min"]["ok"] > ROW_TOLERANCES["fp16"]["cosine_min"]["ok"] \
        > ROW_TOLERANCES["int8"]["cosine_min"]["ok"] - 1e-12


@pytest.mark.parametrize("precision, par, status, named", [
    # the user's reports: BGR fed RGB, bit-flipped classifier weights, an extra first output
    ("FP32", {"cosine_min": 0.42, "cosine_mean": 0.93, "top1_agreement": 79.7}, "failed",
     "cosine_min 0.42 < 0.99 (FP32 failed bound)"),
    ("FP32", {"cosine_min": 0.18, "cosine_mean": 0.3, "top1_agreement": 0.0,
              "max_abs_err": 2e38}, "failed", "top1_agreement 0.0 % < 95.0 %"),
    ("FP32", {"cosine_min": -1.0, "cosine_mean": -1.0}, "failed", "cosine_mean -1"),
    # measured healthy rows of efficientnet_lite0 (results/gpu, results/auto_precision)
    ("FP32", {"cosine_min": 0.999996, "cosine_mean": 0.999999, "top1_agreement": 100.0}, "ok",
     None),
    ("FP16", {"cosine_min": 0.999931, "cosine_mean": 0.999988, "top1_agreement": 99.56}, "ok",
     None),
    ("INT8", {"cosine_min": 0.968502, "cosine_mean": 0.996319, "top1_agreement": 98.56}, "ok",
     None),
    ("INT4", {"cosine_min": 0.994279, "cosine_mean": 0.996209, "top1_agreement": 98.56}, "ok",
     None),
    # the committed collapses
    ("INT8", {"cosine_min": -0.145, "cosine_mean": 0.069, "top1_agreement": 0.89}, "failed",
     "top1_agreement 0.9 % < 90.0 % (INT8 failed bound)"),
    ("INT8", {"cosine_min": 0.146, "cosine_mean": 0.704, "top1_agreement": 66.2}, "failed",
     "cosine_mean 0.704 < 0.9"),
    # the warn band: one outlier image, a few flips
    ("INT8", {"cosine_min": 0.93, "cosine_mean": 0.995, "top1_agreement": 97.0}, "warn",
     "cosine_min 0.93 < 0.95 (INT8 ok bound)"),
    ("FP16", {"cosine_min": 0.9995, "cosine_mean": 0.9999, "top1_agreement": 93.0}, "warn",
     "top1_agreement 93.0 % < 98.0 % (FP16 ok bound)"),
    ("unknown", {"cosine_min": 0.5, "cosine_mean": 0.6, "top1_agreement": 50.0}, "failed",
     "(INT4 failed bound)"),
])
def test_row_verdict(precision, par, status, named):
    from deploykit.compare import row_verdict

    v = row_verdict(precision, {"logits": par})
    assert v["status"] == status, v
    if named is None:
        assert v["status_reason"] is None
    else:
        assert named in v["status_reason"] and v["status_reason"].startswith("logits ")


def test_row_verdict_fails_on_nonfinite_outputs_and_judges_every_output():
    from deploykit.compare import row_verdict

    good = {"cosine_min": 1.0, "cosine_mean": 1.0}
    v = row_verdict("FP16", {"y": good}, {"y": 20})
    assert v["status"] == "failed" and "y: 20 NaN/Inf" in v["status_reason"]
    v = row_verdict("FP32", {"a": good, "b": {"cosine_min": float("nan"), "cosine_mean": 1.0}})
    assert v["status"] == "failed" and "b cosine_min nan (not finite)" in v["status_reason"]
    assert row_verdict("FP32", None)["status"] == "ok"


def test_an_old_row_saying_ok_against_its_own_parity_is_rejudged_failed():
    """The committed GPU rows (written before a row's status followed parity) said ok at 0.1 %
    agreement; the report judges every row it reads by its parity."""
    from deploykit.compare import rejudge_row

    bad = {"status": "ok", "precision": "INT8", "status_reason": "ok; BACKEND DISAGREEMENT",
           "parity": {"cosine_mean": 0.03, "cosine_min": -0.2, "top1_agreement": 0.1}}
    r = rejudge_row(dict(bad))
    assert r["status"] == "failed"
    assert r["status_reason"].startswith("output cosine_mean 0.03 < 0.9 (INT8 failed bound)")
    assert "re-judged by the report from the row's parity: the row says ok" in r["status_reason"]
    assert r["status_reason"].endswith("; ok; BACKEND DISAGREEMENT")
    good = dict(bad, parity={"cosine_mean": 0.9999, "cosine_min": 0.999, "top1_agreement": 99.9})
    assert rejudge_row(dict(good))["status"] == "ok"
    skipped = dict(bad, status="skipped")  # only ok/warn rows are re-judged, never made better
    assert rejudge_row(dict(skipped))["status"] == "skipped"
    failed = dict(good, status="failed")
    assert rejudge_row(dict(failed))["status"] == "failed"


# --------------------------------------------------------------------------------------------
# TensorStat: float64 statistics a block at a time
# --------------------------------------------------------------------------------------------
def _whole_tensor_stats(a, b, n_batch):
    """The statistics of one pass over whole float64 copies (TensorStat's former arithmetic)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    rows = a64.reshape(len(a64), -1) if a64.ndim >= 2 and len(a64) == n_batch else \
        a64.reshape(1, -1)
    rows_b = b64.reshape(rows.shape)
    na, nb = np.sqrt((rows * rows).sum(1)), np.sqrt((rows_b * rows_b).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((na == 0) & (nb == 0), 1.0, (rows * rows_b).sum(1) / np.maximum(na * nb, 1e-300))
    err = np.abs(a64 - b64)
    return cos, float(np.max(err)), float(np.sum(err)), float(np.max(np.abs(a64)))


@pytest.mark.parametrize("block", [5, 64, 1 << 18])  # inside a channel, whole channels, rows
@pytest.mark.parametrize("shape,n_batch", [((3, 4, 5, 6), 3), ((2, 7), 2), ((11,), 4),
                                           ((4, 3, 1), 4), ((1, 2, 9, 9), 1)])
def test_tensor_stat_blocks_give_the_whole_tensor_figures(monkeypatch, block, shape, n_batch):
    import deploykit.compare as compare

    monkeypatch.setattr(compare, "STAT_BLOCK", block)
    rng = np.random.default_rng(sum(shape) + block)
    a = rng.standard_normal(shape).astype(np.float32)
    b = (a + 0.05 * rng.standard_normal(shape)).astype(np.float16)  # a float16 run too
    st = compare.TensorStat()
    st.update(a, b, n_batch, channels=True)
    cos, emax, esum, amax = _whole_tensor_stats(a, b, n_batch)
    np.testing.assert_allclose(st.cosines, cos, rtol=1e-12)
    assert st.max_abs_err == emax and st.ref_abs_max == amax  # maxima are exact
    assert st.sum_abs_err == pytest.approx(esum, rel=1e-12) and st.count == a.size
    if len(shape) >= 2 and shape[0] == n_batch:  # per channel (axis 1), over samples and positions
        fa = a.astype(np.float64).reshape(shape[0], shape[1], -1)
        fb = b.astype(np.float64).reshape(fa.shape)
        want = np.stack([np.einsum("ncp,ncp->c", fa, fb), np.einsum("ncp,ncp->c", fa, fa),
                         np.einsum("ncp,ncp->c", fb, fb)])
        np.testing.assert_allclose(st.channel_sums, want, rtol=1e-12)
    else:
        assert st.channel_sums is None


def test_tensor_stat_accumulates_chunks_and_keeps_nonfinite_rules(monkeypatch):
    import deploykit.compare as compare

    monkeypatch.setattr(compare, "STAT_BLOCK", 8)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    b = a.copy()
    b[1, 0, 0, 0] = np.nan  # one NaN where the reference is finite
    b[3, 1, 2, 2] = np.inf
    st = compare.TensorStat()
    st.update(a[:2], b[:2], 2, channels=True)
    st.update(a[2:], b[2:], 2, channels=True)
    assert len(st.cosines) == 4 and st.nonfinite_b == 2 and st.nonfinite_a == 0
    assert np.isnan(st.cosines[1]) and np.isnan(st.cosines[3])
    assert st.cosines[0] == pytest.approx(1.0) and st.cosines[2] == pytest.approx(1.0)
    # a NaN in a chunk leaves the running maximum as it was (Python's max keeps the first of
    # 0.0 and nan), as one pass over that whole chunk did; the Inf of the next chunk is kept;
    # the sum becomes NaN
    assert st.max_abs_err == np.inf and np.isnan(st.sum_abs_err)
    res = st.result({"min_cosine": 0.99, "atol": 1e-3, "rtol": 1e-3})
    assert res["status"] == "fail" and res["nonfinite_b"] == 2
    assert st.channel_sums.shape == (3, 2)
