"""Empirical bias correction removes the per-channel mean output error of quantized convs."""
import numpy as np
import onnx

from deploykit.quant import bias_correction, ort_static
from tests.quant._models import block_model, inputs, run


def _quantized(tmp_path, m, x, **kw):
    fp = tmp_path / "fp.onnx"
    onnx.save(m, fp)
    ort_static.quantize(fp, tmp_path / "q.onnx", x, batch=len(x), **kw)
    return onnx.load(tmp_path / "q.onnx")


def test_bias_correction_reduces_mean_error(tmp_path):
    m = block_model()
    x = inputs(32) * 3
    # per-tensor weights make the bias of the quantized convs large (as on depthwise layers)
    q = _quantized(tmp_path, m, x, per_channel=False)
    before = bias_correction.measure_bias_error(m, q, x)
    assert set(before) == {"conv1", "dw", "conv3"}
    qc, log = bias_correction.bias_correct(m, q, x)
    after = bias_correction.measure_bias_error(m, qc, x)
    b = np.mean([np.abs(v).mean() for v in before.values()])
    a = np.mean([np.abs(v).mean() for v in after.values()])
    assert b > 1e-3
    assert a < 0.2 * b, (a, b)
    assert [r["node"] for r in log] == ["conv1", "dw", "conv3"]
    # the output's mean error shrinks on the calibration data
    y = run(m, x)[0]
    e0 = np.abs((run(q, x)[0] - y).mean(axis=(0, 2, 3))).mean()
    e1 = np.abs((run(qc, x)[0] - y).mean(axis=(0, 2, 3))).mean()
    assert e1 < 0.2 * e0


def test_quantized_bias_is_refused(tmp_path):
    m = block_model()
    x = inputs(8)
    q = _quantized(tmp_path, m, x, quantize_bias=True)
    import pytest
    with pytest.raises(ValueError, match="bias"):
        bias_correction.apply_bias_shift(q, {"conv1": np.zeros(8)})
