"""Interleaved re-timing of the CPU rows a verdict ranks by speed (``8_report.py --retime``).

Each row's batch-1 p50 comes from its own process (stage 3), minutes apart from the others. On a
shared or virtualised CPU the speed of the host drifts on that scale: on the 2-core AMD EPYC
(AVX512-VNNI) CPU machine of this project the same ``fp32.onnx`` timed 4.8-5.1 ms p50 in some
stretches and 7.5-8.0 ms in others, within one process as well as between processes
(``benchmarks/README.md``, 2026-12-05/06), enough to swap two rows 1.3x apart. So before the
verdict names the fastest CPU row, the rows it chooses between are timed again in one process,
interleaved: round after round, each row ``iters`` runs in turn (the order rotated every round),
so a slow stretch of the host falls on all of them alike; benchmarking practice for comparing
two programs on a drifting machine (as ``benchmarks/harness_fidelity.py`` does).

The record (``results/<model>/ship_timing.json``) names the machine, the settings and, per row,
the file's SHA-256 and the row's ``provenance.time_utc``: :func:`annotate` applies it only to
the same rows measured on the same kind of machine, so a rerun row or a copied results folder
falls back to the rows' own figures.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np

from deploykit.timing import OtherCpu, busy_machine_note, interleaved_times
from deploykit.verdict import (INTERLEAVED, INTERLEAVED_BUSY, INTERLEAVED_INPUT, deploy_baselines,
                               verdicts)
from deploykit.sweep.report import p50_ms

#: Rounds of the interleaved loop (:func:`deploykit.timing.interleaved_times`); each row runs
#: :data:`ITERS` times per round.
ROUNDS = 8
ITERS = 20
#: Untimed runs of each row before the first round.
WARMUP = 10
#: Only the CPU EP group is re-timed: its rows ran on this host's CPU, which the re-timing can
#: reach; GPU rows need their device and are timed by the GPU's own clocks.
GROUP = "CPU EP"
FILE = "ship_timing.json"


def candidates(rows: list[dict], budget) -> list[dict]:
    """The CPU EP rows the verdict compares by speed: those within budget and the group's ORT
    FP32 baseline (speedups divide by it), each only while its file is here with the SHA-256
    its row recorded. Empty when fewer than two remain (another machine's results, files
    remade since).

    Args:
        rows: the report's run rows. budget: :class:`deploykit.verdict.Budget`.
    """
    vs = [v for v in verdicts(rows, budget) if v["group"] == GROUP]
    if not vs:
        return []
    picked = [r for r, j in vs[0]["judged"] if j.eligible]
    base = deploy_baselines(rows).get(GROUP)
    if base is not None and all(r is not base for r in picked):
        picked.append(base)
    picked = [r for r in picked if _same_file(r)]
    return picked if len(picked) >= 2 else []


def _recorded_sha(r: dict) -> str | None:
    """The SHA-256 the row recorded for the file it evaluated."""
    return ((r.get("measured_against") or {}).get("evaluated") or {}).get("sha256")


def _same_file(r: dict) -> bool:
    """The row's file is here and is the one the row measured (its recorded SHA-256)."""
    path, want = r.get("onnx"), _recorded_sha(r)
    if not path or not want or not Path(path).is_file():
        return False
    from deploykit.results import file_sha256

    return file_sha256(path) == want


def _row_key(r: dict) -> dict:
    return {"onnx": r.get("onnx"), "sha256": _recorded_sha(r),
            "row_time_utc": (r.get("provenance") or {}).get("time_utc")}


