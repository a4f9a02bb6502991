"""run_all.sh and env.sh end to end: usage errors, full and smoke runs, one run per artifacts
folder (locks, Ctrl-C, killed runs), unwritable folders, the console summary; stages 1, 2, 3, 8 in a row."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from deploykit.layout import DEFAULT_DATA

from tests.helpers.stages import ROOT, run_stage
from tests.helpers.auto_models import _auto_env
from tests.helpers.run_all import _env, _good_row


SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))


@pytest.mark.slow
def test_run_all_auto_precision_usage(tmp_path):
    env = _auto_env(tmp_path, MODEL="efficientnet_lite0")
    p = subprocess.run(["bash", "run_all.sh", "--auto-precision=1.5"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "needs a fraction 0 < F < 1" in p.stderr
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "splits.json").write_text(json.dumps({"eval": [], "calib": []}))
    p = subprocess.run(["bash", "run_all.sh", "--auto-precision", "--stage", "5"], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "has no tuning split" in p.stderr and "start from stage 0" \
        in p.stderr


# ----------------------------------------------------------------------------- stages
@pytest.mark.slow
def test_stages_1_2_3_8_on_real_subset(stage_env):
    env = stage_env
    lim = ["--limit", "48"]
    run_stage(["1_pytorch_baseline.py", "--iters", "20", "--warmup", "3", *lim], env)
    res = Path(env["RESULTS"]) / "efficientnet_lite0"
    base = json.loads((res / "pytorch_fp32_cpu.json").read_text())
    assert base["n_images"] == 48 and base["accuracy"]["top1"] > 70
    prov = base["provenance"]
    assert {"args", "command", "versions", "device", "git_sha", "time_utc", "input_sha256",
            "wall_time_s"} <= set(prov)
    run_stage(["2_export_onnx.py", "--check-images", "16"], env)
    exp = json.loads((res / "export.json").read_text())
    assert exp["files"]["fp32"]["outputs"]["logits"]["cosine_min"] > 0.99999
    onnx_dir = Path(env["ARTIFACTS"]) / "efficientnet_lite0" / "onnx"
    for v in ("fp32", "fp16"):
        run_stage(["3_onnx_eval.py", "--onnx", str(onnx_dir / f"{v}.onnx"), "--tag", f"ort_{v}",
                   "--iters", "20", "--warmup", "3", *lim], env)
        r = json.loads((res / f"ort_{v}.json").read_text())
        assert r["precision"] == v.upper() and r["ep_used"] == "CPUExecutionProvider"
        assert r["parity"]["cosine_mean"] > (0.99999 if v == "fp32" else 0.999)
        assert abs(r["accuracy"]["top1"] - base["accuracy"]["top1"]) <= 100 / 48 * 2
        # the CPU EP computes the FP16 graph in FP32, and the row says so
        assert (r.get("fp16_computed_in") or "").startswith("FP32") == (v == "fp16")
    run_stage(["8_report.py"], env)
    md = (res / "REPORT.md").read_text()
    for row in ("| PyTorch | FP32 |", "| ORT | FP32 |", "| ORT | FP16 |"):
        assert row in md
    # the copy one folder up is the same report, its plot links going through the model folder
    top = (Path(env["RESULTS"]) / "REPORT.md").read_text()
    assert top == md.replace("](accuracy_latency.png)", "](efficientnet_lite0/accuracy_latency.png)"
                             ).replace("](size.png)", "](efficientnet_lite0/size.png)")
    assert (res / "accuracy_latency.png").exists()
    csv = (res / "REPORT.csv").read_text().splitlines()
    assert csv[0].startswith("backend,precision") and len(csv) >= 4


# ----------------------------------------------------------------------------- shell
@pytest.mark.slow
def test_env_sh_refuses_to_be_executed():
    p = subprocess.run(["bash", str(ROOT / "env.sh")], capture_output=True, text=True)
    assert p.returncode == 2 and "must be sourced" in p.stderr


@pytest.mark.slow
def test_env_sh_drops_the_folders_of_the_checkout_sourced_before(tmp_path):
    """Sourcing a second checkout's env.sh in one shell: ARTIFACTS/RESULTS that are the first
    checkout's defaults (however spelled) become this checkout's, said on stderr, also when the
    install then fails; a folder the user set elsewhere is kept, one set inside the other
    checkout is kept with a warning; the same checkout (through a symlink) changes nothing."""
    import sys

    other = tmp_path / "other-checkout"
    (other / "results").mkdir(parents=True)
    mine = tmp_path / "mine"
    link = tmp_path / "link-to-this-checkout"
    link.symlink_to(ROOT)
    script = ('source "$ENV_SH" >/dev/null; echo "rc=$?"; '
              'echo "A=$ARTIFACTS"; echo "R=$RESULTS"; echo "P=$PIPELINE_ROOT"')
    base = {**os.environ, "ENV_SH": str(ROOT / "env.sh"), "PIPELINE_ROOT": str(other),
            "PIPELINE_USE_CURRENT_PYTHON": "1",
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    def source(**env):
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                           env={**base, **env})
        out = dict(line.split("=", 1) for line in p.stdout.splitlines() if "=" in line)
        return out, p.stderr

    mine_a, mine_r = f"{ROOT}/artifacts", f"{ROOT}/results"
    out, err = source(ARTIFACTS=f"{other}/artifacts", RESULTS=f"{other}/results")
    assert out == {"rc": "0", "A": mine_a, "R": mine_r, "P": str(ROOT)}, err
    assert "ARTIFACTS was" in err and "RESULTS was" in err and "sourced before" in err
    # other spellings of the same folders: a trailing slash, //, ./, relative to the cwd
    out, err = source(ARTIFACTS=f"{other}/./artifacts/", RESULTS=f"{tmp_path}//other-checkout"
                      "/results")
    assert (out["A"], out["R"]) == (mine_a, mine_r), err
    # the install fails (no venv can be made): the other checkout's folders are gone already
    out, err = source(PIPELINE_USE_CURRENT_PYTHON="0", VENV_DIR=str(tmp_path / "no" / "venv"),
                      PYTHON="false", ARTIFACTS=f"{other}/artifacts")
    assert out["rc"] == "1" and out["A"] == mine_a and "cannot create" in err, err
    # folders the user set: elsewhere kept silently, inside the other checkout with a warning
    out, err = source(ARTIFACTS=str(mine / "a"), RESULTS=f"{other}/my-results")
    assert out["A"] == str(mine / "a") and out["R"] == f"{other}/my-results"
    assert "WARNING: RESULTS" in err and "ARTIFACTS" not in err
    # the same checkout again, also through a symlink: nothing changes, nothing said
    for prev in (ROOT, link):
        out, err = source(PIPELINE_ROOT=str(prev), ARTIFACTS=f"{prev}/artifacts",
                          RESULTS=str(mine / "r"))
        assert out["A"] == f"{prev}/artifacts" and out["R"] == str(mine / "r"), err
        assert "sourced before" not in err and "WARNING" not in err, err


@pytest.mark.slow
def test_run_all_usage_errors():
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--bogus"], capture_output=True,
                       text=True)
    assert p.returncode == 2 and "unknown option" in p.stderr
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--stage", "12"], capture_output=True,
                       text=True, env={**os.environ, "PIPELINE_ROOT": str(ROOT)})
    assert p.returncode == 2 and "0..8" in p.stderr
    import sys

    env = {**os.environ, "PIPELINE_ROOT": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for args, msg in ((["--stage", "5", "--stop-stage", "2"], "nothing to run"),
                      (["--limit"], "needs a number"), (["--limit", "abc"], "positive integer")):
        p = subprocess.run(["bash", str(ROOT / "run_all.sh"), *args], capture_output=True,
                           text=True, env=env)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
    p = subprocess.run(["bash", str(ROOT / "run_all.sh")], capture_output=True, text=True,
                       env={**env, "MODEL": "nosuchmodel"})
    assert p.returncode == 2 and "unknown model" in p.stderr


@pytest.mark.slow
def test_run_all_end_to_end(tmp_path):
    """The whole pipeline as a user runs it (stages 0-8) on 64 real images of the embedded
    sample: it must finish, and the report must have the FP rows and the TensorRT rows as not run
    (no TensorRT here) or run."""
    import sys

    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="efficientnet_lite0", PIPELINE_ROOT=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "run_all.sh", "--limit", "64"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for n in range(9):
        assert f"Stage {n}: finished" in p.stdout
    md = (tmp_path / "r" / "smoke" / "efficientnet_lite0" / "REPORT.md").read_text()  # --limit
    # a smoke run makes one INT8 variant and says what it left out
    assert ("smoke run (--limit 64): int8_hp32 only, calibrated on at most 32 samples; left "
            "out: baseline int8") in p.stdout
    assert "what it leaves out of a full run" in p.stdout
    # stage 5 is one command whose last lines are the rows; the smoke verdict is not re-timed
    assert "ort_int8_hp32: ORT INT8" in p.stdout
    assert "the verdict's interleaved re-timing" in p.stdout
    assert not (tmp_path / "r" / "smoke" / "efficientnet_lite0" / "ship_timing.json").exists()
    for row in ("| PyTorch | FP32 |", "| ORT | FP16 |", "| ORT | INT8 | ort_int8_hp32 |"):
        assert row in md, row
    for row in ("| ORT | INT8 | ort_int8 |", "| ORT | INT4 | ort_int4 |"):
        assert row not in md, row
    assert "| TensorRT |" in md  # run, or listed as skipped with the reason


@pytest.mark.slow
def test_run_all_full_run_moves_previous_results(tmp_path):
    """A full run must not mix an earlier run's rows into its report: with a stale row present,
    a partial run leaves it in place and a full run moves it to artifacts/previous_results/
    (the full run is stopped soon after, at stage 1, by a checkpoint it cannot load). A VAL_ROOT
    that does not exist, or holds no images, is refused before anything is moved (a typo used
    to leave results/<model>/ empty)."""
    import sys

    res = tmp_path / "r" / "efficientnet_lite0"
    res.mkdir(parents=True)
    (res / "ort_stale.json").write_text("{}")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="efficientnet_lite0", PIPELINE_ROOT=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "run_all.sh", "--stop-stage", "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert (res / "ort_stale.json").exists()  # partial run: rows stay in place
    env["VAL_ROOT"] = str(tmp_path / "nonexistent")
    p = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 2 and "nothing was run or moved" in p.stderr, p.stderr
    assert (res / "ort_stale.json").exists() and "previous results" not in p.stdout
    # so is a folder without images (stage 0's own listing runs first)
    env["VAL_ROOT"] = str(tmp_path / "no_images")
    (tmp_path / "no_images").mkdir()
    p = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 2 and "no images in" in p.stderr and "nothing was run" in p.stderr
    assert (res / "ort_stale.json").exists()
    # A full run starts by moving them (stop it soon after: a checkpoint stage 1 cannot load).
    del env["VAL_ROOT"]
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    env["WEIGHTS"] = str(tmp_path / "bad.pt")
    p = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1 and "previous results" in p.stdout, p.stderr
    assert not (res / "ort_stale.json").exists()
    moved = list((tmp_path / "a" / "previous_results").glob("efficientnet_lite0-*/ort_stale.json"))
    assert len(moved) == 1


MODEL = "efficientnet_lite0"


def _run_all(env: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "run_all.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _tiny_data(tmp_path: Path, n: int = 4) -> Path:
    data = tmp_path / "data"
    for f in SAMPLE[:n]:
        (data / f.name[:9]).mkdir(parents=True)
        (data / f.name[:9] / f.name).symlink_to(f)
    return data


def _wait_for(path: Path, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not path.exists():
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.2)


# ------------------------------------------------------------------------------- lock + Ctrl-C
@pytest.mark.slow
def test_second_run_refuses_naming_the_first_and_ctrl_c_names_stage_and_resume(tmp_path):
    env = _env(tmp_path)
    # SIGINT as a terminal delivers it: pytest-xdist workers ignore SIGINT and a child inherits
    # an ignored signal (bash cannot even trap it then), so the run restores the default
    first = subprocess.Popen(["bash", "run_all.sh", "--stop-stage", "1"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
        # Ctrl-C once stage 1 runs (its 900-image pass takes tens of seconds, however loaded
        # the machine): the message must name it and the resume command start there.
        _wait_for(tmp_path / "a" / "logs" / MODEL / "1_pytorch_baseline.log", timeout=300)
        assert first.poll() is None, "the run ended before the signal:\n" + first.stderr.read()
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 130, err
    m = re.search(r"interrupted during stage (\d) \((.+?)\)", err)
    assert m, err
    stage = int(m.group(1))
    assert (stage, m.group(2)) == (1, "PyTorch FP32 baseline"), err
    assert f"resume with: MODEL={MODEL} ARTIFACTS={tmp_path / 'a'} RESULTS={tmp_path / 'r'} " \
           f"bash {ROOT / 'run_all.sh'} --stage {stage} --stop-stage 1" in err
    assert not lock.exists()                              # released
    # nothing half-written: no temporary left, and the reference is either absent or whole
    # (since the preload server, stage 1 may write it before the signal lands: CI, stop 38)
    assert not list((tmp_path / "a").rglob(".tmp-*"))
    splits = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert {"eval", "calib"} <= set(splits)
    ref = tmp_path / "a" / MODEL / "ref_logits.npz"
    if ref.exists():
        with np.load(ref) as z:
            assert z["logits"].shape == (len(splits["eval"]), 1000)
            assert np.isfinite(z["logits"]).all() and len(z["y"]) == len(z["files"])


@pytest.mark.slow
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
@pytest.mark.slow
def test_smoke_run_never_moves_or_replaces_a_full_runs_results(tmp_path):
    """A full-range smoke run (stopped at stage 1 by a checkpoint it cannot load): the old
    script moved results/<model>/ aside before stage 0; now the smoke run works in its own
    folders."""
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    env = _env(tmp_path, VAL_ROOT=str(_tiny_data(tmp_path)), ALLOW_CLASS_SUBSET="1",
               WEIGHTS=str(tmp_path / "bad.pt"))
    row = _good_row(env)
    before = row.read_text()
    p = _run_all(env, "--limit", "4")
    assert p.returncode == 1, p.stdout + p.stderr
    assert row.read_text() == before and "previous results" not in p.stdout
    assert f"results: {tmp_path / 'r' / 'smoke'}; smoke run on 4 images" in p.stdout
    assert f"resume with: MODEL={MODEL} ARTIFACTS={tmp_path / 'a'} RESULTS={tmp_path / 'r'} " \
           in p.stderr and " VAL_ROOT=" in p.stderr and "--stage 1 --limit 4" in p.stderr
    assert (tmp_path / "a" / "smoke" / "logs" / MODEL / "0_prepare_data.log").exists()
    assert not (tmp_path / "a" / "logs").exists()


@pytest.mark.slow
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
@pytest.mark.slow
def test_unwritable_results_folder_is_refused_before_any_stage(tmp_path):
    p = _run_all(_env(tmp_path, RESULTS="/sys/no_results_here"), "--stop-stage", "0")
    assert p.returncode == 1 and "cannot write to /sys/no_results_here" in p.stderr
    assert "Stage 0" not in p.stdout


@pytest.mark.slow
def test_weights_folder_and_bad_input_shape_are_usage_errors(tmp_path):
    p = _run_all(_env(tmp_path, WEIGHTS=str(tmp_path)))
    assert p.returncode == 2 and f"WEIGHTS={tmp_path} is a folder" in p.stderr
    p = _run_all(_env(tmp_path, MODEL="tests.custom_models:two_head",
                      INPUT_SHAPE="image:1,3,-16,16 tokens:1,4,16"))
    assert p.returncode == 2 and "INPUT_SHAPE: --input-shape 'image:1,3,-16,16'" in p.stderr
    assert "every dimension must be >= 1" in p.stderr and "Stage" not in p.stdout
    # a built-in classifier ignored INPUT_SHAPE without a word
    p = _run_all(_env(tmp_path, INPUT_SHAPE="x:1,3,8,8"))
    assert p.returncode == 2 and "INPUT_SHAPE is for models with their own data" in p.stderr
    assert "unset INPUT_SHAPE" in p.stderr and "Stage" not in p.stdout


# ------------------------------------------------------------------------------- console
@pytest.mark.slow
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


# ----------------------------------------------------------------- run_all.sh: orphaned stage
@pytest.mark.slow
def test_rerun_refuses_while_a_stage_of_a_killed_run_still_writes(tmp_path):
    """kill -9 of run_all.sh leaves its running stage alive (orphaned, still writing into the
    artifacts folder); a rerun must not call that lock stale and run beside it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    # Stage 0 of this run sleeps first, so it is surely running when the script is killed.
    (hook / "sitecustomize.py").write_text(
        "import os, time\n"
        "if b'0_prepare_data.py' in open('/proc/self/cmdline', 'rb').read():\n"
        "    time.sleep(float(os.environ.get('REVIEW_STAGE_SLEEP', '0')))\n")
    # (PIPELINE_PRELOAD=0: the hook reads the command line at interpreter start, which a stage
    # forked by the preload server does not have; test_zygote covers that server)
    env = _env(tmp_path, PYTHONPATH=f"{hook}:{ROOT}", REVIEW_STAGE_SLEEP="120",
               PIPELINE_PRELOAD="0")
    _good_row(env)
    first = subprocess.Popen(["bash", "run_all.sh", "--stop-stage", "0"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        _wait_for(tmp_path / "a" / "logs" / MODEL / "0_prepare_data.log")
        time.sleep(1)
        os.kill(first.pid, signal.SIGKILL)  # the script only: its stage lives on
        first.wait(timeout=30)
        second = _run_all(dict(env, REVIEW_STAGE_SLEEP="0"), "--stage", "8", "--stop-stage", "8",
                          timeout=120)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "still running" in second.stderr and "0_prepare_data.py" in second.stderr, \
            second.stderr
        assert f"pid {first.pid}" in second.stderr  # the killed run, named
        assert "Stage 8" not in second.stdout
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the orphan keeps the killed script's group
    # Once the orphan is gone the lock is stale and is cleared.
    deadline = time.time() + 30
    third = None
    while time.time() < deadline:
        third = _run_all(dict(env, REVIEW_STAGE_SLEEP="0"), "--stage", "8", "--stop-stage", "8",
                         timeout=120)
        if third.returncode == 0:
            break
        time.sleep(1)
    assert third is not None and third.returncode == 0, third.stderr
    assert "clearing a stale lock" in third.stderr


# ------------------------------------------------------------------------------- your own model
@pytest.mark.slow
def test_run_all_own_data_flags_paths_and_kind(tmp_path):
    """--model/--inputs on run_all.sh: the kind is said first, a relative --inputs is taken from
    where the user stands, the resume line carries it quoted; a model with its own data and no
    data is refused; a factory that cannot be imported is named, not called unknown."""
    own = "tests.custom_models:image_depth"
    p = _run_all(_env(tmp_path), "--model", own)
    assert p.returncode == 2 and "has its own data" in p.stderr and "--inputs eval.npz" in p.stderr
    p = _run_all(_env(tmp_path), "--model", "tests.custom_models:nope")
    assert p.returncode == 2 and "cannot import nope from tests.custom_models" in p.stderr
    user = tmp_path / "my dir"
    user.mkdir()
    np.savez(user / "eval.npz", image=np.zeros((2, 3, 8, 8), np.float32),
             depth=np.ones((2, 1, 8, 8), np.float32))
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--model", own, "--inputs", "eval.npz",
                        "--stop-stage", "0"], cwd=user, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"(own-data: no preprocessing carried" in p.stdout
    assert f"not applicable: {own} has its own data ({user / 'eval.npz'})" in p.stdout
    assert f"Stage 0: prepare data: not applicable ({own} has its own data)" in p.stdout
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--model", own, "--inputs",
                        "missing.npz"], cwd=user, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "INPUTS=missing.npz: no such file" in p.stderr
    # ARTIFACTS / RESULTS given relative are taken from where the user stands, as the stages do
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--stage", "8", "--stop-stage", "8"],
                       cwd=user, env={**_env(tmp_path), "ARTIFACTS": "rel a", "RESULTS": "rel r"},
                       capture_output=True, text=True, timeout=300)
    assert f"(artifacts: {user / 'rel a'}, results: {user / 'rel r'})" in p.stdout, p.stdout
    # --random-init (seeded random weights in stages 1-2) and a checkpoint: one or the other
    w = user / "w.pt"
    w.write_bytes(b"x")
    p = _run_all(_env(tmp_path), "--random-init", "--weights", str(w))
    assert p.returncode == 2 and "--random-init and WEIGHTS/--weights: give one" in p.stderr
    # a classifier refuses the own-data settings instead of dropping them
    p = _run_all(_env(tmp_path), "--inputs", str(user / "eval.npz"))
    assert p.returncode == 2 and "INPUTS is for models with their own data" in p.stderr


@pytest.mark.slow
def test_a_stages_usage_error_stays_a_usage_error(tmp_path):
    """run_all.sh turned every failed stage into exit 1: an INPUT_SHAPE the model rejects (stage
    1's usage error, 2) must stay 2, with the stage's message and the resume line."""
    p = _run_all(_env(tmp_path, INPUT_SHAPE="x:1,5,8,8"), "--model", "tests.custom_models:tiny_net",
                 "--stop-stage", "1")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "forward() fails on --input-shape x:1,5,8,8" in p.stderr
    assert "resume with:" in p.stderr


@pytest.mark.slow
def test_stage_log_replaces_a_planted_link_and_never_writes_through_it(tmp_path):
    """run_all.sh wrote each stage's output with ``>"$log"``, which follows a link planted at
    the log's name and overwrites what it points to."""
    env = _env(tmp_path, VAL_ROOT=str(_tiny_data(tmp_path)), ALLOW_CLASS_SUBSET="1")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    log = tmp_path / "a" / "smoke" / "logs" / MODEL / "0_prepare_data.log"
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    p = _run_all(env, "--limit", "2", "--stop-stage", "0")
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "precious"
    assert not log.is_symlink() and "preprocess eval" in log.read_text()
