"""deploykit.timing: latency percentiles and the bounded timed loop."""

from __future__ import annotations

import time

import pytest

from deploykit.timing import latency_stats, MIN_ITERS, Timing, wall_loop


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
