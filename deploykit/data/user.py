"""A model's own data: ``--inputs`` evaluation samples, ``--labels``, and the reference inputs
stage 1 recorded (``ref_outputs.npz``) that every later stage of a model with its own inputs is
judged on.

The reference file holds ``in:<input name>`` and ``out:<output name>`` arrays (batch on axis 0),
``labels`` (int64 ``[N]``) when ``--labels`` was given, and ``meta:synthetic`` (bool): True when
stage 1 had no ``--inputs`` and ran on seeded N(0,1) samples of ``--input-shape``. Every
data-dependent check reads that flag: on synthetic inputs it warns and says so, never refuses.
"""
from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Sequence

import numpy as np

from deploykit.errors import StageError, UsageError
from deploykit.io import check_regular_file, load_npz

SYNTHETIC_KEY = "meta:synthetic"

LABELS_KEY = "labels"

SYNTHETIC_NOTE = ("synthetic inputs (seeded N(0,1) samples of --input-shape: no --inputs was "
                  "given to stage 1)")


def forward_arg_names(model) -> list[str]:
    """Names of ``model.forward``'s positional parameters, in order (``*args``/``**kwargs``
    left out)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def input_names(model, shapes: Sequence[tuple], keys: Sequence[str], flag: str = "--inputs"
                ) -> list[str]:
    """The model's input names, in ``forward()`` order, for samples keyed ``keys``.

    ``--input-shape`` names win when given; else the keys must be ``forward()``'s parameter
    names (any order), or one key for a one-argument ``forward()`` (the array then takes that
    argument's name, the name the ONNX export gives the input).

    Raises:
        UsageError: keys that are no parameter (or missing parameters), naming both lists and
            the ``np.savez`` call that fixes it.
    """
    if shapes:
        names = [n for n, _, _ in shapes]
        missing = [n for n in names if n not in keys]
        if missing and not (len(names) == 1 and len(keys) == 1):
            raise UsageError(f"{flag}: keys {sorted(keys)} lack {missing} (the names of "
                             "--input-shape): key each array by its input name")
        return names if not missing else [keys[0]]
    params = forward_arg_names(model)
    if set(keys) <= set(params):
        ordered = [p for p in params if p in keys]
        required = [p.name for p in inspect.signature(model.forward).parameters.values()
                    if p.name in params and p.default is inspect.Parameter.empty]
        lacking = [p for p in required if p not in keys]
        if lacking:
            raise UsageError(f"{flag}: forward() needs {required} but the file has only "
                             f"{sorted(keys)}: add {lacking} (np.savez(path, "
                             + ", ".join(f"{p}=..." for p in required) + "))")
        return ordered
    if len(keys) == 1 and len(params) <= 1:
        return params or list(keys)  # one array for a one-argument forward(): named after it
    raise UsageError(f"{flag}: keys {sorted(keys)} are not the names of forward()'s arguments "
                     f"{params}: save one array per argument (np.savez(path, "
                     + ", ".join(f"{p}=..." for p in params) + ")), or name them with "
                     "--input-shape NAME:DIMS in forward() order")


def load_inputs(path: Path | str, names: Sequence[str] | None = None,
                limit: int | None = None, flag: str = "--inputs") -> dict[str, np.ndarray]:
    """Samples of ``path`` (an ``.npz`` of ``{input name: array [N, ...]}``).

    Args:
        names: the arrays to keep, in this order (None: every array, as stored); a one-array
            file for a one-input model is renamed to that input.
        limit: keep the first ``limit`` samples.
    Returns:
        ``{name: array}``, every array with the same N >= 1 on axis 0.
    Raises:
        StageError: unreadable file. UsageError: missing names, 0-d arrays, sample counts that
            disagree, no samples.
    """
    data = load_npz(path, None, f"np.savez of your samples ({flag})", flag=flag, feed=True)
    if not data:
        raise UsageError(f"{flag} {path}: the file holds no array")
    if names is not None:
        if len(names) == 1 and len(data) == 1 and names[0] not in data:
            data = {names[0]: next(iter(data.values()))}
        missing = [n for n in names if n not in data]
        if missing:
            raise UsageError(f"{flag} {path}: keys {sorted(data)} lack the model inputs "
                             f"{missing}")
        data = {n: data[n] for n in names}
    for k, v in data.items():
        if v.ndim == 0 or not (np.issubdtype(v.dtype, np.number) or v.dtype == np.bool_):
            raise UsageError(f"{flag} {path}: array {k!r} ({v.dtype}, shape {list(v.shape)}) "
                             "is not a numeric array with the samples on axis 0")
    counts = {k: len(v) for k, v in data.items()}
    if len(set(counts.values())) != 1:
        raise UsageError(f"{flag} {path}: the arrays hold different numbers of samples "
                         f"{counts}: every input needs one row per sample on axis 0")
    n = next(iter(counts.values()))
    if n == 0:
        raise UsageError(f"{flag} {path}: 0 samples")
    if limit:
        data = {k: v[:limit] for k, v in data.items()}
    return data


def load_labels(path: Path | str, n: int, flag: str = "--labels") -> np.ndarray:
    """Class ids of ``n`` samples: ``.npy``, ``.npz`` with one array, or text with one integer
    per line (``#`` comments and blank lines skipped).

    Returns:
        int64 ``[n]`` (the first ``n`` of the file: ``--limit`` keeps the first samples).
    Raises:
        StageError: unreadable file. UsageError: not integers, negative, or fewer than ``n``.
    """
    path = check_regular_file(Path(path), flag)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such file")
    try:
        if path.suffix == ".npy":
            y = np.load(path, allow_pickle=False)
        elif path.suffix == ".npz":
            z = load_npz(path, None, f"np.savez of your labels ({flag})")
            if len(z) != 1:
                raise UsageError(f"{flag} {path}: expected one array of class ids, found "
                                 f"{sorted(z)}")
            y = next(iter(z.values()))
        else:
            lines = [ln.split("#")[0].strip().lstrip("\ufeff") for ln in
                     path.read_text(encoding="utf-8-sig", errors="strict").splitlines()]
            y = np.array([int(ln) for ln in lines if ln], dtype=np.int64)
    except (ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: not a list of integer class ids ({e})") from None
    except OSError as e:
        raise StageError(f"{flag} {path}: unreadable ({e})") from e
    y = np.asarray(y).reshape(-1)
    if not np.issubdtype(y.dtype, np.integer) or (y.size and y.min() < 0):
        raise UsageError(f"{flag} {path}: class ids must be integers >= 0 (got {y.dtype}"
                         + (f", min {y.min()}" if y.size else "") + ")")
    if len(y) < n:
        raise UsageError(f"{flag} {path}: {len(y)} labels for {n} samples: one per sample of "
                         "--inputs, in the same order")
    return y[:n].astype(np.int64)


def reference_inputs(ref_path: Path | str) -> tuple[dict[str, np.ndarray], bool,
                                                    np.ndarray | None]:
    """The inputs stage 1 ran the reference on.

    Returns:
        ``(feed {input name: array}, synthetic, labels int64 [N] or None)``; a reference written
        before the synthetic flag existed counts as synthetic when it has no labels.
    Raises:
        StageError: missing or unreadable file (names stage 1).
    """
    z = load_npz(ref_path, None, "1_pytorch_baseline.py")
    feed = {k[3:]: v for k, v in z.items() if k.startswith("in:")}
    synthetic = bool(z[SYNTHETIC_KEY]) if SYNTHETIC_KEY in z else True
    return feed, synthetic, z.get(LABELS_KEY)


def check_same_inputs(path: Path | str, ref_feed: dict[str, np.ndarray], flag: str,
                      rerun: str) -> None:
    """Refuse ``path`` unless its samples are the ones the reference was computed on (the first
    ``len(reference)`` samples of every array, bit for bit).

    Raises:
        UsageError: other inputs, naming the first array that differs and ``rerun``.
    """
    n = len(next(iter(ref_feed.values())))
    data = load_inputs(path, list(ref_feed), flag=flag)
    for k, ref in ref_feed.items():
        got = data[k][:n]
        if got.shape != ref.shape or got.dtype != ref.dtype or not np.array_equal(got, ref):
            raise UsageError(f"{flag} {path}: input {k!r} is not what stage 1's reference was "
                             f"computed on ({list(got.shape)} {got.dtype} vs "
                             f"{list(ref.shape)} {ref.dtype}, or other values): every row is "
                             f"judged against that reference, so rerun {rerun}")


def sample_digests(feed: dict[str, np.ndarray]) -> list[bytes]:
    """One digest per sample (row on axis 0) over every input's bytes, for finding the same
    sample in two sets whatever their order (BLAKE2b, 16 bytes)."""
    n = len(next(iter(feed.values())))
    out = []
    for i in range(n):
        h = hashlib.blake2b(digest_size=16)
        for k in sorted(feed):
            row = np.ascontiguousarray(feed[k][i])
            h.update(k.encode() + str(row.dtype).encode() + str(row.shape).encode())
            h.update(row.tobytes())
        out.append(h.digest())
    return out


def shared_samples(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> int:
    """How many samples of ``a`` are also samples of ``b`` (bit-identical on every input, any
    order; 0 when the two do not have the same inputs)."""
    if sorted(a) != sorted(b):
        return 0
    seen = set(sample_digests(b))
    return sum(d in seen for d in sample_digests(a))
