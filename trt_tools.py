"""TensorRT helpers for stages 6 and 7: log parsers, per-version trtexec command lines, version and
platform detection, and the engine-build driver behind ``6_build_engines.sh``.

Nothing here imports TensorRT at module level, so the parsers and the command builder run (and are
tested) on machines without TensorRT or a GPU.

Sources relied on (read to learn; flag names checked per release in NVIDIA/TensorRT
``samples/common/sampleOptions.cpp`` at tags v8.6.1, v9.3.0, v10.0.1, v10.3.0, v10.16, v11.0,
v11.1):
- trtexec flags: ``--onnx``, ``--saveEngine``, ``--loadEngine``, ``--timingCacheFile``,
  ``--min/opt/maxShapes``, ``--memPoolSize=workspace:<size>`` (8.4+; MiB unless a suffix; the
  ``K/M/G`` suffixes are documented from 10.x), ``--profilingVerbosity=detailed`` +
  ``--exportLayerInfo`` (8.2+), ``--useDLACore`` / ``--allowGPUFallback``, ``--noTF32``.
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

Run ``python trt_tools.py build --help`` (or ``bash 6_build_engines.sh --help``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import common
import onnx_graph
import variants
from common import StageError, UsageError

# --------------------------------------------------------------------------------------------
# Variants (the registry is variants.py)
# --------------------------------------------------------------------------------------------
VARIANTS = variants.VARIANTS
Variant = variants.Variant
DEFAULT_VARIANTS = tuple(v.name for v in variants.for_stage(6))


def variant_for_engine(path: Path | str) -> Variant | None:
    """The variant whose plan file is ``path`` (``<variant>.plan``), or None."""
    return VARIANTS.get(Path(path).stem)


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------
Version = tuple  # (major, minor, patch[, build]) of ints


def parse_version(text: str) -> Version:
    """``"10.3.0.30"`` / ``"8.6"`` / ``"v10.3"`` -> tuple of ints.

    Raises:
        UsageError: not a dotted version.
    """
    m = re.fullmatch(r"v?(\d+(?:\.\d+){0,3})", text.strip())
    if not m:
        raise UsageError(f"not a TensorRT version: {text!r} (expected e.g. 8.6.1, 10.3.0, 11.0)")
    return tuple(int(p) for p in m.group(1).split("."))


def decode_version_int(n: int) -> Version:
    """Decode ``NV_TENSORRT_VERSION`` / ``getInferLibVersion()`` / the ``[TensorRT vN]`` banner.

    8.x/9.x encode ``major*1000 + minor*100 + patch`` (``v8601`` = 8.6.1); 10.x and later
    ``major*10000 + minor*100 + patch`` (``v100300`` = 10.3.0, ``v101601`` = 10.16.1,
    ``v110000`` = 11.0.0), see ``NV_TENSORRT_VERSION_INT`` in NvInferRuntimeBase.h.
    """
    if n >= 100000:
        return (n // 10000, (n // 100) % 100, n % 100)
    return (n // 1000, (n // 100) % 10, n % 100)


def vstr(v: Sequence[int] | None) -> str | None:
    """Version tuple -> ``"10.3.0"`` (None stays None)."""
    return None if v is None else ".".join(str(p) for p in v)


# --------------------------------------------------------------------------------------------
# Parsers (tested on the real captured outputs in tests/data/trt/, see SOURCES.md there)
# --------------------------------------------------------------------------------------------
_BANNER = re.compile(r"\[TensorRT v(\d+)\]")
_HEADER = re.compile(r"TensorRT version:\s*(\d+\.\d+\.\d+(?:\.\d+)?)")


def parse_trtexec_version(text: str) -> dict[str, Version | None]:
    """Versions printed by trtexec.

    Args:
        text: trtexec console output (any run, also ``--help``).
    Returns:
        ``{"banner": (10, 3, 0) from "[TensorRT v100300]", "header": (10, 16, 1) from
        "TensorRT version: 10.16.1"}``; a key is None when its line is absent. Both are
        compile-time values of the trtexec binary, not of the loaded libnvinfer.
    """
    b = _BANNER.search(text)
    h = _HEADER.search(text)
    return {"banner": decode_version_int(int(b.group(1))) if b else None,
            "header": tuple(int(p) for p in h.group(1).split(".")) if h else None}


_METRIC_LINE = re.compile(r"\]\s*(?:\[I\]\s*)?(?P<key>[A-Za-z0-9 ]+?):\s*(?P<body>min = .*)$")
_STAT = re.compile(r"(min|max|mean|median|percentile\((\d+(?:\.\d+)?)%\))\s*=\s*([-+0-9.eE]+)\s*ms")
_SCALAR = {
    "Throughput": ("throughput_qps", re.compile(r"Throughput:\s*([-+0-9.eE]+)\s*qps")),
    "Total Host Walltime": ("total_host_walltime_s",
                            re.compile(r"Total Host Walltime:\s*([-+0-9.eE]+)\s*s\b")),
    "Total GPU Compute Time": ("total_gpu_compute_time_s",
                               re.compile(r"Total GPU Compute Time:\s*([-+0-9.eE]+)\s*s\b")),
}


def _metric_key(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.strip().lower()).strip("_")


def parse_performance_summary(text: str) -> dict | None:
    """Parse trtexec's ``=== Performance summary ===`` block (8.x, 10.x and 11.x print it alike).

    Args:
        text: trtexec console output (log file contents).
    Returns:
        None when the log has no summary (build failed, ``--skipInference``), else::

            {"throughput_qps": float, "total_host_walltime_s": float,
             "total_gpu_compute_time_s": float,
             "gpu_compute_time": {"min_ms", "max_ms", "mean_ms", "median_ms",
                                  "p90_ms", "p95_ms", "p99_ms"},   # ms
             "latency": {...}, "enqueue_time": {...}, "h2d_latency": {...},
             "d2h_latency": {...}}

        Percentile keys follow the printed percentiles (``--percentile``, default 90,95,99).
        ``Latency`` is H2D + GPU compute + D2H per query (trtexec's own definition); with
        ``Data transfers: Disabled`` (11.x default) H2D/D2H are 0 and Latency equals GPU Compute
        Time.
    """
    start = text.find("=== Performance summary ===")
    if start < 0:
        return None
    block = text[start:]
    end = block.find("&&&&")
    block = block[:end] if end > 0 else block
    out: dict[str, Any] = {}
    for line in block.splitlines():
        line = line.rstrip()
        for key, (field, rx) in _SCALAR.items():
            if key + ":" in line and field not in out:
                m = rx.search(line)
                if m:
                    out[field] = float(m.group(1))
        if "Total " in line:
            continue
        m = _METRIC_LINE.search(line)
        if not m:
            continue
        stats = {}
        for s in _STAT.finditer(m.group("body")):
            name = s.group(1)
            k = f"p{s.group(2).rstrip('0').rstrip('.') if '.' in s.group(2) else s.group(2)}_ms" \
                if name.startswith("percentile") else f"{name}_ms"
            stats[k] = float(s.group(3))
        if stats:
            out[_metric_key(m.group("key"))] = stats
    return out or None


_BINDING = re.compile(r"(?:Created )?(?P<io>[Ii]nput|[Oo]utput) binding for (?P<name>\S+) with "
                      r"dimensions (?P<dims>[0-9x]+)")


def parse_inference_shapes(text: str) -> dict[str, dict[str, list[int]]]:
    """Shapes trtexec ran inference with (``Input binding for x with dimensions 1x1x28x28``,
    or 8.x verbose ``Created input binding for ...``).

    Returns:
        ``{"inputs": {name: [dims]}, "outputs": {name: [dims]}}`` (empty dicts if absent).
    """
    out: dict[str, dict[str, list[int]]] = {"inputs": {}, "outputs": {}}
    for m in _BINDING.finditer(text):
        side = "inputs" if m.group("io").lower() == "input" else "outputs"
        out[side].setdefault(m.group("name"), [int(d) for d in m.group("dims").split("x")])
    return out


_UNKNOWN = re.compile(r"Unknown option:\s*(--\S+)(?:[ \t]+(\S.*?))?[ \t]*$", re.M)


def parse_unknown_options(text: str) -> list[str]:
    """Options trtexec rejected (``[E] Unknown option: --fp16`` or ``--workspace 2048``), with
    their value re-joined by ``=``; raw trtexec prints a trailing space when there is no value,
    copies stripped of trailing whitespace do not, both are accepted."""
    return [m.group(1) + (f"={m.group(2)}" if m.group(2) else "") for m in _UNKNOWN.finditer(text)]


_PLAN_VERSION = re.compile(r"Plan was created with TensorRT version\s+(\d+(?:\.\d+){1,3})")


def parse_plan_version(text: str) -> Version | None:
    """Version from ``trtexec --loadEngine=P --getPlanVersionOnly`` output.

    No public capture of this output exists (see tests/data/trt/SOURCES.md), so this parser is
    written against the documented behaviour: trtexec (9.x+, ``samples/common/sampleEngines.cpp``
    ``printPlanVersion``) logs ``Plan was created with TensorRT version A.B.C.D`` at info level,
    i.e. behind the usual ``[date-time] [I] `` prefix, the four numbers being bytes 24..27 of
    the plan.

    Returns:
        ``(A, B, C, D)`` or None if the line is absent.
    """
    m = _PLAN_VERSION.search(text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


PLAN_FILE_TAG = 0x74727466  # first little-endian uint32 of a plan, per sampleEngines.cpp


def read_plan_header_version(path: Path | str) -> Version | None:
    """Plan version read from the file header, the way trtexec's ``--getPlanVersionOnly`` does
    (tag ``0x74727466`` at offset 0, serialization word 0 at offset 4, version bytes 24..27).

    Returns None when the header does not have that layout (e.g. plans whose serialization
    word is not 0, which the trtexec code also refuses); no claim is made for such plans.
    """
    with open(path, "rb") as f:
        head = f.read(28)
    if len(head) < 28:
        return None
    tag, ser = int.from_bytes(head[0:4], "little"), int.from_bytes(head[4:8], "little")
    if tag != PLAN_FILE_TAG or ser != 0:
        return None
    return tuple(head[24:28])


_LIB_MISMATCH = re.compile(r"expecting library version\s+([^\s,]*?)\s+got\s+([^\s,]*?)[\s,]*"
                           r"(?:please rebuild|\)|$)", re.M)
_TAG_MISMATCH = re.compile(r"Current Version:\s*(\d+),\s*Serialized Engine Version:\s*(\d+)")
_DEV_MISMATCH = re.compile(r"expecting compute\s+([0-9.]+)\s+got compute\s+([0-9.]+)")


def parse_version_mismatch(text: str) -> dict | None:
    """Plan/runtime mismatch reported by the TensorRT runtime logger (8.x, 9.x, 10.x texts).

    Forms (real captures in tests/data/trt/plan_*.txt):
    - ``... not compatible with this version of TensorRT, expecting library version 8.6.1.6 got
      8.6.1.4, please rebuild.`` (8.x, 9.x; 10.x ends ``... got .)`` with an empty "got").
      ``expected`` is the deserialising library, ``got`` the plan, as in the 8.6.1 capture
      (runtime 8.6.1.6, plan 8.6.1.4) and the 10.12 capture (runtime 10.12.0.36). The 8.5.3
      capture's source does not say which side is which; read the pair as "the two versions
      involved" and take the runtime's own version from the runtime.
    - ``Version tag does not match. Note: Current Version: 213, Serialized Engine Version: 205``
      (serialization tag, 8.2-era) -> ``kind="serialization"``.
    - ``expecting compute 8.9 got compute 8.6`` (plan built for another GPU) -> ``kind="device"``.

    Returns:
        ``{"kind": "library"|"serialization"|"device", "expected": str, "got": str | None}``
        or None. An empty/unparseable "got" becomes None.
    """
    m = _LIB_MISMATCH.search(text)
    if m:
        got = m.group(2).rstrip(".")
        return {"kind": "library", "expected": m.group(1).rstrip("."), "got": got or None}
    m = _TAG_MISMATCH.search(text)
    if m:
        return {"kind": "serialization", "expected": m.group(1), "got": m.group(2)}
    m = _DEV_MISMATCH.search(text)
    if m:
        return {"kind": "device", "expected": m.group(1), "got": m.group(2)}
    return None


# Data-type words as printed in "Format/Datatype" (long pre-10 spelling, e.g. "Channel major FP16
# format where channel % 8 == 0", or short 10.x spelling, e.g. "Float") and in 11.x "DataType".
_DTYPE_WORDS = (
    (re.compile(r"\bBFloat16\b|\bBF16\b"), "BF16"),
    (re.compile(r"\bFP8\b|\bE4M3\b|\bE5M2\b"), "FP8"),
    (re.compile(r"\bFP4\b|\bFP4E2M1\b"), "FP4"),
    (re.compile(r"\bInt4\b|\bINT4\b"), "INT4"),
    (re.compile(r"\bFP16\b|\bHalf\b"), "FP16"),
    (re.compile(r"\bFP32\b|\bFloat\b"), "FP32"),
    (re.compile(r"\bDouble\b|\bFP64\b"), "FP64"),
    (re.compile(r"\bUInt8\b"), "UINT8"),
    (re.compile(r"\bInt8\b|\bINT8\b"), "INT8"),
    (re.compile(r"\bInt32\b|\bINT32\b"), "INT32"),
    (re.compile(r"\bInt64\b|\bINT64\b"), "INT64"),
    (re.compile(r"\bBool\b"), "BOOL"),
)
_SHORT_DTYPES = {"Float", "Half", "Int8", "Int32", "Int64", "BFloat16", "FP8", "Int4", "FP4",
                 "Bool", "UInt8", "Double", "None"}


def dtype_of(fmt: str | None) -> str | None:
    """Data type of a layer-info tensor description: ``"Row major linear FP32"`` -> ``FP32``,
    ``"Thirty-two wide channel vectorized row major Int8 format"`` -> ``INT8``, ``"Half"`` ->
    ``FP16``. None if unknown."""
    if not fmt:
        return None
    for rx, name in _DTYPE_WORDS:
        if rx.search(fmt):
            return name
    return None


def _tensor_dtype(t: Mapping) -> tuple[str | None, str | None]:
    """(dtype, spelling) of one tensor entry of layer info."""
    if "DataType" in t:  # 11.x split field (migration guide: Format/Datatype -> Format + DataType)
        return dtype_of(str(t["DataType"])), "split"
    fmt = t.get("Format/Datatype")
    if fmt is None:
        return None, None
    return dtype_of(fmt), ("short" if str(fmt).strip() in _SHORT_DTYPES else "long")


NAMES_ONLY_ADVICE = ("layer info holds layer names only: rebuild the engine with "
                     "--profilingVerbosity=detailed (6_build_engines.sh does) to get layer types, "
                     "formats and data types")


def parse_layer_info(info: str | Mapping | Sequence) -> dict:
    """Summarise engine layer information (``trtexec --exportLayerInfo`` file or
    ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``).

    Accepts the names-only form (``{"Layers": ["name", ...], "Bindings": [...]}``, written when
    the engine was built without ``--profilingVerbosity=detailed``), the detailed form with the
    pre-10 long spelling, the 10.x short spelling (``"Format/Datatype": "Float"``) and the 11.x
    split ``DataType`` field with ``"I/O Tensors"`` replacing ``"Bindings"`` (11.x: from the
    TensorRT migration guide; no public 11.x capture was available).

    Reformat layers are those with ``LayerType == "Reformat"``: layout/precision conversions
    the builder inserted (``Origin: REFORMAT``, named ``Reformatting CopyNode ...``) and
    QuantizeLinear ops implemented as reformats (``Origin: QDQ``). Layers named
    ``Reformatting CopyNode`` with ``LayerType: NoOp`` were optimised away and are counted
    separately. Many reformats between INT8 and FP32/FP16 regions are why an INT8 engine can be
    slower than the FP16 one.

    Returns:
        ``{"detailed": bool, "spelling": sorted spellings seen, "n_layers": int,
        "reformat_layers": int, "reformat_by_origin": {origin: n}, "reformat_noop": int,
        "output_dtypes": {dtype: n outputs}, "layer_types": {type: n},
        "layers": [{"name", "type", "origin", "outputs": [{"name", "dtype"}]}],
        "io_tensors": [names], "advice": str | None}``. For the names-only form
        ``reformat_layers`` counts names starting with ``Reformatting CopyNode`` (an upper
        bound: NoOps cannot be told apart) and the dtype fields are empty.
    Raises:
        StageError: not layer information.
    """
    if isinstance(info, (str, bytes)):
        try:
            info = json.loads(info)
        except json.JSONDecodeError as e:
            raise StageError(f"layer info is not JSON: {e}") from e
    if isinstance(info, list):  # a bare list of layers
        if any(isinstance(x, Mapping) and ("timeMs" in x or "count" in x) for x in info):
            raise StageError("this is a trtexec --exportProfile file, not layer information")
        info = {"Layers": info}
    if not isinstance(info, Mapping) or "Layers" not in info:
        raise StageError("layer info has no 'Layers' key")
    layers = info["Layers"]
    io = info.get("Bindings")
    if io is None and "I/O Tensors" in info:
        io = [t.get("Name") for t in info["I/O Tensors"]]
    io = [t if isinstance(t, str) else t.get("Name") for t in (io or [])]
    out: dict[str, Any] = {"detailed": False, "spelling": [], "n_layers": len(layers),
                           "reformat_layers": 0, "reformat_by_origin": {}, "reformat_noop": 0,
                           "output_dtypes": {}, "layer_types": {}, "layers": [],
                           "io_tensors": io, "advice": None}
    if all(isinstance(layer, str) for layer in layers):
        out["reformat_layers"] = sum(1 for n in layers if n.startswith("Reformatting CopyNode"))
        out["advice"] = NAMES_ONLY_ADVICE
        out["layers"] = [{"name": n, "type": None, "origin": None, "outputs": []} for n in layers]
        return out
    out["detailed"] = True
    spell: set[str] = set()
    for layer in layers:
        if isinstance(layer, str):
            layer = {"Name": layer}
        name, ltype = layer.get("Name", ""), layer.get("LayerType")
        origin = layer.get("Origin")
        out["layer_types"][ltype] = out["layer_types"].get(ltype, 0) + 1
        if ltype == "Reformat":
            out["reformat_layers"] += 1
            key = origin or "unknown"
            out["reformat_by_origin"][key] = out["reformat_by_origin"].get(key, 0) + 1
        elif name.startswith("Reformatting CopyNode"):
            out["reformat_noop"] += 1
        outs = []
        for t in layer.get("Outputs", []) or []:
            dt, sp = _tensor_dtype(t)
            if sp:
                spell.add(sp)
            outs.append({"name": t.get("Name"), "dtype": dt})
            out["output_dtypes"][dt or "unknown"] = out["output_dtypes"].get(dt or "unknown", 0) + 1
        out["layers"].append({"name": name, "type": ltype, "origin": origin, "outputs": outs})
    out["spelling"] = sorted(spell)
    return out


def layer_summary(summary: Mapping) -> dict:
    """:func:`parse_layer_info` result without the per-layer list (for results JSON)."""
    return {k: v for k, v in summary.items() if k != "layers"}


def layer_dtype_table(summary: Mapping) -> list[dict]:
    """Per-layer rows ``{"name", "type", "origin", "output_dtypes": "FP16,INT8"}`` (the table
    that shows where an engine converts precision)."""
    return [{"name": lay["name"], "type": lay["type"], "origin": lay["origin"],
             "output_dtypes": ",".join(sorted({o["dtype"] or "?" for o in lay["outputs"]}))}
            for lay in summary.get("layers", [])]


def parse_export_profile(info: str | Sequence) -> dict:
    """Summarise a ``trtexec --exportProfile`` JSON (``[{"count": N}, {"name", "timeMs",
    "averageMs", "medianMs", "percentage"}, ...]``).

    Returns:
        ``{"count": runs, "n_layers", "total_average_ms", "reformat_layers",
        "reformat_average_ms", "reformat_percent"}`` where reformat entries are those named
        ``Reformatting CopyNode ...`` (QDQ reformats carry their ONNX names and are not included).
    """
    data = json.loads(info) if isinstance(info, (str, bytes)) else info
    count = next((d["count"] for d in data if "count" in d), None)
    rows = [d for d in data if "name" in d]
    ref = [d for d in rows if d["name"].startswith("Reformatting CopyNode")]
    return {"count": count, "n_layers": len(rows),
            "total_average_ms": sum(d.get("averageMs", 0.0) for d in rows),
            "reformat_layers": len(ref),
            "reformat_average_ms": sum(d.get("averageMs", 0.0) for d in ref),
            "reformat_percent": sum(d.get("percentage", 0.0) for d in ref)}


def parse_ldd(text: str) -> dict[str, str | None]:
    """``ldd`` output -> ``{soname: resolved path or None ("not found")}``."""
    out: dict[str, str | None] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(not found|\S+)", line)
        if m:
            out[m.group(1)] = None if m.group(2) == "not found" else m.group(2)
    return out


def error_lines(text: str, limit: int = 20) -> list[str]:
    """The last ``limit`` error lines of a trtexec log (``[E]``, ``ERROR``, ``&&&& FAILED``)."""
    lines = [ln.rstrip() for ln in text.splitlines()
             if "[E]" in ln or "ERROR" in ln or ln.startswith("&&&& FAILED")]
    return lines[-limit:]


# --------------------------------------------------------------------------------------------
# Command lines per TensorRT major version
# --------------------------------------------------------------------------------------------
class UnsupportedVariant(StageError):
    """The variant cannot be built with this TensorRT version (recorded as skipped)."""


def dla_allowed(trt_version: Version, variant: Variant) -> str | None:
    """Why DLA cannot be used for ``variant`` on ``trt_version`` (None if it can).

    DLA runs FP16 and INT8 layers only (TensorRT DLA docs), so FP32 and INT4 weight-only
    variants stay on the GPU. TensorRT 11.0-11.4.0 do not support DLA on JetPack; the 11.4.1
    docs list Jetson AGX Orin with JetPack 7.2.2+.
    """
    if variant.kind not in ("fp16", "qdq"):
        return (f"DLA runs FP16/INT8 layers only; {variant.name} ({variant.precision}) stays "
                "on the GPU")
    if trt_version[0] >= 11 and tuple(trt_version[:3]) < (11, 4, 1):
        return (f"TensorRT {vstr(trt_version)} has no DLA support on Jetson (11.4.1+ with "
                "JetPack 7.2.2+)")
    return None


def _shape(name: str, dims: Sequence[int]) -> str:
    return f"{name}:" + "x".join(str(d) for d in dims)


def build_command(onnx: Path | str, plan: Path | str, variant: str, trt_version: Sequence[int], *,
                  timing_cache: Path | str, layer_info: Path | str | None = None,
                  mem_pool_mb: int | None = None, dla_core: int | None = None,
                  input_name: str | None = None, input_shape: Sequence[int | None] | None = None,
                  min_batch: int = 1, opt_batch: int = 1, max_batch: int = 64,
                  no_tf32: bool = False, trtexec: str = "trtexec") -> list[str]:
    """The trtexec command that builds ``variant`` from ``onnx`` on ``trt_version``.

    Precision rules (issue 4):
    - 8.x (weakly typed only): ``--fp16`` for the FP16 graph, ``--int8`` for Q/DQ graphs (without
      it TensorRT 8 does not pick INT8 kernels for Q/DQ); nothing for FP32. INT4 graphs are not
      buildable (raises :class:`UnsupportedVariant`).
    - 9.x/10.x: ``--stronglyTyped`` for FP16, Q/DQ and INT4 graphs, so precision comes from the
      ONNX tensor types; FP32 is a plain build. With DLA the documented 10.x path is the weakly
      typed one (``--useDLACore=N --fp16|--int8 --allowGPUFallback``), so that is used instead.
    - 11.x: strongly typed only; no precision flag at all (``--fp16``/``--int8``/``--best`` are
      "Unknown option"; ``--stronglyTyped`` is a no-op and left out).
    Never passed: ``--explicitBatch``, ``--workspace``, ``--buildOnly``, ``--best``.

    Args:
        onnx, plan: input model and output plan path.
        variant: a key of :data:`VARIANTS`.
        trt_version: detected (or ``--trt-version``) TensorRT version, e.g. ``(10, 3, 0)``.
        timing_cache: ``--timingCacheFile`` (read if present, updated after the build).
        layer_info: ``--exportLayerInfo`` path (with ``--profilingVerbosity=detailed``); None
            leaves both out.
        mem_pool_mb: workspace pool limit in MiB (``--memPoolSize=workspace:N`` on 8.x where the
            unit is MiB, ``workspace:NM`` on 10.x+ where suffixes are documented).
        dla_core: DLA core; always paired with ``--allowGPUFallback``.
        input_name, input_shape: the ONNX input and its shape, ``None``/0 for the dynamic batch
            axis; with a dynamic batch, ``--minShapes/--optShapes/--maxShapes`` use
            ``min_batch``/``opt_batch``/``max_batch`` (trtexec then runs its timing at the opt
            shape).
        no_tf32: add ``--noTF32`` (FP32 layers otherwise may use TF32 on Ampere+).
        trtexec: program path.
    Returns:
        argv list.
    Raises:
        UsageError: unknown variant, TensorRT < 8, bad DLA request.
        UnsupportedVariant: the variant needs a newer TensorRT.
    """
    if variant not in VARIANTS:
        raise UsageError(f"unknown variant {variant!r}: choose from {', '.join(VARIANTS)}")
    v = VARIANTS[variant]
    ver = tuple(int(p) for p in trt_version)
    major = ver[0]
    if major < 8:
        raise UsageError(f"TensorRT {vstr(ver)} is not supported (8.5+ needed)")
    if v.kind == "int4" and major < 10:
        raise UnsupportedVariant(f"{variant}: INT4 weight-only Q/DQ graphs need TensorRT 10+, "
                                 f"this is {vstr(ver)}")
    if dla_core is not None:
        if dla_core < 0:
            raise UsageError(f"--dla-core {dla_core}: must be >= 0")
        why = dla_allowed(ver, v)
        if why:
            raise UsageError(why)
    cmd = [trtexec, f"--onnx={onnx}", f"--saveEngine={plan}", f"--timingCacheFile={timing_cache}"]
    if input_name and input_shape and (input_shape[0] is None or input_shape[0] == 0):
        rest = [int(d) for d in input_shape[1:]]
        for flag, b in (("--minShapes", min_batch), ("--optShapes", opt_batch),
                        ("--maxShapes", max_batch)):
            cmd.append(f"{flag}={_shape(input_name, [b, *rest])}")
    weak = major < 9 or (major < 11 and dla_core is not None)
    if weak:
        if v.kind == "fp16":
            cmd.append("--fp16")
        elif v.kind == "qdq":
            # Weak typing ignores the ONNX's float types: the layers ModelOpt left in FP16
            # (high-precision dtype fp16, e.g. the `int8` recipe) run in FP32 unless --fp16 is
            # also given; fp32 high-precision variants (`int8_hp32`) keep them FP32 on purpose.
            cmd.append("--int8")
            if v.high_precision_fp16:
                cmd.append("--fp16")
    elif major < 11 and v.kind in ("fp16", "qdq", "int4"):
        cmd.append("--stronglyTyped")
    if layer_info is not None:
        cmd += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    if mem_pool_mb is not None:
        if mem_pool_mb <= 0:
            raise UsageError(f"--mem-pool-mb {mem_pool_mb}: must be > 0")
        cmd.append(f"--memPoolSize=workspace:{mem_pool_mb}" + ("M" if major >= 10 else ""))
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
# ONNX input
# --------------------------------------------------------------------------------------------
def onnx_input(path: Path | str) -> tuple[str, list[int | None]]:
    """Name and shape of the first real graph input (dynamic dims = None); reads the graph only
    (no external weight data)."""
    inputs = onnx_graph.inputs(onnx_graph.load(path, external=False))
    if not inputs:
        raise StageError(f"{path}: the graph has no input")
    return inputs[0][0], inputs[0][1]


# Highest ONNX opset the ONNX parser of each TensorRT major supports (TensorRT 8.6 support
# matrix / onnx-tensorrt "Supported ONNX opsets": 8.6 parses opsets up to 17; 10.x up to 20+).
MAX_PARSER_OPSET = {8: 17}


def opset_warning(path: Path | str, trt_version: Version | None) -> str | None:
    """A warning when the ONNX file's default-domain opset is newer than the TensorRT
    version's parser supports (8.x: 17), with the fix; None when fine or unknown."""
    import onnx

    if not trt_version or trt_version[0] not in MAX_PARSER_OPSET or not Path(path).exists():
        return None
    m = onnx.load(str(path), load_external_data=False)
    opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0)
    limit = MAX_PARSER_OPSET[trt_version[0]]
    if opset <= limit:
        return None
    return (f"{Path(path).name} uses ONNX opset {opset}; TensorRT {vstr(trt_version)}'s parser "
            f"supports up to {limit}: export with `2_export_onnx.py --exporter legacy --opset "
            f"{limit}` (and quantize that file) if the parser rejects it")


