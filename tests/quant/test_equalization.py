"""Cross-layer equalization keeps the float function and equalizes per-channel weight ranges."""
import numpy as np
from onnx import numpy_helper

from deploykit.quant import equalization, graph
from tests.quant._models import block_model, inputs, run


def test_cle_keeps_function_and_equalizes():
    m = block_model()
    x = inputs() * 3
    y0 = run(m, x)[0]
    e, log = equalization.equalize(m)
    assert [(r["conv1"], r["conv2"]) for r in log] == [("conv1", "dw"), ("dw", "conv3")]
    y1 = run(e, x)[0]
    np.testing.assert_allclose(y1, y0, atol=1e-5, rtol=1e-5)
    # ReLU6 kept exact through per-channel bounds (Clip -> Relu + Min)
    assert not any(n.op_type == "Clip" for n in e.graph.node)
    # conv1's per-output-channel ranges: spread shrinks by a large factor
    w1 = numpy_helper.to_array(graph.initializers(m)["w1"])
    w1e = numpy_helper.to_array(graph.initializers(e)["w1"])
    spread = lambda w: (lambda r: r.max() / r.min())(equalization.channel_ranges(w, 0))  # noqa
    assert spread(w1) > 10
    assert spread(w1e) < spread(w1) / 5
    # per channel, conv1's output range equals the next conv's input range (DFQ's equilibrium)
    assert all(abs(r["max_range_ratio_after"] - 1) < 1e-4 for r in log)
    assert sum(log[0]["precision_after"]) > sum(log[0]["precision_before"])


def test_no_pairs_on_branching_output():
    m = block_model()
    # conv1's activation is also a graph output, or has a second consumer: no pair
    import onnx
    m.graph.output.append(onnx.helper.make_tensor_value_info("a1", onnx.TensorProto.FLOAT, None))
    pairs = equalization.find_pairs(m)
    assert all(p[0] != "conv1" for p in pairs)  # a1 is seen outside: it must not be rescaled
    m2 = block_model()
    m2.graph.node.append(onnx.helper.make_node("Relu", ["a1"], ["extra"], name="extra"))
    m2.graph.output.append(onnx.helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT, None))
    assert all(p[0] != "conv1" for p in equalization.find_pairs(m2))
