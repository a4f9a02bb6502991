"""Reliability review of issues 11/12 with new inputs (a newcomer's bad inputs and faults):
a stage orphaned by ``kill -9`` of run_all.sh, a symlink loop in the data folder, environment
failures of a stage (out of memory, Ctrl-C), more CPU threads than CPUs, and results files that
are valid JSON but not this model's rows.

Each test builds its own input and fails on the code before the fix it covers.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.test_reliability_run_all import MODEL, _env, _good_row, _run_all, _wait_for
from deploykit.cli import add_shared_args, cli, stage_parser
from deploykit.data.images import imagenet_wnids, list_images
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import EvalData, latency
from deploykit.io import write_json
from deploykit.layout import DEFAULT_DATA
from deploykit.results import result_record, write_result
from deploykit.runners import Runner
from deploykit.timing import MIN_ITERS


# ----------------------------------------------------------------- run_all.sh: orphaned stage
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
    env = _env(tmp_path, PYTHONPATH=f"{hook}:{ROOT}", REVIEW_STAGE_SLEEP="120")
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


# ----------------------------------------------------------------- data folder: folder links
def _class_folders(tmp_path: Path, n: int = 3) -> tuple[Path, list[Path]]:
    sample = sorted(DEFAULT_DATA.glob("n*.JPEG"))[:n]
    data = tmp_path / "data"
    for f in sample:
        (data / f.name[:9]).mkdir(parents=True)
        (data / f.name[:9] / f.name).symlink_to(f)
    return data, sample


@pytest.mark.parametrize("target", ["root", "other_class", "itself", "parent_of_root"])
def test_folder_link_loops_never_list_images_twice_or_under_another_label(tmp_path, capsys,
                                                                          target):
    """A link inside a class folder back to the data folder (a loop: os.walk follows it until
    ELOOP), to another class or to itself listed every image again under this class's label,
    exit 0; now each folder is listed once and the link is named."""
    data, sample = _class_folders(tmp_path)
    first = data / sample[0].name[:9]
    dest = {"root": "..", "other_class": f"../{sample[1].name[:9]}", "itself": ".",
            "parent_of_root": "../.."}[target]
    (first / "link").symlink_to(dest)
    items, _ = list_images(data, allow_subset=True)
    wnids = imagenet_wnids()
    truth = {f"{f.name[:9]}/{f.name}": wnids.index(f.name[:9]) for f in sample}
    assert dict(items) == truth            # each image once, with its own class's label
    err = capsys.readouterr().err
    assert "folder link(s)" in err and str(first / 'link') in err and "not followed" in err


def test_two_class_folders_that_are_one_folder_are_refused(tmp_path):
    data, sample = _class_folders(tmp_path, 2)
    wnid = imagenet_wnids()[500]
    (data / wnid).symlink_to(data / sample[0].name[:9])
    with pytest.raises(StageError, match=f"{sample[0].name[:9]}, {wnid}|{wnid}, "
                                                f"{sample[0].name[:9]}") as e:
        list_images(data, allow_subset=True)
    assert "two labels" in str(e.value)


# ----------------------------------------------------------------- stage CLI: environment faults
def _cli(main, argv: list[str], monkeypatch) -> SystemExit:
    def parser():
        p = stage_parser("test stage", prog="stage_x.py")
        add_shared_args(p, "batch_size", "latency_batch", "limit", "threads")
        return p

    monkeypatch.setattr(sys, "argv", ["stage_x.py", *argv])
    try:
        with pytest.raises(SystemExit) as e:
            cli(parser, main)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped common.cli as a traceback")
    return e.value


def test_out_of_memory_is_a_message_naming_the_batch_flags(monkeypatch, capsys):
    """--latency-batch 100000 ended stage 1 in a numpy MemoryError traceback."""
    def main(args):
        raise MemoryError("Unable to allocate 56.1 GiB for an array with shape "
                          "(100000, 3, 224, 224) and data type float32")

    e = _cli(main, ["--latency-batch", "100000"], monkeypatch)
    err = capsys.readouterr().err
    assert e.code == 1
    assert "stage_x.py: FAILED: out of memory (Unable to allocate 56.1 GiB" in err
    assert "--latency-batch 100000" in err and "lower the batch sizes" in err
    assert "Traceback" not in err


def test_ctrl_c_of_a_stage_is_a_message_and_exit_130(monkeypatch, capsys):
    def main(args):
        raise KeyboardInterrupt

    e = _cli(main, [], monkeypatch)
    err = capsys.readouterr().err
    assert e.code == 130
    assert "stage_x.py: interrupted (Ctrl-C)" in err and "rerun the same command" in err


CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("value", ["-1", "abc", str(CPUS + 1), "9999"])
def test_threads_outside_0_to_cpu_count_is_a_usage_error(value, monkeypatch, capsys):
    """--threads 9999 on 2 CPUs was accepted and stage 3 ran for minutes without finishing."""
    e = _cli(lambda args: None, ["--threads", value], monkeypatch)
    err = capsys.readouterr().err
    assert e.code == 2
    assert "argument --threads" in err and value in err
    if value.lstrip("-").isdigit():
        assert f"1..{CPUS}" in err


def test_threads_within_the_cpu_count_is_accepted(monkeypatch):
    seen = {}
    e = _cli(lambda args: seen.update(t=args.threads) or sys.exit(0),
             ["--threads", str(CPUS)], monkeypatch)
    assert e.code == 0 and seen["t"] == CPUS


# ----------------------------------------------------------------- report: rows that are not ours
@pytest.mark.parametrize("case", ["list", "status", "tag", "model"])
def test_report_refuses_a_valid_json_that_is_not_this_folders_row(tmp_path, case):
    """Valid JSON that is no row of this folder was shown as one (another model's numbers, a
    row standing in for another tag, status 'weird') or, for a list, silently dropped with a
    'not run: no ort_fp32.json' that named a file which is there."""
    from tests.conftest import run_stage

    env = _env(tmp_path)
    good = _good_row(env)
    res = good.parent
    other = json.loads(good.read_text())
    other.update(backend="ORT", tag="ort_fp32")
    if case == "list":
        other = [other]
    elif case == "status":
        other["status"] = "weird"
    elif case == "tag":
        other["tag"] = "ort_fp16"  # a copy of another row's file
    else:
        other["model"] = "resnet50"  # a row copied from results/resnet50/
    (res / "ort_fp32.json").write_text(json.dumps(other))
    p = run_stage(["8_report.py", "--model", MODEL], env)
    want = {"list": "a JSON list, not a results row",
            "status": "field status is 'weird', expected one of ok, failed, skipped",
            "tag": "field tag is 'ort_fp16' but the file is ort_fp32.json",
            "model": f"field model is 'resnet50' but the folder is {MODEL}/"}[case]
    assert f"{res / 'ort_fp32.json'}: {want}" in p.stderr
    md = (res / "REPORT.md").read_text()
    assert f"| ort_fp32 | cpu |" in md and f"invalid: ort_fp32.json: {want}" in md
    assert not [ln for ln in md.splitlines() if "| ort_fp16 |" in ln and "not run" not in ln]
    assert "| PyTorch | FP32 | pytorch_fp32_cpu |" in md  # the good row is still reported
    assert "1 invalid" in p.stdout and "invalid (see the warnings): ort_fp32.json" in p.stdout


# ----------------------------------------------------------------- benchmarks and --help
@pytest.mark.parametrize("cmd,flag", [
    (["benchmarks/data_path.py", "--n", "0"], "--n: must be an integer >= 1 (got 0)"),
    (["benchmarks/data_path.py", "--rounds", "0"], "--rounds: must be an integer >= 1 (got 0)"),
    (["benchmarks/data_path.py", "--workers", "-1"], "--workers: must be an integer >= 0"),
    (["benchmarks/harness_fidelity.py", "--iters", "0"], "--iters: must be an integer >= 1"),
    (["benchmarks/harness_fidelity.py", "--rounds", "0"], "--rounds: must be an integer >= 1"),
    (["benchmarks/harness_fidelity.py", "--warmup", "-2"], "--warmup: must be an integer >= 0"),
    (["benchmarks/profile_run.py", "--", "NOTANASSIGNMENT"], "'NOTANASSIGNMENT' is not VAR=value"),
])
def test_benchmark_flags_with_impossible_values_are_usage_errors(tmp_path, cmd, flag):
    """These ended in tracebacks (an empty median, ImageFolder finding no class folder,
    DataLoader's ValueError, a dict update error) after seconds of work."""
    p = subprocess.run([sys.executable, *cmd, *(["--out", str(tmp_path / "o.json")]
                                                if "profile_run" not in cmd[0] else [])],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert flag in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("cmd", [["python", "trt_tools.py"], ["bash", "benchmarks/gpu_rows.sh"]])
def test_help_of_every_tool_exits_0_and_prints_usage(cmd):
    """`trt_tools.py --help` exited 2 as a usage error; `gpu_rows.sh --help` took --help for a
    model name and failed with 'no CUDA GPU'."""
    exe = sys.executable if cmd[0] == "python" else cmd[0]
    p = subprocess.run([exe, *cmd[1:], "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PATH=f"{Path(sys.executable).parent}:"
                                                          f"{os.environ['PATH']}"))
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout.lower() or "Usage" in p.stdout


# ----------------------------------------------------------------- latency: --iters honoured
class _SlowRunner:
    """A runner whose every call takes 20 ms (runners.Runner.time's default loop)."""

    batch_range = (1, None)
    max_seconds = Runner.max_seconds

    def infer(self, feed):
        time.sleep(0.02)
        return {}

    def time(self, feed, warmup, iters):
        return Runner.time(self, feed, warmup, iters)


@pytest.mark.parametrize("stage", ["1_pytorch_baseline", "3_onnx_eval", "7_trt_eval"])
def test_max_seconds_flag_exists_and_is_checked(stage):
    """--iters 1000 silently gave ~140 timed runs (an undocumented 5 s budget, no way to lift
    it); the budget is now a flag of every stage that times."""
    import importlib

    parser = importlib.import_module(stage).get_args_parser()
    req = {"1_pytorch_baseline": [], "3_onnx_eval": ["--onnx", "f.onnx", "--tag", "t"],
           "7_trt_eval": ["--engine", "f.plan", "--tag", "t"]}[stage]
    assert parser.parse_args([*req, "--max-seconds", "0"]).max_seconds == 0
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*req, "--max-seconds", "-1"])
    assert e.value.code == 2