# --------------------------------------------------------------------------------------------
# Build driver (6_build_engines.sh)
# --------------------------------------------------------------------------------------------
STAGE6 = "6_build_engines"


def engines_dir(model: str) -> Path:
    """``artifacts/<model>/engines``."""
    return common.model_artifacts(model) / "engines"


def engine_paths(model: str, variant: str) -> dict[str, Path]:
    """Plan, build log, layer info and timing cache paths of ``variant``."""
    d = engines_dir(model)
    return {"plan": d / f"{variant}.plan", "log": d / f"{variant}.build.log",
            "layers": d / f"{variant}.layers.json", "cache": d / "timing.cache"}


def onnx_path(model: str, variant: str) -> Path:
    """``artifacts/<model>/onnx/<file>`` of ``variant``."""
    return common.model_artifacts(model) / "onnx" / VARIANTS[variant].onnx_file


def _record(args, variant: str, status: str, reason: str | None, started: float,
            inputs: Iterable[Path] = (), **fields) -> dict:
    v = VARIANTS[variant]
    rec = common.result_record(STAGE6, "TensorRT", v.precision, args.model, f"trt_build_{variant}",
                               status=status, reason=reason, variant=variant,
                               expected_failure=v.expected_failure, **fields)
    rec["provenance"] = common.provenance(args, list(inputs), started)
    return rec


