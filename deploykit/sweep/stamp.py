"""The up-to-date rule: when a rerun of the sweep may skip a pipeline.

After each pipeline the driver writes ``<out>/stamps/<id>.json`` holding

- ``key``: SHA-256 of the pipeline's provenance, :func:`pipeline_key`: its steps (model, target,
  variants, limit, every command and environment variable), the model's inputs (SHA-256 of the
  ``WEIGHTS`` file; of a custom factory's module source), ``VAL_ROOT``, and the code: the git
  commit plus the SHA-256 of ``git diff HEAD`` (tracked files, ``results/`` excluded), so an
  uncommitted edit counts as a change;
- ``status`` of the run, and the SHA-256 of each row file it collected into ``<out>/rows/<id>/``.

A pipeline is **up to date**, and skipped, when all hold (:func:`up_to_date`):

1. its stamp exists and says ``ok`` (a failed or unavailable pipeline always reruns);
2. the stamp's key equals the key computed now;
3. every row file the stamp lists is in ``<out>/rows/<id>/`` with the same SHA-256;
4. every row's own provenance ``git_sha`` (``HEAD`` + ``+dirty``, written by the stage) equals
   the checkout's now: rows computed by other code are never reused.

``--force`` reruns every pipeline whatever the stamps say.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from deploykit.sweep.plan import Pipeline

STAMP_VERSION = 1


def sha256_bytes(data: bytes) -> str:
    """SHA-256 hex digest of bytes.

    Args:
        data: the bytes.

    Returns:
        64 hex digits.
    """
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """SHA-256 hex digest of a file's content (read in 1 MiB blocks).

    Args:
        path: the file.

    Returns:
        64 hex digits.

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.decode(errors="replace") if p.returncode == 0 else None


def git_state(root: Path) -> dict:
    """The code a pipeline would run now.

    Args:
        root: the repository root.

    Returns:
        ``{"commit", "rows_git_sha", "diff_sha256"}``: HEAD (None without git history); the
        value stages record as ``provenance.git_sha`` (HEAD + ``+dirty`` when tracked files
        outside ``results/`` differ); SHA-256 of ``git diff HEAD`` over the same files.
    """
    spec = ["--", ".", ":(exclude)results"]
    sha = (_git(root, "rev-parse", "HEAD") or "").strip()
    if len(sha) != 40:
        return {"commit": None, "rows_git_sha": None, "diff_sha256": None}
    dirty = (_git(root, "status", "--porcelain", "--untracked-files=no", *spec) or "").strip()
    diff = _git(root, "diff", "HEAD", "--binary", *spec) or ""
    return {"commit": sha, "rows_git_sha": sha + ("+dirty" if dirty else ""),
            "diff_sha256": sha256_bytes(diff.encode())}


