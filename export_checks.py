#!/usr/bin/env python3
"""Export checks: is an ONNX file a faithful, deployable copy of the model, in FP32 and FP16?

One function per check, one result shape. Stage 2 (``2_export_onnx.py``) runs them on every
file it writes and refuses a file that fails one; the command line runs them on any file:

    python export_checks.py lint F.onnx [--example-batch N] [--json OUT]      # any ONNX file
    python export_checks.py check --model M --onnx F [--inputs X.npz | --input-shape ...]
    python export_checks.py fp16-audit FP32.onnx [--fp16 F16.onnx] [--inputs X.npz | --model M]
    python export_checks.py fp16 FP32.onnx -o FP16.onnx [--keep-fp32 NODE ...] [--inputs ...]

``lint`` exits 1 on any warning or error; ``check`` and ``fp16-audit`` exit 1 on a failed check;
``fp16`` writes the FP16 file only when it passes (else ``<name>.rejected.onnx`` + reason).

Every check returns a list of results of this shape::

    {"check": name, "status": "pass" | "warn" | "fail" | "skip", "detail": one sentence,
     "node": ONNX node name or None, "fix": what to change or None, ...check-specific fields}

Checks
- lint (graph only): ``softmax_axis`` (Softmax/LogSoftmax/Hardmax below opset 13 flatten the
  input to 2-D), ``hardsigmoid`` (alpha/beta against PyTorch's 1/6 and 0.5), ``squeeze_axes``
  (Squeeze without axes on a dynamic axis), ``shape_constants`` (Reshape/Expand/Tile shape
  constants that hold a batch size), ``blocked_qdq_opset`` (blocked Q/DQ below opset 21),
  ``fp16_initializers`` (constants outside the FP16 range in an FP16 file).
- export: ``dynamic_axes`` (every declared dynamic axis symbolic), ``exporter_warnings`` (a
  TracerWarning, i.e. a value frozen at trace time, is an error), ``data_dependent_ops``
  (NonZero & co.: accepted when parity holds, flagged for TensorRT).
- against PyTorch: ``batch_parity`` (each batch size, output ranks), ``input_paths`` (a second
  input that takes other data-dependent paths), ``unused_inputs``.
- FP16: ``fp16_range`` (every FP16 tensor's range on real inputs: overflow above 65504, mass
  below the smallest normal 6.1e-5, long reductions), ``fp16_constants`` (constants the
  converter changed), ``fp16_true_arithmetic`` (``onnx.reference`` computes in the graph's
  dtypes, unlike ORT's CPU EP), ``fp16_backends`` (CUDA EP / TensorRT when present).

FP16 limits: IEEE 754 binary16, largest finite 65504, smallest normal 2^-14 = 6.10e-05, smallest
subnormal 2^-24 = 5.96e-08 (``numpy.finfo(numpy.float16)``).
"""
from __future__ import annotations

import argparse
import linecache
import os
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

import common
import onnx_graph
import runners
from common import StageError, UsageError

FP16_MAX = float(np.finfo(np.float16).max)                      # 65504
FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)              # 6.10e-05
FP16_MIN_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)  # 5.96e-08
#: A tensor "loses most of its mass" in FP16 when more than this share of its L1 mass
#: (sum of |x|) sits in nonzero values below the smallest normal (subnormal or zero in FP16).
UNDERFLOW_MASS_SHARE = 0.5
#: A constant change by the FP16 converter matters when it moves an element by more than this
#: share of the tensor's largest magnitude (FP16 rounding itself moves at most 2^-11 = 4.9e-4).
CONSTANT_CHANGE_SHARE = 1e-3

HARDSIGMOID_TORCH = {"alpha": 1.0 / 6.0, "beta": 0.5}  # torch.nn.Hardsigmoid: relu6(x + 3) / 6
#: Ops whose output shape depends on input values (TensorRT needs an IOutputAllocator for such
#: outputs, TensorRT >= 8.5; ONNX Runtime handles them). If/Loop: control flow.
DATA_DEPENDENT_OPS = {"NonZero", "Unique", "Compress", "NonMaxSuppression", "If", "Loop"}
#: Reductions whose running sum, not their output, can leave the FP16 range. ``mean``
#: (ReduceMean, GlobalAveragePool): the sum of the averaged values, |output| x count; kernels
#: that accumulate in FP32 (usual on GPUs) are safe, the reference evaluator is not: a warning.
#: ``l2`` (ReduceL2): the sum of squares, output^2; a sum of squares above 65504 returns inf on
#: ONNX Runtime's CUDA EP where its CPU EP returns the finite root (measured, see the project
#: notes): a failure.
ACCUMULATING_REDUCTIONS = {"ReduceMean": "mean", "GlobalAveragePool": "mean", "ReduceL2": "l2"}
SOFTMAX_OPS = {"Softmax", "LogSoftmax", "Hardmax"}
STATUS_ORDER = {"fail": 3, "warn": 2, "pass": 1, "skip": 0}
DEFAULT_EXAMPLE_BATCH = 3  # export example batch: >= 2, and unlike a channel or group count


# --------------------------------------------------------------------------------------------
# Result shape and small helpers
# --------------------------------------------------------------------------------------------
def result(check: str, status: str, detail: str, node: str | None = None,
           fix: str | None = None, **extra) -> dict:
    """One check result (the shape every check returns, in a list).

    Raises:
        ValueError: unknown status (a programming error).
    """
    if status not in STATUS_ORDER:
        raise ValueError(f"status {status!r}")
    return {"check": check, "status": status, "detail": detail, "node": node, "fix": fix,
            **extra}


def worst(results: Iterable[dict]) -> str:
    """Overall status of ``results``: ``fail`` > ``warn`` > ``pass`` > ``skip``."""
    return max((r["status"] for r in results), key=STATUS_ORDER.__getitem__, default="skip")


def format_result(r: dict) -> str:
    """One or two printable lines: ``[status] check node: detail`` and ``fix: ...``."""
    node = f" {r['node']}" if r.get("node") else ""
    line = f"[{r['status']}] {r['check']}{node}: {r['detail']}"
    return line + (f"\n       fix: {r['fix']}" if r.get("fix") else "")


def node_label(node, index: int | None = None) -> str:
    """A node's name, or ``<op>(<first output>)`` for unnamed nodes."""
    return node.name or f"{node.op_type}({node.output[0] if node.output else index})"