def _write(args, variant: str, rec: dict) -> Path:
    return common.write_result(args.model, f"trt_build_{variant}", rec)


def _input_spec(args, variant: str) -> tuple[str, list[int | None], str]:
    p = onnx_path(args.model, variant)
    if p.exists():
        name, shape = onnx_input(p)
        return name, shape, "from ONNX"
    crop = common.MODEL_TABLE[args.model].crop if args.model in common.MODEL_TABLE else 224
    return "input", [None, 3, crop, crop], "assumed (ONNX not written yet)"


def _dry_run(args, variants: Sequence[str]) -> None:
    if not args.trt_version:
        raise UsageError("--dry-run needs --trt-version (e.g. 8.6.1, 10.3.0, 11.0.0)")
    ver = parse_version(args.trt_version)
    ver = ver + (0,) * (3 - len(ver)) if len(ver) < 3 else ver
    tool = os.environ.get("TRTEXEC") or "trtexec"
    for var in variants:
        paths = engine_paths(args.model, var)
        name, shape, how = _input_spec(args, var)
        dla = args.dla_core
        if dla is not None and dla_allowed(ver, VARIANTS[var]):
            print(f"# {var}: {dla_allowed(ver, VARIANTS[var])}: built for the GPU")
            dla = None
        warn = opset_warning(onnx_path(args.model, var), ver)
        if warn:
            print(f"# {var}: WARNING: {warn}")
        try:
            cmd = build_command(onnx_path(args.model, var), paths["plan"], var, ver,
                                timing_cache=paths["cache"], layer_info=paths["layers"],
                                mem_pool_mb=args.mem_pool_mb, dla_core=dla,
                                input_name=name, input_shape=shape, min_batch=args.min_batch,
                                opt_batch=args.opt_batch, max_batch=args.max_batch,
                                no_tf32=args.no_tf32, trtexec=tool)
        except UnsupportedVariant as e:
            print(f"# {var}: not built with TensorRT {vstr(ver)}: {e}")
            continue
        print(f"# {var} ({VARIANTS[var].precision}, TensorRT {vstr(ver)}, input {name} {how})")
        print(shlex.join(cmd))
        check = plan_version_command(paths["plan"], ver, tool)
        print(shlex.join(check) if check else
              "# plan check: deserialise with the Python runtime (trtexec 8.x has no "
              "--getPlanVersionOnly)")


