"""Reliability of run_all.sh (issue 11): one run per artifacts folder (a lock naming its holder,
stale locks cleared), Ctrl-C naming the stage and the resume command, smoke runs in their own
folders, checks before any stage starts, and what the console shows (skip reasons, the report's
summary, progress kept in the logs).

The runs stop early (a stage range, a missing data folder) so each case takes seconds.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT
from deploykit.io import write_json
from deploykit.layout import DEFAULT_DATA
from deploykit.results import result_record

MODEL = "efficientnet_lite0"
SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL=MODEL, PIPELINE_ROOT=str(ROOT), PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for k in ("VAL_ROOT", "ALLOW_CLASS_SUBSET", "WEIGHTS", "INPUT_SHAPE"):
        env.pop(k, None)
    return {**env, **extra}


def _run_all(env: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "run_all.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _tiny_data(tmp_path: Path, n: int = 4) -> Path:
    data = tmp_path / "data"
    for f in SAMPLE[:n]:
        (data / f.name[:9]).mkdir(parents=True)
        (data / f.name[:9] / f.name).symlink_to(f)
    return data


def _good_row(env: dict, tag: str = "pytorch_fp32_cpu") -> Path:
    row = Path(env["RESULTS"]) / MODEL / f"{tag}.json"
    rec = result_record("1_pytorch_baseline", "PyTorch", "FP32", MODEL, tag)
    rec.update(device="cpu", n_images=4, accuracy={"top1": 50.0, "top5": 75.0},
               latency={"end_to_end_ms": {"p50_ms": 10.0, "mean_ms": 10.0, "fps": 100.0}})
    write_json(row, rec)
    return row


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not path.exists():
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.2)


# ------------------------------------------------------------------------------- lock + Ctrl-C
def test_second_run_refuses_naming_the_first_and_ctrl_c_names_stage_and_resume(tmp_path):
    env = _env(tmp_path)
    first = subprocess.Popen(["bash", "run_all.sh", "--stop-stage", "1"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        lock = tmp_path / "a" / ".run_all.lock"
        _wait_for(lock / "owner")
        _wait_for(tmp_path / "a" / "logs" / MODEL / "0_prepare_data.log")
        t0 = time.time()
        second = _run_all(env, "--stage", "8", "--stop-stage", "8")
        assert time.time() - t0 < 30  # refused at once, not after waiting
        assert second.returncode == 1
        assert f"another run_all.sh is using {tmp_path / 'a'}: pid {first.pid}" in second.stderr
        assert "--stage 0 --stop-stage 1" in second.stderr  # the holder's command
        assert "started 20" in second.stderr                  # and its start time (UTC)
        assert "Stage 8" not in second.stdout
        time.sleep(1)
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 130, err
    # On a loaded machine stage 0 may have finished before the signal: the message must name
    # whichever stage was running, and the resume command must start there.
    m = re.search(r"interrupted during stage (\d) \((.+?)\)", err)
    assert m, err
    stage = int(m.group(1))
    assert (stage, m.group(2)) in {(0, "prepare data"), (1, "PyTorch FP32 baseline")}, err
    assert f"resume with: MODEL={MODEL} ARTIFACTS={tmp_path / 'a'} RESULTS={tmp_path / 'r'} " \
           f"bash run_all.sh --stage {stage} --stop-stage 1" in err
    assert not lock.exists()                              # released
    if stage == 0:
        assert not (tmp_path / "a" / "splits.json").exists()  # nothing half-written
    else:
        assert not (tmp_path / "a" / MODEL / "ref_logits.npz").exists()
    assert not list((tmp_path / "a").rglob(".tmp-*"))


def test_stale_lock_of_a_killed_run_is_cleared(tmp_path):
    env = _env(tmp_path)
    _good_row(env)
    lock = tmp_path / "a" / ".run_all.lock"
    dead = subprocess.Popen(["true"])
    dead.wait()
    for pid, pstart in ((dead.pid, ""), (os.getpid(), "1")):  # gone; pid reused since
        lock.mkdir(parents=True)
        (lock / "owner").write_text(f"pid={pid}\npstart={pstart}\nstarted=2020-01-01T00:00:00Z\n"
                                    f"host={os.uname().nodename}\ncommand=MODEL=x bash run_all.sh\n")
        p = _run_all(env, "--stage", "8", "--stop-stage", "8")
        assert p.returncode == 0, p.stderr
        assert f"clearing a stale lock of a run that is no longer running (pid {pid}" in p.stderr
        assert "Stage 8: finished" in p.stdout
        assert not lock.exists()


# ------------------------------------------------------------------------------- smoke runs
def test_smoke_run_never_moves_or_replaces_a_full_runs_results(tmp_path):
    """A full-range smoke run (stopped at stage 0 by a missing data folder): the old script
    moved results/<model>/ aside before stage 0; now the smoke run works in its own folders."""
    env = _env(tmp_path, VAL_ROOT=str(tmp_path / "nonexistent"))
    row = _good_row(env)
    before = row.read_text()
    p = _run_all(env, "--limit", "4")
    assert p.returncode == 1
    assert row.read_text() == before and "previous results" not in p.stdout
    assert f"results: {tmp_path / 'r' / 'smoke'}; smoke run on 4 images" in p.stdout
    assert f"resume with: MODEL={MODEL} ARTIFACTS={tmp_path / 'a'} RESULTS={tmp_path / 'r'} " \
           "VAL_ROOT=" in p.stderr and "--stage 0 --limit 4" in p.stderr
    assert (tmp_path / "a" / "smoke" / "logs" / MODEL / "0_prepare_data.log").exists()
    assert not (tmp_path / "a" / "logs").exists()


def test_smoke_stage0_writes_only_its_own_folders_and_logs_keep_progress(tmp_path):
    env = _env(tmp_path, VAL_ROOT=str(_tiny_data(tmp_path)), ALLOW_CLASS_SUBSET="1")
    p = _run_all(env, "--limit", "2", "--stop-stage", "0")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "a" / "smoke" / "splits.json").exists()
    assert not (tmp_path / "a" / "splits.json").exists()
    assert (tmp_path / "r" / "smoke" / MODEL / "data.json").exists()
    assert not (tmp_path / "r" / MODEL).exists()
    log = (tmp_path / "a" / "smoke" / "logs" / MODEL / "0_prepare_data.log").read_text()
    assert "preprocess eval" in log and "img" in log  # the tqdm bar is kept in the log
    assert "%|" not in p.stdout                         # and not dumped on the console


# ------------------------------------------------------------------------------- checks first
def test_unwritable_results_folder_is_refused_before_any_stage(tmp_path):
    p = _run_all(_env(tmp_path, RESULTS="/sys/no_results_here"), "--stop-stage", "0")
    assert p.returncode == 1 and "cannot write to /sys/no_results_here" in p.stderr
    assert "Stage 0" not in p.stdout


def test_weights_folder_and_bad_input_shape_are_usage_errors(tmp_path):
    p = _run_all(_env(tmp_path, WEIGHTS=str(tmp_path)))
    assert p.returncode == 2 and f"WEIGHTS={tmp_path} is a folder" in p.stderr
    p = _run_all(_env(tmp_path, MODEL="tests.custom_models:two_head",
                      INPUT_SHAPE="image:1,3,-16,16 tokens:1,4,16"))
    assert p.returncode == 2 and "INPUT_SHAPE: --input-shape 'image:1,3,-16,16'" in p.stderr
    assert "every dimension must be >= 1" in p.stderr and "Stage" not in p.stdout
    # a built-in classifier ignored INPUT_SHAPE without a word
    p = _run_all(_env(tmp_path, INPUT_SHAPE="x:1,3,8,8"))
    assert p.returncode == 2 and "INPUT_SHAPE is for custom models" in p.stderr
    assert "unset INPUT_SHAPE" in p.stderr and "Stage" not in p.stdout


# ------------------------------------------------------------------------------- console
def test_console_shows_stage6_skip_reason_and_stage8_summary(tmp_path):
    env = _env(tmp_path)
    env.pop("TRTEXEC", None)
    _good_row(env)
    p = _run_all(env, "--stage", "6", "--stop-stage", "8")
    assert p.returncode == 0, p.stderr
    s6 = p.stdout.split("Stage 6:")[1].split("Stage 7:")[0]
    if not (shutil.which("trtexec") or Path("/usr/src/tensorrt/bin/trtexec").exists()):
        assert "SKIPPED: trtexec not found" in s6  # no TensorRT here: the reason is shown
    s8 = p.stdout.split("Stage 8:")[1]
    assert f"  report {MODEL}: " in s8 and " skipped" in s8