def source_line(node) -> str | None:
    """The user's source line that made an exported node (``file.py:16: x = x.squeeze()``), from
    the dynamo exporter's ``pkg.torch.onnx.stack_trace`` metadata; None without it. Frames inside
    torch itself are skipped."""
    for p in node.metadata_props:
        if p.key != "pkg.torch.onnx.stack_trace":
            continue
        for m in re.finditer(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', p.value):
            path, line, code = m.groups()
            if f"{os.sep}torch{os.sep}" in path:
                continue
            code = code.split("  #")[0].strip()  # drop a trailing comment
            return f"{Path(path).name}:{line}: {code}"
    return None


def _with_source(node) -> str:
    src = source_line(node)
    return node_label(node) + (f" ({src})" if src else "")


def _inferred(model):
    """``model`` with inferred shapes (the original on failure, e.g. > 2 GB or unknown ops)."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - shape inference is best effort here
        return model


def value_shapes(model) -> dict[str, list]:
    """``{tensor: dims}`` for every tensor with known rank (after shape inference); a dim is an
    int, a symbol (str) or None."""
    m = _inferred(model)
    out = {}
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        out[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                        for d in t.shape.dim]
    for name, arr in onnx_graph.constants(model).items():
        out[name] = list(arr.shape)
    return out


def _depends_on_inputs(model) -> set[str]:
    """Tensors computed (directly or not) from a real graph input."""
    live = {n for n, _, _ in onnx_graph.inputs(model)}
    for node in model.graph.node:  # ONNX node lists are topologically sorted
        if any(i in live for i in node.input if i):
            live.update(o for o in node.output if o)
    return live


def _const_leading(model, name: str, consts: dict, prod: dict) -> tuple[np.ndarray | None, str]:
    """``(constant value of name, how to print it)``; for a Concat of pieces, the constant
    leading piece (the legacy exporter builds shapes as ``Concat(Constant[b], ...)``)."""
    if name in consts:
        arr = np.asarray(consts[name])
        return arr, str(arr.reshape(-1).tolist())
    node = prod.get(name)
    if node is not None and node.op_type == "Concat" and node.input:
        arr, text = _const_leading(model, node.input[0], consts, prod)
        return arr, (f"Concat({text}, ...)" if arr is not None else text)
    return None, ""


# --------------------------------------------------------------------------------------------
# Lint: graph-only checks, any ONNX file
# --------------------------------------------------------------------------------------------
def lint_softmax_axis(model) -> list[dict]:
    """Softmax/LogSoftmax/Hardmax below opset 13 on a rank > 2 input with an axis that is not
    the last: those opsets coerce the input to 2-D at ``axis`` and normalise over all the
    trailing axes together (ONNX Operators.md, Softmax-1/11 vs Softmax-13), not over ``axis``
    alone as PyTorch's ``softmax(dim)`` and opset 13 do."""
    ops = onnx_graph.opset(model)
    nodes = [n for n in model.graph.node if n.op_type in SOFTMAX_OPS]
    if not nodes:
        return [result("softmax_axis", "skip", "no Softmax/LogSoftmax/Hardmax nodes")]
    if ops >= 13:
        return [result("softmax_axis", "pass", f"opset {ops} >= 13: per-axis semantics")]
    shapes = value_shapes(model)
    out = []
    for n in nodes:
        axis = int(onnx_graph.attr(n, "axis", 1))
        rank = len(shapes[n.input[0]]) if n.input[0] in shapes else None
        if rank is not None and (rank <= 2 or axis in (-1, rank - 1)):
            continue
        what = f"rank-{rank}" if rank else "unknown-rank"
        out.append(result(
            "softmax_axis", "warn",
            f"{n.op_type} axis={axis} on a {what} input at opset {ops}: opsets < 13 flatten the "
            f"input to 2-D at axis {axis} and normalise over all axes from {axis} on together, "
            f"not over axis {axis} alone", node=_with_source(n),
            fix=f"export at opset >= 13 (--opset 13 or higher), or move the axis last "
                f"(transpose, {n.op_type}(axis=-1), transpose back)"))
    return out or [result("softmax_axis", "pass", "every Softmax runs over the last axis")]


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
        alpha = float(onnx_graph.attr(n, "alpha", 0.2))
        beta = float(onnx_graph.attr(n, "beta", 0.5))
        if (abs(alpha - HARDSIGMOID_TORCH["alpha"]) > 1e-6
                or abs(beta - HARDSIGMOID_TORCH["beta"]) > 1e-6):
            bad.append(result(
                "hardsigmoid", "fail" if against_torch else "warn",
                f"alpha={alpha:.6g} beta={beta:.6g} (PyTorch: alpha=1/6={1/6:.6g}, beta=0.5; "
                "ONNX's default alpha is 0.2)", node=_with_source(n),
                fix="set alpha=1/6 (0.1666667) and beta=0.5 on this node, or re-export from "
                    "PyTorch (its exporter writes both)"))
    if bad:
        return bad
    if not n_hs:
        return [result("hardsigmoid", "skip", "no HardSigmoid/HardSwish nodes")]
    return [result("hardsigmoid", "pass", f"{n_hs} HardSigmoid/HardSwish nodes match PyTorch")]


def lint_squeeze_axes(model) -> list[dict]:
    """Squeeze without axes whose input has a dynamic axis: it removes every axis of size 1 at
    run time, so at batch 1 the batch axis goes too and the output rank depends on the batch
    (a PyTorch ``.squeeze()`` head)."""
    shapes = value_shapes(model)
    ops = onnx_graph.opset(model)
    out, n_sq = [], 0
    for n in model.graph.node:
        if n.op_type != "Squeeze":
            continue
        n_sq += 1
        has_axes = (len(n.input) > 1 and n.input[1]) if ops >= 13 else \
            onnx_graph.attr(n, "axes") is not None
        if has_axes:
            continue
        dims = shapes.get(n.input[0])
        dyn = [i for i, d in enumerate(dims or []) if not isinstance(d, int) or d == 0]
        if dims is not None and not dyn:
            continue  # all sizes fixed: the squeezed axes are known
        where = (f"dynamic axes {dyn} of {dims}" if dims is not None else "an input of unknown "
                 "shape")
        out.append(result(
            "squeeze_axes", "fail" if dims is not None else "warn",
            f"Squeeze without axes on {where}: it also removes a dynamic axis whenever that "
            "axis is 1 at run time (batch 1), so the output rank depends on the batch",
            node=_with_source(n),
            fix="squeeze only the axes you mean (x.squeeze((2, 3)) or x.flatten(1) in PyTorch; "
                "an 'axes' input in the ONNX)"))
    if not n_sq:
        return [result("squeeze_axes", "skip", "no Squeeze nodes")]
    return out or [result("squeeze_axes", "pass", f"{n_sq} Squeeze nodes name their axes")]


def lint_shape_constants(model, example_batch: int | None = None) -> list[dict]:
    """Reshape/Expand/Tile whose constant shape holds a batch size: a leading fixed size on a
    tensor whose axis 0 is the dynamic batch (Reshape), or the export's example batch
    (``example_batch``, when known) anywhere at the front of a shape computed from the inputs.

    Args:
        example_batch: the batch the file was exported with (stage 2 knows it); None for a
            file of unknown origin (only the Reshape rule applies, Expand/Tile warn).
    """
    consts = onnx_graph.constants(model)
    prod = onnx_graph.producers(model)
    shapes = value_shapes(model)
    live = _depends_on_inputs(model)
    static = onnx_graph.static_batch(model)
    out, n_seen = [], 0
    for n in model.graph.node:
        if n.op_type not in ("Reshape", "Expand", "Tile") or len(n.input) < 2:
            continue
        if n.input[0] not in live:
            continue  # reshaping a constant (weights), not a batch of data
        arr, text = _const_leading(model, n.input[1], consts, prod)
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
            out.append(result(
                "shape_constants", "fail",
                f"{n.op_type} {what} {text} starts with {lead}, the export's "
                "example batch: the batch was frozen into the graph", node=_with_source(n),
                fix=fix))
        elif (n.op_type == "Reshape" and lead > 1 and batch_dynamic and static is None
              and isinstance(axis0, str)):
            out.append(result(
                "shape_constants", "fail",
                f"Reshape target {text} fixes axis 0 to {lead} although its "
                f"input's axis 0 is the dynamic '{axis0}': any other batch fails or mixes "
                "samples", node=_with_source(n), fix=fix))
        elif n.op_type in ("Expand", "Tile") and lead > 1 and static is None and axis0 == 1:
            out.append(result(
                "shape_constants", "warn",
                f"{n.op_type} {what} {text} turns axis 0 of size 1 into the "
                f"fixed {lead}: if {lead} is the export batch, the batch was frozen",
                node=_with_source(n), fix=fix))
    if not n_seen:
        return [result("shape_constants", "skip", "no Reshape/Expand/Tile with a constant shape "
                                                  "on data")]
    return out or [result("shape_constants", "pass",
                          f"{n_seen} constant shapes hold no batch size")]


def lint_blocked_qdq_opset(model) -> list[dict]:
    """QuantizeLinear/DequantizeLinear with ``block_size`` (blocked quantization) need opset 21
    (the attribute was added in QuantizeLinear-21/DequantizeLinear-21, ONNX Operators.md)."""
    ops = onnx_graph.opset(model)
    blocked = [n for n in model.graph.node if n.op_type in onnx_graph.QDQ_OPS
               and int(onnx_graph.attr(n, "block_size", 0) or 0) > 0]
    if not blocked:
        return [result("blocked_qdq_opset", "skip", "no blocked Q/DQ nodes")]
    if ops >= 21:
        return [result("blocked_qdq_opset", "pass",
                       f"{len(blocked)} blocked Q/DQ nodes at opset {ops} >= 21")]
    return [result("blocked_qdq_opset", "fail",
                   f"block_size={onnx_graph.attr(n, 'block_size')} at opset {ops}: blocked Q/DQ "
                   "exists from opset 21 on; runtimes reject or misread it", node=node_label(n),
                   fix="set the model's default-domain opset to 21 (onnx.version_converter), or "
                       "quantize per-channel") for n in blocked]


def lint_fp16_initializers(model) -> list[dict]:
    """Constants of an FP16 file outside the FP16 range: FP16 constants holding inf/NaN (a
    finite value that did not fit), or FP32 constants beyond 65504 cast to FP16 by the graph."""
    from onnx import TensorProto

    if onnx_graph.detect_precision(model) != "FP16":
        return [result("fp16_initializers", "skip", "not an FP16 file")]
    consts = onnx_graph.constants(model)
    cons = onnx_graph.consumers(model)
    out = []
    for name, arr in consts.items():
        if not np.issubdtype(arr.dtype, np.floating) or arr.size == 0:
            continue
        users = ", ".join(node_label(c) for c in cons.get(name, [])[:3]) or None
        if arr.dtype == np.float16 and not np.isfinite(arr).all():
            out.append(result(
                "fp16_initializers", "fail",
                f"FP16 constant {name} holds {int((~np.isfinite(arr)).sum())} inf/NaN values",
                node=users, fix=f"keep {users} in FP32 when converting (2_export_onnx.py "
                                "--fp16-keep-fp32), or rescale the constant"))
        elif arr.dtype == np.float32 and float(np.abs(arr).max()) > FP16_MAX:
            casts = [c for c in cons.get(name, []) if c.op_type == "Cast"
                     and int(onnx_graph.attr(c, "to", 0)) == TensorProto.FLOAT16]
            if casts:
                out.append(result(
                    "fp16_initializers", "fail",
                    f"FP32 constant {name} (max |x| {float(np.abs(arr).max()):.6g}) is cast to "
                    f"FP16 by {node_label(casts[0])}: values above {FP16_MAX:g} become inf",
                    node=node_label(casts[0]),
                    fix="keep its consumers in FP32 (2_export_onnx.py --fp16-keep-fp32)"))
    return out or [result("fp16_initializers", "pass", "every FP16 constant is finite")]


LINT_CHECKS: tuple[Callable, ...] = (lint_softmax_axis, lint_hardsigmoid, lint_squeeze_axes,
                                     lint_shape_constants, lint_blocked_qdq_opset,
                                     lint_fp16_initializers)


def lint(model, example_batch: int | None = None, against_torch: bool = False) -> list[dict]:
    """Every lint check on ``model`` (a ModelProto or a path).

    Args:
        example_batch: the export's example batch, when known (sharpens ``shape_constants``).
        against_torch: the file was exported from PyTorch (``hardsigmoid`` mismatches fail).
    Returns:
        the results of all lint checks (see the module docstring for the shape).
    Raises:
        StageError: the file cannot be read.
    """
    if isinstance(model, (str, Path)):
        model = onnx_graph.load(model)
    out = []
    for fn in LINT_CHECKS:
        if fn is lint_shape_constants:
            out += fn(model, example_batch)
        elif fn is lint_hardsigmoid:
            out += fn(model, against_torch)
        else:
            out += fn(model)
    return out


# --------------------------------------------------------------------------------------------
# Export checks (graph + exporter)
# --------------------------------------------------------------------------------------------
def check_dynamic_axes(model, declared: dict[str, Sequence[int]] | None = None,
                       example_batch: int | None = None,
                       model_inputs: Sequence[str] | None = None) -> list[dict]:
    """Every axis declared dynamic at export is symbolic in the file, and no output's axis 0 is
    frozen to the example batch.

    Args:
        declared: ``{input or output name: [axes]}`` declared dynamic (None: a file of unknown
            origin; a static batch is then a warning: the file runs at that batch only).
        example_batch: the export's example batch (outputs with that fixed axis 0 fail).
        model_inputs: the PyTorch model's input names; a declared one the exporter dropped
            (the graph never reads it) is left to :func:`check_unused_inputs`.
    """
    dims = {vi.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                      for d in vi.type.tensor_type.shape.dim]
            for vi in list(model.graph.input) + list(model.graph.output)}
    out = []
    fix = ("keep the batch symbolic: no int()/.item() on sizes, x.reshape(-1, ...) instead of "
           "x.view(b, ...) with a Python b; check the dynamic_axes/dynamic_shapes names match "
           "input_names")
    if declared is None:
        static = onnx_graph.static_batch(model)
        if static is not None:
            return [result("dynamic_axes", "warn",
                           f"every input has the fixed batch {static}: the file runs at batch "
                           f"{static} only (if a dynamic batch was declared at export, the "
                           "declaration did not reach the exporter)",
                           fix="re-export with a dynamic batch axis if other batches are "
                               "deployed; dynamic_axes keys must be the input_names",
                           static_batch=static)]
        declared = {n: [0] for n, _, _ in onnx_graph.inputs(model)}
    outputs = {o.name for o in model.graph.output}
    for name, axes in declared.items():
        if name not in dims:
            if name not in outputs and name in (model_inputs or ()):
                continue  # an input the exporter dropped: unused_inputs reports it
            out.append(result("dynamic_axes", "fail",
                              f"{name!r} was declared dynamic but is not an input or output of "
                              "the file (misspelt name in dynamic_axes?)", fix=fix))
            continue
        for ax in axes:
            d = dims[name][ax] if ax < len(dims[name]) else None
            if isinstance(d, int) and d > 0:
                why = (" (the example batch)" if example_batch and d == example_batch else "")
                out.append(result(
                    "dynamic_axes", "fail",
                    f"axis {ax} of {name} was declared dynamic but exported as the fixed size "
                    f"{d}{why}: the model read it as a Python number, or the exporter "
                    "specialised it", node=name, fix=fix))
    ins_dynamic = any(isinstance(v[0], str) for n, v in dims.items()
                      if v and n in {i for i, _, _ in onnx_graph.inputs(model)})
    for o in model.graph.output:
        d = dims[o.name][0] if dims.get(o.name) else None
        if (ins_dynamic and example_batch and isinstance(d, int) and d == example_batch
                and o.name not in declared):
            out.append(result("dynamic_axes", "fail",
                              f"output {o.name} has the fixed axis 0 = {d}, the example batch, "
                              "while the inputs are dynamic", node=o.name, fix=fix))
    return out or [result("dynamic_axes", "pass",
                          f"declared dynamic axes are symbolic ({dict(declared)})")]


