"""ORT quantize_static recipe: excluded nodes stay float in the CPU EP session."""
import numpy as np
import onnx

from deploykit.quant import graph, ort_static
from tests.quant._models import block_model, inputs, run


def test_excluded_node_stays_float(tmp_path):
    m = block_model()
    x = inputs(16) * 3
    onnx.save(m, tmp_path / "fp.onnx")
    ort_static.quantize(tmp_path / "fp.onnx", tmp_path / "q.onnx", x, batch=16,
                        op_types=("Conv", "Clip"), nodes_to_exclude=["dw"])
    q = onnx.load(tmp_path / "q.onnx")
    nodes = {n.name: n for n in q.graph.node}
    assert not graph.is_quantized(q, nodes["dw"]) and graph.is_quantized(q, nodes["conv1"])
    ref = run(q, x)[0]  # optimisations off: the file's own semantics
    s = ort_static.session(tmp_path / "q.onnx", optimize=True)
    y = s.run(None, {"x": x})[0]
    # with WeightBiasQuantization disabled the optimised session computes the same function
    assert np.abs(y - ref).max() < 0.05 * np.abs(ref).max()
    assert graph.macs(m, (1, 4, 8, 8))["dw"] == 8 * 8 * 8 * 9
