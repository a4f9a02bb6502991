"""deploykit.results: result rows written beside a good one, rewriting an earlier row."""

from __future__ import annotations

import json

from deploykit.results import result_record, write_result


MODEL = "efficientnet_lite0"


def test_write_result_skipped_over_ok_goes_beside(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path))
    ok = result_record("7_trt_eval", "TensorRT", "FP16", MODEL, "trt_fp16")
    write_result(MODEL, "trt_fp16", ok)
    skipped = dict(ok, status="skipped", reason="no TensorRT on this machine")
    path = write_result(MODEL, "trt_fp16", skipped)
    assert path.name == "trt_fp16.skipped.json"
    assert json.loads((tmp_path / MODEL / "trt_fp16.json").read_text())["status"] == "ok"
    failed = dict(ok, status="failed", reason="x")
    write_result(MODEL, "trt_int8", failed)  # no good row: written under its own name
    assert json.loads((tmp_path / MODEL / "trt_int8.json").read_text())["status"] == "failed"
    # a failure that already replaced the artifact the good row described replaces the row
    write_result(MODEL, "trt_fp16", failed, keep_good=False)
    assert json.loads((tmp_path / MODEL / "trt_fp16.json").read_text())["status"] == "failed"
    assert not (tmp_path / MODEL / "trt_fp16.skipped.json").exists()


def test_a_tag_naming_an_earlier_row_is_still_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    rec = result_record("3_onnx_eval", "ORT", "FP32", MODEL, "ort_x")
    write_result(MODEL, "ort_x", rec)
    rec["reason"] = "second"
    path = write_result(MODEL, "ort_x", rec)
    assert json.loads(path.read_text())["reason"] == "second"


def test_an_onnx_exported_from_other_weights_than_the_reference_is_named(tmp_path, monkeypatch):
    """Stage 1 rerun with new weights: the old fp32.onnx failed stage 3 (cosine 0.93) and the
    report said rerun stage 3; the cause, and the fix (stage 2), are named now."""
    import torch

    from deploykit.io import write_json
    from deploykit.results import weights_mismatch, weights_sha256

    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))  # 0-d buffer
    a = weights_sha256(net)
    with torch.no_grad():
        net[0].weight[0, 0] += 1.0
    b = weights_sha256(net)
    assert a != b and weights_sha256(net) == b
    folder = tmp_path / "r" / "m"
    ref = tmp_path / "a" / "m" / "ref_logits.npz"
    write_json(folder / "export.json", {"stage": "2_export_onnx", "weights_sha256": a})
    write_json(folder / "pytorch_fp32_cpu.json", {"stage": "1_pytorch_baseline", "tag":
                                                  "pytorch_fp32_cpu", "reference": str(ref),
                                                  "weights_sha256": b})
    msg = weights_mismatch("m", ref)
    assert msg.startswith(f"fp32.onnx was exported (stage 2, export.json: weights {a[:12]}) "
                          f"from other weights than the PyTorch reference ref_logits.npz")
    assert "rerun 2_export_onnx.py" in msg
    write_json(folder / "export.json", {"stage": "2_export_onnx", "weights_sha256": b})
    assert weights_mismatch("m", ref) is None
    assert weights_mismatch("m", tmp_path / "other.npz") is None  # no row wrote that reference