def test_latency_loop_cut_by_the_budget_says_so_and_0_runs_every_iteration(monkeypatch, capsys):

    data = EvalData(x_u8=np.zeros((2, 3, 4, 4), np.uint8), y=np.zeros(2, np.int64),
                             files=["a", "b"], mean=(0.5,) * 3, std=(0.5,) * 3)
    slow = _SlowRunner()
    slow.max_seconds = 0.1  # what --max-seconds 0.1 sets on the runner evaluate() times
    cut = latency(slow, data, 1, 0, 40)
    assert MIN_ITERS <= cut["iters"] < 40 and cut["max_seconds"] == 0.1
    err = capsys.readouterr().err
    assert f"{cut['iters']} of --iters 40 timed runs" in err and "--max-seconds 0" in err
    slow.max_seconds = float("inf")  # what --max-seconds 0 sets
    full = latency(slow, data, 1, 0, 40)
    assert full["iters"] == 40 and full["max_seconds"] is None
    assert "note: latency" not in capsys.readouterr().err


# ----------------------------------------------------------------- tags that clash with files
@pytest.mark.parametrize("tag,kind", [("data", "file"), ("export", "file"),
                                      ("quant_int8", "file"), ("ort_fp32.failed", "sidecar"),
                                      ("ort_fp32.skipped", "sidecar")])
