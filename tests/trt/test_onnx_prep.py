"""deploykit.trt.onnx_prep: Q/DQ opset 19 -> 17 conversion (exact, or reported), calibration
scales and the calibration cache text."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from deploykit.errors import StageError
from deploykit.trt.onnx_prep import (
    calibration_cache_text, calibration_scales, ort_parity, parity_feed, to_opset,
)
from deploykit.trt.parsers import parse_calibration_cache
from deploykit.trt.rules import encode_version_int

from tests.helpers.trt_captures import read
from tests.helpers.trt_models import conv_net, qdq_net, save


# --------------------------------------------------------------------------------------------
# ONNX preparation: opset 17 for the 8.x parser, calibration cache for the implicit path
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("axes_initializer", [False, True])
def test_qdq_opset19_to_17_is_exact(fp16, axes_initializer):
    import onnx

    m = qdq_net(fp16, axes_initializer=axes_initializer)
    conv, notes, reason = to_opset(m)
    assert reason is None and conv.ir_version == 8
    assert [o.version for o in conv.opset_import if o.domain in ("", "ai.onnx")] == [17]
    rm = next(n for n in conv.graph.node if n.op_type == "ReduceMean")
    assert len(rm.input) == 1
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in rm.attribute}
    assert attrs["axes"] == [2, 3]  # the 8.6 parser reads axes from the attribute only
    scales = {i.name: i.data_type for i in conv.graph.initializer if i.name.endswith("_s")}
    assert set(scales.values()) == {onnx.TensorProto.FLOAT}
    assert any("widened" in n for n in notes) == fp16
    par = ort_parity(m, conv, parity_feed(m, {"input": (2, 3, 8, 8)}))
    assert par["exact"] and par["max_abs_diff"] == 0.0 and par["n_tensors_compared"] > 10
    assert m.opset_import[0].version == 19  # the input model is not modified


def test_onnx_converter_empty_axes_bug_is_covered():
    """onnx.version_converter (onnx 1.21) turns initializer axes into an empty axes attribute
    (reduce over all axes); to_opset keeps the axes, and a dynamic axes input is refused."""
    from onnx import TensorProto, helper, version_converter

    m = qdq_net(False, axes_initializer=True)
    plain = version_converter.convert_version(m, 17)
    rm = next(n for n in plain.graph.node if n.op_type == "ReduceMean")
    assert [list(a.ints) for a in rm.attribute if a.name == "axes"] == [[]]  # the bug
    conv, notes, reason = to_opset(m)
    rm = next(n for n in conv.graph.node if n.op_type == "ReduceMean")
    assert [list(a.ints) for a in rm.attribute if a.name == "axes"] == [[2, 3]]
    assert any("noop_with_empty_axes" in n for n in notes)
    m.graph.initializer.remove(next(i for i in m.graph.initializer if i.name == "axes"))
    m.graph.input.append(helper.make_tensor_value_info("axes", TensorProto.INT64, [2]))
    assert "computed at run time" in to_opset(m)[2]


def test_parity_detects_a_wrong_conversion():
    from onnx import numpy_helper

    m = qdq_net(False)
    conv, _, _ = to_opset(m)
    s = next(i for i in conv.graph.initializer if i.name == "r_s")
    s.CopyFrom(numpy_helper.from_array(np.float32(0.021), "r_s"))
    par = ort_parity(m, conv, parity_feed(m, {"input": (2, 3, 8, 8)}))
    assert not par["exact"] and par["max_abs_diff"] > 0


def test_no_opset17_form_is_reported_not_forced():
    from onnx import TensorProto, helper

    m = qdq_net(False)
    m.graph.node.append(helper.make_node("Relu", ["logits"], ["z"], domain="com.microsoft",
                                         name="ms"))
    assert "com.microsoft" in to_opset(m)[2]
    m = qdq_net(False)
    m.graph.initializer.append(helper.make_tensor("f8", TensorProto.FLOAT8E4M3FN, [1], [1.0]))
    assert "FP8" in to_opset(m)[2]
    # An op that does not exist at opset 17 (GroupNormalization-18): no exact form.
    g = helper.make_graph(
        [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 2, 2]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    conv, _, reason = to_opset(m)
    assert conv is None and reason
    m17 = conv_net(opset=17)
    assert to_opset(m17)[0] is m17  # already 17: unchanged


@pytest.fixture(scope="module")
def modelopt_int8(tmp_path_factory):
    """ModelOpt 0.47.0's real INT8 output (fp16 high-precision dtype, the `int8` recipe's) of a
    small opset-17 CNN with ReduceMean, calibrated on 16 seeded samples."""
    pytest.importorskip("modelopt.onnx.quantization")
    d = tmp_path_factory.mktemp("modelopt")
    from onnx import helper

    m = conv_net(opset=17)
    # GAP as ReduceMean(axes=[2,3]) so the opset-18 axes change is exercised
    gap = next(n for n in m.graph.node if n.op_type == "GlobalAveragePool")
    gap.op_type = "ReduceMean"
    gap.attribute.extend([helper.make_attribute("axes", [2, 3]),
                          helper.make_attribute("keepdims", 1)])
    save(m, d / "fp32.onnx")
    np.savez(d / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (16, 3, 8, 8)).astype(np.float32))
    p = subprocess.run([sys.executable, "-m", "modelopt.onnx.quantization", "--onnx_path",
                        str(d / "fp32.onnx"), "--quantize_mode", "int8", "--high_precision_dtype",
                        "fp16", "--calibration_data_path", str(d / "calib.npz"),
                        "--calibration_eps", "cpu", "--output_path", str(d / "int8.onnx")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return d


@pytest.mark.slow
def test_modelopt_output_is_opset19_and_converts_exactly(modelopt_int8):
    import onnx

    q = onnx.load(str(modelopt_int8 / "int8.onnx"))
    assert [o.version for o in q.opset_import if o.domain in ("", "ai.onnx")] == [19]
    conv, notes, reason = to_opset(q)
    assert reason is None, reason
    par = ort_parity(q, conv, parity_feed(q, {"input": (2, 3, 8, 8)}))
    assert par["exact"], par
    # the implicit path's cache keys are tensors of the FP32 source, through ModelOpt's Cast
    scales, skipped = calibration_scales(q, onnx.load(str(modelopt_int8 / "fp32.onnx")))
    assert "input" in scales and not skipped and all(s > 0 for s in scales.values())


def test_calibration_scales_follow_casts_and_skip_weights():
    src = conv_net(opset=17)  # names: input, r0..r3
    q = qdq_net(True)  # Q on Cast(input), weights quantized, r0 quantized
    scales, skipped = calibration_scales(q, src)
    assert scales == {"input": pytest.approx(0.03, rel=1e-3), "r0": pytest.approx(0.02,
                                                                                   rel=1e-3)}
    assert skipped == []


def test_calibration_cache_text_matches_tensorrt_written_cache():
    # A cache TensorRT 8.2.4 wrote (header TRT-8204): reading and re-writing it gives the bytes.
    real = read("calib_cache_8.2.4_cookbook_plugin_int8.cache")
    c = parse_calibration_cache(real)
    assert calibration_cache_text(c["scales"], encode_version_int((8, 2, 4))) == real
    real = read("calib_cache_qdq_translator_8600_yolov5_cudla_samples.cache")
    c = parse_calibration_cache(real)
    assert calibration_cache_text(c["scales"], 8600) == real
    text = calibration_cache_text({"x:0": 2 ** -7}, 100300)
    assert text == "TRT-100300-EntropyCalibration2\nx:0: 3c000000\n"
    with pytest.raises(StageError):
        calibration_cache_text({"x": 0.0}, 8601)