def _python_plan_check(plan: Path, env: Mapping[str, str]) -> tuple[bool | None, str]:
    """Deserialise ``plan`` with the Python runtime in a child process (8.x plan check)."""
    code = (
        "import sys, tensorrt as trt\n"
        "class L(trt.ILogger):\n"
        "    def __init__(s):\n        trt.ILogger.__init__(s)\n"
        "    def log(s, sev, msg):\n        print(msg)\n"
        "rt = trt.Runtime(L())\n"
        "e = rt.deserialize_cuda_engine(open(sys.argv[1], 'rb').read())\n"
        "print('DESERIALIZED' if e is not None else 'FAILED')\n")
    rc, text = _run([sys.executable, "-c", code, str(plan)], env, timeout=300)
    if "DESERIALIZED" in text:
        return True, "deserialised by the Python runtime"
    if rc != 0 and "No module named" in text:
        return None, "Python tensorrt not importable: plan not checked"
    mm = parse_version_mismatch(text)
    return False, (f"runtime refuses the plan: {mm}" if mm else text.strip()[-500:])


def _verify_plan(plan: Path, det: Detected) -> dict:
    """Check the plan's TensorRT version against the runtime that will load it."""
    ver = det.version or (0,)
    runtime = det.python_runtime or det.libnvinfer_version
    cmd = plan_version_command(plan, ver, det.trtexec)
    if cmd is None:
        ok, detail = _python_plan_check(plan, det.env)
        return {"method": "python-deserialize", "plan_version": None,
                "runtime_version": vstr(det.python_runtime), "ok": ok, "detail": detail}
    rc, text = _run(cmd, det.env)
    pv = parse_plan_version(text)
    if pv is None:
        return {"method": "trtexec --getPlanVersionOnly", "plan_version": None,
                "runtime_version": vstr(runtime), "ok": False,
                "detail": f"no plan version in the output (rc={rc}): {text.strip()[-300:]}"}
    n = min(len(pv), len(runtime or ()))
    ok = bool(runtime) and tuple(pv[:n]) == tuple(runtime[:n])
    return {"method": "trtexec --getPlanVersionOnly", "plan_version": vstr(pv),
            "runtime_version": vstr(runtime), "ok": ok,
            "detail": "match" if ok else f"plan {vstr(pv)} vs runtime {vstr(runtime)}"}


