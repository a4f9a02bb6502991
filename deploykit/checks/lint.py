"""Checks of any ONNX file: Softmax axis semantics, HardSigmoid attributes, Squeeze without
axes, batch frozen into shape constants, blocked-Q/DQ opset, FP16 initializers (graph only),
operators whose meaning changes on an opset conversion (:func:`lint_opset_conversion`), and
whether it loads at all: ``onnx.checker`` (full check) and an ONNX Runtime session on the CPU EP.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable
import numpy as np

from deploykit.checks.base import (
    check_result,
    const_leading,
    depends_on_inputs,
    node_label,
    value_shapes,
    with_source,
)
from deploykit.numerics import FP16_MAX
from deploykit.onnx.graph import (
    QDQ_OPS,
    attr,
    constants,
    consumers,
    detect_precision,
    load_onnx,
    onnx_opset,
    producers,
    static_batch,
)


HARDSIGMOID_TORCH = {"alpha": 1.0 / 6.0, "beta": 0.5}  # torch.nn.Hardsigmoid: relu6(x + 3) / 6


#: Ops whose output shape depends on input values (TensorRT needs an IOutputAllocator for such
#: outputs, TensorRT >= 8.5; ONNX Runtime handles them). If/Loop: control flow.
DATA_DEPENDENT_OPS = {"NonZero", "Unique", "Compress", "NonMaxSuppression", "If", "Loop"}


SOFTMAX_OPS = {"Softmax", "LogSoftmax", "Hardmax"}


DEFAULT_EXAMPLE_BATCH = 3  # export example batch: >= 2, and unlike a channel or group count


# --------------------------------------------------------------------------------------------
# Lint: graph-only checks, any ONNX file
# --------------------------------------------------------------------------------------------
def lint_softmax_axis(model) -> list[dict]:
    """Softmax/LogSoftmax/Hardmax below opset 13 on a rank > 2 input with an axis that is not
    the last: those opsets coerce the input to 2-D at ``axis`` and normalise over all the
    trailing axes together (ONNX Operators.md, Softmax-1/11 vs Softmax-13), not over ``axis``
    alone as PyTorch's ``softmax(dim)`` and opset 13 do."""
    ops = onnx_opset(model)
    nodes = [n for n in model.graph.node if n.op_type in SOFTMAX_OPS]
    if not nodes:
        return [check_result("softmax_axis", "skip", "no Softmax/LogSoftmax/Hardmax nodes")]
    if ops >= 13:
        return [check_result("softmax_axis", "pass", f"opset {ops} >= 13: per-axis semantics")]
    shapes = value_shapes(model)
    out = []
    for n in nodes:
        axis = int(attr(n, "axis", 1))
        rank = len(shapes[n.input[0]]) if n.input[0] in shapes else None
        if rank is not None and (rank <= 2 or axis in (-1, rank - 1)):
            continue
        what = f"rank-{rank}" if rank else "unknown-rank"
        out.append(check_result(
            "softmax_axis", "warn",
            f"{n.op_type} axis={axis} on a {what} input at opset {ops}: opsets < 13 flatten the "
            f"input to 2-D at axis {axis} and normalise over all axes from {axis} on together, "
            f"not over axis {axis} alone", node=with_source(n),
            fix=f"export at opset >= 13 (--opset 13 or higher), or move the axis last "
                f"(transpose, {n.op_type}(axis=-1), transpose back)"))
    return out or [check_result("softmax_axis", "pass", "every Softmax runs over the last axis")]


def lint_hardsigmoid(model, against_torch: bool = False) -> list[dict]:
    """HardSigmoid ``alpha``/``beta`` against PyTorch's ``Hardsigmoid``/``Hardswish``
    (alpha = 1/6, beta = 0.5); ONNX's default alpha is 0.2 (Keras' hard_sigmoid), so a
    hand-written or converted graph may silently use it. ``HardSwish`` has fixed attributes.

    Args:
        against_torch: the file was exported from PyTorch (``check``/stage 2): a mismatch is a
            failure; in plain lint it is a warning (0.2 is right for a Keras model).
    """
    bad, n_hs = [], 0
    for n in model.graph.node:
        if n.op_type == "HardSwish":
            n_hs += 1
        if n.op_type != "HardSigmoid":
            continue
        n_hs += 1
        alpha = float(attr(n, "alpha", 0.2))
        beta = float(attr(n, "beta", 0.5))
        if (abs(alpha - HARDSIGMOID_TORCH["alpha"]) > 1e-6
                or abs(beta - HARDSIGMOID_TORCH["beta"]) > 1e-6):
            bad.append(check_result(
                "hardsigmoid", "fail" if against_torch else "warn",
                f"alpha={alpha:.6g} beta={beta:.6g} (PyTorch: alpha=1/6={1/6:.6g}, beta=0.5; "
                "ONNX's default alpha is 0.2)", node=with_source(n),
                fix="set alpha=1/6 (0.1666667) and beta=0.5 on this node, or re-export from "
                    "PyTorch (its exporter writes both)"))
    if bad:
        return bad
    if not n_hs:
        return [check_result("hardsigmoid", "skip", "no HardSigmoid/HardSwish nodes")]
    return [check_result("hardsigmoid", "pass", f"{n_hs} HardSigmoid/HardSwish nodes match PyTorch")]


