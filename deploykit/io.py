"""File I/O with the pipeline's guarantees: atomic writes (temporary name, then rename), JSON,
SHA-256, the one checked ``.npz`` reader (:func:`load_npz`), writable-folder checks and sizes (MB).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import stat
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any, Sequence
import numpy as np

from deploykit.errors import StageError


def check_writable(*folders: Path | str) -> None:
    """Make sure each folder exists (created if needed) and a file can be created in it, before
    any long work starts.

    Creates and removes a small probe file, which also catches read-only mounts and folders that
    ``os.access`` reports writable for root.

    Raises:
        StageError: naming the folder, the operating system's reason and the fix.
    """
    for folder in folders:
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
                pass
        except OSError as e:
            raise StageError(
                f"cannot {'write to' if folder.is_dir() else 'create'} {folder} "
                f"({e.strerror or type(e).__name__}"
                f"{': ' + str(e.filename) if e.filename and Path(e.filename) != folder else ''})"
                f": make it writable, or point ARTIFACTS / RESULTS at a writable folder "
                "(nothing was changed)") from e


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------
# errno values that mean "this write cannot succeed here" (as opposed to a bug in the writer).
_WRITE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EFBIG: "the file size limit is exceeded (ulimit -f)",
                 errno.EROFS: "the file system is read-only",
                 errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}


def _write_failure(path: Path, e: OSError) -> StageError:
    """A :class:`StageError` naming the final ``path`` of a failed write, the free space left
    there (for a full disk or quota) and what to do."""
    why = _WRITE_ERRNOS.get(e.errno, e.strerror or str(e))
    keep = (f"; the previous {path.name} is unchanged" if path.exists() else
            "; nothing was written under that name")
    free = ""
    with contextlib.suppress(OSError, StopIteration):
        usage = shutil.disk_usage(next(p for p in (path.parent, *path.parents) if p.is_dir()))
        free = f"{usage.free / 1e6:.0f} MB free of {usage.total / 1e9:.1f} GB there; "
    fix = (f"free some space ({free}df -h {shlex.quote(str(path.parent))}) or point ARTIFACTS / "
           "RESULTS at another disk" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else
           "make the folder writable or point ARTIFACTS / RESULTS elsewhere")
    return StageError(f"cannot write {path}: {why} [{errno.errorcode.get(e.errno, e.errno)}]"
                      f"{keep}: {fix}, then rerun")


def disk_full_error(e: OSError, folders: Sequence[Path] = ()) -> StageError | None:
    """A :class:`StageError` for an ``OSError`` that means the disk (or quota, or file-size
    limit) is full, naming the file (``e.filename``; else ``folders``, the ARTIFACTS and RESULTS
    folders) and the free space; None for other errors. Used by :func:`deploykit.cli.cli` for
    writes outside :func:`atomic_path`."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    if e.filename:
        return _write_failure(Path(e.filename), e)

    where = []
    for d in dict.fromkeys(Path(f) for f in folders):
        with contextlib.suppress(OSError, StopIteration):
            usage = shutil.disk_usage(next(p for p in (d, *d.parents) if p.is_dir()))
            where.append(f"{d}: {usage.free / 1e6:.0f} MB free")
    return StageError(f"a write failed: {_WRITE_ERRNOS[e.errno]} "
                      f"[{errno.errorcode[e.errno]}] ({'; '.join(where) or 'free space unknown'})"
                      ": free some space (df -h) or point ARTIFACTS / RESULTS at another disk, "
                      "then rerun; files written before stay as they were")


