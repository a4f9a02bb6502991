"""deploykit.quant.cross_check: the adaptive backend cross-check."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.evaluate import EvalData, run_outputs
import deploykit.quant.cross_check as cross_check
from deploykit.quant.cross_check import (CROSS_CHECK_AGREE_LOOK, CROSS_CHECK_PEEK,
                                         agreement_beyond_doubt, backend_cross_check,
                                         cross_check_looks, disagreement_beyond_doubt,
                                         marked_bounds)
from deploykit.runners import OrtRunner

from tests.helpers.auto_models import _save


def _qdq_classifier(w_scale, path):
    """x [N,3,4,4] -> Q/DQ -> Conv 1x1 (2 classes, int8 weights, per-channel ``w_scale``,
    bias [5, 3]) -> Clip(0, 6) -> Q/DQ -> ReduceMean over H, W -> logits [N, 2]."""
    from onnx import helper, numpy_helper

    ws = np.asarray(w_scale, np.float32)
    inits = [numpy_helper.from_array(x, n) for x, n in (
        (np.array([5.0, 3.0], np.float32), "b"), (np.array(0, np.float32), "lo"),
        (np.array(6, np.float32), "hi"), (np.array(0.01, np.float32), "xs"),
        (np.array(128, np.uint8), "xz"), (np.full((2, 3, 1, 1), 10, np.int8), "wq"), (ws, "ws"),
        (np.zeros(2, np.int8), "wz"), (np.array(6 / 255, np.float32), "ys"),
        (np.array(0, np.uint8), "yz"), (np.array([2, 3], np.int64), "axes"))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="xdq"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0, name="wdq"),
             helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv"),
             helper.make_node("Clip", ["c", "lo", "hi"], ["cc"], name="clip"),
             helper.make_node("QuantizeLinear", ["cc", "ys", "yz"], ["yq"], name="yq"),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="ydq"),
             helper.make_node("ReduceMean", ["y", "axes"], ["logits"], keepdims=0, name="gap")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 3, 4, 4])],
                          [helper.make_tensor_value_info("logits", 1, ["N", 2])], inits)
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9),
                 path)


@pytest.mark.parametrize("broken", [True, False])
def test_adaptive_cross_check_stops_on_a_verdict_beyond_doubt(broken, tmp_path):
    """Classifier cross-check (stage 3's) on ORT: a backend disagreement (WeightBiasQuantization
    on a tiny weight channel under a large bias) is beyond doubt on a random 32 of 600 samples
    (no rerun of the rest); a model the backend runs faithfully agrees beyond doubt only on the
    512-sample look (none of 512 right in one run only: at most 1.8 % of 600 can be);
    ``n=200`` measures a seeded random 200."""
    q = _qdq_classifier([1e-12, 0.01] if broken else [0.01, 0.01], tmp_path / "q.onnx")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (600, 3, 4, 4), dtype=np.uint8)
    data = EvalData(x_u8=x, y=np.zeros(600, np.int64), files=[str(i) for i in range(600)],
                    mean=(0.5,) * 3, std=(0.5,) * 3, input_name="x")
    with OrtRunner(q, opt_level="disable") as r:  # labels: the graph's own answer
        data.y = run_outputs(r, data, 64)["logits"].argmax(1)
    with OrtRunner(q) as r:
        main = run_outputs(r, data, 64)
    cc = backend_cross_check(q, data, main, batch=64)
    assert cc["adaptive"] and cc["disagreement"] is broken
    # the reference: ORT's default level with its Q/DQ rewrites off, checked node by node
    assert cc["reference"] == "qdq_rewrites_off" and cc["reference_why"] is None
    assert cc["n"] == (CROSS_CHECK_PEEK if broken else CROSS_CHECK_AGREE_LOOK)
    assert cc["decided_on_first_look"] and cc["sample"] == {"seed": 0, "n": cc["n"]}
    assert cc["decided"] == ("disagreement" if broken else "agreement")
    if broken:
        assert cc["top1_unoptimized"] == 100.0 and cc["top1_main"] < 90
        assert "32 of 600 images, a seeded random sample, a disagreement beyond doubt" in cc["reason"]
        exact = backend_cross_check(q, data, main, n=200, batch=64)
        assert exact["n"] == 200 and not exact["adaptive"] and exact["disagreement"]
        assert exact["sample"] == {"seed": 0, "n": 200} and not exact["decided_on_first_look"]
        assert "(200 of 600 images, a seeded random sample)" in exact["reason"]
    else:
        assert cc["top1_agreement"] == 100.0
        assert "512 of 600 images, a seeded random sample, agreement beyond doubt" in cc["reason"]


def _fake_backend(monkeypatch, unoptimized: np.ndarray, x64: np.ndarray | None = None
                  ) -> list[int]:
    """Make the cross-check's unoptimised runs return rows of ``unoptimized`` [N, C] (looked up
    by the samples' file names, their indices), and its runs with a session config rows of
    ``x64``; returns the list that counts the samples run unoptimised."""
    ran: list[int] = []

    class _Runner:
        def __init__(self, *a, **kw):
            self.kw = kw

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def close(self):
            pass

    def fake_run_outputs(runner, sub, batch, progress=None):
        idx = [int(f) for f in sub.files]
        if runner.kw.get("session_config"):
            return {"logits": x64[idx]}
        ran.extend(idx)
        return {"logits": unoptimized[idx]}

    monkeypatch.setattr(cross_check, "OrtRunner", _Runner)
    monkeypatch.setattr(cross_check, "qdq_reference_runner", lambda path, **kw: (
        _Runner(), {"reference": "qdq_rewrites_off", "why": None}))
    monkeypatch.setattr(cross_check, "run_outputs", fake_run_outputs)
    return ran


def _sorted_split(n: int = 900, classes: int = 10):
    """A split ordered by class, as the sample's eval split is: labels [n], one-hot logits."""
    y = np.repeat(np.arange(classes), n // classes)
    return y, np.eye(classes, dtype=np.float32)[y] * 5


def test_a_fault_on_later_classes_is_not_missed(monkeypatch):
    """A backend fault on the last third of a split sorted by class (66.7 % against 100 % on
    all of it) must be a disagreement: the first 128 images of the split agree exactly, so a
    look at them would pass it; the seeded random looks do not."""
    y, right = _sorted_split()
    main = right.copy()
    main[600:] = np.roll(main[600:], 1, axis=1)  # the optimised run wrong on classes 6..9
    ran = _fake_backend(monkeypatch, right)
    data = EvalData(x_u8=np.zeros((900, 3, 2, 2), np.uint8), y=y,
                    files=[str(i) for i in range(900)], mean=(0.5,) * 3, std=(0.5,) * 3,
                    input_name="x")
    cc = backend_cross_check("fake.onnx", data, {"logits": main})
    assert cc["disagreement"] and cc["decided_on_first_look"]
    assert cc["n"] in (32, 128) and len(ran) == cc["n"] and max(ran) >= 600
    assert cc["top1_unoptimized"] == 100.0 and cc["top1_main"] < 90


def test_a_small_difference_is_measured_on_every_image(monkeypatch):
    """Five flipped images of 900 (0.6 points, within the 2-point tolerance): no look proves a
    disagreement, and the images right only in the unoptimised run that the 512-sample look
    holds leave room for more than 2 points on the whole split, so all 900 run once each, and
    the verdict is agreement."""
    y, right = _sorted_split()
    main = right.copy()
    main[[5, 200, 410, 620, 890]] = np.roll(main[[5, 200, 410, 620, 890]], 1, axis=1)
    ran = _fake_backend(monkeypatch, right)
    data = EvalData(x_u8=np.zeros((900, 3, 2, 2), np.uint8), y=y,
                    files=[str(i) for i in range(900)], mean=(0.5,) * 3, std=(0.5,) * 3,
                    input_name="x")
    cc = backend_cross_check("fake.onnx", data, {"logits": main})
    assert not cc["disagreement"] and not cc["decided_on_first_look"]
    assert cc["n"] == 900 and sorted(ran) == list(range(900)) and cc["sample"] == "all"
    assert cc["top1_agreement"] == pytest.approx(100 * 895 / 900)


def test_marked_bounds_match_scipy():
    """The exact hypergeometric bounds equal the ones read off scipy's distribution."""
    stats = pytest.importorskip("scipy.stats")
    for x, k, n_total in [(0, 128, 900), (4, 128, 900), (27, 32, 900), (32, 32, 50),
                          (10, 128, 5000)]:
        for alpha in (1.25e-5, 0.05):
            m = np.arange(n_total + 1)
            lo = m[stats.hypergeom.sf(x - 1, n_total, m, k) > alpha].min()
            hi = m[stats.hypergeom.cdf(x, n_total, m, k) > alpha].max()
            assert marked_bounds(x, k, n_total, alpha) == (lo, hi)
    with pytest.raises(ValueError):
        marked_bounds(5, 4, 900, 0.05)


def test_disagreement_beyond_doubt_never_decides_agreement():
    """A collapse on 32 of 900 is beyond doubt; one or a few flips are not; identical answers
    are no proof of agreement either (the rule only ever proves a disagreement)."""
    right = np.ones(32, bool)
    collapsed = right.copy()
    collapsed[:27] = False
    assert disagreement_beyond_doubt(collapsed, right, 2.0, 900)
    assert disagreement_beyond_doubt(right, collapsed, 2.0, 900)  # either direction
    assert not disagreement_beyond_doubt(right, right, 2.0, 900)
    r128 = np.ones(128, bool)
    some = r128.copy()
    some[:6] = False  # 4.7 points on 128 images: not beyond doubt at 1e-4
    assert not disagreement_beyond_doubt(some, r128, 2.0, 900)
    many = r128.copy()
    many[:40] = False  # 31 points
    assert disagreement_beyond_doubt(many, r128, 2.0, 900)
    assert not disagreement_beyond_doubt(np.zeros(0, bool), np.zeros(0, bool), 2.0, 900)


def test_agreement_needs_a_large_enough_look():
    """No image right in one run only among 128 of 900 is no proof of agreement within 2 points
    (up to some 7 % may be); none among 512 is; a few among 512 are not, unless the tolerance is
    wider."""
    y = np.arange(512) % 10
    assert not agreement_beyond_doubt(y[:128], y[:128], y[:128], 2.0, 900)
    assert agreement_beyond_doubt(y, y, y, 2.0, 900)
    some = y.copy()
    some[:5] += 1  # 5 right in the unoptimised run only
    assert not agreement_beyond_doubt(some, y, y, 2.0, 900)
    assert agreement_beyond_doubt(some, y, y, 5.0, 900)  # a wider tolerance
    assert not agreement_beyond_doubt(y[:0], y[:0], y[:0], 2.0, 900)


def test_agreement_bounds_each_direction_apart():
    """The int8_hp32 row of EfficientNet-Lite0 at its 512-image look (seed 0): 6 of 512 images
    change class, 2 are right only in the optimised run, 2 only in the unoptimised one, 2 are
    wrong in both. The images right in one run only are bounded apart (at most 19 of 900 each,
    so at most 17 either way after the 2 seen the other way): agreement within 2 points, which
    a bound on the 6 flips alone (up to 29 of 900) could not show. With 3 right only in the
    optimised run and none the other way, it cannot (up to 21 of 900)."""
    y = np.arange(512) % 10
    main, ref = y.copy(), y.copy()
    main[:2] += 1  # right only in the unoptimised run
    ref[2:4] += 1  # right only in the optimised run
    main[4:6] += 1
    ref[4:6] += 2  # wrong in both, in different classes
    assert (main != ref).sum() == 6
    assert agreement_beyond_doubt(main, ref, y, 2.0, 900)
    _, f_hi = marked_bounds(6, 512, 900, cross_check.CROSS_CHECK_ALPHA / 3)
    assert f_hi > 18  # the flips alone decide nothing
    one_way = y.copy()
    one_way[:3] += 1
    assert not agreement_beyond_doubt(y, one_way, y, 2.0, 900)


def test_early_agreement_is_wrong_at_most_alpha_of_the_time():
    """On a 900-image split just beyond the tolerance (19 images right only in the optimised
    run, 1 % flipping between wrong classes besides), random 512-image looks claim agreement in
    at most ``alpha`` of 4000 draws (at a large alpha, 0.2, where a wrong bound would show);
    within the tolerance (10 images) they mostly do."""
    rng = np.random.default_rng(1)
    y = np.arange(900) % 10
    def rate(b_total, alpha):
        main, ref = y.copy(), y.copy()
        ref[:b_total] += 1  # right only in the optimised (main) run
        main[100:109] += 1
        ref[100:109] += 2  # 9 wrong in both, in different classes
        hits = 0
        for _ in range(4000):
            idx = rng.choice(900, 512, replace=False)
            hits += agreement_beyond_doubt(main[idx], ref[idx], y[idx], 2.0, 900, alpha)
        return hits / 4000
    assert rate(19, 0.2) <= 0.2
    assert rate(10, 0.2) > 0.5


def test_runs_wrong_everywhere_in_different_ways_never_agree(monkeypatch):
    """Labels no run gets right (a random-init model): both runs score 0 %, but their classes
    differ on every image, so no look claims agreement; all 900 run, and the verdict is the
    plain top-1 figure (0 vs 0 points)."""
    y, right = _sorted_split()
    a, b = np.roll(right, 1, axis=1), np.roll(right, 2, axis=1)
    ran = _fake_backend(monkeypatch, b)
    data = EvalData(x_u8=np.zeros((900, 3, 2, 2), np.uint8), y=y,
                    files=[str(i) for i in range(900)], mean=(0.5,) * 3, std=(0.5,) * 3,
                    input_name="x")
    cc = backend_cross_check("fake.onnx", data, {"logits": a})
    assert cc["decided"] is None and len(ran) == 900 and cc["top1_agreement"] == 0.0
    assert cc["disagreement"] is False and cc["top1_main"] == cc["top1_unoptimized"] == 0.0


def test_exactly_the_tolerance_is_no_disagreement(monkeypatch):
    """18 of 900 images right only in the unoptimised run are exactly 2.00 points: not more
    than the tolerance (the rule counts images, free of float rounding: 4.11 - 2.11 computes
    as 2.0000000000000004)."""
    y, right = _sorted_split()
    wrong = np.roll(right, 1, axis=1)
    ref = wrong.copy()
    ref[:37] = right[:37]  # 37 right: 4.11 %
    main = wrong.copy()
    main[:19] = right[:19]  # 19 right: 2.11 %
    _fake_backend(monkeypatch, ref)
    data = EvalData(x_u8=np.zeros((900, 3, 2, 2), np.uint8), y=y,
                    files=[str(i) for i in range(900)], mean=(0.5,) * 3, std=(0.5,) * 3,
                    input_name="x")
    cc = backend_cross_check("fake.onnx", data, {"logits": main})
    assert abs(cc["top1_unoptimized"] - cc["top1_main"]) > 2.0  # the float figure
    assert cc["n"] == 900 and cc["disagreement"] is False


def test_the_tolerance_is_compared_as_written():
    """57 images of 5000 are exactly 1.14 %: not more than a 1.14-point tolerance, although
    1.14 * 5000 is 5699.999999999999 in floating point; 58 are."""
    from deploykit.quant.cross_check import _exceeds

    assert not _exceeds(57, 5000, 1.14) and _exceeds(58, 5000, 1.14)
    assert not _exceeds(18, 900, 2.0) and _exceeds(19, 900, 2.0)
    assert not _exceeds(1005, 50000, 2.01) and _exceeds(1006, 50000, 2.01)


@pytest.mark.parametrize("n", [-1, 16])
def test_a_first_look_sample_is_compared_whole_whatever_the_image_count(n, monkeypatch):
    """--cross-check-images 16 on a row decided on 32 first-look images of 900: all 32 run (a
    sample of that sample would be no sample of the split), and the verdict is about all 900."""
    y, right = _sorted_split()
    idx = np.sort(np.random.default_rng(0).choice(900, 32, replace=False))
    main = right[idx].copy()
    main[:1] = np.roll(main[:1], 1, axis=1)
    ran = _fake_backend(monkeypatch, right[idx])
    sub = EvalData(x_u8=np.zeros((32, 3, 2, 2), np.uint8), y=y[idx],
                   files=[str(i) for i in range(32)], mean=(0.5,) * 3, std=(0.5,) * 3,
                   input_name="x")
    cc = backend_cross_check("fake.onnx", sub, {"logits": main}, n=n, population=900)
    assert len(ran) == 32 and cc["n"] == 32 and cc["n_total"] == 900
    assert cc["disagreement"] is None and cc["sample"] == {"seed": 0, "n": 32}


@pytest.mark.parametrize("flips", [32, 1])
def test_a_first_look_sample_gives_a_verdict_about_the_whole_split(flips, monkeypatch):
    """A row decided on its first look hands the cross-check those 32 samples of 900: a
    collapse there is a disagreement beyond doubt about all 900; one flip of 32 (3.1 points on
    the sample) decides nothing, and the record says so (disagreement None, not True)."""
    y, right = _sorted_split()
    idx = np.sort(np.random.default_rng(0).choice(900, 32, replace=False))
    main = right[idx].copy()
    main[:flips] = np.roll(main[:flips], 1, axis=1)
    _fake_backend(monkeypatch, right[idx])
    sub = EvalData(x_u8=np.zeros((32, 3, 2, 2), np.uint8), y=y[idx],
                   files=[str(i) for i in range(32)], mean=(0.5,) * 3, std=(0.5,) * 3,
                   input_name="x")
    cc = backend_cross_check("fake.onnx", sub, {"logits": main}, population=900)
    assert cc["n"] == 32 and cc["n_total"] == 900 and cc["sample"] == {"seed": 0, "n": 32}
    if flips == 32:
        assert cc["disagreement"] is True and cc["decided"] == "disagreement"
        assert "32 of 900 images, the row's first look, a disagreement beyond doubt" in cc["reason"]
    else:
        assert cc["disagreement"] is None and cc["decided"] is None
        assert "no verdict beyond doubt about the whole split" in cc["reason"]


def test_cross_check_looks_are_nested_random_samples():
    """32 within 128 within 512 for a 900-image split, not its first images; a split of 300
    keeps the 32/128 looks only; one of 200 has none (every image at once); a 50,000-image
    split grows them 4 times per look."""
    looks = cross_check_looks(900)
    assert [len(x) for x in looks] == [32, 128, 512]
    for a, b in zip(looks, looks[1:]):
        assert set(a) <= set(b)
    assert looks[1].max() > 600 and len(set(looks[2])) == 512
    assert [len(x) for x in cross_check_looks(300)] == [32, 128]
    assert cross_check_looks(200) == []
    big = cross_check_looks(50_000)  # 4 times larger per look while under the split
    assert [len(x) for x in big] == [32, 128, 512, 2048, 8192, 32768]
    assert all(set(a) <= set(b) for a, b in zip(big, big[1:]))


@pytest.mark.parametrize("saturates", [True, False])
def test_saturation_leg_names_u8s8_only_when_u8u8_kernels_agree(saturates, monkeypatch):
    """On a CPU without VNNI a disagreement gets one more run with
    session.x64quantprecision=1 on the last look's images: u8s8 saturation is named as the
    cause only when that run agrees with the unoptimised graph."""
    y, right = _sorted_split()
    main = np.roll(right, 1, axis=1)  # the optimised run wrong everywhere
    _fake_backend(monkeypatch, right, x64=right if saturates else main)
    monkeypatch.setattr(cross_check, "cpu_has_vnni", lambda: False)
    data = EvalData(x_u8=np.zeros((900, 3, 2, 2), np.uint8), y=y,
                    files=[str(i) for i in range(900)], mean=(0.5,) * 3, std=(0.5,) * 3,
                    input_name="x")
    cc = backend_cross_check("fake.onnx", data, {"logits": main})
    assert cc["disagreement"] and cc["n"] == CROSS_CHECK_PEEK and cc["cpu_vnni"] is False
    assert cc["n_x64quantprecision"] == CROSS_CHECK_PEEK
    assert cc["top1_x64quantprecision"] == (100.0 if saturates else 0.0)
    assert (cc["cause"] is not None) is saturates
    exact = backend_cross_check("fake.onnx", data, {"logits": main}, n=900)
    assert exact["n"] == 900 and exact["n_x64quantprecision"] == 900


@pytest.mark.parametrize("same", [False, True])
def test_nan_in_one_run_only_is_a_disagreement_for_any_model(monkeypatch, same):
    """A model without labels: an output that is NaN in the optimised run where the
    unoptimised one is finite is a backend disagreement (NaN compares false with the cosine
    bound, so it used to pass as agreement); NaN at the same places in both runs is the graph's
    own, judged on the finite values (agreement)."""
    rng = np.random.default_rng(0)
    ref_out = rng.standard_normal((40, 5)).astype(np.float32)
    main = ref_out.copy()
    main[3, 2] = np.nan
    if same:
        ref_out[3, 2] = np.nan

    class _Runner:
        def __init__(self, *a, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def close(self):
            pass

    monkeypatch.setattr(cross_check, "OrtRunner", _Runner)
    monkeypatch.setattr(cross_check, "qdq_reference_runner", lambda path, **kw: (
        _Runner(), {"reference": "qdq_rewrites_off", "why": None}))
    monkeypatch.setattr(cross_check, "run_outputs",
                        lambda r, sub, batch, progress=None: {"y": ref_out[sub.feed["i"][:, 0]]})
    data = EvalData(feed={"i": np.arange(40).reshape(40, 1)})
    cc = backend_cross_check("fake.onnx", data, {"y": main})
    assert cc["disagreement"] is (not same)
    if same:
        assert cc["outputs"]["y"]["cosine_min"] == pytest.approx(1.0)
        assert cc["outputs"]["y"]["nonfinite_same"] == 1
        assert "1 value(s) NaN/Inf at the same places in both" in cc["reason"]
    else:
        assert cc["outputs"]["y"]["nonfinite_differs"] == 1
        assert "1 value(s) NaN/Inf in one run only" in cc["reason"]
    # +inf against -inf at the same place: a disagreement, counted
    ref_out[3, 2], main[3, 2] = np.inf, -np.inf
    cc = backend_cross_check("fake.onnx", data, {"y": main})
    assert cc["disagreement"] and cc["outputs"]["y"]["nonfinite_differs"] == 1
    # identical finite float64 outputs whose norms overflow: no finding about the backend
    huge = rng.standard_normal((40, 5)) * 1e160
    ref_out = huge
    assert backend_cross_check("fake.onnx", data, {"y": huge.copy()})["disagreement"] is False
