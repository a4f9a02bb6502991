"""Export and FP16 verdicts (export_checks.py, 2_export_onnx.py, the feeding rules, the printed
FP16 remedy). Every test builds its own small model or graph; none reads ../shared.

Fault kinds covered (one test or more each): a ``.squeeze()`` head, a batch frozen by a Python
int (dynamo specialisation, legacy Reshape constant), a frozen data-dependent index (legacy
TracerWarning, unused input), a correct boolean-mask export (NonZero), HardSigmoid attributes,
Softmax below opset 13, blocked Q/DQ below opset 21, FP16 overflow / underflow invisible to ORT's
CPU EP (conv, decomposed LayerNorm), a constant the FP16 converter changes, a static batch-1
model fed several samples, FP16-input candidates, and the printed TensorRT FP16 remedy.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from deploykit.checks.base import format_result, worst
from deploykit.checks.export import check_export, ort_runner
from deploykit.checks.fp16 import (
    convert_fp16,
    fp16_backends,
    fp16_converter_changes,
    fp16_range_audit,
    fp16_true_arithmetic,
)
from deploykit.checks.lint import lint
from deploykit.errors import UsageError
from deploykit.feeds import feed_plan, input_shape_batch, load_feed
from deploykit.layerwise.diff import run_layer_diff
from deploykit.layerwise.remedies import trt_remedies
from deploykit.layerwise.torch_vs_onnx import torch_vs_onnx
from deploykit.layout import model_tag
from deploykit.quant.inspect import activation_stats
from deploykit.variants import variant_of_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402

torch = pytest.importorskip("torch")
nn = torch.nn
stage2 = importlib.import_module("2_export_onnx")

# Models a user would write, as a module the stages import (package.module:factory).
MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class SqueezeHead(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3), keepdim=True).squeeze())


    class Shuffle(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            x = self.conv(x)
            b, c, h, w = x.shape
            b = int(b)
            x = x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)
            return self.fc(x.mean((2, 3)))


    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.head = nn.Linear(16, 2)

        def forward(self, x, m):
            return self.head(x[m])


    class PyIntIndex(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.head = nn.Linear(16, 2)

        def forward(self, x, m):
            i = int(m[0].nonzero()[0])
            return self.head(x[:, i])


    class Overflow(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(20)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)
            with torch.no_grad():
                self.conv.weight.mul_(40000.0)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x) * 1e-3).mean((2, 3)))


    class DecomposedLN(nn.Module):
        def __init__(self):
            super().__init__()
            off = torch.zeros(64)
            off[7] = 300.0
            self.register_buffer("off", off)

        def forward(self, x):
            x = x + self.off
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + 1e-5)


    class BigClamp(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.clamp(x, max=1e5))


    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


    def squeeze_head(): return SqueezeHead().eval()
    def shuffle(): return Shuffle().eval()
    def masked(): return Masked().eval()
    def pyint(): return PyIntIndex().eval()
    def overflow(): return Overflow().eval()
    def decomposed_ln(): return DecomposedLN().eval()
    def big_clamp(): return BigClamp().eval()
    def plain(): return Plain().eval()
''')


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("usermodels")
    (d / "ec_user_models.py").write_text(MODELS)
    sys.path.insert(0, str(d))
    yield d, importlib.import_module("ec_user_models")
    sys.path.remove(str(d))


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


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name, shape, dt=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dt, shape)


def _by(results, check, status=None):
    return [r for r in results if r["check"] == check and (status is None
                                                           or r["status"] == status)]


# ------------------------------------------------------------------------------------------
# Lint: any ONNX file
# ------------------------------------------------------------------------------------------
def test_lint_softmax_below_opset13_named_with_fix(tmp_path):
    m = _model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1)],
               [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=11)
    r = _by(lint(m), "softmax_axis")
    assert r[0]["status"] == "warn" and r[0]["node"] == "sm" and "opset >= 13" in r[0]["fix"]
    m13 = _model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1)],
                 [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=13)
    assert _by(lint(m13), "softmax_axis")[0]["status"] == "pass"
    last = _model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)],
                  [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=11)
    assert _by(lint(last), "softmax_axis")[0]["status"] == "pass"
    # The command line: exit 1, the node and the fix printed.
    onnx.save(m, str(tmp_path / "sm.onnx"))
    p = subprocess.run([sys.executable, "export_checks.py", "lint", str(tmp_path / "sm.onnx")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and "sm" in p.stdout and "fix:" in p.stdout
    onnx.save(m13, str(tmp_path / "ok.onnx"))
    p = subprocess.run([sys.executable, "export_checks.py", "lint", str(tmp_path / "ok.onnx")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_lint_squeeze_without_axes_on_dynamic_axis():
    nodes = [helper.make_node("Squeeze", ["x"], ["y"], name="sq")]
    r = _by(lint(_model(nodes, [_vi("x", ["N", 8, 1, 1])], [_vi("y", None)], opset=13)),
            "squeeze_axes")
    assert r[0]["status"] == "fail" and r[0]["node"] == "sq" and "flatten(1)" in r[0]["fix"]
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "ax")
    ok = _model([helper.make_node("Squeeze", ["x", "ax"], ["y"], name="sq")],
                [_vi("x", ["N", 8, 1, 1])], [_vi("y", None)], [axes], opset=13)
    assert _by(lint(ok), "squeeze_axes")[0]["status"] == "pass"


def test_lint_reshape_constant_holding_a_batch():
    shape = numpy_helper.from_array(np.array([2, 2, 4, 8], np.int64), "s")
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
               [_vi("x", ["N", 8, 8])], [_vi("y", None)], [shape])
    r = _by(lint(m), "shape_constants")
    assert r[0]["status"] == "fail" and r[0]["node"] == "rs"
    ok_shape = numpy_helper.from_array(np.array([-1, 2, 4, 8], np.int64), "s")
    ok = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
                [_vi("x", ["N", 8, 8])], [_vi("y", None)], [ok_shape])
    assert _by(lint(ok), "shape_constants")[0]["status"] == "pass"
    # With the export's example batch known, a leading 3 is named as the frozen batch.
    s3 = numpy_helper.from_array(np.array([3, 64], np.int64), "s")
    m3 = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
                [_vi("x", ["N", 8, 8])], [_vi("y", None)], [s3])
    assert "example batch" in _by(lint(m3, example_batch=3), "shape_constants")[0]["detail"]


def test_lint_blocked_qdq_needs_opset21_and_fp16_constants_in_range():
    q = numpy_helper.from_array(np.zeros((4, 32), np.int8), "q")
    s = numpy_helper.from_array(np.ones((4, 1), np.float32), "s")
    dq = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq", axis=1,
                          block_size=32)
    mm = helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")
    tr = helper.make_node("Transpose", ["w"], ["wt"], name="tr")
    m = _model([dq, tr, mm], [_vi("x", ["N", 32])], [_vi("y", None)], [q, s], opset=19)
    r = _by(lint(m), "blocked_qdq_opset")
    assert r[0]["status"] == "fail" and r[0]["node"] == "dq"
    w16 = numpy_helper.from_array(np.array([1.0, np.inf], np.float16), "w16")
    m16 = _model([helper.make_node("Mul", ["x", "w16"], ["y"], name="mul")],
                 [_vi("x", ["N", 2], TensorProto.FLOAT16)], [_vi("y", None, TensorProto.FLOAT16)],
                 [w16])
    r = _by(lint(m16), "fp16_initializers")
    assert r[0]["status"] == "fail" and r[0]["node"] == "mul"


def test_hardsigmoid_attributes_lint_warns_check_fails():
    m = _model([helper.make_node("HardSigmoid", ["x"], ["y"], name="hs")],
               [_vi("x", ["N", 16])], [_vi("y", ["N", 16])])
    assert _by(lint(m), "hardsigmoid")[0]["status"] == "warn"  # right for a Keras model
    r = _by(lint(m, against_torch=True), "hardsigmoid")[0]
    assert r["status"] == "fail" and r["node"] == "hs" and "alpha=0.2" in r["detail"]


# ------------------------------------------------------------------------------------------
# Export checks against PyTorch (hand-made exports)
# ------------------------------------------------------------------------------------------
def _legacy(model, example, path, names, dynamic=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(torch.from_numpy(v) for v in example.values()),
                          str(path), input_names=list(example), output_names=names,
                          opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "N"} for n in list(example) + names}
                          if dynamic else None)
    return path


def test_check_passes_a_correct_boolean_mask_export_and_flags_it_for_tensorrt(user_models,
                                                                              tmp_path):
    _, mods = user_models
    m = mods.masked()
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((4, 6, 16)).astype(np.float32),
            "m": rng.integers(0, 2, (4, 6)).astype(bool)}
    path = _legacy(m, feed, tmp_path / "mask.onnx", ["y"])
    res = check_export(m, path, feed)
    assert worst(res) != "fail", [format_result(r) for r in res if r["status"] == "fail"]
    dd = _by(res, "data_dependent_ops")[0]
    assert dd["status"] == "warn" and "NonZero" in dd["ops"] and "TensorRT" in dd["detail"]


def test_check_names_a_frozen_index_and_the_unused_input(user_models, tmp_path):
    _, mods = user_models
    m = mods.pyint()
    feed = {"x": np.random.default_rng(0).standard_normal((1, 6, 16)).astype(np.float32),
            "m": np.eye(6, dtype=bool)[[4]]}
    path = _legacy(m, feed, tmp_path / "pyint.onnx", ["y"], dynamic=False)
    res = check_export(m, path, {k: np.repeat(v, 3, 0) for k, v in feed.items()})
    assert _by(res, "unused_inputs")[0]["unused"] == ["m"]
    paths = _by(res, "input_paths")[0]
    assert paths["status"] == "fail" and "frozen" in paths["detail"] and paths["node"] == "m"


def test_check_static_batch_file_is_fed_its_batch(user_models, tmp_path):
    _, mods = user_models
    m = mods.plain()
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    path = _legacy(m, {"input": x}, tmp_path / "b1.onnx", ["y"], dynamic=False)
    res = check_export(m, path, {"input": np.repeat(x, 4, 0)})
    assert _by(res, "batch_parity")[0]["status"] == "pass"
    assert _by(res, "dynamic_axes")[0]["status"] == "warn"


def test_check_frozen_batch_reshape_named(user_models, tmp_path):
    _, mods = user_models
    m = mods.shuffle()
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    path = _legacy(m, {"input": x}, tmp_path / "shuffle.onnx", ["y"])
    res = check_export(m, path, {"input": x})
    bp = _by(res, "batch_parity")[0]
    assert bp["status"] == "fail" and bp["node"] and "Reshape" in bp["node"]
    assert _by(res, "shape_constants", "fail")


def test_check_batch_dependent_model_warned_not_blamed_on_export(tmp_path):
    class BatchMix(nn.Module):
        def forward(self, x):
            return x.flatten(1) - x.flatten(1).mean(0, keepdim=True)

    feed = {"input": np.random.default_rng(0).standard_normal((4, 3, 4, 4)).astype(np.float32)}
    path = _legacy(BatchMix(), feed, tmp_path / "mix.onnx", ["y"])
    res = check_export(BatchMix(), path, feed)
    assert _by(res, "batch_parity")[0]["status"] == "pass"  # the export is faithful
    assert _by(res, "batch_independence")[0]["status"] == "warn"


def test_check_blames_an_opset11_softmax_not_a_frozen_value(tmp_path):
    """A Softmax(axis=1) on a rank-4 tensor at opset 11 normalises over C*H*W: parity fails and
    the finding names the Softmax node, not a "traced constant"."""
    class Soft(nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=1)

    m = _model([helper.make_node("Softmax", ["x"], ["y"], name="softmax_c", axis=1)],
               [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=11)
    onnx.save(m, str(tmp_path / "sm11.onnx"))
    feed = {"x": np.random.default_rng(0).standard_normal((3, 5, 4, 4)).astype(np.float32)}
    res = check_export(Soft().eval(), tmp_path / "sm11.onnx", feed)
    bp = _by(res, "batch_parity")[0]
    assert bp["status"] == "fail" and bp["node"] == "softmax_c" and "opset >= 13" in bp["fix"]
    assert "frozen" not in _by(res, "input_paths")[0]["detail"]


def test_layerwise_export_check_delegates(tmp_path, user_models):
    m = _model([helper.make_node("HardSigmoid", ["x"], ["y"], name="hsig_noattr")],
               [_vi("x", ["N", 64])], [_vi("y", ["N", 64])])
    onnx.save(m, str(tmp_path / "hs.onnx"))
    mod = tmp_path / "hsmod.py"
    mod.write_text("import torch\ndef build():\n    return torch.nn.Sequential("
                   "torch.nn.Hardsigmoid()).eval()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    p = subprocess.run([sys.executable, "layerwise.py", "export-check", "--model", "hsmod:build",
                        "--onnx", str(tmp_path / "hs.onnx"), "--input-shape", "x:1,64"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 1 and "hsig_noattr" in p.stdout and "alpha=1/6" in p.stdout


# ------------------------------------------------------------------------------------------
# Stage 2 as a gate
# ------------------------------------------------------------------------------------------
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


def test_stage2_fp16_overflow_named_and_fixed_by_one_command(user_models, tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    args = ["--model", "ec_user_models:overflow", "--input-shape", "input:1,3,16,16",
            "--true-fp16-budget-s", "0"]
    p = _stage2(args, env, check=1)
    assert "fp16_range" in p.stderr and "> 65504" in p.stderr
    out = _onnx_dir(tmp_path, "ec_user_models:overflow")
    assert not (out / "fp16.onnx").exists() and (out / "fp16.rejected.onnx").exists()
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


def test_fp16_true_arithmetic_sees_what_ort_cpu_does_not(user_models, tmp_path):
    _, mods = user_models
    m = mods.overflow()
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    path = tmp_path / "fp32.onnx"
    _legacy(m, {"input": x}, path, ["y"])
    m16, _ = convert_fp16(onnx.load(str(path)))
    onnx.save(m16, str(tmp_path / "fp16.onnx"))
    ref = {"y": m(torch.from_numpy(x)).detach().numpy()}
    ort_cpu = ort_runner(tmp_path / "fp16.onnx")({"input": x})
    assert np.isfinite(next(iter(ort_cpu.values()))).all()  # ORT CPU computes in FP32
    r = fp16_true_arithmetic(tmp_path / "fp16.onnx", {"input": x}, ref, 0.999)[0]
    assert r["status"] == "fail" and "Conv" in r["detail"]
    b = fp16_backends(tmp_path / "fp16.onnx", {"input": x}, ref, 0.999)
    if b[0]["status"] == "skip":
        assert "computed this FP16 graph in FP32" in b[0]["detail"]
    else:  # a real FP16 backend ran it and is named (on the H200's CUDA EP this conv model
        # matched PyTorch: the kernel did not store the >65504 value in FP16 there)
        assert {r["backend"] for r in b} <= {"ort-cuda", "tensorrt"}
        assert b[0]["status"] in ("pass", "fail"), b


def test_fp16_backend_run_sees_an_overflow_the_cpu_ep_hides(tmp_path):
    """sqrt of a sum of squares above 65504: ORT's CPU EP returns the FP32 value (it computes
    the FP16 graph in FP32), ORT's CUDA EP returns inf (seen on an H200 with ORT 1.31.1: 489.9
    vs inf); fp16_backends fails it where a GPU EP exists, and says why it cannot judge on a
    CPU-only machine."""
    g = helper.make_graph(
        [helper.make_node("ReduceSumSquare", ["x"], ["s"], keepdims=1),
         helper.make_node("Sqrt", ["s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 300])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m16, _ = convert_fp16(m)
    onnx.save(m16, str(tmp_path / "fp16.onnx"))
    x = np.full((2, 300), 20.0, np.float32)
    ref = {"y": np.sqrt((x.astype(np.float64) ** 2).sum()).reshape(1, 1).astype(np.float32)}
    cpu = ort_runner(tmp_path / "fp16.onnx")({"x": x})["y"]
    assert np.allclose(cpu, ref["y"], rtol=1e-3)  # the CPU EP's FP32 arithmetic hides it
    b = fp16_backends(tmp_path / "fp16.onnx", {"x": x}, ref, 0.999)
    if b[0]["status"] == "skip":
        assert "computed this FP16 graph in FP32" in b[0]["detail"]
    else:
        assert b[0]["backend"] == "ort-cuda" and b[0]["status"] == "fail", b


def test_decomposed_layernorm_overflow_named(user_models, tmp_path):
    _, mods = user_models
    m = mods.decomposed_ln()
    x = np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)
    path = _legacy(m, {"x": x}, tmp_path / "ln.onnx", ["y"])
    m32 = onnx.load(str(path))
    m16, _ = convert_fp16(m32)
    res = fp16_range_audit(m32, {"x": x}, m16)
    bad = [r for r in res if r["status"] == "fail" and not r.get("summary")]
    assert bad and bad[0]["node"].endswith("Pow") and "65504" in bad[0]["detail"]
    # The fix (producer and consumers in FP32) clears the audit.
    m16k, _ = convert_fp16(m32, bad[0]["keep_fp32"])
    assert worst(fp16_range_audit(m32, {"x": x}, m16k)) == "pass"


def test_fp16_underflow_and_converter_changes_named(tmp_path):
    tiny = numpy_helper.from_array(np.array(1e-7, np.float32), "tiny")
    big = numpy_helper.from_array(np.array(1e5, np.float32), "big")
    low = numpy_helper.from_array(np.array(-1.0, np.float32), "low")
    m = _model([helper.make_node("Mul", ["x", "tiny"], ["t"], name="scale_down"),
                helper.make_node("Clip", ["t", "low", "big"], ["y"], name="clamp")],
               [_vi("x", ["N", 64])], [_vi("y", ["N", 64])], [tiny, big, low])
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    m16, warns = convert_fp16(m)
    res = fp16_range_audit(m, {"x": x}, m16)
    under = [r for r in res if r["status"] == "fail" and "mass" in r["detail"]]
    assert under and under[0]["node"] == "scale_down"
    ch = fp16_converter_changes(m, m16, warns)
    bad = [r for r in ch if r["status"] == "fail" and r.get("constant")]
    assert {r["constant"] for r in bad} == {"big"} and "clamp" in bad[0]["keep_fp32"]
    assert any("truncated" in w["message"] for w in warns)  # the converter's warning, kept


def test_convert_fp16_keeps_constants_fp16_can_hold():
    c = numpy_helper.from_array(np.array(20000.0, np.float32), "c")
    m = _model([helper.make_node("Mul", ["x", "c"], ["y"], name="mul")],
               [_vi("x", ["N", 4])], [_vi("y", ["N", 4])], [c])
    m16, _ = convert_fp16(m)
    got = {t.name: numpy_helper.to_array(t) for t in m16.graph.initializer}["c"]
    assert float(got) == 20000.0  # onnxconverter-common's default would clamp it to 10000
    assert fp16_converter_changes(m, m16)[-1]["status"] == "pass"


def test_stage2_flags_are_range_checked(user_models, tmp_path):
    d, _ = user_models
    env = _env(tmp_path, d)
    base = ["--model", "ec_user_models:plain", "--input-shape", "input:1,3,8,8"]
    for bad in (["--min-cosine-fp32", "1.5"], ["--min-cosine-fp16", "0"],
                ["--check-images", "1"], ["--opset", "3", "--exporter", "legacy"],
                ["--true-fp16-budget-s", "-1"]):
        p = _stage2(base + bad, env, check=2)
        assert bad[0] in p.stderr


# ------------------------------------------------------------------------------------------
# Feeding: static batch, --input-shape batch, FP16 inputs
# ------------------------------------------------------------------------------------------
def _static_b1(path: Path, batch=1) -> Path:
    rng = np.random.default_rng(26)
    w = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32),
                                "w")
    big = numpy_helper.from_array(np.array(2e4, np.float32), "big")
    m = _model([helper.make_node("Conv", ["input", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
                helper.make_node("Mul", ["c", "big"], ["y"], name="amplify")],
               [_vi("input", [batch, 3, 8, 8])], [_vi("y", [batch, 8, 8, 8])], [w, big])
    onnx.save(m, str(path))
    return path


def test_act_stats_feeds_a_static_batch_one_sample_at_a_time_and_flags_fp16(tmp_path):
    path = _static_b1(tmp_path / "b1.onnx")
    np.savez(tmp_path / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (12, 3, 8, 8)).astype(np.float32))
    rows = {r["tensor"]: r for r in activation_stats(path, tmp_path / "calib.npz",
                                                                batch=10)}
    assert rows["y"]["fp16"] == "overflow" and rows["c"]["fp16"] is None
    p = subprocess.run([sys.executable, "qdq_tools.py", "act-stats", str(path), "--calib",
                        str(tmp_path / "calib.npz")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "OVERFLOW" in p.stdout, p.stderr


def test_layerwise_diff_static_batch_and_input_shape_batch(tmp_path):
    a = _static_b1(tmp_path / "ref.onnx", batch="N")
    b = _static_b1(tmp_path / "b1.onnx")
    np.savez(tmp_path / "feed.npz", input=np.random.default_rng(0).standard_normal(
        (5, 3, 8, 8)).astype(np.float32))
    feed = load_feed(tmp_path / "feed.npz", None, 0, a)
    res = run_layer_diff(a, b, feed, batch=8)
    assert res["first_divergent"] is None and res["n_samples"] == 5
    # --input-shape's first dimension is the batch per run; --n the number of samples.
    feed, batch = feed_plan(load_feed(None, None, 8, a, ["input:2,3,8,8"]),
                                      [a], input_shape_batch(["input:2,3,8,8"]))
    assert batch == 2 and len(feed["input"]) == 8
    with pytest.raises(UsageError):
        feed_plan(feed, [b, _static_b1(tmp_path / "b2.onnx", batch=2)], None)
    p = subprocess.run([sys.executable, "layerwise.py", "diff", str(a), str(b), "--inputs",
                        str(tmp_path / "feed.npz")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_diff_accepts_a_candidate_with_fp16_inputs(tmp_path):
    a = _static_b1(tmp_path / "ref.onnx", batch="N")
    m = onnx.load(str(a))
    for t in m.graph.initializer:
        if t.name == "big":
            t.CopyFrom(numpy_helper.from_array(np.array(2.0, np.float32), "big"))
    onnx.save(m, str(a))
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m16 = float16.convert_float_to_float16(onnx.load(str(a)), keep_io_types=False)
    onnx.save(m16, str(tmp_path / "io16.onnx"))
    feed = {"input": np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)}
    res = run_layer_diff(a, tmp_path / "io16.onnx", feed)
    assert res["status"] == "ok" and res["first_divergent"] is None


# ------------------------------------------------------------------------------------------
# Remedies produce files the pipeline picks up
# ------------------------------------------------------------------------------------------
def test_trt_fp16_remedy_command_writes_the_fp16_variant_the_pipeline_uses(user_models,
                                                                           tmp_path):

    _, mods = user_models
    m = mods.overflow()
    art = tmp_path / "a" / "mymodel"
    onnx_dir = art / "onnx"
    onnx_dir.mkdir(parents=True)
    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    _legacy(m, {"input": x}, onnx_dir / "fp32.onnx", ["output"])
    np.savez(art / "calib.npz", input=x)
    bad = onnx.load(str(onnx_dir / "fp32.onnx"))
    conv = next(n.name for n in bad.graph.node if n.op_type == "Conv")
    onnx.save(convert_fp16(bad)[0], str(onnx_dir / "fp16.onnx"))
    remedies = trt_remedies(conv, onnx_dir / "fp16.onnx", "fp16", "11.0.0")
    line = next(r for r in remedies if "export_checks.py fp16" in r)
    cmd = line[line.index("python export_checks.py"):line.index("  # then:")]
    assert "autocast" not in line
    p = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout + p.stderr
    out = onnx_dir / "fp16.onnx"
    fixed = onnx.load(str(out))
    assert variant_of_file(out).name == "fp16"
    assert [i.type.tensor_type.elem_type for i in list(fixed.graph.input) +
            list(fixed.graph.output)] == [TensorProto.FLOAT, TensorProto.FLOAT]
    # The next stages take it: the layer-wise diff (ORT) and stage 6's command line.
    res = run_layer_diff(onnx_dir / "fp32.onnx", out, {"input": x})
    assert res["final_outputs"]["output"]["status"] == "pass"
    build = next(r for r in remedies if "6_build_engines.sh" in r).split("# then: ")[1]
    p = subprocess.run(build.replace("bash 6_build_engines.sh",
                                     "bash 6_build_engines.sh --dry-run --trt-version 11.0.0"),
                       shell=True, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, ARTIFACTS=str(tmp_path / "a"),
                                RESULTS=str(tmp_path / "r")))
    assert p.returncode == 0 and str(out) in p.stdout, p.stdout + p.stderr


# ------------------------------------------------------------------------------------------
# torch-vs-onnx: in-place activations after a folded BatchNorm (timm's BatchNormAct2d)
# ------------------------------------------------------------------------------------------
class _BNAct(nn.BatchNorm2d):
    """timm-style BatchNormAct2d: batch_norm -> drop (Identity) -> ReLU6(inplace=True)."""

    def __init__(self, c):
        super().__init__(c)
        self.drop, self.act = nn.Identity(), nn.ReLU6(inplace=True)

    def forward(self, x):
        x = nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                     self.bias, False, 0.0, self.eps)
        return self.act(self.drop(x))


class _ConvBNAct(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), _BNAct(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, groups=8), _BNAct(8)
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x)))).mean((2, 3))


def test_torch_vs_onnx_no_false_divergence_with_inplace_activation(tmp_path):
    m = _ConvBNAct().eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    prog = torch.onnx.export(m, (torch.from_numpy(x),), input_names=["input"], dynamo=True,
                             opset_version=18, verbose=False)
    prog.save(str(tmp_path / "m.onnx"))
    res = torch_vs_onnx(m, tmp_path / "m.onnx", {"input": x})
    assert res["first_divergent"] is None, [(r["module"], r["compared_as"], r["cosine_min"])
                                            for r in res["modules"] if r["status"] == "fail"]
    assert any(r["module"] == "bn1.act" for r in res["modules"])
