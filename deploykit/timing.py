"""Latency measurement: the bounded timed loops (wall clock with device sync, CUDA events), the
interleaved loop that compares several calls on a drifting host, and their statistics
(p50/p90/p99 in ms, throughput).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np



def latency_stats(times_ms: Sequence[float], batch: int = 1) -> dict[str, float]:
    """Summary of per-iteration latencies (ms): p50/p90/p99/mean/min/max and FPS
    (``batch * 1000 / mean``)."""
    t = np.asarray(times_ms, np.float64)
    return {"batch": batch, "iters": int(t.size), "p50_ms": float(np.percentile(t, 50)),
            "p90_ms": float(np.percentile(t, 90)), "p99_ms": float(np.percentile(t, 99)),
            "mean_ms": float(t.mean()), "min_ms": float(t.min()), "max_ms": float(t.max()),
            "fps": float(batch * 1000.0 / t.mean())}


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    """Per-iteration latencies of one timed loop.

    Attributes:
        end_to_end_ms: host wall-clock per iteration (ms), always measured.
        gpu_compute_ms: CUDA-event time per iteration (ms), GPU runners only, else None.
        end_to_end_timer / gpu_compute_timer: how each was measured (for the results row).
        extra: further figures of the same work on a GPU, ``{name: (times_ms or None, timer
            or the reason it could not be measured)}``, e.g. ``cuda_graph`` (graph replay),
            ``device_buffers`` (ORT I/O binding on device buffers), ``compile``
            (``torch.compile``).
    """

    end_to_end_ms: list[float]
    end_to_end_timer: str
    gpu_compute_ms: list[float] | None = None
    gpu_compute_timer: str | None = None
    extra: dict[str, tuple[list[float] | None, str]] = dataclasses.field(default_factory=dict)

    def stats(self, batch: int, warmup: int) -> dict:
        """The ``latency`` block of a results row: ``{"batch", "warmup" (warm-up calls made:
        ``end_to_end_ms.warmup_runs`` of a :class:`LoopTimes`, else ``warmup``),
        "warmup_requested", "iters", "other_cpu" (:class:`OtherCpu` of the end-to-end loop, or
        None), "end_to_end_ms": latency_stats, "end_to_end_timer", "gpu_compute_ms": latency_stats or
        None, "gpu_compute_timer"}`` plus ``"<name>_ms"`` and ``"<name>_timer"`` (or
        ``"<name>_error"``) for each extra figure."""
        out = {"batch": batch, "warmup": getattr(self.end_to_end_ms, "warmup_runs", warmup),
               "warmup_requested": warmup, "iters": len(self.end_to_end_ms),
               "other_cpu": getattr(self.end_to_end_ms, "other_cpu", None),
               "end_to_end_ms": latency_stats(self.end_to_end_ms, batch),
               "end_to_end_timer": self.end_to_end_timer,
               "gpu_compute_ms": (latency_stats(self.gpu_compute_ms, batch)
                                  if self.gpu_compute_ms else None),
               "gpu_compute_timer": self.gpu_compute_timer}
        for name, (times, how) in self.extra.items():
            out[f"{name}_ms"] = latency_stats(times, batch) if times else None
            out[f"{name}_timer" if times else f"{name}_error"] = how
        return out


def try_extra(timing: Timing, name: str, fn: Callable[[], tuple[list[float], str]]) -> None:
    """Measure an extra figure into ``timing.extra[name]``; a failure (a model that cannot be
    captured in a CUDA graph, say) is recorded with its reason instead of raised."""
    try:
        timing.extra[name] = fn()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - any capture/compile failure is a recorded finding
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        # ORT's own reason follows "FAIL : " (e.g. "... as all compute graph nodes have not been
        # partitioned to the CUDAExecutionProvider"): keep that, not the path before it.
        msg = msg.split("FAIL : ", 1)[-1].strip()
        timing.extra[name] = (None, msg[:300])


# Time budget of one timed loop: it stops after ``iters`` iterations or this many seconds,
# whichever comes first, but never before MIN_ITERS iterations (MLPerf's LoadGen bounds a run
# the same way, by a minimum query count and a minimum duration). A 400 ms INT8 model on a busy
# 2-core CPU would otherwise spend 80 s on 200 iterations; the row records how many ran.
MAX_SECONDS = 5.0


MIN_ITERS = 20

#: Warm-up bound: the untimed calls before a timed loop stop after ``warmup`` calls or once this
#: many seconds have passed, whichever comes first, but never before :data:`MIN_WARMUP` calls
#: (trtexec's ``--warmUp`` is a duration, 200 ms by default). A call slow enough to hit it has
#: already run its first-call work (allocations, kernel selection) in the first few calls.
WARMUP_SECONDS = 0.2

MIN_WARMUP = 3


class LoopTimes(list):
    """Per-iteration latencies (ms) of a timed loop, a list; ``warmup_runs`` is how many untimed
    warm-up calls ran before it (:data:`WARMUP_SECONDS`); ``other_cpu`` what other processes
    used of the machine's CPUs meanwhile (:class:`OtherCpu`, None where it cannot be read)."""

    warmup_runs: int = 0
    other_cpu: dict | None = None


