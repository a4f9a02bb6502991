"""deploykit.sequential (a row failed beyond doubt on a first look) and the first look of
deploykit.evaluate.evaluate: which samples run, in which order, and what the row says."""
from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from deploykit.compare import row_tolerance
from deploykit.evaluate import (FAILED_LATENCY_S, EvalData, evaluate, evaluated_data,
                                summary_line)
from deploykit.runners import Runner
from deploykit.sequential import (ALPHA, FIRST_LOOK, FIRST_PEEK, LOOK_ALPHA, decided_indices,
                                  failed_beyond_doubt, look_schedule,
                                  first_look_indices, hoeffding_margin)


def test_first_look_indices_are_a_seeded_sorted_sample_only_when_it_saves_work():
    idx = first_look_indices(900)
    assert idx is not None and len(idx) == FIRST_LOOK == len(set(idx.tolist()))
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < 900
    assert np.array_equal(idx, first_look_indices(900))  # the same images every run
    assert not np.array_equal(idx, first_look_indices(900, seed=1))
    # not the first 128: the split is ordered by class
    assert idx.max() > 2 * FIRST_LOOK
    assert first_look_indices(2 * FIRST_LOOK) is None  # at most two looks long: nothing saved
    assert first_look_indices(900, 0) is None


def test_hoeffding_margin_is_the_textbook_value_and_refuses_nonsense():
    # range 1, n 128, alpha 1e-4: sqrt(ln(1e4) / 256) = 0.18967...
    assert hoeffding_margin(128, 1.0, 1e-4) == pytest.approx(np.sqrt(np.log(1e4) / 256))
    assert hoeffding_margin(512, 2.0) == pytest.approx(2 * np.sqrt(np.log(1 / ALPHA) / 1024))
    for bad in ((0, 1.0, 0.1), (10, 1.0, 0.0), (10, 1.0, 1.0)):
        with pytest.raises(ValueError):
            hoeffding_margin(*bad)


def _par(agree: float, cmean: float = 0.999, cmin: float = 0.99) -> dict:
    return {"logits": {"top1_agreement": agree, "cosine_mean": cmean, "cosine_min": cmin}}


def test_collapsed_rows_are_decided_and_borderline_ones_are_not():
    # the committed collapse: 0.8 % agreement, cosine 0.02 on 128 images
    why = failed_beyond_doubt("INT8", _par(0.8, 0.02, -0.2), None, 128)
    assert any("top1_agreement" in w for w in why) and any("cosine_mean" in w for w in why)
    # 85 % agreement on 128 is below the 90 % failed bound but not beyond doubt (+19 points)
    assert failed_beyond_doubt("INT8", _par(85.0), None, 128) == []
    # a cosine minimum under the failed bound decides: more samples only lower a minimum
    fp32_failed_min = row_tolerance("FP32")[1]["cosine_min"]["failed"]
    why = failed_beyond_doubt("FP32", _par(100.0, 0.9999, fp32_failed_min - 0.01), None, 128)
    assert len(why) == 1 and "cosine_min" in why[0]
    # NaN outputs decide whatever the metrics say
    assert failed_beyond_doubt("FP16", _par(100.0), {"logits": 3}, 128) == [
        "logits: 3 NaN/Inf values where the reference is finite"]
    assert failed_beyond_doubt("FP32", _par(float("nan")), None, 128)


def test_a_row_just_above_its_failed_bound_is_never_decided_on_thousands_of_draws():
    """A split whose per-image agreement is 91 % (INT8 failed bound 90 %): the first look must
    not call it failed, whichever 128 images it draws (Hoeffding at alpha 1e-4)."""
    rng = np.random.default_rng(7)
    agree = np.zeros(900, bool)
    agree[:819] = True  # 91.0 %
    decided = 0
    for _ in range(2000):
        look = rng.choice(900, FIRST_LOOK, replace=False)
        decided += bool(failed_beyond_doubt("INT8", _par(100.0 * agree[look].mean()), None,
                                            FIRST_LOOK))
    assert decided == 0
    # and one that collapsed (5 % agreement) is decided on every draw
    bad = np.zeros(900, bool)
    bad[:45] = True
    assert all(failed_beyond_doubt("INT8", _par(100.0 * bad[rng.choice(900, FIRST_LOOK,
                                                                        replace=False)].mean()),
                                   None, FIRST_LOOK) for _ in range(200))


class _IndexRunner(Runner):
    """Returns, for each sample, logits that put the sample's own class first (``good``) or
    another class (a collapse); counts how often each sample id is run. The sample id travels
    in the input (column 0)."""

    backend = "fake"
    input_names, output_names = ["x"], ["y"]

    def __init__(self, good: bool, classes: int = 10, right_mod5: int = 0):
        self.good, self.classes, self.seen = good, classes, []
        self.right_mod5 = right_mod5  # a bad runner still gets samples with id % 5 below it

    def infer(self, feed):
        ids = feed["x"][:, 0].astype(int)
        self.seen += ids.tolist()
        y = np.full((len(ids), self.classes), -1.0, np.float32)
        wrong = ~(self.good | (ids % 5 < self.right_mod5))
        y[np.arange(len(ids)), (ids + wrong) % self.classes] = 5.0
        return {"y": y}

    def time(self, feed, warmup, iters):
        return Runner.time(self, feed, 0, 2)

    def describe(self):
        return {"backend": self.backend, "device": "cpu"}


