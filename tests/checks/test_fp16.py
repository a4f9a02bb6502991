"""deploykit.checks.fp16: FP16 conversion, the range audit, converter changes and true FP16 arithmetic
on small graphs with overflow/underflow faults."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, TensorProto

from deploykit.checks.base import worst
from deploykit.checks.export import ort_runner
from deploykit.checks.fp16 import (
    convert_fp16, fp16_backends, fp16_converter_changes, fp16_range_audit, fp16_true_arithmetic,
)

from tests.helpers.export_models import _legacy, _model, _vi
from tests.helpers.verdict_models import _ort_model


torch = pytest.importorskip("torch")


def test_fp16_true_arithmetic_sees_what_ort_cpu_does_not(user_models, tmp_path):
    _, mods = user_models
    m = mods.overflow()
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    path = tmp_path / "fp32.onnx"
    _legacy(m, {"input": x}, path, ["y"])
    m16, _ = convert_fp16(onnx.load(str(path)))
    onnx.save(m16, str(tmp_path / "fp16.onnx"))
    ref = {"y": m(torch.from_numpy(x)).detach().numpy()}
    ort_cpu = ort_runner(tmp_path / "fp16.onnx")({"input": x})
    assert np.isfinite(next(iter(ort_cpu.values()))).all()  # ORT CPU computes in FP32
    r = fp16_true_arithmetic(tmp_path / "fp16.onnx", {"input": x}, ref, 0.999)[0]
    assert r["status"] == "fail" and "Conv" in r["detail"]
    b = fp16_backends(tmp_path / "fp16.onnx", {"input": x}, ref, 0.999)
    if b[0]["status"] == "skip":
        assert "computed this FP16 graph in FP32" in b[0]["detail"]
    else:  # a real FP16 backend ran it and is named (on the H200's CUDA EP this conv model
        # matched PyTorch: the kernel did not store the >65504 value in FP16 there)
        assert {r["backend"] for r in b} <= {"ort-cuda", "tensorrt"}
        assert b[0]["status"] in ("pass", "fail"), b


def test_fp16_backend_run_sees_an_overflow_the_cpu_ep_hides(tmp_path):
    """sqrt of a sum of squares above 65504: ORT's CPU EP returns the FP32 value (it computes
    the FP16 graph in FP32), ORT's CUDA EP returns inf (seen on an H200 with ORT 1.31.1: 489.9
    vs inf); fp16_backends fails it where a GPU EP exists, and says why it cannot judge on a
    CPU-only machine."""
    g = helper.make_graph(
        [helper.make_node("ReduceSumSquare", ["x"], ["s"], keepdims=1),
         helper.make_node("Sqrt", ["s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 300])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m16, _ = convert_fp16(m)
    onnx.save(m16, str(tmp_path / "fp16.onnx"))
    x = np.full((2, 300), 20.0, np.float32)
    ref = {"y": np.sqrt((x.astype(np.float64) ** 2).sum()).reshape(1, 1).astype(np.float32)}
    cpu = ort_runner(tmp_path / "fp16.onnx")({"x": x})["y"]
    assert np.allclose(cpu, ref["y"], rtol=1e-3)  # the CPU EP's FP32 arithmetic hides it
    b = fp16_backends(tmp_path / "fp16.onnx", {"x": x}, ref, 0.999)
    if b[0]["status"] == "skip":
        assert "computed this FP16 graph in FP32" in b[0]["detail"]
    else:
        assert b[0]["backend"] == "ort-cuda" and b[0]["status"] == "fail", b


def test_decomposed_layernorm_overflow_named(user_models, tmp_path):
    _, mods = user_models
    m = mods.decomposed_ln()
    x = np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)
    path = _legacy(m, {"x": x}, tmp_path / "ln.onnx", ["y"])
    m32 = onnx.load(str(path))
    m16, _ = convert_fp16(m32)
    res = fp16_range_audit(m32, {"x": x}, m16)
    bad = [r for r in res if r["status"] == "fail" and not r.get("summary")]
    assert bad and bad[0]["node"].endswith("Pow") and "65504" in bad[0]["detail"]
    # The fix (producer and consumers in FP32) clears the audit.
    m16k, _ = convert_fp16(m32, bad[0]["keep_fp32"])
    assert worst(fp16_range_audit(m32, {"x": x}, m16k)) == "pass"


def test_fp16_underflow_and_converter_changes_named(tmp_path):
    tiny = numpy_helper.from_array(np.array(1e-7, np.float32), "tiny")
    big = numpy_helper.from_array(np.array(1e5, np.float32), "big")
    low = numpy_helper.from_array(np.array(-1.0, np.float32), "low")
    m = _model([helper.make_node("Mul", ["x", "tiny"], ["t"], name="scale_down"),
                helper.make_node("Clip", ["t", "low", "big"], ["y"], name="clamp")],
               [_vi("x", ["N", 64])], [_vi("y", ["N", 64])], [tiny, big, low])
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    m16, warns = convert_fp16(m)
    res = fp16_range_audit(m, {"x": x}, m16)
    under = [r for r in res if r["status"] == "fail" and "mass" in r["detail"]]
    assert under and under[0]["node"] == "scale_down"
    ch = fp16_converter_changes(m, m16, warns)
    bad = [r for r in ch if r["status"] == "fail" and r.get("constant")]
    assert {r["constant"] for r in bad} == {"big"} and "clamp" in bad[0]["keep_fp32"]
    assert any("truncated" in w["message"] for w in warns)  # the converter's warning, kept


def test_convert_fp16_keeps_constants_fp16_can_hold():
    c = numpy_helper.from_array(np.array(20000.0, np.float32), "c")
    m = _model([helper.make_node("Mul", ["x", "c"], ["y"], name="mul")],
               [_vi("x", ["N", 4])], [_vi("y", ["N", 4])], [c])
    m16, _ = convert_fp16(m)
    got = {t.name: numpy_helper.to_array(t) for t in m16.graph.initializer}["c"]
    assert float(got) == 20000.0  # onnxconverter-common's default would clamp it to 10000
    assert fp16_converter_changes(m, m16)[-1]["status"] == "pass"


# --------------------------------------------------------------------------------------------
# The FP16 remedy (keep a node in FP32) also keeps the constants it reads in FP32
# --------------------------------------------------------------------------------------------
def fp16_constants_model():
    """y1 = (x * 1e5 - 1e5) * 1e-5 + 1e-9 (a Constant node), y2 = x * 1e5 sharing the
    initializer: 1e5 is clamped to 65504 by the FP16 converter, 1e-9 raised to 5.96e-8, and
    1e-5 (listed in value_info) is made FP16 before a Cast back."""
    nodes = [helper.make_node("Constant", [], ["tiny"], name="c_tiny",
                              value=numpy_helper.from_array(np.array(1e-9, np.float32))),
             helper.make_node("Mul", ["x", "big"], ["m"], name="mul"),
             helper.make_node("Sub", ["m", "big"], ["s"], name="sub"),
             helper.make_node("Mul", ["s", "small"], ["t"], name="scale"),
             helper.make_node("Add", ["t", "tiny"], ["y1"], name="add"),
             helper.make_node("Mul", ["x", "big"], ["y2"], name="mul3")]
    inits = [numpy_helper.from_array(np.array(1e5, np.float32), "big"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "small")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 4])],
                          [helper.make_tensor_value_info("y1", 1, ["N", 4]),
                           helper.make_tensor_value_info("y2", 1, ["N", 4])], inits,
                          # the dynamo exporter lists initializers in value_info too
                          value_info=[helper.make_tensor_value_info("small", 1, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_fp16_keep_fp32_keeps_the_constants_of_the_kept_nodes():
    """onnxconverter-common converts (and clamps) the constants a node of its block list reads,
    then casts them back to FP32: keeping the node in FP32, the fix the FP16 checks print, did
    not undo the change, so the same check failed again."""
    m = fp16_constants_model()
    keep = ["mul", "sub", "scale", "add"]
    feed = {"x": np.random.default_rng(0).uniform(0, 1, (3, 4)).astype(np.float32)}
    y32 = _ort_model(m, feed, "disable")
    m16, warn = convert_fp16(m, keep)
    onnx.checker.check_model(m16)
    y16 = _ort_model(m16, feed, "disable")
    np.testing.assert_allclose(y16, y32, atol=1e-3)  # the kept nodes compute with 1e5
    res = fp16_converter_changes(m, m16, warn, keep_fp32=keep)
    fails = [r for r in res if r["status"] == "fail" and not r.get("summary")]
    # the shared initializer is still changed for the node that was not kept, and only it
    (f,) = fails
    assert f["constant"] == "big" and f["keep_fp32"] == ["mul3"], f
    m16b, warn = convert_fp16(m, keep + ["mul3"])
    res = fp16_converter_changes(m, m16b, warn, keep_fp32=keep + ["mul3"])
    assert worst(res) == "pass", res
    # nothing left behind: the FP16 copies only the kept nodes read are gone
    assert "big" not in {i.name for i in m16b.graph.initializer}
    assert "c_tiny" not in {n.name for n in m16b.graph.node}


def test_fp16_constant_summary_row_does_not_contradict_the_finding():
    m = fp16_constants_model()
    m16, warn = convert_fp16(m, [])
    res = fp16_converter_changes(m, m16, warn)
    summary = [r for r in res if r.get("summary")]
    assert summary and "no constant changed" not in summary[0]["detail"]
    assert {r["constant"] for r in res if r["status"] == "fail" and not r.get("summary")} == \
        {"big", "tiny"}


def test_true_fp16_arithmetic_runs_a_static_batch(tmp_path):
    """onnx.reference was fed one sample at a time: a file with a static batch of 4 (a Reshape
    to [4, 6]) failed there and the true-FP16 verdict became a skip, hiding an overflow
    ((300 x)^2 > 65504) that only FP16 arithmetic shows."""
    g = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shp"], ["f"], name="flat"),
         helper.make_node("Mul", ["f", "k"], ["h"], name="scale"),
         helper.make_node("Mul", ["h", "h"], ["sq"], name="square"),
         helper.make_node("Mul", ["sq", "inv"], ["y"], name="rescale")], "g",
        [helper.make_tensor_value_info("x", 1, [4, 2, 3])],
        [helper.make_tensor_value_info("y", 1, [4, 6])],
        [numpy_helper.from_array(np.array([4, 6], np.int64), "shp"),
         numpy_helper.from_array(np.array(300.0, np.float32), "k"),
         numpy_helper.from_array(np.array(1e-4, np.float32), "inv")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m16, _ = convert_fp16(m)
    path = tmp_path / "fp16.onnx"
    onnx.save(m16, str(path))
    feed = {"x": np.random.default_rng(0).uniform(1, 2, (8, 2, 3)).astype(np.float32)}
    ref = {"y": np.concatenate([_ort_model(m, {"x": feed["x"][i:i + 4]}) for i in (0, 4)])}
    (r,) = fp16_true_arithmetic(path, feed, ref, 0.999)
    assert r["status"] == "fail", r
    assert "square" in r["detail"] and r["n_samples"] >= 4


# --------------------------------------------------------------------------------------------
# Graphs onnxconverter-common makes invalid with keep_io_types: repaired by convert_fp16
# --------------------------------------------------------------------------------------------
def _ort_runs(m16, feed):
    import onnxruntime as ort

    s = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feed)


def test_convert_fp16_output_also_read_inside_the_graph(tmp_path):
    """forward() returning (logits, feature) where logits are made from the feature: the
    converter casts the feature output back to float32 and left the Gemm reading it beside
    float16 weights (ORT: 'Type parameter (T) of Optype (Gemm) bound to different types')."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "w")
    m = _model([helper.make_node("Relu", ["x"], ["feat"], name="relu"),
                helper.make_node("Gemm", ["feat", "w"], ["logits"], name="fc", transB=1)],
               [_vi("x", ["N", 4])], [_vi("logits", ["N", 3]), _vi("feat", ["N", 4])], [w])
    m16, _ = convert_fp16(m)
    onnx.checker.check_model(m16, full_check=True)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    logits, feat = _ort_runs(m16, {"x": x})
    ref = np.maximum(x, 0)
    assert feat.dtype == np.float32 and np.allclose(feat, ref, atol=1e-3)
    assert np.allclose(logits, ref @ numpy_helper.to_array(w).T, atol=1e-2)
    # kept in FP32 on request: the Gemm then reads the FP32 output, as before
    m16k, _ = convert_fp16(m, ["fc"])
    assert np.allclose(_ort_runs(m16k, {"x": x})[0], ref @ numpy_helper.to_array(w).T,
                       atol=1e-2)


