"""deploykit.layerwise.report: the layer-wise plots."""

from __future__ import annotations

import json

import numpy as np

from deploykit.layerwise.report import plot_rows, plot_similarity


def test_layerwise_plot_keeps_non_finite_layers(tmp_path):
    """A NaN layer used to be a gap in the plot, so the first divergent layer had no point."""
    layers = [{"index": i, "node": f"n{i}", "status": "pass", "cosine_min": 0.9999,
               "shape_only": False} for i in range(5)]
    layers[3] = {"index": 3, "node": "n3", "status": "fail", "cosine_min": float("nan"),
                 "shape_only": False}
    res = {"layers": layers, "tolerances": {"min_cosine": 0.98},
           "first_divergent": {"index": 3, "node": "n3"},
           "a": {"backend": "ORT", "onnx": "a.onnx"}, "b": {"backend": "ORT", "onnx": "b.onnx"}}
    assert [r["node"] for r in plot_rows(res)] == [f"n{i}" for i in range(5)]
    # also after a JSON round trip (NaN is written as null)
    back = json.loads(json.dumps(res).replace("NaN", "null"))
    assert len(plot_rows(back)) == 5
    path = plot_similarity(back, tmp_path / "p.png")
    assert path.stat().st_size > 5000
    assert np.isnan(np.array([r["cosine_min"] if r["cosine_min"] is not None else np.nan
                              for r in plot_rows(back)])).sum() == 1
