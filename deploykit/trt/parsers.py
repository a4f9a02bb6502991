"""Parsers for TensorRT tool output: trtexec console logs, layer information, profiles, plan
headers, runtime-logger errors and ``ldd`` output.

Every function here is pure (text or bytes in, plain data out) and imports neither TensorRT nor
anything heavy, so each is tested on real captured output (``tests/data/trt/``, provenance in its
``SOURCES.md``) on machines without TensorRT or a GPU. ``trt_tools.py`` (versions, command lines,
detection) and the stages 6/7 use them.

Sources relied on (read to learn; formats checked against the captures):
- trtexec ``=== Performance summary ===``, binding lines, ``Unknown option`` lines: trtexec
  8.6-11.1 captures in tests/data/trt/.
- Plan header: NVIDIA/TensorRT ``samples/common/sampleEngines.cpp`` ``printPlanVersion`` (9.x+):
  tag ``0x74727466`` at offset 0, serialization word at offset 4, version bytes 24..27 when that
  word is 0.
- DLA placement: the builder's INFO lines ``---------- Layers Running on DLA ----------`` /
  ``[DlaLayer] {ForeignNode[first...last]}`` / ``[GpuLayer] TYPE: name`` (captures from
  NVIDIA-AI-IOT/jetson_dla_tutorial, TensorRT 8.4 on Orin) and the per-layer fallback warnings.
- Calibration cache text: ``TRT-<NV_TENSORRT_VERSION>-EntropyCalibration2`` then
  ``<tensor>: <8 hex digits of the float32 scale>`` (trtexec ``readScalesFromCalibrationCache``
  in sampleEngines.cpp reads 8 hex digits after ``": "``; NVIDIA Deep-Learning-Accelerator-SW
  ``tools/qdq-translator/utils.py`` writes the same form).

"""
from __future__ import annotations

import json
import re
import struct
from typing import Any, Mapping, Sequence

from deploykit.errors import StageError


Version = tuple  # (major, minor, patch[, build]) of ints


