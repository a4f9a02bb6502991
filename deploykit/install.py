"""Installing a checked candidate file under its final name (atomic), or keeping a rejected
one beside it as ``<name>.rejected.onnx`` with its findings, never over an earlier good file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from deploykit.io import write_json


def rejected_path(path: Path) -> Path:
    """``fp32.onnx`` -> ``fp32.rejected.onnx`` (where a file that failed its checks is kept)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rejected{path.suffix}")


def stale_path(path: Path) -> Path:
    """``fp16.onnx`` -> ``fp16.stale.onnx``: where an earlier file is set aside when it no longer
    belongs to the files installed beside it (no stage and no report reads that name)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.stale{path.suffix}")


def install(candidate: Path, final: Path) -> None:
    """Move a checked ``candidate`` to its final name (atomic rename) and drop a stale
    ``.rejected`` copy and its reason, and a ``.stale`` copy (:func:`set_aside`)."""
    os.replace(candidate, final)
    for p in (rejected_path(final), rejected_path(final).with_suffix(".json"),
              stale_path(final)):
        p.unlink(missing_ok=True)


def set_aside(final: Path) -> Path | None:
    """Move an existing ``final`` to :func:`stale_path` (atomic rename, replacing an older stale
    copy): an earlier file made from another source (an FP16 file converted from an earlier
    ``fp32.onnx``) must not stay under its final name looking current. Nothing is deleted.

    Returns:
        the new path, or None when ``final`` did not exist.
    """
    final = Path(final)
    if not final.exists():
        return None
    dest = stale_path(final)
    os.replace(final, dest)
    return dest


def install_rejected(candidate: Path, final: Path, results: Sequence[dict]) -> Path:
    """Keep a failed ``candidate`` as ``<name>.rejected.onnx`` with ``<name>.rejected.json``
    (the failing results), never under ``final``; an earlier good ``final`` stays. A candidate
    that was never written leaves the reason only (``file`` None)."""
    rej = rejected_path(final)
    if Path(candidate).exists():
        os.replace(candidate, rej)
    else:  # the candidate was never written (its conversion failed): the reason alone
        rej.unlink(missing_ok=True)
    write_json(rej.with_suffix(".json"),
               {"file": str(rej) if rej.exists() else None, "final_name": str(final),
                "reason": [r for r in results if r["status"] == "fail"],
                "warnings": [r for r in results if r["status"] == "warn"]})
    return rej


def rejected_reason(final: Path) -> str | None:
    """Why ``final`` is not there: one line from ``<name>.rejected.json`` (the check, the node
    and the finding of the first failure, FP16-specific findings first), or None when no
    rejection is recorded beside it."""
    import json

    reason_file = rejected_path(final).with_suffix(".json")
    try:
        rec = json.loads(reason_file.read_text())
    except (OSError, ValueError):
        return None
    fails = sorted([r for r in rec.get("reason") or [] if isinstance(r, dict)],
                   key=lambda r: (r.get("check") == "batch_parity", bool(r.get("summary"))))
    if not fails:
        return f"{Path(final).name} was rejected by its checks ({reason_file})"
    r = fails[0]
    detail = " ".join(str(r.get("detail", "")).split()).split("blind to FP16 overflow): ")[-1]
    where = f" at {r['node']}" if r.get("node") else ""
    return (f"{Path(final).name} was rejected by 2_export_onnx.py's checks: {r.get('check')}"
            f"{where}: {detail[:240]} (all findings: {reason_file})")
