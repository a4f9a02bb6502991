#!/usr/bin/env python3
"""Stage 4: calibration data for ModelOpt: the calibration split (never an eval image),
preprocessed exactly as evaluation (``common.load_split`` + ``common.normalize``), saved as an
``.npz`` keyed to the input name read from the ONNX model.

Reads:  ``artifacts/splits.json`` + calib cache (0_prepare_data.py),
        ``artifacts/<model>/onnx/fp32.onnx`` (2_export_onnx.py) for the input name and dtype.
Writes: ``artifacts/<model>/calib.npz`` (``{<input name>: float32 [N,3,crop,crop]}``),
        ``results/<model>/calib.json`` (files used, input name, provenance).
Rerun:  ``python 4_make_calib.py --model efficientnet_lite0``

The stage refuses to run (exit 1) when any calibration file is also an evaluation file, so a
quantized model is never calibrated on the images it is scored on.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import common
import onnx_graph


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__)
    common.add_shared_args(p, "model")
    p.add_argument("--onnx", type=Path, default=None,
                   help="ONNX model whose input name keys the npz (default: "
                        "artifacts/<model>/onnx/fp32.onnx)")
    p.add_argument("--output", type=Path, default=None,
                   help="output npz (default: artifacts/<model>/calib.npz)")
    p.add_argument("--limit", type=int, default=None,
                   help="use the first N calibration images only (default: all)")
    return p


def onnx_input(path: Path) -> tuple[str, np.dtype]:
    """Name and numpy dtype of the single real input of an ONNX model.

    Raises:
        StageError: the model has no input or more than one (calibration of multi-input models
            needs one array per input: not supported by this stage).
    """
    inputs = onnx_graph.inputs(onnx_graph.load(path, external=False))
    if len(inputs) != 1:
        raise common.StageError(f"{path}: {len(inputs)} graph inputs "
                                f"({[i[0] for i in inputs]}); stage 4 supports one image input")
    return inputs[0][0], inputs[0][2]


def check_disjoint(split: dict) -> None:
    """Raise StageError if a calibration file is also an evaluation file.

    Args:
        split: the dict of ``artifacts/splits.json`` (``eval``/``calib`` lists of
            ``[relative path, class]``).
    """
    ev = {p for p, _ in split.get("eval", [])}
    both = sorted(p for p, _ in split.get("calib", []) if p in ev)
    if both:
        raise common.StageError(f"{len(both)} calibration image(s) are also evaluation images "
                                f"(first: {both[0]}); rerun 0_prepare_data.py")


def main(args: argparse.Namespace) -> dict:
    """Write the calibration npz; return the record written to ``results/<model>/calib.json``."""
    started = time.time()
    if args.limit is not None and args.limit < 1:
        raise common.UsageError("--limit must be >= 1")
    spec = common.model_spec(args.model)
    if not spec.classifier:
        raise common.UsageError(f"--model {args.model}: stage 4 needs an image classifier")
    onnx_path = Path(args.onnx or common.model_artifacts(args.model) / "onnx" / "fp32.onnx")
    common.require(onnx_path, "2_export_onnx.py")
    common.require(common.splits_path(), "0_prepare_data.py")
    name, dtype = onnx_input(onnx_path)
    split = common.load_splits()
    check_disjoint(split)
    x_u8, _, files = common.load_split("calib", spec, args.limit)
    eval_files = {p for p, _ in split["eval"]}
    if eval_files & set(files):  # the cache is keyed to the split, but check what we really use
        raise common.StageError("calibration cache holds evaluation images: rerun "
                                "0_prepare_data.py")
    x = common.normalize(x_u8, spec.mean, spec.std).astype(dtype)
    out = Path(args.output or common.model_artifacts(args.model) / "calib.npz")
    with common.atomic_path(out) as tmp:
        np.savez(tmp, **{name: x})
    record = {"stage": "4_make_calib", "model": args.model, "onnx": str(onnx_path),
              "input_name": name, "dtype": str(dtype), "shape": list(x.shape),
              "n_images": len(files), "files": files, "output": str(out),
              "preprocessing": {**spec.preprocessing(), "mean": spec.mean, "std": spec.std},
              "provenance": common.provenance(args, [onnx_path, common.splits_path(), out],
                                              started)}
    common.write_json(common.model_results(args.model) / "calib.json", record)
    print(f"calib: {len(files)} calibration images -> {out} (key {name!r}, {x.dtype}, "
          f"{tuple(x.shape)})")
    return record


if __name__ == "__main__":
    common.cli(get_args_parser, main)