def _build_one(args, var: str, det: Detected, jetson: dict | None) -> tuple[dict, bool]:
    """Build one variant. Returns ``(record, unexpected_failure)``."""
    started = time.time()
    v = VARIANTS[var]
    paths = engine_paths(args.model, var)
    src = onnx_path(args.model, var)
    name, shape = onnx_input(src)
    pid = os.getpid()
    tmp_plan = paths["plan"].with_name(f".tmp-{pid}-{paths['plan'].name}")
    tmp_layers = paths["layers"].with_name(f".tmp-{pid}-{paths['layers'].name}")
    dla = args.dla_core
    dla_note = None
    if dla is not None and dla_allowed(det.version, v):
        dla_note, dla = dla_allowed(det.version, v), None
    try:
        cmd = build_command(src, tmp_plan, var, det.version, timing_cache=paths["cache"],
                            layer_info=tmp_layers, mem_pool_mb=args.mem_pool_mb, dla_core=dla,
                            input_name=name, input_shape=shape, min_batch=args.min_batch,
                            opt_batch=args.opt_batch, max_batch=args.max_batch,
                            no_tf32=args.no_tf32, trtexec=det.trtexec)
    except UnsupportedVariant as e:
        return _record(args, var, "skipped", str(e), started, [src],
                       detected=det.as_dict()), False
    paths["plan"].parent.mkdir(parents=True, exist_ok=True)
    print(f"[{var}] {shlex.join(cmd)}", flush=True)
    t0 = time.time()
    with common.atomic_path(paths["log"]) as tmp_log:
        with open(tmp_log, "w") as f:
            f.write(f"# command: {shlex.join(cmd)}\n")
            if det.loader_fix:
                f.write(f"# LD_LIBRARY_PATH first entry (loader fix): {det.loader_fix}\n")
            f.flush()
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=det.env)
    build_s = time.time() - t0
    text = paths["log"].read_text(errors="replace")
    passed = p.returncode == 0 and "&&&& PASSED" in text and tmp_plan.exists()
    fields: dict[str, Any] = {
        "opset_warning": opset_warning(src, det.version),
        "command": shlex.join(cmd), "returncode": p.returncode, "build_log": paths["log"],
        "build_wall_s": round(build_s, 2), "detected": det.as_dict(), "jetson": jetson,
        "dla_core": dla, "dla_note": dla_note,
        "unknown_options": parse_unknown_options(text), "errors": error_lines(text)}
    if not passed:
        for t in (tmp_plan, tmp_layers):
            t.unlink(missing_ok=True)
        if v.expected_failure:
            reason = ("expected failure reproduced: the CLI-quantised INT4 model does not parse; "
                      f"see {paths['log']}")
            return _record(args, var, "failed", reason, started, [src], reproduced=True,
                           **fields), False
        tail = "\n".join(text.splitlines()[-15:])
        print(f"[{var}] FAILED (rc={p.returncode}); log {paths['log']}:\n{tail}", file=sys.stderr)
        return _record(args, var, "failed", f"trtexec failed (rc={p.returncode}); see "
                       f"{paths['log']}", started, [src], **fields), True
    os.replace(tmp_plan, paths["plan"])
    if tmp_layers.exists():
        os.replace(tmp_layers, paths["layers"])
        summary = parse_layer_info(paths["layers"].read_text())
        fields["layer_info"] = layer_summary(summary)
        fields["layer_info_file"] = paths["layers"]
    fields["trtexec_perf"] = parse_performance_summary(text)
    fields["trtexec_inference_shapes"] = parse_inference_shapes(text)
    fields["plan"] = paths["plan"]
    fields["size_mb"] = common.file_size_mb(paths["plan"])
    check = _verify_plan(paths["plan"], det)
    fields["plan_check"] = check
    if v.expected_failure:
        return _record(args, var, "ok", "expected the INT4 parse failure, but the build passed: "
                       "the reproduction no longer reproduces", started, [src], reproduced=False,
                       **fields), False
    if check["ok"] is False:
        return _record(args, var, "failed", f"plan version check failed: {check['detail']}",
                       started, [src], **fields), True
    print(f"[{var}] ok: {paths['plan']} ({fields['size_mb']:.2f} MB), plan check: "
          f"{check['detail']}", flush=True)
    return _record(args, var, "ok", None, started, [src], **fields), False


