"""deploykit.quant.int4: INT4 axis detection and repair, on models ModelOpt really produced."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.compare import parity
from deploykit.errors import StageError
from deploykit.quant.int4 import check_blocked_dq, fix_int4_axis

from tests.helpers.quant_models import _ort_run
from tests.helpers.stages import load_stage


int4 = load_stage("5b_quantize_int4")


# --------------------------------------------------------------------------------------------
# INT4 axis detection and repair
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_int4_axis_detected_repaired_and_ort_then_runs(modelopt_int4_models):
    import onnx

    m = modelopt_int4_models
    x = np.random.default_rng(3).standard_normal((4, 576)).astype(np.float32)
    q = onnx.load(str(m["gemm_q"]))
    report = check_blocked_dq(q)
    assert len(report) == 1
    (r,) = report
    # What ModelOpt wrote: axis 0 for a scale blocked along axis 1 ([N, ceil(K/128)]).
    assert r["status"] == "mismatch" and r["axis"] == 0 and r["valid_axes"] == [1]
    assert r["scale_shape"] == [64, 5] and r["x_shape"] == [64, 576]
    with pytest.raises(Exception, match="block"):
        _ort_run(m["gemm_q"], {"x": x})  # ORT rejects the model as ModelOpt wrote it
    fixed_model, fixed = fix_int4_axis(q)
    assert [f["name"] for f in fixed] == [r["name"]] and fixed[0]["new_axis"] == 1
    assert check_blocked_dq(fixed_model)[0]["status"] == "ok"
    y = _ort_run(fixed_model, {"x": x})
    ref = _ort_run(m["gemm_src"], {"x": x})
    assert parity(ref, y)["cosine_min"] > 0.98  # INT4 weights, but the right function
    # Only the axis attribute changed: the same nodes, initializers and other attributes.
    q2 = onnx.load(str(m["gemm_q"]))
    assert [n.op_type for n in q2.graph.node] == [n.op_type for n in fixed_model.graph.node]
    assert {i.name for i in q2.graph.initializer} == {i.name for i in fixed_model.graph.initializer}


@pytest.mark.slow
def test_int4_correct_model_left_untouched(modelopt_int4_models):
    import onnx

    q = onnx.load(str(modelopt_int4_models["mm_q"]))
    before = q.SerializeToString()
    report = check_blocked_dq(q)
    assert report and all(r["status"] == "ok" for r in report)
    q, fixed = fix_int4_axis(q)
    assert fixed == [] and q.SerializeToString() == before
    _ort_run(q, {"x": np.ones((2, 256), np.float32)})


def test_unrepairable_scale_raises():
    from onnx import TensorProto, helper, numpy_helper

    q = numpy_helper.from_array(np.zeros((64, 576), np.int8), "q")
    q.data_type = TensorProto.INT4
    s = numpy_helper.from_array(np.ones((7, 7), np.float32), "s")  # fits no axis
    dq = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq", axis=0, block_size=128)
    g = helper.make_graph([dq], "g", [], [helper.make_tensor_value_info("w", 1, None)], [q, s])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    assert check_blocked_dq(model)[0]["status"] == "unrepairable"
    with pytest.raises(StageError, match="fits no single axis"):
        fix_int4_axis(model)
