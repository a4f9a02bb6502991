"""Stage 7 (7_trt_eval.py): skips without TensorRT, missing engines, usage errors, the batch
invariance check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploykit.evaluate import EvalData
from deploykit.io import write_json
from deploykit.results import result_record

from tests.helpers.stages import ROOT, load_stage, run_stage
from tests.helpers.trt_models import _env, _linear_infer


MODEL = "efficientnet_lite0"


# ------------------------------------------------------------------------------- stage 7
@pytest.mark.slow
def test_stage7_missing_engine_is_named_before_the_tensorrt_check_and_writes_no_row(env,
                                                                                    tmp_path):
    p = run_stage(["7_trt_eval.py", "--model", MODEL, "--engine", str(tmp_path / "missing.plan"),
                   "--tag", "trt_missing"], env, check=False)
    assert p.returncode == 1 and "missing.plan: no such file" in p.stderr, p.stderr
    assert "TensorRT Python package" not in p.stdout + p.stderr
    assert not (Path(env["RESULTS"]) / MODEL / "trt_missing.json").exists()
    p = run_stage(["7_trt_eval.py", "--model", MODEL, "--engine", str(tmp_path), "--tag",
                   "trt_missing"], env, check=False)
    assert p.returncode == 2 and "is a folder" in p.stderr


@pytest.mark.slow
def test_stage7_engine_that_stage6_did_not_build_is_still_a_skipped_row(env):
    res = Path(env["RESULTS"]) / MODEL
    write_json(res / "trt_build_fp16.json", result_record(
        "6_build_engines", "TensorRT", "FP16", MODEL, "trt_build_fp16", status="skipped",
        reason="trtexec not found"))
    engine = Path(env["ARTIFACTS"]) / MODEL / "engines" / "fp16.plan"
    p = run_stage(["7_trt_eval.py", "--model", MODEL, "--engine", str(engine), "--tag",
                   "trt_fp16"], env)
    assert "SKIPPED" in p.stdout and "trtexec not found" in p.stdout
    assert json.loads((res / "trt_fp16.json").read_text())["status"] == "skipped"


# --------------------------------------------------------------------------------------------
# Stage 7 on this machine (no TensorRT): skip cleanly
# --------------------------------------------------------------------------------------------
def _no_trt():
    import importlib.util
    return importlib.util.find_spec("tensorrt") is None


@pytest.mark.slow
@pytest.mark.skipif(not _no_trt(), reason="TensorRT is importable here")
def test_stage7_skips_without_tensorrt(tmp_path):
    eng = tmp_path / "a" / "mobilenet_v3_small" / "engines" / "int8.plan"
    eng.parent.mkdir(parents=True)
    eng.write_bytes(b"a plan file")  # a missing plan is an error named before this check
    p = subprocess.run([sys.executable, "7_trt_eval.py", "--engine", str(eng), "--tag", "trt_int8"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "SKIPPED" in p.stdout
    rec = json.loads((tmp_path / "r/mobilenet_v3_small/trt_int8.json").read_text())
    assert rec["status"] == "skipped" and "tensorrt" in rec["reason"].lower()
    assert rec["backend"] == "TensorRT" and rec["precision"] == "INT8" and rec["variant"] == "int8"
    assert all(rec[k] is None for k in ("latency", "accuracy", "parity"))  # no numbers without a run
    assert rec["provenance"]["args"]["tag"] == "trt_int8"


@pytest.mark.slow
@pytest.mark.skipif(not _no_trt(), reason="TensorRT is importable here")
def test_stage7_several_engines_one_process_each_row_its_own_command(tmp_path):
    """Several --engine/--tag pairs: each row is written as its one-engine command would write
    it and records that command; an engine that fails does not stop the next one (exit 1,
    naming it)."""
    eng = tmp_path / "a" / "mobilenet_v3_small" / "engines"
    eng.mkdir(parents=True)
    for v in ("fp16", "int8"):
        (eng / f"{v}.plan").write_bytes(b"a plan file")
    argv = ["7_trt_eval.py", "--engine", str(eng / "fp16.plan"), "--tag", "trt_fp16",
            "--engine", str(eng / "fp32.plan"), "--tag", "trt_fp32",  # not there, not skipped
            "--engine", str(eng / "int8.plan"), "--tag", "trt_int8", "--iters", "7"]
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "FAILED trt_fp32" in p.stderr and "1 of 3 engines failed" in p.stderr
    assert "\n  trt_fp32: --engine " in p.stderr  # each failed engine named with its reason
    assert p.stdout.splitlines()[-2:] == ["trt_fp16: skipped (why: above)",
                                          "trt_int8: skipped (why: above)"]
    res = tmp_path / "r" / "mobilenet_v3_small"
    assert not (res / "trt_fp32.json").exists()
    for v in ("fp16", "int8"):
        rec = json.loads((res / f"trt_{v}.json").read_text())
        assert rec["status"] == "skipped" and rec["variant"] == v
        prov = rec["provenance"]
        assert prov["command"] == (f"7_trt_eval.py --engine {eng / f'{v}.plan'} --tag trt_{v} "
                                   "--model mobilenet_v3_small --iters 7")
        assert prov["args"]["engine"] == str(eng / f"{v}.plan") and prov["args"]["tag"] == f"trt_{v}"
        assert prov["rerun"]["argv"][-8:] == ["--engine", str(eng / f"{v}.plan"), "--tag",
                                              f"trt_{v}", "--model", "mobilenet_v3_small",
                                              "--iters", "7"]


@pytest.mark.parametrize("extra,message", [
    (["--engine", "b.plan"], "2 --engine but 1 --tag"),
    (["--engine", "b.plan", "--tag", "t"], "--tag t given twice"),
    (["--engine", "b.plan", "--tag", "u", "--onnx", "x.onnx"], "--onnx apply to one engine"),
    (["--engine", "b.plan", "--tag", "u", "--precision", "FP16"], "--precision apply to one"),
    (["--engine", "b.plan", "--tag", "bad/tag"], "bad/tag"),
    (["--engine", "b.plan", "--tag", "u", "--iters", "0"], "--iters"),
])
def test_stage7_several_engines_usage_errors(tmp_path, monkeypatch, extra, message):
    from deploykit.errors import UsageError
    mod = load_stage("7_trt_eval")
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    args = mod.get_args_parser().parse_args(["--model", MODEL, "--engine", "a.plan", "--tag", "t",
                                             *extra])
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        mod.main(args)
    assert not (tmp_path / "r").exists()  # refused before anything is written


@pytest.mark.slow
def test_stage7_usage_error_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "7_trt_eval.py", "--engine", "x.plan", "--tag", "t",
                        "--iters", "0"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "usage:" in p.stderr


class _FakeRunner:
    """A runner stand-in with the deploykit.runners.Runner surface stage 7's check uses (no TensorRT)."""

    def __init__(self, w, batch_range=(1, 64), batch_dependent=0.0):
        self.w, self.batch_range, self.bd = w, batch_range, batch_dependent

    def infer(self, feed):
        return _linear_infer(self.w, self.bd)(feed)