def lint_squeeze_axes(model) -> list[dict]:
    """Squeeze that depends on a dynamic axis being 1. Without axes it removes every axis of
    size 1 at run time, so at batch 1 the batch axis goes too and the output rank depends on the
    batch (a PyTorch ``.squeeze()`` head). With axes that name a dynamic axis (PyTorch's
    ``x.squeeze(0)``, a no-op for a batch > 1, exported with a symbolic batch) it fails for any
    size but 1: "If an axis is selected with shape entry not equal to one, an error is raised"
    (ONNX Operators.md, Squeeze-13). The fix names the axes that are 1 in the graph."""
    shapes = value_shapes(model)
    ops = onnx_opset(model)
    consts = constants(model)
    input_syms = {d.dim_param for i in model.graph.input
                  for d in i.type.tensor_type.shape.dim if d.dim_param}
    out, n_sq = [], 0
    for n in model.graph.node:
        if n.op_type != "Squeeze":
            continue
        n_sq += 1
        if ops >= 13:
            axes = consts.get(n.input[1]) if len(n.input) > 1 and n.input[1] else None
            has_axes = bool(len(n.input) > 1 and n.input[1])
        else:
            axes = attr(n, "axes")
            has_axes = axes is not None
        dims = shapes.get(n.input[0])
        dyn = [i for i, d in enumerate(dims or []) if not isinstance(d, int) or d == 0]
        ones = [i for i, d in enumerate(dims or []) if isinstance(d, int) and d == 1]
        keep = ("x.squeeze(" + (str(ones[0]) if len(ones) == 1 else str(tuple(ones))) + ")"
                if ones else "x.flatten(1)")
        if has_axes:
            if axes is None or dims is None:
                continue  # axes computed at run time, or unknown rank: nothing to judge
            named = sorted({int(a) % len(dims) for a in np.asarray(axes).reshape(-1)})
            # only axes carrying a graph input's symbol (a declared dynamic axis such as
            # 'batch'): one whose size shape inference could not tell ('unk__0') may well be 1
            bad = [a for a in named if isinstance(dims[a], str) and dims[a] in input_syms]
            if not bad:
                continue
            out.append(check_result(
                "squeeze_axes", "fail",
                f"Squeeze axes {named} on {dims} include the dynamic axis {bad[0]} "
                f"({dims[bad[0]] or '?'}): ONNX Squeeze fails unless that axis is 1 at run time "
                "(batch 1 only), while PyTorch's squeeze(dim) is a no-op for other sizes",
                node=with_source(n),
                fix=(f"drop the squeeze({bad[0]}) in the model (for batch 1 index it explicitly, "
                     f"x[0]), or squeeze only the axes that are 1: {keep}" if ones else
                     f"drop the squeeze({bad[0]}) in the model (for batch 1 index it explicitly, "
                     "x[0])")))
            continue
        if dims is not None and not dyn:
            continue  # all sizes fixed: the squeezed axes are known
        where = (f"dynamic axes {dyn} of {dims}" if dims is not None else "an input of unknown "
                 "shape")
        out.append(check_result(
            "squeeze_axes", "fail" if dims is not None else "warn",
            f"Squeeze without axes on {where}: it also removes a dynamic axis whenever that "
            "axis is 1 at run time (batch 1), so the output rank depends on the batch",
            node=with_source(n),
            fix=(f"squeeze only the axes you mean: {keep}"
                 + (" or x.flatten(1)" if dims and ones == list(range(2, len(dims))) else "")
                 + f" in PyTorch (axes {ones} are 1 here; an 'axes' input in the ONNX)" if ones else
                 "squeeze only the axes you mean (x.squeeze(dims) or x.flatten(1) in PyTorch; "
                 "an 'axes' input in the ONNX)")))
    if not n_sq:
        return [check_result("squeeze_axes", "skip", "no Squeeze nodes")]
    return out or [check_result("squeeze_axes", "pass", f"{n_sq} Squeeze nodes name their axes")]


