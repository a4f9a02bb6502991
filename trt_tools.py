"""TensorRT rules, per-version trtexec command lines and detection, for stages 6 and 7.

- Versions: parse and encode TensorRT version numbers.
- Rules per TensorRT version, each with its source: precision flags, DLA availability and its
  INT8 path, the ONNX parser's opset (the rule table is also in the README, "TensorRT").
- Shapes: an optimisation profile for every input and every dynamic axis, from the ONNX model,
  ``--input-shape`` and ``--min/--opt/--max-shapes``, written in trtexec's syntax.
- :func:`build_command`: the trtexec argv for one variant.
- Detection: trtexec, the libnvinfer it really loads, the Python runtime, Jetson facts.
- Stage 7 helpers: the batch-invariance check and plan-load diagnosis.

Log, layer-info and header parsers live in ``trt_parsers.py``; ONNX preparation for a build
(opset-17 Q/DQ for 8.x, calibration cache) in ``trt_onnx.py``; the stage-6 driver in
``6_build_engines.py``. Nothing here imports TensorRT at module level, so everything runs (and is
tested) on machines without TensorRT or a GPU. ``python trt_tools.py detect`` prints what
detection finds.

Sources relied on (read to learn; flag names checked per release in NVIDIA/TensorRT
``samples/common/sampleOptions.cpp`` at tags 8.5.1, v8.6.1, v9.3.0, v10.0.1, v10.1.0, v10.3.0,
v10.16, v11.0, v11.1):
- trtexec flags: ``--onnx``, ``--saveEngine``, ``--loadEngine``, ``--timingCacheFile``,
  ``--min/opt/maxShapes``, ``--memPoolSize=workspace:<size>`` (8.4+),
  ``--profilingVerbosity=detailed`` + ``--exportLayerInfo`` (8.2+), ``--useDLACore`` / ``--allowGPUFallback``, ``--noTF32``,
  ``--calib=<file>`` (8.x-10.x; with ``--int8``).
- Shape specs: ``name:DxDxD``, several inputs comma-separated; "Input names can be wrapped with
  escaped single quotes (ex: 'Input:0')" (trtexec --help); ``splitNameAndValue`` in
  sampleOptions.cpp (8.5+) takes the text inside exactly two single quotes as the name, else
  splits on the last ``:``; the list is split on ``,`` first. So a name with ``,`` or ``'`` cannot
  be written (refused here) and a name with ``:`` is quoted.
- ``--memPoolSize=workspace:N`` is written without a unit suffix: a plain number is MiB in every
  release ("in MiB" in 8.4-10.0's help; "If none of suffixes is appended, the defualt unit is in
  MiB" from 10.1). The ``B/K/M/G`` suffixes are parsed from 10.0.0, but 10.0.0/10.0.1 turn
  ``512M`` into 512 * 2**20 and then ``roundToBytes`` multiplies by 2**20 again (a limit 2**20
  times too large); 10.1.0 fixed it (``workspace = memPoolSize / 1.0_MiB``).
- ``--fp16`` / ``--int8`` / ``--best`` exist up to 10.x and are gone in 11.x ("Unknown option",
  captured in tests/data/trt/trtexec_11.0.0_b200_..._unknown_option_fp16_int8_best.log).
- ``--stronglyTyped`` exists from 9.x; in 11.x it is a documented no-op (strong typing is the only
  mode), so it is not passed there.
- ``--workspace``, ``--explicitBatch``, ``--buildOnly`` were removed in 10.0 (TensorRT docs,
  "Migrating trtexec Usage from TensorRT 8.x to 10.x"); they are never passed.
- ``--getPlanVersionOnly`` exists from 9.x (absent in 8.6.1's sampleOptions.cpp). It prints
  ``Plan was created with TensorRT version A.B.C.D`` (sampleEngines.cpp ``printPlanVersion``).
- The ``[TensorRT vNNNNN]`` banner and the ``TensorRT version: X.Y.Z`` line are both compiled into
  trtexec (``NV_TENSORRT_VERSION`` / ``NV_TENSORRT_MAJOR..PATCH`` macros), so neither tells which
  libnvinfer is really loaded; :func:`loaded_libnvinfer` asks the dynamic loader instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import common
import onnx_graph
import variants
from common import StageError, UsageError
from trt_parsers import (Version, classify_plan_load_error, decode_version_int,
                         parse_ldd, parse_trtexec_version, PLAN_HEADER_BYTES)

# --------------------------------------------------------------------------------------------
# Variants (the registry is variants.py)
# --------------------------------------------------------------------------------------------
VARIANTS = variants.VARIANTS
Variant = variants.Variant
DEFAULT_VARIANTS = tuple(v.name for v in variants.for_stage(6))


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


# Oldest TensorRT the toolkit runs: stage 7 (runners.TrtRunner) uses the tensor-name API
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
# (trt_onnx.py docstring), so files above 17 are converted or refused, never passed as is.
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
    INT8 on DLA takes the implicit (calibration) path (trt_onnx.py docstring), which TensorRT 11
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
# parser when exact, trt_onnx.to_opset), "implicit" (FP32 ONNX + calibration cache from the
# Q/DQ scales, --int8 --calib). Sources: trt_onnx.py docstring.
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


# --------------------------------------------------------------------------------------------
# Shapes: one optimisation profile over every input and every dynamic axis
# --------------------------------------------------------------------------------------------
def onnx_inputs(path_or_model) -> list[tuple[str, list[int | None], np.dtype]]:
    """Every real graph input of an ONNX file (or model): ``[(name, dims, dtype)]``, dynamic
    dims as None (``onnx_graph.inputs``); reads the graph only, not external weights.

    Raises:
        StageError: the file is missing/unreadable or the graph has no input.
    """
    model = path_or_model if hasattr(path_or_model, "graph") else onnx_graph.load(
        path_or_model, external=False)
    inputs = onnx_graph.inputs(model)
    if not inputs:
        raise StageError(f"{path_or_model if isinstance(path_or_model, (str, Path)) else 'model'}"
                         ": the graph has no input")
    return inputs


@dataclasses.dataclass(frozen=True)
class InputProfile:
    """Optimisation-profile shapes of one network input.

    Attributes:
        name: the ONNX input name.
        onnx_dims: dims in the ONNX file (None = dynamic).
        min, opt, max: the profile (every dim >= 1; equal where the ONNX dim is static).
        source: how the dynamic dims were chosen (for the record and the dry run).
    """

    name: str
    onnx_dims: tuple
    min: tuple
    opt: tuple
    max: tuple
    source: str

    @property
    def dynamic(self) -> bool:
        return any(d is None for d in self.onnx_dims)

    @property
    def static_profile(self) -> bool:
        return self.min == self.opt == self.max

    def as_dict(self) -> dict:
        return {"name": self.name, "onnx_dims": list(self.onnx_dims), "min": list(self.min),
                "opt": list(self.opt), "max": list(self.max), "source": self.source}


def parse_shape_specs(items: Sequence[str] | None, what: str = "--opt-shapes"
                      ) -> dict[str, tuple[int, ...]]:
    """Parse trtexec-style shape specs: each item ``name:DxDxD[,name2:DxD...]``; a name with
    ``:`` is written quoted (``'input:0':1x3x32x32``) or found by splitting on the last ``:``.

    Raises:
        UsageError: a spec without a name, bad dims, or the same name twice.
    """
    out: dict[str, tuple[int, ...]] = {}
    for item in items or []:
        # trtexec splits the list on every ","; names are quoted only to hold ":".
        for part in re.findall(r"(?:'[^']*'|[^,'])+", item):
            name, dims = common.split_shape_name(part.strip(), what)
            if not name:
                raise UsageError(f"{what} {part!r}: expected name:DxDxD")
            if name in out:
                raise UsageError(f"{what}: input {name!r} given twice")
            out[name] = common.parse_dims(dims, f"{what} {part!r}")
    return out


def input_profiles(inputs: Sequence[tuple[str, Sequence[int | None], Any]], *,
                   input_shapes: Sequence[str] = (), min_shapes: Mapping[str, Sequence[int]] = {},
                   opt_shapes: Mapping[str, Sequence[int]] = {},
                   max_shapes: Mapping[str, Sequence[int]] = {}, min_batch: int = 1,
                   opt_batch: int = 1, max_batch: int = 64, static: bool = False,
                   default_hw: int | None = None) -> list[InputProfile]:
    """The optimisation profile for every input.

    For each input: explicit ``--min/--opt/--max-shapes`` win (all three, or opt alone which
    then also sets min and max, as trtexec does; other partial sets are refused: trtexec's
    ``processShapes`` (sampleOptions.cpp, 8.5.1-v11.1) broadcasts them with only a warning for
    the build profile, and 8.5-10.x refuse them for the calibration profile); otherwise a dynamic axis 0 takes
    ``min/opt/max_batch`` and every other dynamic axis (spatial, sequence, ...) takes its size
    from the input's ``--input-shape`` value, else, for a 4-D image input, ``default_hw`` (the
    model's crop) on axes 2 and 3. ``static`` (DLA: "DLA does not support dynamic dimensions, so
    the profile's min, max, and opt values must be equal for wildcard dimensions", TensorRT docs
    "DLA Supported Layers and Restrictions") collapses every profile to its opt shape.

    Args:
        inputs: :func:`onnx_inputs` of the model.
        input_shapes: ``--input-shape`` values (:func:`common.parse_input_shape`; an unnamed one is
            the input at its position).
        min_shapes, opt_shapes, max_shapes: :func:`parse_shape_specs` results.
        min_batch, opt_batch, max_batch: batch range for a dynamic axis 0.
        static: min = opt = max (DLA).
        default_hw: size for dynamic H/W of a 4-D input when nothing else gives one.
    Returns:
        one :class:`InputProfile` per input, in graph order.
    Raises:
        UsageError: an unknown input name, a rank or static-dim mismatch, min > opt > max, or a
            dynamic axis nothing gives a size for (the message names input, axis and the fix).
    """
    names = [n for n, _, _ in inputs]
    given: dict[str, tuple[int, ...]] = {}
    for i, item in enumerate(input_shapes or ()):
        name, dims, _ = common.parse_input_shape(item)
        name = name if name is not None else (names[i] if i < len(names) else None)
        if name not in names:
            raise UsageError(f"--input-shape {item!r}: the model has no input {name!r} "
                             f"(inputs: {', '.join(names)})")
        given[name] = dims
    for flag, spec in (("--min-shapes", min_shapes), ("--opt-shapes", opt_shapes),
                       ("--max-shapes", max_shapes)):
        for n in spec:
            if n not in names:
                raise UsageError(f"{flag}: the model has no input {n!r} (inputs: "
                                 f"{', '.join(names)})")
    if not (1 <= min_batch <= opt_batch <= max_batch):
        raise UsageError(f"batch range must satisfy 1 <= --min-batch ({min_batch}) <= --opt-batch "
                         f"({opt_batch}) <= --max-batch ({max_batch})")
    out = []
    for idx, (name, dims, _dtype) in enumerate(inputs):
        dims = tuple(dims)
        rank = len(dims)

        def check(shape: Sequence[int], what: str) -> tuple[int, ...]:
            shape = tuple(int(d) for d in shape)
            if len(shape) != rank:
                raise UsageError(f"{what} for input {name!r}: {len(shape)} dims, the ONNX input "
                                 f"has {rank} ({fmt_dims(dims)})")
            for ax, (s, d) in enumerate(zip(shape, dims)):
                if d is not None and s != d:
                    raise UsageError(f"{what} for input {name!r}: axis {ax} is {s}, the ONNX "
                                     f"input fixes it to {d} ({fmt_dims(dims)})")
            return shape

        explicit = [name in s for s in (min_shapes, opt_shapes, max_shapes)]
        if any(explicit):
            if explicit != [True] * 3 and explicit != [False, True, False]:
                raise UsageError(f"input {name!r}: give --opt-shapes alone or all of --min-shapes, "
                                 "--opt-shapes, --max-shapes (a partial set is ambiguous: "
                                 "trtexec fills it in with a warning, and refuses it for the "
                                 "calibration profile of --int8 builds)")
            opt = check(opt_shapes[name], "--opt-shapes")
            lo = check(min_shapes.get(name, opt), "--min-shapes")
            hi = check(max_shapes.get(name, opt), "--max-shapes")
            if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
                raise UsageError(f"input {name!r}: need min <= opt <= max on every axis, got "
                                 f"{fmt_dims(lo)} / {fmt_dims(opt)} / {fmt_dims(hi)}")
            source = "--min/--opt/--max-shapes"
        else:
            lo, opt, hi, why = [], [], [], []
            user = check(given[name], "--input-shape") if name in given else None
            for ax, d in enumerate(dims):
                if d is not None:
                    lo.append(d), opt.append(d), hi.append(d)
                elif ax == 0:
                    lo.append(min_batch), opt.append(opt_batch), hi.append(max_batch)
                    why.append("axis 0: --min/--opt/--max-batch")
                elif user is not None:
                    lo.append(user[ax]), opt.append(user[ax]), hi.append(user[ax])
                    why.append(f"axis {ax}: --input-shape")
                elif default_hw and rank == 4 and ax in (2, 3):
                    lo.append(default_hw), opt.append(default_hw), hi.append(default_hw)
                    why.append(f"axis {ax}: the model's crop {default_hw}")
                else:
                    raise UsageError(
                        f"input {name!r} axis {ax} is dynamic in the ONNX ({fmt_dims(dims)}) and "
                        f"nothing gives its size: pass --input-shape {_quote(name)}:"
                        f"{','.join(str(x) if x else 'N' for x in dims)} with N replaced, or a "
                        f"range with --min-shapes/--opt-shapes/--max-shapes "
                        f"{_quote(name)}:{'x'.join(str(x) if x else 'N' for x in dims)}")
            lo, opt, hi = tuple(lo), tuple(opt), tuple(hi)
            source = "; ".join(why) if why else "static in the ONNX"
        if static and not (lo == opt == hi):
            lo = hi = opt
            source += "; static for DLA (min = opt = max)"
        out.append(InputProfile(name, dims, lo, opt, hi, source))
    return out


def trt_layer_names(model) -> list[tuple[str, str]]:
    """``[(layer name, op type)]`` of an ONNX model's nodes, in graph order, named as TensorRT's
    ONNX parser names their layers (and build logs print them): the node name, or
    ``node_of_<first output>`` for an unnamed node (onnx-tensorrt ``getNodeName``:
    ``onnx2trt_utils.cpp`` at release/8.5-GA and 8.6-GA, ``importerUtils.cpp`` at 10.0-GA to
    main)."""
    return [(n.name or (f"node_of_{n.output[0]}" if len(n.output) else ""), n.op_type)
            for n in model.graph.node]


def check_named_dims(model, profiles: Sequence[InputProfile]) -> None:
    """Refuse profiles in which inputs that share an ONNX dim name get disjoint ranges.

    "Two network inputs with the same named dimension parameter are considered equal. TensorRT
    supports this feature by checking that in the optimization profile these dimensions have
    overlapping intervals and that at runtime they have the same value" (NVIDIA/TensorRT
    samples/sampleNamedDimensions README, tags 8.5.1 to v11.1), so such a profile fails the build.

    Args:
        model: the ONNX model the profiles were made for (``dim_param`` names are read from it).
        profiles: :func:`input_profiles` of that model.
    Raises:
        UsageError: the dim name, each (input, axis) that holds it with its range, and the fix.
    """
    by_name = {p.name: p for p in profiles}
    users: dict[str, list[tuple[str, int, int, int]]] = {}
    for i in model.graph.input:
        p = by_name.get(i.name)
        if p is None:
            continue
        for ax, d in enumerate(i.type.tensor_type.shape.dim):
            if d.dim_param and ax < len(p.min):
                users.setdefault(d.dim_param, []).append((i.name, ax, p.min[ax], p.max[ax]))
    for dim, uses in users.items():
        if len(uses) > 1 and max(u[2] for u in uses) > min(u[3] for u in uses):
            where = ", ".join(f"{n} axis {ax}: {lo}..{hi}" for n, ax, lo, hi in uses)
            raise UsageError(f"the ONNX names these dims {dim!r}, so TensorRT needs them equal, "
                             f"but their profile ranges do not overlap ({where}): give them the "
                             "same size in --input-shape / --min/--opt/--max-shapes")


def fmt_dims(dims: Sequence[int | None]) -> str:
    """``[None, 3, 224, 224]`` -> ``"?x3x224x224"``."""
    return "x".join("?" if d is None else str(d) for d in dims)


def _quote(name: str) -> str:
    return f"'{name}'" if ":" in name else name


def trtexec_shape_name(name: str) -> str:
    """An input name as trtexec's shape syntax needs it: quoted when it contains ``:``.

    Raises:
        UsageError: a name with ``,`` (separates inputs) or ``'`` (the quote character) cannot be
            written in trtexec's syntax (sampleOptions.cpp ``splitNameAndValue``).
    """
    if "," in name or "'" in name:
        raise UsageError(f"input name {name!r} cannot be written in trtexec's shape syntax ("
                         "',' separates inputs and \"'\" quotes names): rename the input when "
                         "exporting the ONNX model")
    return _quote(name)


def shape_flags(profiles: Sequence[InputProfile]) -> list[str]:
    """``--minShapes/--optShapes/--maxShapes`` for the dynamic inputs (all of them in one
    comma-separated list per flag); ``[]`` when every input is static."""
    dyn = [p for p in profiles if p.dynamic]
    if not dyn:
        return []
    out = []
    for flag, attr in (("--minShapes", "min"), ("--optShapes", "opt"), ("--maxShapes", "max")):
        spec = ",".join(f"{trtexec_shape_name(p.name)}:{'x'.join(str(d) for d in getattr(p, attr))}"
                        for p in dyn)
        out.append(f"{flag}={spec}")
    return out


# --------------------------------------------------------------------------------------------
# Command lines per TensorRT major version
# --------------------------------------------------------------------------------------------
def build_command(onnx: Path | str, plan: Path | str, variant: str, trt_version: Sequence[int], *,
                  timing_cache: Path | str, layer_info: Path | str | None = None,
                  profiles: Sequence[InputProfile] = (), mem_pool_mb: int | None = None,
                  dla_core: int | None = None, int8: str | None = None,
                  calib: Path | str | None = None, no_tf32: bool = False,
                  trtexec: str = "trtexec") -> list[str]:
    """The trtexec command that builds ``variant`` from ``onnx`` on ``trt_version``.

    Precision rules:
    - 8.x (weakly typed only): ``--fp16`` for the FP16 graph, ``--int8`` for Q/DQ graphs (without
      it TensorRT 8 does not pick INT8 kernels for Q/DQ); nothing for FP32. INT4 graphs are not
      buildable (raises :class:`UnsupportedVariant`).
    - 9.x/10.x: ``--stronglyTyped`` for FP16, Q/DQ and INT4 graphs, so precision comes from the
      ONNX tensor types; FP32 is a plain build. DLA builds and the implicit INT8 path are weakly
      typed (``--fp16`` / ``--int8 --fp16 --calib``), the documented DLA path up to 10.7.
    - 11.x: strongly typed only; no precision flag at all (``--fp16``/``--int8``/``--best`` are
      "Unknown option"; ``--stronglyTyped`` is a no-op and left out); no implicit INT8.
    - The implicit INT8 path (``int8="implicit"``): ``onnx`` is the FP32 model,
      ``--int8 --calib=<cache>``, plus ``--fp16`` (layers without a scale run in FP16; DLA has
      no FP32) where the variant keeps FP16 high-precision layers or for DLA (NVIDIA's
      qdq-translator README builds DLA the same way: ``--int8 --fp16 --calib``).
    Never passed: ``--explicitBatch``, ``--workspace``, ``--buildOnly``, ``--best``.

    Args:
        onnx, plan: input model and output plan path.
        variant: a key of :data:`VARIANTS`.
        trt_version: detected (or ``--trt-version``) TensorRT version, e.g. ``(10, 3, 0)``.
        timing_cache: ``--timingCacheFile`` (read if present, updated after the build).
        layer_info: ``--exportLayerInfo`` path (with ``--profilingVerbosity=detailed``); None
            leaves both out.
        profiles: :func:`input_profiles` of the model; the dynamic ones become
            ``--minShapes/--optShapes/--maxShapes`` (trtexec times the build at the opt shape).
            With ``dla_core`` every profile must be static (min = opt = max).
        mem_pool_mb: workspace pool limit in MiB (``--memPoolSize=workspace:N``, a plain number,
            which every trtexec reads as MiB; see the module docstring).
        dla_core: DLA core; always paired with ``--allowGPUFallback``.
        int8: for Q/DQ variants, ``"qdq"`` (default) or ``"implicit"`` (see above).
        calib: calibration cache for the implicit path.
        no_tf32: add ``--noTF32`` (FP32 layers otherwise may use TF32 on Ampere+).
        trtexec: program path.
    Returns:
        argv list.
    Raises:
        UsageError: unknown variant, TensorRT < 8.5, bad DLA request, dynamic profile with DLA,
            implicit INT8 without a cache, a bad memory pool size.
        UnsupportedVariant: the variant cannot be built with this version or device.
    """
    if variant not in VARIANTS:
        raise UsageError(f"unknown variant {variant!r}: choose from {', '.join(VARIANTS)}")
    v = VARIANTS[variant]
    ver = full_version(trt_version)
    major = ver[0]
    check_supported(ver)
    why = variant_unsupported(ver, v)
    if why:
        raise UnsupportedVariant(why)
    implicit = v.kind == "qdq" and int8 == "implicit"
    if implicit and major >= 11:
        raise UnsupportedVariant(f"{variant}: TensorRT {vstr(ver)} has no implicit INT8 "
                                 "(--int8/--calib removed in 11.0)")
    if implicit and not calib:
        raise UsageError(f"{variant}: the implicit INT8 path needs a calibration cache (calib=)")
    if dla_core is not None:
        if dla_core < 0:
            raise UsageError(f"--dla-core {dla_core}: must be >= 0")
        why = dla_allowed(ver, v)
        if why:
            raise UsageError(why)
        if v.kind == "qdq" and not implicit:
            raise UsageError(f"{variant} on DLA: DLA takes INT8 from a calibration cache "
                             "(implicit path), not from Q/DQ nodes (NVIDIA/TensorRT#2222)")
        dyn = [p.name for p in profiles if not p.static_profile]
        if dyn:
            raise UsageError(f"DLA needs a static profile (min = opt = max) for every input "
                             f"('DLA Supported Layers and Restrictions'); dynamic: "
                             f"{', '.join(dyn)}")
    cmd = [trtexec, f"--onnx={onnx}", f"--saveEngine={plan}", f"--timingCacheFile={timing_cache}"]
    cmd += shape_flags(profiles)
    weak = major < 9 or (major < 11 and (dla_core is not None or implicit))
    if weak:
        if v.kind == "fp16":
            cmd.append("--fp16")
        elif v.kind == "qdq":
            # Weak typing ignores the ONNX's float types: the layers ModelOpt left in FP16
            # (high-precision dtype fp16, e.g. the `int8` recipe) run in FP32 unless --fp16 is
            # also given; fp32 high-precision variants (`int8_hp32`) keep them FP32 on purpose.
            # DLA has no FP32 layers, so its unquantized layers need --fp16 in any case.
            cmd.append("--int8")
            if v.high_precision_fp16 or dla_core is not None:
                cmd.append("--fp16")
            if implicit:
                cmd.append(f"--calib={calib}")
    elif major < 11 and v.kind in ("fp16", "qdq", "int4"):
        cmd.append("--stronglyTyped")
    if layer_info is not None:
        cmd += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    if mem_pool_mb is not None:
        if mem_pool_mb <= 0:
            raise UsageError(f"--mem-pool-mb {mem_pool_mb}: must be > 0")
        # A plain number: MiB in every trtexec. No unit suffix: 10.0.x scales "N<suffix>" to
        # bytes and then again as MiB (module docstring).
        cmd.append(f"--memPoolSize=workspace:{mem_pool_mb}")
    if dla_core is not None:
        cmd += [f"--useDLACore={dla_core}", "--allowGPUFallback"]
    if no_tf32:
        cmd.append("--noTF32")
    return cmd


def plan_version_command(plan: Path | str, trt_version: Sequence[int], trtexec: str = "trtexec"
                         ) -> list[str] | None:
    """``trtexec --loadEngine=P --getPlanVersionOnly`` where the flag exists (9.x+), else None
    (8.x: verify by deserialising with the Python runtime instead)."""
    if trt_version[0] < 9:
        return None
    return [trtexec, f"--loadEngine={plan}", "--getPlanVersionOnly"]


# --------------------------------------------------------------------------------------------
# Stage 7: plan-load diagnosis, profile fit, batch invariance
# --------------------------------------------------------------------------------------------
def diagnose_plan_load(plan: Path | str, log: str, runtime_version: Sequence[int] | None) -> dict:
    """:func:`trt_parsers.classify_plan_load_error` for a plan file: reads its first bytes and
    size, then classifies ``log`` (what the runtime logged). Returns the classification with a
    one-line ``text`` ("<message>. Fix: <fix>")."""
    plan = Path(plan)
    head, size = None, None
    try:
        size = plan.stat().st_size
        with open(plan, "rb") as f:
            head = f.read(PLAN_HEADER_BYTES)
    except OSError:
        pass
    res = classify_plan_load_error(log, head, runtime_version=runtime_version, file_size=size,
                                   plan=str(plan))
    res["text"] = f"{res['message']}. Fix: {res['fix']}"
    return res


def fit_batch(profile: Sequence[Sequence[int]], want: int, sample_shape: Sequence[int],
              what: str = "engine") -> int:
    """The batch to run an input at: ``want`` clipped to the profile's batch range, after checking
    that one sample's shape (``[C, H, W]`` ...) fits the profile's other axes.

    Args:
        profile: ``(min, opt, max)`` shapes of the input (engine or build record).
        want: requested batch (e.g. ``--batch-size``).
        sample_shape: shape of one preprocessed sample, without the batch axis.
    Raises:
        UsageError: the sample does not fit (names the profile and the stage-6 flags to rebuild).
    """
    lo, _opt, hi = (tuple(int(d) for d in s) for s in profile)
    rest = tuple(int(d) for d in sample_shape)
    if len(lo) != len(rest) + 1 or any(not (a <= s <= b) for a, s, b in
                                       zip(lo[1:], rest, hi[1:])):
        raise UsageError(f"the {what} takes {fmt_dims(lo)} .. {fmt_dims(hi)}, a sample is "
                         f"N x {fmt_dims(rest)}: rebuild with 6_build_engines.sh --input-shape / "
                         "--min-shapes/--opt-shapes/--max-shapes covering it")
    return max(lo[0], min(int(want), hi[0]))


# Heuristic, not from a source: a batch-1 result may differ from the batch-N one by kernel choice
# (accumulation order); 1 % of the largest |logit| passes FP16 accumulation-order noise (~1e-3
# relative) and flags real divergence. Top-1 must agree on every image.
BATCH_INVARIANCE_REL_TOL = 1e-2
# Known-issue note for a flagged row. No TensorRT release note documenting batch-dependent GEMV
# results at batch 1 was found in the 8.6-11.x release notes searched for this toolkit; related
# public reports: NVIDIA/TensorRT#4796 (10.x: identical samples in one batch give different
# outputs, open), NVIDIA/TensorRT#4813 (11.1, open), NVIDIA/TensorRT-LLM#1879 (NVIDIA: "different
# batch sizes may lead to different kernels. So, the results can be different. This is a known
# issue.").
BATCH_INVARIANCE_NOTE = (
    "TensorRT may choose different kernels per batch size (e.g. a GEMV path at batch 1), so "
    "batch-1 and batch-N outputs can differ; no TensorRT release note documenting this was found "
    "(searched 8.6-11.x release notes); related reports: NVIDIA/TensorRT#4796, #4813, "
    "NVIDIA/TensorRT-LLM#1879. Score with the batch you deploy, or rebuild with "
    "--opt-batch 1 / a static batch-1 profile for batch-1 deployment.")


def batch_invariance(infer: Callable[[dict], Mapping[str, np.ndarray]],
                     feed: Mapping[str, np.ndarray], batch: int, output_name: str | None = None,
                     rel_tol: float = BATCH_INVARIANCE_REL_TOL) -> dict:
    """Run the same samples at batch 1 and at batch ``batch`` and compare the outputs.

    Every batch-N call has exactly ``batch`` rows (the last one is padded with the first samples
    and the padding discarded), so the engine really runs at that batch.

    Args:
        infer: a runner's ``infer(feed) -> {output name: array}``.
        feed: ``{input name: array [M, ...]}`` (M >= 1 samples, batch on axis 0), preprocessed.
        batch: N (>= 2).
        output_name: output to compare (default: the first one returned).
        rel_tol: allowed max |difference| as a fraction of max |output at batch 1|.
    Returns:
        ``{"batch": N, "n": M, "max_abs_diff": float, "max_abs_ref": float,
        "rel_max_diff": float, "rel_tol": float, "top1_agreement": float (0..1 over the M
        samples; None for outputs with one value per sample), "ok": bool,
        "note": str | None (the known-issue note when not ok)}``.
    Raises:
        UsageError: ``batch < 2`` or no samples.
    """
    n = len(next(iter(feed.values()))) if feed else 0
    if batch < 2 or n < 1:
        raise UsageError(f"batch invariance needs batch >= 2 and samples (got {batch}, {n})")

    def out_of(idx):
        res = infer({k: v[idx] for k, v in feed.items()})
        return np.asarray(res[output_name] if output_name else next(iter(res.values())),
                          dtype=np.float64)

    one = np.concatenate([out_of(np.array([i])) for i in range(n)])
    many = []
    for i in range(0, n, batch):
        idx = np.arange(i, min(i + batch, n))
        real = len(idx)
        if real < batch:
            idx = np.concatenate([idx, np.arange(batch - real) % n])
        many.append(out_of(idx)[:real])
    many = np.concatenate(many)
    diff = float(np.max(np.abs(one - many))) if one.size else 0.0
    ref = float(np.max(np.abs(one))) if one.size else 0.0
    rel = diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))
    flat1, flatn = one.reshape(len(one), -1), many.reshape(len(many), -1)
    top1 = (float(np.mean(flat1.argmax(1) == flatn.argmax(1)))
            if flat1.shape[1] > 1 else None)
    ok = rel <= rel_tol and (top1 is None or top1 == 1.0)
    return {"batch": int(batch), "n": int(n), "max_abs_diff": diff, "max_abs_ref": ref,
            "rel_max_diff": rel, "rel_tol": rel_tol, "top1_agreement": top1, "ok": bool(ok),
            "note": None if ok else BATCH_INVARIANCE_NOTE}


# --------------------------------------------------------------------------------------------
# Detection: trtexec, loaded libnvinfer, Python runtime, Jetson
# --------------------------------------------------------------------------------------------
JETPACK_TRTEXEC = Path("/usr/src/tensorrt/bin/trtexec")  # JetPack / Debian packages, not on PATH


def find_trtexec(env: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """Locate trtexec: ``$TRTEXEC``, else ``PATH``, else ``/usr/src/tensorrt/bin/trtexec``.

    Returns:
        ``(path, how)`` or ``(None, reason)``.
    """
    env = os.environ if env is None else env
    given = env.get("TRTEXEC")
    if given:
        p = Path(given)
        if p.is_file() and os.access(p, os.X_OK):
            return p, "TRTEXEC"
        return None, f"TRTEXEC={given} is not an executable file"
    found = shutil.which("trtexec", path=env.get("PATH", ""))
    if found:
        return Path(found), "PATH"
    if JETPACK_TRTEXEC.is_file() and os.access(JETPACK_TRTEXEC, os.X_OK):
        return JETPACK_TRTEXEC, "JetPack default location"
    return None, ("trtexec not found (not in $TRTEXEC, not on PATH, not at "
                  f"{JETPACK_TRTEXEC}); TensorRT is not installed on this machine")


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120
         ) -> tuple[int, str]:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, env=dict(env or os.environ),
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return 127, f"{type(e).__name__}: {e}"


def loaded_libnvinfer(trtexec: Path | str, env: Mapping[str, str] | None = None
                      ) -> tuple[str | None, str]:
    """Path of the libnvinfer the dynamic loader gives ``trtexec`` under ``env`` (``ldd``).

    Returns:
        ``(resolved path or None, the ldd line or error text)``.
    """
    rc, text = _run(["ldd", str(trtexec)], env)
    libs = parse_ldd(text)
    for soname, path in libs.items():
        if soname.startswith("libnvinfer.so"):
            resolved = str(Path(path).resolve()) if path else None
            return resolved, f"{soname} => {path or 'not found'}"
    return None, (text.strip()[-300:] or f"ldd exited {rc}")


def libnvinfer_version(lib: str, env: Mapping[str, str] | None = None) -> Version | None:
    """Version of a libnvinfer file: ``getInferLibVersion()`` called through ctypes in a child
    process (so nothing is loaded here), else the ``libnvinfer.so.X.Y.Z`` file name."""
    code = "import ctypes,sys; print(ctypes.CDLL(sys.argv[1]).getInferLibVersion())"
    rc, text = _run([sys.executable, "-c", code, lib], env)
    if rc == 0 and text.strip().splitlines()[-1].isdigit():
        return decode_version_int(int(text.strip().splitlines()[-1]))
    m = re.search(r"libnvinfer\.so\.(\d+(?:\.\d+){1,3})$", lib)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def python_trt_version(env: Mapping[str, str] | None = None) -> tuple[Version | None, str]:
    """``tensorrt.__version__`` of the Python runtime (imported in a child process).

    Returns:
        ``(version or None, detail)``.
    """
    rc, text = _run([sys.executable, "-c", "import tensorrt; print(tensorrt.__version__)"], env)
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if rc == 0 and re.fullmatch(r"\d+(\.\d+)+\S*", last):
        return tuple(int(p) for p in re.findall(r"\d+", last)[:4]), last
    return None, (last or f"python exited {rc}")


def python_trt_libdirs(env: Mapping[str, str] | None = None) -> list[str]:
    """Folders holding the Python runtime's own libnvinfer (pip wheels: ``tensorrt_libs``)."""
    code = ("import importlib, os\nfor m in ('tensorrt_libs', 'tensorrt_cu13_libs', "
            "'tensorrt_cu12_libs'):\n    try:\n        print(os.path.dirname("
            "importlib.import_module(m).__file__))\n    except Exception:\n        pass\n")
    rc, text = _run([sys.executable, "-c", code], env)
    return [ln for ln in text.splitlines() if ln.strip() and Path(ln).is_dir()] if rc == 0 else []


