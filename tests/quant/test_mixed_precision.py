"""Nodes made float in a Q/DQ model compute the float function (activations included)."""
import numpy as np
import onnx

from deploykit.quant import graph, mixed_precision, ort_static
from tests.quant._models import block_model, inputs, run


def test_make_float_all_nodes_is_float(tmp_path):
    m = block_model()
    x = inputs(16) * 3
    onnx.save(m, tmp_path / "fp.onnx")
    ort_static.quantize(tmp_path / "fp.onnx", tmp_path / "q.onnx", x, batch=16,
                        op_types=("Conv", "Clip"), per_channel=False)
    q = onnx.load(tmp_path / "q.onnx")
    share, nq, nall = graph.int8_mac_share(q, (1, 4, 8, 8))
    assert share == 1.0 and nq == 3
    f = mixed_precision.make_float(q, m, ["conv1", "dw", "conv3"])
    y = run(m, x)[0]
    # conv3's input: the ReLU6 that ORT folded into the quantized range is copied back in
    assert any(n.name.endswith("_float_copy") for n in f.graph.node)
    # the last conv's own output (its graph output is still quantized by ORT's output Q/DQ)
    last = next(n for n in f.graph.node if n.name == "conv3").output[0]
    np.testing.assert_allclose(run(graph.with_outputs(f, [last]), x, [last])[0], y, atol=1e-4)
    assert graph.int8_mac_share(f, (1, 4, 8, 8))[0] == 0.0
    one = mixed_precision.make_float(q, m, ["dw"])
    s1 = graph.int8_mac_share(one, (1, 4, 8, 8))
    assert 0 < s1[0] < 1 and s1[1] == 2
    err = lambda mm: float(np.abs(run(mm, x)[0] - y).mean())  # noqa: E731
    assert err(one) < err(q)
