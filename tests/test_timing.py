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


def test_other_processes_on_the_machine_are_counted_and_named(monkeypatch):
    """A timed loop sharing the machine with another process was recorded as if the machine had
    been quiet (a PyTorch baseline timed beside a second pipeline gave an 810x "speedup"). The
    arithmetic on /proc/stat samples: others = every CPU's busy time - this process's own."""
    def sample(t, busy, steal, own, cpus=("cpu0", "cpu1")):
        return t, {c: (busy / len(cpus), steal / len(cpus)) for c in cpus}, own

    samples = iter([sample(10.0, 1000, 0, 5.0),        # wall s, busy ticks, steal ticks, own s
                    sample(12.0, 1000 + 500, 40, 7.0)])  # 5 s busy in 2 s wall, 2 s our own
    monkeypatch.setattr(timing.OtherCpu, "_sample", staticmethod(lambda: next(samples)))
    with timing.OtherCpu() as other:
        pass
    assert other.result == {"cores": 1.5, "steal_cores": 0.2, "of_cores": 2, "seconds": 2.0}
    assert timing.busy_machine_note(other.result) == (
        "other processes used 1.50 of the machine's 2 cores (0.20 of them the hypervisor's "
        "steal)")
    assert timing.busy_machine_note({"cores": 0.1, "steal_cores": 0, "of_cores": 2}) is None
    assert timing.busy_machine_note(None) is None
    assert timing.busy_machine_note({"cores": None}) is None  # not judged, or hand-edited
    for edited in ("busy", [1, 2], {"cores": float("nan")}, {"cores": float("inf")},
                   {"cores": True}, {"cores": "0.9"}, {"cores": -1.0}, {"cores": 10 ** 400}):
        assert timing.busy_machine_note(edited) is None, edited
    assert timing.busy_machine_note({"cores": 0.5}) == \
        "other processes used 0.50 of the machine's cores"
    # too short to judge: recorded as such, not as "cannot read /proc/stat" (None)
    samples = iter([sample(10.0, 1000, 0, 5.0), sample(10.1, 1010, 0, 5.1)])
    with timing.OtherCpu() as other:
        pass
    assert other.result["cores"] is None and "under 0.2 s" in other.result["not_judged"]
    # a CPU that goes off-line between the samples is left out, and the figure stays within
    # the CPUs counted (a reviewer saw 44969 cores when the counted set changed mid-loop)
    samples = iter([sample(10.0, 1000, 0, 5.0, ("cpu0",)),
                    sample(11.0, 90000, 0, 5.0, ("cpu0", "cpu1"))])
    with timing.OtherCpu() as other:
        pass
    assert other.result["of_cores"] == 1 and other.result["cores"] <= 1
    samples = iter([None, sample(11.0, 1000, 0, 5.0)])  # /proc/stat unreadable
    with timing.OtherCpu() as other:
        pass
    assert other.result is None


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity")
                    or not __import__("os").path.exists("/proc/stat"), reason="Linux only")
def test_a_loop_timed_beside_a_busy_process_says_so():
    """For real: a child pinned to one CPU times a loop while a spinning process shares that
    CPU; the loop's record names the other process's share (of every CPU of the machine)."""
    import json
    import subprocess
    import sys

    code = r'''
import json, os, subprocess, sys, time
cpu = sorted(os.sched_getaffinity(0))[0]
os.sched_setaffinity(0, {cpu})
hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
try:
    time.sleep(0.3)
    from deploykit.timing import wall_loop
    t = wall_loop(lambda: sum(range(20000)), 3, 100000, max_seconds=0.8)
finally:
    hog.kill()
print(json.dumps(t.other_cpu))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["of_cores"] == __import__("os").cpu_count() and rec["seconds"] >= 0.8
    assert rec["cores"] >= timing.BUSY_CORES, rec
    assert "other processes used" in timing.busy_machine_note(rec)
