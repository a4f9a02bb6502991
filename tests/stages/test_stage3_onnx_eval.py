"""Stage 3 (3_onnx_eval.py): parity on a corrupted ONNX, missing inputs, GPU EP fallback, failed
reruns keep the good row, tags, truncated references and caches, the layer-wise diagnostic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploykit.errors import UsageError
from deploykit.io import write_json
from deploykit.results import result_record, write_result

from tests.helpers.stages import ROOT, run_stage
from tests.helpers.artifacts import _no_temporaries, _stage3
from tests.helpers.run_all import _env


@pytest.mark.slow
def test_stage3_parity_fails_on_corrupted_onnx(stage_env, tmp_path):
    """A copy of the FP32 ONNX with one Conv weight perturbed must show worse parity."""
    import onnx
    from onnx import numpy_helper

    env = stage_env
    src = Path(env["ARTIFACTS"]) / "efficientnet_lite0" / "onnx" / "fp32.onnx"
    if not src.exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    if not (Path(env["ARTIFACTS"]) / "efficientnet_lite0" / "ref_logits.npz").exists():
        run_stage(["1_pytorch_baseline.py", "--iters", "5", "--warmup", "1", "--limit", "48"], env)
    m = onnx.load(str(src))
    conv = next(n for n in m.graph.node if n.op_type == "Conv")
    init = next(t for t in m.graph.initializer if t.name == conv.input[1])
    w = numpy_helper.to_array(init).copy()
    w *= -3.0
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    run_stage(["3_onnx_eval.py", "--onnx", str(bad), "--tag", "ort_bad", "--iters", "2",
               "--warmup", "1", "--limit", "48"], env)
    r = json.loads((Path(env["RESULTS"]) / "efficientnet_lite0" / "ort_bad.json").read_text())
    assert r["parity"]["cosine_mean"] < 0.99
    (Path(env["RESULTS"]) / "efficientnet_lite0" / "ort_bad.json").unlink()


@pytest.mark.slow
def test_stage3_missing_input_names_producer_and_exits_1(stage_env, tmp_path):
    env = dict(stage_env, ARTIFACTS=str(tmp_path / "empty"))
    p = run_stage(["3_onnx_eval.py", "--onnx", str(tmp_path / "x.onnx"), "--tag", "t"], env,
                  check=False)
    assert p.returncode == 1 and "missing: run" in p.stderr
    p = run_stage(["3_onnx_eval.py", "--tag", "t"], env, check=False)
    assert p.returncode == 2


@pytest.mark.slow
def test_stage3_gpu_ep_unavailable_fails_unless_fallback_allowed(stage_env):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has the CUDA EP")
    onnx_path = Path(stage_env["ARTIFACTS"]) / "efficientnet_lite0" / "onnx" / "fp32.onnx"
    if not onnx_path.exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], stage_env)
    if not (Path(stage_env["ARTIFACTS"]) / "efficientnet_lite0" / "ref_logits.npz").exists():
        run_stage(["1_pytorch_baseline.py", "--iters", "5", "--warmup", "1", "--limit", "48"],
                  stage_env)
    args = ["3_onnx_eval.py", "--onnx", str(onnx_path), "--ep", "cuda", "--iters", "2",
            "--warmup", "1", "--limit", "16"]
    p = run_stage(args + ["--tag", "ort_cuda"], stage_env, check=False)
    assert p.returncode == 1 and "CUDAExecutionProvider" in p.stderr
    rec = json.loads((Path(stage_env["RESULTS"]) / "efficientnet_lite0" / "ort_cuda.json")
                     .read_text())
    assert rec["status"] == "failed" and "onnxruntime-gpu" in rec["reason"]
    run_stage(args + ["--tag", "ort_cuda", "--allow-cpu-fallback"], stage_env)
    rec = json.loads((Path(stage_env["RESULTS"]) / "efficientnet_lite0" / "ort_cuda.json")
                     .read_text())
    assert rec["status"] == "ok" and rec["ep_used"] == "CPUExecutionProvider"
    assert rec["ep_requested"] == "CUDAExecutionProvider" and rec["cpu_fallback"]
    (Path(stage_env["RESULTS"]) / "efficientnet_lite0" / "ort_cuda.json").unlink()


@pytest.mark.slow
def test_stage3_reference_mismatch_keeps_existing_row(stage_env, tmp_path):
    """After a smoke run (reference of 48 images), evaluating more images fails with the fix
    (--limit or rerun stage 1) and leaves the good row alone; --limit 0 is a usage error."""
    env = stage_env
    art = Path(env["ARTIFACTS"]) / "efficientnet_lite0"
    if not (art / "onnx" / "fp32.onnx").exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    run_stage(["1_pytorch_baseline.py", "--iters", "3", "--warmup", "1", "--limit", "48"], env)
    row = Path(env["RESULTS"]) / "efficientnet_lite0" / "ort_keep.json"
    args = ["3_onnx_eval.py", "--onnx", str(art / "onnx" / "fp32.onnx"), "--tag", "ort_keep",
            "--iters", "2", "--warmup", "1"]
    run_stage(args + ["--limit", "48"], env)
    before = row.read_text()
    p = run_stage(args + ["--limit", "64"], env, check=False)
    assert p.returncode == 1 and "--limit 48" in p.stderr
    assert row.read_text() == before
    p = run_stage(args + ["--limit", "0"], env, check=False)
    assert p.returncode == 2 and "--limit must be >= 1" in p.stderr
    assert row.read_text() == before
    row.unlink()


MODEL = "efficientnet_lite0"


# ------------------------------------------------------------------------------- stage 3
@pytest.mark.slow
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


@pytest.mark.slow
def test_stage3_unsafe_tag_is_refused_before_any_work(env, tmp_path):
    p = _stage3(env, "fp32.onnx", "../../escaped", check=False)
    assert p.returncode == 2 and "--tag '../../escaped': not a plain name" in p.stderr
    assert not list(tmp_path.rglob("escaped*"))
    assert not list((tmp_path / "r").rglob("*.json")) if (tmp_path / "r").exists() else True


@pytest.mark.slow
def test_stage3_truncated_reference_is_named(env):
    ref = Path(env["ARTIFACTS"]) / MODEL / "ref_logits.npz"
    ref.write_bytes(ref.read_bytes()[:200])
    p = _stage3(env, "fp32.onnx", "ort_fp32", check=False)
    assert p.returncode == 1 and f"{ref} is unreadable" in p.stderr
    assert "rerun 1_pytorch_baseline.py" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_truncated_cache_is_rebuilt_by_a_stage(env):
    cache = next((Path(env["ARTIFACTS"]) / "cache").glob("eval-*.npz"))
    cache.write_bytes(cache.read_bytes()[:1000])
    p = _stage3(env, "fp32.onnx", "ort_fp32")
    assert cache.name in p.stderr and "rebuilding" in p.stderr
    assert json.loads((Path(env["RESULTS"]) / MODEL / "ort_fp32.json").read_text())["status"] \
        == "ok"


# ----------------------------------------------------------------- tags that clash with files
@pytest.mark.slow
@pytest.mark.parametrize("tag,kind", [("data", "file"), ("export", "file"),
                                      ("quant_int8", "file"), ("ort_fp32.failed", "sidecar"),
                                      ("ort_fp32.skipped", "sidecar")])
def test_a_tag_that_names_another_results_file_is_refused_before_any_work(tmp_path, tag, kind):
    """--tag data replaced stage 0's data.json by a row; --tag ort_fp32.failed wrote a good row
    that the report took for ort_fp32's failed rerun (and ort_fp32's next good run deleted)."""
    from tests.helpers.stages import run_stage

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


@pytest.mark.slow
def test_stage3_layerwise_works_and_row_stays_ok(stage_env):
    """The README's `3_onnx_eval.py ... --layerwise` (it raised NameError after writing the
    row, and the catch-all then rewrote the good row as failed)."""
    env = stage_env
    art = Path(env["ARTIFACTS"]) / "efficientnet_lite0"
    if not (art / "onnx" / "fp32.onnx").exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    if not (art / "ref_logits.npz").exists():
        run_stage(["1_pytorch_baseline.py", "--iters", "3", "--warmup", "1", "--limit", "48"],
                  env)
    run_stage(["3_onnx_eval.py", "--onnx", str(art / "onnx" / "fp16.onnx"), "--tag", "lw_fp16",
               "--limit", "8", "--iters", "3", "--warmup", "1", "--layerwise",
               "--layerwise-images", "2"], env)
    res = Path(env["RESULTS"]) / "efficientnet_lite0"
    row = json.loads((res / "lw_fp16.json").read_text())
    assert row["status"] == "ok"
    lw = row["diagnostics"]["layerwise"]
    assert "error" not in lw and lw["first_divergent"] is None
    assert (res / "layerwise_lw_fp16" / "layerwise.md").exists()


@pytest.mark.slow
def test_stage3_wrong_file_is_failed_with_its_reason_and_exits_0(env):
    """Bit-flipped classifier weights (the user's report: status ok, exit 0): the row is
    written as failed, with the metric, value and bound and the layerwise.py command to run,
    a WARNING line says so, and the stage exits 0 (run_all.sh measures known collapses on
    purpose and goes on); the report shows it."""
    import shlex

    import onnx
    from onnx import numpy_helper

    art = Path(env["ARTIFACTS"]) / MODEL / "onnx"
    m = onnx.load(str(art / "fp32.onnx"))
    w = next(t for t in m.graph.initializer if t.name == "w")
    w.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(w), "w"))
    onnx.save(m, str(art / "flipped.onnx"))
    p = _stage3(env, "flipped.onnx", "ort_flipped")
    assert p.returncode == 0
    row = json.loads((Path(env["RESULTS"]) / MODEL / "ort_flipped.json").read_text())
    assert row["status"] == "failed" and "(FP32 failed bound)" in row["status_reason"]
    assert "WARNING: row ort_flipped is FAILED" in p.stderr, p.stderr[-2000:]
    argv = shlex.split(row["next_step"])
    # pasteable from any folder: cd <root> && VARS... <python> <root>/layerwise.py diff A B ...
    assert argv[:3] == ["cd", str(ROOT), "&&"]
    i = argv.index(str(ROOT / "layerwise.py"))
    assert argv[i + 1] == "diff" and argv[i + 3] == str(art / "flipped.onnx")
    assert row["next_step"] in p.stderr
    run_stage(["8_report.py", "--model", MODEL], env)
    md = (Path(env["RESULTS"]) / MODEL / "REPORT.md").read_text()
    (line,) = [ln for ln in md.splitlines() if "| ort_flipped |" in ln]
    assert "| failed: " in line and "FP32 failed bound" in line


def test_stage3_refuses_a_tag_of_another_stages_row(tmp_path, monkeypatch):
    """Checked before any input is read: a usage error (exit 2) naming the file and its stage."""
    from tests.helpers.stages import load_stage

    monkeypatch.setenv("RESULTS", str(tmp_path))
    ref = result_record("1_pytorch_baseline", "PyTorch", "FP32", MODEL, "pytorch_fp32_cpu")
    path = write_result(MODEL, "pytorch_fp32_cpu", ref)
    before = path.read_text()
    stage = load_stage("3_onnx_eval")
    args = stage.get_args_parser().parse_args(
        ["--onnx", str(tmp_path / "none.onnx"), "--tag", "pytorch_fp32_cpu", "--model", MODEL])
    with pytest.raises(UsageError, match="written by stage 1_pytorch_baseline"):
        stage.main(args)
    assert path.read_text() == before


@pytest.mark.parametrize("argv,match", [(["--cross-check-images", "-5"], "--cross-check-images -5"),
                                        (["--cross-check-tol", "-1"], "--cross-check-tol -1")])
def test_stage3_cross_check_flags_out_of_range_are_usage_errors(argv, match):
    """-1 is the only negative image count (adaptive); the tolerance is top-1 points."""
    from tests.helpers.stages import load_stage

    stage = load_stage("3_onnx_eval")
    args = stage.get_args_parser().parse_args(["--onnx", "x.onnx", "--tag", "t", *argv])
    with pytest.raises(UsageError, match=match):
        stage.preflight(args, ahead=False)
