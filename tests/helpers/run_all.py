"""Helpers to run run_all.sh in a private artifacts folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from deploykit.io import write_json
from deploykit.results import result_record

from tests.helpers.stages import ROOT


MODEL = "efficientnet_lite0"


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL=MODEL, PIPELINE_ROOT=str(ROOT), PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for k in ("VAL_ROOT", "ALLOW_CLASS_SUBSET", "WEIGHTS", "INPUT_SHAPE", "PREPROCESS", "INPUTS",
              "CALIB_INPUTS", "LABELS"):
        env.pop(k, None)
    return {**env, **extra}


def _good_row(env: dict, tag: str = "pytorch_fp32_cpu") -> Path:
    row = Path(env["RESULTS"]) / MODEL / f"{tag}.json"
    rec = result_record("1_pytorch_baseline", "PyTorch", "FP32", MODEL, tag)
    rec.update(device="cpu", n_images=4, accuracy={"top1": 50.0, "top5": 75.0},
               latency={"end_to_end_ms": {"p50_ms": 10.0, "mean_ms": 10.0, "fps": 100.0}})
    write_json(row, rec)
    return row
