"""Rules per TensorRT version, each with its source: supported versions, parser opsets, DLA,
the INT8 route (Q/DQ or implicit), opset advice, and remedy flags.
"""
from __future__ import annotations

import re
from typing import Sequence
from typing import Sequence

from deploykit.errors import StageError, UsageError
from deploykit.trt.parsers import Version
from deploykit.variants import Variant, for_stage


# --------------------------------------------------------------------------------------------
# TensorRT version rules for remedies (checked against NVIDIA's docs):
# - trtexec --layerPrecisions/--layerOutputTypes/--precisionConstraints=obey exist in 8.6 and
#   10.x (used together in NVIDIA/TensorRT issue #3941 for 8.6 and 10.0.1); they apply to weakly
#   typed builds only (not with --stronglyTyped, not to explicitly quantised Q/DQ layers).
# - --stronglyTyped exists in 10.x.
# - TensorRT 11.x: "all networks are strongly typed"; --fp16/--int8/--best and the
#   OBEY/PREFER_PRECISION_CONSTRAINTS builder flags are removed ("Migrating trtexec Usage from
#   TensorRT 10.x to 11.x", "Removed Python APIs" pages, docs.nvidia.com/deeplearning/tensorrt/
#   11.x/api/migration/). The remedy there is to change the ONNX: keep the layer in FP32
#   (``python export_checks.py fp16 ... --keep-fp32 LAYER``, which writes ``fp16.onnx`` with FP32
#   I/O for stage 6) or drop its Q/DQ pair.
# - --noTF32 (BuilderFlag.TF32 cleared) exists in 8.x, 10.x and 11.x (TF32 is not in the 11.x
#   removed-API lists).
# --------------------------------------------------------------------------------------------
TRT_RULES: dict[int, dict[str, bool]] = {
    # major: {flag: available}
    8: {"layer_precisions": True, "strongly_typed": False, "no_tf32": True, "weak_flags": True},
    10: {"layer_precisions": True, "strongly_typed": True, "no_tf32": True, "weak_flags": True},
    11: {"layer_precisions": False, "strongly_typed": True, "no_tf32": True, "weak_flags": False},
}


# --------------------------------------------------------------------------------------------
# Variants (the registry is variants.py)
# --------------------------------------------------------------------------------------------
DEFAULT_VARIANTS = tuple(v.name for v in for_stage(6))


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------
def parse_version(text: str) -> Version:
    """``"10.3.0.30"`` / ``"8.6"`` / ``"v10.3"`` -> tuple of ints.

    Raises:
        UsageError: not a dotted version.
    """
    m = re.fullmatch(r"v?(\d+(?:\.\d+){0,3})", text.strip())
    if not m:
        raise UsageError(f"not a TensorRT version: {text!r} (expected e.g. 8.6.1, 10.3.0, 11.0)")
    return tuple(int(p) for p in m.group(1).split("."))


def full_version(v: Sequence[int]) -> Version:
    """Pad a version to at least (major, minor, patch): ``(8, 6)`` -> ``(8, 6, 0)``."""
    v = tuple(int(p) for p in v)
    return v + (0,) * (3 - len(v)) if len(v) < 3 else v


def encode_version_int(v: Sequence[int]) -> int:
    """``NV_TENSORRT_VERSION`` of a version, the inverse of ``decode_version_int``: 8.x/9.x
    ``major*1000 + minor*100 + patch`` (8.6.1 -> 8601), 10.x+ ``major*10000 + minor*100 +
    patch`` (10.3.0 -> 100300). Calibration-cache headers carry it (``TRT-8510-...`` and
    ``TRT-100300-...`` in published caches)."""
    major, minor, patch = full_version(v)[:3]
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def vstr(v: Sequence[int] | None) -> str | None:
    """Version tuple -> ``"10.3.0"`` (None stays None)."""
    return None if v is None else ".".join(str(p) for p in v)


# --------------------------------------------------------------------------------------------
# Rules per TensorRT version (each with its source; the README table repeats them)
# --------------------------------------------------------------------------------------------
class UnsupportedVariant(StageError):
    """The variant cannot be built with this TensorRT version or device (recorded as skipped)."""


# Oldest TensorRT the toolkit runs: stage 7 (deploykit.runners.TrtRunner) uses the tensor-name API
# (enqueueV3 / execute_async_v3, setInputShape, getProfileShape by name), which NvInferRuntime.h
# has from tag 8.5.1 and lacks at 8.4.3 (NVIDIA/TensorRT); trtexec 8.2 also has no --memPoolSize
# (sampleOptions.cpp, tag 8.2.1).
MIN_VERSION = (8, 5)


