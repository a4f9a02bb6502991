#!/usr/bin/env python3
"""Stage 4: calibration data for ModelOpt, keyed to the ONNX model's input names, checked
against the model and against the evaluation data before any quantizer sees it.

Image classifiers: the calibration split (never an eval image), preprocessed exactly as
evaluation (``deploykit.data.splits.load_split`` + ``deploykit.data.images.normalize``). A model
with its own data: ``--calib-inputs NPZ`` (your calibration samples, one array per input name,
batch on axis 0; never stage 1's evaluation samples) or ``--random N`` (N seeded samples from the
generator stage 1 uses for synthetic inputs: structure runs only, never an accuracy claim).

Every input of the model gets an array (read from the ONNX graph with ``deploykit.onnx.graph.graph_inputs``).
The samples are shuffled with ``--seed`` (the order is recorded: it decides which samples share
a calibration batch when stage 5 calibrates in several batches). Before writing, the data are
validated (``deploykit.quant.calibration.validate_calibration``): keys equal the model's input names, shapes and
dtypes fit, no NaN/Inf, and per-input mean/std/range are close to the evaluation data's (the
eval split through the same preprocessing; for other models stage 1's reference inputs), so
swapped or unnormalised inputs are refused with the numbers.

Reads:  ``artifacts/<model>/onnx/fp32.onnx`` (2_export_onnx.py); classifiers:
        ``artifacts/splits.json`` + caches (0_prepare_data.py); other models: ``--inputs`` and
        ``artifacts/<model>/ref_outputs.npz`` (1_pytorch_baseline.py, for the statistics check).
Writes: ``artifacts/<model>/calib.npz`` (``{<input name>: [N, ...]}``),
        ``results/<model>/calib.json`` (source, order seed, per-input statistics, sha256 of the
        npz, provenance).
Rerun:  ``python 4_make_calib.py --model efficientnet_lite0``;
        ``python 4_make_calib.py --model pkg.mod:factory --inputs my_calib.npz``

The stage refuses to run (exit 1) when any calibration file is also an evaluation file, so a
quantized model is never calibrated on the images it is scored on.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from deploykit.layout import calib_path, fp32_onnx_path, ref_outputs_path
from deploykit.data.user import load_inputs, reference_inputs, shared_samples
from deploykit.io import load_npz
from deploykit.cli import add_shared_args, check_positive, cli, stage_parser
from deploykit.io import require
from deploykit.data.images import normalize
from deploykit.data.splits import load_split, load_splits
from deploykit.errors import StageError, UsageError
from deploykit.io import (atomic_path, remove_leftovers, report_leftovers, sha256_file,
                          write_json)
from deploykit.layout import model_artifacts, model_results, splits_path
from deploykit.lock import lock_folders
from deploykit.models import ModelSpec, example_inputs, model_spec
from deploykit.onnx.graph import graph_inputs, load_onnx
from deploykit.quant.calibration import calibration_reference, validate_calibration
from deploykit.results import provenance



def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    add_shared_args(p, "model")
    p.add_argument("--onnx", type=Path, default=None,
                   help="ONNX model whose inputs key the npz (default: "
                        "artifacts/<model>/onnx/fp32.onnx)")
    p.add_argument("--output", type=Path, default=None,
                   help="output npz (default: artifacts/<model>/calib.npz)")
    p.add_argument("--limit", type=int, default=None,
                   help="use the first N calibration samples only (default: all)")
    p.add_argument("--calib-inputs", "--inputs", dest="inputs", type=Path, default=None,
                   metavar="NPZ",
                   help="models with their own data: npz of calibration samples keyed by input "
                        "name (batch on axis 0; never the evaluation samples)")
    p.add_argument("--random", type=int, default=None, metavar="N",
                   help="custom models: N seeded random samples (stage 1's generator; structure "
                        "runs only)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sample order (and of --random's generator)")
    p.add_argument("--no-stats-check", action="store_true",
                   help="do not compare the per-input statistics with the evaluation data "
                        "(recorded; use when the evaluation inputs are not representative)")
    return p


def model_inputs(path: Path) -> list[tuple[str, list[int | None], np.dtype]]:
    """Every real input of an ONNX model: ``[(name, dims (None = dynamic), numpy dtype)]``.

    Raises:
        StageError: the model cannot be read or has no input.
    """
    inputs = graph_inputs(load_onnx(path, external=False))
    if not inputs:
        raise StageError(f"{path}: the model has no graph input to calibrate")
    return inputs


def check_disjoint(split: dict) -> None:
    """Raise StageError if a calibration file is also an evaluation file.

    Args:
        split: the dict of ``artifacts/splits.json`` (``eval``/``calib`` lists of
            ``[relative path, class]``).
    """
    ev = {p for p, _ in split.get("eval", [])}
    both = sorted(p for p, _ in split.get("calib", []) if p in ev)
    if both:
        raise StageError(f"{len(both)} calibration image(s) are also evaluation images "
                         f"(first: {both[0]}); rerun 0_prepare_data.py")


def classifier_data(args, spec, inputs) -> tuple[dict[str, np.ndarray], dict]:
    """Calibration split of an image classifier, preprocessed as evaluation.

    Returns:
        ``({input name: float [N, 3, crop, crop]}, record fields)``.
    Raises:
        UsageError: the model has more than one input, or --inputs/--random were given.
        StageError: the split is missing or overlaps the eval split.
    """
    if args.inputs or args.random:
        raise UsageError(f"--model {args.model} is an image classifier: its calibration "
                         "data is the calibration split; --calib-inputs/--random are for "
                         "models with their own data")
    if len(inputs) != 1:
        raise UsageError(f"--model {args.model}: the ONNX has {len(inputs)} inputs "
                         f"({[i[0] for i in inputs]}); an image classifier takes one")
    require(splits_path(), "0_prepare_data.py")
    split = load_splits()
    check_disjoint(split)
    x_u8, _, files = load_split("calib", spec, args.limit)
    if {p for p, _ in split["eval"]} & set(files):  # what is really used, not only the split
        raise StageError("calibration cache holds evaluation images: rerun "
                         "0_prepare_data.py")
    name, _, dtype = inputs[0]
    x = normalize(x_u8, spec.mean, spec.std).astype(dtype)
    return {name: x}, {"source": "calibration split", "files": files,
                       "preprocessing": {**spec.preprocessing(), "mean": spec.mean,
                                         "std": spec.std}}


def custom_data(args, inputs) -> tuple[dict[str, np.ndarray], dict]:
    """Calibration samples of a custom model: ``--inputs`` npz or ``--random N``.

    Returns:
        ``({input name: array [N, ...]}, record fields)``.
    Raises:
        UsageError: neither or both of --inputs/--random, or --random < 1.
        StageError: the npz is missing or unreadable.
    """
    if bool(args.inputs) == bool(args.random):
        raise UsageError(
            f"--model {args.model} is not an image classifier: give --calib-inputs NPZ (calibration "
            "samples keyed by input name "
            f"{[i[0] for i in inputs]}) or --random N (seeded structure-run data)")
    if args.random is not None and args.random < 1:
        raise UsageError(f"--random must be >= 1 (got {args.random})")
    if args.inputs:
        data = load_inputs(args.inputs, flag="--calib-inputs")
        ref = ref_outputs_path(args.model)
        if ref.exists():
            ev, _, _ = reference_inputs(ref)
            both = shared_samples(data, ev)
            if both:
                n = len(next(iter(data.values())))
                raise UsageError(f"--calib-inputs {args.inputs}: {both} of its {n} samples are "
                                 "samples stage 1 evaluates on (bit-identical, in any order): "
                                 "calibrate on other samples, or the rows are scored on their "
                                 "own calibration data")
        return data, {"source": f"--inputs {args.inputs}",
                      "input_sha256": sha256_file(args.inputs)}
    shapes = []
    for name, dims, dtype in inputs:
        if any(d is None for d in dims[1:]):
            raise UsageError(f"input {name} has dynamic non-batch axes {dims}: --random "
                             "cannot choose their sizes; give --inputs NPZ")
        shapes.append((name, tuple([1] + list(dims[1:])), str(dtype)))
    spec = ModelSpec(args.model, "custom", classifier=False)
    data = example_inputs(spec, shapes, batch=args.random, seed=args.seed)
    print(f"WARNING: --random {args.random}: synthetic calibration samples (seeded N(0,1)): "
          "the INT8 rows of this model are structure and latency runs, their accuracy says "
          "nothing; give --calib-inputs NPZ", file=sys.stderr)
    return data, {"source": f"--random {args.random} (deploykit.models.example_inputs, seed {args.seed}): "
                            "structure runs only", "synthetic": True}


def main(args: argparse.Namespace) -> dict:
    """Write the calibration npz; return the record written to ``results/<model>/calib.json``.

    Raises:
        UsageError: bad flags (see :func:`classifier_data` / :func:`custom_data`).
        StageError: missing inputs, overlapping splits, or calibration data that fail
            :func:`deploykit.quant.calibration.validate_calibration` (nothing is written then).
    """
    started = time.time()
    check_positive(args, "limit")
    spec = model_spec(args.model)
    # one writer per folder, held until this process exits (a second writer is refused)
    lock_folders(model_artifacts(args.model), model_results(args.model))
    onnx_path = require(Path(args.onnx or fp32_onnx_path(args.model)), "2_export_onnx.py")
    inputs = model_inputs(onnx_path)
    data, fields = (classifier_data(args, spec, inputs) if spec.classifier
                    else custom_data(args, inputs))
    n = {len(v) for v in data.values()}
    if len(n) == 1 and args.limit:
        data = {k: v[:args.limit] for k, v in data.items()}
    # Seeded order: which samples share a calibration batch is then a recorded choice, not an
    # accident of file names (the split is sorted by path, i.e. by class).
    if len(n) == 1:
        order = np.random.default_rng(args.seed).permutation(len(next(iter(data.values()))))
        data = {k: v[order] for k, v in data.items()}
        if "files" in fields:
            fields["files"] = [fields["files"][i] for i in order]
    reference, ref_source = calibration_reference(args.model, onnx_path)
    report = validate_calibration(
        onnx_path, data, None if args.no_stats_check else reference, source="calibration data",
        reference_source=ref_source)
    out = Path(args.output or calib_path(args.model))
    with atomic_path(out) as tmp:
        np.savez(tmp, **data)
    record = {"stage": "4_make_calib", "model": args.model, "onnx": str(onnx_path),
              "inputs": report["inputs"], "n_samples": report["n_samples"],
              "order_seed": args.seed, "stats_check": report["stats_check"],
              "output": str(out), "sha256": sha256_file(out), **fields}
    # Kept for readers of the single-input record.
    first = next(iter(report["inputs"]))
    record.update(input_name=first, dtype=report["inputs"][first]["dtype"],
                  shape=report["inputs"][first]["shape"],
                  n_images=report["n_samples"] if spec.classifier else None)
    record["provenance"] = provenance(args, [onnx_path, out], started)
    write_json(model_results(args.model) / "calib.json", record)
    report_leftovers(remove_leftovers(out.parent, started, (f".tmp-{out.name[:64]}.*",
                                                            f".tmp-*-{out.name}")))
    shapes = ", ".join(f"{k!r} {v['dtype']} {tuple(v['shape'])}"
                       for k, v in report["inputs"].items())
    print(f"calib: {report['n_samples']} samples ({fields['source'].split(':')[0]}, order seed "
          f"{args.seed}) -> {out} ({shapes}); statistics check: {report['stats_check']}")
    return record


if __name__ == "__main__":
    cli(get_args_parser, main)
