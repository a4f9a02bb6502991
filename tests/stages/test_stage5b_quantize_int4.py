"""Stage 5b (5b_quantize_int4.py): K dimensions, block sizes, blocks along K, refusals and the
end-to-end record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploykit.errors import StageError, UsageError
from deploykit.onnx.graph import attr
from deploykit.quant.health import check_against_float

from tests.helpers.auto_models import _save
from tests.helpers.qdq_models import _ort, scaled_gemm_model
from tests.helpers.quant_models import _ort_run, gemm_model, matmul_model
from tests.helpers.stages import load_stage


int4 = load_stage("5b_quantize_int4")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn_dq", "awq_clip"])
def test_stage5b_blocks_along_k_for_every_weight(method, tmp_path, monkeypatch):
    pytest.importorskip("modelopt.onnx.quantization")
    import onnx

    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    src = _save(scaled_gemm_model(), tmp_path / "fp32.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal(
        (16, 256)).astype(np.float32))
    out = tmp_path / "int4.onnx"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "int4.quant.log").symlink_to(victim)  # ModelOpt opens its log by name
    argv = ["--model", "tiny", "--onnx", str(src), "--output", str(out), "--calib",
            str(tmp_path / "calib.npz"), "--no-eval", "--calibration-method", method]
    rec = int4.main(int4.get_args_parser().parse_args(argv))
    assert victim.read_text() == "precious" and not (tmp_path / "int4.quant.log").is_symlink()
    assert (tmp_path / "int4.quant.log").stat().st_size > 0
    assert not list(tmp_path.glob(".tmp-*"))
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
    # the record links the INT4 file to the fp32.onnx and the calibration bytes it came from
    from deploykit.io import sha256_file
    src_block = saved["source"]
    assert src_block["fp32"]["sha256"] == sha256_file(src)
    assert src_block["output"]["sha256"] == sha256_file(out)
    assert (src_block["calibration"] or {}).get("sha256") == (
        sha256_file(tmp_path / "calib.npz") if method == "awq_clip" else None)


@pytest.mark.slow
def test_stage5b_refuses_what_it_cannot_make_right(tmp_path, monkeypatch):
    pytest.importorskip("modelopt.onnx.quantization")
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    src = _save(scaled_gemm_model(), tmp_path / "fp32.onnx")
    out = tmp_path / "int4.onnx"
    argv = ["--model", "tiny", "--onnx", str(src), "--output", str(out), "--no-eval",
            "--calibration-method", "rtn_dq", "--keep-layout"]
    with pytest.raises(StageError, match=r"(?s)refused.*block_axis"):
        int4.main(int4.get_args_parser().parse_args(argv))
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


# --------------------------------------------------------------------------------------------
# Block size choice
# --------------------------------------------------------------------------------------------
def test_k_dims_follow_trans_b_and_matmul_layout():
    assert [d["k"] for d in int4.quantized_k_dims(gemm_model(576, 1024))] == [576]
    assert [d["k"] for d in int4.quantized_k_dims(gemm_model(576, 1024, trans_b=False))] == [576]
    assert [d["k"] for d in int4.quantized_k_dims(matmul_model(256, 64))] == [256]


def test_block_size_divides_every_k_override_and_error():
    assert int4.choose_block_size([576, 1024]) == 64  # MobileNetV3-Small classifier
    assert int4.choose_block_size([1280]) == 128  # EfficientNet-Lite0 classifier
    assert int4.choose_block_size([576, 1024], override=32) == 32
    assert int4.choose_block_size([576], candidates=(96, 64)) == 96
    with pytest.raises(UsageError, match=r"does not divide K = \[576\]"):
        int4.choose_block_size([576, 1024], override=128)
    with pytest.raises(StageError, match="no block size"):
        int4.choose_block_size([7 * 13, 1024])
    with pytest.raises(StageError, match="nothing to quantize"):
        int4.choose_block_size([])


@pytest.mark.slow
def test_stage5b_end_to_end_block_override_repair_and_record(tmp_path, monkeypatch):
    pytest.importorskip("modelopt.onnx.quantization")
    import onnx

    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    src = _save(gemm_model(576, 64), tmp_path / "fp32.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal(
        (8, 576)).astype(np.float32))
    out = tmp_path / "int4.onnx"
    src_mtime = src.stat().st_mtime_ns
    args = int4.get_args_parser().parse_args(
        ["--model", "tiny", "--onnx", str(src), "--output", str(out), "--calib",
         str(tmp_path / "calib.npz"), "--block-size", "32", "--no-eval"])
    rec = int4.main(args)
    assert rec["block_size"] == 32 and rec["block_size_source"] == "override"
    q = onnx.load(str(out))
    dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert [attr(n, "block_size") for n in dq] == [32]
    # The Gemm weight went to ModelOpt as [K, N] (transB=0): blocks along K, nothing to repair.
    assert [r["node"] for r in rec["layout_kn"]] == ["fc"] and rec["repaired"] == []
    assert [attr(n, "axis") for n in dq] == [0]
    assert rec["weights_verified"][0]["status"] == "ok"
    assert all(r["status"] == "ok" for r in rec["blocked_dq_after"])
    saved = json.loads((tmp_path / "results" / "tiny" / "quant_int4.json").read_text())
    assert saved["block_size"] == 32 and saved["provenance"]["command"]
    _ort_run(out, {"x": np.ones((2, 576), np.float32)})
    assert src.stat().st_mtime_ns == src_mtime  # ModelOpt got a copy, not the source
