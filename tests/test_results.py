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