def lint_shape_constants(model, example_batch: int | None = None) -> list[dict]:
    """Reshape/Expand/Tile whose constant shape holds a batch size: a leading fixed size on a
    tensor whose axis 0 is the dynamic batch (Reshape), or the export's example batch
    (``example_batch``, when known) anywhere at the front of a shape computed from the inputs.

    Args:
        example_batch: the batch the file was exported with (stage 2 knows it); None for a
            file of unknown origin (only the Reshape rule applies, Expand/Tile warn).
    """
    consts = constants(model)
    prod = producers(model)
    shapes = value_shapes(model)
    live = depends_on_inputs(model)
    static = static_batch(model)
    out, n_seen = [], 0
    for n in model.graph.node:
        if n.op_type not in ("Reshape", "Expand", "Tile") or len(n.input) < 2:
            continue
        if n.input[0] not in live:
            continue  # reshaping a constant (weights), not a batch of data
        arr, text = const_leading(model, n.input[1], consts, prod)
        if arr is None or arr.size == 0:
            continue
        n_seen += 1
        lead = int(arr.reshape(-1)[0])
        dims = shapes.get(n.input[0]) or []
        axis0 = dims[0] if dims else None
        batch_dynamic = axis0 is None or isinstance(axis0, str)
        what = "target shape" if n.op_type == "Reshape" else (
            "shape" if n.op_type == "Expand" else "repeats")
        fix = ("compute the size from the tensor instead of a Python int: x.reshape(-1, ...) / "
               "x.flatten(1) / x.expand(x.shape[0], ...) (no int(x.shape[0]), no size read into "
               "Python arithmetic), then re-export")
        if example_batch and example_batch > 1 and lead == example_batch and static is None:
            out.append(check_result(
                "shape_constants", "fail",
                f"{n.op_type} {what} {text} starts with {lead}, the export's "
                "example batch: the batch was frozen into the graph", node=with_source(n),
                fix=fix))
        elif (n.op_type == "Reshape" and lead > 1 and batch_dynamic and static is None
              and isinstance(axis0, str)):
            out.append(check_result(
                "shape_constants", "fail",
                f"Reshape target {text} fixes axis 0 to {lead} although its "
                f"input's axis 0 is the dynamic '{axis0}': any other batch fails or mixes "
                "samples", node=with_source(n), fix=fix))
        elif n.op_type in ("Expand", "Tile") and lead > 1 and static is None and axis0 == 1:
            out.append(check_result(
                "shape_constants", "warn",
                f"{n.op_type} {what} {text} turns axis 0 of size 1 into the "
                f"fixed {lead}: if {lead} is the export batch, the batch was frozen",
                node=with_source(n), fix=fix))
    if not n_seen:
        return [check_result("shape_constants", "skip", "no Reshape/Expand/Tile with a constant shape "
                             "on data")]
    return out or [check_result("shape_constants", "pass",
                                f"{n_seen} constant shapes hold no batch size")]


def lint_blocked_qdq_opset(model) -> list[dict]:
    """QuantizeLinear/DequantizeLinear with ``block_size`` (blocked quantization) need opset 21
    (the attribute was added in QuantizeLinear-21/DequantizeLinear-21, ONNX Operators.md)."""
    ops = onnx_opset(model)
    blocked = [n for n in model.graph.node if n.op_type in QDQ_OPS
               and int(attr(n, "block_size", 0) or 0) > 0]
    if not blocked:
        return [check_result("blocked_qdq_opset", "skip", "no blocked Q/DQ nodes")]
    if ops >= 21:
        return [check_result("blocked_qdq_opset", "pass",
                             f"{len(blocked)} blocked Q/DQ nodes at opset {ops} >= 21")]
    return [check_result("blocked_qdq_opset", "fail",
                         f"block_size={attr(n, 'block_size')} at opset {ops}: blocked Q/DQ "
                         "exists from opset 21 on; runtimes reject or misread it", node=node_label(n),
                         fix="set the model's default-domain opset to 21 (onnx.version_converter), or "
                         "quantize per-channel") for n in blocked]


