#!/usr/bin/env python3
"""Tools for Q/DQ (QuantizeLinear/DequantizeLinear) ONNX models, used by stages 5 and 5b.

Subcommands
- ``list-depthwise ONNX [--names-only] [--anchored]``: grouped convolutions (``group > 1``;
  in MobileNet/EfficientNet all of them are depthwise). Stage 5 excludes them from INT8 with
  ``--nodes_to_exclude``; ``--anchored`` prints ``^name$`` regexes because ModelOpt matches
  ``--nodes_to_exclude`` with ``re.match`` (a prefix match: ``node_Conv_77`` also hits
  ``node_Conv_775``).
- ``list-stem ONNX [--names-only] [--anchored]``: the first convolution fed by the graph input.
- ``fix-int4-axis IN [-o OUT] [--check]``: find blocked DequantizeLinear nodes whose ``axis``
  disagrees with the layout of their scale (ModelOpt 0.47.0 writes ``axis=0`` for Gemm weights
  with ``transB=1`` whose scale is blocked along axis 1; ORT rejects them at run time) and set
  ``axis`` to the one axis the scale shape fits. Nodes that are consistent are left untouched;
  ``--check`` only reports (exit 1 if anything is wrong).
- ``inspect ONNX [--json PATH]``: Q/DQ counts by consumer op type, per-tensor / per-channel /
  blocked scales, scale dtypes, the smallest scales and how many underflow fp16, bias
  quantization (and the products ``act_scale * weight_scale`` that ORT's
  ``WeightBiasQuantization`` optimiser would form: in fp16 they underflow and predict an ORT-only
  collapse), and which compute nodes stay float.
- ``act-stats ONNX --calib NPZ [--top N] [--batch B] [--json PATH]``: per-tensor activation
  max |x|, p99.9 of |x| and their ratio on the calibration set, worst first (why one per-tensor
  INT8 scale fails), for 4-D tensors the spread of per-channel max, and an FP16 flag (max above
  65504, or most of the mass below FP16's smallest normal). A static batch is respected.
- ``check Q.onnx [--fp32 F.onnx] [--calib C.npz]``: the Q/DQ health check (``qdq_check``);
  exit 1 on any finding, each naming the node or initializer and the fix.
- ``check-calib F.onnx --calib C.npz [--model M]``: refuse calibration data that does not fit the
  model or the evaluation data; print the calibration batch stage 5 uses.
- ``modelopt [--calib-batch B] -- FLAGS``: ModelOpt's ONNX PTQ with its own flags and a
  calibration batch of its own (:func:`modelopt_quantize`).
- ``layer-diff A B [args...]``: delegated to ``layerwise.py`` (imported lazily).
- ``record-quant``: write ``results/<model>/quant_<variant>.json`` (used by 5_quantize.sh).

Rerun:  ``python qdq_tools.py inspect artifacts/efficientnet_lite0/onnx/int8.onnx``
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

import common
import runners
import onnx_graph
from onnx_graph import QDQ_OPS, attr, constants, consumers, producers

FP16_MIN_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)  # 5.96e-08
FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)  # 6.10e-05


# --------------------------------------------------------------------------------------------
# Graph helpers
# --------------------------------------------------------------------------------------------
def weight_shape(model, node, consts: dict | None = None) -> tuple[int, ...] | None:
    """Shape of a Conv/Gemm/MatMul weight (second input), looking through a DequantizeLinear."""
    consts = constants(model) if consts is None else consts
    if len(node.input) < 2:
        return None
    w = node.input[1]
    if w in consts:
        return tuple(consts[w].shape)
    prod = producers(model).get(w)
    if prod is not None and prod.op_type == "DequantizeLinear" and prod.input[0] in consts:
        return tuple(consts[prod.input[0]].shape)
    return None


def list_depthwise(model) -> list[dict]:
    """Grouped convolutions (``group > 1``) in graph order.

    Returns:
        ``[{"name", "group", "weight_shape", "depthwise"}]``; ``depthwise`` is True when each
        group has one input channel (weight ``[C_out, 1, kh, kw]``).
    Raises:
        StageError: a grouped Conv has no name (it could not be excluded by name).
    """
    consts = constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type != "Conv" or int(attr(n, "group", 1)) <= 1:
            continue
        if not n.name:
            raise common.StageError("a grouped Conv has no node name: name the nodes (e.g. "
                                    "re-export) so it can be excluded from quantization")
        shape = weight_shape(model, n, consts)
        out.append({"name": n.name, "group": int(attr(n, "group", 1)),
                    "weight_shape": list(shape) if shape else None,
                    "depthwise": bool(shape and len(shape) > 1 and shape[1] == 1)})
    return out


def list_stem(model) -> list[dict]:
    """The first Conv (graph order is topological) whose data input descends from a graph
    input: the stem convolution that sees the normalised image."""
    inits = {i.name for i in model.graph.initializer}
    reach = {i.name for i in model.graph.input if i.name not in inits}
    for n in model.graph.node:
        if n.input and n.input[0] in reach:
            if n.op_type == "Conv":
                return [{"name": n.name, "group": int(attr(n, "group", 1))}]
            reach.update(n.output)
    return []


def _print_nodes(nodes: list[dict], names_only: bool, anchored: bool) -> None:
    for d in nodes:
        name = f"^{re.escape(d['name'])}$" if anchored else d["name"]
        if names_only:
            print(name)
        else:
            print(f"{name}\t" + "\t".join(f"{k}={v}" for k, v in d.items() if k != "name"))


# --------------------------------------------------------------------------------------------
# INT4 blocked DequantizeLinear: axis detection and repair
# --------------------------------------------------------------------------------------------
def _fits(x_shape, s_shape, axis: int, block: int) -> bool:
    """True if ``s_shape`` is the blocked-scale shape of ``x_shape`` along ``axis`` (ONNX
    DequantizeLinear-21: equal everywhere except ``ceil(x[axis] / block)`` on ``axis``)."""
    if len(x_shape) != len(s_shape):
        return False
    return all(s == (-(-x // block) if a == axis else x)
               for a, (x, s) in enumerate(zip(x_shape, s_shape)))


def check_blocked_dq(model) -> list[dict]:
    """Every blocked DequantizeLinear (``block_size > 0``) with its axis verdict.

    Returns:
        ``[{"name", "axis", "block_size", "x_shape", "scale_shape", "valid_axes", "status"}]``
        with ``status`` ``ok`` (``axis`` fits the scale layout), ``mismatch`` (exactly one other
        axis fits: repairable), ``unrepairable`` (none or several fit) or ``unknown`` (data or
        scale are not constants).
    """
    consts = constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or int(attr(n, "block_size", 0) or 0) <= 0:
            continue
        block = int(attr(n, "block_size"))
        rec = {"name": n.name, "axis": int(attr(n, "axis", 1)), "block_size": block,
               "x_shape": None, "scale_shape": None, "valid_axes": [], "status": "unknown"}
        if n.input[0] in consts and len(n.input) > 1 and n.input[1] in consts:
            xs, ss = consts[n.input[0]].shape, consts[n.input[1]].shape
            rec["x_shape"], rec["scale_shape"] = list(xs), list(ss)
            valid = [a for a in range(len(xs)) if _fits(xs, ss, a, block)]
            rec["valid_axes"] = valid
            axis = rec["axis"] % len(xs) if xs else rec["axis"]
            if axis in valid:
                rec["status"] = "ok"
            elif len(valid) == 1:
                rec["status"] = "mismatch"
            else:
                rec["status"] = "unrepairable"
        out.append(rec)
    return out


def fix_int4_axis(model) -> tuple[object, list[dict]]:
    """Repair the ``axis`` of blocked DequantizeLinear nodes flagged ``mismatch`` by
    :func:`check_blocked_dq`, in place; consistent nodes are not touched.

    Returns:
        ``(model, fixed)`` with ``fixed`` the records of the repaired nodes (``new_axis`` added).
    Raises:
        StageError: a node is ``unrepairable`` (the scale shape fits no axis, or several).
    """
    from onnx import helper

    report = check_blocked_dq(model)
    bad = [r for r in report if r["status"] == "unrepairable"]
    if bad:
        raise common.StageError(
            f"{len(bad)} blocked DequantizeLinear node(s) whose scale fits no single axis, e.g. "
            f"{bad[0]['name']}: x {bad[0]['x_shape']}, scale {bad[0]['scale_shape']}, block "
            f"{bad[0]['block_size']}: re-quantize with a block size that divides K")
    todo = {r["name"]: r for r in report if r["status"] == "mismatch"}
    fixed = []
    for n in model.graph.node:
        if n.name in todo and n.op_type == "DequantizeLinear":
            rec = dict(todo[n.name], new_axis=todo[n.name]["valid_axes"][0])
            keep = [a for a in n.attribute if a.name != "axis"]
            del n.attribute[:]
            n.attribute.extend(keep + [helper.make_attribute("axis", rec["new_axis"])])
            fixed.append(rec)
    return model, fixed


def dequantize_blocked(q: np.ndarray, scale: np.ndarray, axis: int, block: int,
                       zero_point: np.ndarray | None = None) -> np.ndarray:
    """Reference blocked dequantization (ONNX DequantizeLinear-21) in float64."""
    s = np.repeat(scale.astype(np.float64), block, axis=axis)
    s = np.take(s, np.arange(q.shape[axis]), axis=axis)
    zp = 0.0
    if zero_point is not None:
        zp = np.take(np.repeat(zero_point.astype(np.float64), block, axis=axis),
                     np.arange(q.shape[axis]), axis=axis)
    return (q.astype(np.float64) - zp) * s


# --------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------
_COMPUTE = {"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "Sub", "Div",
            "GlobalAveragePool", "AveragePool", "MaxPool", "ReduceMean", "HardSigmoid",
            "HardSwish", "Sigmoid", "Relu", "Clip", "Concat", "Softmax", "Gather"}


def inspect_model(model) -> dict:
    """Facts about the Q/DQ placement and scales of ``model`` (see the module docstring).

    Returns:
        dict with ``n_quantize``, ``n_dequantize``, ``dq_by_consumer_op``,
        ``quantized_nodes_by_op`` / ``float_nodes_by_op`` (compute nodes with / without a
        DequantizeLinear input), ``float_nodes`` (names, first 50), ``granularity`` counts,
        ``scale_dtypes``, ``smallest_scales``, ``n_scales_below_fp16_subnormal`` /
        ``n_scales_below_fp16_normal`` / ``n_scales_at_6e-08`` (ModelOpt's replacement value),
        ``bias`` (quantized biases and ``WeightBiasQuantization`` candidates with the smallest
        ``act_scale * weight_scale`` products in fp32 and fp16), ``blocked_dq`` (axis check).
    """
    from onnx import helper

    consts = constants(model)
    prod = producers(model)
    cons = consumers(model)
    nodes = model.graph.node
    q = [n for n in nodes if n.op_type == "QuantizeLinear"]
    dq = [n for n in nodes if n.op_type == "DequantizeLinear"]
    dq_out = {n.output[0]: n for n in dq}
    by_consumer = Counter(c.op_type for n in dq for c in cons.get(n.output[0], []))
    quantized, floating, float_names = Counter(), Counter(), []
    for n in nodes:
        if n.op_type in QDQ_OPS or n.op_type not in _COMPUTE:
            continue
        if any(i in dq_out for i in n.input):
            quantized[n.op_type] += 1
        else:
            floating[n.op_type] += 1
            float_names.append(f"{n.op_type}:{n.name}")
    gran = Counter()
    dtypes = Counter()
    scales = []
    for n in dq:
        s = consts.get(n.input[1]) if len(n.input) > 1 else None
        if s is None:
            gran["non-constant scale"] += 1
            continue
        dtypes[str(s.dtype)] += 1
        if int(attr(n, "block_size", 0) or 0) > 0:
            gran["blocked"] += 1
        elif s.size == 1:
            gran["per-tensor"] += 1
        else:
            gran["per-channel"] += 1
        # A weight is a constant DQ input, or a constant fed through a QuantizeLinear (ModelOpt
        # keeps float weights behind Q/DQ unless --dq_only).
        src = prod.get(n.input[0])
        is_weight = n.input[0] in consts or (src is not None and src.op_type == "QuantizeLinear"
                                             and src.input[0] in consts)
        kind = "weight" if is_weight else "activation"
        for v in s.astype(np.float64).ravel():
            scales.append((float(v), n.name, kind))
    signed = np.array([v for v, _, _ in scales]) if scales else np.zeros(0)
    vals = np.abs(signed)
    # Smallest by magnitude, printed with their sign; NaN first (they are the worst).
    smallest = sorted(scales, key=lambda t: (not np.isnan(t[0]), abs(t[0]) if not np.isnan(t[0])
                                             else 0.0))[:10]
    # Bias: a DQ-fed bias is quantized already; a float bias of a node ORT's
    # WeightBiasQuantization selects (qdq_check.wbq_candidates, its own rules) becomes int32
    # with scale act_scale * weight_scale, computed in the scale dtype: in fp16 tiny products
    # become 0. Whether that changes the output is qdq_check.check_bias_requant's question.
    import qdq_check

    bias = {"quantized_bias": 0, "float_bias_wbq_candidates": 0,
            "min_product_fp32": None, "n_products_zero_in_fp16": 0,
            "n_products_below_fp16_normal": 0, "n_products": 0, "scale_dtype": None}
    for n in nodes:
        if (n.op_type in ("Conv", "ConvTranspose", "Gemm") and len(n.input) > 2
                and n.input[2] in dq_out):
            bias["quantized_bias"] += 1
    mins = []
    for c in qdq_check.wbq_candidates(model, consts):
        if c["bias"] is None or c["dq_w"] is None:
            continue
        a_s, w_s = consts.get(c["dq_in"].input[1]), consts.get(c["dq_w"].input[1])
        bias["float_bias_wbq_candidates"] += 1
        bias["scale_dtype"] = str(w_s.dtype)
        p32 = a_s.astype(np.float32).ravel()[0] * w_s.astype(np.float32).ravel()
        p16 = (a_s.astype(np.float16).ravel()[0]
               * w_s.astype(np.float16).ravel()).astype(np.float16)
        bias["n_products"] += int(p32.size)
        bias["n_products_zero_in_fp16"] += int((p16 == 0).sum())
        bias["n_products_below_fp16_normal"] += int((np.abs(p32) < FP16_MIN_NORMAL).sum())
        mins.append(float(np.abs(p32).min()))
    bias["min_product_fp32"] = min(mins) if mins else None
    return {
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "n_quantize": len(q), "n_dequantize": len(dq),
        "dq_by_consumer_op": dict(by_consumer.most_common()),
        "quantized_nodes_by_op": dict(quantized.most_common()),
        "float_nodes_by_op": dict(floating.most_common()),
        "float_nodes": float_names[:50], "n_float_nodes": len(float_names),
        "granularity": dict(gran), "scale_dtypes": dict(dtypes),
        "n_scale_values": int(vals.size),
        "smallest_scales": [{"value": v, "node": nm, "kind": k} for v, nm, k in smallest],
        "unusable_scales": [{"value": v, "node": nm, "kind": k} for v, nm, k in scales
                            if not np.isfinite(v) or v <= 0][:10],
        "n_scales_nan": int(np.isnan(signed).sum()), "n_scales_inf": int(np.isinf(signed).sum()),
        "n_scales_zero": int((signed == 0).sum()), "n_scales_negative": int((signed < 0).sum()),
        "n_scales_below_fp16_subnormal": int((vals < FP16_MIN_SUBNORMAL).sum()),
        "n_scales_below_fp16_normal": int((vals < FP16_MIN_NORMAL).sum()),
        "n_scales_at_6e-08": int(np.isclose(vals, 6e-08, rtol=0.01, atol=0).sum()),  # fp16 5.96e-08
        "bias": bias,
        "blocked_dq": check_blocked_dq(model),
        "dq_axis_attrs": dict(Counter(str(attr(n, "axis", None)) for n in dq)),
        "producer_ops_of_q_inputs": dict(Counter(
            (prod[n.input[0]].op_type if n.input[0] in prod else "graph-input") for n in q)),
        "graph_inputs": [i.name for i in model.graph.input],
        "onnx_ir_version": model.ir_version,
        "_helper": helper.__name__,
    }


def _short(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def print_inspect(rep: dict, path: Path) -> None:
    """Human-readable summary of :func:`inspect_model`."""
    print(f"{path}: {rep['n_quantize']} QuantizeLinear, {rep['n_dequantize']} DequantizeLinear, "
          f"opset {rep['opset']}")
    print(f"  DQ feeds:          {rep['dq_by_consumer_op']}")
    print(f"  quantized nodes:   {rep['quantized_nodes_by_op']}")
    print(f"  float nodes:       {rep['float_nodes_by_op']} ({rep['n_float_nodes']})")
    print(f"  granularity:       {rep['granularity']}; scale dtypes {rep['scale_dtypes']}")
    print(f"  scales:            {rep['n_scale_values']} values, "
          f"{rep['n_scales_below_fp16_subnormal']} below fp16 subnormal "
          f"({FP16_MIN_SUBNORMAL:.2e}), {rep['n_scales_below_fp16_normal']} below fp16 normal "
          f"({FP16_MIN_NORMAL:.2e}), {rep['n_scales_at_6e-08']} equal to 6e-08 "
          "(ModelOpt's fp16 underflow replacement)")
    bad = {k: rep[f"n_scales_{k}"] for k in ("nan", "inf", "zero", "negative")
           if rep.get(f"n_scales_{k}")}
    if bad:
        print("  WARNING: unusable scales: " + ", ".join(f"{v} {k}" for k, v in bad.items())
              + ": " + ", ".join(f"{u['value']:.3e} ({u['kind']} {u['node']})"
                                 for u in rep.get("unusable_scales", [])[:6])
              + " (python qdq_tools.py check says how to fix them)")
    for s in rep["smallest_scales"][:5]:
        print(f"    smallest |scale|: {s['value']:.3e} {s['kind']} {s['node']}")
    b = rep["bias"]
    print(f"  bias:              {b['quantized_bias']} quantized; "
          f"{b['float_bias_wbq_candidates']} float biases ORT's WeightBiasQuantization would "
          f"quantize with act_scale*weight_scale (min {b['min_product_fp32']}); in fp16 "
          f"{b['n_products_zero_in_fp16']}/{b['n_products']} products are 0 and "
          f"{b['n_products_below_fp16_normal']} subnormal")
    flagged = rep.get("bias_requant_changes")
    if flagged:
        print(f"  WARNING: ORT's WeightBiasQuantization (opt level >= basic) changes the output of "
              f"{len(flagged)} node(s) by more than one quantization step ({_short(flagged)}): "
              "ORT CPU mis-runs this model; python qdq_tools.py check says why, compare with "
              "--opt-level disable or --disable-optimizer WeightBiasQuantization before calling "
              "it a quantization collapse")
    bad = [r for r in rep["blocked_dq"] if r["status"] not in ("ok",)]
    ops = rep["opset"].get("ai.onnx", 0)
    if rep["blocked_dq"] and ops < 21:
        print(f"  WARNING: {len(rep['blocked_dq'])} blocked DequantizeLinear in a model that "
              f"imports opset {ops}: block_size needs opset >= 21 (ONNX Runtime refuses the model)")
    if rep["blocked_dq"]:
        print(f"  blocked DQ:        {len(rep['blocked_dq'])}, inconsistent axis: "
              + (", ".join(f"{r['name']} axis={r['axis']} scale {r['scale_shape']} "
                           f"({r['status']})" for r in bad) or "none"))


# --------------------------------------------------------------------------------------------
# act-stats
# --------------------------------------------------------------------------------------------
def activation_stats(onnx_path: Path, calib: Path, batch: int = 10, sample: int = 100_000,
                     limit: int | None = None, seed: int = 0) -> list[dict]:
    """Per-tensor activation statistics of a float ONNX model over the calibration data.

    Every node output is marked as a graph output (``onnx_graph.mark_all_outputs`` through
    ``layerwise.ort_activations``, graph optimisations off) and the npz samples are fed in runs
    the model accepts (a static batch is fed exactly; ``layerwise.feed_plan``). ``max`` is the
    exact max |x| over all samples; ``p99.9`` is the 99.9th percentile of |x| estimated from a
    seeded sample of up to ``sample`` values per run (exact for smaller tensors). For 4-D
    tensors ``channel_spread`` is max over channels of max |x| divided by the median over
    channels: the spread one per-tensor scale has to cover. ``fp16`` flags what FP16 cannot
    hold: ``overflow`` (max |x| > 65504) or ``underflow`` (most of the L1 mass below FP16's
    smallest normal 6.1e-5), thresholds of ``export_checks``.

    Args:
        calib: npz keyed by input name (``4_make_calib.py``, or your samples).
        batch: samples per run for a dynamic batch.
        limit: use the first ``limit`` samples only.
    Returns:
        ``[{"tensor", "producer", "consumers", "max", "p99.9", "ratio", "channel_spread",
        "fp16"}]`` sorted by ``ratio`` (worst first).
    Raises:
        UsageError: a Q/DQ model, or npz keys that do not match the model's inputs.
    """
    import export_checks
    import layerwise

    model = onnx_graph.load(onnx_path)
    if any(n.op_type in QDQ_OPS for n in model.graph.node):
        raise common.UsageError(f"{onnx_path} has Q/DQ nodes: act-stats needs the float model")
    prod = producers(model)
    cons = consumers(model)
    feed = layerwise.load_feed(common.require(Path(calib), "4_make_calib.py"), None, 0, onnx_path)
    if limit:
        feed = {k: v[:limit] for k, v in feed.items()}
    feed, run_batch = layerwise.feed_plan(feed, [model], batch)
    rng = np.random.default_rng(seed)
    samples = defaultdict(list)
    chmax: dict[str, np.ndarray] = {}
    ranges: dict[str, export_checks.RangeStat] = {}
    for outs, _ in layerwise.ort_activations(model, feed, batch=run_batch, opt_level="disable"):
        for nm, a in outs.items():
            if not np.issubdtype(np.asarray(a).dtype, np.floating) or np.size(a) == 0:
                continue
            ranges.setdefault(nm, export_checks.RangeStat()).update(a)
            a = np.abs(np.asarray(a, np.float32))
            flat = a.ravel()
            samples[nm].append(flat if flat.size <= sample else
                               flat[rng.integers(0, flat.size, sample)])
            if a.ndim == 4:
                c = a.max(axis=(0, 2, 3))
                chmax[nm] = c if nm not in chmax else np.maximum(chmax[nm], c)
    rows = []
    for nm, st in ranges.items():
        p = float(np.percentile(np.concatenate(samples[nm]), 99.9))
        spread = None
        if nm in chmax and np.median(chmax[nm]) > 0:
            spread = float(chmax[nm].max() / np.median(chmax[nm]))
        flag = None
        if st.amax > export_checks.FP16_MAX:
            flag = "overflow"
        elif st.l1 > 0 and st.l1_small / st.l1 > export_checks.UNDERFLOW_MASS_SHARE:
            flag = "underflow"
        rows.append({"tensor": nm,
                     "producer": f"{prod[nm].op_type}:{prod[nm].name}" if nm in prod else "input",
                     "consumers": sorted({f"{c.op_type}" + (
                         f"(group={attr(c, 'group')})" if c.op_type == "Conv"
                         and int(attr(c, "group", 1)) > 1 else "") for c in cons.get(nm, [])}),
                     "max": st.amax, "p99.9": p,
                     "ratio": st.amax / p if p > 0 else float("inf"),
                     "channel_spread": spread, "fp16": flag})
    rows.sort(key=lambda r: -r["ratio"] if np.isfinite(r["ratio"]) else -1e300)
    return rows


# --------------------------------------------------------------------------------------------
# Calibration data: validation (stages 4, 5, 5b) and the calibration batch plan (stage 5)
# --------------------------------------------------------------------------------------------
# Statistics check: calibration vs evaluation data, per input. Refused when the means differ by
# more than STATS_MAX_MEAN_SHIFT standard deviations (the larger of the two stds), the stds by
# more than a factor STATS_MAX_STD_RATIO or the value ranges (max - min) by more than a factor
# STATS_MAX_RANGE_RATIO. Calibration and eval splits of the same images differ far less
# (embedded sample, EfficientNet-Lite0, its 100 calibration images against the first 64 eval
# images that calibration_reference takes: mean shift 0.09 std, std ratio 1.19, ranges equal;
# against all 900: 0.01 std, 1.04); unnormalised 0..255 pixels give a mean shift of ~1.6 std
# and a std ratio of ~150, [0, 1] pixels (no Normalize) a mean shift of 1.3 std, inputs swapped
# between the keys of a two-input model a std ratio of the two inputs' ratio, and ImageNet's
# mean/std instead of the model's 0.5/0.5 a std ratio of 2.6 (inside the std bound) with a
# range of [-2.1, 2.6] for [-1, 1]: a range ratio of 2.4, which the input's quantization scale
# would follow. Ranges are compared on equal numbers of samples (the calibration data's first
# ones, as many as the reference has: the range of unbounded data grows with the sample count)
# and only for inputs whose reference holds at least STATS_RANGE_MIN_VALUES values (two ranges
# of 24 N(0, 1) values differ by more than 2x in 0.8 % of draws, of 96 values in 0.006 %).
STATS_MAX_MEAN_SHIFT = 1.0
STATS_MAX_STD_RATIO = 3.0
STATS_MAX_RANGE_RATIO = 2.0
STATS_RANGE_MIN_VALUES = 1000


def load_npz(path: Path | str, producer: str) -> dict[str, np.ndarray]:
    """``{key: array}`` of an ``.npz`` file.

    Raises:
        StageError: missing (naming ``producer``) or unreadable file.
    """
    path = common.require(Path(path), producer)
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # noqa: BLE001 - zipfile/ValueError/OSError
        raise common.StageError(f"cannot read {path} as an .npz of arrays ({e}): write it with "
                                "np.savez(path, <input name>=array, ...)") from e


def input_stats(a: np.ndarray) -> dict:
    """mean, std, min, max (float64, finite values only) and sample count of an array."""
    v = np.asarray(a).astype(np.float64).ravel()
    v = v[np.isfinite(v)]
    if not v.size:
        return {"n": int(len(a)), "mean": None, "std": None, "min": None, "max": None}
    return {"n": int(len(a)), "mean": float(v.mean()), "std": float(v.std()),
            "min": float(v.min()), "max": float(v.max())}


def calibration_reference(model: str, onnx_path: Path | str, n: int = 64
                          ) -> tuple[dict[str, np.ndarray] | None, str]:
    """The evaluation data the calibration statistics are compared with.

    Image classifiers: the first ``n`` eval images through the evaluation preprocessing
    (:func:`common.load_split` + :func:`common.normalize`). Other models: the inputs stage 1 ran
    the PyTorch reference on (``artifacts/<model>/ref_outputs.npz``, keys ``in:<name>``).

    Returns:
        ``(arrays keyed by input name or None, where they come from / why there are none)``.
    """
    try:
        spec = common.model_spec(model)
    except common.UsageError:
        spec = None
    names = [i[0] for i in onnx_graph.inputs(onnx_graph.load(onnx_path, external=False))]
    if spec is not None and spec.classifier:
        if not common.splits_path().exists():
            return None, f"none: {common.splits_path()} missing (run 0_prepare_data.py)"
        try:
            x, _, _ = common.load_split("eval", spec, n)
        except common.StageError as e:
            return None, f"none: {e}"
        return {names[0]: common.normalize(x, spec.mean, spec.std)}, \
            f"first {len(x)} eval images, evaluation preprocessing"
    ref = common.model_artifacts(model) / "ref_outputs.npz"
    if not ref.exists():
        return None, f"none: {ref} missing (1_pytorch_baseline.py writes it)"
    data = {k[3:]: v for k, v in load_npz(ref, "1_pytorch_baseline.py").items()
            if k.startswith("in:")}
    return data, f"the inputs stage 1 evaluated ({ref})"


def validate_calibration(onnx_path: Path | str, data: dict[str, np.ndarray],
                         reference: dict[str, np.ndarray] | None = None, *,
                         source: str = "calibration data", reference_source: str = "",
                         producer: str = "4_make_calib.py does") -> dict:
    """Refuse calibration data that does not fit the model, before any quantizer runs.

    Checks: keys equal the model's input names; each array has the input's rank, static dims and
    dtype; every input has the same sample count N >= 1 (a multiple of a static batch); no
    NaN/Inf; with ``reference``, per input mean/std/range within :data:`STATS_MAX_MEAN_SHIFT` /
    :data:`STATS_MAX_STD_RATIO` / :data:`STATS_MAX_RANGE_RATIO` of the evaluation data's.

    Args:
        data: ``{input name: array [N, ...]}``. reference: the same for evaluation data
            (:func:`calibration_reference`), or None to skip the statistics check.
        source: what the data are, in messages. producer: the hint after the missing-key fix.
    Returns:
        ``{"n_samples", "inputs": {name: {"shape", "dtype", "stats", "reference_stats"}},
        "stats_check": "passed" | "skipped: ..."}``.
    Raises:
        StageError: every problem found, with the numbers and the fix.
    """
    inputs = onnx_graph.inputs(onnx_graph.load(onnx_path, external=False))
    names = [i[0] for i in inputs]
    problems: list[str] = []
    missing = [k for k in names if k not in data]
    extra = [k for k in data if k not in names]
    if missing or extra:
        what = "; ".join(x for x in (f"missing {missing}" if missing else "",
                                     f"not inputs of the model: {extra}" if extra else "") if x)
        raise common.StageError(
            f"{source} has keys {sorted(data)} but the model's inputs are {names} ({what}): key "
            "each array by its ONNX input name (np.savez(path, "
            + ", ".join(f"{k}=..." for k in names) + f")); {producer}")
    counts = {}
    info = {}
    for name, dims, dtype in inputs:
        a = np.asarray(data[name])
        info[name] = {"shape": list(a.shape), "dtype": str(a.dtype)}
        if a.ndim != len(dims):
            problems.append(f"input {name!r}: array of shape {list(a.shape)} for an input of rank "
                            f"{len(dims)} {dims} (batch on axis 0, one sample per row)")
            continue
        bad = [(k, d, a.shape[k]) for k, d in enumerate(dims) if k and d and d != a.shape[k]]
        if bad:
            problems.append(f"input {name!r}: shape {list(a.shape)} does not fit the model's "
                            f"{['N' if d is None else d for d in dims]} (axis {bad[0][0]}: "
                            f"{bad[0][2]} vs {bad[0][1]})")
        if a.dtype != dtype:
            problems.append(f"input {name!r} is {a.dtype} but the model takes {dtype}: save it "
                            f"with .astype(np.{dtype.name})")
        counts[name] = len(a) if a.ndim else 0
        if np.issubdtype(a.dtype, np.floating):
            nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
            if nan or inf:
                rows = np.flatnonzero(~np.isfinite(a.reshape(len(a), -1)).all(1))
                problems.append(f"input {name!r} has {nan} NaN and {inf} Inf values (samples "
                                f"{rows[:5].tolist()}{' ...' if rows.size > 5 else ''}): remove "
                                "or repair those samples")
        if dims and dims[0] and counts[name] % dims[0]:
            problems.append(f"input {name!r}: {counts[name]} samples for a static batch of "
                            f"{dims[0]}: use a multiple of {dims[0]} samples")
        info[name]["stats"] = input_stats(a)
    if len(set(counts.values())) > 1:
        problems.append(f"inputs have different sample counts {counts}: one row per sample in "
                        "every input")
    if any(c < 1 for c in counts.values()):
        problems.append(f"no samples ({counts})")
    stats_note = "passed"
    if reference is None:
        stats_note = f"skipped ({reference_source or 'no evaluation data given'})"
    elif not problems:
        for name in names:
            if name not in reference:
                continue
            r = input_stats(reference[name])
            c = info[name]["stats"]
            info[name]["reference_stats"] = r
            if r["std"] is None or c["std"] is None:
                continue
            spread = max(r["std"], c["std"], 1e-12)
            shift = abs(c["mean"] - r["mean"]) / spread
            ratio = max(c["std"], 1e-12) / max(r["std"], 1e-12)
            span = 1.0
            ref_arr = np.asarray(reference[name])
            if ref_arr.size >= STATS_RANGE_MIN_VALUES:
                cs = input_stats(np.asarray(data[name])[:max(len(ref_arr), 1)])
                span = (max(cs["max"] - cs["min"], 1e-12) / max(r["max"] - r["min"], 1e-12)
                        if cs["max"] is not None else 1.0)
            if shift > STATS_MAX_MEAN_SHIFT or not (
                    1 / STATS_MAX_STD_RATIO <= ratio <= STATS_MAX_STD_RATIO) or not (
                    1 / STATS_MAX_RANGE_RATIO <= span <= STATS_MAX_RANGE_RATIO):
                problems.append(
                    f"input {name!r}: {source} mean {c['mean']:.4g} std {c['std']:.4g} range "
                    f"[{c['min']:.4g}, {c['max']:.4g}] vs evaluation data mean {r['mean']:.4g} std "
                    f"{r['std']:.4g} range [{r['min']:.4g}, {r['max']:.4g}] ({reference_source}):"
                    f" mean shift {shift:.2f} std, std ratio {ratio:.3g}, range ratio {span:.3g}"
                    " - not preprocessed like the evaluation data (unnormalised? another "
                    "mean/std? inputs swapped between keys?); the quantization scales would be "
                    "fitted to other data")
        stats_note = f"passed against {reference_source}"
    if problems:
        raise common.StageError(f"{source} refused: " + "; ".join(problems)
                                + (" (if the data are right and the evaluation inputs are not "
                                   "representative, pass --no-stats-check / CALIB_STATS_CHECK=0)"
                                   if any("evaluation data" in p for p in problems) else ""))
    return {"n_samples": int(next(iter(counts.values()))), "inputs": info,
            "stats_check": stats_note}


def activation_bytes_per_sample(onnx_path: Path | str, data: dict[str, np.ndarray]) -> int:
    """Bytes of every float intermediate tensor for one sample (ONNX shape inference with the
    inputs' non-batch dims taken from ``data``): what a calibrator that records all activations
    holds per sample. An upper bound: ModelOpt records the inputs of the ops it quantizes
    (measured on EfficientNet-Lite0: estimate 95 MiB per image, ModelOpt's peak RSS grows by
    ~62 MiB per image: 1.4 GiB at batch 1, 7.5 GiB at batch 100)."""
    import onnx

    model = onnx_graph.load(onnx_path, external=False)
    for i in model.graph.input:
        if i.name in data:
            shape = (1,) + tuple(np.shape(data[i.name])[1:])
            dims = i.type.tensor_type.shape.dim
            for d, v in zip(dims, shape):
                d.ClearField("dim_param")
                d.dim_value = int(v)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - shape inference is best effort here
        return 0
    total = 0
    for v in list(model.graph.value_info) + list(model.graph.output):
        t = v.type.tensor_type
        if t.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        dims = [d.dim_value for d in t.shape.dim]
        if dims and all(d > 0 for d in dims):
            total += int(np.prod(dims)) * (4 if t.elem_type == onnx.TensorProto.FLOAT else 2)
    return total


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Default calibration batch: the whole calibration set in one batch.
# Why: ModelOpt 0.47.0's ONNX CLI splits the npz into int(N / B) batches of B = the batch dim of
# --calibration_shapes (default: the model's, 1 when dynamic) (modelopt/onnx/quantization/
# calib_utils.py, CalibrationDataProvider), and entropy calibration runs ONNX Runtime's
# HistogramCollector batch by batch: the first batch fixes the bin width, each later batch whose
# range is wider adds bins of that width (onnxruntime/quantization/calibrate.py, merge_histogram),
# and get_entropy_threshold searches only thresholds beyond the first num_quantized_bins (128)
# bins. So with several batches the entropy scales depend on which samples come first. Measured
# (ModelOpt 0.47.0, ORT 1.32.0, 256 N(0,1) samples, 5 random orders, two small CNNs from
# ../shared/cases c13/c17): the spread of an activation scale across orders is up to 46 % / 31 %
# at batch 1, 18 % / 14 % at batch 4, 9-34 % at batch 16-128, and 0.0 % with all 256 samples in
# one batch. With one batch the histogram has exactly 128 bins and the search has one candidate,
# max |x|: entropy then equals max calibration (same scales, measured), deterministic and
# independent of order. A smaller batch (--calib-batch / CALIB_BATCH) is used only when one
# batch would not fit in memory; the sample order (seeded by stage 4) is then recorded.
CALIB_MEMORY_FRACTION = 0.5


def calibration_plan(onnx_path: Path | str, data: dict[str, np.ndarray],
                     batch: str | int = "all", memory_fraction: float = CALIB_MEMORY_FRACTION
                     ) -> dict:
    """Calibration batch for ModelOpt and the ``--calibration_shapes`` that sets it.

    Args:
        data: validated calibration arrays (:func:`validate_calibration`).
        batch: ``"all"`` (default: every sample in one batch, capped by memory) or a number.
        memory_fraction: share of the available memory one batch of activations may use.
    Returns:
        ``{"batch_size", "n_samples", "batches" (sizes ModelOpt will use: it splits N into
        int(N / B) parts with np.array_split), "calibration_shapes", "order_dependent",
        "reason", "bytes_per_sample"}``.
    Raises:
        UsageError: ``batch`` is not "all" or a positive integer.
        StageError: a static batch axis the data cannot be cut into.
    """
    inputs = onnx_graph.inputs(onnx_graph.load(onnx_path, external=False))
    n = len(next(iter(data.values())))
    static = {d[0] for _, d, _ in inputs if d and d[0]}
    per = activation_bytes_per_sample(onnx_path, data)
    if static:
        b = min(static)
        reason = f"the model's batch axis is static ({b})"
    elif str(batch) == "all":
        b, reason = n, "whole calibration set in one batch (order-independent)"
        avail = _mem_available()
        if per and avail and n * per > memory_fraction * avail:
            parts = int(np.ceil(n * per / (memory_fraction * avail)))
            b = max(1, n // parts)
            reason = (f"one batch of {n} would hold ~{n * per / 2 ** 30:.1f} GiB of activations, "
                      f"more than {memory_fraction:.0%} of the {avail / 2 ** 30:.1f} GiB "
                      f"available: {parts} batches")
    else:
        try:
            b = int(batch)
        except ValueError:
            b = 0
        if b < 1:
            raise common.UsageError(f"calibration batch {batch!r}: 'all' or a positive integer")
        b = min(b, n)
        reason = "requested"
    k = max(1, n // b)
    sizes = [len(x) for x in np.array_split(np.arange(n), k)]
    shapes = ",".join(f"{name}:" + "x".join(str(v) for v in (b,) + tuple(np.shape(data[name])[1:]))
                      for name, _, _ in inputs)
    return {"batch_size": b, "n_samples": n, "batches": sizes, "calibration_shapes": shapes,
            "order_dependent": len(sizes) > 1, "reason": reason, "bytes_per_sample": per}


def deployment_shapes(onnx_path: Path | str, data: dict[str, np.ndarray]) -> str:
    """``name:1xCxHxW,...``: the model's inputs at batch 1 (or their static batch) with the other
    dims from ``data``: the shapes ModelOpt's GEMV rule should see (it excludes a MatMul/Gemm
    whose M is 1, a TensorRT performance rule about the deployed batch, not the calibration one)."""
    out = []
    for name, dims, _ in onnx_graph.inputs(onnx_graph.load(onnx_path, external=False)):
        shape = (dims[0] or 1,) + tuple(np.shape(data[name])[1:])
        out.append(f"{name}:" + "x".join(str(v) for v in shape))
    return ",".join(out)


def modelopt_quantize(argv: Sequence[str], calib_batch: str | int = "all") -> None:
    """``python -m modelopt.onnx.quantization ARGV`` (ModelOpt's own argument parser and
    ``quantize()``), with the calibration batch set on its own.

    ModelOpt 0.47.0's CLI has one knob for two things: ``--calibration_shapes`` is both the
    calibration batch (calib_utils.CalibrationDataProvider) and the shapes its GEMV rule reads
    (graph_utils.find_nodes_from_matmul_to_exclude: a Gemm whose M is 1 stays float). Without
    it the batch is the model's batch dim, 1 when dynamic. Here the calibration data reader gets
    the batch of :func:`calibration_plan` and, unless ARGV says otherwise, the GEMV rule keeps
    seeing the deployment batch (:func:`deployment_shapes`), so the nodes ModelOpt quantizes are
    the same as with its CLI; only the calibration batch differs.

    Raises:
        UsageError: ``--autotune`` (use ModelOpt's CLI for it).
    """
    import inspect

    from modelopt.onnx.quantization import quantize
    from modelopt.onnx.quantization.__main__ import get_parser
    from modelopt.onnx.quantization.calib_utils import CalibrationDataProvider

    args = get_parser().parse_args(list(argv))
    if args.autotune is not None:
        raise common.UsageError("--autotune: run python -m modelopt.onnx.quantization directly")
    params = inspect.signature(quantize).parameters
    kw = {k: v for k, v in vars(args).items() if k in params and k != "onnx_path"}
    kw["autotune"] = False
    if args.calibration_data_path:
        data = load_npz(args.calibration_data_path, "4_make_calib.py")
        plan = calibration_plan(args.onnx_path, data, calib_batch)
        kw["calibration_data"] = data
        kw["calibration_data_reader"] = CalibrationDataProvider(args.onnx_path, data,
                                                                plan["calibration_shapes"])
        if not args.calibration_shapes:
            kw["calibration_shapes"] = deployment_shapes(args.onnx_path, data)
        print(f"calibration batch {plan['batch_size']} ({len(plan['batches'])} batch(es) of "
              f"{plan['batches'][:4]}); ModelOpt's GEMV rule sees {kw['calibration_shapes']}")
    quantize(args.onnx_path, **kw)


def check_calib_cli(args: argparse.Namespace) -> dict:
    """``check-calib``: validate the npz for a model, plan the calibration batch, print the
    ``--calibration_shapes`` value (stdout, one line) and write the record (``--json``)."""
    data = load_npz(args.calib, "4_make_calib.py")
    ref, ref_src = (None, "skipped (--no-stats-check)")
    if not args.no_stats_check:
        if args.reference:
            ref, ref_src = load_npz(args.reference, "np.savez"), str(args.reference)
        elif args.model:
            ref, ref_src = calibration_reference(args.model, args.onnx)
    rep = validate_calibration(args.onnx, data, ref, source=str(args.calib),
                               reference_source=ref_src)
    plan = calibration_plan(args.onnx, data, args.batch)
    rec = {**rep, "plan": plan, "calib": str(args.calib), "sha256": common.sha256_file(args.calib)}
    made = common.model_results(args.model) / "calib.json" if args.model else None
    rec["order_seed"] = None
    rec["made_by"] = "unknown (not the npz stage 4 recorded)"
    if made is not None and made.exists():
        try:
            c = json.loads(made.read_text())
        except json.JSONDecodeError:
            c = {}
        if c.get("sha256") == rec["sha256"]:
            rec["order_seed"] = c.get("order_seed")
            rec["made_by"] = f"4_make_calib.py ({c.get('source')})"
    if args.json:
        common.write_json(args.json, rec)
    print(plan["batch_size"])
    note = (f"calibration: {plan['n_samples']} samples, batch {plan['batch_size']} "
            f"({len(plan['batches'])} batch(es): {plan['reason']}); statistics "
            f"{rep['stats_check']}")
    print(note, file=sys.stderr)
    if plan["order_dependent"]:
        print(f"NOTE: {len(plan['batches'])} calibration batches: entropy scales depend on the "
              f"sample order (order seed {rec['order_seed']})", file=sys.stderr)
    return rec


# --------------------------------------------------------------------------------------------
# record-quant (5_quantize.sh)
# --------------------------------------------------------------------------------------------
KEEP_WARNINGS = re.compile(r"WARNING|replaced with|smaller than smallest|Error|error:", re.I)


def log_warnings(log: Path, limit: int = 40) -> list[str]:
    """ModelOpt warning lines worth keeping (deduplicated, timestamps stripped)."""
    out: list[str] = []
    for line in Path(log).read_text(errors="replace").splitlines():
        if KEEP_WARNINGS.search(line):
            msg = re.sub(r"^\S+ \S+ - \[modelopt\]\[onnx\] - ", "", line).strip()
            if msg not in out:
                out.append(msg)
    return out[:limit]


def ort_smoke(path: Path) -> dict:
    """Load ``path`` in ORT CPU and run one all-zero batch-1 input (symbolic dims -> 1), at the
    default optimisation level: ``{"ok": bool, "error": str | None}``. A model ORT accepts at
    load time can still fail at the first run (blocked DequantizeLinear shape checks)."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), runners.ort_session_options("all"),
                                    providers=["CPUExecutionProvider"])
        feed = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
            dtype = np.float16 if "float16" in i.type else np.float32
            feed[i.name] = np.zeros(shape, dtype)
        sess.run(None, feed)
        return {"ok": True, "error": None}
    except Exception as e:  # noqa: BLE001 - ORT raises Fail/InvalidGraph/RuntimeException
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}


