"""Stage 5 (5_quantize.sh): usage errors, missing calibration, wrong keys, int8_auto, ModelOpt
runs on tiny models, failures that leave no temporaries, custom models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from deploykit.layout import model_tag
from deploykit.quant.auto.search import anchored

from tests.helpers.stages import ROOT
from tests.helpers.auto_models import _auto_env, _conv_chain, _run, _save
from tests.helpers.qdq_models import _feed, qdq_conv
from tests.helpers.quant_models import conv_model
from tests.helpers.verdict_models import static_batch_model


# --------------------------------------------------------------------------------- stage 5
@pytest.mark.slow
def test_quantize_sh_int8_auto_budget_usage_error_exits_2(tmp_path):
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(_conv_chain(), d / "onnx" / "fp32.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "calib.npz", x=rng.standard_normal((8, 3, 16, 16)).astype(np.float32))
    np.savez(d / "tune.npz", x=rng.standard_normal((8, 3, 16, 16)).astype(np.float32))
    env = _auto_env(tmp_path, MODEL="tiny", EPS="cpu", CALIB_STATS_CHECK="0",
               AUTO_ARGS="--min-cosine 2")
    p = _run(["bash", "5_quantize.sh", "int8_auto"], env)
    assert p.returncode == 2 and "cosine similarity lies in [-1, 1]" in p.stderr
    assert not (d / "onnx" / "int8_auto.onnx").exists()


@pytest.mark.slow
def test_quantize_sh_int8_auto_end_to_end(tmp_path):
    """5_quantize.sh int8_auto on a small model with a tuning npz: search, ModelOpt with the
    exclusion list, verification before the file is installed, records."""
    pytest.importorskip("modelopt.onnx.quantization")
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    m = _conv_chain(32)
    _save(m, d / "onnx" / "fp32.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "calib.npz", x=rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
    np.savez(d / "tune.npz", x=rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
    env = _auto_env(tmp_path, MODEL="tiny", EPS="cpu", CALIB_STATS_CHECK="0",
               AUTO_ARGS="--min-agreement off --min-cosine 0.9999")
    p = _run(["bash", "5_quantize.sh", "int8_auto"], env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "r" / "tiny" / "auto_precision.json").read_text())
    quant = json.loads((tmp_path / "r" / "tiny" / "quant_int8_auto.json").read_text())
    assert rec["verify"]["tune_budget_met"] and rec["verify"]["onnx"] == str(
        d / "onnx" / "int8_auto.onnx")
    assert abs(quant["macs"]["int8_fraction"] - rec["int8_mac_fraction"]) < 1e-9
    for r in anchored(rec["excluded"]):
        assert r.replace("\\", "") in quant["command"].replace("\\", "")


@pytest.mark.slow
def test_quantize_sh_help_exits_0_and_names_int8_auto_and_auto_args():
    p = subprocess.run(["bash", "5_quantize.sh", "--help"], cwd=ROOT, capture_output=True,
                       text=True, env=_auto_env(Path("/nonexistent")))
    assert p.returncode == 0, p.stderr
    assert "except those made on request only: int8_auto" in p.stderr
    assert "AUTO_ARGS" in p.stderr
    assert subprocess.run(["bash", "5_quantize.sh", "--nope"], cwd=ROOT, capture_output=True,
                          env=_auto_env(Path("/nonexistent"))).returncode == 2


@pytest.mark.slow
def test_quantize_sh_wrong_key_is_named_not_an_assertion(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="tiny", PYTHON=sys.executable, EPS="cpu")
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(qdq_conv([1.0, 1.0], [0.1, 0.1], float_model=True), d / "onnx" / "fp32.onnx")
    np.savez(d / "calib.npz", input=_feed()["x"])
    p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32"], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert p.returncode == 1
    assert "keys ['input'] but the model's inputs are ['x']" in p.stderr
    assert "AssertionError" not in p.stderr and not (d / "onnx" / "int8_hp32.onnx").exists()


# --------------------------------------------------------------------------------------------
# Custom models through stages 4 and 5
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_custom_model_reaches_stages_4_and_5(tmp_path):
    pytest.importorskip("modelopt.onnx.quantization")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT), PYTHON=sys.executable, EPS="cpu")
    name = "tests.custom_models:two_head"
    shapes = ["--input-shape", "image:1,3,16,16", "--input-shape", "tokens:1,5,16"]

    def run(*argv, check=True):
        p = subprocess.run([sys.executable, *argv] if argv[0].endswith(".py") else list(argv),
                           cwd=ROOT, capture_output=True, text=True, env=env)
        assert not check or p.returncode == 0, p.stdout + p.stderr
        return p

    run("2_export_onnx.py", "--model", name, *shapes, "--no-fp16")
    run("1_pytorch_baseline.py", "--model", name, *shapes, "--iters", "2", "--warmup", "1")
    p = run("4_make_calib.py", "--model", name, check=False)
    assert p.returncode == 2 and "--calib-inputs NPZ" in p.stderr
    run("4_make_calib.py", "--model", name, "--random", "16", "--seed", "3")
    art = tmp_path / "a" / model_tag(name)
    with np.load(art / "calib.npz") as z:
        assert sorted(z.files) == ["image", "tokens"] and z["tokens"].shape == (16, 5, 16)
    # A user npz with the inputs swapped between keys (tokens data under image): refused.
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "swap.npz", image=(rng.standard_normal((8, 3, 16, 16)) * 40 + 100
                                           ).astype(np.float32),
             tokens=rng.standard_normal((8, 5, 16)).astype(np.float32))
    p = run("4_make_calib.py", "--model", name, "--inputs", str(tmp_path / "swap.npz"),
            check=False)
    # stage 1 ran on synthetic samples (--input-shape): the statistics check cannot tell right
    # from wrong against them, so it warns with the numbers and never refuses on them alone
    assert p.returncode == 0 and "statistics differ from stage 1's synthetic N(0,1)" in p.stderr
    assert "input 'image'" in p.stderr
    run("4_make_calib.py", "--model", name, "--random", "16", "--seed", "3")
    p = run("bash", "5_quantize.sh", "--model", name, "int8_hp32")
    rec = json.loads((tmp_path / "r" / model_tag(name) / "quant_int8_hp32.json")
                     .read_text())
    assert rec["status"] == "ok" and rec["calibration"]["n_samples"] == 16
    assert rec["calibration"]["batch_size"] == 16 and rec["calibration"]["order_seed"] == 3
    assert "qdq_tools.py modelopt --calib-batch 16 --" in rec["command"]
    assert rec["check"]["ok"] in (True, False) and "summary" in rec["check"]
    # Stage 3 cross-checks the custom Q/DQ model against its unoptimised graph (every output).
    run("3_onnx_eval.py", "--model", name, "--onnx", str(art / "onnx" / "int8_hp32.onnx"),
        "--tag", "ort_int8_hp32", "--iters", "2", "--warmup", "1")
    row = json.loads((tmp_path / "r" / model_tag(name) / "ort_int8_hp32.json")
                     .read_text())
    cc = row["diagnostics"]["backend_cross_check"]
    assert row["status"] == "ok" and set(cc["outputs"]) == set(row["parity_outputs"])


@pytest.mark.slow
def test_quantize_sh_usage_errors_exit_2_with_variant_list():
    for argv in ([], ["no_such_variant"], ["--bogus"]):
        p = subprocess.run(["bash", "5_quantize.sh", *argv], cwd=ROOT, capture_output=True,
                           text=True)
        assert p.returncode == 2, argv
        assert "int8_hp32" in p.stderr and "int4_cli_broken" in p.stderr
    p = subprocess.run(["bash", "5_quantize.sh", "--list"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and {"baseline", "int8", "int8_hp32", "excl_dw",
                                  "conv_gemm"} <= set(p.stdout.split())


@pytest.mark.slow
def test_quantize_sh_missing_calib_names_stage4(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path), MODEL="efficientnet_lite0",
               PYTHON=sys.executable)
    (tmp_path / "efficientnet_lite0" / "onnx").mkdir(parents=True)
    _save(conv_model(), tmp_path / "efficientnet_lite0" / "onnx" / "fp32.onnx")
    p = subprocess.run(["bash", "5_quantize.sh", "int8"], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert p.returncode == 1 and "4_make_calib.py" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_quantize_sh_is_shellcheck_clean():
    p = subprocess.run(["shellcheck", "5_quantize.sh"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


@pytest.mark.slow
def test_stage5_int8_on_tiny_conv_model(tmp_path):
    """5_quantize.sh end to end on a small conv model: output, log and results JSON."""
    pytest.importorskip("modelopt.onnx.quantization")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="tiny", PYTHON=sys.executable, EPS="cpu")
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(conv_model(size=32), d / "onnx" / "fp32.onnx")
    np.savez(d / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (8, 3, 32, 32)).astype(np.float32))
    src_mtime = (d / "onnx" / "fp32.onnx").stat().st_mtime_ns
    # leftovers of a killed run: its work folder (with ModelOpt intermediates), a temporary log
    killed = d / "onnx" / ".tmp-5_quantize.pid999999999.abc"
    killed.mkdir()
    (killed / "int8_hp32_opset19.onnx").write_bytes(b"half")
    (d / "onnx" / ".tmp-int8_hp32.quant.log.xyz").write_text("half")
    for f in (killed, d / "onnx" / ".tmp-int8_hp32.quant.log.xyz"):
        os.utime(f, (1e9, 1e9))
    p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32"], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "removed 2 leftover(s) of an interrupted run" in p.stdout
    # ModelOpt rewrites its --onnx_path: the stage hands it a copy, fp32.onnx stays untouched.
    assert (d / "onnx" / "fp32.onnx").stat().st_mtime_ns == src_mtime
    rec = json.loads((tmp_path / "r" / "tiny" / "quant_int8_hp32.json").read_text())
    assert rec["status"] == "ok" and rec["wall_time_s"] > 0
    assert "--nodes_to_exclude" in rec["command"] and "^dw" in rec["command"].replace("\\", "")
    assert rec["inspect"]["scale_dtypes"] == {"float32": rec["inspect"]["n_dequantize"]}
    assert not list((d / "onnx").glob(".tmp-*"))


MODEL = "efficientnet_lite0"


# ------------------------------------------------------------------------------- stage 5
@pytest.mark.slow
def test_stage5_modelopt_failure_leaves_no_temporaries(tmp_path):
    """A calibration npz whose key does not match the model's input: ModelOpt fails (or the
    calibration check refuses it first); none of ModelOpt's intermediate files
    (fp32_opset19.onnx, fp32_reconciled.onnx) or work folders may stay behind."""
    pytest.importorskip("modelopt.onnx.quantization")
    from tests.helpers.auto_models import _save
    from tests.helpers.quant_models import conv_model

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


# --------------------------------------------------------------------------------------------
# Custom models without convolutions through stage 5
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_stage5_quantizes_a_model_without_convolutions(tmp_path):
    """An MLP (no Conv, so no stem): stage 5 refused every variant ("no stem conv found"),
    although only excl_stem excludes a stem."""
    import os

    pytest.importorskip("modelopt.onnx.quantization")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="mlp", PYTHON=sys.executable, EPS="cpu", CALIB_STATS_CHECK="0")
    d = tmp_path / "a" / "mlp"
    (d / "onnx").mkdir(parents=True)
    m = static_batch_model(4)
    for vi in list(m.graph.input) + list(m.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "N"
    onnx.save(m, str(d / "onnx" / "fp32.onnx"))
    np.savez(d / "calib.npz", x=np.random.default_rng(0).standard_normal((16, 6))
             .astype(np.float32))
    p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32", "excl_stem"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "excl_stem not made" in p.stderr and "no Conv fed by a graph input" in p.stderr
    assert (d / "onnx" / "int8_hp32.onnx").exists(), p.stdout + p.stderr
    assert not (d / "onnx" / "excl_stem.onnx").exists()
    assert "Traceback" not in p.stderr