def decode_version_int(n: int) -> Version:
    """Decode ``NV_TENSORRT_VERSION`` / ``getInferLibVersion()`` / the ``[TensorRT vN]`` banner.

    8.x/9.x encode ``major*1000 + minor*100 + patch`` (``v8601`` = 8.6.1); 10.x and later
    ``major*10000 + minor*100 + patch`` (``v100300`` = 10.3.0, ``v101601`` = 10.16.1,
    ``v110000`` = 11.0.0), see ``NV_TENSORRT_VERSION_INT`` in NvInferRuntimeBase.h.
    """
    if n >= 100000:
        return (n // 10000, (n // 100) % 100, n % 100)
    return (n // 1000, (n // 100) % 10, n % 100)


def _vtuple(text: str | None) -> Version | None:
    nums = re.findall(r"\d+", text or "")
    return tuple(int(p) for p in nums[:4]) if nums else None


def _vs(v: Sequence[int] | None) -> str:
    return ".".join(str(p) for p in v) if v else "unknown"


# --------------------------------------------------------------------------------------------
# trtexec console output
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


# The name is printed as it is (sampleInference.cpp: ``<< " binding for " << name << " with
# dimensions "``), so it may hold spaces, ':' or ','.
_BINDING = re.compile(r"(?:Created )?(?P<io>[Ii]nput|[Oo]utput) binding for (?P<name>.+?) with "
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


# --------------------------------------------------------------------------------------------
# Plans: header bytes and runtime load errors
# --------------------------------------------------------------------------------------------
PLAN_FILE_TAG = 0x74727466  # first little-endian uint32 of a plan ("ftrt"), sampleEngines.cpp


PLAN_HEADER_BYTES = 28      # what printPlanVersion reads


def plan_header_info(head: bytes) -> dict:
    """Decode the first bytes of a file that should be a TensorRT plan.

    The layout is the one trtexec's ``--getPlanVersionOnly`` reads (NVIDIA/TensorRT
    ``samples/common/sampleEngines.cpp`` ``printPlanVersion``, 9.x+): uint32 tag
    ``0x74727466`` at offset 0, uint32 serialization word at offset 4, and, when that word is 0,
    the building TensorRT's version in bytes 24..27. No claim is made for other layouts.

    Args:
        head: the file's first bytes (``PLAN_HEADER_BYTES`` or more; fewer is reported).
    Returns:
        ``{"n_bytes": int, "is_plan": bool, "serialization": int | None,
        "version": (a, b, c, d) | None, "looks_like": str | None}``; ``looks_like`` names what a
        non-plan file resembles (``"empty file"``, ``"ONNX model (protobuf)"``, ``"JSON"``,
        ``"ZIP archive"``, ``"text"``, ``"unknown binary"``).
    """
    out: dict[str, Any] = {"n_bytes": len(head), "is_plan": False, "serialization": None,
                           "version": None, "looks_like": None}
    if not head:
        out["looks_like"] = "empty file"
        return out
    if len(head) >= 4 and struct.unpack_from("<I", head, 0)[0] == PLAN_FILE_TAG:
        out["is_plan"] = True
        if len(head) >= 8:
            out["serialization"] = struct.unpack_from("<I", head, 4)[0]
        if len(head) >= PLAN_HEADER_BYTES and out["serialization"] == 0:
            out["version"] = tuple(head[24:28])
        return out
    # ONNX files start with field 1 (ir_version, varint): byte 0x08 (protobuf wire format).
    if head[0] == 0x08:
        out["looks_like"] = "ONNX model (protobuf)"
    elif head.lstrip()[:1] in (b"{", b"["):
        out["looks_like"] = "JSON"
    elif head[:2] == b"PK":
        out["looks_like"] = "ZIP archive"
    elif all(32 <= b < 127 or b in (9, 10, 13) for b in head[:PLAN_HEADER_BYTES]):
        out["looks_like"] = "text"
    else:
        out["looks_like"] = "unknown binary"
    return out


_LIB_MISMATCH = re.compile(r"expecting library version\s+([^\s,]*?)\s+got\s+([^\s,]*?)[\s,]*"
                           r"(?:please rebuild|\)|$)", re.M)


_TAG_MISMATCH = re.compile(r"Current Version:\s*(\d+),\s*Serialized Engine Version:\s*(\d+)")


_DEV_MISMATCH = re.compile(r"expecting compute\s+([0-9.]+)\s+got compute\s+([0-9.]+)")


# 8.x "Magic tag does not match" (stdArchiveReader.cpp), 8.6 "plan->header.magicTag ==
# rt::kPLAN_MAGIC_TAG" (runtime.cpp::parsePlan), 7.x "verifyHeader: 0 (Magic tag does not match)".
_MAGIC = re.compile(r"Magic tag does not match|magicTag\s*==\s*rt::kPLAN_MAGIC_TAG|kMAGIC_TAG")


_SIZE = re.compile(r"Size specified in header does not match archive size|sizeRead\s*==")


def parse_version_mismatch(text: str) -> dict | None:
    """Plan/runtime mismatch reported by the TensorRT runtime logger (8.x, 9.x, 10.x texts).

    Forms (real captures in tests/data/trt/plan_*.txt):
    - ``... not compatible with this version of TensorRT, expecting library version 8.6.1.6 got
      8.6.1.4, please rebuild.`` (8.x, 9.x; 10.x ends ``... got .)`` with an empty "got").
      ``expected`` is the deserialising library, ``got`` the plan, as in the 8.6.1 capture
      (runtime 8.6.1.6, plan 8.6.1.4) and the 10.12 capture (runtime 10.12.0.36). In the 8.5.3
      capture the user's Python package was 8.5.3.1 while the library said it expected 8.5.1.7:
      the loaded libnvinfer was not the package's (see :func:`classify_plan_load_error`).
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


# Classes of plan-loading failure and their fixes (classify_plan_load_error). Sources: the
# runtime messages in tests/data/trt/plan_*.txt; NVIDIA/TensorRT#1596 and #2195 (maintainers:
# magic/version-tag errors come from two TensorRT installs, "check the LD_LIBRARY_PATH");
# lix19937/tensorrt-insight#65 (magic tag: an ONNX file was loaded as a plan); NVIDIA/TensorRT#1736
# (header size does not match the archive: a damaged file); trtexec --help
# ``--hardwareCompatibilityLevel=ampere+`` (8.6+) for plans that must run on several GPUs.
PLAN_LOAD_CLASSES = ("not_a_plan", "truncated", "other_version", "library_path", "other_gpu",
                     "unknown")


def same_version(a: Sequence[int] | None, b: Sequence[int] | None) -> bool:
    """Equal on every component both give (8.6.1.4 and 8.6.1.6 differ; 8.6.1 and 8.6.1.6 do
    not); False when either is unknown."""
    if not a or not b:
        return False
    n = min(len(a), len(b))
    return tuple(a[:n]) == tuple(b[:n])


def classify_plan_load_error(log: str, header: bytes | None = None, *,
                             runtime_version: Sequence[int] | None = None,
                             file_size: int | None = None, plan: str = "the plan") -> dict:
    """Why a TensorRT runtime refused a plan, and the fix for that cause.

    A pure function over the runtime logger's text and the plan file's first bytes; it never
    loads TensorRT.

    Args:
        log: everything the runtime logged while deserialising (empty if nothing).
        header: the file's first ``PLAN_HEADER_BYTES`` bytes (None: not read).
        runtime_version: version of the Python ``tensorrt`` package doing the load (e.g.
            ``(10, 3, 0, 26)``); needed to tell a library-path mismatch from a plan of another
            version.
        file_size: size of the file in bytes, if known.
        plan: how to name the file in messages.
    Returns:
        ``{"kind": one of PLAN_LOAD_CLASSES, "message": str, "fix": str,
        "plan_version": str | None, "runtime_version": str | None,
        "library_version": str | None, "header": plan_header_info(...) | None}``.
        Kinds: ``not_a_plan`` (empty file, or not a plan at all: e.g. the ONNX model),
        ``truncated`` (a plan cut short), ``other_version`` (built by another TensorRT; both
        versions named when known), ``library_path`` (the runtime's package and the libnvinfer
        it really loaded differ: fix the loader path, do not rebuild), ``other_gpu`` (built for
        another compute capability), ``unknown``.
    """
    hdr = plan_header_info(header) if header is not None else None
    mm = parse_version_mismatch(log or "")
    rt = tuple(runtime_version) if runtime_version else None
    plan_v: Version | None = hdr["version"] if hdr else None
    lib_v: Version | None = None
    if mm and mm["kind"] == "library":
        lib_v = _vtuple(mm["expected"])
        plan_v = plan_v or _vtuple(mm["got"])

    def out(kind: str, message: str, fix: str) -> dict:
        return {"kind": kind, "message": message, "fix": fix,
                "plan_version": _vs(plan_v) if plan_v else None,
                "runtime_version": _vs(rt) if rt else None,
                "library_version": _vs(lib_v) if lib_v else None, "header": hdr}

    rebuild = "rebuild it with 6_build_engines.sh on this machine"
    if file_size == 0 or (hdr is not None and hdr["n_bytes"] == 0):
        return out("not_a_plan", f"{plan} is empty",
                   f"{rebuild}; an empty file is what an interrupted write leaves")
    if hdr is not None and not hdr["is_plan"]:
        return out("not_a_plan", f"{plan} is not a TensorRT plan (it looks like: "
                   f"{hdr['looks_like']})",
                   "pass the .plan written by 6_build_engines.sh "
                   "(artifacts/<model>/engines/<variant>.plan), not the ONNX model or another file")
    if _SIZE.search(log or "") or (hdr is not None and hdr["n_bytes"] < PLAN_HEADER_BYTES):
        return out("truncated", f"{plan} is shorter than its header says (cut short: "
                   "interrupted copy or download, or a full disk)",
                   f"{rebuild} (it writes plans under a temporary name and renames them), or copy "
                   "the complete file again")
    if mm and mm["kind"] == "device":
        return out("other_gpu", f"{plan} was built for a GPU of compute capability {mm['got']}; "
                   f"this GPU is {mm['expected']}",
                   f"{rebuild}: a plan is built for one GPU architecture (trtexec "
                   "--hardwareCompatibilityLevel=ampere+, TensorRT 8.6+, trades speed for plans "
                   "that run on Ampere and newer)")
    def other_version() -> dict:
        built = f"TensorRT {_vs(plan_v)}" if plan_v else "another TensorRT version"
        running = f"TensorRT {_vs(lib_v or rt)}" if (lib_v or rt) else "this runtime's version"
        return out("other_version", f"{plan} was built by {built}; it is being loaded by "
                   f"{running}",
                   f"{rebuild} with the trtexec of {running} (TRTEXEC=/path/to/trtexec), or run "
                   f"stage 7 with the tensorrt package of {built}: plans do not load across "
                   "TensorRT versions")

    loader_fix = ("do not rebuild: `source env.sh` (puts the package's tensorrt_libs first on "
                  "LD_LIBRARY_PATH) or remove the other TensorRT from LD_LIBRARY_PATH; "
                  "`python trt_tools.py detect` shows which libnvinfer is loaded")
    if mm and mm["kind"] == "library":
        if rt and lib_v and not same_version(lib_v, rt):
            return out("library_path", f"the Python package is tensorrt {_vs(rt)} but the "
                       f"libnvinfer that tried to load {plan} is {_vs(lib_v)}: another TensorRT "
                       "library is found first on the loader path", loader_fix)
        return other_version()
    tag_error = bool(_MAGIC.search(log or "")) or (mm is not None and
                                                   mm["kind"] == "serialization")
    if tag_error or (plan_v and rt and not same_version(plan_v, rt)):
        if plan_v and rt and same_version(plan_v, rt):
            # The plan says it was built by the package's own version, yet the runtime refuses it:
            # the library that runs is not the package's (NVIDIA/TensorRT#1596, #2195).
            return out("library_path", f"{plan} was built by TensorRT {_vs(plan_v)}, the same "
                       f"version as the Python package ({_vs(rt)}), yet the runtime refused it: "
                       "the libnvinfer loaded is another TensorRT's", loader_fix)
        return other_version()
    tail = " | ".join(ln.strip() for ln in (log or "").strip().splitlines()[-3:])
    return out("unknown", f"the runtime refused {plan}" + (f": {tail}" if tail else
                                                           " without a message"),
               "read the runtime log above; if the plan is old or from another machine, " + rebuild)


# --------------------------------------------------------------------------------------------
# Layer information and profiles
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# ldd, error lines
# --------------------------------------------------------------------------------------------
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
# DLA placement (build log)
# --------------------------------------------------------------------------------------------
_DLA_HEAD = re.compile(r"-+ Layers Running on DLA -+")


_GPU_HEAD = re.compile(r"-+ Layers Running on GPU -+")


_DLA_LAYER = re.compile(r"\[DlaLayer\]\s*(?P<text>.*?)\s*$")


_GPU_LAYER = re.compile(r"\[GpuLayer\]\s*(?P<text>.*?)\s*$")


_FOREIGN = re.compile(r"\{ForeignNode\[(?P<body>.*)\]\}")


_GPU_TYPE = re.compile(r"^(?P<type>[A-Z][A-Z0-9_]*):\s+(?P<name>.*)$")


# Per-layer fallback warnings: 8.x "Layer 'X' (TYPE): Unsupported on DLA. Switching this layer's
# device type to GPU." (NVIDIA-AI-IOT/jetson_dla_tutorial#3) and older "Default DLA is enabled
# but layer X is not supported on DLA, falling back to GPU." (NVIDIA/TensorRT#2318).
_FALLBACK = (re.compile(r"Layer '(?P<name>.+?)' \((?P<type>[A-Z_0-9]+)\): Unsupported on DLA"),
             re.compile(r"Default DLA is enabled but layer (?P<name>.+?) is not "
                        r"(?:supported|running) on DLA, falling back to GPU"))


_NO_DLA = re.compile(r"no layer in the network can run on DLA")


def _foreign_range(text: str) -> tuple[str | None, str | None]:
    m = _FOREIGN.search(text)
    if not m:
        return None, None
    body = m.group("body")
    if "..." in body:
        first, last = body.split("...", 1)
        return first.strip(), last.strip()
    return body.strip(), body.strip()


def parse_dla_placement(text: str) -> dict | None:
    """Which layers a DLA build put on the DLA and which on the GPU, from a build log.

    TensorRT's builder logs (INFO level, trtexec's default) one block per build::

        [I] [TRT] ---------- Layers Running on DLA ----------
        [I] [TRT] [DlaLayer] {ForeignNode[Conv_0...Relu_7]}
        [I] [TRT] ---------- Layers Running on GPU ----------
        [I] [TRT] [GpuLayer] REDUCE: GlobalAveragePool_8

    A DLA entry is one DLA subgraph (loadable) named by its first and last layer; a GPU entry is
    one (fused) GPU layer, with the layer type in front from TensorRT 8.4 (``SHUFFLE: ...``).
    The last block in the log is used.

    Returns:
        None when the log says nothing about DLA, else ``{"block_found": bool,
        "dla": [{"text", "first", "last"}], "gpu": [{"text", "type", "first", "last"}],
        "fallback": [{"name", "type"}], "no_dla_layer": bool}``; ``fallback`` lists the layers the
        builder moved to the GPU with a warning, ``no_dla_layer`` is True when it said no layer can
        run on DLA.
    """
    lines = (text or "").splitlines()
    heads = [i for i, ln in enumerate(lines) if _DLA_HEAD.search(ln)]
    fallback = []
    for ln in lines:
        for rx in _FALLBACK:
            m = rx.search(ln)
            if m:
                fallback.append({"name": m.group("name"),
                                 "type": m.groupdict().get("type")})
                break
    no_dla = bool(_NO_DLA.search(text or ""))
    out: dict[str, Any] = {"block_found": bool(heads), "dla": [], "gpu": [],
                           "fallback": fallback, "no_dla_layer": no_dla}
    if not heads:
        return out if (fallback or no_dla) else None
    side = "dla"
    for ln in lines[heads[-1] + 1:]:
        if _GPU_HEAD.search(ln):
            side = "gpu"
            continue
        if _DLA_HEAD.search(ln):
            break
        m = _DLA_LAYER.search(ln) if side == "dla" else _GPU_LAYER.search(ln)
        if not m:
            if side == "gpu" and out["gpu"] and "[GpuLayer]" not in ln:
                break  # the block ended
            continue
        entry_text = m.group("text")
        if side == "dla":
            first, last = _foreign_range(entry_text)
            out["dla"].append({"text": entry_text, "first": first or entry_text,
                               "last": last or entry_text})
        else:
            t = _GPU_TYPE.match(entry_text)
            name = t.group("name") if t else entry_text
            first, last = _foreign_range(name)
            out["gpu"].append({"text": entry_text, "type": t.group("type") if t else None,
                               "first": first, "last": last})
    return out


# ONNX ops TensorRT folds into constants or shape arithmetic: not counted as placed layers.
SHAPE_ONLY_OPS = frozenset({"Constant", "Shape", "ConstantOfShape", "Identity", "Size"})


def dla_fraction(placement: Mapping, onnx_nodes: Sequence[tuple[str, str]] | None = None
                 ) -> dict:
    """Share of the model's layers that run on the DLA.

    DLA entries name only the first and last layer of each DLA subgraph, so the count is made on
    the ONNX graph: every node between a subgraph's first and last node (graph order) runs on the
    DLA unless a GPU entry names it; GPU entries are split on `` + `` (fused layers) and matched to
    ONNX node names. Nodes in ``SHAPE_ONLY_OPS`` are not counted.

    Args:
        placement: :func:`parse_dla_placement` output.
        onnx_nodes: ``[(node name, op type)]`` in graph order (the ONNX the engine was built from);
            None gives counts of log entries only and ``fraction`` None.
    Returns:
        ``{"fraction": float | None (0..1), "dla_nodes": [names], "gpu_nodes": [names],
        "n_dla_subgraphs": int, "n_gpu_layers": int, "unmatched": [entry texts not mapped to
        ONNX nodes], "unplaced": [counted ONNX nodes named by no entry (folded or fused away)]}``.
    """
    dla_e, gpu_e = list(placement.get("dla", [])), list(placement.get("gpu", []))
    res: dict[str, Any] = {"fraction": None, "dla_nodes": [], "gpu_nodes": [],
                           "n_dla_subgraphs": len(dla_e), "n_gpu_layers": len(gpu_e),
                           "unmatched": [], "unplaced": []}
    if onnx_nodes is None:
        return res
    order = [n for n, _ in onnx_nodes]
    index = {n: i for i, n in enumerate(order)}
    ops = dict(onnx_nodes)

    def nodes_of(entry: Mapping, text: str) -> list[str]:
        first, last = entry.get("first"), entry.get("last")
        if first in index and last in index and index[first] <= index[last]:
            return order[index[first]:index[last] + 1]
        m = _FOREIGN.search(text)
        body = m.group("body") if m else (_GPU_TYPE.match(text).group("name")
                                          if _GPU_TYPE.match(text) else text)
        return [t.strip() for t in body.replace("...", " + ").split(" + ") if t.strip() in index]

    gpu: set[str] = set()
    for e in gpu_e:
        names = nodes_of(e, e["text"])
        if not names:
            res["unmatched"].append(e["text"])
        gpu.update(names)
    dla: list[str] = []
    for e in dla_e:
        names = nodes_of(e, e["text"])
        if not names:
            res["unmatched"].append(e["text"])
        dla += [n for n in names if n not in gpu]
    count = [n for n in dict.fromkeys(dla) if ops.get(n) not in SHAPE_ONLY_OPS]
    gcount = [n for n in order if n in gpu and ops.get(n) not in SHAPE_ONLY_OPS]
    res["dla_nodes"], res["gpu_nodes"] = count, gcount
    placed = set(count) | set(gcount)
    res["unplaced"] = [n for n in order if n not in placed and ops.get(n) not in SHAPE_ONLY_OPS]
    total = len(count) + len(gcount)
    res["fraction"] = (len(count) / total) if total else (0.0 if placement.get("no_dla_layer")
                                                          else None)
    return res


# --------------------------------------------------------------------------------------------
# Calibration cache (implicit INT8)
# --------------------------------------------------------------------------------------------
_CALIB_HEAD = re.compile(r"^TRT-(?P<ver>\d+)-(?P<algo>[A-Za-z0-9]+)\s*$")


def parse_calibration_cache(text: str) -> dict:
    """Read a TensorRT calibration cache (text form).

    Format: a header ``TRT-<NV_TENSORRT_VERSION>-<algorithm>`` (e.g.
    ``TRT-8510-EntropyCalibration2``), then one ``<tensor name>: <hex>`` line per tensor where
    ``<hex>`` is the IEEE-754 float32 bit pattern of the scale (dynamic range / 127) as 8 hex
    digits; names may contain ``:`` (trtexec splits on the last one).

    Returns:
        ``{"version": (major, minor, patch) | None, "algorithm": str | None,
        "scales": {tensor: float}}``.
    Raises:
        StageError: a line that is neither header nor ``name: hex``.
    """
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    out: dict[str, Any] = {"version": None, "algorithm": None, "scales": {}}
    if lines and _CALIB_HEAD.match(lines[0]):
        m = _CALIB_HEAD.match(lines[0])
        out["version"] = decode_version_int(int(m.group("ver")))
        out["algorithm"] = m.group("algo")
        lines = lines[1:]
    for ln in lines:
        name, sep, hexv = ln.rpartition(": ")
        if not sep or not re.fullmatch(r"[0-9a-fA-F]{1,8}", hexv.strip()):
            raise StageError(f"not a calibration-cache line: {ln!r}")
        out["scales"][name] = struct.unpack(">f", bytes.fromhex(hexv.strip().zfill(8)))[0]
    return out