def check_exporter_warnings(records: Sequence[dict], allow_tracer: bool = False) -> list[dict]:
    """Warnings the exporter raised, shown; a ``TracerWarning`` means a value (a size, an index,
    a branch) was read into Python and frozen at trace time, and is an error.

    Args:
        records: ``[{"category", "message", "filename", "lineno"}]`` (see
            :func:`capture_warnings`).
        allow_tracer: accept TracerWarnings (the user checked each named line).
    """
    out, quiet = [], 0
    for w in records:
        cat = w["category"]
        if cat in ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning"):
            quiet += 1
            continue
        where = f"{Path(w['filename']).name}:{w['lineno']}"
        code = linecache.getline(w["filename"], int(w["lineno"] or 0)).strip()
        msg = w["message"].strip().splitlines()[0][:220]
        if cat == "TracerWarning":
            out.append(result(
                "exporter_warnings", "warn" if allow_tracer else "fail",
                f"value frozen at trace time at {where}" + (f" ({code})" if code else "")
                + f": {msg}", node=where,
                fix=None if allow_tracer else
                "keep the value a tensor (index with the tensor, torch.where/gather instead of "
                "int()/.item()/bool()), or export with --exporter dynamo; after checking the "
                "line, --allow-tracer-warnings accepts it"))
        else:
            out.append(result("exporter_warnings", "warn", f"{cat} at {where}: {msg}",
                              node=where))
    if out:
        return out
    return [result("exporter_warnings", "pass",
                   "no exporter warnings" + (f" ({quiet} deprecation notices recorded)"
                                             if quiet else ""))]


def capture_warnings(caught: Sequence[warnings.WarningMessage]) -> list[dict]:
    """``warnings.catch_warnings(record=True)`` output as plain dicts (deduplicated)."""
    seen, out = set(), []
    for w in caught:
        rec = {"category": w.category.__name__, "message": str(w.message),
               "filename": str(w.filename), "lineno": int(w.lineno or 0)}
        key = (rec["category"], rec["message"], rec["filename"], rec["lineno"])
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def check_data_dependent_ops(model) -> list[dict]:
    """Ops whose output shape depends on the data (NonZero, ...) or control flow: accepted when
    parity holds, flagged for TensorRT (data-dependent output shapes need an ``IOutputAllocator``
    with ``enqueueV3``, TensorRT >= 8.5 C++/Python API)."""
    nodes = [n for n in model.graph.node if n.op_type in DATA_DEPENDENT_OPS]
    if not nodes:
        return [result("data_dependent_ops", "pass", "no data-dependent output shapes")]
    names = ", ".join(f"{node_label(n)} ({n.op_type})" for n in nodes[:6])
    return [result(
        "data_dependent_ops", "warn",
        f"{len(nodes)} node(s) with data-dependent output shapes or control flow: {names}; "
        "accepted when parity holds; for TensorRT: outputs of data-dependent size need an "
        "IOutputAllocator (TensorRT >= 8.5), check stage 6/7 on this model",
        node=node_label(nodes[0]), ops=sorted({n.op_type for n in nodes}),
        tensorrt_note="data-dependent output shapes")]


# --------------------------------------------------------------------------------------------
# Checks against PyTorch (runtime)
# --------------------------------------------------------------------------------------------
def _nan_safe_below(value: float, threshold: float) -> bool:
    return not (value >= threshold)  # NaN counts as below


def _compare(ref: dict[str, np.ndarray], out: dict[str, np.ndarray], min_cosine: float
             ) -> list[str]:
    """Problems of ``out`` against ``ref`` (matched by position): shapes, non-finite values,
    cosine similarity below ``min_cosine``."""
    problems = []
    for (rn, r), (on, o) in zip(ref.items(), out.items()):
        r, o = np.asarray(r), np.asarray(o)
        if r.shape != o.shape:
            problems.append(f"output {on} shape {list(o.shape)} vs PyTorch {list(r.shape)}")
            continue
        if not np.issubdtype(r.dtype, np.floating) and not np.issubdtype(o.dtype, np.floating):
            if not np.array_equal(r, o):
                problems.append(f"output {on} (integer) differs from PyTorch")
            continue
        bad = int((~np.isfinite(o.astype(np.float64)) & np.isfinite(r.astype(np.float64))).sum())
        if bad:
            problems.append(f"output {on} has {bad} NaN/inf values where PyTorch is finite")
            continue
        if r.size == 0:
            continue
        par = common.parity(r, o)
        if _nan_safe_below(par["cosine_min"], min_cosine):
            problems.append(f"output {on} differs from PyTorch (cosine min "
                            f"{par['cosine_min']:.6f} < {min_cosine}, max abs err "
                            f"{par['max_abs_err']:.3g})")
    if len(out) < len(ref):
        problems.append(f"the file has {len(out)} outputs, PyTorch {len(ref)}")
    return problems


def _suspects(lint_results: Sequence[dict], checks: Sequence[str]) -> list[dict]:
    return [r for r in lint_results if r["check"] in checks and r["status"] in ("fail", "warn")]


def check_batch_parity(ref_by_batch: dict[int, dict[str, np.ndarray]],
                       feed_by_batch: dict[int, dict[str, np.ndarray]],
                       run: Callable[[dict], dict], min_cosine: float,
                       lint_results: Sequence[dict] = ()) -> list[dict]:
    """The file against PyTorch at each batch size: same output shapes and values; PyTorch's own
    output ranks must not depend on the batch (a ``.squeeze()`` head).

    Args:
        ref_by_batch: ``{batch: PyTorch outputs}``; feed_by_batch: ``{batch: feed}`` (same keys).
        run: runs the file on a feed, returns ``{output: array}`` (raises on a runtime error).
        min_cosine: lowest cosine similarity per sample (FP32: 0.99999).
        lint_results: lint (and dynamic-axes, exporter-warning) findings; the ones that explain
            a failure are named in it.
    Returns:
        one ``batch_parity`` row with ``parity`` (:func:`common.parity` per output at the
        largest batch, outputs named by PyTorch) and ``output_shapes``.
    """
    problems, node, fix = [], None, None
    ranks = {b: [np.ndim(v) for v in r.values()] for b, r in ref_by_batch.items()}
    if len({tuple(v) for v in ranks.values()}) > 1:
        sq = _suspects(lint_results, ("squeeze_axes",))
        problems.append(f"the model's own output rank depends on the batch (PyTorch ranks by "
                        f"batch: {ranks})")
        node = sq[0]["node"] if sq else None
        fix = ("squeeze only the axes you mean in the model: x.flatten(1) or x.squeeze((2, 3)) "
               "instead of x.squeeze()")
    shapes, parity = {}, {}
    for b, feed in feed_by_batch.items():
        try:
            out = run(feed)
        except Exception as e:  # noqa: BLE001 - ORT/TensorRT raise their own types
            first = " ".join(str(e).split())[:240]
            problems.append(f"batch {b}: the file fails to run ({first})")
            sus = _suspects(lint_results, ("dynamic_axes", "shape_constants", "squeeze_axes"))
            if sus and node is None:
                node, fix = sus[0]["node"], sus[0]["fix"]
            continue
        shapes[b] = {k: list(np.shape(v)) for k, v in out.items()}
        problems += [f"batch {b}: {p}" for p in _compare(ref_by_batch[b], out, min_cosine)]
        if b == max(feed_by_batch):
            try:
                parity = {name: common.parity(r, o) for (name, r), o in
                          zip(ref_by_batch[b].items(), out.values())}
            except StageError:
                parity = {}
    if problems and node is None:
        sus = _suspects(lint_results, ("hardsigmoid", "softmax_axis", "shape_constants",
                                       "squeeze_axes", "fp16_initializers", "exporter_warnings"))
        if sus:
            node = sus[0]["node"]
            fix = sus[0]["fix"] or ("the exporter warned about this construct: rewrite it as "
                                    "the warning says, or try the other exporter (--exporter "
                                    "dynamo / legacy)")
            problems.append(f"likely cause: {sus[0]['check']} at {sus[0]['node']} "
                            f"({sus[0]['detail'][:160]})")
        else:
            fix = ("python layerwise.py torch-vs-onnx --model M --onnx F names the first module "
                   "whose ONNX output differs")
    return [result("batch_parity", "fail" if problems else "pass",
                   "; ".join(problems) or f"matches PyTorch at batch sizes {sorted(feed_by_batch)}"
                   f" (cosine >= {min_cosine})", node=node, fix=fix if problems else None,
                   batches=sorted(feed_by_batch), output_shapes=shapes, parity=parity)]


