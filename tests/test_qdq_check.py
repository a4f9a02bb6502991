"""The Q/DQ health check (qdq_tools.py check / deploykit.quant.health), calibration validation, the INT4
block axis of stage 5b, custom models through stages 4-5 and the quantization-vs-backend table.

Every model is built here (hand-made Q/DQ graphs, or ModelOpt/ORT quantizers run on small
models); the ground truth of each ORT claim is ORT itself, run in the test.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deploykit.data.images import list_images
from deploykit.data.splits import load_split
from deploykit.errors import StageError
from deploykit.evaluate import EvalData, run_outputs
from deploykit.io import write_json
from deploykit.layerwise.quant_backend import quant_backend_table
from deploykit.layout import DEFAULT_DATA, model_artifacts, model_tag, splits_path
from deploykit.models import model_spec
from deploykit.quant.bias import simulate_bias_requant
from deploykit.quant.calibration import calibration_plan, validate_calibration
from deploykit.quant.cross_check import CROSS_CHECK_FIRST, backend_cross_check, first_look_verdict
from deploykit.quant.health import check_against_float, check_model, check_scales
from deploykit.quant.inspect import inspect_model
from deploykit.quant.modelopt import modelopt_quantize
from deploykit.runners import OrtRunner, ort_session_options

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402

int4 = importlib.import_module("5b_quantize_int4")
make_calib = importlib.import_module("4_make_calib")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------
def _save(model, path: Path) -> Path:
    import onnx

    onnx.save(model, str(path))
    return path


def _ort(model_or_path, feed, level="all", disabled=()):
    import onnxruntime as ort

    src = str(model_or_path) if isinstance(model_or_path, (str, Path)) else \
        model_or_path.SerializeToString()
    so = ort_session_options(level)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled)).run(None, feed)[0]


def qdq_conv(bias, w_scale, *, dtype=np.float32, relu6=True, s_in=0.01, s_out=6 / 255,
             float_model=False):
    """x [N,2,4,4] -> Q/DQ (uint8, s_in, zp 128) -> Conv 1x1 (int8 weights 10, per-channel
    scales ``w_scale``, float bias ``bias``) -> Clip(0, 6) -> Q/DQ (uint8, s_out, zp 0) -> y.
    ``float_model``: the same Conv in float (dequantized weights), no Q/DQ."""
    from onnx import TensorProto, helper, numpy_helper

    tp = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    c = len(bias)
    wq = np.full((c, 2, 1, 1), 10, np.int8)
    ws = np.asarray(w_scale, dtype)
    wf = (wq.astype(np.float32) * ws.astype(np.float32)[:, None, None, None]).astype(dtype)
    inits = [numpy_helper.from_array(np.asarray(bias, dtype), "b"),
             numpy_helper.from_array(np.array(0, dtype), "lo"),
             numpy_helper.from_array(np.array(6, dtype), "hi")]
    if float_model:
        inits.append(numpy_helper.from_array(wf, "w"))
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
                 helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip")]
    else:
        inits += [numpy_helper.from_array(np.array(s_in, dtype), "xs"),
                  numpy_helper.from_array(np.array(128, np.uint8), "xz"),
                  numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"),
                  numpy_helper.from_array(np.zeros(c, np.int8), "wz"),
                  numpy_helper.from_array(np.array(s_out, dtype), "ys"),
                  numpy_helper.from_array(np.array(0, np.uint8), "yz")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
                 helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="xdq"),
                 helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0,
                                  name="wdq"),
                 helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv")]
        last = "c"
        if relu6:
            nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["cc"], name="clip"))
            last = "cc"
        nodes += [helper.make_node("QuantizeLinear", [last, "ys", "yz"], ["yq"], name="yq"),
                  helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="ydq")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", tp, ["N", 2, 4, 4])],
                          [helper.make_tensor_value_info("y", tp, ["N", c, 4, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _feed(dtype=np.float32, n=4):
    return {"x": np.random.default_rng(0).uniform(0, 1, (n, 2, 4, 4)).astype(dtype)}


def gemm_model(k=256, n=64, trans_b=True, opset=18, row_scale=True):
    """x [batch, k] -> Gemm (weight [n, k] with transB=1 as torch Linear exports); output
    channel i scaled by 10^(-2 + 2 i / n) so small channels exist."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if row_scale:
        w *= np.logspace(-2, 0, n).astype(np.float32)[:, None]
    if not trans_b:
        w = np.ascontiguousarray(w.T)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc", transB=int(trans_b))], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.zeros(n, np.float32), "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _check(*argv):
    return subprocess.run([sys.executable, "qdq_tools.py", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True)


# --------------------------------------------------------------------------------------------
# Bias re-quantization (ORT WeightBiasQuantization): judged by its effect
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bias_requant_flagged_where_ort_changes_the_output(dtype, tmp_path):
    # Channel 0: weights x1e-12 (fp32) / 6e-8 (fp16) under a bias of 5: the int32 bias
    # overflows and ORT turns the channel's output 5 into 0.
    ws = [1e-12, 0.01] if dtype == np.float32 else [6e-8, 0.01]
    m = qdq_conv([5.0, 3.0], ws, dtype=dtype)
    path = _save(m, tmp_path / "m.onnx")
    feed = _feed(dtype)
    ref, got = _ort(path, feed, "disable"), _ort(path, feed, "all")
    assert np.abs(ref[:, 0] - got[:, 0]).max() > 4  # ground truth: ORT really changes it
    np.testing.assert_allclose(_ort(path, feed, "all", ["WeightBiasQuantization"]), ref)
    for calib in (None, feed):
        rep = check_model(m, path=path, calib=calib)
        (f,) = [f for f in rep["findings"] if f["kind"] == "bias_requant"]
        assert f["node"] == "conv" and f["details"]["channels_changed"] == [0]
        assert f["details"]["max_change_steps"] > 100
        assert "WeightBiasQuantization" in f["message"] and f["fix"]
    p = _check("check", path, "--calib", _npz(tmp_path / "c.npz", feed))
    assert p.returncode == 1 and "[bias_requant] conv (Conv)" in p.stdout


def _npz(path, feed):
    np.savez(path, **feed)
    return path


def test_bias_over_int32_that_changes_nothing_is_not_flagged(tmp_path):
    """A negative bias over 2^31 steps becomes -2^31 steps: still clipped to 0 by the ReLU6,
    so the output is the same; the ratio alone must not raise an alarm."""
    m = qdq_conv([-5.0, 3.0], [1e-12, 0.01])
    path = _save(m, tmp_path / "m.onnx")
    feed = _feed()
    np.testing.assert_allclose(_ort(path, feed, "all"), _ort(path, feed, "disable"))
    for calib in (None, feed):
        rep = check_model(m, path=path, calib=calib)
        assert rep["ok"], rep["findings"]
        (row,) = rep["bias_requant"]
        assert row["n_over_int32"] == 1 and row["max_change_steps"] <= 1


def test_simulated_bias_is_what_ort_computes():
    b = np.array([5.0, -3.0, 0.25], np.float16)
    eff, q = simulate_bias_requant(b, np.array(0.01, np.float16),
                                             np.array([6e-8, 0.01, 0.02], np.float16))
    # fp16 product underflows to 0: 5/0 = inf -> int32 min (x86: the "integer indefinite"
    # value, for inf, NaN and out-of-range alike); the others are divided in float16 (-3 / 1e-4
    # is not -29995 as in float32 but a float16 neighbour) and dequantized back.
    assert q[0] == -2 ** 31 and q[1] != -29995 and abs(q[1] + 29995) <= 16
    assert abs(eff[1] + 3.0) < 0.01 and abs(eff[2] - 0.25) < 0.01
    assert abs(eff[2] - 0.25) < 0.01


# --------------------------------------------------------------------------------------------
# Bias scale, scales, per-tensor depthwise / dead channels
# --------------------------------------------------------------------------------------------
def test_int32_bias_with_wrong_scale(tmp_path):
    from onnx import helper, numpy_helper

    xs, ws = 0.01, np.array([0.02, 0.03], np.float32)
    inits = [numpy_helper.from_array(np.array(xs, np.float32), "xs"),
             numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(np.ones((2, 2, 1, 1), np.int8), "wq"),
             numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(np.array([100, 200], np.int32), "bq"),
             numpy_helper.from_array((2 * xs * ws).astype(np.float32), "bs")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws"], ["wd"], axis=0),
             helper.make_node("DequantizeLinear", ["bq", "bs"], ["bd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["y"], name="conv")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 2, 4, 4])],
                          [helper.make_tensor_value_info("y", 1, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    rep = check_model(m)
    (f,) = rep["findings"]
    assert f["kind"] == "bias_scale_mismatch" and f["initializer"] == "bs"
    assert f["details"]["ratio_min"] == pytest.approx(2.0)
    ok = numpy_helper.from_array((xs * ws).astype(np.float32), "bs")
    m.graph.initializer[-1].CopyFrom(ok)
    assert check_model(m)["ok"]


def test_nan_inf_zero_negative_and_fp16_subnormal_scales(tmp_path, capsys):
    from onnx import helper, numpy_helper

    inits = [numpy_helper.from_array(np.array([0.1, np.nan, -0.2, 0.0, np.inf], np.float32), "s"),
             numpy_helper.from_array(np.ones((5, 2), np.int8), "w"),
             numpy_helper.from_array(np.array([0.1, 6e-8], np.float16), "s16"),
             numpy_helper.from_array(np.ones((2, 2), np.int8), "w16")]
    nodes = [helper.make_node("DequantizeLinear", ["w", "s"], ["y"], axis=0, name="dq"),
             helper.make_node("DequantizeLinear", ["w16", "s16"], ["y16"], axis=0, name="dq16")]
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", 1, None),
                                           helper.make_tensor_value_info("y16", 10, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    kinds = {f.kind: f for f in check_scales(m)}
    assert set(kinds) == {"scale_nan", "scale_inf", "scale_zero", "scale_negative",
                          "scale_fp16_underflow"}
    assert kinds["scale_negative"].details["indices"] == [2]
    assert kinds["scale_fp16_underflow"].initializer == "s16"
    path = _save(m, tmp_path / "m.onnx")
    p = _check("inspect", path)
    assert "1 nan" in p.stdout and "1 negative" in p.stdout and "-2.000e-01" in p.stdout
    assert _check("check", path).returncode == 1


def depthwise_models(per_channel: bool, x: np.ndarray):
    """Depthwise Conv (32 channels, channel c scaled to max|w| = 10^(-3 + 3c/31)) in float and
    quantized the way ONNX Runtime's quantize_static does it (symmetric int8 weights per tensor
    or per channel, uint8 activations with min/max ranges of ``x``, int32 bias)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 1, 3, 3))
    w = (w / np.abs(w).max(axis=(1, 2, 3), keepdims=True)
         * 10.0 ** (-3 + 3 * np.arange(32) / 31)[:, None, None, None]).astype(np.float32)
    vi = [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 32, 8, 8]),
          helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 32, 8, 8])]
    conv = dict(group=32, pads=[1] * 4, kernel_shape=[3, 3])

    def model(nodes, inits):
        g = helper.make_graph(nodes, "dw", vi[:1], vi[1:], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    fp32 = model([helper.make_node("Conv", ["input", "w"], ["output"], name="/Conv", **conv)],
                 [numpy_helper.from_array(w, "w")])
    y = _ort(fp32, {"input": x})

    def act(a):  # uint8 min/max quantization parameters (ORT's MinMax calibrator)
        lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
        s = (hi - lo) / 255
        return np.float32(s), np.uint8(round(-lo / s))

    ws = (np.abs(w).max(axis=(1, 2, 3)) if per_channel else np.abs(w).max(keepdims=True)) / 127
    ws = ws.astype(np.float32).reshape(-1)
    wq = np.clip(np.rint(w / ws.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
    (xs, xz), (ys, yz) = act(x), act(y)
    inits = [numpy_helper.from_array(v, k) for k, v in (
        ("xs", np.array(xs)), ("xz", np.array(xz)), ("ys", np.array(ys)), ("yz", np.array(yz)),
        ("wq", wq), ("ws", ws if per_channel else ws.reshape(())),
        ("wz", np.zeros(32 if per_channel else (), np.int8)))]
    nodes = [helper.make_node("QuantizeLinear", ["input", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"],
                              **({"axis": 0} if per_channel else {})),
             helper.make_node("Conv", ["xd", "wd"], ["output_QuantizeLinear_Input"], name="/Conv",
                              **conv),
             helper.make_node("QuantizeLinear", ["output_QuantizeLinear_Input", "ys", "yz"],
                              ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["output"])]
    return fp32, model(nodes, inits)


@pytest.fixture(scope="module")
def depthwise_ort(tmp_path_factory):
    """Float and Q/DQ (per tensor ``pt``, per channel ``pc``) depthwise models, saved."""
    d = tmp_path_factory.mktemp("dw")
    x = np.random.default_rng(1).standard_normal((16, 32, 8, 8)).astype(np.float32)
    fp32, pt = depthwise_models(False, x)
    _, pc = depthwise_models(True, x)
    return {"fp32": _save(fp32, d / "fp32.onnx"), "pt": _save(pt, d / "q_pt.onnx"),
            "pc": _save(pc, d / "q_pc.onnx"), "x": x}


def test_per_tensor_depthwise_dead_channels(depthwise_ort):
    import onnx

    d = depthwise_ort
    rep = check_model(onnx.load(str(d["pt"])), fp32_model=onnx.load(str(d["fp32"])))
    kinds = {f["kind"]: f for f in rep["findings"]}
    assert {"per_tensor_grouped", "dead_channels", "weight_error"} <= set(kinds)
    dead = kinds["dead_channels"]["details"]
    assert len(dead["all_zero"]) >= 5 and len(dead["few_levels"]) >= 10
    assert 0 in dead["all_zero"] and 31 not in dead["few_levels"]
    clean = check_model(onnx.load(str(d["pc"])), fp32_model=onnx.load(str(d["fp32"])))
    assert clean["ok"], clean["findings"]


# --------------------------------------------------------------------------------------------
# INT4 blocks (ModelOpt, stage 5b)
# --------------------------------------------------------------------------------------------
def _modelopt_int4(src: Path, dst: Path, method: str, block: int = 128):
    from modelopt.onnx.quantization import quantize

    calib = {"x": np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32)}
    quantize(onnx_path=str(src), quantize_mode="int4", calibration_method=method,
             calibration_data=calib if method == "awq_clip" else None, calibration_eps=["cpu"],
             block_size=block, output_path=str(dst), log_level="ERROR")
    return dst


def test_check_finds_int4_blocks_along_output_channels(tmp_path):
    """ModelOpt rtn_dq on Gemm(transB=1): blocks along N (axis 0 of [N, K]); consistent enough
    for ORT to run, wrong for the small output channels."""
    pytest.importorskip("modelopt.onnx.quantization")
    src = _save(gemm_model(), tmp_path / "fp32.onnx")
    q = _modelopt_int4(src, tmp_path / "q.onnx", "rtn_dq")
    p = _check("check", q, "--fp32", src)
    assert p.returncode == 1
    assert "[block_axis] fc (Gemm)" in p.stdout and "sums over axis 1 (K = 256)" in p.stdout
    assert "[weight_error]" in p.stdout
    assert _check("check", q).returncode == 1  # without the float model too


def test_check_finds_block_size_under_opset_20(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    qw = numpy_helper.from_array(np.ones((256, 64), np.int8), "qw")
    qw.data_type = TensorProto.INT4
    s = numpy_helper.from_array(np.full((2, 64), 0.01, np.float32), "s")
    nodes = [helper.make_node("DequantizeLinear", ["qw", "s"], ["w"], axis=0, block_size=128,
                              name="dq"),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 256])],
                          [helper.make_tensor_value_info("y", 1, ["N", 64])], [qw, s])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    path = _save(m, tmp_path / "m.onnx")
    rep = check_model(m)
    assert [f["kind"] for f in rep["findings"]] == ["block_opset"]
    assert _check("fix-int4-axis", "--check", path).returncode == 1
    assert "opset 20" in _check("inspect", path).stdout
    m.opset_import[0].version = 21
    assert check_model(m)["ok"]
    onnx.save(m, str(path))
    assert _check("fix-int4-axis", "--check", path).returncode == 0


@pytest.mark.parametrize("method", ["rtn_dq", "awq_clip"])
def test_stage5b_blocks_along_k_for_every_weight(method, tmp_path, monkeypatch):
    pytest.importorskip("modelopt.onnx.quantization")
    import onnx

    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    src = _save(gemm_model(), tmp_path / "fp32.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal(
        (16, 256)).astype(np.float32))
    out = tmp_path / "int4.onnx"
    argv = ["--model", "tiny", "--onnx", str(src), "--output", str(out), "--calib",
            str(tmp_path / "calib.npz"), "--no-eval", "--calibration-method", method]
    rec = int4.main(int4.get_args_parser().parse_args(argv))
    assert [r["node"] for r in rec["layout_kn"]] == ["fc"]
    (w,) = rec["weights_verified"]
    assert w["status"] == "ok" and w["rel_err_max"] < 0.5
    assert rec["check"]["ok"] is True
    # Independent of the tool: every output channel's dequantized weights are close to float.
    q = onnx.load(str(out))
    deq = check_against_float(q, onnx.load(str(src)))[1]
    assert deq[0]["rel_err_max"] < 0.5
    x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    ref, y = _ort(src, {"x": x}), _ort(out, {"x": x})
    rel = np.linalg.norm(y - ref, axis=0) / np.linalg.norm(ref, axis=0)
    assert rel.max() < 0.5  # the smallest output channels too
    saved = json.loads((tmp_path / "r" / "tiny" / "quant_int4.json").read_text())
    assert saved["check"]["summary"] == "check: clean"


def test_stage5b_refuses_what_it_cannot_make_right(tmp_path, monkeypatch):
    pytest.importorskip("modelopt.onnx.quantization")
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    src = _save(gemm_model(), tmp_path / "fp32.onnx")
    out = tmp_path / "int4.onnx"
    argv = ["--model", "tiny", "--onnx", str(src), "--output", str(out), "--no-eval",
            "--calibration-method", "rtn_dq", "--keep-layout"]
    with pytest.raises(StageError, match=r"(?s)refused.*block_axis"):
        int4.main(int4.get_args_parser().parse_args(argv))
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


# --------------------------------------------------------------------------------------------
# Calibration data
# --------------------------------------------------------------------------------------------
def two_input_model():
    """a [N, 8] and b [N, 8] -> Add -> y (same shapes: only statistics tell them apart)."""
    from onnx import helper

    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info(n, 1, ["N", 8]) for n in "ab"],
                          [helper.make_tensor_value_info("y", 1, ["N", 8])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_calibration_refuses_wrong_keys_swapped_inputs_nan_and_dtype(tmp_path):
    path = _save(two_input_model(), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    ref = {"a": rng.standard_normal((32, 8)).astype(np.float32),
           "b": (50 + 20 * rng.standard_normal((32, 8))).astype(np.float32)}
    good = {"a": rng.standard_normal((16, 8)).astype(np.float32),
            "b": (50 + 20 * rng.standard_normal((16, 8))).astype(np.float32)}
    rep = validate_calibration(path, good, ref, reference_source="eval")
    assert rep["n_samples"] == 16 and rep["stats_check"].startswith("passed")
    with pytest.raises(StageError, match=r"keys \['a', 'x'\].*inputs are \['a', 'b'\]"):
        validate_calibration(path, {"a": good["a"], "x": good["b"]}, ref)
    with pytest.raises(StageError, match=r"input 'a'.*std ratio"):
        validate_calibration(path, {"a": good["b"], "b": good["a"]}, ref)
    bad = dict(good, a=good["a"].copy())
    bad["a"][3, 1] = np.nan
    with pytest.raises(StageError, match=r"1 NaN.*samples \[3\]"):
        validate_calibration(path, bad, None)
    with pytest.raises(StageError, match="float64 but the model takes float32"):
        validate_calibration(path, dict(good, a=good["a"].astype(np.float64)), None)
    with pytest.raises(StageError, match="different sample counts"):
        validate_calibration(path, dict(good, a=good["a"][:5]), None)


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


def test_unnormalised_pixels_refused_for_a_classifier(tmp_path, monkeypatch):
    """Calibration npz of 0..255 pixels for EfficientNet-Lite0 (eval data normalised to
    [-1, 1]): refused with the numbers; the stage-4 npz passes."""
    items, _ = list_images(DEFAULT_DATA)
    split = {"data_root": str(DEFAULT_DATA.resolve()),
             "eval": [list(i) for i in items[:4]], "calib": [list(i) for i in items[500:503]]}
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    write_json(splits_path(), split)
    onnx_dir = model_artifacts("efficientnet_lite0") / "onnx"
    onnx_dir.mkdir(parents=True)
    from onnx import helper

    g = helper.make_graph([helper.make_node("Relu", ["input"], ["y"])], "g",
                          [helper.make_tensor_value_info("input", 1, ["N", 3, 224, 224])],
                          [helper.make_tensor_value_info("y", 1, None)])
    _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
          onnx_dir / "fp32.onnx")
    rec = make_calib.main(make_calib.get_args_parser().parse_args(["--model",
                                                                   "efficientnet_lite0"]))
    assert rec["stats_check"].startswith("passed") and rec["order_seed"] == 0
    spec = model_spec("efficientnet_lite0")
    x_u8, _, _ = load_split("calib", spec)
    np.savez(tmp_path / "raw.npz", input=x_u8.astype(np.float32))
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"))
    p = subprocess.run([sys.executable, "qdq_tools.py", "check-calib", str(onnx_dir / "fp32.onnx"),
                        "--calib", str(tmp_path / "raw.npz"), "--model", "efficientnet_lite0"],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.returncode == 1 and "std ratio" in p.stderr and "unnormalised" in p.stderr
    p = subprocess.run([sys.executable, "qdq_tools.py", "check-calib", str(onnx_dir / "fp32.onnx"),
                        "--calib", str(model_artifacts("efficientnet_lite0") / "calib.npz"),
                        "--model", "efficientnet_lite0", "--json", str(tmp_path / "c.json")],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "3"  # the calibration batch: all 3 samples at once
    rec = json.loads((tmp_path / "c.json").read_text())
    assert rec["order_seed"] == 0 and rec["plan"]["batches"] == [3]


def test_calibration_plan_batches():
    path = None
    from onnx import helper

    def model(batch):
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [batch, 4])],
                              [helper.make_tensor_value_info("y", 1, [batch, 4])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = {"x": np.zeros((10, 4), np.float32)}
        path = _save(model("N"), Path(d) / "dyn.onnx")
        plan = calibration_plan(path, data)
        assert plan["batches"] == [10] and not plan["order_dependent"]
        assert plan["calibration_shapes"] == "x:10x4"
        plan = calibration_plan(path, data, 4)
        assert plan["batches"] == [5, 5] and plan["order_dependent"]
        static = _save(model(1), Path(d) / "static.onnx")
        plan = calibration_plan(static, data)
        assert plan["batch_size"] == 1 and len(plan["batches"]) == 10
        with pytest.raises(StageError, match="static batch of 4"):
            validate_calibration(_save(model(4), Path(d) / "s4.onnx"), data)


def test_default_calibration_batch_makes_entropy_independent_of_order(tmp_path):
    """ModelOpt entropy calibration through stage 5's driver: two sample orders give different
    scales at batch 1 (ModelOpt's CLI default for a dynamic batch) and identical ones with the
    default (one batch); the nodes ModelOpt quantizes do not depend on the batch (its GEMV rule
    still sees batch 1: the classifier Gemm stays float, as with ModelOpt's CLI)."""
    pytest.importorskip("modelopt.onnx.quantization")
    import onnx
    import torch
    from onnx import numpy_helper

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(32, 32)).eval()
    src = tmp_path / "fp32.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 8, 8),), str(src), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    x = np.random.default_rng(0).standard_normal((64, 3, 8, 8)).astype(np.float32)
    x[np.arange(0, 64, 7)] *= 4  # a few wide samples: where they fall decides the histogram

    def quantize(xi, batch):
        np.savez(tmp_path / "c.npz", x=xi)
        out = tmp_path / "q.onnx"
        modelopt_quantize(
            ["--onnx_path", str(src), "--quantize_mode", "int8", "--high_precision_dtype",
             "fp32", "--calibration_data_path", str(tmp_path / "c.npz"), "--calibration_eps",
             "cpu", "--output_path", str(out), "--log_level", "ERROR"], batch)
        q = onnx.load(str(out))
        c = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
        acts = [float(c[n.input[1]]) for n in q.graph.node
                if n.op_type == "QuantizeLinear" and n.input[0] not in c]
        return acts, inspect_model(q)["quantized_nodes_by_op"]

    orders = [x, x[np.random.default_rng(1).permutation(64)]]
    (a0, nodes0), (a1, _) = (quantize(o, "all") for o in orders)
    assert a0 and a0 == a1
    (b0, nodes1), (b1, _) = (quantize(o, 1) for o in orders)
    assert b0 != b1
    assert nodes0 == nodes1 and "Gemm" not in nodes0 and nodes0.get("Conv") == 2


# --------------------------------------------------------------------------------------------
# Custom models through stages 4 and 5
# --------------------------------------------------------------------------------------------
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
    assert p.returncode == 2 and "--inputs NPZ" in p.stderr
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
    assert p.returncode == 1 and "input 'image'" in p.stderr and "std ratio" in p.stderr
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


# --------------------------------------------------------------------------------------------
# Quantization error vs backend error
# --------------------------------------------------------------------------------------------
def test_table_separates_backend_error_from_quantization_error(tmp_path):
    q = _save(qdq_conv([5.0, 3.0], [1e-12, 0.01]), tmp_path / "q.onnx")
    f = _save(qdq_conv([5.0, 3.0], [1e-12, 0.01], float_model=True), tmp_path / "f.onnx")
    res = quant_backend_table(f, q, _feed(), out_dir=tmp_path / "t")
    rows = {r["node"]: r for r in res["layers"]}
    assert rows["conv"]["verdict"] == "backend" and rows["conv"]["quant"]["status"] == "pass"
    assert rows["clip"]["backend"]["steps_max"] > 100 and rows["clip"]["quant"]["steps_max"] <= 1
    assert res["first_backend"]["node"] == "conv" and res["first_quant"] is None
    assert "backend error" in res["verdict"]
    md = (tmp_path / "t" / "quant_backend.md").read_text()
    assert "| `conv` | Conv |" in md and "steps" in md
    # Without the optimizer the backend reproduces the graph.
    ok = quant_backend_table(f, q, _feed(),
                                       disabled_optimizers=["WeightBiasQuantization"])
    assert ok["first_backend"] is None
    # The stage-3 style cross-check on a model without labels sees the same.
    import onnxruntime as ort

    y = ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]).run(None, _feed())[0]
    cc = backend_cross_check(q, EvalData(feed=_feed()), {"y": y})
    assert cc["disagreement"] and "cosine" in cc["reason"]


def _qdq_classifier(w_scale, path):
    """x [N,3,4,4] -> Q/DQ -> Conv 1x1 (2 classes, int8 weights, per-channel ``w_scale``,
    bias [5, 3]) -> Clip(0, 6) -> Q/DQ -> ReduceMean over H, W -> logits [N, 2]."""
    from onnx import helper, numpy_helper

    ws = np.asarray(w_scale, np.float32)
    inits = [numpy_helper.from_array(x, n) for x, n in (
        (np.array([5.0, 3.0], np.float32), "b"), (np.array(0, np.float32), "lo"),
        (np.array(6, np.float32), "hi"), (np.array(0.01, np.float32), "xs"),
        (np.array(128, np.uint8), "xz"), (np.full((2, 3, 1, 1), 10, np.int8), "wq"), (ws, "ws"),
        (np.zeros(2, np.int8), "wz"), (np.array(6 / 255, np.float32), "ys"),
        (np.array(0, np.uint8), "yz"), (np.array([2, 3], np.int64), "axes"))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="xdq"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0, name="wdq"),
             helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv"),
             helper.make_node("Clip", ["c", "lo", "hi"], ["cc"], name="clip"),
             helper.make_node("QuantizeLinear", ["cc", "ys", "yz"], ["yq"], name="yq"),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="ydq"),
             helper.make_node("ReduceMean", ["y", "axes"], ["logits"], keepdims=0, name="gap")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 3, 4, 4])],
                          [helper.make_tensor_value_info("logits", 1, ["N", 2])], inits)
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9),
                 path)