# --------------------------------------------------------------------------------------------
# Backend cross-check (stage 3): the same Q/DQ file with ORT graph optimisations off
# --------------------------------------------------------------------------------------------
#: ORT session option that makes its x86-64 int8 kernels use u8u8 instead of u8s8, which cannot
#: saturate on CPUs without VNNI (onnxruntime PR #12088, session.x64quantprecision).
X64_QUANT_PRECISION = {"session.x64quantprecision": "1"}


CROSS_CHECK_FIRST = 128  # samples of the adaptive cross-check's first look
CROSS_CHECK_MIN_COSINE = 0.999  # per-sample output cosine under which two runs "differ"


def backend_cross_check(onnx_path: Path | str, data, outputs: dict[str, np.ndarray], *,
                        n: int = -1, batch: int = 64, tol_points: float = 2.0,
                        min_cosine: float = 0.99, opt_level: str = "all",
                        session_config: dict | None = None) -> dict:
    """Rerun a Q/DQ model with every ORT graph optimisation off (DequantizeLinear + float ops:
    the graph's own semantics) on the samples of the main run and compare, for any model.

    ONNX Runtime is not a neutral judge of Q/DQ graphs (``WeightBiasQuantization``, QDQ fusions
    into integer kernels): a result that changes here is the backend's, not the quantization's.
    ``n`` samples; ``n < 0`` is adaptive: the first :data:`CROSS_CHECK_FIRST`, extended to all
    as soon as any of them differs between the two runs (top-1, or an output cosine below
    :data:`CROSS_CHECK_MIN_COSINE`). A backend effect comes from the weights and scales (an
    overflowing int32 bias, a fused kernel), not from one input, so it shows on the first
    samples, and every flagged disagreement is then measured on all of them. When the two
    disagree on an x86-64 CPU without VNNI, the optimised graph is run once more with
    :data:`X64_QUANT_PRECISION` to tell u8s8 kernel saturation from a graph optimiser effect
    (``cause``).

    Args:
        data: ``evaluate.EvalData`` of the main run (classifier images with labels, or a feed).
        outputs: ``{output name: array [N, ...]}`` of the main run (same order of samples).
        batch: samples per run (the model's static batch, if any, wins: evaluate.run_outputs).
        tol_points: classifiers: top-1 difference (points) that counts as a disagreement.
        min_cosine: other models: an output whose cosine (min over samples) falls below this
            counts as a disagreement.
        opt_level, session_config: how the main run was made (for the saturation leg).
    Returns:
        ``{"n", "adaptive", "opt_level": "disable", "outputs": {name: parity}, "disagreement",
        "reason", "cause", "cpu_vnni"}`` plus ``top1_main``/``top1_unoptimized``/
        ``top1_agreement``/``tolerance_points`` (and ``top1_x64quantprecision`` on
        ``n_x64quantprecision`` first samples after the saturation leg) for classifiers.
    Raises:
        StageError: ORT cannot load or run the model unoptimised.
    """
    import evaluate

    total = len(data)
    adaptive = n < 0
    first = min(CROSS_CHECK_FIRST, total) if adaptive else min(n, total)

    def run(lo: int, hi: int, **kw) -> dict[str, np.ndarray]:
        with runners.OrtRunner(onnx_path, "cpu", **kw) as r:
            return evaluate.run_outputs(r, data.subset(lo, hi), batch, progress="cross-check")

    def compare(ref: dict, main: dict) -> tuple[dict, tuple | None]:
        pars, worst = {}, None
        for name, m in main.items():
            if name in ref and ref[name].shape == np.shape(m):
                pars[name] = common.parity(ref[name], m)
                if worst is None or pars[name]["cosine_min"] < worst[1]["cosine_min"]:
                    worst = (name, pars[name])
        return pars, worst

    head = {k: v[:first] for k, v in outputs.items()}
    ref = run(0, first, opt_level="disable")
    differs = any(common.cosine_rows(ref[k], head[k]).min() < CROSS_CHECK_MIN_COSINE
                  for k in head if k in ref and ref[k].shape == head[k].shape)
    if data.classifier:
        k0 = next(iter(head))
        differs = differs or bool((ref[k0].argmax(1) != head[k0].argmax(1)).any())
    if adaptive and differs and first < total:
        more = run(first, total, opt_level="disable")
        ref = {k: np.concatenate([v, more[k]]) for k, v in ref.items()}
    k = len(next(iter(ref.values())))
    main = {name: v[:k] for name, v in outputs.items()}
    pars, worst = compare(ref, main)
    rec: dict = {"n": int(k), "adaptive": adaptive, "opt_level": "disable", "outputs": pars,
                 "cause": None, "cpu_vnni": common.cpu_has_vnni()}
    first_out = next(iter(main))
    if data.classifier:
        t_main = common.topk_accuracy(main[first_out], data.y[:k], (1,))["top1"]
        t_ref = common.topk_accuracy(ref[first_out], data.y[:k], (1,))["top1"]
        rec.update(top1_main=t_main, top1_unoptimized=t_ref, tolerance_points=tol_points,
                   top1_agreement=float(100.0 * (ref[first_out].argmax(1)
                                                 == main[first_out].argmax(1)).mean()),
                   disagreement=bool(abs(t_main - t_ref) > tol_points))
        rec["reason"] = (f"top-1 {t_main:.1f}% at opt level {opt_level} vs {t_ref:.1f}% with ORT "
                         f"graph optimisations disabled ({k} images)")
    else:
        bad = worst is not None and worst[1]["cosine_min"] < min_cosine
        rec.update(min_cosine=min_cosine, disagreement=bool(bad))
        rec["reason"] = (f"output {worst[0]}: cosine min {worst[1]['cosine_min']:.4f} between the "
                         f"optimised and the unoptimised run ({k} samples)" if worst else
                         "no comparable output")
    if rec["disagreement"] and common.cpu_has_vnni() is False and not session_config:
        # The cause needs no more samples than the first look: the saturating and the u8u8
        # kernels run the same weights on every input.
        kc = min(k, first)
        fixed = run(0, kc, opt_level=opt_level, session_config=X64_QUANT_PRECISION)
        ref_c = {name: v[:kc] for name, v in ref.items()}
        if data.classifier:
            t_fix = common.topk_accuracy(fixed[first_out], data.y[:kc], (1,))["top1"]
            t_ref = common.topk_accuracy(ref_c[first_out], data.y[:kc], (1,))["top1"]
            rec["top1_x64quantprecision"] = t_fix
            rec["n_x64quantprecision"] = kc
            agrees = abs(t_fix - t_ref) <= tol_points
            how = (f"top-1 is {t_fix:.1f}% vs {t_ref:.1f}% unoptimised on the first {kc} "
                   "images")
        else:
            _, w2 = compare(ref_c, fixed)
            agrees = w2 is not None and w2[1]["cosine_min"] >= min_cosine
            how = f"the outputs agree (cosine min {w2[1]['cosine_min']:.4f})" if w2 else ""
        if agrees:
            rec["cause"] = ("u8s8 saturation in ORT's int8 CPU kernels on this CPU without VNNI: "
                            f"with session.x64quantprecision=1 {how} (rerun with "
                            "--x64-quant-precision; ORT PR #12088)")
    return rec


