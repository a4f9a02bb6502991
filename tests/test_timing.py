"""deploykit.timing: latency percentiles and the bounded timed loop."""

from __future__ import annotations

import time

import pytest

import deploykit.timing as timing
from deploykit.timing import latency_stats, MIN_ITERS, MIN_WARMUP, Timing, wall_loop


def test_latency_stats_percentiles():
    s = latency_stats(list(range(1, 101)), batch=2)
    assert s["p50_ms"] == pytest.approx(50.5) and s["p99_ms"] == pytest.approx(99.01)
    assert s["fps"] == pytest.approx(2 * 1000 / 50.5)


def test_timed_loop_is_bounded_by_iterations_and_time():
    """A slow model stops after the time budget (but never before MIN_ITERS); a fast one runs
    all iterations. The row records how many ran."""
    slow = wall_loop(lambda: time.sleep(0.005), 0, 1000, max_seconds=0.01)
    assert len(slow) == MIN_ITERS
    fast = wall_loop(lambda: None, 2, 150, max_seconds=5.0)
    assert len(fast) == 150
    assert len(wall_loop(lambda: None, 0, 5, max_seconds=0.0)) == 5  # iters < MIN_ITERS
    t = Timing(slow, "t").stats(batch=1, warmup=0)
    assert t["iters"] == MIN_ITERS


def test_warm_up_is_bounded_by_calls_and_time(monkeypatch):
    """A call slower than the warm-up budget gets MIN_WARMUP warm-up calls, not all 20 asked
    for; a fast one all of them; the row records the calls made and the number asked for."""
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    monkeypatch.setattr(timing, "WARMUP_SECONDS", 0.03)
    t = wall_loop(slow, 20, 1, max_seconds=0.0)
    assert t.warmup_runs == MIN_WARMUP and len(calls) == MIN_WARMUP + 1
    block = Timing(t, "t").stats(batch=1, warmup=20)
    assert block["warmup"] == MIN_WARMUP and block["warmup_requested"] == 20
    assert wall_loop(lambda: None, 20, 1).warmup_runs == 20
    assert wall_loop(lambda: None, 0, 1).warmup_runs == 0
    assert wall_loop(slow, 2, 1).warmup_runs == 2  # fewer than MIN_WARMUP asked: those
    assert Timing([1.0], "t").stats(batch=1, warmup=7)["warmup"] == 7  # a plain list