def _feed_data(n: int = 900, classes: int = 10) -> EvalData:
    ids = np.arange(n)
    x = np.stack([ids, np.zeros(n)], 1).astype(np.float32)
    ref = np.full((n, classes), -1.0, np.float32)
    ref[ids, ids % classes] = 5.0
    return EvalData(feed={"x": x}, ref={"y": ref}, y=(ids % classes).astype(np.int64))


def _run(runner, data, first_look):
    return evaluate(runner, data, stage="3_onnx_eval", precision="INT8", model="m", tag="t",
                    args=argparse.Namespace(), started=time.time(), warmup=0, iters=2,
                    write=False, first_look=first_look)


def test_a_collapsed_row_is_measured_on_the_earlier_look_only_and_says_so():
    runner, data = _IndexRunner(good=False), _feed_data()
    rec, out = _run(runner, data, FIRST_LOOK)
    peek = first_look_indices(900, peek=FIRST_PEEK)
    assert set(peek) < set(first_look_indices(900).tolist())  # a part of the first look
    inference = runner.seen[:-2]  # the latency loop's two calls come last (sample 0 twice)
    assert sorted(inference) == peek.tolist()  # only the earlier look ran
    assert rec["status"] == "failed" and rec["n_images"] == FIRST_PEEK
    fl = rec["first_look"]
    assert fl["decided"] == "failed" and fl["n_total"] == 900 and fl["look"] == FIRST_LOOK
    assert fl["alpha"] == LOOK_ALPHA == ALPHA / 2  # two looks: the total stays ALPHA
    assert "first look at 32 of 900" in rec["status_reason"] and "--full-eval" in rec[
        "status_reason"]
    assert "(first look of 900)" in summary_line(rec)
    assert rec["latency"]["max_seconds"] == FAILED_LATENCY_S  # no deployment candidate
    # the outputs are those of the earlier look's samples, in the order evaluated_data gives
    sub = evaluated_data(data, rec)
    assert len(sub) == FIRST_PEEK and np.array_equal(sub.feed["x"][:, 0], peek)
    assert np.array_equal(out["y"].argmax(1), (peek + 1) % 10)


def test_a_row_the_earlier_look_leaves_open_is_decided_on_the_whole_first_look():
    """60 % top-1 agreement: 32 samples cannot prove it under 90 %, 128 can (Hoeffding at
    alpha/2: 39.3 and 19.7 points); each of the 128 samples runs once."""
    runner, data = _IndexRunner(good=False, right_mod5=3), _feed_data()
    rec, out = _run(runner, data, FIRST_LOOK)
    look = first_look_indices(900)
    inference = runner.seen[:-2]
    assert sorted(inference) == look.tolist() and len(inference) == FIRST_LOOK
    assert rec["status"] == "failed" and rec["n_images"] == FIRST_LOOK
    assert rec["first_look"]["n"] == FIRST_LOOK and "first look at 128 of 900" in rec[
        "status_reason"]
    sub = evaluated_data(data, rec)
    assert np.array_equal(sub.feed["x"][:, 0], look)
    right = (look % 5) < 3
    assert np.array_equal(out["y"].argmax(1), (look + ~right) % 10)


def test_a_good_row_runs_every_sample_once_in_the_split_order():
    runner, data = _IndexRunner(good=True), _feed_data()
    rec, out = _run(runner, data, FIRST_LOOK)
    inference = runner.seen[:-2]
    assert sorted(inference) == list(range(900))  # each sample once
    assert rec["status"] == "ok" and rec["n_images"] == 900
    assert rec["first_look"]["decided"] is None
    assert rec["latency"]["max_seconds"] == Runner.max_seconds
    assert np.array_equal(out["y"], data.ref["y"])  # the split's order, not the look's
    assert evaluated_data(data, rec) is data


def test_full_eval_and_small_splits_have_no_first_look():
    runner, data = _IndexRunner(good=False), _feed_data()
    rec, _ = _run(runner, data, 0)  # --full-eval
    assert rec["n_images"] == 900 and rec["first_look"] is None
    runner, small = _IndexRunner(good=False), _feed_data(200)
    rec, _ = _run(runner, small, FIRST_LOOK)  # --limit 200: two looks long, nothing saved
    assert rec["n_images"] == 200 and rec["first_look"] is None


def test_decided_indices_name_the_deciding_look_and_read_rows_of_one_look():
    peek, look = look_schedule(900)
    assert len(peek) == FIRST_PEEK and len(look) == FIRST_LOOK and set(peek) < set(look)
    block = {"n": FIRST_PEEK, "n_total": 900, "decided": "failed", "seed": 0,
             "look": FIRST_LOOK}
    assert np.array_equal(decided_indices(block), peek)
    assert np.array_equal(decided_indices({**block, "n": FIRST_LOOK}), look)
    # a row written before the two looks: one look of n samples
    old = {"n": FIRST_LOOK, "n_total": 900, "decided": "failed", "seed": 0}
    assert np.array_equal(decided_indices(old), look)
    assert decided_indices({**block, "decided": None}) is None and decided_indices(None) is None
    assert look_schedule(200) == [] and len(look_schedule(900, 40)) == 1  # no room for a peek