def check_supported(trt_version: Sequence[int]) -> None:
    """Refuse a TensorRT older than :data:`MIN_VERSION`.

    Raises:
        UsageError: the version, the minimum and why.
    """
    v = full_version(trt_version)
    if tuple(v[:2]) < MIN_VERSION:
        raise UsageError(f"TensorRT {vstr(v)} is not supported (8.5+ needed): stage 7 runs engines "
                         "with the tensor-name API (enqueueV3/execute_async_v3, setInputShape) "
                         "that TensorRT 8.5 introduced; install TensorRT 8.5 or newer")


# Highest ONNX opset the ONNX parser of a TensorRT major handles: onnx-tensorrt
# docs/operators.md, release/8.5-GA and release/8.6-GA: "supports operators up to Opset 17";
# 10.0-GA: "opset 9 to opset 20". The 8.x parser does not refuse newer opsets, it misreads them
# (deploykit.trt.onnx_prep docstring), so files above 17 are converted or refused, never passed as is.
MAX_PARSER_OPSET = {8: 17, 10: 20}


# DLA availability (TensorRT docs, "Working with DLA", 11.4.0 and 11.4.1 editions, and the 11.4.1
# release notes): "TensorRT 10.7 was the last 10.x release that supported DLA"; "DLA was
# unavailable in TensorRT 11.0 through 11.3"; "TensorRT 11.4.0 supported DLA only on Windows on
# ARM"; 11.4.1 supports DLA "on NVIDIA Jetson AGX Orin when using NVIDIA JetPack 7.2.2 or later"
# (not Jetson Thor, not DriveOS, not Orin on JetPack 6.x). JetPack 5.1 ships TensorRT 8.5,
# JetPack 6.0 8.6, JetPack 6.1/6.2 10.3. Disagreement noted: the onnx-tensorrt 10.11 GA notes
# add a DLA parser flag although the 11.x docs call 10.7 the last DLA release; the docs are
# followed here.
DLA_LAST_10X = (10, 7)


DLA_BACK_IN_11 = (11, 4, 1)


DLA_MIN_FRACTION_WARN = 0.5  # issue 13: warn below 50 % of layers on DLA unless a minimum is set


def variant_unsupported(trt_version: Sequence[int], variant: Variant) -> str | None:
    """Why ``variant`` cannot be built on ``trt_version`` at all (None if it can): INT4
    weight-only Q/DQ graphs need TensorRT 10+ (onnx-tensorrt docs/operators.md: DequantizeLinear
    takes INT8 at release/8.6-GA, "INT8, FP8, INT4" at release/10.0-GA; ONNX has INT4 from opset
    21, above the 8.x parser's 17, MAX_PARSER_OPSET). Checked before any opset handling, whose
    re-export advice does not apply to such a file."""
    v = full_version(trt_version)
    if variant.kind == "int4" and v[0] < 10:
        return (f"{variant.name}: INT4 weight-only Q/DQ graphs need TensorRT 10+, this is "
                f"{vstr(v)}")
    return None


def dla_unavailable(trt_version: Sequence[int]) -> str | None:
    """Why ``trt_version`` has no DLA (None when it has). Sources: see ``DLA_LAST_10X``."""
    v = full_version(trt_version)
    if v[:2] > DLA_LAST_10X and v[0] < 11:
        return (f"TensorRT {vstr(v)} has no DLA support: 10.7 was the last 10.x release with DLA "
                "(TensorRT 11.4.1 docs, 'Working with DLA'); JetPack 6.1/6.2 ship 10.3")
    if v[0] >= 11 and v[:3] < DLA_BACK_IN_11:
        return (f"TensorRT {vstr(v)} has no DLA support on Jetson: DLA was unavailable in "
                "11.0-11.3 "
                "and 11.4.0 had it on Windows on ARM only; 11.4.1+ with JetPack 7.2.2+ on Jetson "
                "AGX Orin (TensorRT 11.4.1 release notes)")
    return None


def dla_allowed(trt_version: Sequence[int], variant: Variant) -> str | None:
    """Why ``variant`` cannot be built for DLA on ``trt_version`` (None if it can).

    Rules: DLA runs FP16 and INT8 layers only ("DLA Supported Layers and Restrictions"; "DLA
    support is currently limited to networks running in FP16 and INT8 mode"), so FP32 and INT4
    weight-only variants stay on the GPU; the version must have DLA (:func:`dla_unavailable`);
    INT8 on DLA takes the implicit (calibration) path (deploykit.trt.onnx_prep docstring), which TensorRT 11
    removed with ``BuilderFlag::kINT8`` ("Strongly Typed Networks for DLA", 11.4.1) - the 11.4.1
    pages read here do not say whether DLA accepts Q/DQ INT8, so INT8 stays on the GPU there.
    """
    if variant.kind not in ("fp16", "qdq"):
        return (f"DLA runs FP16/INT8 layers only; {variant.name} ({variant.precision}) stays "
                "on the GPU")
    why = dla_unavailable(trt_version)
    if why:
        return why
    if variant.kind == "qdq" and full_version(trt_version)[0] >= 11:
        return (f"INT8 on DLA with TensorRT {vstr(trt_version)}: the implicit (calibration) path "
                "was removed in 11.0 (no --int8/--calib) and Q/DQ INT8 on DLA is not documented "
                "in the 11.4.1 DLA pages; it is built for the GPU")
    return None


