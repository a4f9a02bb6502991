"""deploykit.layerwise.quant_backend: the table that separates quantization error from backend error."""

from __future__ import annotations

from deploykit.evaluate import EvalData
from deploykit.layerwise.quant_backend import quant_backend_table
from deploykit.quant.cross_check import backend_cross_check

from tests.helpers.auto_models import _save
from tests.helpers.qdq_models import _feed, qdq_conv


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
