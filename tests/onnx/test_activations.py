"""deploykit.onnx.activations: capture of intermediates on a backend that is missing (TensorRT)."""

from __future__ import annotations

import pytest

from deploykit.layerwise.diff import run_layer_diff
from deploykit.onnx.activations import trt_available


torch = pytest.importorskip("torch")
nn = torch.nn


def test_trt_skips_cleanly_without_tensorrt(token_model, tmp_path):
    ok, _ = trt_available()
    if ok:
        pytest.skip("tensorrt is installed here")
    _, path, feed = token_model
    res = run_layer_diff(path, path, feed, b_engine=tmp_path / "x.plan",
                                   out_dir=tmp_path)
    assert res["status"] == "skipped" and "TensorRT" in res["reason"]
    assert "Skipped" in (tmp_path / "layerwise.md").read_text()