def retime(rows: list[dict], budget, model: str, rounds: int | None = None,
           iters: int | None = None, warmup: int | None = None,
           picked: list[dict] | None = None) -> dict | None:
    """Re-time :func:`candidates` interleaved on this machine, each file in an ORT CPU session
    made as its row made it (``runtime``: optimisation level, disabled optimizers, session
    config, threads), at the batch its row timed (``latency.batch``, 1 by default) on the
    samples its row timed: the first eval images of a classifier, the first samples of stage
    1's inputs (``ref_outputs.npz``: the model's own data, or its synthetic inputs) otherwise,
    seeded random inputs when that file is not here (said in ``input``). ``rounds``, ``iters``, ``warmup``: default :data:`ROUNDS`,
    :data:`ITERS`, :data:`WARMUP`.

    Returns:
        the record (see the module doc; ``rows: {tag: {"batch", "p50_ms", "round_p50_ms",
        "row_p50_ms", "onnx", "sha256", "row_time_utc"}}``), or None when there is nothing to
        compare or the rows were measured on another kind of machine.
    Raises:
        StageError: ORT cannot load or run one of the files.
    """
    from deploykit.envinfo import device_info
    from deploykit.feeds import load_feed
    from deploykit.layout import ref_outputs_path
    from deploykit.models import model_spec
    from deploykit.runners import OrtRunner

    picked = candidates(rows, budget) if picked is None else picked
    device = device_info()
    if not picked or any((r.get("provenance") or {}).get("device") != device for r in picked):
        return None
    rounds = ROUNDS if rounds is None else rounds
    iters = ITERS if iters is None else iters
    warmup = WARMUP if warmup is None else warmup
    classifier = model_spec(model).classifier
    ref = None if classifier else ref_outputs_path(model)
    ref = ref if ref is not None and ref.is_file() else None
    runners, calls, batches = [], {}, {}
    try:
        for r in picked:
            rt = r.get("runtime") or {}
            runner = OrtRunner(r["onnx"], "cpu", opt_level=rt.get("opt_level") or "all",
                               disabled_optimizers=rt.get("disabled_optimizers") or (),
                               threads=int(rt.get("threads") or 0),
                               session_config=rt.get("session_config") or None)
            runners.append(runner)
            # the batch its row timed
            n = batches[r["tag"]] = int((r.get("latency") or {}).get("batch") or 1)
            feed = load_feed(ref, model if classifier else None, n, r["onnx"])
            feed = runner.check_feed({k: v[:n] for k, v in feed.items()})
            calls[r["tag"]] = (lambda s, f: lambda: s.run(None, f))(runner.session, feed)
        with OtherCpu() as other:
            times = interleaved_times(calls, rounds, iters, warmup)
    finally:
        for runner in runners:
            runner.close()
    return {
        "what": "InferenceSession.run wall-clock (each row's latency batch) of the CPU EP rows "
                "the verdict ranks, interleaved in one process (order rotated each round)",
        "model": model, "device": device,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rounds": rounds, "iters": iters, "warmup": warmup, "other_cpu": other.result,
        "input": ("the first eval images" if classifier else
                  f"the first samples of {ref}" if ref else "seeded random inputs (synthetic)"),
        "rows": {r["tag"]: {"batch": batches[r["tag"]],
                            "p50_ms": float(np.median(times[r["tag"]])),
                            "round_p50_ms": [float(np.median(times[r["tag"]][i:i + iters]))
                                             for i in range(0, rounds * iters, iters)],
                            "row_p50_ms": p50_ms(r), **_row_key(r)} for r in picked},
    }


def annotate(rows: list[dict], record: dict | None) -> list[str]:
    """Put the record's interleaved p50 on the rows it measured (in memory, key
    :data:`deploykit.verdict.INTERLEAVED`; never written to a row's JSON): only on a row whose
    file SHA-256 and ``provenance.time_utc`` are the ones recorded and that was measured on the
    record's kind of machine, and only when at least two rows qualify.

    Returns:
        the tags annotated (empty: the rows' own p50s rank them).
    """
    for r in rows:
        for key in (INTERLEAVED, INTERLEAVED_INPUT, INTERLEAVED_BUSY):
            r.pop(key, None)
    if not isinstance(record, dict) or not isinstance(record.get("rows"), dict):
        return []
    hits = []
    for r in rows:
        ent = record["rows"].get(r.get("tag"))
        if (isinstance(ent, dict) and isinstance(ent.get("p50_ms"), (int, float))
                and {k: ent.get(k) for k in ("onnx", "sha256", "row_time_utc")} == _row_key(r)
                and (r.get("provenance") or {}).get("device") == record.get("device")):
            hits.append(r)
    if len(hits) < 2:
        return []
    for r in hits:
        r[INTERLEAVED] = float(record["rows"][r["tag"]]["p50_ms"])
        r[INTERLEAVED_INPUT] = str(record.get("input") or "")
        r[INTERLEAVED_BUSY] = busy_machine_note(record.get("other_cpu"))
    return [r["tag"] for r in hits]
