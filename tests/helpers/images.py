"""Helpers for the data tests: class folders of the embedded images."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.stages import ROOT


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    env.pop("VAL_ROOT", None)
    env.pop("ALLOW_CLASS_SUBSET", None)
    return {**env, **extra}


def _class_folders(root: Path, files, nested: str = "") -> Path:
    """``root/<WNID>/[nested/]<name>`` symlinks to embedded images."""
    for f in files:
        d = root / f.name[:9] / nested
        d.mkdir(parents=True, exist_ok=True)
        (d / f"val_{f.name}").symlink_to(f)
    return root
