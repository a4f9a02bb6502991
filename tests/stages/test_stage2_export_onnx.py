"""Stage 2 (2_export_onnx.py): rejected exports with node and fix, FP16 overflow, flag checks,
custom models and outputs without a batch axis."""

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

from tests.helpers.stages import ROOT, run_stage
from tests.helpers.export_models import _by


def _env(tmp_path, models_dir) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(models_dir)]))
    env.pop("MODEL", None)
    return env


def _stage2(argv, env, check=None):
    p = subprocess.run([sys.executable, "2_export_onnx.py", *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    if check is not None:
        assert p.returncode == check, f"{argv}: exit {p.returncode}\n{p.stdout[-3000:]}\n" \
                                      f"{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


def _onnx_dir(tmp_path, model) -> Path:
    return tmp_path / "a" / model_tag(model) / "onnx"


# ------------------------------------------------------------------------------------------
# Stage 2 as a gate
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_stage2_squeeze_head_rejected_with_node_and_fix_previous_file_kept(user_models,
                                                                          tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    out = _onnx_dir(tmp_path, "ec_user_models:squeeze_head")
    out.mkdir(parents=True)
    (out / "fp32.onnx").write_bytes(b"earlier good file")
    p = _stage2(["--model", "ec_user_models:squeeze_head", "--input-shape", "input:1,3,8,8",
                 "--no-fp16"], env, check=1)
    assert "Squeeze" in p.stderr and "flatten(1)" in p.stderr
    assert (out / "fp32.onnx").read_bytes() == b"earlier good file"
    assert (out / "fp32.rejected.onnx").exists()
    reason = json.loads((out / "fp32.rejected.json").read_text())
    assert any(r["check"] == "squeeze_axes" for r in reason["reason"])


@pytest.mark.slow
def test_stage2_frozen_batch_dynamo_and_legacy(user_models, tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    args = ["--model", "ec_user_models:shuffle", "--input-shape", "input:1,3,8,8", "--no-fp16"]
    p = _stage2(args, env, check=1)  # dynamo specialises the batch to the example's 3
    assert "declared dynamic but exported as the fixed size 3" in p.stderr
    p = _stage2(args + ["--exporter", "legacy", "--opset", "17"], env, check=1)
    assert "value frozen at trace time" in p.stderr and "b = int(b)" in p.stderr
    assert "Reshape" in p.stderr
    assert not (_onnx_dir(tmp_path, "ec_user_models:shuffle") / "fp32.onnx").exists()


@pytest.mark.slow
def test_stage2_accepts_mask_export_and_rejects_frozen_index(user_models, tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    shp = ["--input-shape", "x:1,6,16", "--input-shape", "m:1,6:bool", "--no-fp16"]
    p = _stage2(["--model", "ec_user_models:masked", *shp], env, check=0)
    rec = json.loads((tmp_path / "r" / "ec_user_models-masked" / "export.json").read_text())
    assert rec["status"] == "ok"
    assert _by(rec["files"]["fp32"]["checks"], "data_dependent_ops")[0]["status"] == "warn"
    assert "NonZero" in p.stdout
    p = _stage2(["--model", "ec_user_models:pyint", *shp, "--exporter", "legacy"], env, check=1)
    assert "value frozen at trace time" in p.stderr and "int(m[0].nonzero()[0])" in p.stderr


@pytest.mark.slow
def test_stage2_fp16_overflow_named_and_fixed_by_one_command(user_models, tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    # real samples: on synthetic ones (--input-shape only) the range audit only warns
    samples = tmp_path / "samples.npz"
    np.savez(samples, input=np.random.default_rng(0).standard_normal((8, 3, 16, 16))
             .astype(np.float32))
    args = ["--model", "ec_user_models:overflow", "--input-shape", "input:1,3,16,16",
            "--inputs", str(samples), "--true-fp16-budget-s", "0"]
    p = _stage2(args, env, check=0)  # FP32 passed: installed; FP16 rejected with a warning
    assert "fp16_range" in p.stderr and "> 65504" in p.stderr
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("WARNING: FP16 candidate")]
    assert warn and "--no-fp16 skips FP16" in warn[0] and "fp16.rejected.onnx" in warn[0]
    out = _onnx_dir(tmp_path, "ec_user_models:overflow")
    assert not (out / "fp16.onnx").exists() and (out / "fp16.rejected.onnx").exists()
    assert (out / "fp32.onnx").exists()
    fix = [ln for ln in p.stderr.splitlines() if ln.startswith("fix (keep")][0]
    keep = fix.split("--fp16-keep-fp32 ")[1].split()[0]
    _stage2(args + ["--fp16-keep-fp32", keep], env, check=0)
    m = onnx.load(str(out / "fp16.onnx"))
    from onnx.reference import ReferenceEvaluator

    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    with np.errstate(all="ignore"):
        y = ReferenceEvaluator(m).run(None, {"input": x})[0]
    assert np.isfinite(y).all()  # true FP16 arithmetic: finite once the conv is kept FP32
    assert not (out / "fp16.rejected.onnx").exists()


@pytest.mark.slow
def test_stage2_flags_are_range_checked(user_models, tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    base = ["--model", "ec_user_models:plain", "--input-shape", "input:1,3,8,8"]
    for bad in (["--min-cosine-fp32", "1.5"], ["--min-cosine-fp16", "0"],
                ["--check-images", "1"], ["--opset", "3", "--exporter", "legacy"],
                ["--true-fp16-budget-s", "-1"]):
        p = _stage2(base + bad, env, check=2)
        assert bad[0] in p.stderr


@pytest.mark.slow
def test_custom_model_export_and_parity(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    m = ["--model", "tests.custom_models:two_head", "--input-shape", "image:1,3,16,16",
         "--input-shape", "tokens:1,5,16"]
    run_stage(["1_pytorch_baseline.py", *m, "--iters", "5", "--warmup", "1"], env)
    run_stage(["2_export_onnx.py", *m], env)
    tag = model_tag("tests.custom_models:two_head")
    onnx_path = tmp_path / "a" / tag / "onnx" / "fp32.onnx"
    run_stage(["3_onnx_eval.py", "--model", "tests.custom_models:two_head", "--onnx",
               str(onnx_path), "--tag", "ort_fp32", "--iters", "3", "--warmup", "1"], env)
    r = json.loads((tmp_path / "r" / tag / "ort_fp32.json").read_text())
    assert r["accuracy"] is None and r["reason_accuracy"] == "synthetic inputs, no labels"
    assert len(r["parity_outputs"]) == 2
    assert all(p["cosine_min"] > 0.99999 for p in r["parity_outputs"].values())
    p = run_stage(["0_prepare_data.py", "--model", "tests.custom_models:two_head"], env,
                  check=False)
    assert p.returncode == 2 and "does not apply" in p.stderr


@pytest.mark.slow
def test_out_of_place_fooled_by_its_check_samples_is_exported_again_as_it_is(tmp_path):
    """A model that reads a tensor again after an in-place ReLU overwrote it, with inputs whose
    first 16 samples (the out-of-place check's) are non-negative and the rest not: the check
    agrees, the FP32 parity fails on the later samples, and stage 2 exports the model again as
    it is, which passes (deploykit.export.out_of_place)."""
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.random((16, 3, 8, 8)), rng.standard_normal((16, 3, 8, 8))])
    np.savez(tmp_path / "x.npz", x=x.astype(np.float32))
    model = "tests.custom_models:late_alias"
    p = run_stage(["2_export_onnx.py", "--model", model, "--input-shape", "x:1,3,8,8",
                   "--inputs", str(tmp_path / "x.npz"), "--check-images", "32", "--no-fp16"],
                  env)
    assert "1 in-place torch.nn/timm module(s)" in p.stderr
    assert "exporting again with the model exactly as it is" in p.stderr
    rec = json.loads((tmp_path / "r" / model_tag(model) / "export.json").read_text())
    assert rec["traced_out_of_place"] == 0 and rec["out_of_place_retried"] == 1
    assert rec["files"]["fp32"]["status"] == "pass"


MODEL = "efficientnet_lite0"


# ------------------------------------------------------------------------------- stage 2
@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_stage2_success_removes_leftovers_of_a_killed_run_only(tmp_path):
    """A killed stage 2 leaves its candidate folder (.stage2-*); a killed atomic write leaves a
    .tmp-* folder. The next successful run removes them (older than the run, no live process in
    them), and nothing else: not a live run's folder, not a link's target."""
    import time

    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    m = ["--model", "tests.custom_models:two_head", "--input-shape", "image:1,3,16,16",
         "--input-shape", "tokens:1,5,16"]
    run_stage(["1_pytorch_baseline.py", *m, "--iters", "2", "--warmup", "1"], env)
    onnx_dir = tmp_path / "a" / model_tag("tests.custom_models:two_head") / "onnx"
    onnx_dir.mkdir(parents=True)
    dead = [onnx_dir / ".stage2-pid999999999-k1", onnx_dir / ".stage2-oldname",
            onnx_dir / ".tmp-fp32.onnx.abc"]
    for d in dead:
        d.mkdir()
        (d / "fp32.onnx").write_bytes(b"half")
    live = onnx_dir / f".stage2-pid{os.getpid()}-live"  # this pytest process: alive
    live.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (onnx_dir / ".tmp-link").symlink_to(victim)
    old = time.time() - 600
    for p in [*dead, live, onnx_dir / ".tmp-link"]:
        os.utime(p, (old, old), follow_symlinks=False)
    p = run_stage(["2_export_onnx.py", *m], env)
    assert p.returncode == 0 and "removed 3 leftover(s) of an interrupted run" in p.stdout
    assert not any(d.exists() for d in dead) and live.is_dir()
    assert (victim / "keep").read_text() == "x" and (onnx_dir / ".tmp-link").is_symlink()
    assert (onnx_dir / "fp32.onnx").exists()


@pytest.mark.slow
def test_a_failed_rerun_keeps_the_record_of_the_files_it_left_installed(tmp_path):
    """A rerun whose export check fails installs nothing and leaves the earlier fp32.onnx and
    fp16.onnx as they were: export.json, which stages 3-8 match those files by, must stay
    theirs (it was overwritten with ``status: failed``, so the good fp16 row became stale); the
    failure goes to export.failed.json, which the next good export removes."""
    (tmp_path / "s2_toggle.py").write_text(
        "import os, torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); torch.manual_seed(0)\n"
        "        self.conv, self.fc = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(8, 4)\n"
        "    def forward(self, x):\n"
        "        y = torch.relu(self.conv(x)).mean((2, 3), keepdim=True)\n"
        "        return self.fc(y.squeeze() if os.environ.get('S2_BREAK') else y.flatten(1))\n"
        "def build():\n"
        "    return Net().eval()\n")
    env = _env(tmp_path, tmp_path)
    argv = ["--model", "s2_toggle:build", "--input-shape", "input:1,3,8,8"]
    _stage2(argv, env, check=0)
    out, res = _onnx_dir(tmp_path, "s2_toggle:build"), tmp_path / "r" / model_tag("s2_toggle:build")
    good = (res / "export.json").read_bytes()
    files = {n: (out / n).read_bytes() for n in ("fp32.onnx", "fp16.onnx")}
    p = _stage2(argv, dict(env, S2_BREAK="1"), check=1)
    assert "export.failed.json" in p.stderr and "nothing installed" in p.stderr
    assert (res / "export.json").read_bytes() == good
    assert {n: (out / n).read_bytes() for n in files} == files
    assert json.loads((res / "export.failed.json").read_text())["status"] == "failed"
    _stage2(argv, env, check=0)
    assert not (res / "export.failed.json").exists()
    # with no earlier record of installed files, the failure is export.json itself
    shutil.rmtree(out)
    (res / "export.json").unlink()
    _stage2(argv, dict(env, S2_BREAK="1"), check=1)
    assert json.loads((res / "export.json").read_text())["status"] == "failed"
    assert not (res / "export.failed.json").exists()
