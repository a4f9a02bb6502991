"""ONNX files prepared for a TensorRT build: a Q/DQ model converted back to opset 17 for the
TensorRT 8.x parser (exactly, or not at all), its parity check on ONNX Runtime, and the
calibration cache of the implicit INT8 path (DLA, or 8.x when the Q/DQ file cannot be converted).

Why (sources; when they disagree it is said):
- TensorRT 8.5/8.6's ONNX parser "supports operators up to Opset 17" (onnx-tensorrt
  ``docs/operators.md`` at release/8.5-GA and release/8.6-GA). It does not refuse a newer opset:
  ``ModelImporter.cpp`` only rejects opsets below 7, and each op is imported with the opset-13..17
  semantics. Two consequences for a ModelOpt 0.47.0 file (opset 19, IR 10, whatever the input
  opset: ``modelopt/onnx/utils.py`` ``BASE_MIN_OPSET = 19``, ``quantize.py`` upgrades a lower
  ``--opset`` to it):
  * ``ReduceMean``-18 takes its axes as an input; the 8.6 importer
    (``builtin_op_importers.cpp`` ``DEFINE_BUILTIN_OP_IMPORTER(ReduceMean)``) calls
    ``reduceTensor`` without that input and so reduces over all axes;
  * ``QuantizeLinear``/``DequantizeLinear``-19 allow float16 scales; the 8.6 importer
    (``QuantDequantLinearHelper``) reads the scale weights as ``float const*``.
  A file at opset 17 whose Q/DQ scales are float32 avoids both. ``onnx.version_converter``
  (onnx 1.21) converts ModelOpt's opset-19 files down to 17 (it moves ``ReduceMean`` axes back
  to the attribute); ``onnx.checker`` at opset 17 then rejects any Q/DQ left with float16 types
  (opset-13 ``QuantizeLinear`` takes float32 only). :func:`to_opset` widens float16 scales
  to float32 first (exact: every float16 is a float32; a Cast back to float16 follows each
  DequantizeLinear, and an int8 times a float16 scale has at most 19 significant bits, so the
  float32 product is exact and one rounding to float16 gives the float16 result).
- DLA does not take explicitly quantized (Q/DQ) networks: NVIDIA/TensorRT#2222 (NVIDIA, 2022:
  "DLA doesn't support QAT yet ... if you convert it to implicit quantization, it would work with
  DLA"); NVIDIA/Model-Optimizer PR #1661 (2026: "DLA still only supports IQ"; workflow: ModelOpt
  Q/DQ model, then NVIDIA's Q/DQ Translator for ``calib.cache`` used with the non-quantized
  model). The onnx-tensorrt 10.11 GA notes add a DLA parser flag for asymmetric Q/DQ
  (``kENABLE_UINT8_AND_ASYMMETRIC_QUANTIZATION_DLA``), while the TensorRT 11.4.1 docs say 10.7 was
  the last 10.x release with DLA: the sources disagree about Q/DQ on DLA in late 10.x; this
  toolkit follows the implicit path for every DLA INT8 build.

What the implicit path can and cannot do without TensorRT:
- Can: write the cache text TensorRT reads (header
  ``TRT-<NV_TENSORRT_VERSION>-EntropyCalibration2``, then ``<tensor>: <float32 scale as 8 hex
  digits>``, the form of trtexec's ``readScalesFromCalibrationCache`` and NVIDIA's qdq-translator
  ``export_to_trt_calib``) with the activation scales ModelOpt computed on the calibration split
  of stage 4, keyed by the tensor names of the FP32 ONNX that trtexec then builds (TensorRT's
  parser keeps ONNX tensor names).
- Cannot: run TensorRT's own IInt8EntropyCalibrator2 (it needs the GPU builder); know scales for
  tensors TensorRT creates itself; check that this TensorRT accepts the header or that each name
  matches a network tensor (a build shows "Missing scale" warnings and falls back to FP16 for
  those layers); reproduce ModelOpt's placement exactly (implicit quantization lets TensorRT choose
  INT8 per layer; weights are re-quantized by TensorRT, per channel, max).

"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Mapping, Sequence
import numpy as np

from deploykit.errors import StageError
from deploykit.io import atomic_path
from deploykit.onnx.graph import (
    QDQ_OPS,
    constants,
    consumers,
    graph_inputs,
    mark_all_outputs,
    onnx_opset,
    producers,
)
from deploykit.runners import ort_session_options
from deploykit.checks.lint import lint_opset_conversion


TARGET_OPSET = 17


# IR version of ONNX 1.12/1.13, the releases that introduced / kept opset 17 (onnx
# docs/Versioning.md); TensorRT 8.6's parser is built against ONNX 1.13.1 (onnx-tensorrt
# release/8.6-GA README).
TARGET_IR = 8


def _types_beyond_ir8():
    from onnx import TensorProto

    names = ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "UINT4", "INT4",
             "FLOAT4E2M1", "FLOAT8E8M0")
    return {getattr(TensorProto, n) for n in names if hasattr(TensorProto, n)}


def _widen_fp16_qdq_scales(m) -> list[str]:
    """Rewrite Q/DQ nodes with float16 scales to float32 scales in place (exact; see module
    docstring). Returns notes; raises StageError where the rewrite is not possible."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {i.name: i for i in m.graph.initializer}
    cons = consumers(m)
    half = {n for n, i in inits.items() if i.data_type == TensorProto.FLOAT16}  # before rewriting
    done: set[str] = set()
    new_nodes = []
    n_q = n_dq = 0
    for node in m.graph.node:
        if node.op_type not in QDQ_OPS or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        scale = inits.get(node.input[1])
        if scale is None:
            raise StageError(f"{node.op_type} {node.name!r}: its scale {node.input[1]!r} is not "
                             "an initializer")
        if scale.data_type == TensorProto.FLOAT and node.input[1] not in half:
            new_nodes.append(node)
            continue
        if node.input[1] not in half:
            raise StageError(f"{node.op_type} {node.name!r}: scale type "
                             f"{TensorProto.DataType.Name(scale.data_type)} has no opset-17 form")
        if node.input[1] not in done:
            users = cons[node.input[1]]
            if any(u.op_type not in QDQ_OPS for u in users):
                raise StageError(f"float16 scale {node.input[1]!r} is also read by a non-Q/DQ node")
            arr = numpy_helper.to_array(scale).astype(np.float32)
            scale.CopyFrom(numpy_helper.from_array(arr, scale.name))
            done.add(node.input[1])
        if node.op_type == "QuantizeLinear":
            x32 = f"{node.input[0]}__f32_for_{node.name or node.output[0]}"
            new_nodes.append(helper.make_node("Cast", [node.input[0]], [x32],
                                              name=f"{node.name}__to_f32", to=TensorProto.FLOAT))
            node.input[0] = x32
            new_nodes.append(node)
            n_q += 1
        else:
            out = node.output[0]
            node.output[0] = f"{out}__f32"
            new_nodes.append(node)
            new_nodes.append(helper.make_node("Cast", [node.output[0]], [out],
                                              name=f"{node.name}__to_f16",
                                              to=TensorProto.FLOAT16))
            n_dq += 1
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    return [f"{len(done)} float16 Q/DQ scale(s) widened to float32 ({n_q} QuantizeLinear get a "
            f"Cast to float32 before, {n_dq} DequantizeLinear a Cast to float16 after)"] if done \
        else []


