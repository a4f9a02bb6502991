"""Result rows: the self-describing record of one measurement (stage, backend, precision,
provenance: arguments, versions, device, git SHA, input hashes) and its atomic write that never
replaces a good row by a failed one.
"""
from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from deploykit.envinfo import device_info, git_sha, versions
from deploykit.io import sha256_file, write_json
from deploykit.layout import check_row_tag, model_results, result_sidecars, safe_name


def provenance(args: Any, inputs: Sequence[Path | str] = (), started: float | None = None,
               torch_device: str | None = None) -> dict:
    """Everything needed to reproduce a result: args, command line, versions, device, git SHA,
    UTC time, SHA-256 of input files and the stage's wall time (s)."""
    hashes = {}
    for p in inputs:
        p = Path(p)
        if p.is_file():
            hashes[str(p)] = sha256_file(p)
    return {
        "args": {k: v for k, v in vars(args).items()} if args is not None else {},
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + sys.argv[1:]),
        "versions": versions(),
        "device": device_info(torch_device),
        "git_sha": git_sha(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "input_sha256": hashes,
        "wall_time_s": round(time.time() - started, 3) if started else None,
    }


def result_record(stage: str, backend: str, precision: str, model: str, tag: str,
                  status: str = "ok", reason: str | None = None, **fields) -> dict:
    """A results row, as ``8_report.py`` reads it.

    Args:
        stage: script name, e.g. ``3_onnx_eval``. backend: ``PyTorch``, ``ORT``, ``TensorRT``.
        precision: ``FP32``, ``FP16``, ``INT8``, ``INT4`` (with a variant suffix if needed).
        tag: unique row id within the model (file name ``results/<model>/<tag>.json``).
        status: ``ok``, ``skipped`` (could not run here: reason says why) or ``failed``.
        fields: ``n_images``, ``accuracy`` {top1, top5}, ``latency`` (:func:`latency_stats`),
            ``size_mb``, ``parity`` (:func:`parity`), ``ep_requested``/``ep_used``, ...
    """
    return {"stage": stage, "backend": backend, "precision": precision, "model": model,
            "tag": tag, "status": status, "reason": reason, **fields}


def _row_status(path: Path) -> str | None:
    """``status`` of an existing results row (None when absent or unreadable)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec.get("status") if isinstance(rec, dict) else None


def write_result(model: str, tag: str, record: dict, keep_good: bool = True) -> Path:
    """Write ``results/<model>/<tag>.json`` atomically and return the path written.

    An earlier good row is never replaced by a failure: when ``record`` is not ``ok`` and
    ``<tag>.json`` holds an ``ok`` row, the record goes to ``<tag>.<status>.json`` beside it
    (the report shows both) and a note says so. An ``ok`` record removes such leftovers.

    Args:
        keep_good: False when the failed run already replaced the artifact the good row
            describes (e.g. an engine rebuilt and then rejected by a check): the row must then
            describe the file on disk and is replaced.
    Raises:
        UsageError: ``tag`` is not a plain file name or names a file that is no row
            (:func:`check_row_tag`).
    """
    path = model_results(model) / f"{check_row_tag(model, tag)}.json"
    status = record.get("status")
    if keep_good and status != "ok" and _row_status(path) == "ok":
        side = path.with_name(f"{tag}.{safe_name(str(status), 'status')}.json")
        write_json(side, record)
        print(f"note: {path} holds a good row of an earlier run: kept; this {status} run is "
              f"recorded in {side.name} (the report lists both)", file=sys.stderr)
        return side
    write_json(path, record)
    if status == "ok" or not keep_good:
        for side in result_sidecars(model, tag):
            side.unlink(missing_ok=True)
    return path