def run_check(onnx_path: Path | str, fp32: Path | str | None = None,
              calib: Path | str | None = None, calib_limit: int = 32) -> dict:
    """:func:`qdq_check.check_model` on files (see ``qdq_tools.py check --help``).

    Returns:
        the check report plus ``file``, ``fp32``, ``calib``.
    Raises:
        StageError: a file is missing/unreadable, or the model cannot run on ``calib``.
    """
    import qdq_check

    model = onnx_graph.load(onnx_path)
    fp32_model = onnx_graph.load(fp32, "2_export_onnx.py") if fp32 else None
    data = load_npz(calib, "4_make_calib.py") if calib else None
    rep = qdq_check.check_model(model, path=onnx_path, fp32_model=fp32_model, calib=data,
                                calib_limit=calib_limit)
    return {"file": str(onnx_path), "fp32": str(fp32) if fp32 else None,
            "calib": str(calib) if calib else None, **rep}


def print_check(rep: dict, limit: int | None = None) -> None:
    """Findings of :func:`run_check`, one block each (message, then the fix); ``limit``: print
    the first ``limit`` of each kind only."""
    import qdq_check

    print(f"{rep['file']}: {qdq_check.summary_line(rep)} (bias re-quantization judged on "
          f"{rep['basis']}; {rep['checked']['n_wbq_candidates']} Conv/Gemm (or MatMul+Add ORT "
          f"fuses into a Gemm) rewritten by ORT's WeightBiasQuantization, "
          + (f"{rep['checked'].get('n_compared', 0)} of {rep['checked']['n_weights']} quantized "
             "weights compared with the float weights (matched by node, else weight name)"
             if rep["checked"]["fp32"] else f"{rep['checked']['n_weights']} quantized weights")
          + ")")
    shown: dict[str, int] = defaultdict(int)
    for f in rep["findings"]:
        shown[f["kind"]] += 1
        if limit is None or shown[f["kind"]] <= limit:
            print(f"  [{f['kind']}] {f['message']}\n      fix: {f['fix']}")
        elif shown[f["kind"]] == limit + 1:
            print(f"  [{f['kind']}] ... {rep['kinds'][f['kind']] - limit} more (all in the "
                  "JSON; python qdq_tools.py check prints them)")