def test_stage7_batch_invariance_check_on_eval_data():

    stage7 = load_stage("7_trt_eval")
    rng = np.random.default_rng(0)
    data = EvalData(x_u8=rng.integers(0, 255, (20, 3, 2, 2), dtype=np.uint8),
                             mean=(0.5,) * 3, std=(0.5,) * 3, input_name="input")
    w = rng.standard_normal((12, 10))
    ok = stage7.batch_invariance_check(_FakeRunner(w), data, 8)
    assert ok["ok"] and ok["batch"] == 8 and ok["n"] == 16
    bad = stage7.batch_invariance_check(_FakeRunner(w, batch_dependent=1.0), data, 8)
    assert bad["ok"] is False and "NVIDIA/TensorRT#4796" in bad["note"]
    static = stage7.batch_invariance_check(_FakeRunner(w, batch_range=(4, 4)), data, 8)
    assert static["ok"] is None and "no batch-1 vs batch-N" in static["reason"]


def test_stage7_several_engines_a_folder_is_refused_before_any_engine_runs(tmp_path, monkeypatch):
    from deploykit.errors import UsageError
    mod = load_stage("7_trt_eval")
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    ran = []
    monkeypatch.setattr(mod, "run_script", lambda name, argv: ran.append(argv))
    args = mod.get_args_parser().parse_args(["--model", MODEL, "--engine", "a.plan", "--tag", "a",
                                             "--engine", str(tmp_path), "--tag", "b"])
    with pytest.raises(UsageError, match="is a folder"):
        mod.main(args)
    assert ran == []


def test_stage7_several_engines_any_error_of_one_leaves_the_others_and_lines_name_each_row(
        tmp_path, monkeypatch, capsys):
    """An engine whose run raises anything (OSError, TensorRT's RuntimeError) is named with
    its reason; the engines after it still run; the last lines name each row's tag and, when
    not ok, its status."""
    from deploykit.errors import StageError
    mod = load_stage("7_trt_eval")
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    ran = []

    def fake(name, argv):
        tag = argv[argv.index("--tag") + 1]
        ran.append(tag)
        if tag == "b":
            raise OSError("File name too long")
        return {"tag": tag, "status": "failed" if tag == "c" else "ok", "backend": "TensorRT",
                "precision": "INT8", "device": "cuda", "n_images": 8,
                "accuracy": {"top1": 50.0, "top5": 75.0}, "latency": None, "parity": None}
    monkeypatch.setattr(mod, "run_script", fake)
    monkeypatch.setattr(mod, "summary_line", lambda rec: f"summary of {rec['tag']}")
    args = mod.get_args_parser().parse_args(
        ["--model", MODEL, "--engine", "a.plan", "--tag", "a", "--engine", "b.plan", "--tag", "b",
         "--engine", "c.plan", "--tag", "c"])
    with pytest.raises(StageError, match=r"1 of 3 engines failed.*\n  b: File name too long"):
        mod.main(args)
    assert ran == ["a", "b", "c"]
    out = capsys.readouterr()
    assert out.out.splitlines()[-2:] == ["a: summary of a", "c: FAILED: summary of c"]
    assert "FAILED b (b.plan): OSError: File name too long" in out.err


def test_stage7_several_engines_all_failing_says_no_row_was_written(tmp_path, monkeypatch):
    from deploykit.errors import StageError
    mod = load_stage("7_trt_eval")
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))

    def fake(name, argv):
        raise MemoryError
    monkeypatch.setattr(mod, "run_script", fake)
    args = mod.get_args_parser().parse_args(["--model", MODEL, "--engine", "a.plan", "--tag", "a",
                                             "--engine", "b.plan", "--tag", "b"])
    with pytest.raises(StageError, match="2 of 2 engines failed; no row was written:\n  a: "
                                         "MemoryError\n  b: MemoryError"):
        mod.main(args)