# INT8 routes: "qdq" (the Q/DQ file as is), "qdq_opset17" (converted to opset 17 for the 8.x
# parser when exact, deploykit.trt.onnx_prep.to_opset), "implicit" (FP32 ONNX + calibration cache from the
# Q/DQ scales, --int8 --calib). Sources: deploykit.trt.onnx_prep docstring.
INT8_ROUTES = ("qdq", "qdq_opset17", "implicit")


def int8_route(trt_version: Sequence[int], variant: Variant, dla: bool,
               onnx_opset: int | None, forced: str = "auto") -> tuple[str | None, str]:
    """How an INT8 Q/DQ variant is built on ``trt_version``.

    Args:
        trt_version: target TensorRT.
        variant: the variant (only ``kind == "qdq"`` has a route).
        dla: built for a DLA core.
        onnx_opset: default-domain opset of the Q/DQ file (None: not known yet).
        forced: ``auto`` (the rules), ``qdq`` or ``implicit`` (the user's ``--int8-path``).
    Returns:
        ``(route or None, reason)``; route None for non-INT8 variants.
    Raises:
        UsageError: a forced route the version or device cannot take.
    """
    if variant.kind != "qdq":
        return None, ""
    v = full_version(trt_version)
    if dla:
        if forced == "qdq":
            raise UsageError("--int8-path qdq with --dla-core: DLA takes INT8 from a calibration "
                             "cache (implicit quantization), not from Q/DQ nodes; use "
                             "--int8-path auto or implicit")
        return "implicit", ("DLA takes INT8 from a calibration cache, not from Q/DQ nodes "
                            "(NVIDIA/TensorRT#2222; NVIDIA/Model-Optimizer PR #1661)")
    if forced == "implicit":
        if v[0] >= 11:
            raise UsageError(f"--int8-path implicit: TensorRT {vstr(v)} has no implicit INT8 "
                             "(--int8/--calib removed in 11.0); use --int8-path auto")
        return "implicit", "--int8-path implicit"
    limit = MAX_PARSER_OPSET.get(v[0])
    if v[0] == 8 and (onnx_opset is None or onnx_opset > limit):
        seen = f"opset {onnx_opset}" if onnx_opset else "opset not known yet (ModelOpt 0.47 " \
                                                          "writes 19)"
        return "qdq_opset17", (f"TensorRT {vstr(v)}'s parser handles opsets up to {limit}; "
                               f"the Q/DQ file is {seen}: converted to opset {limit} where "
                               "exact, else the implicit path")
    return "qdq", "Q/DQ ONNX as written"


def opset_advice(onnx_opset: int | None, trt_version: Sequence[int] | None,
                 quantized: bool) -> str | None:
    """Advice when an ONNX file's opset is above what ``trt_version``'s parser handles and stage 6
    found no exact opset-17 copy of it; None when fine or unknown.

    A Q/DQ file from ModelOpt 0.47.0 is opset >= 19 whatever the opset of its input (ModelOpt's
    ``BASE_MIN_OPSET = 19``), so exporting at opset 17 cannot help it: without an exact copy its
    INT8 build takes the implicit path. A float file is re-exported at 17.
    """
    if not trt_version or onnx_opset is None:
        return None
    limit = MAX_PARSER_OPSET.get(full_version(trt_version)[0])
    if limit is None or onnx_opset <= limit:
        return None
    if quantized:
        return (f"Q/DQ file at opset {onnx_opset} (ModelOpt 0.47.0 writes INT8 Q/DQ at opset >= 19 "
                "whatever the input opset, so re-exporting at 17 does not help); TensorRT "
                f"{vstr(trt_version)}'s parser handles up to {limit}: 6_build_engines converts it "
                f"to opset {limit} when exact (checked on ONNX Runtime), else builds INT8 from the "
                "FP32 ONNX with a calibration cache (--int8-path implicit)")
    return (f"opset {onnx_opset}; TensorRT {vstr(trt_version)}'s parser handles up to {limit}: "
            f"re-export with `2_export_onnx.py --exporter legacy --opset {limit}`")