def jetson_info() -> dict | None:
    """Jetson facts, or None on other machines.

    Detected by ``/etc/nv_tegra_release`` (L4T), or aarch64 with "tegra" in the kernel release or
    ``/proc/device-tree/compatible``. Returns ``{"l4t": "R36 (release), REVISION: 4.3 ...",
    "l4t_major": 36, "model": "...", "dla_cores": n}``; JetPack 5 is L4T R35 (TensorRT 8.5),
    JetPack 6 is L4T R36 (TensorRT 8.6 in 6.0, 10.3 in 6.1/6.2).
    """
    rel = Path("/etc/nv_tegra_release")
    tegra = rel.exists()
    compat = ""
    try:
        compat = Path("/proc/device-tree/compatible").read_bytes().decode(errors="ignore")
    except OSError:
        pass
    if not tegra and not (platform.machine() == "aarch64"
                          and ("tegra" in platform.release() or "tegra" in compat)):
        return None
    info: dict[str, Any] = {"l4t": None, "l4t_major": None, "model": None, "dla_cores": None}
    if tegra:
        first = rel.read_text(errors="ignore").splitlines()[0] if rel.stat().st_size else ""
        info["l4t"] = first.lstrip("# ").strip()
        m = re.search(r"R(\d+)", first)
        info["l4t_major"] = int(m.group(1)) if m else None
    try:
        raw = Path("/proc/device-tree/model").read_bytes()
        info["model"] = raw.decode(errors="ignore").strip("\x00 \n")
    except OSError:
        pass
    dla = list(Path("/dev").glob("nvhost-nvdla*")) if Path("/dev").is_dir() else []
    info["dla_cores"] = len(dla) if dla else None
    return info


