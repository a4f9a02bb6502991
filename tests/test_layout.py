"""deploykit.layout: unsafe tags are refused."""

from __future__ import annotations

import pytest

from deploykit.errors import UsageError
from deploykit.layout import safe_name
from deploykit.results import write_result


def test_unsafe_tag_is_refused_and_nothing_is_written_outside(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    for bad in ("../../x", "a/b", "..", ".hidden", "", "x y"):
        with pytest.raises(UsageError, match="not a plain name"):
            write_result("efficientnet_lite0", bad, {"status": "ok"})
    assert not list(tmp_path.rglob("*.json"))
    assert safe_name("ort_int8_hp32") == "ort_int8_hp32"


def test_a_tag_may_not_replace_another_stages_row(tmp_path, monkeypatch):
    """``3_onnx_eval.py --tag pytorch_fp32_cpu`` replaced the PyTorch reference row."""
    from deploykit.layout import check_row_tag
    from deploykit.results import result_record, write_result

    monkeypatch.setenv("RESULTS", str(tmp_path))
    write_result("m", "pytorch_fp32_cpu",
                 result_record("1_pytorch_baseline", "PyTorch", "FP32", "m", "pytorch_fp32_cpu"))
    with pytest.raises(UsageError) as e:
        check_row_tag("m", "pytorch_fp32_cpu", stage="3_onnx_eval")
    msg = str(e.value)
    assert str(tmp_path / "m" / "pytorch_fp32_cpu.json") in msg
    assert "written by stage 1_pytorch_baseline (PyTorch FP32)" in msg
    assert "choose another tag (e.g. pytorch_fp32_cpu_onnx_eval)" in msg
    assert check_row_tag("m", "pytorch_fp32_cpu", stage="1_pytorch_baseline")
    assert check_row_tag("m", "pytorch_fp32_cpu")  # no stage given: the old rule
    assert check_row_tag("m", "new_tag", stage="3_onnx_eval")
