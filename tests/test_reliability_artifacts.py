"""Reliability of the evaluation stages and the report (issue 11): a failed or interrupted rerun
never destroys a good artifact, bad flags are refused before any work, and the report names the
file and field of a broken results JSON.

Stage 3 runs here on a tiny ONNX classifier built in the test (GlobalAveragePool + Gemm to 1000
logits) over six real images of the embedded sample, so each case takes seconds.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_stage
from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.io import write_json
from deploykit.layout import DEFAULT_DATA, model_tag
from deploykit.models import model_spec
from deploykit.results import result_record, write_result
from deploykit.runners import TorchRunner

MODEL = "efficientnet_lite0"
SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))


def _classifier_onnx(path: Path, classes: int = 1000, seed: int = 0) -> Path:
    """``input [N,3,224,224] -> GlobalAveragePool -> Flatten -> Gemm -> logits [N, classes]``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((3, classes)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b")
    g = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("Gemm", ["f", "w", "b"], ["logits"])], "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])], [w, b])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Stage 0 on six classes, a tiny classifier ONNX and its reference logits."""
    base = tmp_path_factory.mktemp("art")
    data = base / "data"
    for f in SAMPLE[:6]:
        (data / f.name[:9]).mkdir(parents=True)
        (data / f.name[:9] / f.name).symlink_to(f)
    env = dict(os.environ, ARTIFACTS=str(base / "a"), RESULTS=str(base / "r"),
               PYTHONPATH=str(ROOT), ALLOW_CLASS_SUBSET="1")
    run_stage(["0_prepare_data.py", "--data-root", str(data), "--model", MODEL,
               "--calib-fraction", "0"], env)
    onnx_dir = base / "a" / MODEL / "onnx"
    onnx_dir.mkdir(parents=True)
    good = _classifier_onnx(onnx_dir / "fp32.onnx")
    _classifier_onnx(onnx_dir / "ten_classes.onnx", classes=10)
    import onnxruntime as ort

    old = os.environ.get("ARTIFACTS")
    os.environ["ARTIFACTS"] = str(base / "a")
    try:
        spec = model_spec(MODEL)
        x, y, files = load_split("eval", spec)
    finally:
        if old is None:
            del os.environ["ARTIFACTS"]
        else:
            os.environ["ARTIFACTS"] = old
    logits = ort.InferenceSession(str(good), providers=["CPUExecutionProvider"]).run(
        None, {"input": normalize(x, spec.mean, spec.std)})[0]
    np.savez(base / "a" / MODEL / "ref_logits.npz", logits=logits, y=y, files=np.array(files))
    return base


@pytest.fixture()
def env(prepared, tmp_path) -> dict:
    """A private copy of the prepared artifacts and an empty results folder."""
    shutil.copytree(prepared / "a", tmp_path / "a", symlinks=True)
    return dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
                PYTHONPATH=str(ROOT))


FAST = ["--iters", "2", "--warmup", "0", "--model", MODEL]


def _stage3(env, onnx: str, tag: str, *extra, check=True):
    return run_stage(["3_onnx_eval.py", "--onnx", str(Path(env["ARTIFACTS"]) / MODEL / "onnx" /
                                                      onnx), "--tag", tag, *FAST, *extra],
                     env, check=check)


def _no_temporaries(*folders):
    for folder in folders:
        assert not list(Path(folder).rglob(".tmp-*")), list(Path(folder).rglob(".tmp-*"))