@dataclasses.dataclass
class Detected:
    """What :func:`detect` found. Versions are tuples; None = could not be determined."""

    trtexec: str
    banner: Version | None
    header: Version | None
    libnvinfer: str | None
    libnvinfer_version: Version | None
    python_runtime: Version | None
    python_detail: str
    env: dict
    loader_fix: str | None = None
    ldd: str = ""

    @property
    def version(self) -> Version | None:
        """The TensorRT that builds the plans: the loaded library, else trtexec's own."""
        return self.libnvinfer_version or self.header or self.banner

    def as_dict(self) -> dict:
        return {"trtexec": self.trtexec, "trtexec_banner": vstr(self.banner),
                "trtexec_header": vstr(self.header), "libnvinfer": self.libnvinfer,
                "libnvinfer_version": vstr(self.libnvinfer_version),
                "python_tensorrt": vstr(self.python_runtime), "loader_fix": self.loader_fix,
                "ldd": self.ldd}


def version_conflicts(d: Detected) -> list[str]:
    """Disagreements that make plans unusable (compared on major.minor.patch)."""
    probs = []
    tool = d.header or d.banner
    if d.libnvinfer is None:
        probs.append(f"the loader finds no libnvinfer for {d.trtexec} ({d.ldd})")
    if tool and d.libnvinfer_version and tuple(tool[:3]) != tuple(d.libnvinfer_version[:3]):
        probs.append(f"trtexec was built for TensorRT {vstr(tool)} but loads libnvinfer "
                     f"{vstr(d.libnvinfer_version)} ({d.libnvinfer})")
    built_by = d.libnvinfer_version or tool
    if d.python_runtime and built_by and tuple(d.python_runtime[:3]) != tuple(built_by[:3]):
        probs.append(f"plans would be built by TensorRT {vstr(built_by)} but the Python runtime "
                     f"(7_trt_eval.py) is {vstr(d.python_runtime)}")
    return probs


