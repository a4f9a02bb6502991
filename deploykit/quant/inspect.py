"""Inspection of a Q/DQ model (counts, granularity, scale dtypes, float compute nodes) and
activation statistics on calibration data.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
import numpy as np

from deploykit.checks.fp16 import RangeStat, UNDERFLOW_MASS_SHARE
from deploykit.io import require
from deploykit.errors import UsageError
from deploykit.feeds import feed_plan, load_feed
from deploykit.numerics import FP16_MAX, FP16_MIN_NORMAL, FP16_MIN_SUBNORMAL
from deploykit.onnx.activations import ort_activations
from deploykit.onnx.graph import QDQ_OPS, attr, constants, consumers, load_onnx, producers
from deploykit.quant.bias import wbq_candidates
from deploykit.quant.int4 import check_blocked_dq


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
    # WeightBiasQuantization selects (deploykit.quant.bias.wbq_candidates, its own rules) becomes int32
    # with scale act_scale * weight_scale, computed in the scale dtype: in fp16 tiny products
    # become 0. Whether that changes the output is deploykit.quant.bias.check_bias_requant's question.

    bias = {"quantized_bias": 0, "float_bias_wbq_candidates": 0,
            "min_product_fp32": None, "n_products_zero_in_fp16": 0,
            "n_products_below_fp16_normal": 0, "n_products": 0, "scale_dtype": None}
    for n in nodes:
        if (n.op_type in ("Conv", "ConvTranspose", "Gemm") and len(n.input) > 2
                and n.input[2] in dq_out):
            bias["quantized_bias"] += 1
    mins = []
    for c in wbq_candidates(model, consts):
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

    Every node output is marked as a graph output (``deploykit.onnx.graph.mark_all_outputs`` through
    ``deploykit.onnx.activations.ort_activations``, graph optimisations off) and the npz samples are fed in runs
    the model accepts (a static batch is fed exactly; ``deploykit.feeds.feed_plan``). ``max`` is the
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

    model = load_onnx(onnx_path)
    if any(n.op_type in QDQ_OPS for n in model.graph.node):
        raise UsageError(f"{onnx_path} has Q/DQ nodes: act-stats needs the float model")
    prod = producers(model)
    cons = consumers(model)
    feed = load_feed(require(Path(calib), "4_make_calib.py"), None, 0, onnx_path, flag="--calib")
    if limit:
        feed = {k: v[:limit] for k, v in feed.items()}
    feed, run_batch = feed_plan(feed, [model], batch)
    rng = np.random.default_rng(seed)
    samples = defaultdict(list)
    chmax: dict[str, np.ndarray] = {}
    ranges: dict[str, RangeStat] = {}
    for outs, _ in ort_activations(model, feed, batch=run_batch, opt_level="disable"):
        for nm, a in outs.items():
            if not np.issubdtype(np.asarray(a).dtype, np.floating) or np.size(a) == 0:
                continue
            ranges.setdefault(nm, RangeStat()).update(a)
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
        if st.amax > FP16_MAX:
            flag = "overflow"
        elif st.l1 > 0 and st.l1_small / st.l1 > UNDERFLOW_MASS_SHARE:
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