# ------------------------------------------------------------------------------- stage 3
@pytest.mark.parametrize("bad", ["wrong_onnx", "ep_unavailable"])
def test_stage3_failed_rerun_keeps_the_good_row_and_the_report_shows_both(env, bad):
    _stage3(env, "fp32.onnx", "ort_fp32")
    row = Path(env["RESULTS"]) / MODEL / "ort_fp32.json"
    good = row.read_text()
    assert json.loads(good)["status"] == "ok"
    if bad == "wrong_onnx":  # a 10-class model under the tag of the good 1000-class one
        p = _stage3(env, "ten_classes.onnx", "ort_fp32", check=False)
        why = "output shape"
    else:  # an EP this onnxruntime build does not have
        p = _stage3(env, "fp32.onnx", "ort_fp32", "--ep", "cuda", check=False)
        why = "CUDAExecutionProvider is not in this onnxruntime build"
    assert p.returncode == 1 and why in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert "holds a good row of an earlier run: kept" in p.stderr
    assert row.read_text() == good
    failed = json.loads((row.parent / "ort_fp32.failed.json").read_text())
    assert failed["status"] == "failed" and why in failed["reason"]
    _no_temporaries(env["RESULTS"], env["ARTIFACTS"])
    run_stage(["8_report.py", "--model", MODEL], env)
    md = (row.parent / "REPORT.md").read_text()
    lines = [ln for ln in md.splitlines() if "| ort_fp32 |" in ln]
    assert len(lines) == 2 and "| ok |" in lines[0]
    assert "latest rerun failed (ort_fp32.failed.json; the ok row above is kept)" in lines[1]
    # a later good run supersedes the failure
    _stage3(env, "fp32.onnx", "ort_fp32")
    assert not (row.parent / "ort_fp32.failed.json").exists()


def test_write_result_skipped_over_ok_goes_beside(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path))
    ok = result_record("7_trt_eval", "TensorRT", "FP16", MODEL, "trt_fp16")
    write_result(MODEL, "trt_fp16", ok)
    skipped = dict(ok, status="skipped", reason="no TensorRT on this machine")
    path = write_result(MODEL, "trt_fp16", skipped)
    assert path.name == "trt_fp16.skipped.json"
    assert json.loads((tmp_path / MODEL / "trt_fp16.json").read_text())["status"] == "ok"
    failed = dict(ok, status="failed", reason="x")
    write_result(MODEL, "trt_int8", failed)  # no good row: written under its own name
    assert json.loads((tmp_path / MODEL / "trt_int8.json").read_text())["status"] == "failed"
    # a failure that already replaced the artifact the good row described replaces the row
    write_result(MODEL, "trt_fp16", failed, keep_good=False)
    assert json.loads((tmp_path / MODEL / "trt_fp16.json").read_text())["status"] == "failed"
    assert not (tmp_path / MODEL / "trt_fp16.skipped.json").exists()


def test_stage3_unsafe_tag_is_refused_before_any_work(env, tmp_path):
    p = _stage3(env, "fp32.onnx", "../../escaped", check=False)
    assert p.returncode == 2 and "--tag '../../escaped': not a plain name" in p.stderr
    assert not list(tmp_path.rglob("escaped*"))
    assert not list((tmp_path / "r").rglob("*.json")) if (tmp_path / "r").exists() else True


def test_stage3_truncated_reference_is_named(env):
    ref = Path(env["ARTIFACTS"]) / MODEL / "ref_logits.npz"
    ref.write_bytes(ref.read_bytes()[:200])
    p = _stage3(env, "fp32.onnx", "ort_fp32", check=False)
    assert p.returncode == 1 and f"{ref} is unreadable" in p.stderr
    assert "rerun 1_pytorch_baseline.py" in p.stderr and "Traceback" not in p.stderr


def test_truncated_cache_is_rebuilt_by_a_stage(env):
    cache = next((Path(env["ARTIFACTS"]) / "cache").glob("eval-*.npz"))
    cache.write_bytes(cache.read_bytes()[:1000])
    p = _stage3(env, "fp32.onnx", "ort_fp32")
    assert cache.name in p.stderr and "rebuilding" in p.stderr
    assert json.loads((Path(env["RESULTS"]) / MODEL / "ort_fp32.json").read_text())["status"] \
        == "ok"


