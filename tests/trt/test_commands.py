"""deploykit.trt.commands: trtexec command lines per TensorRT version (8, 10, 11), shapes, memory
pools, DLA and implicit INT8 rules, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.errors import UsageError
from deploykit.trt.commands import build_command, plan_version_command
from deploykit.trt.parsers import parse_unknown_options
from deploykit.trt.profiles import input_profiles
from deploykit.trt.rules import UnsupportedVariant
from deploykit.variants import VARIANTS

from tests.helpers.trt_captures import read
from tests.helpers.trt_models import flags


F32 = np.dtype(np.float32)


# --------------------------------------------------------------------------------------------
# Shapes: every input, every dynamic axis
# --------------------------------------------------------------------------------------------
IMG = [("input", [None, 3, 224, 224], F32)]


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


def test_plan_version_command_per_version():
    assert plan_version_command("p.plan", V86) is None  # 8.6 trtexec has no such flag
    assert plan_version_command("p.plan", V103, "trtexec") == [
        "trtexec", "--loadEngine=p.plan", "--getPlanVersionOnly"]
    assert plan_version_command("p.plan", V110) is not None