def record_quant(args: argparse.Namespace) -> dict:
    """Write ``results/<model>/quant_<variant>.json``: wall time, the exact command, ModelOpt's
    warnings, the calibration record (``--calib-report``: samples, batch, order seed), the
    :func:`inspect_model` summary, the MACs in INT8 (``macs``: :func:`auto_precision.mac_summary`)
    and the health check (:func:`run_check` with the float model and the calibration data) of
    the output."""
    onnx_path = Path(args.onnx)
    rec = {"stage": "5_quantize", "model": args.model, "variant": args.variant,
           "status": args.status, "output": str(onnx_path), "wall_time_s": args.wall_s,
           "command": args.command, "log": str(args.log), "description": args.description,
           "warnings": log_warnings(args.log) if Path(args.log).exists() else []}
    if args.calib_report and Path(args.calib_report).exists():
        rec["calibration"] = calibration_summary(json.loads(Path(args.calib_report).read_text()))
    if args.status == "ok" and onnx_path.exists():
        qmodel = onnx_graph.load(onnx_path)
        rep = inspect_model(qmodel)
        rep.pop("_helper", None)
        rec["inspect"] = rep
        # Share of the Conv/Gemm/MatMul MACs that compute in INT8 (the report's column).
        import auto_precision

        rec["macs"] = auto_precision.mac_summary(qmodel)
        rec["size_mb"] = common.file_size_mb(onnx_path)
        rec["ort_cpu_smoke"] = ort_smoke(onnx_path)
        if not rec["ort_cpu_smoke"]["ok"]:
            print(f"WARNING: ONNX Runtime cannot run {onnx_path}: "
                  f"{rec['ort_cpu_smoke']['error'][:300]}", file=sys.stderr)
        rec["check"] = check_record(onnx_path, args.source, args.calib)
    inputs = [p for p in (args.source, args.calib, onnx_path) if p]
    rec["provenance"] = common.provenance(args, inputs)
    rec["provenance"]["wall_time_s"] = args.wall_s
    path = common.model_results(args.model) / f"quant_{args.variant}.json"
    common.write_json(path, rec)
    return rec