# ------------------------------------------------------------------------------- stage 1
def test_stage1_interrupted_during_latency_leaves_reference_and_row_as_they_were(
        env, monkeypatch):
    """Ctrl-C in the latency loop (after the accuracy pass): the earlier reference and the row
    that describes it stay untouched, and no temporary is left."""

    for k in ("ARTIFACTS", "RESULTS"):
        monkeypatch.setenv(k, env[k])
    ref = Path(env["ARTIFACTS"]) / MODEL / "ref_logits.npz"
    row = Path(env["RESULTS"]) / MODEL / "pytorch_fp32_cpu.json"
    write_json(row, {"status": "ok", "note": "the earlier run"})
    before = ref.read_bytes(), row.read_bytes()

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(TorchRunner, "time", interrupted)
    stage1 = importlib.import_module("1_pytorch_baseline")
    args = stage1.get_args_parser().parse_args(["--model", MODEL, "--iters", "3",
                                                 "--warmup", "0"])
    with pytest.raises(KeyboardInterrupt):
        stage1.main(args)
    assert (ref.read_bytes(), row.read_bytes()) == before
    _no_temporaries(env["RESULTS"], env["ARTIFACTS"])


# ------------------------------------------------------------------------------- stage 2
@pytest.mark.parametrize("flag,value", [("--min-cosine-fp16", "1.5"),
                                        ("--min-cosine-fp32", "-2.0"),
                                        ("--min-cosine-fp16", "nan")])
def test_stage2_impossible_threshold_is_refused_and_fp16_onnx_kept(env, flag, value):
    fp16 = Path(env["ARTIFACTS"]) / MODEL / "onnx" / "fp16.onnx"
    shutil.copyfile(fp16.with_name("fp32.onnx"), fp16)
    before = fp16.read_bytes()
    p = run_stage(["2_export_onnx.py", "--model", MODEL, flag, value], env, check=False)
    assert p.returncode == 2 and f"{flag} {value}: a cosine similarity lies in [-1, 1]" in p.stderr
    assert fp16.read_bytes() == before


# ------------------------------------------------------------------------------- stage 7
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


# ------------------------------------------------------------------------------- report
def test_report_names_file_and_field_of_a_wrongly_typed_json_and_keeps_the_rest(env):
    _stage3(env, "fp32.onnx", "ort_fp32")
    res = Path(env["RESULTS"]) / MODEL
    bad = json.loads((res / "ort_fp32.json").read_text())
    bad["tag"] = "ort_fp16"
    bad["accuracy"]["top1"] = "88.4"
    (res / "ort_fp16.json").write_text(json.dumps(bad))
    (res / "ort_int8.json").write_text('{"backend": "ORT", "tag": ')  # truncated JSON
    p = run_stage(["8_report.py", "--model", MODEL], env)
    assert "ort_fp16.json: field accuracy.top1 is str (\"88.4\"), expected" in p.stderr
    assert "ort_int8.json: not valid JSON" in p.stderr
    md = (res / "REPORT.md").read_text()
    assert "| ORT | FP32 | ort_fp32 |" in md  # the good row is still reported
    assert "invalid: ort_fp16.json: field accuracy.top1" in md
    assert "invalid: ort_int8.json: not valid JSON" in md
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith(f"report {MODEL}: ") and "2 invalid" in last
    assert "invalid (see the warnings): ort_fp16.json, ort_int8.json" in last


