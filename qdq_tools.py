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
- ``act-stats ONNX --calib NPZ [--top N] [--json PATH]``: per-tensor activation max |x|, p99.9 of
  |x| and their ratio on the calibration set, worst first (why one per-tensor INT8 scale fails),
  plus for 4-D tensors the spread of per-channel max.
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
        for v in np.abs(s.astype(np.float64)).ravel():
            scales.append((float(v), n.name, kind))
    vals = np.array([v for v, _, _ in scales]) if scales else np.zeros(0)
    smallest = sorted(scales)[:10]
    # Bias: a Conv/Gemm whose data and weight come from DQ. A DQ-fed bias is quantized already;
    # a float bias is what ORT's WeightBiasQuantization turns into int32 with scale
    # act_scale * weight_scale, computed in the scale dtype: in fp16 tiny products become 0.
    bias = {"quantized_bias": 0, "float_bias_wbq_candidates": 0,
            "min_product_fp32": None, "n_products_zero_in_fp16": 0,
            "n_products_below_fp16_normal": 0, "n_products": 0, "scale_dtype": None}
    mins = []
    for n in nodes:
        if n.op_type not in ("Conv", "Gemm") or len(n.input) < 3 or not n.input[2]:
            continue
        if n.input[2] in dq_out:
            bias["quantized_bias"] += 1
            continue
        if n.input[0] not in dq_out or n.input[1] not in dq_out:
            continue
        a_dq, w_dq = dq_out[n.input[0]], dq_out[n.input[1]]
        a_s, w_s = consts.get(a_dq.input[1]), consts.get(w_dq.input[1])
        if a_s is None or w_s is None:
            continue
        bias["float_bias_wbq_candidates"] += 1
        bias["scale_dtype"] = str(w_s.dtype)
        p32 = a_s.astype(np.float32).ravel()[0] * w_s.astype(np.float32).ravel()
        p16 = (a_s.astype(np.float16).ravel()[0] * w_s.astype(np.float16).ravel()).astype(np.float16)
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
    for s in rep["smallest_scales"][:5]:
        print(f"    smallest: {s['value']:.3e} {s['kind']} {s['node']}")
    b = rep["bias"]
    print(f"  bias:              {b['quantized_bias']} quantized; "
          f"{b['float_bias_wbq_candidates']} float biases ORT's WeightBiasQuantization would "
          f"quantize with act_scale*weight_scale (min {b['min_product_fp32']}); in fp16 "
          f"{b['n_products_zero_in_fp16']}/{b['n_products']} products are 0 and "
          f"{b['n_products_below_fp16_normal']} subnormal")
    if b["scale_dtype"] == "float16" and b["n_products_zero_in_fp16"]:
        print("  WARNING: fp16 scales + float biases: ORT CPU (opt level >= basic) may mis-run "
              "this model; compare with --opt-level disable or --disable-optimizer "
              "WeightBiasQuantization before calling it a quantization collapse")
    bad = [r for r in rep["blocked_dq"] if r["status"] not in ("ok",)]
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

    Every float node output becomes a graph output; ``max`` is the exact max |x| over all
    images; ``p99.9`` is the 99.9th percentile of |x| estimated from a seeded sample of up to
    ``sample`` values per batch (exact for tensors smaller than that). For 4-D tensors
    ``channel_spread`` is max over channels of max |x| divided by the median over channels: the
    spread one per-tensor scale has to cover.

    Returns:
        ``[{"tensor", "producer", "consumers", "max", "p99.9", "ratio", "channel_spread"}]``
        sorted by ``ratio`` (worst first).
    """
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto

    model = onnx_graph.load(onnx_path)
    if any(n.op_type in QDQ_OPS for n in model.graph.node):
        raise common.UsageError(f"{onnx_path} has Q/DQ nodes: act-stats needs the float model")
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             list(model.graph.value_info) + list(model.graph.output)}
    prod = producers(model)
    cons = consumers(model)
    existing = {o.name for o in model.graph.output}
    names = [o for n in model.graph.node if n.op_type != "Constant" for o in n.output
             if types.get(o) in (TensorProto.FLOAT, TensorProto.FLOAT16) and o not in existing]
    for nm in names:
        model.graph.output.append(onnx.helper.make_tensor_value_info(nm, types[nm], None))
    names = names + list(existing)
    so = runners.ort_session_options("disable")
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    in_name = sess.get_inputs()[0].name
    with np.load(common.require(calib, "4_make_calib.py")) as z:
        if in_name not in z.files:
            raise common.StageError(f"{calib} has keys {z.files}, the model's input is "
                                    f"{in_name!r}: rerun 4_make_calib.py")
        x = z[in_name]
    if limit:
        x = x[:limit]
    rng = np.random.default_rng(seed)
    amax = defaultdict(float)
    samples = defaultdict(list)
    chmax: dict[str, np.ndarray] = {}
    for i in range(0, len(x), batch):
        outs = sess.run(names, {in_name: x[i:i + batch]})
        for nm, a in zip(names, outs):
            a = np.abs(np.asarray(a, np.float32))
            if a.size == 0:
                continue
            amax[nm] = max(amax[nm], float(a.max()))
            flat = a.ravel()
            samples[nm].append(flat if flat.size <= sample else
                               flat[rng.integers(0, flat.size, sample)])
            if a.ndim == 4:
                c = a.max(axis=(0, 2, 3))
                chmax[nm] = c if nm not in chmax else np.maximum(chmax[nm], c)
    rows = []
    for nm in names:
        if nm not in samples:
            continue
        p = float(np.percentile(np.concatenate(samples[nm]), 99.9))
        spread = None
        if nm in chmax and np.median(chmax[nm]) > 0:
            spread = float(chmax[nm].max() / np.median(chmax[nm]))
        rows.append({"tensor": nm,
                     "producer": f"{prod[nm].op_type}:{prod[nm].name}" if nm in prod else "input",
                     "consumers": sorted({f"{c.op_type}" + (
                         f"(group={attr(c, 'group')})" if c.op_type == "Conv"
                         and int(attr(c, "group", 1)) > 1 else "") for c in cons.get(nm, [])}),
                     "max": amax[nm], "p99.9": p,
                     "ratio": amax[nm] / p if p > 0 else float("inf"),
                     "channel_spread": spread})
    rows.sort(key=lambda r: -r["ratio"] if np.isfinite(r["ratio"]) else -1e300)
    return rows


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


def record_quant(args: argparse.Namespace) -> dict:
    """Write ``results/<model>/quant_<variant>.json``: wall time, the exact command, ModelOpt's
    warnings, and the :func:`inspect_model` summary of the output."""
    onnx_path = Path(args.onnx)
    rec = {"stage": "5_quantize", "model": args.model, "variant": args.variant,
           "status": args.status, "output": str(onnx_path), "wall_time_s": args.wall_s,
           "command": args.command, "log": str(args.log), "description": args.description,
           "warnings": log_warnings(args.log) if Path(args.log).exists() else []}
    if args.status == "ok" and onnx_path.exists():
        rep = inspect_model(onnx_graph.load(onnx_path))
        rep.pop("_helper", None)
        rec["inspect"] = rep
        rec["size_mb"] = common.file_size_mb(onnx_path)
        rec["ort_cpu_smoke"] = ort_smoke(onnx_path)
        if not rec["ort_cpu_smoke"]["ok"]:
            print(f"WARNING: ONNX Runtime cannot run {onnx_path}: "
                  f"{rec['ort_cpu_smoke']['error'][:300]}", file=sys.stderr)
    inputs = [p for p in (args.source, args.calib, onnx_path) if p]
    rec["provenance"] = common.provenance(args, inputs)
    rec["provenance"]["wall_time_s"] = args.wall_s
    path = common.model_results(args.model) / f"quant_{args.variant}.json"
    common.write_json(path, rec)
    return rec


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
    s.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    s = sub.add_parser("layer-diff", help="layer-wise diff of two ONNX models (layerwise.py)")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    s.add_argument("rest", nargs=argparse.REMAINDER, help="passed on to layerwise.py")
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
        if args.check:
            if any(r["status"] != "ok" for r in report):
                raise common.StageError("inconsistent blocked DequantizeLinear axis "
                                        "(run without --check to repair)")
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
        rep = inspect_model(onnx_graph.load(args.onnx))
        rep.pop("_helper", None)
        print_inspect(rep, args.onnx)
        if args.json:
            common.write_json(args.json, rep)
        return rep
    if args.cmd == "act-stats":
        rows = activation_stats(args.onnx, args.calib, limit=args.limit)
        print(f"{'ratio':>7} {'max':>9} {'p99.9':>9} {'ch.spread':>9}  tensor (producer -> "
              "consumers)")
        for r in rows[:args.top]:
            sp = f"{r['channel_spread']:.1f}" if r["channel_spread"] is not None else "-"
            print(f"{r['ratio']:7.2f} {r['max']:9.3f} {r['p99.9']:9.3f} {sp:>9}  {r['tensor']} "
                  f"({r['producer']} -> {','.join(r['consumers'])})")
        if args.json:
            common.write_json(args.json, rows)
        return rows
    if args.cmd == "layer-diff":
        return layer_diff(args)
    if args.cmd == "record-quant":
        return record_quant(args)
    raise common.UsageError(f"unknown command {args.cmd}")


if __name__ == "__main__":
    common.cli(get_args_parser, main)
