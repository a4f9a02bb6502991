"""deploykit.trt.rules: per-version rules (versions, DLA, INT8 route, opset advice)."""

from __future__ import annotations

import pytest

from deploykit.errors import UsageError
from deploykit.trt.parsers import decode_version_int
from deploykit.trt.rules import (
    dla_allowed, dla_unavailable, encode_version_int, full_version, int8_route, opset_advice,
    parse_version,
)
from deploykit.variants import VARIANTS


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