#: Mean cores that other processes (and a hypervisor's steal) may use during a timed loop before
#: its figures are marked as taken on a busy machine. A compiler or a second pipeline on a 2-core
#: host uses about 1 core; an idle Linux host's own housekeeping stays near 0.01 (measured on
#: this project's 2-core CPU host: benchmarks/README.md, stop 43).
BUSY_CORES = 0.25


class OtherCpu:
    """CPU time used by everything but this process on the machine while a block runs: a timed
    loop's figures are only as good as the machine was quiet.

    Linux only: the busy time of every CPU in ``/proc/stat`` (user, nice, system, irq, softirq,
    steal; ``proc(5)``; CPUs present in both samples), minus this process's own user + system
    time (``os.times``, all its threads: ORT's and PyTorch's pools count as its own). Every CPU,
    not the caller's affinity: a thread pinned by ``OMP_PROC_BIND`` has an affinity of one CPU
    while its pool runs on the others, and a process on another core still slows a loop through
    the shared cache and memory (a reviewer saw p50 6-36 % higher). ``result`` is then
    ``{"cores": mean cores used by others over the block's wall time (at most the CPUs
    counted), "steal_cores": the hypervisor's share, "of_cores": CPUs counted, "seconds": wall
    time}``; None where ``/proc/stat`` cannot be read (macOS, Windows); and ``cores`` None with
    ``not_judged`` for a block under 0.2 s (``/proc/stat`` counts 10 ms ticks per CPU).
    """

    _MIN_SECONDS = 0.2

    def __init__(self):
        self.result: dict | None = None
        self._start = None

    @staticmethod
    def _sample():
        """``(perf_counter s, {cpu: (busy ticks, steal ticks)}, own CPU s)`` or None."""
        try:
            per_cpu = {}
            with open("/proc/stat") as f:
                for line in f:
                    name, *vals = line.split()
                    if name.startswith("cpu") and name != "cpu":
                        v = [int(x) for x in vals[:8]]
                        per_cpu[name] = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7], v[7])
            t = os.times()
            return (time.perf_counter(), per_cpu, t.user + t.system) if per_cpu else None
        except (OSError, ValueError, IndexError):
            return None

    def __enter__(self) -> "OtherCpu":
        self._start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        end = self._sample()
        if self._start is None or end is None:
            return
        wall = end[0] - self._start[0]
        cpus = sorted(set(self._start[1]) & set(end[1]))  # a CPU going off-line is left out
        if wall < self._MIN_SECONDS or not cpus:
            self.result = {"cores": None, "steal_cores": None, "of_cores": len(cpus),
                           "seconds": round(wall, 3),
                           "not_judged": f"under {self._MIN_SECONDS:g} s: /proc/stat counts "
                                         "10 ms ticks per CPU"}
            return
        tick = os.sysconf("SC_CLK_TCK") or 100
        busy = sum(end[1][c][0] - self._start[1][c][0] for c in cpus) / tick
        steal = sum(end[1][c][1] - self._start[1][c][1] for c in cpus) / tick
        others = min(max(0.0, busy - (end[2] - self._start[2])) / wall, len(cpus))
        self.result = {"cores": round(others, 3), "steal_cores": round(steal / wall, 3),
                       "of_cores": len(cpus), "seconds": round(wall, 3)}


def busy_machine_note(other_cpu) -> str | None:
    """``"other processes used 1.30 of the machine's 2 cores"`` when a timed loop's
    :class:`OtherCpu` record is at or above :data:`BUSY_CORES`, else None: also for a record
    without a figure (None, not judged) and for one no loop wrote (a hand-edited value that is
    no dict, or whose ``cores`` is no finite number)."""
    def number(v):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            return None
        try:
            v = float(v)  # an int of 400 digits: OverflowError
        except OverflowError:
            return None
        return v if math.isfinite(v) else None

    cores = number(other_cpu.get("cores")) if isinstance(other_cpu, dict) else None
    if cores is None or cores < BUSY_CORES:
        return None
    n, steal = other_cpu.get("of_cores"), number(other_cpu.get("steal_cores"))
    of = (f"the machine's {n} cores" if isinstance(n, int) and not isinstance(n, bool) and n > 0
          else "the machine's cores")
    return (f"other processes used {cores:.2f} of {of}"
            + (f" ({steal:.2f} of them the hypervisor's steal)"
               if steal is not None and steal >= BUSY_CORES / 2 else ""))