def lint_fp16_initializers(model) -> list[dict]:
    """Constants of an FP16 file outside the FP16 range: FP16 constants holding inf/NaN (a
    finite value that did not fit), or FP32 constants beyond 65504 cast to FP16 by the graph."""
    from onnx import TensorProto

    if detect_precision(model) != "FP16":
        return [check_result("fp16_initializers", "skip", "not an FP16 file")]
    consts = constants(model)
    cons = consumers(model)
    out = []
    for name, arr in consts.items():
        if not np.issubdtype(arr.dtype, np.floating) or arr.size == 0:
            continue
        users = ", ".join(node_label(c) for c in cons.get(name, [])[:3]) or None
        if arr.dtype == np.float16 and not np.isfinite(arr).all():
            out.append(check_result(
                "fp16_initializers", "fail",
                f"FP16 constant {name} holds {int((~np.isfinite(arr)).sum())} inf/NaN values",
                node=users, fix=f"keep {users} in FP32 when converting (2_export_onnx.py "
                                "--fp16-keep-fp32), or rescale the constant"))
        elif arr.dtype == np.float32 and float(np.abs(arr).max()) > FP16_MAX:
            casts = [c for c in cons.get(name, []) if c.op_type == "Cast"
                     and int(attr(c, "to", 0)) == TensorProto.FLOAT16]
            if casts:
                out.append(check_result(
                    "fp16_initializers", "fail",
                    f"FP32 constant {name} (max |x| {float(np.abs(arr).max()):.6g}) is cast to "
                    f"FP16 by {node_label(casts[0])}: values above {FP16_MAX:g} become inf",
                    node=node_label(casts[0]),
                    fix="keep its consumers in FP32 (2_export_onnx.py --fp16-keep-fp32)"))
    return out or [check_result("fp16_initializers", "pass", "every FP16 constant is finite")]


def lint_onnx_checker(model, path: Path | str | None = None) -> list[dict]:
    """``onnx.checker.check_model(full_check=True)``: the ONNX spec's structural checks plus
    strict shape and type inference. A failure is an error (``fail``) with the checker's
    message; the node, when the message names one.

    Args:
        path: the file (checked from disk: external data and files over 2 GB), else ``model``.
    """
    import re

    import onnx

    try:
        onnx.checker.check_model(str(path) if path is not None else model, full_check=True)
    except Exception as e:  # noqa: BLE001 - onnx raises ValidationError, InferenceError, ...
        msg = " ".join(str(e).split())
        node = re.search(r"node name: ([^)]+)\)", msg)
        return [check_result("onnx_checker", "fail", f"onnx.checker (full_check): {msg[:400]}",
                             node=node.group(1) if node else None,
                             fix="fix the node the message names (opset, attribute, input "
                                 "types) in the exporter or the tool that wrote the file")]
    return [check_result("onnx_checker", "pass", "onnx.checker.check_model(full_check=True)")]


