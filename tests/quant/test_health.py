"""deploykit.quant.health (the Q/DQ check): bias requantization, scales, dead channels, INT4 blocks,
the comparison against the float model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from deploykit.quant.health import check_model, check_scales

from tests.helpers.stages import ROOT, load_stage
from tests.helpers.auto_models import _save
from tests.helpers.qdq_models import _feed, _ort, qdq_conv, scaled_gemm_model
from tests.helpers.verdict_models import _ort_model, _tool


int4 = load_stage("5b_quantize_int4")


def _check(*argv):
    return subprocess.run([sys.executable, "qdq_tools.py", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True)


# --------------------------------------------------------------------------------------------
# Bias re-quantization (ORT WeightBiasQuantization): judged by its effect
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
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


@pytest.mark.slow
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


def test_inspect_shows_the_checks_findings(depthwise_ort, tmp_path):
    """qdq_tools.py inspect also runs the static health check: the per-tensor depthwise file
    shows its dead channels with the fix (inspect alone said nothing of them) and the command
    that lists every finding; the per-channel file shows none; --json records the kinds."""
    d = depthwise_ort
    p = _check("inspect", d["pt"], "--json", tmp_path / "pt.json")
    assert p.returncode == 0, p.stderr
    assert "[dead_channels]" in p.stdout and "[per_tensor_grouped]" in p.stdout
    assert "fix: give each output channel its own scale" in p.stdout
    line = next(ln for ln in p.stdout.splitlines() if "every finding:" in ln)
    assert line.split("every finding: ")[1].startswith("cd ")  # pastes from any folder
    assert f"qdq_tools.py check {d['pt']}" in line and "(all in the JSON" not in p.stdout
    import json

    rec = json.loads((tmp_path / "pt.json").read_text())["check"]
    assert rec["n_findings"] >= 2 and {"dead_channels", "per_tensor_grouped"} <= set(rec["kinds"])
    clean = _check("inspect", d["pc"])
    assert clean.returncode == 0 and "[dead_channels]" not in clean.stdout
    assert "every finding" not in clean.stdout


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


@pytest.mark.slow
def test_check_finds_int4_blocks_along_output_channels(tmp_path):
    """ModelOpt rtn_dq on Gemm(transB=1): blocks along N (axis 0 of [N, K]); consistent enough
    for ORT to run, wrong for the small output channels."""
    pytest.importorskip("modelopt.onnx.quantization")
    src = _save(scaled_gemm_model(), tmp_path / "fp32.onnx")
    q = _modelopt_int4(src, tmp_path / "q.onnx", "rtn_dq")
    p = _check("check", q, "--fp32", src)
    assert p.returncode == 1
    assert "[block_axis] fc (Gemm)" in p.stdout and "sums over axis 1 (K = 256)" in p.stdout
    assert "[weight_error]" in p.stdout
    assert _check("check", q).returncode == 1  # without the float model too


@pytest.mark.slow
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


# --------------------------------------------------------------------------------------------
# Bias re-quantization reached through ORT's MatMulAddFusion
# --------------------------------------------------------------------------------------------
def matmul_add_qdq(x_shape, bias_shape=(4,)):
    """x -> Q/DQ (uint8) -> MatMul(DQ(int8 W [8, 4], per-tensor scale 1e-12)) -> Add(bias
    5, .1, .2, .3) -> Relu -> Q/DQ: a Dense layer as tf2onnx and others write it (no Gemm)."""
    inits = [numpy_helper.from_array(np.array(0.01, np.float32), "xs"),
             numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(np.full((8, 4), 10, np.int8), "wq"),
             numpy_helper.from_array(np.array(1e-12, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(np.array([5.0, 0.1, 0.2, 0.3], np.float32)
                                     .reshape(bias_shape), "b"),
             numpy_helper.from_array(np.array(6 / 255, np.float32), "ys"),
             numpy_helper.from_array(np.array(0, np.uint8), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="xdq"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="wdq"),
             helper.make_node("MatMul", ["xd", "wd"], ["mm"], name="dense/MatMul"),
             helper.make_node("Add", ["mm", "b"], ["pre"], name="dense/BiasAdd"),
             helper.make_node("Relu", ["pre"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["yq"], name="yq"),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="ydq")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, list(x_shape))],
                          [helper.make_tensor_value_info("y", 1, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


@pytest.mark.slow
def test_bias_requant_through_matmul_add_fusion(tmp_path):
    """ORT's MatMulAddFusion (level basic) turns MatMul + Add on a rank-2 input into a Gemm,
    which WeightBiasQuantization then re-quantizes: the bias of 5 becomes 0. The check must see
    the fused Gemm; on a rank-3 input (no fusion: the output would need a Reshape) ORT leaves
    the graph alone and nothing is flagged."""
    m = matmul_add_qdq(["N", 8])
    feed = {"x": np.random.default_rng(0).uniform(0, 1, (4, 8)).astype(np.float32)}
    ref, got = _ort_model(m, feed, "disable"), _ort_model(m, feed, "all")
    assert np.abs(ref[:, 0] - got[:, 0]).min() > 4  # ground truth: ORT changes the output
    np.testing.assert_allclose(_ort_model(m, feed, "all", ["MatMulAddFusion"]), ref)
    np.testing.assert_allclose(_ort_model(m, feed, "all", ["WeightBiasQuantization"]), ref)
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    for calib in (None, feed):
        rep = check_model(m, path=path, calib=calib)
        (f,) = [f for f in rep["findings"] if f["kind"] == "bias_requant"]
        assert f["node"] == "dense/MatMul" and f["details"]["channels_changed"] == [0, 1, 2, 3]
        assert "MatMulAddFusion" in f["message"] and "dense/BiasAdd" in f["message"]
    p = _tool("qdq_tools.py", "check", path)
    assert p.returncode == 1 and "[bias_requant] dense/MatMul" in p.stdout, p.stdout

    m3 = matmul_add_qdq(["N", 3, 8])
    feed3 = {"x": np.random.default_rng(0).uniform(0, 1, (4, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(_ort_model(m3, feed3, "all"), _ort_model(m3, feed3, "disable"))
    assert not [f for f in check_model(m3)["findings"] if f["kind"] == "bias_requant"]
    # a [1, N] bias is fused too, but WeightBiasQuantization takes 1-D biases only
    m2 = matmul_add_qdq(["N", 8], (1, 4))
    np.testing.assert_allclose(_ort_model(m2, feed, "all"), _ort_model(m2, feed, "disable"))
    assert not [f for f in check_model(m2)["findings"] if f["kind"] == "bias_requant"]


def test_negative_scale_message_says_what_it_does():
    """A negative scale in a QuantizeLinear -> DequantizeLinear pair does not "flip the sign of
    every value" (the old message): an int8 pair gives the same values back, a uint8 pair with
    zero point 0 clips every positive value to 0 (ground truth: ORT); TensorRT wants strictly
    positive scales (NvInfer.h, IQuantizeLayer)."""
    def pair(zp_dtype):
        g = helper.make_graph(
            [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq")], "g",
            [helper.make_tensor_value_info("x", 1, [4])],
            [helper.make_tensor_value_info("y", 1, [4])],
            [numpy_helper.from_array(np.array(-0.1, np.float32), "s"),
             numpy_helper.from_array(np.array(0, zp_dtype), "z")])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)

    x = {"x": np.array([0.3, 1.0, 2.0, 5.0], np.float32)}
    np.testing.assert_allclose(_ort_model(pair(np.int8), x), x["x"], atol=1e-6)
    np.testing.assert_allclose(_ort_model(pair(np.uint8), x), 0)
    (f,) = [f for f in check_scales(pair(np.uint8)) if f.kind == "scale_negative"]
    assert "mirrors its clipping range" in f.fix and "TensorRT" in f.fix, f.fix


@pytest.mark.slow
def test_fp32_comparison_says_what_it_compared(tmp_path):
    """A Q/DQ file whose nodes were renamed by its quantizer: ``check --fp32`` matched no node,
    compared nothing and still printed "compared with the float weights". The float weight is
    now also found by the name of the weight it quantizes, and the line says how many were
    compared."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    f = helper.make_graph([helper.make_node("Gemm", ["x", "W"], ["y"], name="fc", transB=1)],
                          "g", [helper.make_tensor_value_info("x", 1, ["N", 8])],
                          [helper.make_tensor_value_info("y", 1, ["N", 4])],
                          [numpy_helper.from_array(w, "W")])
    fp32 = helper.make_model(f, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    s = (np.abs(w).max(1) / 127).astype(np.float32)
    s[1] *= 40  # a wrong scale for output channel 1
    q = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["W", "s", "z"], ["wq"], axis=0, name="wq"),
         helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], axis=0, name="wdq"),
         helper.make_node("Gemm", ["x", "wd"], ["y"], name="fc_quant", transB=1)], "g",
        [helper.make_tensor_value_info("x", 1, ["N", 8])],
        [helper.make_tensor_value_info("y", 1, ["N", 4])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(s, "s"),
         numpy_helper.from_array(np.zeros(4, np.int8), "z")])
    qm = helper.make_model(q, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    rep = check_model(qm, fp32_model=fp32)
    assert rep["checked"]["n_compared"] == 1
    (row,) = rep["weights_vs_float"]
    assert row["status"] == "fail" and row["n_channels_over"] == 1, row  # channel 1's scale
    assert "weight_error" in rep["kinds"]
    # stored integers with a renamed weight: nothing to compare with, and the line says so
    qp, fp = tmp_path / "q.onnx", tmp_path / "f.onnx"
    onnx.save(qm, str(qp))
    f.node[0].name = "other"
    f.initializer[0].name = "W_float"
    f.node[0].input[1] = "W_float"
    onnx.save(helper.make_model(f, opset_imports=[helper.make_opsetid("", 19)], ir_version=9),
              str(fp))
    p = _tool("qdq_tools.py", "check", qp, "--fp32", fp)
    assert "0 of 1 quantized weights compared with the float weights" in p.stdout, p.stdout


@pytest.mark.parametrize("bias_scale, flagged", [([0.0, 0.0003], False), ([0.0, 0.0006], True)])
def test_a_pruned_channel_with_zero_scales_is_no_bias_scale_mismatch(bias_scale, flagged):
    """A channel whose weight scale is 0 (pruned) and whose bias scale is 0 too matches
    x_scale x w_scale = 0: no 'ratio nan' finding; a real x2 on the other channel still is."""
    from deploykit.quant.bias import check_bias_scales

    inits = [numpy_helper.from_array(np.array(0.01, np.float32), "xs"),
             numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(np.zeros((2, 1, 1, 1), np.int8), "wq"),
             numpy_helper.from_array(np.array([0.0, 0.03], np.float32), "ws"),
             numpy_helper.from_array(np.zeros(2, np.int8), "wz"),
             numpy_helper.from_array(np.array([0, 5], np.int32), "bq"),
             numpy_helper.from_array(np.array(bias_scale, np.float32), "bs")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("DequantizeLinear", ["bq", "bs"], ["bd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["y"], name="conv")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 1, 4, 4])],
                          [helper.make_tensor_value_info("y", 1, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    found = check_bias_scales(m)
    assert bool(found) == flagged, found
    if flagged:
        assert found[0].details["n_channels"] == 1