def _warm_up(fn: Callable[[], Any], warmup: int) -> int:
    """Run ``fn()`` ``warmup`` times, stopping early once :data:`WARMUP_SECONDS` have passed
    after at least :data:`MIN_WARMUP` calls; returns the calls made."""
    start = time.perf_counter()
    for i in range(warmup):
        fn()
        if i + 1 >= MIN_WARMUP and time.perf_counter() - start > WARMUP_SECONDS:
            return i + 1
    return max(0, warmup)


def wall_loop(fn: Callable[[], Any], warmup: int, iters: int,
              sync: Callable[[], None] | None = None,
              max_seconds: float | None = None) -> LoopTimes:
    """Wall-clock latency (ms) of ``fn()``: up to ``warmup`` untimed calls (fewer once
    :data:`WARMUP_SECONDS` have passed, at least :data:`MIN_WARMUP`), then up to ``iters`` timed
    ones with ``time.perf_counter`` (fewer once ``max_seconds``, default :data:`MAX_SECONDS`, has
    passed, but at least ``min(iters, MIN_ITERS)``); ``sync()`` (a device synchronisation) runs
    before each timestamp so asynchronous work is counted.

    Returns:
        :class:`LoopTimes`: the timed calls' latencies (ms), ``warmup_runs`` and ``other_cpu``
        (what other processes used of the machine's CPUs during the warm-up and timed calls).
    """
    budget = MAX_SECONDS if max_seconds is None else max_seconds
    times = LoopTimes()
    with OtherCpu() as other:  # the warm-up too: a short loop alone is too short to judge
        times.warmup_runs = _warm_up(fn, warmup)
        if sync:
            sync()
        start = time.perf_counter()
        for i in range(iters):
            t0 = time.perf_counter()
            fn()
            if sync:
                sync()
            t1 = time.perf_counter()
            times.append((t1 - t0) * 1e3)
            if i + 1 >= MIN_ITERS and t1 - start > budget:
                break
    times.other_cpu = other.result
    return times


def cuda_event_loop(fn: Callable[[], Any], warmup: int, iters: int, stream=None,
                    max_seconds: float | None = None) -> LoopTimes:
    """Device time (ms) of the work ``fn()`` enqueues on ``stream`` (default: the current torch
    stream), from a pair of CUDA events per iteration, after the warm-up of :func:`wall_loop`
    (time-bounded too: the calls are asynchronous, so each warm-up call's host time is what is
    bounded); the same iteration/time bounds as :func:`wall_loop`. Returns :class:`LoopTimes`."""
    import torch

    budget = MAX_SECONDS if max_seconds is None else max_seconds
    stream = stream or torch.cuda.current_stream()
    times = LoopTimes()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with OtherCpu() as other:
        times.warmup_runs = _warm_up(fn, warmup)
        stream.synchronize()
        t_start = time.perf_counter()
        for i in range(iters):
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
            if i + 1 >= MIN_ITERS and time.perf_counter() - t_start > budget:
                break
    times.other_cpu = other.result
    return times


def interleaved_times(calls: Mapping[str, Callable[[], object]], rounds: int = 8,
                      iters: int = 20, warmup: int = 10) -> dict[str, list[float]]:
    """Time several calls against each other on the same stretch of a drifting host.

    Each call runs ``warmup`` times untimed; then ``rounds`` rounds, in which every call runs
    ``iters`` times in turn, the order rotated by one each round (so no call always follows the
    same one).

    Args:
        calls: ``{name: zero-argument callable}``, e.g. a bound ``InferenceSession.run``.
    Returns:
        ``{name: [ms, ...]}``: ``rounds * iters`` wall-clock times (``time.perf_counter``) each,
        in the order they ran.
    Raises:
        ValueError: no calls, or ``rounds`` / ``iters`` below 1.
    """
    names = list(calls)
    if not names or rounds < 1 or iters < 1:
        raise ValueError("interleaved_times needs at least one call, one round and one run")
    for name in names:
        for _ in range(warmup):
            calls[name]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn, times = calls[name], out[name]
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
    return out