# Reduce ops whose ``axes`` moved from an attribute to an input in opset 18 (ReduceSum moved in 13).
_REDUCE_18 = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
              "ReduceMin", "ReduceProd", "ReduceSumSquare")


def _reduce_axes(m) -> dict[str, list[int]]:
    """``{output name: axes}`` of opset-18 Reduce nodes whose axes input is a constant.

    Needed because onnx.version_converter (onnx 1.21) writes an empty ``axes`` attribute when
    the axes come from an initializer (it reads Constant nodes only): a silent reduce-all. The
    axes are recorded here and restored by :func:`_restore_reduce_axes`.

    Raises:
        StageError: a Reduce node whose axes are computed at run time (no opset-17 form).
    """
    consts = constants(m)
    out = {}
    for n in m.graph.node:
        if n.op_type in _REDUCE_18 and n.domain in ("", "ai.onnx") and len(n.input) > 1 \
                and n.input[1]:
            if n.input[1] not in consts:
                raise StageError(f"{n.op_type} {n.name!r}: its axes are computed at run time; "
                                 "opset 17 needs them as an attribute")
            out[n.output[0]] = [int(a) for a in np.asarray(consts[n.input[1]]).reshape(-1)]
    return out


def _restore_reduce_axes(m, axes: Mapping[str, list[int]]) -> list[str]:
    from onnx import helper

    fixed = 0
    for n in m.graph.node:
        if n.op_type in _REDUCE_18 and n.output[0] in axes:
            keep = [a for a in n.attribute if a.name != "axes"]
            del n.attribute[:]
            n.attribute.extend(keep + [helper.make_attribute("axes", axes[n.output[0]])])
            del n.input[1:]
            fixed += 1
    return [f"{fixed} Reduce node(s): axes input -> attribute"] if fixed else []


