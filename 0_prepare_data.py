#!/usr/bin/env python3
"""Stage 0: list the images, split them into disjoint evaluation / calibration sets, and fill the
uint8 preprocessing cache for the model's resize/crop.

Reads:  ``$VAL_ROOT`` (ImageNet val, class folders or flat + LOC_val_solution.csv) or, when unset,
        the embedded sample ``data/imagenet-sample-1k`` (1000 images, one per class).
Writes: ``artifacts/splits.json``, ``artifacts/cache/{eval,calib[,tune]}-<key>.npz``,
        ``results/<model>/data.json``.
Rerun:  ``python 0_prepare_data.py --model efficientnet_lite0``

Splits. With several images per class, each class gives ``--calib-per-class`` images (default
10) to calibration and up to ``--eval-per-class`` (default: all the rest) to evaluation. The
embedded sample has one image per class, so a seeded ``--calib-fraction`` of the *classes*
(default 0.1: 100 images) is held out for calibration and the other 900 images are evaluated.
``--calib-fraction 0`` evaluates all 1000 images and leaves no calibration split (stage 4 then
refuses to run). A class with only a few images always keeps one for evaluation, so the
evaluation split is never empty. Images that cannot be decoded are named and dropped, never a
crash mid-run.

Tuning split (only with ``--tune-fraction F``, default 0: none). The mixed-precision search of
``int8_auto`` (``auto_precision.py``) chooses which layers stay in float on images that are
neither evaluated nor used for calibration: a seeded fraction F of the evaluation images is moved
to a ``tune`` split (``deploykit.data.splits.split_tuning``; the calibration split does not change). This
shrinks the evaluation split, so every row of such a run is on fewer images:
``bash run_all.sh --auto-precision`` does it for the whole run (F = 0.25: 225 tuning, 675
evaluation images of the embedded sample).

Labels: every class folder, file-name prefix or CSV label must be one of the 1000 ImageNet WNIDs;
the class index is its position in that list. Data covering only some classes is refused unless
``--allow-class-subset`` (``ALLOW_CLASS_SUBSET=1``) is given.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from deploykit.cli import add_shared_args, check_positive, cli, stage_parser
from deploykit.data.images import list_images, unread_summary
from deploykit.data.splits import (
    drop_content_duplicates,
    make_splits,
    preprocess_items,
    save_cache,
    split_tuning,
)
from deploykit.errors import StageError, UsageError
from deploykit.io import check_writable, write_json
from deploykit.lock import lock_folders
from deploykit.layout import DEFAULT_DATA, artifacts_dir, model_results, splits_path
from deploykit.models import model_spec
from deploykit.results import provenance



def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    p.add_argument("--data-root", type=Path, default=os.environ.get("VAL_ROOT") or None,
                   help="image folder (default: $VAL_ROOT, else the embedded sample "
                        "data/imagenet-sample-1k)")
    p.add_argument("--labels-csv", type=Path, default=None,
                   help="ground-truth CSV for a flat folder (default: LOC_val_solution.csv found "
                        "beside or above the images)")
    add_shared_args(p, "model")
    p.add_argument("--eval-per-class", type=int, default=None,
                   help="evaluation images per class (default: all not used for calibration)")
    p.add_argument("--calib-per-class", type=int, default=10,
                   help="calibration images per class when classes have several images")
    p.add_argument("--calib-fraction", type=float, default=0.1,
                   help="fraction of classes held out for calibration on one-image-per-class data")
    p.add_argument("--tune-fraction", type=float, default=0.0,
                   help="fraction of the evaluation images moved to a tuning split for the "
                        "mixed-precision search (int8_auto); 0 = no tuning split. Shrinks the "
                        "evaluation split (run_all.sh --auto-precision uses 0.25)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split")
    p.add_argument("--limit", type=int, default=None,
                   help="smoke runs: keep the first N images of each split (the same images a "
                        "full split's --limit N would use), so no stage decodes more")
    p.add_argument("--allow-class-subset", action="store_true",
                   default=os.environ.get("ALLOW_CLASS_SUBSET", "") not in ("", "0"),
                   help="accept data that covers only some of the 1000 ImageNet classes (labels "
                        "stay the WNID's index in the full list; default from "
                        "$ALLOW_CLASS_SUBSET)")
    return p


def main(args: argparse.Namespace) -> dict:
    """Write the split and caches; return the summary dict written to ``data.json``."""
    started = time.time()
    check_positive(args, "limit")
    if not 0.0 <= args.calib_fraction < 1.0:
        raise UsageError("--calib-fraction must be in [0, 1)")
    if not 0.0 <= args.tune_fraction < 1.0:
        raise UsageError(f"--tune-fraction {args.tune_fraction}: must be in [0, 1) (0 = "
                         "no tuning split)")
    if args.calib_per_class < 0 or (args.eval_per_class is not None and args.eval_per_class < 1):
        raise UsageError("--calib-per-class must be >= 0 and --eval-per-class >= 1")
    root = Path(args.data_root) if args.data_root else DEFAULT_DATA
    spec = model_spec(args.model)
    if not spec.classifier:
        raise UsageError(f"--model {args.model} is not an ImageNet classifier "
                         f"({spec.preprocessing_from}): the image data stage does not apply; "
                         "its data are --inputs NPZ (stage 1) and --calib-inputs NPZ (stage 4), "
                         "or, for an ImageNet classifier, state its preprocessing with "
                         "--preprocess mean=..,std=..,crop=..")
    # Check the output folders before the long preprocessing, not after it.
    check_writable(artifacts_dir(), model_results(args.model))
    lock_folders(artifacts_dir(), model_results(args.model))  # one writer per folder
    unread: list[str] = []
    items, layout = list_images(root, args.labels_csv, args.allow_class_subset, unread)
    if unread:
        print(f"WARNING: {unread_summary(root, unread)}", file=sys.stderr)
    ev, ca = make_splits(items, args.eval_per_class, args.calib_per_class,
                         args.calib_fraction, args.seed)
    assert not {p for p, _ in ev} & {p for p, _ in ca}, "eval/calib overlap"
    counts: dict[int, int] = {}
    for _, c in items:
        counts[c] = counts.get(c, 0) + 1
    few = sum(1 for n in counts.values() if 1 < n <= args.calib_per_class)
    if few:
        print(f"note: {few} classes have 2..{args.calib_per_class} images (--calib-per-class "
              f"{args.calib_per_class}): each keeps one image for evaluation", file=sys.stderr)
    ev, dup = drop_content_duplicates(root, ev, ca)
    for rel in dup:
        print(f"WARNING: eval image {root / rel} has the same bytes as a calibration image: "
              "dropped from eval", file=sys.stderr)
    ev, tu = split_tuning(ev, args.tune_fraction, args.seed)
    if tu:
        ev, dup_t = drop_content_duplicates(root, ev, tu)
        for rel in dup_t:
            print(f"WARNING: eval image {root / rel} has the same bytes as a tuning image: "
                  "dropped from eval", file=sys.stderr)
        dup += dup_t
    assert not {p for p, _ in tu} & ({p for p, _ in ev} | {p for p, _ in ca}), "tune overlap"
    if args.limit:  # the first N of each sorted split: what load_split(limit=N) would use
        ev, ca, tu = ev[:args.limit], ca[:args.limit], tu[:args.limit]
    prep = spec.preprocessing()
    split = {"data_root": str(root.resolve()), "layout": layout, "seed": args.seed,
             "n_classes": len(counts), "class_subset": len(counts) < 1000,
             "eval_per_class": args.eval_per_class, "calib_per_class": args.calib_per_class,
             "calib_fraction": args.calib_fraction, "limit": args.limit, "n_listed": len(items),
             "tune_fraction": args.tune_fraction,
             "eval": [list(i) for i in ev], "calib": [list(i) for i in ca],
             "tune": [list(i) for i in tu], "unreadable": [], "unread_format": unread,
             "eval_dropped_same_bytes_as_calib": dup}
    caches = {}
    for name in ("eval", "calib", "tune"):
        if not split[name]:
            continue
        x, good, bad = preprocess_items(root, [tuple(i) for i in split[name]], prep,
                                        desc=f"preprocess {name}")
        for rel, err in bad:
            print(f"WARNING: unreadable image dropped from {name}: {root / rel}: {err}",
                  file=sys.stderr)
        split["unreadable"] += [{"file": rel, "split": name, "error": err} for rel, err in bad]
        split[name] = [list(i) for i in good]
        caches[name] = (x, good)
    if not split["eval"]:
        raise StageError(f"no readable evaluation image in {root} (see the warnings "
                         "above); the previous splits.json is unchanged")
    # Caches first, then the split that names them: a failure leaves the previous pair intact.
    for name, (x, _) in caches.items():
        save_cache(split, name, prep, x)
    write_json(splits_path(), split)
    summary = {"stage": "0_prepare_data", "data_root": str(root), "layout": layout,
               "n_listed": len(items), "n_classes": len(counts), "n_eval": len(split["eval"]),
               "n_calib": len(split["calib"]), "n_tune": len(split["tune"]),
               "tune_fraction": args.tune_fraction,
               "n_unreadable": len(split["unreadable"]),
               "n_unread_format": len(unread), "unread_format": unread[:100],
               "n_eval_dropped_duplicates": len(dup),
               "eval_classes": len({c for _, c in split["eval"]}),
               "calib_classes": len({c for _, c in split["calib"]}),
               "preprocessing": prep,
               "provenance": provenance(args, [splits_path()], started)}
    write_json(model_results(args.model) / "data.json", summary)
    print(f"data: {layout} {root}: {summary['n_eval']} eval / {summary['n_calib']} calib images"
          + (f" / {summary['n_tune']} tuning" if summary["n_tune"] else "")
          + f", {summary['n_unreadable']} unreadable"
          + (f", {len(unread)} in a format not read" if unread else "")
          + f" -> {splits_path()}")
    return summary


if __name__ == "__main__":
    cli(get_args_parser, main)