def build_main(args) -> None:
    """Entry of ``6_build_engines.sh`` (see :func:`get_build_parser`)."""
    started = time.time()
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        raise UsageError(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    variants = list(dict.fromkeys(args.variants)) or list(DEFAULT_VARIANTS)
    if args.dry_run:
        _dry_run(args, variants)
        return
    trtexec, how = find_trtexec()
    if trtexec is None:
        reason = f"{how}; engines not built (set TRTEXEC=/path/to/trtexec on a GPU machine)"
        print(f"{STAGE6}: SKIPPED: {reason}")
        for var in variants:
            src = onnx_path(args.model, var)
            why = reason if src.exists() else (
                f"{src} missing (made by {VARIANTS[var].producer}); and {reason}")
            path = _write(args, var, _record(args, var, "skipped", why, started))
            print(f"  wrote {path}")
        return
    if args.variants:
        for var in variants:
            common.require(onnx_path(args.model, var), VARIANTS[var].producer)
    else:
        variants = [v for v in variants if onnx_path(args.model, v).exists()]
        if not variants:
            wanted = ", ".join(f"{onnx_path(args.model, v)} ({VARIANTS[v].producer})"
                               for v in DEFAULT_VARIANTS)
            raise StageError(f"no ONNX model to build; expected any of: {wanted}")
    det, probs = detect_with_loader_fix(trtexec)
    print(f"{STAGE6}: trtexec {trtexec} ({how}); " + json.dumps(det.as_dict()))
    if det.loader_fix:
        print(f"{STAGE6}: versions agree with {det.loader_fix} first on LD_LIBRARY_PATH "
              "(put it there in env.sh to make this permanent)")
    if probs:
        raise StageError("TensorRT versions disagree, refusing to build plans the runtime cannot "
                         "load:\n  - " + "\n  - ".join(probs) +
                         "\n  The loader-path fix (library folder of the Python runtime, "
                         "<trtexec>/../lib, $TENSORRT_HOME/lib first on LD_LIBRARY_PATH; env.sh "
                         "does this) did not help: install trtexec and the Python tensorrt "
                         "package of the same version, or point TRTEXEC at the matching trtexec.")
    if det.version is None:
        raise StageError(f"cannot tell which TensorRT {trtexec} uses ({det.ldd})")
    if det.python_runtime is None:
        print(f"{STAGE6}: warning: Python tensorrt not importable ({det.python_detail}); "
              "7_trt_eval.py will skip", file=sys.stderr)
    jetson = jetson_info()
    if args.dla_core is not None and jetson is None:
        raise UsageError("--dla-core: DLA exists on Jetson (Orin) only; this is not a Jetson")
    failed = []
    for var in variants:
        rec, bad_fail = _build_one(args, var, det, jetson)
        path = _write(args, var, rec)
        print(f"  {var}: {rec['status']}{': ' + rec['reason'] if rec['reason'] else ''} -> {path}")
        if bad_fail:
            failed.append(var)
    if failed:
        raise StageError(f"engine build failed for {', '.join(failed)} (logs in "
                         f"{engines_dir(args.model)})")


def get_build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="6_build_engines.sh",
        description="Build TensorRT engines from artifacts/<model>/onnx/*.onnx with trtexec "
                    "(flags per TensorRT major version); write artifacts/<model>/engines/"
                    "<variant>.{plan,build.log,layers.json} and results/<model>/"
                    "trt_build_<variant>.json. Without trtexec: skipped rows, exit 0.")
    p.add_argument("variants", nargs="*", metavar="VARIANT",
                   help=f"any of {', '.join(VARIANTS)} (default: those whose ONNX exists)")
    p.add_argument("--model", default=os.environ.get("MODEL", "mobilenet_v3_small"))
    p.add_argument("--dry-run", action="store_true",
                   help="print the trtexec command lines for --trt-version and exit")
    p.add_argument("--trt-version", help="TensorRT version for --dry-run, e.g. 8.6.1 / 10.3 / 11.0")
    p.add_argument("--mem-pool-mb", type=int, default=None,
                   help="workspace memory pool limit in MiB (--memPoolSize); default: trtexec's")
    p.add_argument("--dla-core", type=int, default=None,
                   help="Jetson only: build FP16/INT8 variants for DLA core N with GPU fallback")
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--opt-batch", type=int, default=1,
                   help="optimisation batch; trtexec's timing in the build log uses it")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--no-tf32", action="store_true", help="pass --noTF32")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """``python trt_tools.py build ...`` (stage 6) or ``python trt_tools.py detect``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["detect"]:
        trtexec, how = find_trtexec()
        out: dict[str, Any] = {"trtexec": str(trtexec) if trtexec else None, "how": how,
                               "jetson": jetson_info()}
        if trtexec:
            det, probs = detect_with_loader_fix(trtexec)
            out.update(det.as_dict(), conflicts=probs)
        else:
            out["python_tensorrt"] = vstr(python_trt_version()[0])
        print(json.dumps(out, indent=2))
        return
    if argv[:1] != ["build"]:
        print("usage: trt_tools.py {build|detect} ...", file=sys.stderr)
        sys.exit(2)
    sys.argv = ["6_build_engines.sh"] + argv[1:]  # provenance records the stage command
    common.cli(get_build_parser, build_main)


if __name__ == "__main__":
    main()
