"""Shared fixtures and helpers: the repository root, running a stage as a user would
(``run_stage``), an artifacts folder prepared by stage 0 on the embedded real images (built once
per session), and the small models and prepared folders that test modules of several folders use.

Lanes: ``-m "not slow"`` is the fast lane (pure functions and small graphs, no subprocess, no
ModelOpt run); tests marked ``slow`` start a subprocess (a stage, a tool, ``run_all.sh``) or run
ModelOpt."""
from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.layout import DEFAULT_DATA
from deploykit.models import model_spec

from tests.helpers.artifacts import _classifier_onnx
from tests.helpers.auto_models import _save
from tests.helpers.export_models import MODELS
from tests.helpers.images import _class_folders, _env
from tests.helpers.layerwise_models import _init_bn, export, SECNN, TokenHeads
from tests.helpers.qdq_models import depthwise_models
from tests.helpers.quant_models import _modelopt_int4, gemm_model, matmul_model
from tests.helpers.stages import ROOT, load_stage, run_stage  # noqa: F401 (re-exported)

MODEL = "efficientnet_lite0"
SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))
torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _allocator_env_restored():
    """A stage's ``main`` run in this process through ``deploykit.cli.cli`` puts the allocator
    policy into ``os.environ`` for its children (``deploykit.alloc``): undone after each test,
    so that no later test's environment depends on the order tests ran in."""
    before = os.environ.get("GLIBC_TUNABLES")
    yield
    if before is None:
        os.environ.pop("GLIBC_TUNABLES", None)
    else:
        os.environ["GLIBC_TUNABLES"] = before


@pytest.fixture(autouse=True)
def _folder_locks_released_and_never_in_the_checkout():
    """A stage's ``main`` run in this process takes ``deploykit.lock`` locks that a process
    keeps until it exits. After each test, the locks the test itself took are released (a
    fixture's stay held while it lives), so that no later test in this worker finds that folder
    held; and a test whose in-process stage locked the checkout's default ``artifacts/`` or
    ``results/`` (ARTIFACTS/RESULTS not set to a folder of its own) errors at teardown: under
    pytest-xdist two such tests on two workers lock each other out (CI, stop 38)."""
    from deploykit import lock

    before = set(lock._HELD)
    yield
    taken = [k for k in lock._HELD if k not in before]
    for k in taken:
        os.close(lock._HELD.pop(k))
    inside = [k for k in taken if any(Path(k).is_relative_to(ROOT / d)
                                      for d in ("artifacts", "results"))]
    assert not inside, (f"the test locked {inside}, the checkout's default folders: give it "
                        "ARTIFACTS and RESULTS under tmp_path (monkeypatch.setenv)")


@pytest.fixture(scope="session")
def stage_env(tmp_path_factory) -> dict:
    """Environment with private ARTIFACTS/RESULTS in which stage 0 has run on the embedded data
    for EfficientNet-Lite0 (real weights, offline)."""
    base = tmp_path_factory.mktemp("pipeline")
    env = dict(os.environ, ARTIFACTS=str(base / "artifacts"), RESULTS=str(base / "results"),
               MODEL="efficientnet_lite0", PYTHONPATH=str(ROOT))
    env.pop("VAL_ROOT", None)
    run_stage(["0_prepare_data.py", "--model", "efficientnet_lite0"], env)
    return env


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("usermodels")
    (d / "ec_user_models.py").write_text(MODELS)
    sys.path.insert(0, str(d))
    yield d, importlib.import_module("ec_user_models")
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def token_model(tmp_path_factory):
    torch.manual_seed(0)
    m = TokenHeads().eval()
    d = tmp_path_factory.mktemp("tok")
    x = torch.randn(2, 8, 256)
    path = export(m, x, d / "fp32.onnx", "tokens", ["out0", "out1", "out2"])
    feed = {"tokens": np.random.default_rng(0).standard_normal((4, 8, 256)).astype(np.float32)}
    return m, path, feed


@pytest.fixture(scope="module")
def cnn_model(tmp_path_factory):
    torch.manual_seed(0)
    m = _init_bn(SECNN())
    d = tmp_path_factory.mktemp("cnn")
    path = export(m, torch.randn(2, 3, 32, 32), d / "fp32.onnx", "input", ["logits"])
    feed = {"input": np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)}
    return m, path, feed


int4 = load_stage("5b_quantize_int4")


@pytest.fixture(scope="module")
def depthwise_ort(tmp_path_factory):
    """Float and Q/DQ (per tensor ``pt``, per channel ``pc``) depthwise models, saved."""
    d = tmp_path_factory.mktemp("dw")
    x = np.random.default_rng(1).standard_normal((16, 32, 8, 8)).astype(np.float32)
    fp32, pt = depthwise_models(False, x)
    _, pc = depthwise_models(True, x)
    return {"fp32": _save(fp32, d / "fp32.onnx"), "pt": _save(pt, d / "q_pt.onnx"),
            "pc": _save(pc, d / "q_pc.onnx"), "x": x}


@pytest.fixture(scope="module")
def modelopt_int4_models(tmp_path_factory):
    """Models ModelOpt 0.47.0 really produced: a Gemm (transB=1, K=576) quantized with block
    128 (awq_clip, the default: wrong axis) and a MatMul (K=256, correct axis)."""
    pytest.importorskip("modelopt.onnx.quantization")
    d = tmp_path_factory.mktemp("int4")
    gemm = _save(gemm_model(), d / "gemm.onnx")
    mm = _save(matmul_model(), d / "mm.onnx")
    return {"gemm_src": gemm, "gemm_q": _modelopt_int4(gemm, d / "gemm_int4.onnx", 128),
            "mm_src": mm, "mm_q": _modelopt_int4(mm, d / "mm_int4.onnx", 64, k=256), "dir": d}


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


# ------------------------------------------------------------------------------- caches
@pytest.fixture()
def tiny_stage0(tmp_path):
    """Stage 0 run on 6 classes (symlinks to embedded images); returns its environment."""
    data = _class_folders(tmp_path / "d", SAMPLE[:6])
    env = _env(tmp_path, ALLOW_CLASS_SUBSET="1")
    run_stage(["0_prepare_data.py", "--data-root", str(data), "--model", "efficientnet_lite0",
               "--calib-fraction", "0.34"], env)
    return env