def test_convert_fp16_keeps_a_uint8_input_and_casts_it_to_fp16():
    """An NHWC uint8 image the model casts (x.float()) and scales itself: the input stays
    uint8 in the FP16 file and the model's Cast now makes float16 (the converter left
    to=FLOAT under a float16 declaration: ORT refused the file)."""
    s = numpy_helper.from_array(np.array(1 / 255, np.float32), "s")
    m = _model([helper.make_node("Transpose", ["x"], ["t"], name="perm", perm=[0, 3, 1, 2]),
                helper.make_node("Cast", ["t"], ["f"], name="to_float", to=TensorProto.FLOAT),
                helper.make_node("Mul", ["f", "s"], ["y"], name="scale")],
               [_vi("x", ["N", 2, 2, 3], TensorProto.UINT8)], [_vi("y", ["N", 3, 2, 2])], [s])
    m16, _ = convert_fp16(m)
    assert m16.graph.input[0].type.tensor_type.elem_type == TensorProto.UINT8
    x = np.random.default_rng(0).integers(0, 256, (2, 2, 2, 3)).astype(np.uint8)
    (y,) = _ort_runs(m16, {"x": x})
    assert y.dtype == np.float32
    assert np.allclose(y, x.transpose(0, 3, 1, 2) / 255.0, atol=1e-3)