def check_batch_independence(ref_by_batch: dict[int, dict[str, np.ndarray]]) -> list[dict]:
    """Sample 0 alone and sample 0 inside a batch give the same PyTorch outputs (rows 0 of
    outputs whose axis 0 is the batch). A model whose samples interact (BatchNorm in training
    mode, a reduction over the batch) is reported: every batch size deploys a different model."""
    if 1 not in ref_by_batch or len(ref_by_batch) < 2:
        return [result("batch_independence", "skip", "needs batch 1 and a larger batch")]
    big = max(ref_by_batch)
    diffs = []
    for (n1, a), (_, b) in zip(ref_by_batch[1].items(), ref_by_batch[big].items()):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim and b.ndim and a.shape[0] == 1 and b.shape[0] == big and \
                a.shape[1:] == b.shape[1:] and np.issubdtype(a.dtype, np.floating):
            d = float(np.abs(a[0].astype(np.float64) - b[0]).max()) if a.size else 0.0
            scale = float(np.abs(b[0]).max()) if b[0].size else 0.0
            if d > 1e-4 * max(scale, 1.0):
                diffs.append(f"output {n1}: max abs diff {d:.3g}")
    if diffs:
        return [result("batch_independence", "warn",
                       f"in PyTorch, sample 0 alone differs from sample 0 inside a batch of "
                       f"{big} ({'; '.join(diffs)}): the samples interact",
                       fix="model.eval() before export; no statistics over the batch axis")]
    return [result("batch_independence", "pass", "samples do not interact (PyTorch)")]


def check_input_paths(ref_feeds: Sequence[tuple[dict, dict]], run: Callable[[dict], dict],
                      min_cosine: float, unused: Sequence[str] = ()) -> list[dict]:
    """Parity on inputs that take different data-dependent paths (another mask, index, argmax
    row): a file that matches PyTorch on the first and not on another froze a value at export.

    Args:
        ref_feeds: ``[(feed, PyTorch outputs)]``, at least two with different values.
        unused: model inputs the file does not read (their value is baked in).
    """
    if len(ref_feeds) < 2:
        return [result("input_paths", "skip", "one input only")]
    verdicts = []
    for feed, ref in ref_feeds:
        try:
            verdicts.append(_compare(ref, run(feed), min_cosine))
        except Exception as e:  # noqa: BLE001
            verdicts.append([f"fails to run ({' '.join(str(e).split())[:160]})"])
    fix = ("keep data-dependent values tensors (boolean masks, torch.gather/index_select with a "
           "tensor index, torch.where) instead of int()/.item()/Python branches, then re-export")
    why = (f"; inputs {list(unused)} are not read by the file: their value was frozen at export"
           if unused else "")
    if not verdicts[0] and any(verdicts[1:]):
        bad = next(v for v in verdicts[1:] if v)
        return [result("input_paths", "fail",
                       f"matches PyTorch on the first input but not on another ({bad[0]}): a "
                       f"data-dependent value was frozen at export{why}",
                       node=(list(unused) or [None])[0], fix=fix)]
    if all(verdicts):
        if unused:
            return [result("input_paths", "fail",
                           f"differs from PyTorch on every input ({verdicts[0][0]}){why}",
                           node=list(unused)[0], fix=fix)]
        return [result("input_paths", "skip",
                       "the file differs from PyTorch on every input: see batch_parity")]
    return [result("input_paths", "pass",
                   f"matches PyTorch on {len(ref_feeds)} inputs with different values")]


def check_unused_inputs(model, names: Sequence[str]) -> list[dict]:
    """Model inputs (``names``) the file does not take: the exporter dropped them because the
    traced graph never read them (a value read into Python and frozen, or a truly unused
    argument)."""
    have = {n for n, _, _ in onnx_graph.inputs(model)}
    missing = [n for n in names if n not in have]
    if missing:
        return [result("unused_inputs", "warn",
                       f"inputs {missing} are not inputs of the file: the exported graph does not "
                       "depend on them", node=missing[0], unused=missing,
                       fix="if the output should depend on them, keep their use tensor-valued "
                           "(no int()/.item()/Python branch on them)")]
    return [result("unused_inputs", "pass", "every model input is a graph input")]


# --------------------------------------------------------------------------------------------
# FP16: range audit, converter changes, true FP16 arithmetic, GPU backends
# --------------------------------------------------------------------------------------------
def fp16_held_tensors(fp16_model) -> set[str]:
    """Tensor names of the FP32 graph that an FP16 graph (onnxconverter-common, names kept)
    holds in FP16: FP16-typed tensors, tensors cast to FP16, and graph outputs cast back to FP32
    from an FP16 tensor (``keep_io_types``)."""
    from onnx import TensorProto

    m = _inferred(fp16_model)
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output)}
    for t in m.graph.initializer:
        types[t.name] = t.data_type
    # Only tensors that exist: the converter leaves value_info of tensors it renamed (a kept
    # node's output, whose Cast pair to FP16 and back it removed again).
    exist = ({o for n in m.graph.node for o in n.output} | {i.name for i in m.graph.input}
             | {t.name for t in m.graph.initializer})
    held = {n for n, t in types.items() if t == TensorProto.FLOAT16 and n in exist}
    for n in m.graph.node:
        if n.op_type != "Cast":
            continue
        to = int(onnx_graph.attr(n, "to", 0))
        if to == TensorProto.FLOAT16:
            held.add(n.input[0])
        elif to == TensorProto.FLOAT and types.get(n.input[0]) == TensorProto.FLOAT16:
            held.add(n.output[0])
    return held


def keep_fp32_nodes(model, tensors: Iterable[str]) -> list[str]:
    """Nodes to keep in FP32 so that ``tensors`` never exist in FP16: each tensor's producer and
    all its consumers (onnxconverter-common casts a blocked node's output back to FP16 for any
    consumer that is not blocked, which would overflow the same values)."""
    prod, cons = onnx_graph.producers(model), onnx_graph.consumers(model)
    out: list[str] = []
    for t in tensors:
        for n in ([prod[t]] if t in prod else []) + list(cons.get(t, [])):
            if n.name and n.name not in out:
                out.append(n.name)
    return out


class RangeStat:
    """Running |x| statistics of one tensor over chunks (float64 sums): ``amax`` (max |x|, inf
    if a value is not finite), ``l1`` (sum |x|), ``l1_small`` (sum of the nonzero |x| below
    FP16's smallest normal), ``n`` (finite values seen). ``update(array)`` adds a chunk."""

    __slots__ = ("amax", "l1", "l1_small", "n", "acc")

    def __init__(self):
        self.amax, self.l1, self.l1_small, self.n, self.acc = 0.0, 0.0, 0.0, 0, 0.0

    def update(self, a: np.ndarray) -> None:
        a = np.abs(np.asarray(a, np.float32)).ravel()
        if not a.size:
            return
        finite = np.isfinite(a)
        if not finite.all():
            self.amax = float("inf")
            a = a[finite]
        if a.size:
            self.amax = max(self.amax, float(a.max()))
            self.l1 += float(a.sum(dtype=np.float64))
            small = a[(a > 0) & (a < FP16_MIN_NORMAL)]
            self.l1_small += float(small.sum(dtype=np.float64))
        self.n += a.size