def detect(trtexec: Path | str, env: Mapping[str, str] | None = None) -> Detected:
    """Versions of trtexec (banner/header from ``trtexec --help``), the libnvinfer it loads and
    the Python runtime, under ``env``."""
    env = dict(os.environ if env is None else env)
    _, text = _run([str(trtexec), "--help"], env, timeout=60)
    tv = parse_trtexec_version(text)
    lib, ldd = loaded_libnvinfer(trtexec, env)
    libv = libnvinfer_version(lib, env) if lib else None
    pyv, pyd = python_trt_version(env)
    return Detected(str(trtexec), tv["banner"], tv["header"], lib, libv, pyv, pyd, env, ldd=ldd)


def detect_with_loader_fix(trtexec: Path | str, env: Mapping[str, str] | None = None
                           ) -> tuple[Detected, list[str]]:
    """:func:`detect`, and when versions disagree, retry with each candidate library folder
    first on ``LD_LIBRARY_PATH`` (the fix env.sh applies): the Python runtime's wheel folder
    (``tensorrt_libs``), the tarball's ``<trtexec>/../lib`` and ``$TENSORRT_HOME/lib``.

    Returns:
        ``(detected, remaining conflicts)``; ``detected.env`` is the environment to run
        trtexec with and ``detected.loader_fix`` names the folder that fixed it.
    """
    env = dict(os.environ if env is None else env)
    d = detect(trtexec, env)
    probs = version_conflicts(d)
    if not probs:
        return d, []
    cands = python_trt_libdirs(env) + [str(Path(trtexec).resolve().parent.parent / "lib")]
    if env.get("TENSORRT_HOME"):
        cands.append(str(Path(env["TENSORRT_HOME"]) / "lib"))
    for c in dict.fromkeys(cands):
        if not Path(c).is_dir():
            continue
        e2 = dict(env)
        e2["LD_LIBRARY_PATH"] = c + (os.pathsep + env["LD_LIBRARY_PATH"]
                                     if env.get("LD_LIBRARY_PATH") else "")
        d2 = detect(trtexec, e2)
        if not version_conflicts(d2):
            d2.loader_fix = c
            return d2, []
    return d, probs


