"""ORT quantize_static recipe: excluded nodes stay float in the CPU EP session."""
import numpy as np
import onnx
import onnx.numpy_helper
import pytest

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


@pytest.mark.slow
def test_quantize_after_modelopt_patched_ort_runs_in_a_clean_process(tmp_path):
    """ModelOpt patches ORT's calibrators for good when it quantizes; in a patched process ORT's
    own quantize_static fails on this model (measured: "Quantization parameters are not
    specified for param x"). Ours then runs in a fresh interpreter and gives the clean result."""
    x = inputs(16) * 3
    onnx.save(block_model(), tmp_path / "fp.onnx")
    kw = dict(batch=16, op_types=("Conv", "Clip"), nodes_to_exclude=["dw"])
    clean = ort_static._in_fresh_process(tmp_path / "fp.onnx", tmp_path / "clean.onnx", x,
                                         **_defaults(kw))
    pytest.importorskip("modelopt.onnx.quantization")
    from modelopt.onnx.quantization.ort_patching import patch_ort_modules

    patch_ort_modules()
    after = ort_static.quantize(tmp_path / "fp.onnx", tmp_path / "after.onnx", x, **kw)
    a, b = (_initializers(p) for p in (clean, after))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert any(k.endswith("_scale") for k in a)  # it did quantize


def _defaults(kw: dict) -> dict:
    """``quantize``'s keyword defaults overridden by ``kw`` (what _in_fresh_process takes)."""
    import inspect

    sig = inspect.signature(ort_static.quantize)
    out = {k: p.default for k, p in sig.parameters.items()
           if p.default is not inspect.Parameter.empty}
    return {**out, **kw}


def _initializers(path) -> dict:
    return {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