def fp16_range_audit(fp32_model, feed: dict[str, np.ndarray], fp16_model=None, *,
                     batch: int | None = 8, real_inputs: bool = True,
                     keep_fp32: Sequence[str] = ()) -> list[dict]:
    """Range audit of every tensor an FP16 graph holds in FP16, from FP32 activations on
    ``feed`` (ONNX Runtime CPU, every tensor marked as an output, graph optimisations off).

    Flags (each names the tensor, the node that makes it, and the nodes to keep in FP32):
    ``fail`` when a tensor's max |x| exceeds 65504 (inf in FP16) or more than
    :data:`UNDERFLOW_MASS_SHARE` of its L1 mass lies in nonzero values below FP16's smallest
    normal (6.1e-5: subnormal or zero); ``warn`` when a mean reduction's running sum
    (|output| x reduced count) exceeds 65504 (kernels that accumulate in FP16 overflow).

    Args:
        fp32_model: the FP32 ModelProto or path (the reference the FP16 file came from).
        feed: ``{input name: array}``, real inputs (eval/calibration images or the user's npz).
        fp16_model: the FP16 ModelProto/path; only tensors it holds in FP16 are judged
            (None: every float tensor, as if the whole graph were converted).
        batch: samples per run (None: all at once); a static batch overrides it.
        real_inputs: False when ``feed`` is synthetic (said in the summary; status capped at
            ``warn`` for the summary row only, findings still fail).
        keep_fp32: nodes already kept in FP32 (named in the fix so it accumulates).
    Returns:
        findings (``fail``/``warn``) then one summary row ``fp16_range``.
    """
    import layerwise

    m32 = onnx_graph.load(fp32_model) if isinstance(fp32_model, (str, Path)) else fp32_model
    held = None
    if fp16_model is not None:
        m16 = onnx_graph.load(fp16_model) if isinstance(fp16_model, (str, Path)) else fp16_model
        held = fp16_held_tensors(m16)
    feed, batch = layerwise.feed_plan(feed, [m32], batch)
    prod = onnx_graph.producers(m32)
    # Reductions computed in FP16 (their input is held in FP16).
    reds = {n.output[0]: n for n in m32.graph.node if n.op_type in ACCUMULATING_REDUCTIONS
            and (held is None or n.input[0] in held)}
    stats: dict[str, RangeStat] = {}
    acc: dict[str, float] = {}
    for acts, _ in layerwise.ort_activations(m32, feed, batch=batch, opt_level="disable"):
        for name, a in acts.items():
            if not np.issubdtype(np.asarray(a).dtype, np.floating):
                continue
            stats.setdefault(name, RangeStat()).update(a)
            if name in reds and reds[name].input[0] in acts and np.size(a):
                top = float(np.abs(a).max())
                if ACCUMULATING_REDUCTIONS[reds[name].op_type] == "l2":
                    run = top * top
                else:
                    run = top * np.size(acts[reds[name].input[0]]) / np.size(a)
                acc[name] = max(acc.get(name, 0.0), run)
    for name in feed:  # graph inputs (cast to FP16 by keep_io_types)
        if np.issubdtype(np.asarray(feed[name]).dtype, np.floating):
            stats.setdefault(name, RangeStat()).update(feed[name])
    out = []
    n_judged = 0
    for name, st in stats.items():
        if held is not None and name not in held:
            continue
        n_judged += 1
        node = prod.get(name)
        made_by = f"{node_label(node)} ({node.op_type})" if node is not None else "graph input"
        keep = [k for k in keep_fp32_nodes(m32, [name]) if k not in keep_fp32]
        fix = (f"keep {', '.join(keep)} in FP32: --fp16-keep-fp32 {','.join(keep)}"
               if keep else None)
        if st.amax > FP16_MAX:
            out.append(result("fp16_range", "fail",
                              f"tensor {name} made by {made_by} reaches max |x| {st.amax:.6g} > "
                              f"{FP16_MAX:g}: inf in FP16", node=node_label(node) if node else
                              name, fix=fix, tensor=name, max_abs=st.amax, keep_fp32=keep))
        elif st.l1 > 0 and st.l1_small / st.l1 > UNDERFLOW_MASS_SHARE:
            out.append(result("fp16_range", "fail",
                              f"tensor {name} made by {made_by} has "
                              f"{100 * st.l1_small / st.l1:.0f}% of its mass (sum |x|) below "
                              f"FP16's smallest normal {FP16_MIN_NORMAL:.3g}: subnormal or zero "
                              "in FP16", node=node_label(node) if node else name, fix=fix,
                              tensor=name, max_abs=st.amax,
                              underflow_share=st.l1_small / st.l1, keep_fp32=keep))
        elif acc.get(name, 0.0) > FP16_MAX:
            red = reds[name]
            keep = [k for k in keep_fp32_nodes(m32, [name]) if k not in keep_fp32]
            fix = f"keep {', '.join(keep)} in FP32: --fp16-keep-fp32 {','.join(keep)}"
            if ACCUMULATING_REDUCTIONS[red.op_type] == "l2":
                out.append(result("fp16_range", "fail",
                                  f"{made_by}: its sum of squares reaches ~{acc[name]:.6g} > "
                                  f"{FP16_MAX:g} although the root ({st.amax:.4g}) fits: inf in "
                                  "FP16 (as on ONNX Runtime's CUDA EP)", node=node_label(red),
                                  fix=fix, tensor=name, running_sum=acc[name], keep_fp32=keep))
            else:
                out.append(result("fp16_range", "warn",
                                  f"{made_by} averages {acc[name] / max(st.amax, 1e-30):.0f} "
                                  f"values: its running sum reaches ~{acc[name]:.6g} > "
                                  f"{FP16_MAX:g}, inf where a kernel accumulates in FP16 (GPU "
                                  "kernels usually accumulate in FP32)", node=node_label(red),
                                  fix=fix, tensor=name, running_sum=acc[name], keep_fp32=keep))
    src = "real inputs" if real_inputs else "synthetic N(0,1) inputs (pass --inputs for a real "\
        "audit)"
    n = len(next(iter(feed.values()))) if feed else 0
    worst_amax = max((st.amax for k, st in stats.items() if held is None or k in held),
                     default=0.0)
    n_fail, n_warn = (sum(r["status"] == k for r in out) for k in ("fail", "warn"))
    summary = result(
        "fp16_range", "fail" if n_fail else ("pass" if real_inputs else "warn"),
        f"{n_judged} FP16 tensors audited on {n} samples of {src}: "
        + (f"{n_fail} out of FP16 range, {n_warn} warning(s) (rows above)" if out
           else f"all within range (largest |x| {worst_amax:.4g})"),
        fix=None if real_inputs else "give real samples (--inputs X.npz) for the audit",
        n_tensors=n_judged, n_samples=n, largest_abs=worst_amax, summary=True)
    return out + [summary]


def convert_fp16(model, keep_fp32: Sequence[str] = ()) -> tuple[Any, list[dict]]:
    """FP16 copy of an FP32 ModelProto: onnxconverter-common's ``convert_float_to_float16``
    with ``keep_io_types=True`` (FP32 inputs/outputs, Cast nodes at the boundary),
    ``node_block_list=keep_fp32`` (nodes computed in FP32), and the converter's clamp limits set
    to the FP16 range (``max_finite_val=65504``, ``min_positive_val=5.96e-8``; its defaults 1e4
    and 1e-7 would change constants that FP16 holds). The converter's warnings are returned,
    never hidden.

    Returns:
        ``(fp16 ModelProto, warning records)``.
    Raises:
        UsageError: a ``keep_fp32`` name is not a node of the model.
    """
    from onnxconverter_common import float16

    names = {n.name for n in model.graph.node}
    unknown = [k for k in keep_fp32 if k not in names]
    if unknown:
        raise UsageError(f"--fp16-keep-fp32: {unknown} are not node names of the FP32 file "
                         f"(e.g. {sorted(names)[:5]})")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m16 = float16.convert_float_to_float16(
            model, keep_io_types=True, node_block_list=list(keep_fp32) or None,
            max_finite_val=FP16_MAX, min_positive_val=FP16_MIN_SUBNORMAL)
    return m16, capture_warnings(caught)


def fp16_converter_changes(fp32_model, fp16_model, converter_warnings: Sequence[dict] = ()
                           ) -> list[dict]:
    """Constants the FP16 converter changed beyond FP16 rounding (clamped to its limits),
    named with the nodes that read them; ``fail`` when an element moved by more than
    :data:`CONSTANT_CHANGE_SHARE` of the tensor's largest magnitude (a clamp of 20000 to 10000),
    else listed in one ``pass`` row (tiny weights raised to the smallest subnormal)."""
    c32, c16 = onnx_graph.constants(fp32_model), onnx_graph.constants(fp16_model)
    cons = onnx_graph.consumers(fp32_model)
    out, minor = [], []
    for name, x in c32.items():
        y = c16.get(name)
        if y is None or y.dtype != np.float16 or x.dtype != np.float32 or x.size == 0:
            continue
        with np.errstate(over="ignore"):  # values beyond FP16 become inf in the plain cast
            changed = (y.astype(np.float32) != x.astype(np.float16).astype(np.float32)) & \
                np.isfinite(x)
        if not changed.any():
            continue
        delta = float(np.abs(y.astype(np.float64) - x.astype(np.float64))[changed].max())
        scale = float(np.abs(x).max())
        users = [c for c in cons.get(name, [])]
        keep = [u.name for u in users if u.name]
        i = int(np.flatnonzero(changed.ravel())[np.argmax(np.abs(
            y.astype(np.float64) - x.astype(np.float64)).ravel()[changed.ravel()])])
        ex = f"{float(x.ravel()[i]):.6g} -> {float(y.ravel()[i]):.6g}"
        if delta > CONSTANT_CHANGE_SHARE * scale:
            out.append(result(
                "fp16_constants", "fail",
                f"the FP16 converter changed {int(changed.sum())} value(s) of constant {name} "
                f"(e.g. {ex}): it is outside what FP16 holds", node=", ".join(keep[:3]) or name,
                fix=(f"keep {', '.join(keep)} in FP32: --fp16-keep-fp32 {','.join(keep)}"
                     if keep else "rescale the constant into the FP16 range"),
                constant=name, n_changed=int(changed.sum()), example=ex, keep_fp32=keep))
        else:
            minor.append(f"{name} ({int(changed.sum())}, e.g. {ex})")
    detail = ("no constant changed beyond FP16 rounding" if not minor else
              f"{len(minor)} constants had elements below FP16's smallest subnormal raised to "
              f"{FP16_MIN_SUBNORMAL:.3g}, below {CONSTANT_CHANGE_SHARE:g} of their tensor's "
              f"largest value: {'; '.join(minor[:5])}")
    return out + [result("fp16_constants", "fail" if out else "pass", detail,
                         changed_minor=minor, converter_warnings=list(converter_warnings))]


