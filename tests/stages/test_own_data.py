"""A model with its own data through the stages: --inputs/--labels (stage 1, checked by 3),
--calib-inputs (stage 4) judged against the real evaluation samples; synthetic samples only warn.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers.stages import ROOT, run_stage

MODEL = "tests.custom_models:image_depth"


def _samples(n, seed):
    r = np.random.default_rng(seed)
    image = (r.standard_normal((n, 3, 16, 16)) * 0.8 + 0.1).astype(np.float32)
    depth = r.uniform(0.5, 10.0, (n, 1, 16, 16)).astype(np.float32)  # metres
    return image, depth


@pytest.fixture
def own(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    image, depth = _samples(24, 1)
    np.savez(tmp_path / "eval.npz", depth=depth, image=image)  # not forward() order on purpose
    np.save(tmp_path / "labels.npy", np.random.default_rng(0).integers(0, 5, 24))
    image, depth = _samples(16, 2)
    np.savez(tmp_path / "calib.npz", image=image, depth=depth)
    np.savez(tmp_path / "swapped.npz", image=np.repeat(depth, 3, 1), depth=image[:, :1])
    np.savez(tmp_path / "u8range.npz", image=(image * 60 + 128).clip(0, 255), depth=depth)
    return tmp_path, env


@pytest.mark.slow
def test_own_data_reference_accuracy_and_calibration_check(own):
    tmp, env = own
    fast = ["--iters", "2", "--warmup", "0"]
    p = run_stage(["1_pytorch_baseline.py", "--model", MODEL, "--inputs", str(tmp / "eval.npz"),
                   "--labels", str(tmp / "labels.npy"), *fast], env)
    row = json.loads((tmp / "r" / "tests.custom_models-image_depth" / "pytorch_fp32_cpu.json"
                      ).read_text())
    assert row["n_images"] == 24 and row["accuracy"]["top1"] is not None, p.stdout
    assert "synthetic" not in p.stderr
    run_stage(["2_export_onnx.py", "--model", MODEL, "--check-images", "8",
               "--true-fp16-budget-s", "0"], env)
    export = json.loads((tmp / "r" / "tests.custom_models-image_depth" / "export.json"
                         ).read_text())
    assert export["check_inputs"] == "real"  # stage 1's reference inputs, not N(0,1)
    onnx = str(tmp / "a" / "tests.custom_models-image_depth" / "onnx" / "fp32.onnx")
    p = run_stage(["3_onnx_eval.py", "--model", MODEL, "--onnx", onnx, "--tag", "ort_fp32",
                   "--inputs", str(tmp / "eval.npz"), *fast], env)
    ort = json.loads((tmp / "r" / "tests.custom_models-image_depth" / "ort_fp32.json"
                      ).read_text())
    assert ort["accuracy"]["top1"] == row["accuracy"]["top1"]
    assert ort["parity"]["cosine_min"] > 0.9999
    # stage 3 given other inputs than the reference's: refused, naming the rerun
    p = run_stage(["3_onnx_eval.py", "--model", MODEL, "--onnx", onnx, "--tag", "ort_other",
                   "--inputs", str(tmp / "calib.npz"), *fast], env, check=False)
    assert p.returncode == 2 and "not what stage 1's reference was computed on" in p.stderr
    assert "1_pytorch_baseline.py" in p.stderr
    # calibration: the right data accepted, swapped inputs and 0..255 images refused
    p = run_stage(["4_make_calib.py", "--model", MODEL, "--calib-inputs",
                   str(tmp / "calib.npz")], env)
    assert "statistics check: passed against the inputs stage 1 evaluated" in p.stdout
    for bad in ("swapped", "u8range"):
        p = run_stage(["4_make_calib.py", "--model", MODEL, "--calib-inputs",
                       str(tmp / f"{bad}.npz")], env, check=False)
        assert p.returncode == 1 and "calibration data refused: input 'image'" in p.stderr, bad
    # the evaluation samples themselves are no calibration data
    p = run_stage(["4_make_calib.py", "--model", MODEL, "--calib-inputs",
                   str(tmp / "eval.npz")], env, check=False)
    assert p.returncode == 2 and "are samples stage 1 evaluates on" in p.stderr


@pytest.mark.slow
def test_synthetic_reference_warns_and_never_refuses(own):
    """No --inputs: stage 1 runs on N(0,1) samples; the calibration statistics check then warns
    (it cannot tell right from wrong) and the right data are written."""
    tmp, env = own
    p = run_stage(["1_pytorch_baseline.py", "--model", MODEL, "--input-shape",
                   "image:1,3,16,16", "--input-shape", "depth:1,1,16,16", "--iters", "2",
                   "--warmup", "0"], env)
    assert "WARNING: synthetic inputs" in p.stderr
    run_stage(["2_export_onnx.py", "--model", MODEL, "--input-shape", "image:1,3,16,16",
               "--input-shape", "depth:1,1,16,16", "--no-fp16"], env)
    p = run_stage(["4_make_calib.py", "--model", MODEL, "--calib-inputs",
                   str(tmp / "calib.npz")], env)
    assert "statistics differ from stage 1's synthetic N(0,1) inputs" in p.stderr
    rec = json.loads((tmp / "r" / "tests.custom_models-image_depth" / "calib.json").read_text())
    assert rec["stats_check"].startswith("warned, not judged")


@pytest.mark.slow
def test_fp16_range_audit_on_synthetic_inputs_only_warns(tmp_path):
    """x / 20000 puts N(0,1) samples below FP16's smallest normal; real counts (0..20000) do
    not: on synthetic samples the audit warns and fp16.onnx is installed; on the real ones it
    passes."""
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    model = "tests.custom_models:raw_counts"
    args = ["2_export_onnx.py", "--model", model, "--input-shape", "x:1,1,16,16",
            "--true-fp16-budget-s", "0", "--check-images", "8"]
    p = run_stage(args, env)
    rec = json.loads((tmp_path / "r" / "tests.custom_models-raw_counts" / "export.json"
                      ).read_text())
    fp16 = rec["files"]["fp16"]
    assert fp16["status"] == "warn", p.stdout
    warned = [c for c in fp16["checks"] if c["check"] == "fp16_range" and c["status"] == "warn"]
    assert any("synthetic N(0,1) inputs" in c["detail"] for c in warned)
    assert (tmp_path / "a" / "tests.custom_models-raw_counts" / "onnx" / "fp16.onnx").exists()
    counts = np.random.default_rng(0).uniform(0, 20000, (8, 1, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "counts.npz", x=counts)
    run_stage(args + ["--inputs", str(tmp_path / "counts.npz")], env)
    rec = json.loads((tmp_path / "r" / "tests.custom_models-raw_counts" / "export.json"
                      ).read_text())
    assert rec["files"]["fp16"]["status"] == "pass" and rec["check_inputs"] == "real"


@pytest.mark.slow
def test_nan_inputs_or_outputs_never_replace_a_good_reference(tmp_path):
    """NaN in --inputs is refused when read; finite inputs on which the model gives NaN are
    refused after the run: either way the earlier reference and row stay byte for byte."""
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    model = "tests.custom_models:log_net"
    r = np.random.default_rng(0)
    good = r.uniform(0.5, 2.0, (6, 4, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "good.npz", x=good)
    fast = ["--model", model, "--iters", "2", "--warmup", "0"]
    run_stage(["1_pytorch_baseline.py", *fast, "--inputs", str(tmp_path / "good.npz")], env)
    ref = tmp_path / "a" / "tests.custom_models-log_net" / "ref_outputs.npz"
    row = tmp_path / "r" / "tests.custom_models-log_net" / "pytorch_fp32_cpu.json"
    before = ref.read_bytes(), row.read_bytes()
    nan = good.copy()
    nan[2, 0, 0, 0] = np.nan
    np.savez(tmp_path / "nan.npz", x=nan)
    np.savez(tmp_path / "neg.npz", x=-good)
    for name, needle in (("nan.npz", "holds NaN/Inf in 1 of 6 samples (first: sample 2)"),
                         ("neg.npz", "PyTorch's outputs hold NaN/Inf")):
        p = run_stage(["1_pytorch_baseline.py", *fast, "--inputs", str(tmp_path / name)], env,
                      check=False)
        assert p.returncode == 1 and needle in p.stderr, p.stderr
        assert (ref.read_bytes(), row.read_bytes()) == before
