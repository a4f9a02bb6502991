"""Tests of layerwise.py: fault injection into small ONNX models built here.

Models (exported with the legacy TorchScript exporter, ``dynamo=False``, whose node names
``/head1/fc3/Gemm`` carry the module path):
- ``TokenHeads``: input ``[batch, 8, 256]``, three heads Linear-ReLU-Linear-ReLU-Linear(256->2)
  over selected token rows (the model of the issue report).
- ``SECNN``: Conv-BN-ReLU stem, SE blocks (GlobalAvgPool-Conv-ReLU-Conv-HardSigmoid-Mul).

Faults are injected into a copy of the ONNX file (one initializer changed, one op swapped); the
tool must name exactly that node as the first divergent one, with its inputs agreeing.
Run: ``.venv/bin/python -m pytest tests/test_layerwise.py -q``.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
import deploykit.layerwise.diff as layerwise_diff
from deploykit.tools import layerwise as layerwise_cli
from deploykit.layerwise.diff import run_layer_diff
from deploykit.layerwise.remedies import trt_remedies
from deploykit.layerwise.torch_vs_onnx import torch_vs_onnx
from deploykit.onnx.activations import lookthrough_aliases, ort_activations, trt_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pass  # noqa: E402

torch = pytest.importorskip("torch")
nn = torch.nn


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------
class Head(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(d, d), nn.ReLU()
        self.fc2, self.act2 = nn.Linear(d, d), nn.ReLU()
        self.fc3 = nn.Linear(d, 2)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class TokenHeads(nn.Module):
    """``[B, T, 256]`` -> three ``[B, 2]`` outputs, head i reading token row ``ROWS[i]``."""

    ROWS = (0, 3, 5)

    def __init__(self):
        super().__init__()
        self.head0, self.head1, self.head2 = Head(), Head(), Head()

    def forward(self, x):
        return tuple(h(x[:, r]) for h, r in zip((self.head0, self.head1, self.head2), self.ROWS))


class SE(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.act = nn.Conv2d(c, c // 4, 1), nn.ReLU()
        self.fc2, self.gate = nn.Conv2d(c // 4, c, 1), nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


class SECNN(nn.Module):
    def __init__(self, flatten_bug: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.se1 = SE(16)
        self.conv2 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.se2 = SE(32)
        self.head = nn.Linear(32, 10)
        self.flatten_bug = flatten_bug

    def forward(self, x):
        x = self.se2(self.conv2(self.se1(self.stem(x))))
        if self.flatten_bug:  # the classic: int(x.shape[0]) freezes the export batch into a Reshape
            x = x.reshape(int(x.shape[0]), x.shape[1], -1).mean(2)
        else:
            x = x.mean((2, 3))
        return self.head(x)


def _init_bn(model):
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def export(model, example, path: Path, input_name: str, output_names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=17,
                          input_names=[input_name], output_names=list(output_names),
                          dynamic_axes={input_name: {0: "batch"},
                                        **{o: {0: "batch"} for o in output_names}})
    return path


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


def _copy_with(path: Path, dst: Path, edit) -> Path:
    m = onnx.load(str(path))
    edit(m)
    onnx.save(m, str(dst))
    return dst


def _row(res, node):
    return [r for r in res["layers"] if r["node"] == node]


# ------------------------------------------------------------------------------------------
# diff: fault injection
# ------------------------------------------------------------------------------------------
def test_no_fault_passes(token_model, tmp_path):
    _, path, feed = token_model
    res = run_layer_diff(path, path, feed, out_dir=tmp_path)
    assert res["status"] == "ok" and res["first_divergent"] is None
    assert res["summary"]["fail"] == 0 and res["summary"]["pass"] > 10
    assert all(v["status"] == "pass" for v in res["final_outputs"].values())
    assert (tmp_path / "layerwise.png").stat().st_size > 1000
    assert "No divergent layer" in (tmp_path / "layerwise.md").read_text()


def test_weight_fault_names_final_linear(token_model, tmp_path):
    """The issue's report: head1's second Linear agrees, its final Linear (256 -> 2) does not."""
    _, path, feed = token_model

    def edit(m):
        for t in m.graph.initializer:
            if t.name == "head1.fc3.weight":
                w = numpy_helper.to_array(t)
                t.CopyFrom(numpy_helper.from_array((w[::-1] * 0.5).copy(), t.name))

    bad = _copy_with(path, tmp_path / "bad.onnx", edit)
    res = run_layer_diff(path, bad, feed, out_dir=tmp_path)
    fd = res["first_divergent"]
    assert fd["node"] == "/head1/fc3/Gemm"
    assert fd["inputs_agreed"] is True and "is wrong" in fd["verdict"]
    assert "head1.fc3.weight" in fd["detail"]["weights_differ"]
    for pred in ("/head1/fc1/Gemm", "/head1/act1/Relu", "/head1/fc2/Gemm", "/head1/act2/Relu"):
        assert [r["status"] for r in _row(res, pred)] == ["pass"], pred
    assert res["origins"] == ["/head1/fc3/Gemm"]
    assert res["final_outputs"]["out1"]["status"] == "fail"
    assert res["final_outputs"]["out0"]["status"] == "pass"
    saved = json.loads((tmp_path / "layerwise.json").read_text())
    assert saved["first_divergent"]["node"] == "/head1/fc3/Gemm"


def test_op_swap_names_that_node(cnn_model, tmp_path):
    _, path, feed = cnn_model

    def edit(m):
        for n in m.graph.node:
            if n.name == "/se1/act/Relu":
                n.op_type = "Sigmoid"

    bad = _copy_with(path, tmp_path / "swap.onnx", edit)
    res = run_layer_diff(path, bad, feed, out_dir=tmp_path)
    fd = res["first_divergent"]
    assert fd["node"] == "/se1/act/Relu" and fd["inputs_agreed"] is True
    assert fd["detail"]["op_type_b"] == "Sigmoid"
    idx = fd["index"]
    assert all(r["status"] == "pass" for r in res["layers"][:idx])
    # Downstream layers fail too, but their inputs already differed: not origins.
    assert any(r["status"] == "fail" and r["inputs_agreed"] is False for r in res["layers"][idx:])
    assert res["origins"][0] == "/se1/act/Relu"


def test_fp16_no_false_alarm(cnn_model, token_model, tmp_path):
    from onnxconverter_common import float16

    for i, (_, path, feed) in enumerate((cnn_model, token_model)):
        m16 = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
        p16 = tmp_path / f"fp16_{i}.onnx"
        onnx.save(m16, str(p16))
        res = run_layer_diff(path, p16, feed)
        assert res["precision"] == "fp16"
        assert res["first_divergent"] is None, res["verdict"]
        assert res["summary"]["pass"] >= 10


def test_tolerance_override_and_cli(token_model, tmp_path):
    _, path, feed = token_model
    np.savez(tmp_path / "feed.npz", **feed)
    args = layerwise_cli.get_args_parser().parse_args(
        ["diff", str(path), str(path), "--inputs", str(tmp_path / "feed.npz"),
         "--out-dir", str(tmp_path / "out"), "--min-cosine", "0.5", "--batch", "2"])
    res = layerwise_cli.main(args)
    assert res["tolerances"]["min_cosine"] == 0.5 and res["first_divergent"] is None
    assert (tmp_path / "out" / "layerwise.json").exists()


def test_trt_skips_cleanly_without_tensorrt(token_model, tmp_path):
    ok, _ = trt_available()
    if ok:
        pytest.skip("tensorrt is installed here")
    _, path, feed = token_model
    res = run_layer_diff(path, path, feed, b_engine=tmp_path / "x.plan",
                                   out_dir=tmp_path)
    assert res["status"] == "skipped" and "TensorRT" in res["reason"]
    assert "Skipped" in (tmp_path / "layerwise.md").read_text()


def test_trt_remedies_follow_version():
    r10 = trt_remedies("/head1/fc3/Gemm", "m.onnx", "fp16", "10.3.0")
    assert any("--layerPrecisions=/head1/fc3/Gemm:fp32" in r and "--precisionConstraints=obey"
               in r for r in r10)
    r11 = trt_remedies("/head1/fc3/Gemm", "m.onnx", "fp16", "11.0.0")
    cmds = [r for r in r11 if r.startswith("trtexec")]
    assert cmds and not any("--layerPrecisions=" in r or "--fp16" in r for r in cmds)
    assert any("strongly typed" in r for r in r11) and any("--noTF32" in r for r in r11)


# ------------------------------------------------------------------------------------------
# PyTorch vs ONNX
# ------------------------------------------------------------------------------------------
def test_torch_vs_onnx_clean_and_faulty(cnn_model, tmp_path):
    m, path, feed = cnn_model
    res = torch_vs_onnx(m, path, feed)
    mods = {r["module"] for r in res["modules"]}
    assert {"stem.0", "se1.fc1", "se1.gate", "se2", "head"} <= mods
    assert res["first_divergent"] is None
    # stem.0 is compared after its folded BatchNorm.
    assert next(r for r in res["modules"] if r["module"] == "stem.0")["compared_as"] == "stem.1"

    def edit(mm):
        for t in mm.graph.initializer:
            if t.name == "se1.fc2.weight":
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * -1.0, t.name))

    bad = _copy_with(path, tmp_path / "bad.onnx", edit)
    res = torch_vs_onnx(m, bad, feed)
    assert res["first_divergent"]["module"] == "se1.fc2"
    assert next(r for r in res["modules"] if r["module"] == "se1.act")["status"] == "pass"


# ------------------------------------------------------------------------------------------
# Q/DQ look-through on a model ModelOpt really quantized (~3 s; deselect with -k 'not modelopt')
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_int8(cnn_model, tmp_path_factory):
    """The SE CNN quantized once by ModelOpt INT8 (8 random calibration samples)."""
    pytest.importorskip("modelopt.onnx.quantization")
    from modelopt.onnx.quantization import quantize

    _, path, _ = cnn_model
    calib = np.random.default_rng(1).standard_normal((8, 3, 32, 32)).astype(np.float32)
    q = tmp_path_factory.mktemp("int8") / "int8.onnx"
    quantize(onnx_path=str(path), quantize_mode="int8", calibration_data={"input": calib},
             output_path=str(q))
    return q


def test_qdq_lookthrough_modelopt(cnn_model, cnn_int8, tmp_path):
    _, path, feed = cnn_model
    q = cnn_int8
    qm = onnx.load(str(q))
    assert any(n.op_type == "DequantizeLinear" for n in qm.graph.node)
    alias = lookthrough_aliases(qm)
    assert alias["/se1/act/Relu_output_0_DequantizeLinear_Output"] == "/se1/act/Relu_output_0"
    res = run_layer_diff(path, q, feed, out_dir=tmp_path)
    assert res["precision"] == "int8" and res["status"] == "ok"
    compared = [r for r in res["layers"] if r["status"] in ("pass", "fail")]
    # Every compute node of the FP32 graph found its float tensor in the Q/DQ graph.
    assert res["summary"]["unmatched"] == 0 and len(compared) >= 15
    assert all(r["cosine_min"] > 0.9 for r in compared)
    # The error enters at the first quantised Conv (visible, but within INT8 tolerance).
    assert compared[0]["node"] == "/stem/stem.0/Conv" and compared[0]["cosine_min"] < 0.999999
    assert (tmp_path / "layerwise.png").exists()

    # A wrong activation scale in the Q/DQ pair feeding se1.fc2 is blamed on that layer.
    def edit(mm):
        for t in mm.graph.initializer:
            if t.name == "/se1/act/Relu_output_0_scale_2":
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 8, t.name))

    bad = _copy_with(q, tmp_path / "int8_bad.onnx", edit)
    res = run_layer_diff(path, bad, feed)
    assert res["first_divergent"]["node"] == "/se1/fc2/Conv"
    assert res["first_divergent"]["inputs_agreed"] is True


def test_qdq_divergence_blamed_on_ort_optimiser_when_unoptimised_run_agrees(cnn_model, cnn_int8,
                                                                           monkeypatch):
    """A Q/DQ divergence that only exists with ORT graph optimisations on (as ModelOpt fp16
    scales + ORT's WeightBiasQuantization produce on EfficientNet-Lite0) is reported as a
    backend effect, not a quantisation error. The optimiser fault is simulated: B's outputs
    of one node are corrupted unless the level is 'disable'."""
    _, path, feed = cnn_model
    q = cnn_int8
    real = ort_activations

    def faulty(model_or_path, feed_, *, opt_level="all", **kw):
        is_b = "DequantizeLinear" in str(getattr(model_or_path, "graph", "")) or \
            str(model_or_path).endswith("int8.onnx")
        for out, n in real(model_or_path, feed_, opt_level=opt_level, **kw):
            if is_b and opt_level != "disable":
                out = {k: (v * np.nan if k.startswith("/se1/fc2/") else v) for k, v in out.items()}
            yield out, n

    monkeypatch.setattr(layerwise_diff, "ort_activations", faulty)
    res = run_layer_diff(path, q, feed)
    assert res["first_divergent"]["node"] == "/se1/fc2/Conv"
    assert res["backend_check"]["backend_caused"] is True
    assert "ORT graph optimisations cause" in res["verdict"] and "NaN" in res["verdict"]
    # Without the simulated optimiser fault the check does not run and blames nobody.
    monkeypatch.setattr(layerwise_diff, "ort_activations", real)
    assert run_layer_diff(path, q, feed).get("backend_check") is None