def _drop_default_new_attributes(m, source: int, target: int) -> list[str]:
    """Remove attributes the ``target`` schema does not know when they hold their default value
    in the ``source`` schema (in place). ONNX adds attributes with defaults that keep the earlier
    behaviour, so such a node computes the same without them; ``onnx.version_converter`` leaves
    some in place (e.g. ``noop_with_empty_axes=0`` that the dynamo exporter writes on
    ``ReduceMean``-18, unknown to ``ReduceMean``-13).

    Raises:
        StageError: a new attribute with a non-default value (no ``target`` form).
    """
    from onnx import defs, helper

    dropped: dict[str, int] = {}
    for node in m.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            old = defs.get_schema(node.op_type, target, "")
            new = defs.get_schema(node.op_type, source, "")
        except Exception:  # noqa: BLE001 - SchemaError: op unknown at that opset
            continue  # the checker reports it
        keep = []
        for a in node.attribute:
            if a.name in old.attributes:
                keep.append(a)
                continue
            spec = new.attributes.get(a.name)
            default = spec.default_value if spec is not None else None
            if default is None or not default.name:
                raise StageError(f"{node.op_type} {node.name!r}: attribute {a.name} has no "
                                 f"opset-{target} form")
            if helper.get_attribute_value(a) != helper.get_attribute_value(default):
                raise StageError(f"{node.op_type} {node.name!r}: {a.name}="
                                 f"{helper.get_attribute_value(a)!r} (not the default) has no "
                                 f"opset-{target} form")
            dropped[f"{node.op_type}.{a.name}"] = dropped.get(f"{node.op_type}.{a.name}", 0) + 1
        if len(keep) != len(node.attribute):
            del node.attribute[:]
            node.attribute.extend(keep)
    return [f"attributes at their default value removed (unknown at opset {target}): "
            + ", ".join(f"{k} x{v}" for k, v in dropped.items())] if dropped else []


