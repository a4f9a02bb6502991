"""deploykit.install: installing a checked file, keeping a rejected one, setting a stale one
aside, and reading why a file was rejected."""
from __future__ import annotations

from deploykit.checks.base import check_result
from deploykit.install import (
    install,
    install_rejected,
    rejected_reason,
    set_aside,
    stale_path,
)


def test_set_aside_moves_the_earlier_file_and_install_drops_it(tmp_path):
    final = tmp_path / "fp16.onnx"
    assert set_aside(final) is None  # nothing there: nothing moved
    final.write_bytes(b"old")
    assert set_aside(final) == stale_path(final) == tmp_path / "fp16.stale.onnx"
    assert not final.exists() and stale_path(final).read_bytes() == b"old"
    cand = tmp_path / "cand.onnx"
    cand.write_bytes(b"new")
    install(cand, final)
    assert final.read_bytes() == b"new" and not stale_path(final).exists()


def test_rejected_reason_names_the_fp16_finding_before_batch_parity(tmp_path):
    final = tmp_path / "fp16.onnx"
    assert rejected_reason(final) is None
    cand = tmp_path / "cand.onnx"
    cand.write_bytes(b"x")
    rows = [check_result("batch_parity", "fail", "ORT CPU EP (computes this FP16 graph in FP32 "
                         "through inserted Casts, blind to FP16 overflow): batch 4: differs"),
            check_result("fp16_range", "fail", "tensor t reaches max |x| 1e5 > 65504",
                         node="conv")]
    install_rejected(cand, final, rows)
    why = rejected_reason(final)
    assert why.startswith("fp16.onnx was rejected") and "fp16_range at conv" in why
    assert "fp16.rejected.json" in why and not final.exists()


def test_install_rejected_without_a_candidate_file_keeps_the_reason(tmp_path):
    final = tmp_path / "fp16.onnx"
    install_rejected(tmp_path / "never_written.onnx", final,
                     [check_result("fp16_convert", "fail", "converter failed")])
    assert not (tmp_path / "fp16.rejected.onnx").exists()
    assert "fp16_convert" in rejected_reason(final)
