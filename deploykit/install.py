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


def install(candidate: Path, final: Path) -> None:
    """Move a checked ``candidate`` to its final name (atomic rename) and drop a stale
    ``.rejected`` copy and its reason."""
    os.replace(candidate, final)
    for p in (rejected_path(final), rejected_path(final).with_suffix(".json")):
        p.unlink(missing_ok=True)


def install_rejected(candidate: Path, final: Path, results: Sequence[dict]) -> Path:
    """Keep a failed ``candidate`` as ``<name>.rejected.onnx`` with ``<name>.rejected.json``
    (the failing results), never under ``final``; an earlier good ``final`` stays."""
    rej = rejected_path(final)
    os.replace(candidate, rej)
    write_json(rej.with_suffix(".json"),
               {"file": str(rej), "final_name": str(final),
                "reason": [r for r in results if r["status"] == "fail"],
                "warnings": [r for r in results if r["status"] == "warn"]})
    return rej