# --------------------------------------------------------------------------------------------
# Paths shared by stages 6 and 7
# --------------------------------------------------------------------------------------------
def engines_dir(model: str) -> Path:
    """``artifacts/<model>/engines``."""
    return common.model_artifacts(model) / "engines"


def engine_paths(model: str, variant: str) -> dict[str, Path]:
    """Plan, build log, layer info, timing cache, converted ONNX and calibration cache paths of
    ``variant``."""
    d = engines_dir(model)
    return {"plan": d / f"{variant}.plan", "log": d / f"{variant}.build.log",
            "layers": d / f"{variant}.layers.json", "cache": d / "timing.cache",
            "opset17": d / f"{variant}.opset17.onnx", "calib": d / f"{variant}.calib.cache"}


def onnx_path(model: str, variant: str) -> Path:
    """``artifacts/<model>/onnx/<file>`` of ``variant``."""
    return common.model_artifacts(model) / "onnx" / VARIANTS[variant].onnx_file


def main(argv: Sequence[str] | None = None) -> None:
    """``python trt_tools.py detect``: what detection finds (trtexec, the libnvinfer it really
    loads, the Python runtime, Jetson facts) as JSON. Stage 6 is ``6_build_engines.py``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python trt_tools.py detect   (stage 6: python 6_build_engines.py --help)"
    if argv in (["-h"], ["--help"]):
        print(f"{usage}\n\n{main.__doc__}")
        sys.exit(0)
    if argv != ["detect"]:
        print(usage, file=sys.stderr)
        sys.exit(2)
    trtexec, how = find_trtexec()
    out: dict[str, Any] = {"trtexec": str(trtexec) if trtexec else None, "how": how,
                           "jetson": jetson_info()}
    if trtexec:
        det, probs = detect_with_loader_fix(trtexec)
        out.update(det.as_dict(), conflicts=probs)
    else:
        out["python_tensorrt"] = vstr(python_trt_version()[0])
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
