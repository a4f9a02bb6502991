"""Stage 5: a second writer on the same folders is refused (exit 1, the holder named, the first
writer's files untouched); a stage under run_all.sh's held lock still runs; the EP that really
calibrated is recorded (EPS=cuda:0 on an onnxruntime without the CUDA EP: CPU, with a WARNING)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.auto_models import _save
from tests.helpers.quant_models import conv_model
from tests.helpers.stages import ROOT


def _tiny(tmp_path):
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(conv_model(size=32), d / "onnx" / "fp32.onnx")
    np.savez(d / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (8, 3, 32, 32)).astype(np.float32))
    return d, dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
                   MODEL="tiny", PYTHON=sys.executable)


@pytest.mark.slow
def test_second_stage5_on_held_folder_exits_1_naming_holder(tmp_path):
    d, env = _tiny(tmp_path)
    res = tmp_path / "r" / "tiny"
    res.mkdir(parents=True)
    first = {d / "onnx" / "int8_hp32.onnx": b"first writer's file",
             res / "quant_int8_hp32.json": b'{"status": "ok"}'}
    for f, b in first.items():
        f.write_bytes(b)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from deploykit.lock import lock_folders; "
         "lock_folders(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(res)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"{res} is being written by another run: pid {holder.pid}" in p.stderr
    assert "time.sleep(120)" in p.stderr  # the holder's command line, from /proc
    assert "give this run folders of its own: ARTIFACTS=" in p.stderr
    assert "Stage 5: quantize" not in p.stdout
    for f, b in first.items():
        assert f.read_bytes() == b
    assert not list((d / "onnx").glob(".tmp-*"))


@pytest.mark.slow
def test_stage5_under_run_all_lock_runs_and_records_the_ep_that_calibrated(tmp_path):
    """As run_all.sh starts it (fd 9 flocked on $ARTIFACTS/.run_all.flock), with EPS=cuda:0."""
    pytest.importorskip("modelopt.onnx.quantization")
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP: no fallback to see")
    d, env = _tiny(tmp_path)
    env["EPS"] = "cuda:0"
    p = subprocess.run(
        ["bash", "-c", 'exec 9>>"$ARTIFACTS/.run_all.flock" && flock -n 9 && '
         'exec bash 5_quantize.sh int8_hp32'], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "calibration EP: requested cuda:0, ran on CPUExecutionProvider" in p.stdout
    assert ("WARNING: EPS=cuda:0 was requested but calibration ran on CPUExecutionProvider "
            "(this onnxruntime has no CUDAExecutionProvider") in p.stderr
    rec = json.loads((tmp_path / "r" / "tiny" / "quant_int8_hp32.json").read_text())
    ep = rec["calibration_ep"]
    assert ep["requested"] == "cuda:0" and ep["used"] == ["CPUExecutionProvider"]
    assert ep["fallback"] is True and rec["warnings"][0].startswith("WARNING: EPS=cuda:0")
