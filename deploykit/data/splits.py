"""Calibration / evaluation (/ tuning) splits, disjoint by construction, and the preprocessed
uint8 cache keyed by everything that changes it (:data:`PREPROCESS_VERSION`, split, preprocessing).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.cli import progress_bar
from deploykit.io import require
from deploykit.data.images import load_image_rgb, preprocess_image
from deploykit.errors import StageError, UsageError
from deploykit.io import atomic_path, load_json, load_npz, sha256_file
from deploykit.layout import artifacts_dir, splits_path
from deploykit.models import ModelSpec


PREPROCESS_VERSION = 3  # bump when the preprocessing changes (3: EXIF orientation, strips); in every cache key


def make_splits(items: Sequence[tuple[str, int]], eval_per_class: int | None,
                calib_per_class: int, calib_fraction: float, seed: int
                ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Disjoint, seeded evaluation and calibration splits; the evaluation split is never empty.

    Rules, per class:
    - a class with several images gives ``min(calib_per_class, n - 1)`` of them (seeded
      permutation) to calibration, so it always keeps at least one for evaluation, and up to
      ``eval_per_class`` of the rest (all if None) to evaluation;
    - classes with a single image (the embedded sample: all of them) cannot give to both, so a
      seeded ``calib_fraction`` of those classes goes to calibration and the others to
      evaluation.
    On data that is entirely one or the other kind these are the rules used since the first
    release (same seeds, same splits).

    Returns:
        ``(eval_items, calib_items)``, each sorted, with no path in both.
    Raises:
        StageError: no items.
        UsageError: ``calib_fraction`` leaves no evaluation image (names the flag to lower).
    """
    if not items:
        raise StageError("no images to split")
    rng = np.random.default_rng(seed)
    by_class: dict[int, list[str]] = {}
    for p, c in items:
        by_class.setdefault(c, []).append(p)
    single = sorted(c for c, v in by_class.items() if len(v) == 1)
    several = sorted(c for c, v in by_class.items() if len(v) > 1)
    ev, ca = [], []
    if single:
        n_cal = int(round(calib_fraction * len(single)))
        cal_classes = set(rng.choice(single, size=n_cal, replace=False).tolist()
                          ) if n_cal else set()
        for c in single:
            (ca if c in cal_classes else ev).append((by_class[c][0], c))
    for c in several:
        paths = sorted(by_class[c])
        chosen = [paths[i] for i in rng.permutation(len(paths))]
        k = min(calib_per_class, len(paths) - 1)
        ca += [(p, c) for p in chosen[:k]]
        rest = chosen[k:]
        ev += [(p, c) for p in (rest if eval_per_class is None else rest[:eval_per_class])]
    if not ev:
        raise UsageError(f"--calib-fraction {calib_fraction} sends all {len(single)} "
                         "single-image classes to calibration and leaves no evaluation image: "
                         "lower --calib-fraction (0 evaluates every image)")
    return sorted(ev), sorted(ca)