def lint_ort_load(model, path: Path | str | None = None) -> list[dict]:
    """Create an ONNX Runtime ``InferenceSession`` on the CPU EP: a file the checker accepts can
    still be refused (an op/type without a kernel, a graph ORT's own resolve rejects). A refusal
    is an error (``fail``) naming the node when ORT's message does. Skipped without
    onnxruntime, or for an in-memory model over 2 GB."""
    import re

    try:
        import onnxruntime as ort
    except ImportError:
        return [check_result("ort_load", "skip", "onnxruntime is not installed")]
    if path is None and model.ByteSize() > 2**31 - 1:
        return [check_result("ort_load", "skip", "in-memory model over 2 GB: lint the file")]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        ort.InferenceSession(str(path) if path is not None else model.SerializeToString(), so,
                             providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception classes
        msg = " ".join(str(e).split())
        node = (re.search(r"node with name '([^']+)'", msg) or re.search(r"Name:'([^']+)'", msg)
                or re.search(r"in node \(([^)]+)\)", msg) or re.search(r"node \(([^)]+)\)", msg))
        return [check_result(
            "ort_load", "fail", f"ONNX Runtime (CPU EP) cannot load the file: {msg[-400:]}",
            node=node.group(1) if node else None,
            fix="the node ORT names has no kernel or an invalid form on ORT: change its type "
                "or attributes (or the opset), or run it on a backend that implements it")]
    return [check_result("ort_load", "pass", f"ONNX Runtime {ort.__version__} CPU EP loads it")]


# --------------------------------------------------------------------------------------------
# Opset conversions: operators whose meaning or form changed between two opsets
# --------------------------------------------------------------------------------------------
#: ``(op types, opset that changed them, what changed)``, from onnx/docs/Changelog.md (the
#: ``<Op>-<version>`` entries named) and onnx/docs/Operators.md. A conversion from opset ``a``
#: to ``b`` crosses a boundary ``v`` when ``min(a, b) < v <= max(a, b)``.
OPSET_SEMANTIC_CHANGES: tuple[tuple[tuple[str, ...], int, str], ...] = (
    (("Upsample",), 10,
     "Upsample is deprecated from opset 10 (Upsample-10; Resize-10 replaces it) and its "
     "'asymmetric' coordinate mapping is not Resize-11's default half_pixel: a Resize made "
     "from it must set coordinate_transformation_mode='asymmetric'"),
    (("Resize",), 11,
     "Resize-10 has no coordinate_transformation_mode (it maps coordinates 'asymmetric', "
     "nearest rounds down); Resize-11 defaults to half_pixel and round_prefer_floor: the same "
     "node resamples differently across opset 11 unless the mode is set explicitly"),
    (("Resize",), 18,
     "Resize-18 adds antialias, axes and keep_aspect_ratio_policy: a node that uses them has no "
     "form below opset 18"),
    (("Resize",), 19,
     "Resize-19 adds coordinate_transformation_mode='half_pixel_symmetric': no form below "
     "opset 19"),
    (("Softmax", "LogSoftmax", "Hardmax"), 13,
     "before opset 13 (Softmax-1/11) the input is coerced to 2-D at 'axis' (default 1) and "
     "normalised over all trailing axes together; from Softmax-13 over 'axis' alone (default "
     "-1): a rank > 2 input with a non-last or default axis changes meaning"),
    (("ReduceSum",), 13,
     "ReduceSum-13 takes 'axes' as an input (an attribute before), and adds "
     "noop_with_empty_axes"),
    (("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
      "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"), 18,
     "Reduce*-18 take 'axes' as an input (an attribute before) and add noop_with_empty_axes: "
     "axes computed at run time have no form below opset 18"),
    (("Split",), 13,
     "Split-13 takes 'split' as an input (an attribute before): sizes computed at run time "
     "have no form below opset 13"),
    (("Split",), 18,
     "Split-18 adds num_outputs (with an uneven last chunk): no form below opset 18"),
    (("Squeeze", "Unsqueeze"), 13,
     "Squeeze-13/Unsqueeze-13 take 'axes' as an input (an attribute before): axes computed at "
     "run time have no form below opset 13"),
    (("Clip",), 11,
     "Clip-11 takes min/max as inputs (attributes before, default -/+FLT_MAX)"),
    (("Pad",), 11,
     "Pad-11 takes pads (and the constant value) as inputs (attributes before)"),
)


def _runtime_input(n, idx: int, consts: dict) -> bool:
    """True when input ``idx`` of node ``n`` is given and not a constant (computed at run time)."""
    return len(n.input) > idx and bool(n.input[idx]) and n.input[idx] not in consts


def _changes_meaning(n, boundary: int, src: int, dst: int, shapes: dict, consts: dict
                     ) -> str | None:
    """Why node ``n`` is affected by the change at ``boundary`` on a conversion ``src`` ->
    ``dst`` (None: the converter rewrites its form exactly)."""
    down = dst < src
    op = n.op_type
    if op == "Upsample":
        return "an Upsample node"
    if op == "Resize" and boundary == 11:
        mode = attr(n, "coordinate_transformation_mode")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        return None if mode == "asymmetric" else (
            f"coordinate_transformation_mode {mode or 'unset (the default)'}")
    if op == "Resize" and boundary == 18:
        used = [a for a in ("antialias", "axes", "keep_aspect_ratio_policy")
                if attr(n, a) not in (None, 0, b"stretch", "stretch")]
        return f"uses {', '.join(used)}" if down and used else None
    if op == "Resize" and boundary == 19:
        mode = attr(n, "coordinate_transformation_mode")
        return ("coordinate_transformation_mode half_pixel_symmetric" if down and mode in
                (b"half_pixel_symmetric", "half_pixel_symmetric") else None)
    if op in SOFTMAX_OPS:
        rank = len(shapes[n.input[0]]) if n.input[0] in shapes else None
        a = attr(n, "axis")
        if rank is not None and rank <= 2:
            return None
        if a is not None and rank is not None and a in (-1, rank - 1):
            return None
        return (f"axis {'unset (default 1 before, -1 from 13)' if a is None else a} on a "
                f"{f'rank-{rank}' if rank else 'unknown-rank'} input")
    if op == "Split" and boundary == 18:
        return "uses num_outputs" if down and attr(n, "num_outputs") is not None else None
    if op in ("Clip", "Pad"):
        return None if not down or not any(_runtime_input(n, i, consts) for i in (1, 2)) \
            else "min/max or pads computed at run time"
    # axes / split moved from an attribute to an input: only run-time values have no old form
    if down and _runtime_input(n, 1, consts):
        return f"'{'split' if op == 'Split' else 'axes'}' computed at run time"
    if down and attr(n, "noop_with_empty_axes"):
        return "noop_with_empty_axes=1"
    return None


def lint_opset_conversion(model, target: int) -> list[dict]:
    """Nodes whose operator changed meaning or form between the file's opset and ``target``
    (:data:`OPSET_SEMANTIC_CHANGES`), for the conversions the pipeline makes: ModelOpt's
    opset-19 file (``<name>_opset19.onnx``) and stage 6's opset-17 copy for TensorRT 8.x.

    Args:
        model: ``onnx.ModelProto``. target: the opset it is converted to.
    Returns:
        ``opset_conversion`` results: one ``warn`` per affected node (naming it, the boundary,
        the Changelog entry and the fix), else one ``pass`` (or ``skip``: same opset).
    """
    src = onnx_opset(model)
    if src == target:
        return [check_result("opset_conversion", "skip", f"already opset {target}")]
    lo, hi = sorted((src, target))
    crossed = [(ops, v, what) for ops, v, what in OPSET_SEMANTIC_CHANGES if lo < v <= hi]
    shapes = value_shapes(model) if any(
        n.op_type in SOFTMAX_OPS for n in model.graph.node) else {}
    consts = constants(model)
    out = []
    for n in model.graph.node:
        for ops, v, what in crossed:
            if n.op_type not in ops:
                continue
            why = _changes_meaning(n, v, src, target, shapes, consts)
            if why is None:
                continue
            out.append(check_result(
                "opset_conversion", "warn",
                f"{n.op_type} ({why}) crosses the opset-{v} change on the conversion opset "
                f"{src} -> {target}: {what}", node=with_source(n),
                fix=f"compare the converted file with this one on real inputs "
                    f"(python layerwise.py diff ORIGINAL CONVERTED), set the attribute "
                    f"explicitly before converting, or export at opset {target} directly "
                    f"(--opset {target})", boundary=v, source_opset=src, target_opset=target))
    return out or [check_result(
        "opset_conversion", "pass",
        f"opset {src} -> {target}: no node crosses a change of meaning "
        f"({len(crossed)} Changelog entr{'y' if len(crossed) == 1 else 'ies'} in between)")]


LINT_CHECKS: tuple[Callable, ...] = (lint_softmax_axis, lint_hardsigmoid, lint_squeeze_axes,
                                     lint_shape_constants, lint_blocked_qdq_opset,
                                     lint_fp16_initializers, lint_onnx_checker, lint_ort_load)


def lint(model, example_batch: int | None = None, against_torch: bool = False,
         targets: tuple[int, ...] = ()) -> list[dict]:
    """Every lint check on ``model`` (a ModelProto or a path).

    Args:
        example_batch: the export's example batch, when known (sharpens ``shape_constants``).
        against_torch: the file was exported from PyTorch (``hardsigmoid`` mismatches fail).
        targets: opsets the file will be converted to (:func:`lint_opset_conversion` each).
    Returns:
        the results of all lint checks (see the module docstring for the shape).
    Raises:
        StageError: the file cannot be read.
    """
    path = Path(model) if isinstance(model, (str, Path)) else None
    if path is not None:
        model = load_onnx(path)
    out = []
    for fn in LINT_CHECKS:
        if fn is lint_shape_constants:
            out += fn(model, example_batch)
        elif fn is lint_hardsigmoid:
            out += fn(model, against_torch)
        elif fn in (lint_onnx_checker, lint_ort_load):
            out += fn(model, path)
        else:
            out += fn(model)
    for t in targets:
        out += lint_opset_conversion(model, t)
    return out