@contextlib.contextmanager
def atomic_path(path: Path | str):
    """Yield a temporary path beside ``path``; rename it to ``path`` only if the block succeeds.

    An interrupted or failed stage therefore never leaves a half-written artifact that the next
    stage would read, and an earlier good ``path`` stays as it was. The temporary path is
    ``<folder>/.tmp-<name>.<random>/<name>``: a fresh private folder (``tempfile.mkdtemp``, mode
    0700) made beside ``path``, so no name can be planted in advance (a symlink at a predictable
    temporary name would make the writer overwrite what it points to) and the temporary file
    keeps the final name and suffix (writers that check it, np.savez and onnx.save, behave as for
    the final name). The rename replaces a link at ``path`` itself, never what it points to.
    Anything else the block writes into the private folder is removed with it.

    Raises:
        StageError: the folder cannot be created or the write fails for lack of space, quota,
            file-size limit or permission (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EROFS``,
            ``EACCES``, ``EPERM``); the message names ``path`` (and the free space for a full
            disk). Other errors propagate.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name[:64]}."))
    except OSError as e:
        raise _write_failure(path, e) from e
    tmp = work / path.name
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in _WRITE_ERRNOS and (e.filename is None or
                                         Path(e.filename) in (tmp, work, path, path.parent)):
            raise _write_failure(path, e) from e
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_path` and return the path.

    Raises:
        StageError: as :func:`atomic_path`.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return path


def write_json(path: Path | str, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (NaN/inf written as null)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_jsonable(obj), indent=2,
                       sort_keys=False, allow_nan=False) + "\n")
    return path


def load_json(path: Path | str, producer: str | None = None) -> Any:
    """Parse a JSON file.

    Raises:
        StageError: missing, unreadable or not valid JSON; names the file (and ``producer``,
            the command that rewrites it, when given).
    """
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StageError(f"{path} is unreadable ({type(e).__name__}: {e})"
                         + (f": rerun {producer}" if producer else "")) from e


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def check_regular_file(path: Path | str, flag: str | None = None) -> Path:
    """Refuse ``path`` unless it is a regular file (links followed), before anything opens it:
    reading a FIFO blocks until some writer appears, a device (``/dev/zero``) never ends.

    Args:
        path: the file given. flag: the option that named it (``--inputs``), for the message.
    Returns:
        ``Path(path)``.
    Raises:
        StageError: ``path`` is a folder, FIFO, device or socket (named, with the fix). A
            missing path is left to the caller (:func:`require` names its producer).
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        return path
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _FILE_KINDS if test(mode)), "not a regular file")
        raise StageError(f"{flag + ' ' if flag else ''}{path} is {kind}, not a regular file: "
                         "pass the file itself (copy a stream to a file first); nothing was read")
    return path


def require(path: Path | str, producer: str) -> Path:
    """Return ``path`` if it exists, else raise StageError naming the stage that makes it.

    Args:
        path: an artifact this stage reads (a file, or a folder).
        producer: the command that writes it, e.g. ``"2_export_onnx.py"``.
    Returns:
        ``Path(path)``.
    Raises:
        StageError: ``path`` does not exist, or is a FIFO, device or socket (reading one blocks
            until a writer appears, or never ends: refused before anything opens it).
    """
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path} missing: run {producer} first")
    mode = path.stat().st_mode
    kind = next((k for test, k in _FILE_KINDS if test(mode) and test is not stat.S_ISDIR), None)
    if kind:
        raise StageError(f"{path} is {kind}, not a regular file: pass the file itself (copy a "
                         f"stream to a file first; {producer} writes it); nothing was read")
    return path


# dtype kinds an input array may have: bool, signed/unsigned int, float
_NUMERIC_KINDS = "biuf"


