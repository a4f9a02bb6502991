"""FP16: conversion (with nodes kept in FP32), the range audit on real data, true-FP16
arithmetic with ``onnx.reference`` (ORT's CPU EP computes FP16 graphs in FP32), real FP16
backends, and the verdict with the ``--keep-fp32`` remedy.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence
import numpy as np

from deploykit.checks.base import (
    check_result,
    inferred_model,
    node_label,
    output_problems,
    with_source,
)
from deploykit.checks.export import RANGE_CHECKS, capture_warnings, ort_runner
from deploykit.checks.lint import lint
from deploykit.errors import StageError, UsageError
from deploykit.feeds import feed_plan
from deploykit.numerics import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from deploykit.onnx.activations import (
    chunk_size,
    collect_outputs,
    iter_chunks,
    ort_activations,
    trt_activations,
    trt_available,
)
from deploykit.onnx.graph import (
    attr,
    constants,
    consumers,
    graph_inputs,
    load_onnx,
    producers,
    static_batch,
)
from deploykit.runners import OrtRunner


#: A tensor "loses most of its mass" in FP16 when more than this share of its L1 mass
#: (sum of |x|) sits in nonzero values below the smallest normal (subnormal or zero in FP16).
UNDERFLOW_MASS_SHARE = 0.5


#: A constant change by the FP16 converter matters when it moves an element by more than this
#: share of the tensor's largest magnitude (FP16 rounding itself moves at most 2^-11 = 4.9e-4).
CONSTANT_CHANGE_SHARE = 1e-3


#: Reductions whose running sum, not their output, can leave the FP16 range. ``mean``
#: (ReduceMean, GlobalAveragePool): the sum of the averaged values, |output| x count; kernels
#: that accumulate in FP32 (usual on GPUs) are safe, the reference evaluator is not: a warning.
#: ``l2`` (ReduceL2): the sum of squares, output^2; a sum of squares above 65504 returns inf on
#: ONNX Runtime's CUDA EP where its CPU EP returns the finite root (measured, see the project
#: notes): a failure.
ACCUMULATING_REDUCTIONS = {"ReduceMean": "mean", "GlobalAveragePool": "mean", "ReduceL2": "l2"}


# --------------------------------------------------------------------------------------------
# FP16: range audit, converter changes, true FP16 arithmetic, GPU backends
# --------------------------------------------------------------------------------------------
def fp16_held_tensors(fp16_model) -> set[str]:
    """Tensor names of the FP32 graph that an FP16 graph (onnxconverter-common, names kept)
    holds in FP16: FP16-typed tensors, tensors cast to FP16, and graph outputs cast back to FP32
    from an FP16 tensor (``keep_io_types``)."""
    from onnx import TensorProto

    m = inferred_model(fp16_model)
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
        to = int(attr(n, "to", 0))
        if to == TensorProto.FLOAT16:
            held.add(n.input[0])
        elif to == TensorProto.FLOAT and types.get(n.input[0]) == TensorProto.FLOAT16:
            held.add(n.output[0])
    return held


def keep_fp32_nodes(model, tensors: Iterable[str]) -> list[str]:
    """Nodes to keep in FP32 so that ``tensors`` never exist in FP16: each tensor's producer and
    all its consumers (onnxconverter-common casts a blocked node's output back to FP16 for any
    consumer that is not blocked, which would overflow the same values)."""
    prod, cons = producers(model), consumers(model)
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

    m32 = load_onnx(fp32_model) if isinstance(fp32_model, (str, Path)) else fp32_model
    held = None
    if fp16_model is not None:
        m16 = load_onnx(fp16_model) if isinstance(fp16_model, (str, Path)) else fp16_model
        held = fp16_held_tensors(m16)
    feed, batch = feed_plan(feed, [m32], batch)
    print(f"FP16 range audit: every tensor of the FP32 graph on "
          f"{len(next(iter(feed.values())))} sample(s), {batch} per ORT run", file=sys.stderr,
          flush=True)
    prod = producers(m32)
    # Reductions computed in FP16 (their input is held in FP16).
    reds = {n.output[0]: n for n in m32.graph.node if n.op_type in ACCUMULATING_REDUCTIONS
            and (held is None or n.input[0] in held)}
    stats: dict[str, RangeStat] = {}
    acc: dict[str, float] = {}
    # the FP32 graph's float ops at ORT's default level (reordered sums; its optimised graph is
    # checked node by node: deploykit.quant.reference): 64 Lite0 samples 1.0 s against 2.1-2.5 s
    # unoptimised (benchmarks/README.md, stop 45)
    # each tensor's statistics on one of two threads (NumPy releases the GIL; each RangeStat is
    # updated by one task at a time, chunk after chunk: the same figures as one after the other)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for acts, _ in ort_activations(m32, feed, batch=batch, opt_level="reference"):
            floats = [(name, a) for name, a in acts.items()
                      if np.issubdtype(np.asarray(a).dtype, np.floating)]
            for name, _ in floats:
                stats.setdefault(name, RangeStat())
            list(pool.map(lambda item: stats[item[0]].update(item[1]), floats))
            for name, a in floats:
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
            out.append(check_result("fp16_range", "fail",
                                    f"tensor {name} made by {made_by} reaches max |x| {st.amax:.6g} > "
                                    f"{FP16_MAX:g}: inf in FP16", node=node_label(node) if node else
                                    name, fix=fix, tensor=name, max_abs=st.amax, keep_fp32=keep))
        elif st.l1 > 0 and st.l1_small / st.l1 > UNDERFLOW_MASS_SHARE:
            out.append(check_result("fp16_range", "fail",
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
                out.append(check_result("fp16_range", "fail",
                                        f"{made_by}: its sum of squares reaches ~{acc[name]:.6g} > "
                                        f"{FP16_MAX:g} although the root ({st.amax:.4g}) fits: inf in "
                                        "FP16 (as on ONNX Runtime's CUDA EP)", node=node_label(red),
                                        fix=fix, tensor=name, running_sum=acc[name], keep_fp32=keep))
            else:
                out.append(check_result("fp16_range", "warn",
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
    summary = check_result(
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
    if keep_fp32:
        model = _private_fp32_constants(model, keep_fp32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m16 = float16.convert_float_to_float16(
            model, keep_io_types=True, node_block_list=list(keep_fp32) or None,
            max_finite_val=FP16_MAX, min_positive_val=FP16_MIN_SUBNORMAL)
    _repair_converted(model, m16, keep_fp32)
    return m16, capture_warnings(caught)


def _repair_converted(m32, m16, keep_fp32: Sequence[str] = ()) -> None:
    """Repair, in place, two invalid graphs onnxconverter-common 1.16 writes with
    ``keep_io_types=True`` (ONNX Runtime refuses to load them with a type error):

    - a graph output that another node also reads (``forward()`` returning a feature and the
      logits made from it): the converter casts the output back to float32 under its name, and
      the converted reader then gets float32 beside float16 inputs ("Type parameter (T) of
      Optype (Gemm) bound to different types"); the reader is given the FP16 tensor instead;
    - a ``Cast(to=FLOAT)`` of the model (``x.float()`` of a uint8/int image input): the
      converter declares its output float16 but leaves ``to=FLOAT`` ("Type (tensor(float16)) of
      output arg ... does not match expected type (tensor(float))"); it casts to float16 now
      (integers beyond 65504 then overflow, which the range audit names).

    Nodes in ``keep_fp32`` and the converter's default op block list stay as they are.
    """
    from onnx import TensorProto
    from onnxconverter_common.float16 import DEFAULT_OP_BLOCK_LIST

    own = {n.name for n in m32.graph.node if n.name}
    fixed = set(keep_fp32) | {n.name for n in m16.graph.node
                              if n.op_type in DEFAULT_OP_BLOCK_LIST}
    outs = {o.name for o in m16.graph.output}
    back = {n.output[0]: n.input[0] for n in m16.graph.node
            if n.op_type == "Cast" and n.name not in own and n.output and n.output[0] in outs
            and int(attr(n, "to", 0)) == TensorProto.FLOAT}
    f16 = {vi.name for vi in m16.graph.value_info
           if vi.type.tensor_type.elem_type == TensorProto.FLOAT16}
    for n in m16.graph.node:
        if n.name not in own or n.name in fixed:
            continue
        for i, t in enumerate(n.input):
            if t in back:
                n.input[i] = back[t]
        if n.op_type == "Cast" and int(attr(n, "to", 0)) == TensorProto.FLOAT and \
                n.output[0] in f16 | set(back.values()):
            for a in n.attribute:
                if a.name == "to":
                    a.i = TensorProto.FLOAT16


def _private_fp32_constants(model, keep_fp32: Sequence[str]):
    """Copy of ``model`` in which every node of ``keep_fp32`` reads its float32 constants
    (initializers and Constant-node outputs) from initializers of its own, which no other node
    reads and no value_info lists; constants left without readers are removed.

    Why: onnxconverter-common 1.16's ``node_block_list`` keeps the node in FP32 but not always
    its constants. An initializer listed in value_info (the dynamo exporter lists them) and a
    Constant node's output are converted to FP16, clamped, and cast back before the node
    (``insert_cast32_before_node`` runs before ``process_initializers``); an initializer shared
    with a node that is converted stays float32 and makes that node's inputs mixed-type, an
    invalid model (onnxconverter-common PR #329, open). An initializer only block-listed nodes
    read and no value_info names is the one case the converter leaves alone.
    """
    import onnx
    from onnx import numpy_helper

    keep = set(keep_fp32)
    consts = constants(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    taken = {t for n in m.graph.node for t in list(n.input) + list(n.output)}
    taken |= {i.name for i in m.graph.initializer}
    private: dict[str, str] = {}
    for n in m.graph.node:
        if n.name not in keep:
            continue
        for i, name in enumerate(n.input):
            arr = consts.get(name)
            if arr is None or arr.dtype != np.float32:
                continue
            if name not in private:
                new, k = f"{name}_fp32", 1
                while new in taken:
                    new, k = f"{name}_fp32_{k}", k + 1
                taken.add(new)
                m.graph.initializer.append(numpy_helper.from_array(arr, new))
                private[name] = new
            n.input[i] = private[name]
    read = {t for n in m.graph.node for t in n.input} | {o.name for o in m.graph.output}
    unused = [t for t in private if t not in read]
    for t in unused:
        inits = [x for x in m.graph.initializer if x.name == t]
        for x in inits:
            m.graph.initializer.remove(x)
        for n in [n for n in m.graph.node if n.op_type == "Constant" and list(n.output) == [t]]:
            m.graph.node.remove(n)
        for vi in [v for v in m.graph.value_info if v.name == t]:
            m.graph.value_info.remove(vi)
        for gi in [v for v in m.graph.input if v.name == t]:  # IR < 4 lists initializers
            m.graph.input.remove(gi)
    return m


def fp16_converter_changes(fp32_model, fp16_model, converter_warnings: Sequence[dict] = (),
                           keep_fp32: Sequence[str] = ()) -> list[dict]:
    """Constants the FP16 converter changed beyond FP16 rounding (clamped to its limits),
    named with the nodes that read them (``keep_fp32``: nodes already kept in FP32, which
    :func:`convert_fp16` gives FP32 copies, are not named); ``fail`` when an element moved by
    more than :data:`CONSTANT_CHANGE_SHARE` of the tensor's largest magnitude (a clamp of 20000
    to 10000), else listed in the closing summary row (``summary: True``; tiny weights raised to
    the smallest subnormal)."""
    c32, c16 = constants(fp32_model), constants(fp16_model)
    cons = consumers(fp32_model)
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
        users = [c for c in cons.get(name, []) if c.name not in set(keep_fp32)]
        keep = [u.name for u in users if u.name]
        i = int(np.flatnonzero(changed.ravel())[np.argmax(np.abs(
            y.astype(np.float64) - x.astype(np.float64)).ravel()[changed.ravel()])])
        ex = f"{float(x.ravel()[i]):.6g} -> {float(y.ravel()[i]):.6g}"
        if delta > CONSTANT_CHANGE_SHARE * scale:
            out.append(check_result(
                "fp16_constants", "fail",
                f"the FP16 converter changed {int(changed.sum())} value(s) of constant {name} "
                f"(e.g. {ex}): it is outside what FP16 holds", node=", ".join(keep[:3]) or name,
                fix=(f"keep {', '.join(keep)} in FP32: --fp16-keep-fp32 {','.join(keep)}"
                     if keep else "rescale the constant into the FP16 range"),
                constant=name, n_changed=int(changed.sum()), example=ex, keep_fp32=keep))
        else:
            minor.append(f"{name} ({int(changed.sum())}, e.g. {ex})")
    detail = (f"{len(out)} constant(s) changed beyond FP16 rounding (above)" if out else
              "no constant changed beyond FP16 rounding")
    if minor:
        detail += (f"; {len(minor)} constants had elements below FP16's smallest subnormal "
                   f"raised to {FP16_MIN_SUBNORMAL:.3g}, below {CONSTANT_CHANGE_SHARE:g} of their "
                   f"tensor's largest value: {'; '.join(minor[:5])}")
    return out + [check_result("fp16_constants", "fail" if out else "pass", detail, summary=True,
                               changed_minor=minor, converter_warnings=list(converter_warnings))]


#: onnx.reference time per sample / ONNX Runtime CPU time per sample of the same FP16 file,
#: with :func:`_reference_ops`: measured 121 on EfficientNet-Lite0 (0.99 s vs 8.2 ms per 224 px
#: image) and 34 on ResNet-18 (0.68 s vs 20 ms), 2-core AMD EPYC with AVX512-VNNI, onnx 1.21 /
#: onnxruntime 1.32, 2026-12-04; rounded up (an estimate above the budget skips the run).
REFERENCE_SLOWDOWN = 150.0


class _OutOfTime(Exception):
    """Raised between two nodes of an ``onnx.reference`` run past its deadline."""


def _deadline_evaluator(model, new_ops, deadline: float):
    """An ``onnx.reference.ReferenceEvaluator`` of ``model`` that stops between two nodes once
    ``time.time()`` passes ``deadline`` (:class:`_OutOfTime`): its run loop calls ``_log(1, ...)``
    before every node (its verbose hook), which checks the clock first. So the true-FP16 check's
    budget bounds a run that the ORT-based estimate underrates (ops onnx.reference computes in
    Python, e.g. Resize), to within one node."""
    from onnx.reference import ReferenceEvaluator

    class Evaluator(ReferenceEvaluator):
        def _log(self, level, pattern, *args):
            if level == 1 and time.time() > deadline:
                raise _OutOfTime
            return super()._log(level, pattern, *args)

    return Evaluator(model, new_ops=new_ops)


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
    whose squared deviations exceed 65504). And faster, same-arithmetic ``Conv`` / ``MatMul``
    for float16 operands (float32 products rounded once to float16, as numpy's float16 matmul
    that the evaluator uses)."""
    from onnx.reference.ops.op_layer_normalization import LayerNormalization, \
        _layer_normalization
    from onnx.reference.ops.op_matmul import MatMul
    from onnx.reference.ops_optimized.op_conv_optimized import Conv

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

    # Conv and MatMul on float16 tensors: numpy's float16 matmul accumulates in float32 and
    # rounds each output once (measured: 99.4 % of the outputs of a 64x4608 @ 4608x256 product
    # equal a float32 product rounded to float16, the rest differ by the summation order), but
    # with its own loops, about 60x slower than a float32 BLAS product. The same arithmetic:
    # float16 operands (exact in float32), a float32 product, one rounding to float16, then the
    # bias added in float16 as the evaluator does; a result above 65504 still becomes inf.
    class ConvHalf(Conv):
        op_domain = ""

        def _run(self, X, W, B=None, **attrs):
            if X.dtype != np.float16 or W.dtype != np.float16:
                return super()._run(X, W, B, **attrs)
            (y,) = super()._run(X.astype(np.float32), W.astype(np.float32), None, **attrs)
            with np.errstate(over="ignore"):
                y = y.astype(np.float16)
            if B is not None:
                shape = [1] * y.ndim
                shape[1] = -1
                y = y + B.astype(np.float16).reshape(shape) if B.size != 1 else y + B
            return (y.astype(X.dtype),)

    class MatMulHalf(MatMul):
        op_domain = ""

        def _run(self, a, b):
            if a.dtype != np.float16 or b.dtype != np.float16:
                return super()._run(a, b)
            with np.errstate(over="ignore"):
                return (np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(
                    np.float16),)

    ConvHalf.__name__, MatMulHalf.__name__ = "Conv", "MatMul"
    return [LayerNormalizationStash, ConvHalf, MatMulHalf]


def fp16_true_arithmetic(fp16_path: Path | str, feed: dict[str, np.ndarray],
                         ref: dict[str, np.ndarray], min_cosine: float, *,
                         max_samples: int = 2, budget_s: float = 60.0) -> list[dict]:
    """Run the FP16 file with ``onnx.reference`` (the ONNX reference evaluator computes every op
    in the graph's dtypes, with :func:`_reference_ops` where it ignores ``stash_type``; unlike
    ORT's CPU EP, which inserts Casts and computes most FP16
    graphs in FP32) on up to ``max_samples`` runs of one sample each (of the static batch B,
    B samples, for a file exported with one), within ``budget_s`` seconds (measured:
    EfficientNet-Lite0 at 224 px takes about 1 s per sample on 2 CPU cores,
    :data:`REFERENCE_SLOWDOWN`); compare with
    PyTorch and name the first node whose FP16 output is non-finite.

    Returns:
        one ``fp16_true_arithmetic`` row: ``fail`` for non-finite outputs or cosine below
        ``min_cosine``; ``warn`` when the first non-finite node is one the reference computes
        more strictly than the ONNX definition or GPU kernels (:data:`REFERENCE_STRICTER_OPS`);
        ``skip`` when the evaluator cannot run the graph.
    """
    import onnx

    model = onnx.load(str(fp16_path))
    ins = [n for n, _, _ in graph_inputs(model)]
    step = static_batch(model) or 1  # samples per run: a static batch is fed whole
    one = {k: v[:step] for k, v in feed.items() if k in ins}
    try:  # estimate the evaluator's time from one ORT run (measured ratio, see the constant)
        run = ort_runner(fp16_path)
        run(one)
        t = time.time()
        run(one)
        estimate = (time.time() - t) * REFERENCE_SLOWDOWN
    except Exception:  # noqa: BLE001 - a file ORT cannot run is judged elsewhere
        estimate = 0.0
    if estimate > budget_s:
        return [check_result("fp16_true_arithmetic", "skip",
                             f"onnx.reference would take about {estimate:.0f} s per sample here "
                             f"(budget {budget_s:g} s): not run; the range audit judges FP16",
                             fix="raise --true-fp16-budget-s to run it")]
    t0 = time.time()
    try:
        ev = _deadline_evaluator(model, _reference_ops(), t0 + budget_s)
    except Exception as e:  # noqa: BLE001 - unsupported op, custom domain
        return [check_result("fp16_true_arithmetic", "skip",
                             f"onnx.reference cannot load the file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]})")]
    nodes = list(model.graph.node)
    done, problems, first_bad, stopped = 0, [], None, False
    n = len(next(iter(feed.values()))) // step
    print(f"FP16 check: onnx.reference (true FP16 arithmetic) on up to {min(max_samples, n)} "
          f"run(s) of {step} sample(s), at most {budget_s:g} s in all (stopped between two "
          f"nodes at the budget; about {estimate:.0f} s a run by ORT's time, more for ops it "
          "computes in Python such as Resize; a second run only while under half the budget)",
          file=sys.stderr, flush=True)
    if not n:
        return [check_result("fp16_true_arithmetic", "skip",
                             f"the file takes exactly {step} samples per run (static batch); "
                             f"{len(next(iter(feed.values())))} given")]
    for i in range(min(max_samples, n)):
        if i and time.time() - t0 > budget_s / 2:
            break
        sl = slice(i * step, (i + 1) * step)
        one = {k: v[sl] for k, v in feed.items() if k in ins}
        try:
            with np.errstate(all="ignore"):
                inter = ev.run(None, one, intermediate=True)
        except _OutOfTime:
            stopped = True
            break
        except Exception as e:  # noqa: BLE001
            return [check_result("fp16_true_arithmetic", "skip",
                                 f"onnx.reference failed on the file ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:160]})")]
        done += step
        outs = {o.name: inter[o.name] for o in model.graph.output}
        problems += output_problems({k: v[sl] for k, v in ref.items()}, outs, min_cosine)
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
        return [check_result("fp16_true_arithmetic", "skip",
                             f"onnx.reference did not finish one run of {step} sample(s) within "
                             f"the {budget_s:g} s budget (stopped after {took:.0f} s): not "
                             "judged; the range audit judges FP16",
                             fix="raise --true-fp16-budget-s to run it")]
    base = (f"onnx.reference (true FP16 arithmetic) on {done} sample(s), {took:.1f} s"
            + (f" (a further run stopped at the {budget_s:g} s budget)" if stopped else ""))
    if not problems:
        return [check_result("fp16_true_arithmetic", "pass", f"{base}: matches PyTorch "
                             f"(cosine >= {min_cosine})", seconds=took, n_samples=done)]
    node = with_source(first_bad) if first_bad is not None else None
    lenient = first_bad is not None and first_bad.op_type in REFERENCE_STRICTER_OPS
    where = (f"; first non-finite output: {node_label(first_bad)} ({first_bad.op_type})"
             if node else "")
    note = (f"; {first_bad.op_type} is computed in FP16 by onnx.reference but with FP32 "
            "statistics/accumulation by its ONNX definition (stash_type) or by GPU kernels"
            if lenient else "")
    keep = ([k for k in keep_fp32_nodes(model, [o for o in first_bad.output if o])
             if not any(c in k for c in _CAST_SUFFIXES)] if first_bad is not None else [])
    return [check_result("fp16_true_arithmetic", "warn" if lenient else "fail",
                         f"{base}: {problems[0]}{where}{note}", node=node,
                         fix=(f"keep {', '.join(keep)} in FP32: --fp16-keep-fp32 {','.join(keep)}"
                              if keep else None),
                         seconds=took, n_samples=done, keep_fp32=keep)]


def fp16_backends(fp16_path: Path | str, feed: dict[str, np.ndarray],
                  ref: dict[str, np.ndarray], min_cosine: float,
                  batch: int | None = None) -> list[dict]:
    """Run the FP16 file where FP16 is computed in FP16: ONNX Runtime's CUDA EP and TensorRT
    (via Polygraphy), when present; parity with PyTorch. Without them a ``skip`` row says that
    ORT's CPU EP computed the FP16 graph in FP32. ``batch``: samples per run (a static batch
    wins, :func:`deploykit.onnx.activations.chunk_size`; None: all at once)."""
    import onnxruntime as ort


    out = []
    batch = chunk_size([fp16_path], batch)
    if "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            with OrtRunner(fp16_path, "cuda") as r:
                got = collect_outputs(
                    (r.infer({k: v for k, v in c.items() if k in r.input_names}), 0)
                    for c in iter_chunks(feed, batch))
            p = output_problems(ref, got, min_cosine)
            out.append(check_result("fp16_backends", "fail" if p else "pass",
                                    "ORT CUDA EP: " + ("; ".join(p) or f"matches PyTorch (cosine >= "
                                                       f"{min_cosine})"), backend="ort-cuda"))
        except StageError as e:
            out.append(check_result("fp16_backends", "skip", f"ORT CUDA EP unusable: {e}"))
    ok, info = trt_available()
    if ok:
        try:
            got = collect_outputs(trt_activations(
                fp16_path, feed, build={"fp16": True}, batch=batch, mark_all=False))
            p = output_problems(ref, got, min_cosine)
            out.append(check_result("fp16_backends", "fail" if p else "pass",
                                    f"TensorRT {info}: " + ("; ".join(p) or "matches PyTorch"),
                                    backend="tensorrt"))
        except StageError as e:
            out.append(check_result("fp16_backends", "warn", f"TensorRT {info} failed: {e}"))
    if not out:
        out.append(check_result("fp16_backends", "skip",
                                "no CUDA EP or TensorRT here: ORT's CPU EP computed this FP16 graph in "
                                "FP32 (it inserts Casts around ops without FP16 kernels), so its "
                                "parity cannot see FP16 overflow; the range audit and onnx.reference "
                                "judge FP16 instead", computed_in="FP32 (ORT CPU EP)"))
    return out


def fp16_checks(fp32_model, fp16_path: Path | str, feed: dict[str, np.ndarray],
                ref: dict[str, np.ndarray] | None, min_cosine: float, *,
                converter_warnings: Sequence[dict] = (), real_inputs: bool = True,
                keep_fp32: Sequence[str] = (), batch: int | None = 8,
                true_fp16_budget_s: float = 60.0, true_fp16_samples: int = 2,
                trained: bool = True) -> list[dict]:
    """All FP16 checks of one FP16 file: lint, converter changes, range audit, true FP16
    arithmetic (when ``ref`` is given) and the GPU backends.

    Args:
        fp32_model: the FP32 ModelProto the FP16 file was converted from.
        ref: PyTorch (or FP32) outputs for ``feed`` (None skips the runtime comparisons).
        true_fp16_budget_s: seconds for :func:`fp16_true_arithmetic` (0 skips it).
        true_fp16_samples: samples it runs at most (one at a time).
        trained: False for random weights (``--random-init``): value ranges are not the trained
            model's, so range verdicts (``fp16_range``, ``fp16_constants``,
            ``fp16_true_arithmetic``) become warnings. ``real_inputs`` False (synthetic samples)
            does the same: a check on synthetic inputs warns and says so, never refuses.
    """
    m16 = load_onnx(fp16_path)
    out = [r for r in lint(m16) if r["status"] != "skip"]
    out += fp16_converter_changes(fp32_model, m16, converter_warnings, keep_fp32)
    out += fp16_range_audit(fp32_model, feed, m16, batch=batch, real_inputs=real_inputs,
                            keep_fp32=keep_fp32)
    if ref is not None:
        if true_fp16_budget_s > 0:
            names = {n.name for n in fp32_model.graph.node}
            for r in fp16_true_arithmetic(fp16_path, feed, ref, min_cosine,
                                          max_samples=true_fp16_samples,
                                          budget_s=true_fp16_budget_s):
                r["keep_fp32"] = [k for k in r.get("keep_fp32", []) if k in names]
                out.append(r)
        out += fp16_backends(fp16_path, feed, ref, min_cosine, batch)
    if not trained or not real_inputs:  # one warning per range check, not a verdict per tensor
        why = ("random weights (--random-init): value ranges are not the trained model's"
               if not trained else "synthetic N(0,1) inputs: value ranges are not those of "
               "the model's real inputs (give them with --inputs NPZ, or to stage 1)")
        kept, seen = [], {}
        for r in out:
            if r["status"] != "fail" or r["check"] not in RANGE_CHECKS:
                kept.append(r)
                continue
            seen.setdefault(r["check"], []).append(r)
        for check, rows in seen.items():
            named = [r["node"] for r in rows if r.get("node")][:3]
            kept.append(check_result(check, "warn",
                                     f"{why}, not judged; {len(rows)} finding(s) on these "
                                     f"inputs and weights, e.g. {rows[0]['detail'][:160]}",
                                     node=", ".join(named) or None, findings=rows))
        out = kept
    return out
