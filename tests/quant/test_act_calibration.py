"""Activation range choice: each method's rule, and ranges written into the Q/DQ model."""
import numpy as np
import onnx
from onnx import numpy_helper

from deploykit.quant import act_calibration, graph, ort_static
from tests.quant._models import block_model, inputs, run


def _hist(values):
    lo, hi = min(values.min(), 0), max(values.max(), 0)
    e = np.linspace(lo, hi, act_calibration.BINS + 1)
    return {"min": lo, "max": hi, "hist": np.histogram(values, e)[0], "edges": e}


def test_methods_on_heavy_tail():
    r = np.random.default_rng(0)
    v = np.concatenate([np.abs(r.normal(size=200000)), np.linspace(10, 60, 50)])  # a thin tail
    h = _hist(v)
    assert act_calibration.choose_range(h, "max") == (0.0, 60.0)
    _, p = act_calibration.choose_range(h, "percentile:99.9")
    _, mse = act_calibration.choose_range(h, "mse")
    _, ent = act_calibration.choose_range(h, "entropy")
    assert 3 < p < 6
    assert mse <= 60 and ent < 30  # KL ignores the thin tail's mass; MSE weighs its squares
    # ...but entropy keeps the bulk: it never clips inside the dense part of the distribution
    assert ent > np.percentile(v, 99.9)
    # MSE's choice has lower histogram error than max
    c = 0.5 * (h["edges"][1:] + h["edges"][:-1])
    assert act_calibration._qdq_err(c, h["hist"], 0, mse, 255) < \
        act_calibration._qdq_err(c, h["hist"], 0, 60.0, 255)


def test_set_ranges_rewrites_q_and_dq(tmp_path):
    m = block_model()
    x = inputs(16) * 3
    onnx.save(m, tmp_path / "fp.onnx")
    ort_static.quantize(tmp_path / "fp.onnx", tmp_path / "q.onnx", x, batch=16,
                        op_types=("Conv", "Clip"))
    q = onnx.load(tmp_path / "q.onnx")
    q2, rec = act_calibration.calibrate(m, q, x, "max")
    # the conv outputs whose Clip ORT removed (they carry the Clip's output name) are measured
    # after the Clip: range within [0, 6]
    removed = [t for t in rec["stat"] if t in ("a1", "a2")]
    assert len(removed) == 2
    for t in removed:
        lo, hi = rec["ranges"][t]
        assert lo == 0.0 and 0 < hi <= 6.0
    inits = graph.initializers(q2)
    for n in act_calibration.activation_q_nodes(q2):
        lo, hi = rec["ranges"][n.input[0]]
        s = float(numpy_helper.to_array(inits[n.input[1]]))
        assert np.isclose(s, (hi - lo) / 255, rtol=1e-6)
    # same function as ORT's own MinMax within a few quantization steps
    y, y1, y2 = run(m, x)[0], run(q, x)[0], run(q2, x)[0]
    assert np.abs(y2 - y).mean() < 2 * np.abs(y1 - y).mean() + 1e-3
