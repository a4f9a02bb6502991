"""Inputs of the search: the tuning (and evaluation) data and the base Q/DQ model quantized once
by ModelOpt.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
import numpy as np

from deploykit.quant import modelopt_runner
from deploykit.data.splits import load_split, load_splits
from deploykit.envinfo import versions
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import EvalData
from deploykit.io import load_npz, sha256_file, write_json
from deploykit.layout import model_artifacts, splits_path
from deploykit.models import model_spec
from deploykit.onnx.graph import graph_inputs, load_onnx
from deploykit.quant.auto.search import VARIANT, data_digest
from deploykit.quant.calibration import validate_calibration
from deploykit.variants import modelopt_args


# --------------------------------------------------------------------------------------------
# Inputs: tuning/evaluation data, the base Q/DQ model
# --------------------------------------------------------------------------------------------
def _subset(data, idx: np.ndarray):
    """``deploykit.evaluate.EvalData`` restricted to sample indices ``idx``."""
    if data.classifier:
        return dataclasses.replace(data, x_u8=data.x_u8[idx], y=data.y[idx],
                                   files=[data.files[i] for i in idx])
    return dataclasses.replace(data, feed={k: v[idx] for k, v in data.feed.items()})


def tuning_data(model: str, onnx_path: Path, tune_npz: Path | None = None,
                images: int | None = None, seed: int = 0):
    """The tuning samples of the search, with where they come from.

    Image classifiers: the ``tune`` split of ``artifacts/splits.json`` (``0_prepare_data.py
    --tune-fraction``), preprocessed as evaluation, checked disjoint from the evaluation and
    calibration splits. Other models: ``tune_npz`` or ``artifacts/<model>/tune.npz`` (arrays
    keyed by input name, batch on axis 0). ``images``: a seeded subset of that many samples.

    Returns:
        ``(deploykit.evaluate.EvalData, {"source", "n", "sha256", "images", "seed"})``.
    Raises:
        StageError: no tuning split / npz (the message names ``--tune-fraction`` /
            ``run_all.sh --auto-precision`` / ``--tune-npz``), or the splits overlap.
        UsageError: ``images`` < 1.
    """

    if images is not None and images < 1:
        raise UsageError(f"--tune-images must be >= 1 (got {images})")
    try:
        spec = model_spec(model)
    except UsageError:
        spec = None
    if tune_npz is None and spec is not None and spec.classifier:
        x, y, files = load_split("tune", spec)
        split = load_splits()
        other = {p for p, _ in split.get("eval", [])} | {p for p, _ in split.get("calib", [])}
        both = sorted(set(files) & other)
        if both:
            raise StageError(f"{len(both)} tuning image(s) are also evaluation or "
                             f"calibration images (first: {both[0]}): rerun "
                             "0_prepare_data.py --tune-fraction F")
        name = graph_inputs(load_onnx(onnx_path, external=False))[0][0]
        data = EvalData(x_u8=x, y=y, files=files, mean=spec.mean, std=spec.std,
                        input_name=name)
        source = f"tune split of {splits_path()} ({len(files)} images)"
    else:
        path = Path(tune_npz) if tune_npz else model_artifacts(model) / "tune.npz"
        if not path.exists():
            raise StageError(
                f"no tuning data for {model}: {path} missing. The mixed-precision search needs "
                "samples disjoint from calibration and evaluation: for an image classifier run "
                "0_prepare_data.py --tune-fraction 0.25 (or bash run_all.sh --auto-precision); "
                "for another model save them with np.savez (keyed by input name, batch on "
                "axis 0) as that file or pass --tune-npz")
        feed = load_npz(path, None, "np.savez (tuning samples)", flag="tuning data",
                        feed=True)
        # the checks calibration data gets (input names, rank, static dims, dtype, sample
        # counts, NaN/Inf): a wrong file is refused here, not as an ONNX Runtime traceback

        validate_calibration(onnx_path, feed, None, source=f"tuning data {path}",
                             reference_source="tuning data: not compared",
                             producer="the tuning samples must be disjoint from "
                             "the calibration and evaluation data")
        data = EvalData(feed=feed)
        source = str(path)
    n = len(data)
    if images is not None and images < n:
        idx = np.sort(np.random.default_rng(seed).choice(n, size=images, replace=False))
        data = _subset(data, idx)
        source += f", seeded subset of {images} (seed {seed})"
    return data, {"source": source, "n": len(data), "sha256": data_digest(data),
                  "images": images, "seed": seed, "tune_npz": str(tune_npz) if tune_npz else None}


def base_qdq(model: str, fp32: Path, calib: Path, calib_batch: str, eps: str, work: Path,
             variant: str = VARIANT) -> tuple[Path, dict]:
    """ModelOpt's quantization of every candidate: ``variant``'s recipe without exclusions,
    through ``qdq_tools.py modelopt`` (its own process: ModelOpt patches ORT's calibrators),
    reused from ``work/base.onnx`` when the FP32 model, calibration data, flags, calibration
    batch and ModelOpt version are the same.

    Returns:
        ``(path of the base Q/DQ model, {"command", "key", "reused", "wall_s"})``.
    Raises:
        StageError: ModelOpt failed (the log's last lines are in the message).
    """

    flags = modelopt_args(variant, str(calib), eps)
    key = {"fp32": sha256_file(fp32), "calib": sha256_file(calib),
           "flags": ["<calib>" if f == str(calib) else f for f in flags],
           "calib_batch": str(calib_batch),
           "modelopt": versions().get("nvidia-modelopt")}
    out, meta = work / "base.onnx", work / "base.json"
    if out.exists() and meta.exists():
        try:
            old = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        if old.get("key") == key and old.get("sha256") == sha256_file(out):
            return out, {**old, "reused": True}
    work.mkdir(parents=True, exist_ok=True)
    log = work / "base.quant.log"
    with tempfile.TemporaryDirectory(dir=work, prefix=".tmp-base-") as tmp:
        src, made = Path(tmp) / "fp32.onnx", Path(tmp) / "base.onnx"
        shutil.copyfile(fp32, src)  # ModelOpt rewrites its --onnx_path
        replace = {src: fp32, made: out}
        shown = modelopt_runner.shown_command(
            modelopt_runner.modelopt_argv(src, made, flags, calib_batch), replace)
        print(f"auto-precision: quantizing every candidate once: {shown}", file=sys.stderr)
        run = modelopt_runner.run_modelopt(src, made, flags, log, calib_batch=calib_batch,
                                           replace=replace)
        if not run.ok:
            raise StageError(f"ModelOpt failed on the base quantization (exit "
                             f"{run.returncode}); last lines of {log}:\n  "
                             + "\n  ".join(run.tail(15)))
        os.replace(made, out)
    rec = {"key": key, "command": run.shown, "log": str(log), "sha256": sha256_file(out),
           "wall_s": round(run.wall_s, 1)}
    write_json(meta, rec)
    return out, {**rec, "reused": False}