@pytest.mark.parametrize("broken", [True, False])
def test_adaptive_cross_check_escalates_exactly_when_the_backend_differs(broken, tmp_path):
    """Classifier cross-check (stage 3's): a backend disagreement (WeightBiasQuantization on a
    tiny weight channel under a large bias) is seen on the first 128 samples, beyond doubt
    there (no rerun of the rest), and measured on all 200 when asked for exactly 200; a model
    the backend runs faithfully stops after 128."""
    q = _qdq_classifier([1e-12, 0.01] if broken else [0.01, 0.01], tmp_path / "q.onnx")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (200, 3, 4, 4), dtype=np.uint8)
    data = EvalData(x_u8=x, y=np.zeros(200, np.int64), files=[str(i) for i in range(200)],
                             mean=(0.5,) * 3, std=(0.5,) * 3, input_name="x")
    with OrtRunner(q, opt_level="disable") as r:  # labels: the graph's own answer
        data.y = run_outputs(r, data, 64)["logits"].argmax(1)
    with OrtRunner(q) as r:
        main = run_outputs(r, data, 64)
    cc = backend_cross_check(q, data, main, batch=64)
    assert cc["adaptive"] and cc["disagreement"] is broken
    assert cc["n"] == CROSS_CHECK_FIRST and cc["decided_on_first_look"] is broken
    if broken:
        assert cc["top1_unoptimized"] == 100.0 and cc["top1_main"] < 90
        assert "128 of 200 images, decided on the first look" in cc["reason"]
        exact = backend_cross_check(q, data, main, n=200, batch=64)
        assert exact["n"] == 200 and not exact["adaptive"] and exact["disagreement"]
        assert "(200 images)" in exact["reason"]