def load_npz(path: Path | str, keys: Sequence[str] | None, producer: str, *,
             flag: str | None = None, feed: bool = False, data: bytes | None = None
             ) -> dict[str, np.ndarray]:
    """Read arrays ``keys`` (None: all) of an ``.npz`` file completely (no pickles): the one
    checked reader of every ``.npz`` the pipeline is given or writes.

    Args:
        path: the file. keys: arrays that must be there. producer: the command that rewrites
            the file (or how to write it), named in the error. flag: the option that named
            the file (``--inputs``), named in the error. feed: the arrays are model inputs
            with samples on axis 0: each must be numeric (bool/int/float), non-empty, of rank
            >= 1, finite (no NaN/Inf), and all must hold the same number of samples.
            data: the file's bytes, already read (parsed instead of reading ``path``; ``path``
            is still named).
    Returns:
        ``{key: array}``.
    Raises:
        StageError: one line naming the file (and ``flag``) and the fix: the file is missing,
            not a regular file (FIFO, device: :func:`check_regular_file`), truncated, corrupt,
            not an npz, has an oversized header, holds an object (pickled) array or lacks a
            key; with ``feed``, an array that is not numeric, is empty or a scalar, or sample
            counts that disagree.
    """
    path = Path(path)
    label = f"{flag} {path}" if flag else str(path)
    if data is None:
        check_regular_file(path, flag)
        require(path, producer)
    src = io.BytesIO(data) if data is not None else path
    key = None
    try:
        z = np.load(src, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise StageError(f"{label} is a single .npy array, not an .npz: write it with "
                             f"np.savez(path, <name>=array, ...) ({producer})")
        with z:
            names = set(z.files)
            keys = list(z.files) if keys is None else keys
            out = {}
            for key in keys:
                if key in names:
                    out[key] = z[key]
    except StageError:
        raise
    except ValueError as e:
        what = str(e)
        if "header" in what.lower() and "max_header_size" in what:
            raise StageError(f"{label}: array {key!r} has an oversized .npy header ({what[:120]}"
                             f"): not loaded; rewrite it with np.savez ({producer})") from e
        if "allow_pickle" in what and key is None:  # np.load itself: neither zip nor .npy
            raise StageError(f"{label} is not an .npz file (no zip archive, no .npy header; "
                             "numpy would read it as a pickle, not loaded): write it with "
                             f"np.savez(path, <name>=array, ...) ({producer})") from e
        if "allow_pickle" in what:
            raise StageError(f"{label}: array {key!r} is an object array (pickled Python objects,"
                             " not loaded: allow_pickle=False): save plain numeric arrays, e.g. "
                             f"np.savez(path, {key}=np.asarray(x, np.float32)) ({producer})"
                             ) from e
        raise StageError(f"{label} is unreadable (ValueError: {what[:200]}); it is truncated or "
                         f"corrupt: rerun {producer} to rewrite it") from e
    except (OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise StageError(f"{label} is unreadable ({type(e).__name__}: {e}); it is truncated or "
                         f"corrupt: rerun {producer} to rewrite it") from e
    missing = [k for k in keys if k not in out]
    if missing:
        raise StageError(f"{label} lacks {missing} (has {sorted(names)}): rerun {producer}")
    if feed:
        check_feed(out, label, producer)
    return out


def check_feed(arrays: dict[str, np.ndarray], label: str, producer: str) -> None:
    """Check model inputs read from ``label``: numeric (bool/int/float), non-empty, rank >= 1,
    finite (a float array with NaN/Inf is refused), the same number of samples (axis 0) in every
    array.

    Raises:
        StageError: naming ``label``, the array and the fix (``producer``: how to rewrite it).
    """
    if not arrays:
        raise StageError(f"{label} holds no arrays: save one per model input ({producer})")
    for k, v in arrays.items():
        if v.dtype.kind not in _NUMERIC_KINDS:
            raise StageError(f"{label}: array {k!r} has dtype {v.dtype} (not numeric): save it "
                             f"as the model input's dtype, e.g. float32 ({producer})")
        if v.ndim == 0:
            raise StageError(f"{label}: array {k!r} is a scalar: save samples with the batch on "
                             f"axis 0, shape [N, ...] ({producer})")
        if v.size == 0:
            raise StageError(f"{label}: array {k!r} is empty (shape {list(v.shape)}): save at "
                             f"least one sample ({producer})")
        if v.dtype.kind in "fc" and not np.isfinite(v).all():
            bad = ~np.isfinite(v.reshape(len(v), -1)).all(axis=1)
            raise StageError(f"{label}: array {k!r} holds NaN/Inf in {int(bad.sum())} of {len(v)} "
                             f"samples (first: sample {int(np.argmax(bad))}): a reference, a "
                             "calibration or a parity on them is meaningless; drop or fix those "
                             f"samples ({producer})")
    counts = {k: len(v) for k, v in arrays.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{k}: {n}" for k, n in counts.items())
        raise StageError(f"{label}: arrays disagree on the number of samples (axis 0; {listed}): "
                         f"save the same samples for every input ({producer})")


# --------------------------------------------------------------------------------------------
# Leftovers of killed runs
# --------------------------------------------------------------------------------------------
# Temporary names this pipeline makes in its own folders (a killed run leaves them behind):
# atomic_path / mkstemp (".tmp-*"), stage 2's candidate folder, stage 5's work folder (which
# also holds ModelOpt's intermediates), the write probes of check_writable.
LEFTOVER_PATTERNS = (".tmp-*", ".stage2-*", ".write-probe-*")
# the process id in a name: "<prefix>pid<N>." (stage 2 and 5 folders), ".tmp-<N>-" (old names)
_PID_IN_NAME = re.compile(r"^\.(?:stage2-pid|tmp-5_quantize\.pid|tmp-)(\d+)[.-]")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _held_paths() -> set[str]:
    """Every path a process of this machine has open or runs in (``/proc/<pid>/fd``, ``cwd``)."""
    held: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        for link in [proc / "cwd", *((proc / "fd").iterdir() if (proc / "fd").is_dir() and
                                     os.access(proc / "fd", os.R_OK) else [])]:
            with contextlib.suppress(OSError):
                held.add(os.readlink(link))
    return held


def remove_leftovers(folder: Path | str, before: float,
                     patterns: Sequence[str] = LEFTOVER_PATTERNS) -> list[Path]:
    """Remove the temporary files and folders a killed run left in ``folder`` (one of the
    pipeline's own folders; not recursive), after a successful run of the stage that makes them.

    Only names matching ``patterns`` (:data:`LEFTOVER_PATTERNS`) are considered, and one is
    removed only if it is older than ``before`` (this run's start, ``time.time()``), belongs to
    this user, is not a symbolic link, its name's process id (where it has one) is not a live
    process, and no live process has a file open in it or runs in it (``/proc``).

    Returns:
        the paths removed (the caller names them). Errors while removing are ignored.
    """
    folder = Path(folder)
    cands = []
    for pattern in patterns:
        for p in folder.glob(pattern):
            with contextlib.suppress(OSError):
                st = p.lstat()
                if (stat.S_ISLNK(st.st_mode) or st.st_mtime >= before
                        or st.st_uid != os.getuid()):
                    continue
                m = _PID_IN_NAME.match(p.name)
                if m and int(m.group(1)) != os.getpid() and _pid_alive(int(m.group(1))):
                    continue
                cands.append(p)
    if not cands:
        return []
    held = _held_paths()
    removed = []
    for p in cands:
        prefix = str(p.resolve())
        if any(h == prefix or h.startswith(prefix + os.sep) for h in held):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        if not os.path.lexists(p):
            removed.append(p)
    return removed


def report_leftovers(removed: Sequence[Path]) -> None:
    """Print one line naming what :func:`remove_leftovers` removed (nothing when empty)."""
    if removed:
        print(f"removed {len(removed)} leftover(s) of an interrupted run: "
              + ", ".join(str(p) for p in removed[:5]) + (" ..." if len(removed) > 5 else ""))


def file_size_mb(path: Path | str) -> float:
    """Size in MB (1e6 bytes) of a file plus its ONNX external-data file, if any."""
    path = Path(path)
    total = path.stat().st_size
    ext = path.with_name(path.name + ".data")
    if ext.exists():
        total += ext.stat().st_size
    return total / 1e6