#: onnx.reference time per sample / ONNX Runtime CPU time per sample of the same FP16 file:
#: measured ~140 on EfficientNet-Lite0 (7.5 s vs 0.055 s per 224 px image, 2 CPU cores,
#: onnx 1.21 / onnxruntime 1.32), rounded up.
REFERENCE_SLOWDOWN = 200.0

#: Name parts of the Cast nodes onnxconverter-common inserts (not nodes of the FP32 graph).
_CAST_SUFFIXES = ("_cast_to_",)

#: Ops whose ONNX definition computes internally in FP32 (LayerNormalization ``stash_type=1``)
#: or which GPU kernels usually accumulate in FP32, while ``onnx.reference`` computes them in
#: the input dtype: a non-finite result there is a warning, not a failure.
REFERENCE_STRICTER_OPS = {"LayerNormalization", "GroupNormalization", "ReduceMean",
                          "ReduceSum", "GlobalAveragePool", "ReduceL2", "ReduceSumSquare"}


def _reference_ops() -> list:
    """Spec-faithful replacements for ``onnx.reference`` ops that ignore a precision attribute:
    ``LayerNormalization`` with ``stash_type=1`` computes its mean and variance in FP32 and
    normalises there before casting back (ONNX Operators.md, LayerNormalization-17 function
    body); onnx 1.21's evaluator computes them in the input dtype (all zeros for FP16 inputs
    whose squared deviations exceed 65504)."""
    from onnx.reference.ops.op_layer_normalization import LayerNormalization, \
        _layer_normalization

    class LayerNormalizationStash(LayerNormalization):
        op_domain = ""

        def _run(self, X, Scale, B=None, axis=None, epsilon=None, stash_type=None):
            if stash_type in (None, 1) and X.dtype != np.float32:
                y, mean, inv = _layer_normalization(X.astype(np.float32), np.ones_like(
                    Scale, dtype=np.float32), None, axis=axis, epsilon=epsilon)
                y = y.astype(X.dtype) * Scale
                if B is not None:
                    y = y + B
                return y.astype(X.dtype), mean, inv
            return super()._run(X, Scale, B, axis=axis, epsilon=epsilon, stash_type=stash_type)

    LayerNormalizationStash.__name__ = "LayerNormalization"
    return [LayerNormalizationStash]


def fp16_true_arithmetic(fp16_path: Path | str, feed: dict[str, np.ndarray],
                         ref: dict[str, np.ndarray], min_cosine: float, *,
                         max_samples: int = 2, budget_s: float = 60.0) -> list[dict]:
    """Run the FP16 file with ``onnx.reference`` (the ONNX reference evaluator computes every op
    in the graph's dtypes, with :func:`_reference_ops` where it ignores ``stash_type``; unlike
    ORT's CPU EP, which inserts Casts and computes most FP16
    graphs in FP32) on up to ``max_samples`` samples, one at a time, within ``budget_s``
    seconds (measured: EfficientNet-Lite0 at 224 px takes about 7.5 s per sample on 2 CPU
    cores); compare with PyTorch and name the first node whose FP16 output is non-finite.

    Returns:
        one ``fp16_true_arithmetic`` row: ``fail`` for non-finite outputs or cosine below
        ``min_cosine``; ``warn`` when the first non-finite node is one the reference computes
        more strictly than the ONNX definition or GPU kernels (:data:`REFERENCE_STRICTER_OPS`);
        ``skip`` when the evaluator cannot run the graph.
    """
    import onnx
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(str(fp16_path))
    ins = [n for n, _, _ in onnx_graph.inputs(model)]
    one = {k: v[:1] for k, v in feed.items() if k in ins}
    try:  # estimate the evaluator's time from one ORT run (measured ratio, see the constant)
        run = ort_runner(fp16_path)
        run(one)
        t = time.time()
        run(one)
        estimate = (time.time() - t) * REFERENCE_SLOWDOWN
    except Exception:  # noqa: BLE001 - a file ORT cannot run is judged elsewhere
        estimate = 0.0
    if estimate > budget_s:
        return [result("fp16_true_arithmetic", "skip",
                       f"onnx.reference would take about {estimate:.0f} s per sample here "
                       f"(budget {budget_s:g} s): not run; the range audit judges FP16",
                       fix="raise --true-fp16-budget-s to run it")]
    try:
        ev = ReferenceEvaluator(model, new_ops=_reference_ops())
    except Exception as e:  # noqa: BLE001 - unsupported op, custom domain
        return [result("fp16_true_arithmetic", "skip",
                       f"onnx.reference cannot load the file ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:160]})")]
    nodes = list(model.graph.node)
    t0, done, problems, first_bad = time.time(), 0, [], None
    n = len(next(iter(feed.values())))
    for i in range(min(max_samples, n)):
        if i and time.time() - t0 > budget_s / 2:
            break
        one = {k: v[i:i + 1] for k, v in feed.items() if k in ins}
        try:
            with np.errstate(all="ignore"):
                inter = ev.run(None, one, intermediate=True)
        except Exception as e:  # noqa: BLE001
            return [result("fp16_true_arithmetic", "skip",
                           f"onnx.reference failed on the file ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:160]})")]
        done += 1
        outs = {o.name: inter[o.name] for o in model.graph.output}
        problems += _compare({k: v[i:i + 1] for k, v in ref.items()}, outs, min_cosine)
        if first_bad is None:
            for nd in nodes:
                vals = [inter.get(o) for o in nd.output if o]
                ins_ok = all(np.isfinite(np.asarray(inter[x], np.float64)).all()
                             for x in nd.input if x in inter and
                             np.issubdtype(np.asarray(inter[x]).dtype, np.floating))
                if ins_ok and any(v is not None and np.issubdtype(np.asarray(v).dtype,
                                                                  np.floating)
                                  and not np.isfinite(np.asarray(v, np.float64)).all()
                                  for v in vals):
                    first_bad = nd
                    break
    took = time.time() - t0
    if not done:
        return [result("fp16_true_arithmetic", "skip", "no sample ran within the time budget")]
    base = f"onnx.reference (true FP16 arithmetic) on {done} sample(s), {took:.1f} s"
    if not problems:
        return [result("fp16_true_arithmetic", "pass", f"{base}: matches PyTorch "
                       f"(cosine >= {min_cosine})", seconds=took, n_samples=done)]
    node = _with_source(first_bad) if first_bad is not None else None
    lenient = first_bad is not None and first_bad.op_type in REFERENCE_STRICTER_OPS
    where = (f"; first non-finite output: {node_label(first_bad)} ({first_bad.op_type})"
             if node else "")
    note = (f"; {first_bad.op_type} is computed in FP16 by onnx.reference but with FP32 "
            "statistics/accumulation by its ONNX definition (stash_type) or by GPU kernels"
            if lenient else "")
    keep = ([k for k in keep_fp32_nodes(model, [o for o in first_bad.output if o])
             if not any(c in k for c in _CAST_SUFFIXES)] if first_bad is not None else [])
    return [result("fp16_true_arithmetic", "warn" if lenient else "fail",
                   f"{base}: {problems[0]}{where}{note}", node=node,
                   fix=(f"keep {', '.join(keep)} in FP32: --fp16-keep-fp32 {','.join(keep)}"
                        if keep else None),
                   seconds=took, n_samples=done, keep_fp32=keep)]


def fp16_backends(fp16_path: Path | str, feed: dict[str, np.ndarray],
                  ref: dict[str, np.ndarray], min_cosine: float) -> list[dict]:
    """Run the FP16 file where FP16 is computed in FP16: ONNX Runtime's CUDA EP and TensorRT
    (via Polygraphy), when present; parity with PyTorch. Without them a ``skip`` row says that
    ORT's CPU EP computed the FP16 graph in FP32."""
    import onnxruntime as ort

    import layerwise

    out = []
    if "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            with runners.OrtRunner(fp16_path, "cuda") as r:
                got = r.infer({k: v for k, v in feed.items() if k in r.input_names})
            p = _compare(ref, got, min_cosine)
            out.append(result("fp16_backends", "fail" if p else "pass",
                              "ORT CUDA EP: " + ("; ".join(p) or f"matches PyTorch (cosine >= "
                                                 f"{min_cosine})"), backend="ort-cuda"))
        except StageError as e:
            out.append(result("fp16_backends", "skip", f"ORT CUDA EP unusable: {e}"))
    ok, info = layerwise.trt_available()
    if ok:
        try:
            got = layerwise._collect(layerwise.trt_activations(
                fp16_path, feed, build={"fp16": True}, mark_all=False))
            p = _compare(ref, got, min_cosine)
            out.append(result("fp16_backends", "fail" if p else "pass",
                              f"TensorRT {info}: " + ("; ".join(p) or "matches PyTorch"),
                              backend="tensorrt"))
        except StageError as e:
            out.append(result("fp16_backends", "warn", f"TensorRT {info} failed: {e}"))
    if not out:
        out.append(result("fp16_backends", "skip",
                          "no CUDA EP or TensorRT here: ORT's CPU EP computed this FP16 graph in "
                          "FP32 (it inserts Casts around ops without FP16 kernels), so its "
                          "parity cannot see FP16 overflow; the range audit and onnx.reference "
                          "judge FP16 instead", computed_in="FP32 (ORT CPU EP)"))
    return out