def factory_source(module: str, root: Path) -> Path | None:
    """The source file of a custom model's factory module, found without importing it.

    Args:
        module: ``package.module`` (the part of ``package.module:factory`` before the colon).
        root: the repository root (searched first, then ``PYTHONPATH``).

    Returns:
        the ``.py`` file (``mod.py`` or ``mod/__init__.py``), or None when not found.
    """
    rel = Path(*module.split("."))
    bases = [root] + [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for base in bases:
        for cand in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
            if cand.is_file():
                return cand
    return None


def model_inputs(pipeline: Pipeline, root: Path) -> dict:
    """SHA-256 of what the model is built from, beyond the checkout.

    Args:
        pipeline: the pipeline. root: the repository root.

    Returns:
        ``{"weights": {path: sha|"missing"}, "factory_source": {path: sha}|"not found: M",
        "VAL_ROOT": str|None}``.
    """
    m = pipeline.model
    out: dict = {"VAL_ROOT": os.environ.get("VAL_ROOT")}
    if m.weights:
        p = Path(m.weights)
        out["weights"] = {m.weights: sha256_file(p) if p.is_file() else "missing"}
    if m.custom:
        src = factory_source(m.name.split(":", 1)[0], root)
        out["factory_source"] = ({str(src): sha256_file(src)} if src else
                                 f"not found: {m.name.split(':', 1)[0]}")
    return out


def pipeline_key(pipeline: Pipeline, git: dict, inputs: dict) -> tuple[str, dict]:
    """The provenance key of a pipeline (module docstring: what it covers).

    Args:
        pipeline: the pipeline. git: :func:`git_state`. inputs: :func:`model_inputs`.

    Returns:
        ``(key, parts)``: the SHA-256 and the JSON-able parts it hashes.
    """
    d = pipeline.as_dict()
    parts = {"version": STAMP_VERSION,
             "pipeline": {k: d[k] for k in ("model", "target", "variants", "steps")},
             "inputs": inputs,
             "code": {"commit": git.get("commit"), "diff_sha256": git.get("diff_sha256")}}
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return sha256_bytes(blob), parts


def _diff_parts(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    changed = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += _diff_parts(a, b, f"{prefix}{k}.")
        elif a != b:
            changed.append(f"{prefix}{k}")
    return changed


def up_to_date(stamp: dict | None, key: str, parts: dict, rows_dir: Path,
               rows_git_sha: str | None) -> tuple[bool, str]:
    """Apply the up-to-date rule (module docstring) to one pipeline.

    Args:
        stamp: the stamp read from ``<out>/stamps/<id>.json``, or None.
        key: :func:`pipeline_key` now. parts: its parts (to name what changed).
        rows_dir: ``<out>/rows/<id>/``.
        rows_git_sha: :func:`git_state` ``["rows_git_sha"]`` now.

    Returns:
        ``(skip, reason)``: whether the pipeline is up to date, and why (or why not).
    """
    if not stamp:
        return False, "no stamp (never run by this sweep folder)"
    if stamp.get("version") != STAMP_VERSION:
        return False, f"stamp version {stamp.get('version')} != {STAMP_VERSION}"
    if stamp.get("status") != "ok":
        return False, f"last run {stamp.get('status')}"
    if stamp.get("key") != key:
        changed = _diff_parts(stamp.get("parts") or {}, parts)
        return False, "changed since the last run: " + (", ".join(changed[:6]) or "key")
    rows = stamp.get("rows") or {}
    if not rows:
        return False, "the last run left no rows"
    for name, sha in sorted(rows.items()):
        p = rows_dir / name
        if not p.is_file():
            return False, f"row {name} is missing from {rows_dir}"
        if sha256_file(p) != sha:
            return False, f"row {name} changed since the last run"
        try:
            row = json.loads(p.read_text())
        except ValueError:
            return False, f"row {name} is not JSON"
        recorded = (row.get("provenance") or {}).get("git_sha")
        if recorded != rows_git_sha:
            return False, f"row {name} was made by code {recorded}, the checkout is {rows_git_sha}"
    return True, f"up to date ({len(rows)} rows, code {rows_git_sha})"


def read_stamp(path: Path) -> dict | None:
    """Read a stamp file.

    Args:
        path: ``<out>/stamps/<id>.json``.

    Returns:
        its content, or None when missing or unreadable (then the pipeline reruns).
    """
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_stamp(path: Path, key: str, parts: dict, status: str, rows: dict[str, str],
                extra: dict | None = None) -> None:
    """Write a stamp atomically (temporary name, then rename).

    Args:
        path: ``<out>/stamps/<id>.json``. key, parts: :func:`pipeline_key`.
        status: the pipeline's status (``ok``, ``failed``, ...).
        rows: ``{row file name: SHA-256}`` of the rows collected.
        extra: more fields to record (wall time, time).

    Raises:
        OSError: the folder cannot be written.
    """
    write_atomic(path, json.dumps({"version": STAMP_VERSION, "key": key, "parts": parts,
                                   "status": status, "rows": rows, **(extra or {})}, indent=1))


def write_atomic(path: Path, data: str | bytes | None = None, writer=None) -> Path:
    """Write ``data`` (text or bytes), or what ``writer(binary file)`` writes, to ``path``
    atomically: through a fresh temporary file beside it (``tempfile.mkstemp``, written through
    its descriptor, so no planted name or link is ever followed), then renamed over ``path``
    (a link at ``path`` is replaced, not written through). The folder is created if needed.

    Raises:
        OSError: the folder cannot be written (the temporary file is removed; ``path`` as it was).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name[:64]}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if writer is not None:
                writer(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes it 0600: the file gets the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