def test_report_summary_takes_the_good_row_not_a_failed_rerun_beside_it():
    report = importlib.import_module("8_report")

    def row(tag, backend, prec, top1, p50, agree=None, status="ok", file=None):
        r = result_record("x", backend, prec, MODEL, tag, status=status,
                                 reason=None if status == "ok" else "broke")
        r.update(device="cpu", accuracy={"top1": top1, "top5": top1} if top1 else None,
                 latency={"end_to_end_ms": {"p50_ms": p50, "mean_ms": p50, "fps": 1e3 / p50}}
                 if p50 else None, parity={"cosine_mean": 0.99, "top1_agreement": agree}
                 if agree else None, _file=file or f"{tag}.json")
        return r

    rows = [row("pytorch_fp32_cpu", "PyTorch", "FP32", 88.4, 20.0),
            row("ort_int8", "ORT", "INT8", 11.8, 5.0, agree=12.3),
            row("ort_int8_hp32", "ORT", "INT8", 88.3, 8.0, agree=98.6),
            row("ort_int8_hp32", "ORT", "INT8", None, None, status="failed",
                file="ort_int8_hp32.failed.json"),
            row("ort_int4_cli_broken", "ORT", "INT4", None, None, status="failed")]
    rows.sort(key=report._sort_key)
    line = report.summary(MODEL, rows, Path("REPORT.md"))
    assert "best quantized row ort_int8_hp32 (top-1 88.30%, agreement 98.6%, speedup 2.50x)" \
        in line
    assert "failed: ort_int8_hp32 (a rerun; its ok row is kept), ort_int4_cli_broken" in line


# ------------------------------------------------------------------------------- layerwise
def _relu_onnx(path: Path, name: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", [name], ["y"])], "r",
                          [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


def test_layerwise_diff_with_different_input_names_says_how_to_map(tmp_path):
    a, b = _relu_onnx(tmp_path / "a.onnx", "x"), _relu_onnx(tmp_path / "b.onnx", "inp")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "layerwise.py", "diff", str(a), str(b), "--input-shape", "x:2,4"]
    import subprocess

    p = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "name their inputs differently" in p.stderr and "--map-input inp=x" in p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run(base + ["--map-input", "inp=x"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(base + ["--map-input", "nope=x"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "--map-input 'nope=x'" in p.stderr


# ------------------------------------------------------------------------------- stage 5
def test_stage5_modelopt_failure_leaves_no_temporaries(tmp_path):
    """A calibration npz whose key does not match the model's input: ModelOpt fails (or the
    calibration check refuses it first); none of ModelOpt's intermediate files
    (fp32_opset19.onnx, fp32_reconciled.onnx) or work folders may stay behind."""
    pytest.importorskip("modelopt.onnx.quantization")
    from tests.test_quant import _save, conv_model

    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(conv_model(size=32), d / "onnx" / "fp32.onnx")
    np.savez(d / "calib.npz", not_the_input=np.random.default_rng(0).standard_normal(
        (8, 3, 32, 32)).astype(np.float32))
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="tiny", PYTHON=sys.executable, EPS="cpu")
    import subprocess

    p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32"], cwd=ROOT, capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 1
    left = sorted(f.name for f in (d / "onnx").iterdir())
    assert [f for f in left if f.endswith(".onnx")] == ["fp32.onnx"], left
    assert not [f for f in left if f.startswith(".tmp")], left


def test_output_without_batch_axis_is_named_by_stages_1_and_2_and_nothing_is_written(tmp_path):
    """A model returning a scalar (mean over the whole batch): stage 1 kept one batch's value
    as the reference and stage 2 died with an IndexError traceback; both now name the output,
    its shape and the fix, exit 1 and write nothing."""
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    m = ["--model", "tests.custom_models:no_batch_axis", "--input-shape", "x:1,3,16,16"]
    for stage in ("1_pytorch_baseline.py", "2_export_onnx.py"):
        p = run_stage([stage, *m], env, check=False)
        assert p.returncode == 1, p.stderr
        assert "has shape () for a batch of" in p.stderr and "no batch axis" in p.stderr
        assert "Fix: return a [N, ...] tensor" in p.stderr and "Traceback" not in p.stderr
    tag = model_tag("tests.custom_models:no_batch_axis")
    assert not list((tmp_path / "a").rglob("*.onnx"))
    assert not (tmp_path / "r" / tag / "pytorch_fp32_cpu.json").exists()
    assert not (tmp_path / "a" / tag / "ref_outputs.npz").exists()