def test_reference_conv_and_matmul_on_float16_keep_the_evaluators_arithmetic():
    """The faster float16 Conv / MatMul of _reference_ops (float32 products rounded once to
    float16, then the bias in float16) give what onnx.reference's own float16 kernels give:
    the same inf where a product exceeds 65504, every finite value within one float16 step
    (only the summation order differs); grouped, depthwise, strided and biased convs."""
    from onnx.reference import ReferenceEvaluator

    from deploykit.checks.fp16 import _reference_ops

    rng = np.random.default_rng(0)

    def c(name, *shape, scale=1.0):
        return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float16),
                                       name)

    inits = [c("w0", 8, 3, 3, 3), c("b0", 8), c("w1", 8, 1, 3, 3, scale=150.0),
             c("w2", 8, 4, 1, 1), c("b2", 8, scale=100.0), c("m", 8 * 4 * 4, 5, scale=0.1)]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["a"], pads=[1] * 4, strides=[2, 2]),
             helper.make_node("Conv", ["a", "w1"], ["d"], group=8, pads=[1] * 4),
             helper.make_node("Conv", ["d", "w2", "b2"], ["g"], group=2),
             helper.make_node("Flatten", ["a"], ["f"]),
             helper.make_node("MatMul", ["f", "m"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16,
                                                                      [2, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None),
                           helper.make_tensor_value_info("g", TensorProto.FLOAT16, None)],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = {"x": (20 * rng.standard_normal((2, 3, 8, 8))).astype(np.float16)}
    ops = _reference_ops()
    assert {o.__name__ for o in ops} >= {"Conv", "MatMul"}
    with np.errstate(all="ignore"):
        plain = ReferenceEvaluator(m).run(None, x, intermediate=True)
        fast = ReferenceEvaluator(m, new_ops=ops).run(None, x, intermediate=True)
    for name in ("a", "d", "g", "y"):
        p, f = plain[name].astype(np.float64), fast[name].astype(np.float64)
        assert fast[name].dtype == np.float16
        assert np.array_equal(np.isinf(p), np.isinf(f)), name
        assert np.array_equal(np.isnan(p), np.isnan(f)), name
        ok = np.isfinite(p)
        step = np.spacing(np.abs(plain[name][ok]).astype(np.float16)).astype(np.float64)
        assert (np.abs(p[ok] - f[ok]) <= step + 1e-12).all(), name
    # both cases covered: depthwise products above 65504 beside finite ones
    assert np.isinf(plain["d"]).any() and np.isfinite(plain["d"]).any()
    assert np.isfinite(plain["y"]).all()


def test_true_fp16_run_stops_at_its_budget_between_two_nodes(tmp_path, monkeypatch):
    """The budget bounds the onnx.reference run itself, not only the decision to start a
    second one: a run that the ORT-based estimate underrates (here: a clock that advances one
    second per look) is stopped between two nodes at the budget and the check says it did not
    finish (skip, not judged), instead of running on."""
    import deploykit.checks.fp16 as fp16

    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["a"], name="m1"),
         helper.make_node("Mul", ["a", "k"], ["b"], name="m2"),
         helper.make_node("Mul", ["b", "k"], ["c"], name="m3"),
         helper.make_node("Mul", ["c", "k"], ["y"], name="m4")], "g",
        [helper.make_tensor_value_info("x", 1, ["N", 6])],
        [helper.make_tensor_value_info("y", 1, ["N", 6])],
        [numpy_helper.from_array(np.array(1.5, np.float32), "k")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m16, _ = convert_fp16(m)
    path = tmp_path / "fp16.onnx"
    onnx.save(m16, str(path))
    feed = {"x": np.random.default_rng(0).uniform(1, 2, (2, 6)).astype(np.float32)}
    ref = {"y": _ort_model(m, feed)}
    (ok,) = fp16_true_arithmetic(path, feed, ref, 0.999)  # a real clock: well within 60 s
    assert ok["status"] == "pass" and ok["n_samples"] == 2, ok
    clock = iter(range(1000))
    monkeypatch.setattr(fp16, "REFERENCE_SLOWDOWN", 0.0)  # the estimate says: about 0 s
    monkeypatch.setattr(fp16.time, "time", lambda: float(next(clock)))
    (r,) = fp16_true_arithmetic(path, feed, ref, 0.999, budget_s=3)
    assert r["status"] == "skip" and "did not finish one run" in r["detail"], r
    assert "3 s budget" in r["detail"] and r["fix"] == "raise --true-fp16-budget-s to run it"
