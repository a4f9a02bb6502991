"""deploykit.trt.profiles: optimization profiles for every input and dynamic axis, shape specs."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.errors import UsageError
from deploykit.models import parse_input_shape
from deploykit.trt.profiles import (
    input_profiles, onnx_inputs, parse_shape_specs, shape_flags, trtexec_shape_name,
)

from tests.helpers.trt_models import conv_net, two_input_net


F32 = np.dtype(np.float32)


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