def split_tuning(eval_items: Sequence[tuple[str, int]], tune_fraction: float, seed: int
                 ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Carve a seeded tuning split out of the evaluation items (mixed-precision search,
    ``auto_precision.py``): disjoint from evaluation and, since it comes from the evaluation
    items, from calibration too.

    Rules: of the classes that have one evaluation image, a seeded ``tune_fraction`` of those
    classes gives its image to tuning; a class with several evaluation images gives
    ``round(tune_fraction * n)`` of them (seeded) and always keeps one for evaluation. The
    random stream is separate from :func:`make_splits`' (``default_rng([seed, 1])``), so the
    calibration split is the same with or without a tuning split; ``tune_fraction == 0`` returns
    the items unchanged.

    Args:
        eval_items: ``[(relative path, class)]`` from :func:`make_splits`.
        tune_fraction: share of the evaluation images moved to tuning, in [0, 1).
    Returns:
        ``(eval_items, tune_items)``, each sorted.
    Raises:
        UsageError: ``tune_fraction`` outside [0, 1), or it would leave no evaluation image.
    """
    if not 0.0 <= tune_fraction < 1.0:
        raise UsageError(f"--tune-fraction {tune_fraction}: must be in [0, 1)")
    if tune_fraction == 0:
        return sorted(eval_items), []
    rng = np.random.default_rng([seed, 1])
    by_class: dict[int, list[str]] = {}
    for p, c in eval_items:
        by_class.setdefault(c, []).append(p)
    single = sorted(c for c, v in by_class.items() if len(v) == 1)
    ev, tu = [], []
    n_tune = int(round(tune_fraction * len(single)))
    chosen = set(rng.choice(single, size=n_tune, replace=False).tolist()) if n_tune else set()
    for c in single:
        (tu if c in chosen else ev).append((by_class[c][0], c))
    for c in sorted(c for c, v in by_class.items() if len(v) > 1):
        paths = sorted(by_class[c])
        order = [paths[i] for i in rng.permutation(len(paths))]
        k = min(int(round(tune_fraction * len(paths))), len(paths) - 1)
        tu += [(p, c) for p in order[:k]]
        ev += [(p, c) for p in order[k:]]
    if not ev:
        raise UsageError(f"--tune-fraction {tune_fraction} moves every evaluation image to the "
                         "tuning split: lower it (0.25 is the run_all.sh --auto-precision default)")
    return sorted(ev), sorted(tu)


def drop_content_duplicates(root: Path | str, eval_items: Sequence[tuple[str, int]],
                            calib_items: Sequence[tuple[str, int]]
                            ) -> tuple[list[tuple[str, int]], list[str]]:
    """Remove from ``eval_items`` every image whose bytes equal a calibration image's (the same
    file reachable under two names, e.g. symlinks or copies), so the splits are disjoint by
    content, not only by path.

    Returns:
        ``(kept eval items, dropped relative paths)``.
    """
    root = Path(root)
    seen = set()
    for rel, _ in calib_items:
        try:
            seen.add(sha256_file(root / rel))
        except OSError:
            continue
    kept, dropped = [], []
    for rel, c in eval_items:
        try:
            dup = sha256_file(root / rel) in seen
        except OSError:
            dup = False  # unreadable files are reported by the decoder later
        if dup:
            dropped.append(rel)
        else:
            kept.append((rel, c))
    return kept, dropped


def load_splits() -> dict:
    """Read ``artifacts/splits.json`` (written by 0_prepare_data.py).

    Raises:
        StageError: missing, or not a valid split file (named, with the rerun that fixes it).
    """
    path = require(splits_path(), "0_prepare_data.py")
    split = load_json(path, "0_prepare_data.py")
    if not isinstance(split, dict) or not all(isinstance(split.get(k), list)
                                              for k in ("eval", "calib")):
        raise StageError(f"{path} has no eval/calib lists: rerun 0_prepare_data.py")
    return split


def cache_key(split: dict, name: str, prep: dict) -> str:
    """Key of a preprocessing cache: data root, file list, split name, preprocessing."""
    h = hashlib.sha256(json.dumps({"root": split["data_root"], "items": split[name],
                                   "prep": prep, "v": PREPROCESS_VERSION},
                                  sort_keys=True).encode())
    return h.hexdigest()[:16]


def preprocess_items(root: Path | str, items: Sequence[tuple[str, int]], prep: dict,
                     desc: str = "preprocess") -> tuple[np.ndarray, list, list[tuple[str, str]]]:
    """Decode and preprocess ``items`` (paths relative to ``root``) to uint8.

    Unreadable images do not stop the run: they are returned by name in ``bad``.

    Returns:
        ``(x uint8 [N_good, 3, crop, crop], good_items, bad)`` with ``bad`` a list of
        ``(relative path, error message)``.
    """
    root = Path(root)
    x = np.empty((len(items), 3, prep["crop"], prep["crop"]), np.uint8)
    good, bad = [], []
    for rel, c in progress_bar(items, desc=desc, unit="img"):
        try:
            img = load_image_rgb(root / rel)
        except Exception as e:  # noqa: BLE001 - PIL raises OSError, UnidentifiedImageError, ...
            bad.append((rel, f"{type(e).__name__}: {e}"))
            continue
        x[len(good)] = preprocess_image(img, **prep)
        good.append((rel, c))
    return x[:len(good)], good, bad


def cache_path(split: dict, name: str, prep: dict) -> Path:
    """``artifacts/cache/<name>-<key>.npz`` for split ``name`` and preprocessing ``prep``."""
    return artifacts_dir() / "cache" / f"{name}-{cache_key(split, name, prep)}.npz"


def save_cache(split: dict, name: str, prep: dict, x: np.ndarray) -> Path:
    """Write the uint8 cache of split ``name`` (``x`` in the split's item order) atomically."""
    path = cache_path(split, name, prep)
    items = split[name]
    if len(x) != len(items):
        raise StageError(f"cache for {name}: {len(x)} images for {len(items)} items")
    with atomic_path(path) as tmp:
        np.savez(tmp, x=x, y=np.array([c for _, c in items], np.int64),
                 files=np.array([p for p, _ in items]))
    return path


def build_cache(split: dict, name: str, prep: dict) -> Path:
    """Preprocess split ``name`` (``eval``/``calib``) to a uint8 cache, if not already there.

    Returns:
        Path of the cache (see :func:`cache_path`) holding ``x`` uint8 ``[N,3,crop,crop]``,
        ``y`` int64 ``[N]`` and ``files``.
    Raises:
        StageError: an image cannot be decoded (named; rerun 0_prepare_data.py, which drops
        unreadable images from the split).
    """
    path = cache_path(split, name, prep)
    if path.exists():
        return path
    x, _, bad = preprocess_items(split["data_root"], split[name], prep, desc=f"preprocess {name}")
    if bad:
        raise StageError(f"cannot read {len(bad)} image(s) of split {name}: "
                         + "; ".join(f"{p} ({err})" for p, err in bad[:5])
                         + " - rerun 0_prepare_data.py, which drops unreadable images")
    return save_cache(split, name, prep, x)


def _read_cache(path: Path, split: dict, name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(x, y, files)`` of a cache file, checked against the split's items.

    Raises:
        StageError: unreadable (truncated) file or contents that do not match the split.
    """
    z = load_npz(path, ("x", "y", "files"), "0_prepare_data.py")
    x, y, files = z["x"], z["y"], [str(f) for f in z["files"]]
    if files != [p for p, _ in split[name]] or len(x) != len(files) or len(y) != len(files):
        raise StageError(f"{path} does not hold the {len(split[name])} images of split {name}")
    return x, y, files


def load_split(name: str, spec: ModelSpec, limit: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """uint8 images, labels and file names of split ``name`` for ``spec``'s preprocessing.

    A cache file that cannot be read (e.g. truncated by a full disk or a killed run) is named,
    deleted and rebuilt from the images.

    Args:
        name: ``eval``, ``calib`` or ``tune`` (made only by ``0_prepare_data.py
            --tune-fraction F``).
        limit: keep the first ``limit`` images (smoke runs); None keeps all.
    Returns:
        ``(x uint8 [N,3,crop,crop], y int64 [N], files)``.
    Raises:
        StageError: no split, an empty split (names the stage-0 flag that fills it), or images
            that cannot be decoded while rebuilding the cache.
    """
    split = load_splits()
    if name not in split and name != "tune":
        raise StageError(f"split {name!r} not in {splits_path()}: rerun 0_prepare_data.py")
    if name == "tune" and not split.get(name):
        raise StageError(f"{splits_path()} has no tuning split (the mixed-precision search "
                         "int8_auto needs one, disjoint from evaluation and calibration): rerun "
                         "python 0_prepare_data.py --tune-fraction 0.25, or bash run_all.sh "
                         "--auto-precision (either shrinks the evaluation split)")
    if not split[name]:
        flags = ("--calib-fraction (one image per class) or --calib-per-class" if name == "calib"
                 else "a lower --calib-fraction or --calib-per-class")
        raise StageError(f"split {name!r} in {splits_path()} is empty: rerun 0_prepare_data.py "
                         f"with {flags}")
    prep = spec.preprocessing()
    path = build_cache(split, name, prep)
    try:
        x, y, files = _read_cache(path, split, name)
    except StageError as e:
        print(f"WARNING: {e}; deleting and rebuilding the cache", file=sys.stderr)
        path.unlink(missing_ok=True)
        x, y, files = _read_cache(build_cache(split, name, prep), split, name)
    if limit:
        x, y, files = x[:limit], y[:limit], files[:limit]
    return x, y, files


# --------------------------------------------------------------------------------------------
# Reference logits
# --------------------------------------------------------------------------------------------
def align_reference(ref_path: Path | str, files: Sequence[str]
                    ) -> tuple[np.ndarray | None, np.ndarray]:
    """Reference logits of ``ref_logits.npz`` for ``files``, matched by file name.

    Returns:
        ``(logits float32 [M, C] of the matched files in order, or None if none matched,
        bool mask [len(files)] of the matched files)``.
    Raises:
        StageError: ``ref_path`` missing, truncated or without ``logits``/``files`` (named).
    """
    z = load_npz(ref_path, ("logits", "files"), "1_pytorch_baseline.py")
    logits, ref_files = z["logits"], [str(f) for f in z["files"]]
    index = {f: i for i, f in enumerate(ref_files)}
    mask = np.array([f in index for f in files], bool)
    if not mask.any():
        return None, mask
    return logits[[index[f] for f in np.asarray(files)[mask]]].astype(np.float32), mask