def fp16_checks(fp32_model, fp16_path: Path | str, feed: dict[str, np.ndarray],
                ref: dict[str, np.ndarray] | None, min_cosine: float, *,
                converter_warnings: Sequence[dict] = (), real_inputs: bool = True,
                keep_fp32: Sequence[str] = (), batch: int | None = 8,
                true_fp16_budget_s: float = 60.0, trained: bool = True) -> list[dict]:
    """All FP16 checks of one FP16 file: lint, converter changes, range audit, true FP16
    arithmetic (when ``ref`` is given) and the GPU backends.

    Args:
        fp32_model: the FP32 ModelProto the FP16 file was converted from.
        ref: PyTorch (or FP32) outputs for ``feed`` (None skips the runtime comparisons).
        true_fp16_budget_s: seconds for :func:`fp16_true_arithmetic` (0 skips it).
        trained: False for random weights (``--random-init``): value ranges are not the trained
            model's, so range verdicts (``fp16_range``, ``fp16_constants``,
            ``fp16_true_arithmetic``) become warnings.
    """
    m16 = onnx_graph.load(fp16_path)
    out = [r for r in lint(m16) if r["status"] != "skip"]
    out += fp16_converter_changes(fp32_model, m16, converter_warnings)
    out += fp16_range_audit(fp32_model, feed, m16, batch=batch, real_inputs=real_inputs,
                            keep_fp32=keep_fp32)
    if ref is not None:
        if true_fp16_budget_s > 0:
            names = {n.name for n in fp32_model.graph.node}
            for r in fp16_true_arithmetic(fp16_path, feed, ref, min_cosine,
                                          budget_s=true_fp16_budget_s):
                r["keep_fp32"] = [k for k in r.get("keep_fp32", []) if k in names]
                out.append(r)
        out += fp16_backends(fp16_path, feed, ref, min_cosine)
    if not trained:  # one warning per range check instead of a verdict per tensor
        kept, seen = [], {}
        for r in out:
            if r["status"] != "fail" or r["check"] not in RANGE_CHECKS:
                kept.append(r)
                continue
            seen.setdefault(r["check"], []).append(r)
        for check, rows in seen.items():
            named = [r["node"] for r in rows if r.get("node")][:3]
            kept.append(result(check, "warn",
                               f"random weights (--random-init): value ranges are not the "
                               f"trained model's, not judged; {len(rows)} finding(s) on these "
                               f"weights, e.g. {rows[0]['detail'][:160]}",
                               node=", ".join(named) or None, findings=rows))
        out = kept
    return out


#: FP16 checks whose verdict depends on the weights' value ranges.
# Checks whose verdict depends on the trained weights' value ranges: with random weights a
# real-FP16 backend underflows ~1e-9 logits as surely as onnx.reference does (seen on the H200's
# CUDA EP with a random-init MobileNetV3-Small), so they warn instead of failing.
RANGE_CHECKS = ("fp16_range", "fp16_constants", "fp16_true_arithmetic", "fp16_backends")


def keep_list(results: Iterable[dict], already: Sequence[str] = ()) -> list[str]:
    """Nodes the failing FP16 results ask to keep in FP32, added to ``already``, in order."""
    keep = list(already)
    for r in results:
        if r["status"] == "fail":
            keep += [k for k in r.get("keep_fp32", []) if k not in keep]
    return keep


# --------------------------------------------------------------------------------------------
# Composition: every export check of one file against PyTorch
# --------------------------------------------------------------------------------------------
def random_feed(template: dict[str, np.ndarray], batch: int, seed: int) -> dict[str, np.ndarray]:
    """Random feed like ``template`` with the batch axis set to ``batch`` (every row distinct):
    floats ~ N(mean, std) of the template, integers in its range, booleans uniform."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in template.items():
        shape = (batch,) + tuple(v.shape[1:])
        if np.issubdtype(v.dtype, np.floating):
            mu, sd = float(v.mean()), float(v.std()) or 1.0
            out[k] = (rng.standard_normal(shape) * sd + mu).astype(v.dtype)
        elif v.dtype == np.bool_:
            out[k] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            lo, hi = int(v.min()), int(v.max()) + 1
            out[k] = rng.integers(lo, max(hi, lo + 1), size=shape).astype(v.dtype)
    return out


def other_paths(feed: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """An input like ``feed`` that takes other data-dependent paths: booleans inverted (another
    mask selects other rows), integers shifted by one inside their range (another index),
    floats drawn anew (another argmax row, another branch).

    Returns:
        ``{name: array}`` with the shapes and dtypes of ``feed``.
    """
    rnd = random_feed(feed, len(next(iter(feed.values()))), seed)
    out = {}
    for k, v in feed.items():
        if v.dtype == np.bool_:
            out[k] = ~v
        elif np.issubdtype(v.dtype, np.integer) and v.size:
            lo, hi = int(v.min()), int(v.max())
            span = max(hi - lo + 1, 2)
            out[k] = (lo + (v.astype(np.int64) - lo + 1) % span).astype(v.dtype)
        else:
            out[k] = rnd[k]
    return out


def torch_runner(model) -> Callable[[dict], dict]:
    """``feed -> {output_i: array}`` running the PyTorch ``model`` (CPU, inference mode,
    :class:`runners.TorchRunner`); the inputs are passed positionally in the feed's order."""
    def run(feed):
        return runners.TorchRunner(model, "cpu", output_names=(),
                                   input_names=list(feed)).infer(feed)
    return run


def ort_runner(path: Path | str, ep: str = "cpu") -> Callable[[dict], dict]:
    """``feed -> outputs`` of the file on ONNX Runtime; inputs the file lacks are left out and
    float inputs are cast to the dtype the file declares."""
    import onnxruntime as ort

    r = runners.OrtRunner(path, ep=ep)
    types = {i.name: i.type for i in r.session.get_inputs()}
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a failing run is reported by the check, not ORT's logger

    def run(feed):
        f = {}
        for k, v in feed.items():
            if k in types:
                f[k] = v.astype(np.float16) if types[k] == "tensor(float16)" and \
                    v.dtype == np.float32 else v
        return dict(zip(r.output_names, r.session.run(None, f, quiet)))
    return run


def check_export(model, onnx_path: Path | str, feed: dict[str, np.ndarray], *,
                 min_cosine: float = 0.99999, batches: Sequence[int] | None = None,
                 declared: dict[str, Sequence[int]] | None = None,
                 example_batch: int | None = None, exporter_warnings: Sequence[dict] | None = None,
                 allow_tracer: bool = False, second_feed: dict[str, np.ndarray] | None = None,
                 input_paths: bool = True, seed: int = 0, ref_cache: dict | None = None
                 ) -> list[dict]:
    """Every export check of ``onnx_path`` against the PyTorch ``model``.

    Args:
        model: the exported ``torch.nn.Module`` (eval, CPU).
        feed: ``{model input name: array}`` in ``forward`` order, batch on axis 0 (>= 2 rows
            for the batch checks); real data where there is some.
        batches: batch sizes to compare (default: 1 and ``len(feed)``; a file with a static
            batch and no ``declared`` axes is compared at that batch only).
        declared: dynamic axes declared at export (None: a file of unknown origin).
        example_batch: the export's example batch (stage 2: 3).
        exporter_warnings: captured exporter warnings (stage 2), see :func:`capture_warnings`.
        second_feed: another input for ``input_paths`` (default: :func:`other_paths`).
        input_paths: False skips ``input_paths`` (stage 2 on real images: they already take
            whatever data-dependent paths the model has).
        ref_cache: dict reused across calls for the PyTorch outputs (stage 2 checks two files).
    Returns:
        the results of every check (lint included).
    Raises:
        StageError: the file cannot be loaded.
    """
    onnx_model = onnx_graph.load(onnx_path)
    # A file of unknown origin with a static batch runs at that batch only; a file whose batch
    # was declared dynamic (stage 2) is run at batch 1 and N whatever the graph says.
    static = onnx_graph.static_batch(onnx_model) if declared is None else None
    n = len(next(iter(feed.values())))
    if static is not None:
        sizes = [static]
    else:
        sizes = sorted(set(batches or (1, max(n, 2))))
    torch_run = torch_runner(model)
    ref_cache = {} if ref_cache is None else ref_cache

    def feed_for(b: int, s: int = 0) -> dict:
        if s == 0 and b <= n:
            return {k: v[:b] for k, v in feed.items()}
        return random_feed(feed, b, seed + 1000 * s + b)

    def ref_for(key, f):
        if key not in ref_cache:
            ref_cache[key] = torch_run(f)
        return ref_cache[key]

    lint_res = lint(onnx_model, example_batch=example_batch, against_torch=True)
    out = [r for r in lint_res if r["status"] != "skip"]
    dyn = check_dynamic_axes(onnx_model, declared, example_batch, list(feed))
    out += dyn
    lint_res = lint_res + dyn  # a frozen input axis explains a run that fails at other batches
    if exporter_warnings is not None:
        ew = check_exporter_warnings(exporter_warnings, allow_tracer)
        out += ew
        lint_res = lint_res + ew  # an exporter warning can explain a parity failure
    out += check_data_dependent_ops(onnx_model)
    unused = check_unused_inputs(onnx_model, list(feed))
    out += unused
    try:
        run = ort_runner(onnx_path)
    except StageError as e:
        return out + [result("batch_parity", "fail", f"onnxruntime cannot load the file: {e}")]
    feeds, refs = {}, {}
    for b in sizes:
        feeds[b] = feed_for(b)
        try:
            refs[b] = ref_for(("b", b), feeds[b])
        except Exception as e:  # noqa: BLE001 - the model itself rejects this batch
            out.append(result("batch_parity", "warn", f"PyTorch itself fails at batch {b} "
                              f"({str(e).splitlines()[0][:160]}); not compared"))
            feeds.pop(b)
    out += check_batch_parity(refs, feeds, run, min_cosine, lint_res)
    out += check_batch_independence(refs)
    if not input_paths:
        return out + [result("input_paths", "skip", f"{n} real samples exercise the model's "
                             "data-dependent paths (batch_parity)")]
    b = max(feeds) if feeds else sizes[-1]
    second = second_feed if second_feed is not None else other_paths(
        feeds.get(b) or feed_for(b), seed + 1)
    second = {k: v[:b] for k, v in second.items()}
    try:
        pairs = [(feeds[b], refs[b]), (second, ref_for(("s", b), second))] if feeds else []
    except Exception:  # noqa: BLE001
        pairs = []
    out += check_input_paths(pairs, run, min_cosine, unused[0].get("unused", []))
    return out


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _print_results(results: Sequence[dict], show_pass: bool = True) -> None:
    for r in results:
        if show_pass or r["status"] in ("fail", "warn"):
            print(format_result(r))


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__, prog="export_checks.py")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add_inputs(sp, n_default: int):
        sp.add_argument("--inputs", type=Path, help=".npz of inputs keyed by input name (real "
                        "data: the user's samples)")
        sp.add_argument("--model", help="the PyTorch model (mobilenet_v3_small, "
                        "efficientnet_lite0, a torchvision name or package.module:factory); its "
                        "eval images feed image classifiers")
        sp.add_argument("--n", type=int, default=n_default, help="samples")
        common.add_shared_args(sp, "input_shape")

    s = sub.add_parser("lint", help="graph-only checks of any ONNX file (exit 1 on a warning "
                       "or error)", formatter_class=common.HelpFormatter)
    s.add_argument("onnx", type=Path, help="ONNX file")
    s.add_argument("--example-batch", type=int, default=None,
                   help="batch the file was exported with, if known (flags shape constants "
                        "holding it)")
    s.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    s.add_argument("--all", action="store_true", help="also print passing and skipped checks")

    s = sub.add_parser("check", help="export checks against the PyTorch model (batch sizes, "
                       "frozen values, data-dependent paths, lint)",
                       formatter_class=common.HelpFormatter)
    s.add_argument("--onnx", type=Path, required=True, help="exported ONNX file")
    s.add_argument("--weights", type=Path, default=None, help="state dict for --model")
    s.add_argument("--batches", default=None,
                   help="batch sizes to compare, e.g. 1,3 (default: 1 and --n; a static batch "
                        "is used as it is)")
    s.add_argument("--min-cosine", type=float, default=0.99999,
                   help="lowest cosine similarity per sample against PyTorch")
    s.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    add_inputs(s, 4)

    s = sub.add_parser("fp16-audit", help="FP16 range audit of every tensor on real inputs "
                       "(overflow above 65504, mass below 6.1e-5)",
                       formatter_class=common.HelpFormatter)
    s.add_argument("onnx", type=Path, help="FP32 ONNX file (the activations come from it)")
    s.add_argument("--fp16", type=Path, default=None,
                   help="the FP16 file made from it: only tensors it holds in FP16 are judged")
    s.add_argument("--batch", type=int, default=8, help="samples per run (a static batch wins)")
    s.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    add_inputs(s, 32)

    s = sub.add_parser("fp16", help="convert an FP32 file to FP16 (FP32 I/O), keep named nodes "
                       "in FP32, check it; the file stage 6 builds as variant fp16",
                       formatter_class=common.HelpFormatter)
    s.add_argument("onnx", type=Path, help="FP32 ONNX file")
    s.add_argument("-o", "--output", type=Path, required=True,
                   help="FP16 file to write (artifacts/<model>/onnx/fp16.onnx for the pipeline)")
    s.add_argument("--keep-fp32", action="append", default=None, metavar="NODE[,NODE]",
                   help="nodes to compute in FP32 (repeatable, comma-separated)")
    s.add_argument("--min-cosine", type=float, default=0.999,
                   help="lowest cosine similarity per sample against the FP32 file")
    s.add_argument("--batch", type=int, default=8, help="samples per run (a static batch wins)")
    add_inputs(s, 16)
    return p