def test_first_look_verdict_decides_only_beyond_doubt():
    """The paired top-1 difference must clear the tolerance by 4 standard errors."""
    n = 128
    right = np.ones(n, bool)
    collapsed = np.zeros(n, bool)
    assert first_look_verdict(collapsed, right, 2.0) is True  # 100 points apart, se 0
    # same answers (the runs differ only in cosine): agreement, no rerun needed
    assert first_look_verdict(right, right, 2.0) is False
    one_flip = right.copy()
    one_flip[0] = False
    assert first_look_verdict(one_flip, right, 2.0) is None  # 0.8 + 4 * 0.8 > 2: rerun
    assert first_look_verdict(one_flip, right, 5.0) is False  # within 5 points beyond doubt
    some = right.copy()
    some[:6] = False  # 4.7 points, se 1.9: 4.7 - 7.5 < 2 < 4.7 + 7.5
    assert first_look_verdict(some, right, 2.0) is None
    assert first_look_verdict(np.zeros(0, bool), np.zeros(0, bool), 2.0) is None


def test_table_names_quantization_error(depthwise_ort):
    d = depthwise_ort
    res = quant_backend_table(d["fp32"], d["pt"], {"input": d["x"][:4]})
    assert res["first_backend"] is None
    (lost,) = res["channels_lost"]  # the small channels the per-tensor weights zeroed
    assert len(lost["channels"]) >= 5 and 0 in lost["channels"] and 31 not in lost["channels"]
    assert "loses" in res["verdict"]
    # The per-channel file loses them too, at its per-tensor output quantization (ORT's
    # quantizer puts a Q/DQ on the graph output): the table shows it, the weight check does not
    # blame the weights (test_per_tensor_depthwise_dead_channels).
    pc = quant_backend_table(d["fp32"], d["pc"], {"input": d["x"][:4]})
    assert pc["first_backend"] is None and 0 in pc["channels_lost"][0]["channels"]
