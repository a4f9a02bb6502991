"""deploykit.checks.lint: lint findings (opset, Squeeze/Reshape on the batch axis, blocked Q/DQ,
HardSigmoid attributes) on small hand-built ONNX graphs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, TensorProto

from deploykit.checks.lint import lint

from tests.helpers.stages import ROOT
from tests.helpers.export_models import _by, _model, _vi
from tests.helpers.verdict_models import _ort_model, _sq_model


# ------------------------------------------------------------------------------------------
# Lint: any ONNX file
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_lint_softmax_below_opset13_named_with_fix(tmp_path):
    m = _model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1)],
               [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=11)
    r = _by(lint(m), "softmax_axis")
    assert r[0]["status"] == "warn" and r[0]["node"] == "sm" and "opset >= 13" in r[0]["fix"]
    m13 = _model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=1)],
                 [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=13)
    assert _by(lint(m13), "softmax_axis")[0]["status"] == "pass"
    last = _model([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)],
                  [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=11)
    assert _by(lint(last), "softmax_axis")[0]["status"] == "pass"
    # The command line: exit 1, the node and the fix printed.
    onnx.save(m, str(tmp_path / "sm.onnx"))
    p = subprocess.run([sys.executable, "export_checks.py", "lint", str(tmp_path / "sm.onnx")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1 and "sm" in p.stdout and "fix:" in p.stdout
    onnx.save(m13, str(tmp_path / "ok.onnx"))
    p = subprocess.run([sys.executable, "export_checks.py", "lint", str(tmp_path / "ok.onnx")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_lint_squeeze_without_axes_on_dynamic_axis():
    nodes = [helper.make_node("Squeeze", ["x"], ["y"], name="sq")]
    r = _by(lint(_model(nodes, [_vi("x", ["N", 8, 1, 1])], [_vi("y", None)], opset=13)),
            "squeeze_axes")
    assert r[0]["status"] == "fail" and r[0]["node"] == "sq" and "flatten(1)" in r[0]["fix"]
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "ax")
    ok = _model([helper.make_node("Squeeze", ["x", "ax"], ["y"], name="sq")],
                [_vi("x", ["N", 8, 1, 1])], [_vi("y", None)], [axes], opset=13)
    assert _by(lint(ok), "squeeze_axes")[0]["status"] == "pass"


def test_lint_reshape_constant_holding_a_batch():
    shape = numpy_helper.from_array(np.array([2, 2, 4, 8], np.int64), "s")
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
               [_vi("x", ["N", 8, 8])], [_vi("y", None)], [shape])
    r = _by(lint(m), "shape_constants")
    assert r[0]["status"] == "fail" and r[0]["node"] == "rs"
    ok_shape = numpy_helper.from_array(np.array([-1, 2, 4, 8], np.int64), "s")
    ok = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
                [_vi("x", ["N", 8, 8])], [_vi("y", None)], [ok_shape])
    assert _by(lint(ok), "shape_constants")[0]["status"] == "pass"
    # With the export's example batch known, a leading 3 is named as the frozen batch.
    s3 = numpy_helper.from_array(np.array([3, 64], np.int64), "s")
    m3 = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
                [_vi("x", ["N", 8, 8])], [_vi("y", None)], [s3])
    assert "example batch" in _by(lint(m3, example_batch=3), "shape_constants")[0]["detail"]


def test_lint_blocked_qdq_needs_opset21_and_fp16_constants_in_range():
    q = numpy_helper.from_array(np.zeros((4, 32), np.int8), "q")
    s = numpy_helper.from_array(np.ones((4, 1), np.float32), "s")
    dq = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq", axis=1,
                          block_size=32)
    mm = helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")
    tr = helper.make_node("Transpose", ["w"], ["wt"], name="tr")
    m = _model([dq, tr, mm], [_vi("x", ["N", 32])], [_vi("y", None)], [q, s], opset=19)
    r = _by(lint(m), "blocked_qdq_opset")
    assert r[0]["status"] == "fail" and r[0]["node"] == "dq"
    w16 = numpy_helper.from_array(np.array([1.0, np.inf], np.float16), "w16")
    m16 = _model([helper.make_node("Mul", ["x", "w16"], ["y"], name="mul")],
                 [_vi("x", ["N", 2], TensorProto.FLOAT16)], [_vi("y", None, TensorProto.FLOAT16)],
                 [w16])
    r = _by(lint(m16), "fp16_initializers")
    assert r[0]["status"] == "fail" and r[0]["node"] == "mul"


def test_hardsigmoid_attributes_lint_warns_check_fails():
    m = _model([helper.make_node("HardSigmoid", ["x"], ["y"], name="hs")],
               [_vi("x", ["N", 16])], [_vi("y", ["N", 16])])
    assert _by(lint(m), "hardsigmoid")[0]["status"] == "warn"  # right for a Keras model
    r = _by(lint(m, against_torch=True), "hardsigmoid")[0]
    assert r["status"] == "fail" and r["node"] == "hs" and "alpha=0.2" in r["detail"]


def test_lint_squeeze_with_axes_on_the_dynamic_batch():
    """PyTorch's ``x.squeeze(0)`` on ``[B, 10]`` is a no-op for B > 1; exported with a symbolic
    batch it becomes Squeeze(axes=[0]), which ONNX Runtime refuses for any batch but 1 ("If
    an axis is selected with shape entry not equal to one, an error is raised", ONNX Squeeze-13).
    The lint passed it as "names its axes"."""
    (r,) = [r for r in lint(_sq_model(["batch", 10], [0])) if r["check"] == "squeeze_axes"]
    assert r["status"] == "fail" and r["node"] == "head/sq", r
    assert "axis 0" in r["detail"] and "squeeze(0)" in r["fix"]
    x = np.ones((3, 10), np.float32)
    with pytest.raises(Exception, match="must be 1"):  # ground truth: ORT refuses batch 3
        _ort_model(_sq_model(["batch", 10], [0]), {"x": x})
    # named static axes, and a negative one, stay clean
    for axes in ([1], [-1]):
        (r,) = [r for r in lint(_sq_model(["batch", 1, 10] if axes == [1] else
                                             ["batch", 10, 1], axes))
                if r["check"] == "squeeze_axes"]
        assert r["status"] == "pass", r


def test_lint_squeeze_without_axes_fix_names_the_axes_to_keep():
    """The fix named ``x.squeeze((2, 3))`` whatever the shape; for [B, 1, 10] it is axis 1."""
    (r,) = [r for r in lint(_sq_model(["batch", 1, 10])) if r["check"] == "squeeze_axes"]
    assert r["status"] == "fail" and "squeeze(1)" in r["fix"], r


def test_lint_squeeze_with_axes_on_an_axis_of_unknown_size_is_not_an_error():
    """An axis whose size shape inference cannot tell (a Reshape to a computed shape) may be 1:
    a Squeeze naming it is not judged."""
    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["s"], name="shape"),
         helper.make_node("Concat", ["s", "one"], ["s1"], name="cat", axis=0),
         helper.make_node("Reshape", ["x", "s1"], ["r"], name="rs"),
         helper.make_node("Squeeze", ["r", "ax"], ["y"], name="sq")], "g",
        [helper.make_tensor_value_info("x", 1, ["batch", 10])],
        [helper.make_tensor_value_info("y", 1, None)],
        [numpy_helper.from_array(np.array([1], np.int64), "one"),
         numpy_helper.from_array(np.array([2], np.int64), "ax")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (r,) = [r for r in lint(m) if r["check"] == "squeeze_axes"]
    assert r["status"] == "pass", r
    np.testing.assert_allclose(_ort_model(m, {"x": np.ones((3, 10), np.float32)}), np.ones((3, 10)))


# ------------------------------------------------------------------------------------------
# Lint: the file loads (onnx.checker full check, an ORT session on the CPU EP)
# ------------------------------------------------------------------------------------------
def _one_node(op, dtype, name):
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name=name)], "g",
                          [helper.make_tensor_value_info("x", dtype, ["N", 4])],
                          [helper.make_tensor_value_info("y", dtype, ["N", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_lint_reports_a_file_ort_cannot_load_naming_the_node(tmp_path):
    """``export_checks.py lint`` said "0 errors" on a file ONNX Runtime cannot load: a Relu on
    int16 is valid ONNX (the checker passes) but ORT's CPU EP has no kernel for it."""
    path = tmp_path / "relu_int16.onnx"
    onnx.save(_one_node("Relu", TensorProto.INT16, "relu_i16"), str(path))
    res = lint(path)
    assert _by(res, "onnx_checker")[0]["status"] == "pass"
    (r,) = _by(res, "ort_load")
    assert r["status"] == "fail" and r["node"] == "relu_i16", r
    assert "cannot load" in r["detail"] and "NOT_IMPLEMENTED" in r["detail"]
    assert _by(lint(onnx.load(str(path))), "ort_load")[0]["status"] == "fail"  # in memory


def test_lint_runs_the_full_onnx_checker(tmp_path):
    """Erf on int64: the strict type inference of onnx.checker and ORT both refuse it."""
    res = lint(_one_node("Erf", TensorProto.INT64, "erf_i64"))
    (c,) = _by(res, "onnx_checker")
    assert c["status"] == "fail" and c["node"] == "erf_i64" and "int64" in c["detail"]
    assert _by(res, "ort_load")[0]["status"] == "fail"
    good = lint(_one_node("Relu", TensorProto.FLOAT, "relu"))
    assert {r["status"] for r in good if r["check"] in ("onnx_checker", "ort_load")} == {"pass"}


@pytest.mark.slow
def test_lint_cli_counts_a_load_failure_as_an_error(tmp_path):
    path = tmp_path / "relu_int16.onnx"
    onnx.save(_one_node("Relu", TensorProto.INT16, "relu_i16"), str(path))
    p = subprocess.run([sys.executable, "export_checks.py", "lint", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1 and "1 error(s)" in p.stdout, p.stdout + p.stderr
    assert "relu_i16" in p.stdout + p.stderr