def calibration_summary(rep: dict) -> dict:
    """The calibration facts a quant JSON records (from ``check-calib --json``)."""
    plan = rep.get("plan", {})
    return {"npz": rep.get("calib"), "sha256": rep.get("sha256"),
            "n_samples": rep.get("n_samples"), "batch_size": plan.get("batch_size"),
            "batches": plan.get("batches"), "order_dependent": plan.get("order_dependent"),
            "batch_reason": plan.get("reason"), "order_seed": rep.get("order_seed"),
            "made_by": rep.get("made_by"), "stats_check": rep.get("stats_check"),
            "calibration_shapes": plan.get("calibration_shapes"),
            "inputs": {k: {"shape": v["shape"], "dtype": v["dtype"], "stats": v.get("stats")}
                       for k, v in rep.get("inputs", {}).items()}}


def check_record(onnx_path: Path, fp32: Path | str | None, calib: Path | str | None) -> dict:
    """:func:`run_check` for a stage record: prints the findings, never raises (a check that
    cannot run is recorded as ``{"ok": None, "error": ...}``)."""
    import qdq_check

    try:
        rep = run_check(onnx_path, fp32 if fp32 and Path(fp32).exists() else None,
                        calib if calib and Path(calib).exists() else None)
    except (common.StageError, ValueError) as e:
        print(f"WARNING: qdq_tools.py check could not run on {onnx_path}: {e}", file=sys.stderr)
        return {"ok": None, "error": str(e)[:600], "summary": "check: could not run"}
    rep["summary"] = qdq_check.summary_line(rep)
    if rep["ok"]:
        print(f"  {onnx_path.name}: {rep['summary']}")
    else:
        print_check(rep, limit=3)
    return rep


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name in ("list-depthwise", "list-stem"):
        s = sub.add_parser(name, help=f"{name.split('-')[1]} convolutions of a float ONNX model")
        s.add_argument("onnx", type=Path)
        s.add_argument("--names-only", action="store_true", help="one node name per line")
        s.add_argument("--anchored", action="store_true",
                       help="print ^name$ regexes (ModelOpt's --nodes_to_exclude uses re.match)")
        s.add_argument("--expect", type=int, default=None,
                       help="fail (exit 1) unless exactly this many are found")
    s = sub.add_parser("fix-int4-axis", help="repair the axis of blocked DequantizeLinear nodes")
    s.add_argument("onnx", type=Path)
    s.add_argument("-o", "--output", type=Path, default=None,
                   help="output file (default: overwrite the input, atomically)")
    s.add_argument("--check", action="store_true", help="only report; exit 1 if inconsistent")
    s = sub.add_parser("inspect", help="Q/DQ placement, scales, fp16 underflow, float nodes")
    s.add_argument("onnx", type=Path)
    s.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    s = sub.add_parser("act-stats", help="activation max / p99.9 on the calibration set")
    s.add_argument("onnx", type=Path, help="float ONNX model")
    s.add_argument("--calib", type=Path, required=True, help="calibration npz (4_make_calib.py)")
    s.add_argument("--top", type=int, default=20, help="rows to print")
    s.add_argument("--limit", type=int, default=None, help="calibration images to use")
    s.add_argument("--batch", type=int, default=10,
                   help="samples per run (default 10); a model with a static batch is fed "
                        "exactly that many")
    s.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    s = sub.add_parser("layer-diff", help="layer-wise diff of two ONNX models (layerwise.py)")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    s.add_argument("rest", nargs=argparse.REMAINDER, help="passed on to layerwise.py")
    s = sub.add_parser("check", help="Q/DQ health check: scales, ORT bias re-quantization, "
                                     "bias scales, per-tensor/dead channels, INT4 blocks; "
                                     "exit 1 on any finding")
    s.add_argument("onnx", type=Path, help="Q/DQ ONNX model")
    s.add_argument("--fp32", type=Path, default=None,
                   help="the float model it was made from: compare every dequantized weight "
                        "with its float weight")
    s.add_argument("--calib", type=Path, default=None,
                   help="calibration npz: judge ORT's bias re-quantization on these inputs "
                        "instead of from the scales alone")
    s.add_argument("--calib-limit", type=int, default=32, help="calibration samples to run")
    s.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    s = sub.add_parser("check-calib", help="validate calibration data for a model and print "
                                           "the calibration batch (stage 5)")
    s.add_argument("onnx", type=Path, help="float ONNX model to be calibrated")
    s.add_argument("--calib", type=Path, required=True, help="calibration npz")
    s.add_argument("--model", default=None, help="model name: evaluation data for the "
                   "statistics check (eval split, or stage 1's inputs for custom models)")
    s.add_argument("--reference", type=Path, default=None,
                   help="npz of evaluation inputs to compare statistics with (overrides --model)")
    s.add_argument("--batch", default="all",
                   help="calibration batch: 'all' (one batch, order-independent; capped by "
                        "memory) or a number")
    s.add_argument("--no-stats-check", action="store_true",
                   help="skip the comparison with the evaluation data (recorded)")
    s.add_argument("--json", type=Path, default=None, help="write the calibration record here")
    s = sub.add_parser("modelopt", help="ModelOpt ONNX PTQ with its own CLI flags (after --) "
                                        "and a calibration batch of its own (stage 5)")
    s.add_argument("--calib-batch", default="all",
                   help="calibration batch: 'all' (one batch) or a number (check-calib prints "
                        "the one stage 5 uses)")
    s.add_argument("modelopt_args", nargs=argparse.REMAINDER,
                   help="-- then the flags of python -m modelopt.onnx.quantization")
    s = sub.add_parser("record-quant", help="write results/<model>/quant_<variant>.json "
                                            "(called by 5_quantize.sh)")
    s.add_argument("--model", required=True)
    s.add_argument("--variant", required=True)
    s.add_argument("--onnx", required=True)
    s.add_argument("--source", default=None, help="float model that was quantized")
    s.add_argument("--calib", default=None)
    s.add_argument("--log", type=Path, required=True)
    s.add_argument("--wall-s", type=float, required=True)
    s.add_argument("--status", default="ok", choices=("ok", "failed"))
    s.add_argument("--description", default="")
    s.add_argument("--command", required=True, help="the exact quantization command")
    s.add_argument("--calib-report", type=Path, default=None,
                   help="JSON written by check-calib (calibration samples, batch, order seed)")
    return p


