"""Tests for the TensorRT build side without TensorRT: version rules, shapes and profiles, the
trtexec command lines (deploykit.trt.commands), the ONNX preparation for 8.x and DLA (deploykit.trt.onnx_prep), stage 6
(6_build_engines.py / .sh: dry runs, skipped rows, a build driven by a stand-in trtexec), the
stage-7 helpers (batch invariance, profile fit, plan-load diagnosis).

Parsers are tested on real captures in test_trt_parsers.py. Every model here is built by the
test itself. The stand-in trtexec used for the build tests replays a real captured DLA block
(tests/data/trt/, SOURCES.md) and writes placeholder files; it produces no TensorRT number.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import EvalData
from deploykit.models import parse_input_shape
from deploykit.runners import TrtRunner
from deploykit.trt.commands import build_command, plan_version_command
from deploykit.trt.detect import Detected, JETPACK_TRTEXEC, find_trtexec, version_conflicts
from deploykit.trt.onnx_prep import (
    calibration_cache_text,
    calibration_scales,
    ort_parity,
    parity_feed,
    to_opset,
)
from deploykit.trt.parsers import (
    decode_version_int,
    parse_calibration_cache,
    parse_ldd,
    parse_unknown_options,
)
from deploykit.trt.plans import batch_invariance, diagnose_plan_load, fit_batch
from deploykit.trt.profiles import (
    input_profiles,
    onnx_inputs,
    parse_shape_specs,
    shape_flags,
    trtexec_shape_name,
)
from deploykit.trt.rules import (
    DEFAULT_VARIANTS,
    UnsupportedVariant,
    dla_allowed,
    dla_unavailable,
    encode_version_int,
    full_version,
    int8_route,
    opset_advice,
    parse_version,
)
from deploykit.variants import VARIANTS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402

DATA = ROOT / "tests" / "data" / "trt"
F32 = np.dtype(np.float32)


def read(name: str) -> str:
    return (DATA / name).read_text()


# --------------------------------------------------------------------------------------------
# Models built by the tests
# --------------------------------------------------------------------------------------------
def save(model, path: Path) -> Path:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def conv_net(opset: int = 17, names=None, dynamic_hw: bool = False, fp16: bool = False,
             input_name: str = "input"):
    """[N,3,8,8] -> 4 x (Conv+Relu) -> GlobalAveragePool -> Flatten -> Gemm(10). ``names``
    renames the nodes (to match a captured DLA log)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    dt = np.float16 if fp16 else np.float32
    inits, nodes, x = [], [], input_name
    if fp16:
        nodes.append(helper.make_node("Cast", [x], ["x16"], to=TensorProto.FLOAT16, name="cin"))
        x = "x16"
    c = 3
    for i in range(4):
        inits.append(numpy_helper.from_array((rng.standard_normal((8, c, 3, 3)) * 0.3)
                                             .astype(dt), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1] * 4,
                                   name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x, c = f"r{i}", 8
    inits += [numpy_helper.from_array((rng.standard_normal((10, 8)) * 0.3).astype(dt), "fw")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["g"], name="gap"),
              helper.make_node("Flatten", ["g"], ["f"], name="flat"),
              helper.make_node("Gemm", ["f", "fw"], ["l"], transB=1, name="fc")]
    out = "l"
    if fp16:
        nodes.append(helper.make_node("Cast", ["l"], ["logits"], to=TensorProto.FLOAT,
                                      name="cout"))
        out = "logits"
    if names:
        for n, new in zip([n for n in nodes if n.op_type != "Cast"], names):
            n.name = new
    hw = ["H", "W"] if dynamic_hw else [8, 8]
    g = helper.make_graph(nodes, "net",
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT,
                                                         ["N", 3] + hw)],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 10])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def two_input_net(image: str = "image:0", tokens: str = "tokens"):
    """Two inputs with dynamic spatial and sequence axes: image [N,3,H,W], tokens [N,L,16]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "p")]
    nodes = [helper.make_node("Conv", [image, "w"], ["c"], name="conv"),
             helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("MatMul", [tokens, "p"], ["t"], name="proj"),
             helper.make_node("ReduceMean", ["t"], ["tm"], axes=[1], keepdims=0, name="pool"),
             helper.make_node("Add", ["f", "tm"], ["y"], name="add")]
    g = helper.make_graph(nodes, "two",
                          [helper.make_tensor_value_info(image, TensorProto.FLOAT,
                                                         ["N", 3, "H", "W"]),
                           helper.make_tensor_value_info(tokens, TensorProto.FLOAT,
                                                         ["N", "L", 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def qdq_net(fp16: bool, opset: int = 19, input_name: str = "input",
            axes_initializer: bool = False):
    """What ModelOpt 0.47 writes for a small CNN (compare tests below with its real output):
    opset 19, per-tensor activation Q/DQ, per-channel weight Q/DQ, ReduceMean with its axes as a
    Constant input (opset 18 form); ``fp16``: float16 weights, scales and compute with fp32 I/O
    casts (``--high_precision_dtype fp16``). ``axes_initializer``: the axes as an initializer and
    ``noop_with_empty_axes=0`` on ReduceMean, as in ModelOpt's EfficientNet-Lite0 output of the
    dynamo-exported (opset 18) model."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    dt = np.float16 if fp16 else np.float32
    w0 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    w1 = (rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32)
    fw = (rng.standard_normal((10, 8)) * 0.3).astype(np.float32)

    def t(name, arr, dtype=dt):
        return numpy_helper.from_array(np.asarray(arr).astype(dtype), name)

    inits = [t("w0", w0), t("w1", w1), t("fw", fw),
             t("w0_s", np.abs(w0).reshape(8, -1).max(1) / 127), t("w1_s",
                                                                   np.abs(w1).reshape(8, -1).max(1)
                                                                   / 127),
             t("x_s", np.float32(0.03)), t("r_s", np.float32(0.02)),
             t("zp8", np.zeros(8, np.int8), np.int8), t("zp", np.int8(0), np.int8)]
    x = input_name
    nodes = []
    if fp16:
        nodes.append(helper.make_node("Cast", [x], ["x16"], to=TensorProto.FLOAT16,
                                      name="input_cast_to_fp16"))
        x = "x16"
    axes = numpy_helper.from_array(np.array([2, 3], np.int64), "axes")
    if axes_initializer:
        inits.append(axes)
    else:
        nodes.append(helper.make_node("Constant", [], ["axes"], name="axes_const", value=axes))
    nodes += [
        helper.make_node("QuantizeLinear", [x, "x_s", "zp"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "x_s", "zp"], ["xd"], name="x_dq"),
        helper.make_node("QuantizeLinear", ["w0", "w0_s", "zp8"], ["w0q"], axis=0, name="w0_q"),
        helper.make_node("DequantizeLinear", ["w0q", "w0_s", "zp8"], ["w0d"], axis=0,
                         name="w0_dq"),
        helper.make_node("Conv", ["xd", "w0d"], ["c0"], pads=[1] * 4, name="conv0"),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("QuantizeLinear", ["r0", "r_s", "zp"], ["rq"], name="r_q"),
        helper.make_node("DequantizeLinear", ["rq", "r_s", "zp"], ["rd"], name="r_dq"),
        helper.make_node("QuantizeLinear", ["w1", "w1_s", "zp8"], ["w1q"], axis=0, name="w1_q"),
        helper.make_node("DequantizeLinear", ["w1q", "w1_s", "zp8"], ["w1d"], axis=0,
                         name="w1_dq"),
        helper.make_node("Conv", ["rd", "w1d"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("ReduceMean", ["r1", "axes"], ["m"], keepdims=0, name="gap",
                         **({"noop_with_empty_axes": 0} if axes_initializer else {})),
        helper.make_node("Gemm", ["m", "fw"], ["l16" if fp16 else "logits"], transB=1,
                         name="fc")]
    if fp16:
        nodes.append(helper.make_node("Cast", ["l16"], ["logits"], to=TensorProto.FLOAT,
                                      name="logits_cast_to_fp32"))
    g = helper.make_graph(nodes, "qdq",
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT,
                                                         ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------
def test_parse_and_encode_versions():
    assert parse_version("10.3.0.30") == (10, 3, 0, 30)
    assert parse_version("v8.6") == (8, 6)
    with pytest.raises(UsageError):
        parse_version("ten")
    assert full_version((8, 6)) == (8, 6, 0)
    # NV_TENSORRT_VERSION as in real calibration-cache headers (TRT-8204, TRT-8600) and banners
    for v, n in (((8, 2, 4), 8204), ((8, 6, 1), 8601), ((10, 3, 0), 100300),
                 ((10, 16, 1), 101601), ((11, 0, 0), 110000)):
        assert encode_version_int(v) == n and decode_version_int(n) == v


# --------------------------------------------------------------------------------------------
# Rules: DLA availability and INT8 path per version
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version,available", [
    ((8, 5, 2), True), ((8, 6, 2), True), ((10, 3, 0), True), ((10, 7, 0), True),
    ((10, 8, 0), False), ((10, 16, 1), False), ((11, 0, 0), False), ((11, 4, 0), False),
    ((11, 4, 1), True), ((11, 5, 0), True)])
def test_dla_availability_per_version(version, available):
    assert (dla_unavailable(version) is None) == available


def test_dla_allowed_per_variant():
    v = VARIANTS
    assert "FP16/INT8 layers only" in dla_allowed((8, 6, 2), v["fp32"])
    assert "FP16/INT8 layers only" in dla_allowed((10, 3, 0), v["int4"])
    assert dla_allowed((8, 6, 2), v["int8"]) is None
    assert dla_allowed((11, 4, 1), v["fp16"]) is None
    assert "built for the GPU" in dla_allowed((11, 4, 1), v["int8"])
    assert "10.7 was the last" in dla_allowed((10, 16, 1), v["fp16"])


@pytest.mark.parametrize("version,dla,opset,route", [
    ((8, 6, 2), False, 17, "qdq"), ((8, 6, 2), False, 19, "qdq_opset17"),
    ((8, 5, 2), False, None, "qdq_opset17"), ((8, 6, 2), True, 17, "implicit"),
    ((10, 3, 0), True, 19, "implicit"), ((10, 3, 0), False, 19, "qdq"),
    ((11, 1, 0), False, 21, "qdq")])
def test_int8_route_per_version_and_device(version, dla, opset, route):
    assert int8_route(version, VARIANTS["int8"], dla, opset)[0] == route
    assert int8_route(version, VARIANTS["fp16"], dla, opset) == (None, "")


def test_int8_route_forced_paths():
    assert int8_route((8, 6, 2), VARIANTS["int8"], False, 19, "implicit")[0] == "implicit"
    with pytest.raises(UsageError, match="DLA takes INT8 from a calibration cache"):
        int8_route((8, 6, 2), VARIANTS["int8"], True, 17, "qdq")
    with pytest.raises(UsageError, match="no implicit INT8"):
        int8_route((11, 0, 0), VARIANTS["int8"], False, 21, "implicit")


def test_opset_advice_texts():
    q = opset_advice(19, (8, 6, 2), quantized=True)
    assert "ModelOpt 0.47.0 writes INT8 Q/DQ at opset >= 19" in q
    assert "re-exporting at 17 does not help" in q and "--int8-path implicit" in q
    f = opset_advice(18, (8, 6, 2), quantized=False)
    assert "--exporter legacy --opset 17" in f and "ModelOpt" not in f
    assert opset_advice(17, (8, 6, 2), quantized=True) is None
    assert opset_advice(19, (10, 3, 0), quantized=True) is None


# --------------------------------------------------------------------------------------------
# Shapes: every input, every dynamic axis
# --------------------------------------------------------------------------------------------
IMG = [("input", [None, 3, 224, 224], F32)]


def test_profiles_every_input_and_dynamic_axis():
    inputs = onnx_inputs(two_input_net())
    ps = input_profiles(inputs, input_shapes=["image:0:1,3,64,48", "tokens:1,20,16"],
                           min_batch=1, opt_batch=4, max_batch=8)
    assert [(p.name, p.min, p.opt, p.max) for p in ps] == [
        ("image:0", (1, 3, 64, 48), (4, 3, 64, 48), (8, 3, 64, 48)),
        ("tokens", (1, 20, 16), (4, 20, 16), (8, 20, 16))]
    flags = shape_flags(ps)
    # trtexec's syntax: all inputs in one list, a name with ":" quoted (trtexec --help).
    assert flags == ["--minShapes='image:0':1x3x64x48,tokens:1x20x16",
                     "--optShapes='image:0':4x3x64x48,tokens:4x20x16",
                     "--maxShapes='image:0':8x3x64x48,tokens:8x20x16"]


def test_profiles_ranges_for_spatial_and_sequence_axes():
    inputs = onnx_inputs(two_input_net())
    ps = input_profiles(
        inputs, input_shapes=["'image:0':1,3,64,64"],
        min_shapes=parse_shape_specs(["tokens:1x4x16"]),
        opt_shapes=parse_shape_specs(["tokens:2x32x16"]),
        max_shapes=parse_shape_specs(["tokens:8x128x16"]))
    assert ps[1].min == (1, 4, 16) and ps[1].max == (8, 128, 16)
    assert ps[1].source == "--min/--opt/--max-shapes"
    # --opt-shapes alone fixes min = opt = max, as trtexec does
    ps = input_profiles(inputs, input_shapes=["image:0:1,3,64,64"],
                           opt_shapes=parse_shape_specs(["tokens:2x32x16"]))
    assert ps[1].static_profile and ps[1].opt == (2, 32, 16)


def test_dynamic_hw_without_a_size_is_a_usage_error_naming_the_fix():
    inputs = onnx_inputs(two_input_net())
    with pytest.raises(UsageError) as e:
        input_profiles(inputs, input_shapes=["tokens:1,20,16"])
    msg = str(e.value)
    assert "'image:0' axis 2 is dynamic" in msg and "--input-shape 'image:0':N,3,N,N" in msg
    # a classifier's crop fills H/W of its image input
    ps = input_profiles(onnx_inputs(conv_net(dynamic_hw=True)), default_hw=224)
    assert ps[0].opt == (1, 3, 224, 224) and "crop 224" in ps[0].source


def test_profile_errors():
    inputs = onnx_inputs(two_input_net())
    with pytest.raises(UsageError, match="no input 'imag'"):
        input_profiles(inputs, input_shapes=["imag:1,3,8,8", "tokens:1,2,16"])
    with pytest.raises(UsageError, match="3 dims, the ONNX input has 4"):
        input_profiles(inputs, input_shapes=["image:0:1,3,8", "tokens:1,2,16"])
    with pytest.raises(UsageError, match="fixes it to 16"):
        input_profiles(inputs, input_shapes=["image:0:1,3,8,8", "tokens:1,2,17"])
    with pytest.raises(UsageError, match="min <= opt <= max"):
        input_profiles(inputs, input_shapes=["image:0:1,3,8,8"],
                          min_shapes={"tokens": (1, 9, 16)}, opt_shapes={"tokens": (1, 4, 16)},
                          max_shapes={"tokens": (1, 9, 16)})
    with pytest.raises(UsageError, match="--opt-shapes alone or all of"):
        input_profiles(inputs, input_shapes=["image:0:1,3,8,8"],
                          min_shapes={"tokens": (1, 4, 16)}, opt_shapes={"tokens": (1, 4, 16)})
    with pytest.raises(UsageError, match="--min-batch"):
        input_profiles(IMG, min_batch=4, opt_batch=2, max_batch=8)


def shared_dim_net():
    """Two inputs that share the named dims N and L: tokens [N, L, 16], mask [N, L]."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("ReduceSum", ["tokens"], ["t"], axes=[2], keepdims=0, name="sum"),
             helper.make_node("Add", ["t", "mask"], ["y"], name="add")]
    g = helper.make_graph(nodes, "shared",
                          [helper.make_tensor_value_info("tokens", TensorProto.FLOAT,
                                                         ["N", "L", 16]),
                           helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", "L"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 8
    return m


def test_named_dims_need_overlapping_profile_ranges(tmp_path):
    """Inputs with the same ONNX dim name must get overlapping profile intervals (TensorRT
    samples/sampleNamedDimensions README, 8.5.1+): disjoint ones are a usage error naming the dim,
    not a trtexec failure after the build started."""
    model = "mypkg.seq:build"
    save(shared_dim_net(), tmp_path / "a" / "mypkg.seq-build" / "onnx" / "fp32.onnx")
    ok = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
                "--input-shape", "tokens:1,20,16", "--input-shape", "mask:1,20", model=model)
    assert ok.returncode == 0 and len(trtexec_lines(ok.stdout)) == 1, ok.stderr
    p = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
               "--input-shape", "tokens:1,20,16", "--input-shape", "mask:1,30", model=model)
    assert p.returncode == 2 and trtexec_lines(p.stdout) == [], p.stdout
    assert "'L'" in p.stderr and "tokens axis 1" in p.stderr and "mask axis 1" in p.stderr


def test_names_trtexec_cannot_write_are_refused():
    with pytest.raises(UsageError, match="cannot be written in trtexec's shape syntax"):
        shape_flags(input_profiles([("a,b", [None, 3], F32)], default_hw=None))
    with pytest.raises(UsageError):
        trtexec_shape_name("it's")
    assert trtexec_shape_name("x") == "x" and trtexec_shape_name("x:0") == "'x:0'"


def test_shape_spec_parsing():
    assert parse_shape_specs(["'in:0':1x3x8x8,b:2x5", "c:0:4x4"]) == {
        "in:0": (1, 3, 8, 8), "b": (2, 5), "c:0": (4, 4)}
    assert parse_input_shape("tokens:1,16:int64") == ("tokens", (1, 16), "int64")
    assert parse_input_shape("input:0:1,3,32,32") == ("input:0", (1, 3, 32, 32), None)
    assert parse_input_shape("1x3x8x8") == (None, (1, 3, 8, 8), None)
    for bad in (["x:1x0"], ["x:"], ["1x3"], ["a:1,a:2"]):
        with pytest.raises(UsageError):
            parse_shape_specs(bad)
    with pytest.raises(UsageError, match="unknown dtype"):
        parse_input_shape("x:1,2:notatype")


def test_static_profile_for_dla():
    ps = input_profiles(IMG, min_batch=1, opt_batch=2, max_batch=64, static=True)
    assert ps[0].min == ps[0].opt == ps[0].max == (2, 3, 224, 224)
    assert "static for DLA" in ps[0].source
    assert input_profiles([("x", [1, 3, 8, 8], F32)])[0].dynamic is False
    assert shape_flags(input_profiles([("x", [1, 3, 8, 8], F32)])) == []


# --------------------------------------------------------------------------------------------
# Command lines per TensorRT version
# --------------------------------------------------------------------------------------------
V86, V103, V1016, V110 = (8, 6, 1), (10, 3, 0), (10, 16, 1), (11, 0, 0)
WEAK_FLAGS = {"--fp16", "--int8", "--best"}
REMOVED_IN_10 = ("--workspace", "--explicitBatch", "--buildOnly")


def cmd(variant, version, static=False, **kw):
    kw.setdefault("timing_cache", "e/timing.cache")
    kw.setdefault("layer_info", f"e/{variant}.layers.json")
    kw.setdefault("profiles", input_profiles(IMG, max_batch=64, static=static))
    return build_command(f"o/{variant}.onnx", f"e/{variant}.plan", variant, version, **kw)


def flags(c):
    return {a.split("=")[0] for a in c[1:]}


@pytest.mark.parametrize("variant,expected", [
    ("fp32", set()), ("fp16", {"--fp16"}), ("int8", {"--int8", "--fp16"}),
    ("int8_hp32", {"--int8"})])
def test_commands_trt8(variant, expected):
    c = cmd(variant, V86)
    assert flags(c) & WEAK_FLAGS == expected
    assert "--stronglyTyped" not in flags(c)
    assert "--timingCacheFile=e/timing.cache" in c
    assert {"--profilingVerbosity=detailed", f"--exportLayerInfo=e/{variant}.layers.json"} <= set(c)
    assert not any(a.startswith(REMOVED_IN_10) for a in c)


@pytest.mark.parametrize("variant", ["int4", "int4_cli_broken"])
def test_commands_trt8_int4_unsupported(variant):
    with pytest.raises(UnsupportedVariant):
        cmd(variant, V86)


@pytest.mark.parametrize("version", [V103, V1016])
@pytest.mark.parametrize("variant,strong", [
    ("fp32", False), ("fp16", True), ("int8", True), ("int8_hp32", True), ("int4", True),
    ("int4_cli_broken", True)])
def test_commands_trt10(version, variant, strong):
    c = cmd(variant, version)
    assert ("--stronglyTyped" in c) == strong
    assert not flags(c) & WEAK_FLAGS  # precision comes from the ONNX file
    assert not any(a.startswith(REMOVED_IN_10) for a in c)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_commands_trt11_never_weak_flags(variant):
    c = cmd(variant, V110, mem_pool_mb=2048)
    assert not flags(c) & WEAK_FLAGS
    assert "--stronglyTyped" not in c  # 11.x: a documented no-op
    assert not any(a.startswith(REMOVED_IN_10 + ("--precisionConstraints", "--calib")) for a in c)
    # and nothing 11.0 reported as unknown in the captured log
    log = read("trtexec_11.0.0_b200_stronglytyped_skipinference_then_unknown_option_fp16_int8_best.log")
    rejected = {o.split("=")[0] for o in parse_unknown_options(log)}
    assert not flags(c) & rejected
    assert "--memPoolSize=workspace:2048" in c


def test_commands_dynamic_and_static_shapes():
    c = cmd("fp32", V103, profiles=input_profiles(IMG, min_batch=1, opt_batch=8,
                                                     max_batch=32))
    assert {"--minShapes=input:1x3x224x224", "--optShapes=input:8x3x224x224",
            "--maxShapes=input:32x3x224x224"} <= set(c)
    c = cmd("fp32", V103, profiles=input_profiles([("input", [1, 3, 224, 224], F32)]))
    assert not any(a.startswith(("--minShapes", "--optShapes", "--maxShapes")) for a in c)


@pytest.mark.parametrize("version", [(8, 5, 2), V86, (9, 3, 0), (10, 0, 1), V103, V1016, V110])
def test_commands_mem_pool_units(version):
    """A plain number is MiB in every trtexec (8.x-9.x: "in MiB"; 10.1+: "If none of suffixes
    is appended, the defualt unit is in MiB"). A suffix is not: trtexec 10.0.x multiplies
    "1024M" by 2**20 and then again by 2**20 as MiB (sampleOptions.cpp stringToValue<double> x
    getUnitMultiplier, sampleEngines.cpp roundToBytes, tag v10.0.1): a limit 2**20 times the one asked for."""
    c = cmd("fp16", version, mem_pool_mb=1024)
    assert "--memPoolSize=workspace:1024" in c
    assert not any(a.startswith("--memPoolSize") for a in cmd("fp16", V103))
    with pytest.raises(UsageError):
        cmd("fp16", V103, mem_pool_mb=0)


def test_commands_dla_rules():
    for version in ((8, 5, 2), V86, V103):
        c = cmd("fp16", version, static=True, dla_core=0)
        assert "--useDLACore=0" in c and "--allowGPUFallback" in c  # only together
        assert "--fp16" in c and "--stronglyTyped" not in c  # DLA path is weakly typed
        assert "--maxShapes=input:1x3x224x224" in c  # static profile
        c = cmd("int8", version, static=True, dla_core=1, int8="implicit", calib="e/int8.cache")
        assert {"--useDLACore=1", "--allowGPUFallback", "--int8", "--fp16",
                "--calib=e/int8.cache"} <= set(c)
    assert not any(a.startswith(("--useDLACore", "--allowGPUFallback")) for a in cmd("fp16", V103))
    with pytest.raises(UsageError, match="static profile"):
        cmd("fp16", V86, dla_core=0)  # 1/1/64 batch profile
    with pytest.raises(UsageError, match="not from Q/DQ nodes"):
        cmd("int8", V86, static=True, dla_core=0)  # Q/DQ INT8 on DLA
    with pytest.raises(UsageError, match="FP16/INT8"):
        cmd("fp32", V86, static=True, dla_core=0)
    with pytest.raises(UsageError, match="FP16/INT8"):
        cmd("int4", V103, static=True, dla_core=0)
    with pytest.raises(UsageError, match="no DLA support"):
        cmd("fp16", V110, static=True, dla_core=0)
    with pytest.raises(UsageError, match="10.7 was the last"):
        cmd("fp16", V1016, static=True, dla_core=0)
    with pytest.raises(UsageError):
        cmd("fp16", V86, static=True, dla_core=-1)
    c = cmd("fp16", (11, 4, 1), static=True, dla_core=0)
    assert {"--useDLACore=0", "--allowGPUFallback"} <= set(c) and not flags(c) & WEAK_FLAGS


def test_commands_implicit_int8():
    c = cmd("int8_hp32", V86, int8="implicit", calib="e/c.cache")
    assert {"--int8", "--calib=e/c.cache"} <= set(c) and "--fp16" not in c
    c = cmd("int8", V103, int8="implicit", calib="e/c.cache")  # weak path on 10.x
    assert {"--int8", "--fp16", "--calib=e/c.cache"} <= set(c) and "--stronglyTyped" not in c
    with pytest.raises(UsageError, match="needs a calibration cache"):
        cmd("int8", V86, int8="implicit")
    with pytest.raises(UnsupportedVariant, match="no implicit INT8"):
        cmd("int8", V110, int8="implicit", calib="e/c.cache")


def test_commands_bad_input():
    with pytest.raises(UsageError):
        cmd("fp64", V103)
    with pytest.raises(UsageError):
        cmd("fp32", (7, 2, 3))


@pytest.mark.parametrize("version", [(8, 0, 1), (8, 2, 1), (8, 4, 3)])
def test_commands_refuse_tensorrt_before_8_5(version):
    """Stage 7 runs engines with enqueueV3 / setInputShape (NvInferRuntime.h from tag 8.5.1;
    absent at 8.4.3), and trtexec 8.2 has no --memPoolSize: 8.0-8.4 are refused, not printed."""
    with pytest.raises(UsageError, match=r"8\.5\+ needed.*enqueueV3"):
        cmd("fp32", version)


def test_stage6_dry_run_refuses_tensorrt_before_8_5(tmp_path):
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.2.1", "fp32")
    assert p.returncode == 2 and "TensorRT 8.2.1 is not supported" in p.stderr, p.stderr
    assert trtexec_lines(p.stdout) == []


def test_plan_version_command_per_version():
    assert plan_version_command("p.plan", V86) is None  # 8.6 trtexec has no such flag
    assert plan_version_command("p.plan", V103, "trtexec") == [
        "trtexec", "--loadEngine=p.plan", "--getPlanVersionOnly"]
    assert plan_version_command("p.plan", V110) is not None


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------
def test_version_conflicts():
    base = dict(trtexec="t", banner=(10, 3, 0), header=(10, 3, 0), libnvinfer="/l/libnvinfer.so.10",
                libnvinfer_version=(10, 3, 0), python_runtime=(10, 3, 0, 30), python_detail="",
                env={})
    assert version_conflicts(Detected(**base)) == []
    p = version_conflicts(Detected(**{**base, "libnvinfer_version": (10, 8, 0)}))
    assert any("loads libnvinfer 10.8.0" in m for m in p)
    p = version_conflicts(Detected(**{**base, "python_runtime": (8, 6, 1, 6)}))
    assert any("Python runtime" in m for m in p)
    p = version_conflicts(Detected(**{**base, "libnvinfer": None, "libnvinfer_version": None}))
    assert any("no libnvinfer" in m for m in p)


def test_find_trtexec(tmp_path):
    exe = tmp_path / "trtexec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_trtexec({"TRTEXEC": str(exe)}) == (exe, "TRTEXEC")
    assert find_trtexec({"PATH": str(tmp_path)})[0] == exe
    p, why = find_trtexec({"TRTEXEC": str(tmp_path / "nope")})
    assert p is None and "not an executable" in why


def test_parse_ldd_real_output():
    out = subprocess.run(["ldd", sys.executable], capture_output=True, text=True).stdout
    libs = parse_ldd(out + "\tlibnvinfer.so.10 => not found\n")
    assert libs["libnvinfer.so.10"] is None
    assert any(k.startswith("libc.so") and v and Path(v).exists() for k, v in libs.items())


def test_trt_modules_import_no_tensorrt():
    code = ("import sys, trt_tools, deploykit.trt.rules, deploykit.trt.profiles, "
            "deploykit.trt.commands, deploykit.trt.plans, deploykit.trt.detect, "
            "deploykit.trt.parsers, deploykit.trt.onnx_prep; "
            "assert 'tensorrt' not in sys.modules; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr


def test_detect_command_runs_without_trtexec(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))
    env.pop("TRTEXEC", None)
    p = subprocess.run([sys.executable, "trt_tools.py", "detect"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert "trtexec" in out and "jetson" in out


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


# --------------------------------------------------------------------------------------------
# Stage 7 helpers
# --------------------------------------------------------------------------------------------
def _linear_infer(w, batch_dependent: float = 0.0, calls=None):
    def infer(feed):
        x = next(iter(feed.values()))
        if calls is not None:
            calls.append(len(x))
        y = x.reshape(len(x), -1) @ w
        if batch_dependent and len(x) > 1:
            y = y + batch_dependent * np.sign(y)  # a different "kernel" at batch > 1
        return {"logits": y.astype(np.float32)}
    return infer


def test_batch_invariance_passes_and_pads_to_batch_n():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 3, 2, 2)).astype(np.float32), rng.standard_normal((12, 10))
    calls = []
    r = batch_invariance(_linear_infer(w, calls=calls), {"input": x}, 4)
    assert r["ok"] and r["top1_agreement"] == 1.0 and r["max_abs_diff"] < 1e-5
    assert r["note"] is None
    assert calls == [1] * 5 + [4, 4]  # every batch-N call really has N rows


def test_batch_invariance_flags_batch_dependent_outputs():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 3, 2, 2)).astype(np.float32), rng.standard_normal((12, 10))
    r = batch_invariance(_linear_infer(w, batch_dependent=0.5), {"input": x}, 3)
    assert not r["ok"] and r["max_abs_diff"] == pytest.approx(0.5, rel=1e-5)
    assert "no TensorRT release note" in r["note"] and "NVIDIA/TensorRT#4796" in r["note"]
    with pytest.raises(UsageError):
        batch_invariance(_linear_infer(w), {"input": x}, 1)


def test_fit_batch():
    prof = ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))
    assert fit_batch(prof, 64, (3, 224, 224)) == 32
    assert fit_batch(((4, 3, 8, 8),) * 3, 64, (3, 8, 8)) == 4  # static DLA profile
    with pytest.raises(UsageError, match="rebuild with 6_build_engines.sh"):
        fit_batch(prof, 8, (3, 256, 256))


def test_diagnose_plan_load_reads_the_file(tmp_path):
    onnx_file = save(conv_net(), tmp_path / "m.onnx")
    r = diagnose_plan_load(onnx_file, read("plan_magic_tag_8.x_onnx_read_as_plan.txt"),
                              (8, 6, 1, 6))
    assert r["kind"] == "not_a_plan" and "Fix:" in r["text"]
    (tmp_path / "empty.plan").write_bytes(b"")
    assert diagnose_plan_load(tmp_path / "empty.plan", "", None)["kind"] == "not_a_plan"


# --------------------------------------------------------------------------------------------
# Stage 6 as a user runs it (no TensorRT here)
# --------------------------------------------------------------------------------------------
def _env(tmp_path, model="mobilenet_v3_small") -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL=model, PATH="/usr/bin:/bin", PYTHON=sys.executable)
    env.pop("TRTEXEC", None)
    return env


def stage6(tmp_path, *args, model="mobilenet_v3_small", env=None):
    return subprocess.run(["bash", "6_build_engines.sh", *args], cwd=ROOT,
                          env=env or _env(tmp_path, model), capture_output=True, text=True,
                          timeout=300)


def trtexec_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("trtexec --onnx")]


def test_stage6_skips_without_trtexec(tmp_path):
    if Path(JETPACK_TRTEXEC).exists():
        pytest.skip("trtexec is installed here")
    p = stage6(tmp_path)
    assert p.returncode == 0, p.stderr
    assert "SKIPPED" in p.stdout and "trtexec not found" in p.stdout
    rows = sorted((tmp_path / "r" / "mobilenet_v3_small").glob("trt_build_*.json"))
    assert [r.stem for r in rows] == sorted(f"trt_build_{v}" for v in DEFAULT_VARIANTS)
    for r in rows:
        rec = json.loads(r.read_text())
        assert rec["status"] == "skipped" and "trtexec not found" in rec["reason"]
        assert rec["backend"] == "TensorRT" and rec["stage"] == "6_build_engines"
        assert not any(k in rec for k in ("trtexec_perf", "latency", "size_mb"))  # no numbers
    assert json.loads((tmp_path / "r/mobilenet_v3_small/trt_build_int4_cli_broken.json").read_text()
                      )["expected_failure"] is True
    assert not (tmp_path / "a" / "mobilenet_v3_small" / "engines").exists()


def test_stage6_bad_trtexec_env_skips_with_reason(tmp_path):
    env = {**_env(tmp_path), "TRTEXEC": str(tmp_path / "missing" / "trtexec")}
    p = stage6(tmp_path, "fp16", env=env)
    assert p.returncode == 0, p.stderr
    rec = json.loads((tmp_path / "r/mobilenet_v3_small/trt_build_fp16.json").read_text())
    assert rec["status"] == "skipped" and "is not an executable file" in rec["reason"]
    assert not (tmp_path / "r/mobilenet_v3_small/trt_build_fp32.json").exists()


@pytest.mark.parametrize("extra", [["bogus"], ["--dry-run"], ["--dla-min-fraction", "0.5"],
                                   ["--dla-core", "0", "--dla-min-fraction", "2"],
                                   ["--max-batch", "0"]])
def test_stage6_usage_errors_exit_2(tmp_path, extra):
    p = stage6(tmp_path, *extra)
    assert p.returncode == 2 and "usage:" in p.stderr, p.stderr


def test_stage6_help_shows_every_flag_with_help():
    p = subprocess.run([sys.executable, "6_build_engines.py", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0
    for f in ("--input-shape", "--min-shapes", "--opt-shapes", "--max-shapes", "--dla-core",
              "--dla-min-fraction", "--int8-path", "--trt-version", "--model"):
        assert f in p.stdout
    assert "Stage 6: build one TensorRT engine per ONNX variant" in p.stdout


@pytest.mark.parametrize("version,present,absent", [
    ("8.6.1", ["--fp16", "--int8"], ["--stronglyTyped", "--getPlanVersionOnly"]),
    ("10.3.0", ["--stronglyTyped", "--getPlanVersionOnly"], ["--fp16", "--int8"]),
    ("11.0.0", ["--getPlanVersionOnly"], ["--fp16", "--int8", "--best", "--stronglyTyped"]),
])
def test_stage6_dry_run(tmp_path, version, present, absent):
    p = stage6(tmp_path, "--dry-run", "--trt-version", version)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("trtexec")]
    words = {w.split("=")[0] for ln in lines for w in ln.split()}
    assert all(f in words for f in present) and not any(f in words for f in absent)
    assert len(trtexec_lines(p.stdout)) == (4 if version.startswith("8") else 6)
    assert not (tmp_path / "r").exists() and not (tmp_path / "a").exists()  # writes nothing


def test_stage6_dry_run_custom_model_two_inputs_colon_name_dynamic_hw(tmp_path):
    """The three faults of issue 13 on a custom model: only the first input got shapes, a name
    with ':' was unquoted, dynamic H/W raised TypeError."""
    model = "mypkg.net:build"
    art = tmp_path / "a" / "mypkg.net-build" / "onnx"
    save(two_input_net(), art / "fp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
               "--input-shape", "image:0:1,3,64,64", "--input-shape", "tokens:1,20,16",
               "--max-batch", "8", model=model)
    assert p.returncode == 0, p.stderr
    (line,) = trtexec_lines(p.stdout)
    args = line.split()
    assert "'--minShapes='\"'\"'image:0'\"'\"':1x3x64x64,tokens:1x20x16'" in args
    assert "'--maxShapes='\"'\"'image:0'\"'\"':8x3x64x64,tokens:8x20x16'" in args
    # without sizes for H/W: a usage error naming the input and the flag, not a traceback
    p = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
               model=model)
    assert p.returncode == 2 and "'image:0' axis 2 is dynamic" in p.stderr
    assert "Traceback" not in p.stderr


def test_stage6_dry_run_dla_static_implicit_and_refusals(tmp_path):
    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(fp16=True), d / "fp16.onnx")
    save(conv_net(opset=17), d / "fp32.onnx")
    save(qdq_net(False), d / "int8.onnx")
    for version in ("8.5.2", "8.6.2", "10.3.0"):
        p = stage6(tmp_path, "--dry-run", "--trt-version", version, "--dla-core", "0",
                   "fp32", "fp16", "int8")
        assert p.returncode == 0, p.stderr
        fp32, fp16, int8 = trtexec_lines(p.stdout)
        assert "--useDLACore" not in fp32 and "--maxShapes=input:64x3x8x8" in fp32
        assert {"--useDLACore=0", "--allowGPUFallback", "--fp16",
                "--maxShapes=input:1x3x8x8"} <= set(fp16.split())
        assert "--onnx=" + str(d / "fp32.onnx") in int8.split()  # implicit: FP32 ONNX + cache
        assert {"--int8", "--fp16", "--useDLACore=0", "--maxShapes=input:1x3x8x8"} <= set(
            int8.split())
        assert any(w.startswith("--calib=") and w.endswith("int8.calib.cache")
                   for w in int8.split())
        assert "DLA takes INT8 from a calibration cache" in p.stdout
        assert "calibration cache: 2 activation scales" in p.stdout
    # a version without DLA: the dry run refuses as the build does (exit 2, the reason), it does
    # not print GPU command lines that the build would never run
    for version, why in (("10.16.1", "10.7 was the last"), ("11.0.0", "no DLA support"),
                         ("11.4.0", "no DLA support")):
        p = stage6(tmp_path, "--dry-run", "--trt-version", version, "--dla-core", "0", "fp16")
        assert p.returncode == 2 and why in p.stderr and "--dla-core" in p.stderr, p.stderr
        assert trtexec_lines(p.stdout) == []


def test_stage6_dry_run_trt8_converts_opset19_qdq(tmp_path):
    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(opset=17), d / "fp32.onnx")
    save(qdq_net(True), d / "int8.onnx")
    save(qdq_net(False), d / "int8_hp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "int8", "int8_hp32")
    assert p.returncode == 0, p.stderr
    int8, hp32 = trtexec_lines(p.stdout)
    assert str(tmp_path / "a/mobilenet_v3_small/engines/int8.opset17.onnx") in int8
    assert {"--int8", "--fp16"} <= set(int8.split()) and "--fp16" not in hp32.split()
    assert "opset 19 -> 17" in p.stdout and "widened to float32" in p.stdout
    assert "ModelOpt 0.47.0 writes INT8 Q/DQ at opset >= 19" in p.stdout  # the advice text
    assert "re-export with" not in p.stdout  # the old advice that could not work
    # forcing the implicit path
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "--int8-path", "implicit", "int8")
    (line,) = trtexec_lines(p.stdout)
    assert "fp32.onnx" in line and "--calib=" in line


def test_stage6_dry_run_unconvertible_qdq_takes_implicit_path(tmp_path):
    from onnx import helper

    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(opset=17), d / "fp32.onnx")
    m = qdq_net(False)
    m.graph.node.append(helper.make_node("Relu", ["logits"], ["z"], domain="com.microsoft"))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save(m, d / "int8.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "int8")
    assert p.returncode == 0, p.stderr
    assert "no exact opset-17 copy of int8.onnx" in p.stdout and "implicit INT8 instead" in p.stdout
    assert "--calib=" in trtexec_lines(p.stdout)[0]
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "--int8-path", "qdq", "int8")
    assert "not built" in p.stdout and "no exact opset-17 form" in p.stdout


def test_stage6_dry_run_trt8_float_files_above_17(tmp_path):
    """TensorRT 8.x gets an exact opset-17 copy of any file it reads; a file without one is
    skipped with the re-export advice, never passed to the 8.x parser as is."""
    from onnx import helper

    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(opset=18), d / "fp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.1", "fp32")
    assert p.returncode == 0, p.stderr
    assert "fp32.onnx is opset 18" in p.stdout and "fp32.opset17.onnx" in trtexec_lines(p.stdout)[0]
    assert trtexec_lines(stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0",
                                "fp32").stdout)[0].split()[1] == f"--onnx={d / 'fp32.onnx'}"
    m = conv_net(opset=18)
    m.graph.node.append(helper.make_node("Relu", ["l"], ["z"], domain="com.microsoft"))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save(m, d / "fp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.1", "fp32")
    assert p.returncode == 0 and trtexec_lines(p.stdout) == []
    assert "not built" in p.stdout and "--exporter legacy --opset 17" in p.stdout


def int4_net():
    """INT4 weight-only: a blocked DequantizeLinear of INT4 weights into a MatMul, opset 21 (the
    first opset with INT4 and block_size), as ModelOpt's INT4 output."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(3).integers(-8, 8, (16, 8)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=16,
                              name="w_dq"),
             helper.make_node("MatMul", ["input", "w"], ["logits"], name="mm")]
    g = helper.make_graph(
        nodes, "int4", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor("wq", TensorProto.INT4, [16, 8], w.flatten().tolist()),
         numpy_helper.from_array(np.full((1, 8), 0.1, np.float32), "ws")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("variant", ["int4", "int4_cli_broken"])
def test_stage6_dry_run_int4_on_trt8_says_int4_needs_10(tmp_path, variant):
    """An INT4 file on TensorRT 8.x is skipped because INT4 needs TensorRT 10+, not with advice to
    re-export at opset 17 (an INT4 file has no opset-17 form, and stage 2 does not make it)."""
    save(int4_net(), tmp_path / "a" / "mobilenet_v3_small" / "onnx" / f"{variant}.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.1", variant)
    assert p.returncode == 0, p.stderr
    skip = [ln for ln in p.stdout.splitlines() if "not built" in ln]
    assert len(skip) == 1 and "INT4 weight-only Q/DQ graphs need TensorRT 10+" in skip[0], p.stdout
    assert "2_export_onnx.py" not in p.stdout and "opset 17" not in skip[0]


def test_stage6_skip_names_missing_onnx(tmp_path):
    """Without trtexec every row is skipped; a variant whose ONNX was never made says which
    stage makes it, one whose ONNX exists only says trtexec is missing."""
    if Path(JETPACK_TRTEXEC).exists():
        pytest.skip("trtexec is installed here")
    save(conv_net(opset=18), tmp_path / "a" / "mobilenet_v3_small" / "onnx" / "fp32.onnx")
    p = stage6(tmp_path, "fp32", "int8")
    assert p.returncode == 0, p.stderr
    res = tmp_path / "r" / "mobilenet_v3_small"
    fp32 = json.loads((res / "trt_build_fp32.json").read_text())["reason"]
    int8 = json.loads((res / "trt_build_int8.json").read_text())["reason"]
    assert "missing" not in fp32 and "trtexec not found" in fp32
    assert "int8.onnx missing" in int8 and "5_quantize.sh" in int8


# --------------------------------------------------------------------------------------------
# Stage 6 build path, driven by a stand-in trtexec (placeholder plan; replays a real DLA block)
# --------------------------------------------------------------------------------------------
FAKE_TRTEXEC = """#!/bin/sh
# Test double for trtexec: writes placeholder files named by --saveEngine/--exportLayerInfo,
# prints the build-log text in $FAKE_TRTEXEC_LOG, then trtexec's PASSED line.
for a in "$@"; do
  case "$a" in
    --saveEngine=*) printf 'ftrt' > "${a#--saveEngine=}" ;;
    --exportLayerInfo=*) printf '{"Layers": ["x"], "Bindings": []}' > "${a#--exportLayerInfo=}" ;;
  esac
done
echo "args: $*"
[ -n "$FAKE_TRTEXEC_LOG" ] && cat "$FAKE_TRTEXEC_LOG"
echo "&&&& PASSED TensorRT.trtexec [TensorRT v8602] # trtexec"
"""

BN_NODE_NAMES = ["Conv_0", "Relu_1", "Conv_2", "Relu_3", "Conv_4", "Relu_5", "Conv_6", "Relu_7",
                 "GlobalAveragePool_8", "Reshape_14", "Gemm_15"]


@pytest.fixture()
def fake_build(tmp_path, monkeypatch):
    """Run 6_build_engines.main in-process with a stand-in trtexec and TensorRT 8.6.2 on a
    Jetson as what detection finds."""
    exe = tmp_path / "bin" / "trtexec"
    exe.parent.mkdir()
    exe.write_text(FAKE_TRTEXEC)
    exe.chmod(0o755)
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    stage = importlib.import_module("6_build_engines")
    det = Detected(str(exe), (8, 6, 2), (8, 6, 2), "/usr/lib/libnvinfer.so.8", (8, 6, 2),
                      None, "no tensorrt here", dict(os.environ))
    monkeypatch.setattr(stage, "find_trtexec", lambda env=None: (exe, "TRTEXEC"))
    monkeypatch.setattr(stage, "detect_with_loader_fix", lambda t, env=None: (det, []))
    monkeypatch.setattr(stage, "jetson_info", lambda: {"l4t": "R36 (release)", "l4t_major": 36,
                                                    "model": "test", "dla_cores": 2})

    def run(*argv, log=None):
        det.env["FAKE_TRTEXEC_LOG"] = str(DATA / log) if log else ""
        args = stage.get_args_parser().parse_args(list(argv))
        return stage.main(args)
    return run, tmp_path / "r" / "mobilenet_v3_small", tmp_path / "a" / "mobilenet_v3_small"


def test_stage6_dla_fraction_fails_the_row_below_the_minimum(fake_build):
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    run("--dla-core", "0", "fp16", log="dla_placement_8.4_orin_model_bn_int8.log")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok" and rec["dla"]["fraction"] == pytest.approx(0.9)
    assert rec["dla"]["gpu_layers"] == ["GlobalAveragePool_8"] and rec["dla"]["warning"] is None
    assert rec["profile"][0]["max"] == [1, 3, 8, 8]  # static profile, recorded for stage 7
    with pytest.raises(StageError, match="engine build failed for fp16"):
        run("--dla-core", "0", "--dla-min-fraction", "0.95", "fp16",
            log="dla_placement_8.4_orin_model_bn_int8.log")
    # The failed rebuild kept no plan, so the earlier good row (and plan) stay; the failure is
    # written beside it.
    assert json.loads((res / "trt_build_fp16.json").read_text())["status"] == "ok"
    rec = json.loads((res / "trt_build_fp16.failed.json").read_text())
    assert rec["status"] == "failed" and "below --dla-min-fraction 95%" in rec["reason"]
    assert "9 layer(s) on DLA, 1 on the GPU (90% on DLA)" in rec["reason"]


def test_stage6_failed_dla_check_keeps_no_plan_and_the_earlier_one(fake_build):
    """A build whose row fails (DLA share below --dla-min-fraction) leaves no plan of its own under
    the final name, where stage 7 would evaluate it as built, and does not replace the plan of an
    earlier good build."""
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    plan = art / "engines" / "fp16.plan"
    with pytest.raises(StageError):  # first build ever, below the minimum
        run("--dla-core", "0", "--dla-min-fraction", "0.95", "fp16",
            log="dla_placement_8.4_orin_model_bn_int8.log")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "failed" and not plan.exists() and rec.get("plan") is None
    run("--dla-core", "0", "fp16", log="dla_placement_8.4_orin_model_bn_int8.log")  # a good one
    plan.write_bytes(b"ftrt-earlier-good-plan")
    with pytest.raises(StageError):
        run("--dla-core", "0", "--dla-min-fraction", "0.95", "fp16",
            log="dla_placement_8.4_orin_model_bn_int8.log")
    assert plan.read_bytes() == b"ftrt-earlier-good-plan"
    assert not [f.name for f in plan.parent.iterdir() if f.name.startswith(".tmp-")]


def test_stage6_dla_fraction_counts_unnamed_onnx_nodes(fake_build, tmp_path):
    """TensorRT's ONNX parser names the layer of an unnamed node ``node_of_<first output>``
    (onnx-tensorrt getNodeName, release/8.5-GA to main), and the DLA block uses those names. The
    log here is the real captured block with its layer names mapped to the names TensorRT gives
    this test's unnamed nodes (a derived text, not a capture)."""
    run, res, art = fake_build
    m = conv_net(fp16=True)
    for n in m.graph.node:
        n.name = ""
    save(m, art / "onnx" / "fp16.onnx")
    log = read("dla_placement_8.4_orin_model_bn_int8.log")
    for captured, trt_name in (("Conv_0", "node_of_c0"), ("Relu_7", "node_of_r3"),
                               ("Gemm_15", "node_of_l"), ("GlobalAveragePool_8", "node_of_g")):
        log = log.replace(captured, trt_name)
    (tmp_path / "unnamed.log").write_text(log)
    run("--dla-core", "0", "--dla-min-fraction", "0.8", "fp16", log=str(tmp_path / "unnamed.log"))
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok", rec["reason"]
    assert rec["dla"]["fraction"] == pytest.approx(0.9)  # as for the named nodes above
    assert rec["dla"]["gpu_layers"] == ["node_of_g"] and "node_of_c0" in rec["dla"]["dla_layers"]


def test_stage6_dla_default_warns_below_half(fake_build, capsys):
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    run("--dla-core", "0", "fp16", log="dla_no_layer_on_dla_samplenmt_issue2318.log")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok" and rec["dla"]["fraction"] == 0.0
    assert "no layer in the network can run on DLA" in rec["dla"]["warning"]
    assert "DLA:" in capsys.readouterr().err


def test_stage6_builds_8x_int8_from_an_exact_opset17_copy(fake_build):
    run, res, art = fake_build
    save(conv_net(opset=17), art / "onnx" / "fp32.onnx")
    save(qdq_net(True), art / "onnx" / "int8.onnx")
    run("int8")
    rec = json.loads((res / "trt_build_int8.json").read_text())
    assert rec["status"] == "ok" and rec["int8_path"] == "qdq_opset17"
    assert rec["opset17_parity"]["exact"] is True
    assert Path(rec["onnx_built"]).name == "int8.opset17.onnx" and Path(rec["onnx_built"]).exists()
    assert "--onnx=" + rec["onnx_built"] in rec["command"]


def test_stage6_dla_int8_writes_the_calibration_cache(fake_build):
    run, res, art = fake_build
    save(conv_net(opset=17), art / "onnx" / "fp32.onnx")
    save(qdq_net(False), art / "onnx" / "int8.onnx")
    run("--dla-core", "0", "int8", log="dla_placement_8.4_orin_model_gn_int8.log")
    rec = json.loads((res / "trt_build_int8.json").read_text())
    assert rec["int8_path"] == "implicit" and rec["calibration_scales"] == 2
    cache = parse_calibration_cache(Path(rec["calib_cache"]).read_text())
    assert cache["version"] == (8, 6, 2) and set(cache["scales"]) == {"input", "r0"}
    assert rec["dla"]["placement_found"] and rec["dla"]["warning"]  # GN capture: names differ


# --------------------------------------------------------------------------------------------
# Stage 7 on this machine (no TensorRT): skip cleanly
# --------------------------------------------------------------------------------------------
def _no_trt():
    import importlib.util
    return importlib.util.find_spec("tensorrt") is None


@pytest.mark.skipif(not _no_trt(), reason="TensorRT is importable here")
def test_stage7_skips_without_tensorrt(tmp_path):
    eng = tmp_path / "a" / "mobilenet_v3_small" / "engines" / "int8.plan"
    eng.parent.mkdir(parents=True)
    eng.write_bytes(b"a plan file")  # a missing plan is an error named before this check
    p = subprocess.run([sys.executable, "7_trt_eval.py", "--engine", str(eng), "--tag", "trt_int8"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "SKIPPED" in p.stdout
    rec = json.loads((tmp_path / "r/mobilenet_v3_small/trt_int8.json").read_text())
    assert rec["status"] == "skipped" and "tensorrt" in rec["reason"].lower()
    assert rec["backend"] == "TensorRT" and rec["precision"] == "INT8" and rec["variant"] == "int8"
    assert all(rec[k] is None for k in ("latency", "accuracy", "parity"))  # no numbers without a run
    assert rec["provenance"]["args"]["tag"] == "trt_int8"


def test_stage7_usage_error_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "7_trt_eval.py", "--engine", "x.plan", "--tag", "t",
                        "--iters", "0"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "usage:" in p.stderr


def test_trt_runner_names_an_unreadable_plan(tmp_path):
    """--engine given a folder (e.g. artifacts/M/engines) or a missing file: a message naming the
    path, not an IsADirectoryError traceback from reading it."""

    for bad in (tmp_path, tmp_path / "missing.plan"):
        with pytest.raises(StageError, match=f"cannot read the plan {bad}"):
            TrtRunner(bad)


class _FakeRunner:
    """A runner stand-in with the runners.Runner surface stage 7's check uses (no TensorRT)."""

    def __init__(self, w, batch_range=(1, 64), batch_dependent=0.0):
        self.w, self.batch_range, self.bd = w, batch_range, batch_dependent

    def infer(self, feed):
        return _linear_infer(self.w, self.bd)(feed)


def test_stage7_batch_invariance_check_on_eval_data():

    stage7 = importlib.import_module("7_trt_eval")
    rng = np.random.default_rng(0)
    data = EvalData(x_u8=rng.integers(0, 255, (20, 3, 2, 2), dtype=np.uint8),
                             mean=(0.5,) * 3, std=(0.5,) * 3, input_name="input")
    w = rng.standard_normal((12, 10))
    ok = stage7.batch_invariance_check(_FakeRunner(w), data, 8)
    assert ok["ok"] and ok["batch"] == 8 and ok["n"] == 16
    bad = stage7.batch_invariance_check(_FakeRunner(w, batch_dependent=1.0), data, 8)
    assert bad["ok"] is False and "NVIDIA/TensorRT#4796" in bad["note"]
    static = stage7.batch_invariance_check(_FakeRunner(w, batch_range=(4, 4)), data, 8)
    assert static["ok"] is None and "no batch-1 vs batch-N" in static["reason"]


def test_batch_invariance_with_two_inputs():
    rng = np.random.default_rng(1)
    feed = {"a": rng.standard_normal((5, 4)), "b": rng.standard_normal((5, 4))}
    r = batch_invariance(lambda f: {"y": f["a"] * 2 + f["b"]}, feed, 2)
    assert r["ok"] and r["n"] == 5 and r["max_abs_diff"] == 0.0