def to_opset(model, target: int = TARGET_OPSET):
    """A copy of ``model`` at ONNX opset ``target`` with the same results, or the reason there
    is none.

    Steps: refuse nodes outside the default ONNX domain and tensor types that do not exist at IR
    version 8 (FP8, INT4, FP4); widen float16 Q/DQ scales to float32 (exact, see the module
    docstring); ``onnx.version_converter.convert_version`` to ``target``; IR version 8; drop
    attributes unknown at ``target`` that hold their default value; ``onnx.checker.check_model(
    full_check=True)`` against the ``target`` schemas (types,
    attributes, shapes). :func:`ort_parity` then checks the results on real inputs.

    Args:
        model: ``onnx.ModelProto`` (not modified).
        target: opset to reach (TensorRT 8.x: 17).
    Returns:
        ``(converted ModelProto or None, notes: list[str], reason: str | None)``; ``reason`` says
        why no exact ``target`` file exists (then ``converted`` is None). A model already at or
        below ``target`` comes back unchanged with a note.
    """
    import onnx
    from onnx import version_converter

    cur = onnx_opset(model)
    if cur <= target:
        return model, [f"already opset {cur}"], None
    other = sorted({n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if other:
        return None, [], f"nodes of domain(s) {', '.join(other)} have no opset-{target} form"
    bad = _types_beyond_ir8()
    typed = [(i.name, i.data_type) for i in model.graph.initializer]
    typed += [(v.name, v.type.tensor_type.elem_type) for v in
              list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)]
    late = sorted({n for n, t in typed if t in bad})
    if late:
        return None, [], (f"tensors of types newer than IR {TARGET_IR} (FP8/INT4/FP4): "
                          f"{', '.join(late[:5])}")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    notes: list[str] = []
    try:
        notes += _widen_fp16_qdq_scales(m)
        axes = _reduce_axes(m) if cur >= 18 > target else {}
    except StageError as e:
        return None, notes, str(e)
    try:
        conv = version_converter.convert_version(m, target)
    except Exception as e:  # noqa: BLE001 - the converter raises RuntimeError/ValueError/...
        return None, notes, (f"onnx.version_converter cannot convert opset {cur} -> {target}: "
                             f"{str(e).splitlines()[0][:300]}")
    conv.ir_version = min(conv.ir_version, TARGET_IR)
    notes += _restore_reduce_axes(conv, axes)
    try:
        notes += _drop_default_new_attributes(conv, cur, target)
    except StageError as e:
        return None, notes, str(e)
    try:
        onnx.checker.check_model(conv, full_check=True)
    except Exception as e:  # noqa: BLE001 - ValidationError / InferenceError
        return None, notes, (f"the opset-{target} file fails onnx.checker: "
                             f"{str(e).splitlines()[0][:300]}")
    notes.append(f"onnx.version_converter opset {cur} -> {target}, IR {conv.ir_version}; "
                 "onnx.checker passes")

    notes += [f"WARNING: {r['node']}: {r['detail']}" for r in
              lint_opset_conversion(model, target) if r["status"] == "warn"]
    return conv, notes, None


def parity_feed(model, shapes: Mapping[str, Sequence[int]], seed: int = 0
                ) -> dict[str, np.ndarray]:
    """Seeded inputs for :func:`ort_parity`: N(0, 1) floats, integers in [0, 8), one array per
    graph input with the shape given in ``shapes`` (``{name: dims}``, e.g. a profile's opt
    shapes).

    Raises:
        StageError: an input without a shape in ``shapes``.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, _dims, dtype in graph_inputs(model):
        if name not in shapes:
            raise StageError(f"no shape for input {name!r} of the parity check")
        shape = tuple(int(d) for d in shapes[name])
        if np.issubdtype(dtype, np.integer):
            out[name] = rng.integers(0, 8, size=shape).astype(dtype)
        elif dtype == np.bool_:
            out[name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def ort_parity(a, b, feed: Mapping[str, np.ndarray]) -> dict:
    """Run two ONNX models on ONNX Runtime's CPU EP on the same inputs and compare exactly.

    Both run with graph optimisations disabled and every tensor marked as an output
    (:func:`deploykit.onnx.graph.mark_all_outputs`), so each node is computed as written: ORT otherwise
    fuses Q/DQ pairs and removes Cast pairs it inserted around float16 nodes, which changes
    float16 rounding differently in the two files and would hide or invent differences.

    Args:
        a, b: ``onnx.ModelProto`` or paths (``a`` is the reference: its graph outputs are compared).
        feed: ``{input name: array}``.
    Returns:
        ``{"exact": bool (every graph output of a equal in b, NaN equal to NaN),
        "max_abs_diff": float (over those outputs), "outputs": [names],
        "n_tensors_compared": int, "max_abs_diff_any_tensor": float (also over the intermediate
        tensors both files share by name), "inputs": {name: shape},
        "ep": "CPUExecutionProvider", "graph_optimizations": "disabled"}``.
    Raises:
        StageError: a model ONNX Runtime cannot load or run.
    """
    import onnx
    import onnxruntime as ort


    results = []
    graph_outputs = None
    for m in (a, b):
        label = str(m) if isinstance(m, (str, Path)) else "model"
        model = onnx.load(str(m)) if isinstance(m, (str, Path)) else m
        if graph_outputs is None:
            graph_outputs = [o.name for o in model.graph.output]
        marked = mark_all_outputs(model)
        try:
            s = ort.InferenceSession(marked.SerializeToString(),
                                     sess_options=ort_session_options("disable"),
                                     providers=["CPUExecutionProvider"])
            names = [o.name for o in s.get_outputs()]
            results.append(dict(zip(names, s.run(None, dict(feed)))))
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise StageError(f"onnxruntime cannot run {label}: {str(e).splitlines()[0]}") from e

    def diff(x, y) -> tuple[bool, float]:
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, float("inf")
        if not x.size:
            return True, 0.0
        if np.issubdtype(x.dtype, np.floating):
            d = np.abs(x.astype(np.float64) - y.astype(np.float64))
            return bool(np.array_equal(x, y, equal_nan=True)), float(np.nanmax(d)) \
                if not np.all(np.isnan(d)) else 0.0
        return bool(np.array_equal(x, y)), float(np.max(np.abs(x.astype(np.int64)
                                                               - y.astype(np.int64))))

    ra, rb = results
    exact, worst = True, 0.0
    for n in graph_outputs:
        same, d = diff(ra[n], rb[n]) if n in rb else (False, float("inf"))
        exact, worst = exact and same, max(worst, d)
    common_names = [n for n in ra if n in rb]
    worst_any = max((diff(ra[n], rb[n])[1] for n in common_names), default=0.0)
    return {"exact": bool(exact), "max_abs_diff": worst, "outputs": graph_outputs,
            "n_tensors_compared": len(common_names), "max_abs_diff_any_tensor": worst_any,
            "inputs": {k: list(v.shape) for k, v in feed.items()},
            "ep": "CPUExecutionProvider", "graph_optimizations": "disabled"}


# --------------------------------------------------------------------------------------------
# Calibration cache (implicit INT8)
# --------------------------------------------------------------------------------------------
CALIB_ALGORITHM = "EntropyCalibration2"  # trtexec's calibrator is an IInt8EntropyCalibrator2


# (sampleEngines.cpp RndInt8Calibrator); DLA takes only IInt8EntropyCalibrator2 (NVIDIA/TensorRT
# #2222, NVIDIA reply).
_PASS_THROUGH = ("Cast", "Identity")


def calibration_scales(qdq_model, source_model) -> tuple[dict[str, float], list[str]]:
    """Per-tensor activation scales of a Q/DQ model, keyed by tensor names of its source model.

    For every QuantizeLinear on an activation (input not a constant): its scale, if per-tensor,
    becomes the scale of the source-model tensor it quantizes, found by following Cast/Identity
    nodes back (ModelOpt's float16 variants quantize a Cast of the FP32 tensor). Weight quantizers
    are skipped: in implicit mode TensorRT quantizes weights itself.

    Args:
        qdq_model: the ModelOpt output (``onnx.ModelProto``).
        source_model: the FP32 model it was made from (what trtexec builds on the implicit path).
    Returns:
        ``(scales {tensor: float32 scale > 0}, skipped [why, one per quantizer not used])``.
    """
    consts = constants(qdq_model)
    prod = producers(qdq_model)
    src = {i.name for i in source_model.graph.input} | {
        o for n in source_model.graph.node for o in n.output}
    scales: dict[str, float] = {}
    skipped: list[str] = []
    for node in qdq_model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in consts:
            continue
        s = consts.get(node.input[1])
        if s is None or np.asarray(s).size != 1:
            skipped.append(f"{node.name or node.input[0]}: scale is not a per-tensor constant")
            continue
        t = node.input[0]
        while t not in src and t in prod and prod[t].op_type in _PASS_THROUGH:
            t = prod[t].input[0]
        if t not in src:
            skipped.append(f"{node.input[0]}: no tensor of that name in the source model")
            continue
        val = float(np.asarray(s, dtype=np.float32).reshape(()))
        if not val > 0:
            skipped.append(f"{t}: scale {val} is not positive")
            continue
        scales.setdefault(t, val)
    return scales, skipped


def calibration_cache_text(scales: Mapping[str, float], nv_version: int,
                           algorithm: str = CALIB_ALGORITHM) -> str:
    """Text of a TensorRT calibration cache.

    Args:
        scales: ``{tensor name: scale}`` (scale = dynamic range / 127, float32).
        nv_version: ``NV_TENSORRT_VERSION`` of the TensorRT that reads it (8601 for 8.6.1,
            100300 for 10.3.0; ``deploykit.trt.rules.encode_version_int``).
        algorithm: the calibrator's algorithm name in the header.
    Returns:
        ``TRT-<nv_version>-<algorithm>\\n`` + ``<name>: <8 hex digits>\\n`` per tensor (the float32
        bit pattern, big-endian hex, zero-padded: trtexec reads exactly 8 digits).
    Raises:
        StageError: a name with a line break, or a scale that is not finite and positive.
    """
    lines = [f"TRT-{int(nv_version)}-{algorithm}"]
    for name, s in scales.items():
        if "\n" in name or "\r" in name:
            raise StageError(f"tensor name {name!r} cannot be written to a calibration cache")
        f = np.float32(s)
        if not (np.isfinite(f) and f > 0):
            raise StageError(f"scale of {name!r} is {s}: not finite and positive")
        bits = struct.unpack(">I", struct.pack(">f", float(f)))[0]
        lines.append(f"{name}: {bits:08x}")
    return "\n".join(lines) + "\n"


def write_calibration_cache(path: Path | str, scales: Mapping[str, float], nv_version: int
                            ) -> Path:
    """Write :func:`calibration_cache_text` to ``path`` atomically and return the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(calibration_cache_text(scales, nv_version))
    return path
