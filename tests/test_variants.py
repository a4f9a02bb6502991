"""deploykit.variants: int8_auto only on request."""

from __future__ import annotations

from deploykit.variants import for_stage, modelopt_args


def test_int8_auto_only_on_request():
    names = lambda *a: [v.name for v in for_stage(*a)]  # noqa: E731
    for stage in (5, 6, 7):
        assert "int8_auto" not in names(stage) and "int8_auto" not in names(stage, True)
        assert "int8_auto" in names(stage, False, True)
    assert modelopt_args("int8_auto", "c.npz", "cpu", auto=["^a$"])[:8] == [
        "--quantize_mode", "int8", "--op_types_to_quantize", "Conv", "Gemm",
        "--nodes_to_exclude", "^a$", "--high_precision_dtype"]
    assert "--nodes_to_exclude" not in modelopt_args("int8_auto", "c.npz", "cpu")
