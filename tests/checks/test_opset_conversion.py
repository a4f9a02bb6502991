"""deploykit.checks.lint.lint_opset_conversion: nodes whose operator changes meaning between the
file's opset and the opset a conversion makes (ModelOpt's 19, TensorRT 8.x's 17)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from deploykit.checks.lint import OPSET_SEMANTIC_CHANGES, lint, lint_opset_conversion


def _resize(opset, mode=None):
    """``x [1,1,4,4] -> Resize(x2, linear) -> y`` at ``opset`` (Resize-10 form below 11)."""
    kw = {} if mode is None else {"coordinate_transformation_mode": mode}
    if opset < 11:
        node = h.make_node("Resize", ["x", "scales"], ["y"], mode="linear", name="up")
        inits = [nh.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    else:
        node = h.make_node("Resize", ["x", "roi", "scales"], ["y"], mode="linear", name="up",
                           **kw)
        inits = [nh.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
                 nh.from_array(np.zeros(0, np.float32), "roi")]  # Resize-11: roi required
    g = h.make_graph([node], "r", [h.make_tensor_value_info("x", T.FLOAT, [1, 1, 4, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [1, 1, 8, 8])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=8)


def _softmax(opset, axis=None, rank=3):
    shape = [2, 3, 4][:rank]
    kw = {} if axis is None else {"axis": axis}
    g = h.make_graph([h.make_node("Softmax", ["x"], ["y"], name="sm", **kw)], "s",
                     [h.make_tensor_value_info("x", T.FLOAT, shape)],
                     [h.make_tensor_value_info("y", T.FLOAT, shape)])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=8)


def _run(m, x):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_resize_crossing_opset_11_is_named_and_its_results_really_change():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    old = _resize(10)
    (r,) = lint_opset_conversion(old, 19)
    assert r["status"] == "warn" and r["node"].startswith("up") and r["boundary"] == 11
    assert "opset 10 -> 19" in r["detail"] and "half_pixel" in r["detail"]
    # the same node written at opset 11 (default mode) resamples differently: the risk is real
    assert not np.allclose(_run(old, x), _run(_resize(11), x))
    # and onnx.version_converter leaves the mode unset (onnx 1.2x): its copy changes too
    from onnx import version_converter

    assert not np.allclose(_run(old, x), _run(version_converter.convert_version(old, 19), x))
    # an explicit asymmetric mode keeps Resize-10's meaning: nothing to flag at 11
    assert lint_opset_conversion(_resize(11, "asymmetric"), 10)[0]["status"] == "pass"


def test_resize_19_mode_has_no_opset_17_form():
    res = lint_opset_conversion(_resize(19, "half_pixel_symmetric"), 17)
    assert [r["boundary"] for r in res] == [19], res
    assert lint_opset_conversion(_resize(19, "half_pixel"), 17)[0]["status"] == "pass"


def test_softmax_axis_across_13_only_where_the_meaning_changes():
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    m = _softmax(11, axis=1)
    (r,) = lint_opset_conversion(m, 19)
    assert r["boundary"] == 13 and "axis 1 on a rank-3 input" in r["detail"]
    assert not np.allclose(_run(m, x), _run(_softmax(13, axis=1), x))
    (r,) = lint_opset_conversion(_softmax(11), 17)  # default axis 1 (old) vs -1 (new)
    assert "unset" in r["detail"]
    assert lint_opset_conversion(_softmax(11, axis=-1), 19)[0]["status"] == "pass"
    assert lint_opset_conversion(_softmax(11, axis=1, rank=2), 19)[0]["status"] == "pass"
    assert lint_opset_conversion(_softmax(19, axis=1), 19)[0]["status"] == "skip"


def test_reduce_axes_computed_at_run_time_have_no_opset_17_form():
    g = h.make_graph([h.make_node("Shape", ["x"], ["s"]),
                      h.make_node("Slice", ["s", "st", "en"], ["ax"]),
                      h.make_node("ReduceMean", ["x", "ax"], ["y"], name="rm")], "rm",
                     [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                     [h.make_tensor_value_info("y", T.FLOAT, None)],
                     [nh.from_array(np.array([0], np.int64), "st"),
                      nh.from_array(np.array([1], np.int64), "en")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 19)], ir_version=9)
    (r,) = lint_opset_conversion(m, 17)
    assert r["boundary"] == 18 and "computed at run time" in r["detail"] and r["node"] == "rm"
    # constant axes: the converter moves them exactly (no finding), and the lint runs in lint()
    m.graph.node[2].input[1] = "st"
    assert lint_opset_conversion(m, 17)[0]["status"] == "pass"
    assert any(r["check"] == "opset_conversion" for r in lint(m, targets=(17,)))


def test_the_table_names_changelog_versions_and_every_op_exists_at_its_version():
    for ops, v, what in OPSET_SEMANTIC_CHANGES:
        for op in ops:
            schema = onnx.defs.get_schema(op, v)
            assert schema.since_version == v or op == "Upsample", (op, v, schema.since_version)
        assert what