def layer_diff(args: argparse.Namespace):
    """``layerwise.py diff A B rest...`` (layerwise is imported lazily: only this subcommand
    needs it and its dependencies)."""
    if not (common.ROOT / "layerwise.py").exists():
        raise common.StageError("layer-diff needs layerwise.py (the layer-wise comparison tool) "
                                f"in {common.ROOT}; it is not there")
    sys.path.insert(0, str(common.ROOT))
    layerwise = importlib.import_module("layerwise")
    argv = ["diff", str(args.a), str(args.b), *args.rest]
    return layerwise.main(layerwise.get_args_parser().parse_args(argv))


def main(args: argparse.Namespace):
    if not args.cmd:
        raise common.UsageError("give a subcommand")
    if args.cmd in ("list-depthwise", "list-stem"):
        model = onnx_graph.load(args.onnx, external=False)
        nodes = list_depthwise(model) if args.cmd == "list-depthwise" else list_stem(model)
        _print_nodes(nodes, args.names_only, args.anchored)
        if not args.names_only:
            print(f"# {len(nodes)} node(s)", file=sys.stderr)
        if args.expect is not None and len(nodes) != args.expect:
            raise common.StageError(f"{args.cmd}: found {len(nodes)}, expected {args.expect}")
        return nodes
    if args.cmd == "fix-int4-axis":
        model = onnx_graph.load(args.onnx)
        report = check_blocked_dq(model)
        for r in report:
            print(f"{r['name']}: axis={r['axis']} block={r['block_size']} x {r['x_shape']} "
                  f"scale {r['scale_shape']} fits axes {r['valid_axes']} -> {r['status']}")
        if not report:
            print(f"{args.onnx}: no blocked DequantizeLinear nodes")
        ops = onnx_graph.opset(model)
        if report and ops < 21:
            print(f"{args.onnx}: blocked DequantizeLinear in a model that imports opset {ops}: "
                  "block_size needs opset 21 (DequantizeLinear-21); raise the opset import")
        if args.check:
            if any(r["status"] != "ok" for r in report):
                raise common.StageError("inconsistent blocked DequantizeLinear axis "
                                        "(run without --check to repair)")
            if report and ops < 21:
                raise common.StageError(f"opset {ops} does not define block_size")
            return report
        model, fixed = fix_int4_axis(model)
        out = args.output or args.onnx
        if fixed or out != args.onnx:
            import onnx

            with common.atomic_path(out) as tmp:
                onnx.save(model, str(tmp))
        print(f"repaired {len(fixed)} node(s) -> {out}")
        return fixed
    if args.cmd == "inspect":
        import qdq_check

        model = onnx_graph.load(args.onnx)
        rep = inspect_model(model)
        rep.pop("_helper", None)
        findings, _ = qdq_check.check_bias_requant(model)
        rep["bias_requant_changes"] = [f.node for f in findings]
        print_inspect(rep, args.onnx)
        if args.json:
            common.write_json(args.json, rep)
        return rep
    if args.cmd == "act-stats":
        common.check_positive(args, "top", "limit", "batch")
        rows = activation_stats(args.onnx, args.calib, batch=args.batch, limit=args.limit)
        flagged = [r for r in rows if r["fp16"]]
        print(f"{'ratio':>7} {'max':>9} {'p99.9':>9} {'ch.spread':>9} {'fp16':>9}  tensor "
              "(producer -> consumers)")
        for r in rows[:args.top] + [r for r in flagged if r not in rows[:args.top]]:
            sp = f"{r['channel_spread']:.1f}" if r["channel_spread"] is not None else "-"
            print(f"{r['ratio']:7.2f} {r['max']:9.3f} {r['p99.9']:9.3f} {sp:>9} "
                  f"{(r['fp16'] or '-').upper() if r['fp16'] else '-':>9}  {r['tensor']} "
                  f"({r['producer']} -> {','.join(r['consumers'])})")
        if flagged:
            print(f"{len(flagged)} tensor(s) outside what FP16 holds (max 65504, normal >= "
                  f"6.1e-05): {', '.join(r['tensor'] for r in flagged[:8])}; keep their "
                  "producers/consumers in FP32 (python export_checks.py fp16-audit names them, "
                  "2_export_onnx.py --fp16-keep-fp32 keeps them)")
        if args.json:
            common.write_json(args.json, rows)
        return rows
    if args.cmd == "layer-diff":
        return layer_diff(args)
    if args.cmd == "check":
        rep = run_check(args.onnx, args.fp32, args.calib, args.calib_limit)
        print_check(rep)
        if args.json:
            common.write_json(args.json, rep)
        if not rep["ok"]:
            raise common.StageError(f"{rep['n_findings']} finding(s) in {args.onnx} (above)")
        return rep
    if args.cmd == "check-calib":
        return check_calib_cli(args)
    if args.cmd == "modelopt":
        argv = args.modelopt_args[1:] if args.modelopt_args[:1] == ["--"] else args.modelopt_args
        return modelopt_quantize(argv, args.calib_batch)
    if args.cmd == "record-quant":
        return record_quant(args)
    raise common.UsageError(f"unknown command {args.cmd}")


if __name__ == "__main__":
    common.cli(get_args_parser, main)
