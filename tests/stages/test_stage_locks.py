"""One writer per folder (issue 20): stages 0, 1, 3, 4, 6, 7 and auto_precision.py take the same
per-folder lock as stages 2 and 5: a second writer of a held artifacts or results folder is
refused at once (exit 1) naming the holder, and the holder's files survive; a child the holder
starts, and a writer after a killed holder, are not refused."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from deploykit.layout import model_tag
from tests.helpers.stages import ROOT

MODEL = "efficientnet_lite0"
HOLD = ("import sys, time; from deploykit.lock import lock_folders; "
        "lock_folders(*sys.argv[1:]); print('held', flush=True); time.sleep(120)")

WRITERS = {
    "0_prepare_data": ["0_prepare_data.py", "--model", MODEL],
    "1_pytorch_baseline": ["1_pytorch_baseline.py", "--model", MODEL],
    "3_onnx_eval": ["3_onnx_eval.py", "--model", MODEL, "--onnx", "x.onnx", "--tag", "ort_x"],
    "4_make_calib": ["4_make_calib.py", "--model", MODEL],
    "6_build_engines": ["6_build_engines.py", "--model", MODEL, "fp16"],
    "7_trt_eval": ["7_trt_eval.py", "--model", MODEL, "--engine", "x.plan", "--tag", "trt_x"],
    "auto_precision": ["auto_precision.py", "search", "--model", MODEL],
}


def _env(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    env.pop("MODEL", None)
    return env


def _hold(*folders):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, *map(str, folders)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(WRITERS))
def test_second_writer_is_refused_naming_the_holder(tmp_path, stage):
    art, res = tmp_path / "a" / model_tag(MODEL), tmp_path / "r" / model_tag(MODEL)
    (art / "onnx").mkdir(parents=True)
    res.mkdir(parents=True)
    first = {art / "calib.npz": b"holder's calibration", art / "onnx" / "fp32.onnx": b"onnx",
             res / "ort_fp32.json": b'{"status": "ok"}',
             res / "trt_build_fp16.json": b"{}"}
    for f, b in first.items():
        f.write_bytes(b)
    held = res if stage in ("0_prepare_data", "3_onnx_eval", "7_trt_eval") else art
    holder = _hold(held)
    try:
        p = subprocess.run([sys.executable, *WRITERS[stage]], cwd=ROOT, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert p.returncode == 1, p.stdout + p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr  # one line, no traceback
    assert f"{held} is being written by another run: pid {holder.pid}, started 20" in err[0]
    assert "time.sleep(120)" in err[0]  # the holder's command line, from /proc
    assert "Wait for it to finish, or give this run folders of its own" in err[0]
    for f, b in first.items():
        assert f.read_bytes() == b, f
    # nothing else written (no row, no record of the refused run)
    assert {p.name for p in res.iterdir()} - {".deploykit.lock"} == {"ort_fp32.json",
                                                                     "trt_build_fp16.json"}


@pytest.mark.slow
def test_a_child_of_the_holder_and_a_writer_after_a_killed_holder_run(tmp_path):
    res = tmp_path / "r" / model_tag(MODEL)
    env = _env(tmp_path)
    # the holder runs stage 7 as its child (as stage 5b runs stage 3): not refused, it gets as
    # far as the missing engine
    child = [sys.executable, *WRITERS["7_trt_eval"]]
    code = ("import subprocess, sys; from deploykit.lock import lock_folders; "
            f"lock_folders({str(res)!r}); p = subprocess.run({child!r}, capture_output=True, "
            "text=True); sys.stdout.write(p.stderr); sys.exit(p.returncode)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "no such file" in p.stdout, p.stdout + p.stderr
    assert "being written by another run" not in p.stdout
    # a holder killed with SIGKILL leaves its lock file: the next writer is not refused
    holder = _hold(res)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    p = subprocess.run(child, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "no such file" in p.stderr, p.stderr
    assert "being written by another run" not in p.stderr