def _feed(args, onnx_path: Path) -> tuple[dict[str, np.ndarray], bool]:
    """``(feed, real)`` from --inputs / --model / --input-shape (``real``: not synthetic)."""
    import layerwise

    spec = common.model_spec(args.model) if args.model else None
    use_images = bool(args.model and spec.classifier and not args.inputs and not args.input_shape)
    feed = layerwise.load_feed(args.inputs, args.model if use_images else None, args.n,
                               onnx_path, args.input_shape)
    return feed, bool(args.inputs or use_images)


def _split_names(items: Sequence[str]) -> list[str]:
    return [x.strip() for it in items or [] for x in it.split(",") if x.strip()]


def cmd_fp16(args) -> list[dict]:
    """``export_checks.py fp16``: convert, check, install only when every check passes."""
    import onnx

    keep = _split_names(args.keep_fp32)
    m32 = onnx_graph.load(args.onnx)
    feed, real = _feed(args, args.onnx)
    ref = runners.OrtRunner(args.onnx).infer({k: v for k, v in feed.items()
                                             if k in {n for n, _, _ in onnx_graph.inputs(m32)}})
    m16, warn = convert_fp16(m32, keep)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".fp16-") as tmp:
        cand = Path(tmp) / out_path.name
        onnx.save(m16, str(cand))
        onnx.checker.check_model(str(cand))
        res = fp16_checks(m32, cand, feed, ref, args.min_cosine, converter_warnings=warn,
                          real_inputs=real, keep_fp32=keep, batch=args.batch)
        par = _compare(ref, ort_runner(cand)(feed), args.min_cosine)
        res.append(result("fp16_ort_cpu_parity", "fail" if par else "pass",
                          "; ".join(par) or f"matches the FP32 file on ORT CPU (cosine >= "
                          f"{args.min_cosine}; computed in FP32 there)"))
        _print_results(res, show_pass=False)
        if worst(res) == "fail":
            install_rejected(cand, out_path, res)
            more = keep_list(res, keep)
            hint = (f"; rerun with --keep-fp32 {','.join(more)}" if more != keep else "")
            raise StageError(f"{out_path.name} failed its FP16 checks: kept as "
                             f"{rejected_path(out_path)}{hint}")
        install(cand, out_path)
    print(f"wrote {out_path} (FP16, FP32 inputs/outputs, {len(keep)} node(s) kept in FP32)")
    return res


def rejected_path(path: Path) -> Path:
    """``fp32.onnx`` -> ``fp32.rejected.onnx`` (where a file that failed its checks is kept)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.rejected{path.suffix}")


def install(candidate: Path, final: Path) -> None:
    """Move a checked ``candidate`` to its final name (atomic rename) and drop a stale
    ``.rejected`` copy and its reason."""
    os.replace(candidate, final)
    for p in (rejected_path(final), rejected_path(final).with_suffix(".json")):
        p.unlink(missing_ok=True)


def install_rejected(candidate: Path, final: Path, results: Sequence[dict]) -> Path:
    """Keep a failed ``candidate`` as ``<name>.rejected.onnx`` with ``<name>.rejected.json``
    (the failing results), never under ``final``; an earlier good ``final`` stays."""
    rej = rejected_path(final)
    os.replace(candidate, rej)
    common.write_json(rej.with_suffix(".json"),
                      {"file": str(rej), "final_name": str(final),
                       "reason": [r for r in results if r["status"] == "fail"],
                       "warnings": [r for r in results if r["status"] == "warn"]})
    return rej


def main(args) -> list[dict]:
    if args.cmd == "lint":
        res = lint(args.onnx, example_batch=args.example_batch)
        _print_results(res, show_pass=args.all)
        if args.json:
            common.write_json(args.json, {"onnx": str(args.onnx), "results": res})
        bad = [r for r in res if r["status"] in ("fail", "warn")]
        print(f"{args.onnx}: {sum(r['status'] == 'fail' for r in bad)} error(s), "
              f"{sum(r['status'] == 'warn' for r in bad)} warning(s)")
        if bad:
            raise StageError(f"lint found {len(bad)} problem(s) in {args.onnx}")
        return res
    if args.cmd == "fp16":
        common.check_positive(args, "n", "batch")
        return cmd_fp16(args)
    if args.cmd == "fp16-audit":
        common.check_positive(args, "n", "batch")
        feed, real = _feed(args, args.onnx)
        res = fp16_range_audit(args.onnx, feed, args.fp16, batch=args.batch, real_inputs=real)
        _print_results(res)
        if args.json:
            common.write_json(args.json, {"onnx": str(args.onnx), "results": res})
        if worst(res) == "fail":
            raise StageError("tensors outside the FP16 range: keep the named nodes in FP32")
        return res
    # check
    if not args.model:
        raise UsageError("check needs --model NAME (the PyTorch model that was exported)")
    common.check_positive(args, "n")
    if not 0 < args.min_cosine <= 1:
        raise UsageError(f"--min-cosine {args.min_cosine}: must be in (0, 1]")
    batches = None
    if args.batches:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError as e:
            raise UsageError(f"--batches {args.batches!r}: {e}") from e
        if any(b < 1 for b in batches):
            raise UsageError(f"--batches {args.batches!r}: sizes must be >= 1")
    model, spec = common.build_model(args.model, args.weights)
    feed, _ = _feed(args, args.onnx)
    if len(next(iter(feed.values()))) < 2 and onnx_graph.static_batch(
            onnx_graph.load(args.onnx)) is None:
        feed = {k: np.concatenate([v, random_feed({k: v}, 1, 7)[k]]) for k, v in feed.items()}
    res = check_export(model, args.onnx, feed, min_cosine=args.min_cosine, batches=batches)
    _print_results(res)
    if args.json:
        common.write_json(args.json, {"onnx": str(args.onnx), "status": worst(res),
                                      "results": res})
    if worst(res) == "fail":
        raise StageError("export check failed: fix the export before comparing runtimes")
    return res


if __name__ == "__main__":
    common.cli(get_args_parser, main)