def test_a_tag_that_names_another_results_file_is_refused_before_any_work(tmp_path, tag, kind):
    """--tag data replaced stage 0's data.json by a row; --tag ort_fp32.failed wrote a good row
    that the report took for ort_fp32's failed rerun (and ort_fp32's next good run deleted)."""
    from tests.conftest import run_stage

    env = _env(tmp_path)
    res = tmp_path / "r" / MODEL
    other = res / f"{tag}.json"
    if kind == "file":
        write_json(other, {"stage": "0_prepare_data", "n_eval": 900})
    before = other.read_bytes() if other.exists() else None
    p = run_stage(["3_onnx_eval.py", "--model", MODEL, "--onnx", str(tmp_path / "none.onnx"),
                   "--tag", tag], env, check=False)
    assert p.returncode == 2, p.stderr
    assert f"--tag {tag!r}" in p.stderr and "choose another tag" in p.stderr
    assert ("not a results row" if kind == "file" else "kept beside the row") in p.stderr
    assert (other.read_bytes() if other.exists() else None) == before
    # the row writer itself refuses too (every stage writes rows through it)
    rec = result_record("3_onnx_eval", "ORT", "FP32", MODEL, tag)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RESULTS", str(tmp_path / "r"))
        with pytest.raises(UsageError, match="choose another tag"):
            write_result(MODEL, tag, rec)
    assert (other.read_bytes() if other.exists() else None) == before


def test_a_tag_naming_an_earlier_row_is_still_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    rec = result_record("3_onnx_eval", "ORT", "FP32", MODEL, "ort_x")
    write_result(MODEL, "ort_x", rec)
    rec["reason"] = "second"
    path = write_result(MODEL, "ort_x", rec)
    assert json.loads(path.read_text())["reason"] == "second"


@pytest.mark.parametrize("name", ["", "   "])
def test_empty_model_name_is_a_usage_error(name, capsys):
    """``--model ""`` reached stage 8 as a folder named "" ("no results in ...")."""
    report = importlib.import_module("8_report")
    with pytest.raises(SystemExit) as e:
        report.get_args_parser().parse_args(["--model", name])
    assert e.value.code == 2
    assert "empty model name" in capsys.readouterr().err
