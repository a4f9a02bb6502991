"""The Q/DQ health check (``qdq_tools.py check``): scales, weights (granularity, dead
channels, blocks, comparison with the float model), bias findings and the Q/DQ placements
TensorRT runs differently from ONNX Runtime (:mod:`deploykit.quant.placement`) of one file.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
import numpy as np

from deploykit.numerics import FP16_MIN_NORMAL
from deploykit.onnx.graph import QDQ_OPS, attr, constants, consumers, onnx_opset, producers
from deploykit.quant.bias import (
    candidate_outputs,
    check_bias_requant,
    check_bias_scales,
    wbq_candidates,
)
from deploykit.quant.placement import check_trt_placement
from deploykit.quant.qdq import (
    Finding,
    TOL_STEPS,
    WEIGHT_REL_TOL,
    broadcast_param,
    channel_rows,
    dequantize,
    dq_weight,
    fmt_list,
    output_axis,
    reduction_axis,
    weight_consumers,
)


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------
def check_scales(model, consts: dict | None = None) -> list[Finding]:
    """NaN, Inf, zero, negative and float16-subnormal scales of every Q/DQ node, one finding
    per initializer and problem (naming the Q/DQ nodes that use it)."""
    consts = constants(model) if consts is None else consts
    users: dict[str, list[str]] = defaultdict(list)
    for n in model.graph.node:
        if n.op_type in QDQ_OPS and len(n.input) > 1:
            users[n.input[1]].append(n.name or n.output[0])
    out = []
    fix_dtype = ("quantize with fp32 scales (ModelOpt --high_precision_dtype fp32) and "
                 "recalibrate")
    for name, nodes in users.items():
        s = consts.get(name)
        if s is None or not np.issubdtype(s.dtype, np.floating):
            continue
        v = s.astype(np.float64).ravel()
        where = f"scale {name} ({s.dtype}, {v.size} value(s)) of {fmt_list(nodes, 3)}"
        checks = [
            ("scale_nan", np.isnan(v), "NaN",
             "recalibrate: a NaN scale comes from NaN/Inf in the calibration data or a "
             "degenerate range (check the calibration data with qdq_tools.py check-calib)"),
            ("scale_inf", np.isinf(v), "infinite",
             "recalibrate; an infinite scale comes from Inf activations or an overflowing "
             "range (fp16)"),
            ("scale_zero", v == 0, "zero",
             "a zero scale divides by zero in QuantizeLinear: " + fix_dtype + "; a channel "
             "whose range is 0 needs a positive scale (e.g. 1.0)"),
            ("scale_negative", v < 0, "negative",
             "scales must be positive: fix the tool that wrote them (TensorRT requires strictly "
             "positive scale coefficients, NvInfer.h IQuantizeLayer/IDequantizeLayer; in ONNX "
             "a DequantizeLinear of stored integers flips the sign of every value, and a "
             "QuantizeLinear/DequantizeLinear pair mirrors its clipping range: an unsigned one "
             "with zero point 0 clips every positive value to 0)"),
        ]
        if s.dtype == np.float16:
            sub = (np.abs(v) > 0) & (np.abs(v) < FP16_MIN_NORMAL)
            # A float16 subnormal is m * 2^-24 with an integer m < 1024: log2(m) + 1 bits.
            bits = int(np.log2(np.abs(v[sub]).min() / 2.0 ** -24)) + 1 if sub.any() else 0
            checks.append(("scale_fp16_underflow", sub,
                           f"float16-subnormal (< {FP16_MIN_NORMAL:.3g}; the smallest keeps "
                           f"{bits} significant bit(s))", fix_dtype))
        for kind, mask, what, fix in checks:
            k = int(mask.sum())
            if not k:
                continue
            idx = np.flatnonzero(mask)
            vals = v[idx[:4]].tolist()
            out.append(Finding(kind, nodes[0], name,
                               f"{where}: {k} {what} value(s), e.g. index {idx[:4].tolist()} = "
                               f"{[float(x) for x in vals]}", fix,
                               {"count": k, "indices": idx[:20].tolist(), "users": nodes[:20],
                                "dtype": str(s.dtype),
                                "min": float(np.nanmin(v)) if np.isfinite(v).any() else None}))
    return out


# --------------------------------------------------------------------------------------------
# Weights: granularity, dead channels, blocks, comparison with the float model
# --------------------------------------------------------------------------------------------
def _weight_dqs(model, consts: dict) -> list[dict]:
    """Every DequantizeLinear with constant integer data feeding a Conv/ConvTranspose/Gemm/
    MatMul weight input, with its consumer, input position and integer weight."""
    prod, cons = producers(model), consumers(model)
    out = []
    for dq in model.graph.node:
        if dq.op_type != "DequantizeLinear":
            continue
        wq = dq_weight(dq, consts, prod)
        if wq is None or wq["q"].ndim < 2:
            continue
        for user, pos in weight_consumers(dq.output[0], cons):
            if user.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and pos in (0, 1):
                if user.op_type in ("Conv", "ConvTranspose") and pos != 1:
                    continue
                out.append({"dq": dq, "node": user, "pos": pos, **wq})
                break
    return out


def check_weights(model, consts: dict | None = None) -> list[Finding]:
    """Per-tensor weights on grouped convolutions; output channels with all-zero or <= 3-level
    quantized weights under a shared scale; blocked DequantizeLinear axis/opset/scale shape."""
    consts = constants(model) if consts is None else consts
    out = []
    for w in _weight_dqs(model, consts):
        dq, node, q = w["dq"], w["node"], w["q"]
        label = f"{node.name} ({node.op_type}" + (
            f" group={attr(node, 'group', 1)})" if node.op_type == "Conv" else ")")
        s = np.asarray(w["scale"])
        per_tensor = s.size == 1 and not w["block"]
        if node.op_type == "Conv" and int(attr(node, "group", 1)) > 1 and per_tensor:
            out.append(Finding(
                "per_tensor_grouped", node.name, dq.input[1],
                f"{label}: one per-tensor weight scale ({float(s.ravel()[0]):.4g}) for "
                f"{q.shape[0]} output channels of a grouped/depthwise convolution: each channel "
                "is its own filter, and channels with a small range lose their weights",
                "quantize the weights per channel (ModelOpt does by default; ORT "
                f"quantize_static(per_channel=True)) or exclude the node (ModelOpt "
                f"--nodes_to_exclude '^{node.name}$')",
                {"n_channels": int(q.shape[0]), "scale": float(s.ravel()[0])}))
        oax = output_axis(node, q.ndim, w["pos"])
        if oax is not None:
            own = (not per_tensor and not w["block"] and s.ndim == 1
                   and (w["axis"] % q.ndim) == oax)
            blocked_own = bool(w["block"]) and (w["axis"] % q.ndim) != oax
            try:
                zp = 0.0 if w["zp"] is None else broadcast_param(w["zp"], q.shape, w["axis"],
                                                                 w["block"])
            except (ValueError, IndexError):
                own = True  # zero point does not fit its axis: block_scale_shape says so
            if not own and not blocked_own:
                amax = channel_rows(np.abs(q - zp), oax).max(1)
                if amax.max() >= 4:
                    zero = np.flatnonzero(amax == 0)
                    few = np.flatnonzero(amax <= 1)
                    if few.size:
                        share = ("one per-tensor scale" if per_tensor else
                                 f"blocks of {w['block']} along axis {w['axis']} (across output "
                                 "channels)" if w["block"] else
                                 f"per-channel scales along axis {w['axis']}, not the output "
                                 f"channels (axis {oax})")
                        out.append(Finding(
                            "dead_channels", node.name, w["data_name"],
                            f"{label}: weight {w['data_name']} uses {share}; {zero.size} of "
                            f"{amax.size} output channels quantize to all zeros and {few.size} to "
                            f"3 or fewer levels (|q - zp| <= 1: channels {fmt_list(few.tolist())}"
                            f"), while the largest channel uses {int(amax.max())} steps",
                            "give each output channel its own scale (per-channel weights, or "
                            "blocks along the reduction axis), or exclude the node",
                            {"all_zero": zero.tolist(), "few_levels": few.tolist(),
                             "max_steps": int(amax.max())}))
        if w["block"]:
            out.extend(_check_block(model, w, label))
    return out


def _check_block(model, w: dict, label: str) -> list[Finding]:
    dq, node, q = w["dq"], w["node"], w["q"]
    out = []
    dom = dq.domain or ""
    ops = onnx_opset(model, dom)
    if dom in ("", "ai.onnx") and ops < 21:
        out.append(Finding(
            "block_opset", dq.name, dq.input[0],
            f"{dq.name}: blocked DequantizeLinear (block_size={w['block']}) in a model that "
            "imports "
            f"opset {ops}; block_size exists from DequantizeLinear-21 on, so ONNX Runtime refuses "
            "the model and other tools read it as per-axis",
            "raise the model's opset import to 21 or later (onnx.version_converter."
            "convert_version(model, 21)) or re-export at opset >= 21 before quantizing",
            {"opset": ops}))
    axis = w["axis"] % q.ndim
    red = reduction_axis(node, q.ndim, w["pos"])
    s_shape = list(np.shape(w["scale"]))
    fits = [a for a in range(q.ndim) if len(s_shape) == q.ndim and all(
        s == (-(-x // w["block"]) if k == a else x)
        for k, (x, s) in enumerate(zip(q.shape, s_shape)))]
    if axis not in fits:
        out.append(Finding(
            "block_scale_shape", dq.name, dq.input[1],
            f"{dq.name}: weight {list(q.shape)} with axis={w['axis']} block_size={w['block']} "
            f"needs a scale of shape ceil(D/{w['block']}) on axis {axis}, but the scale is "
            f"{s_shape} (fits axis {fits or 'none'}); ONNX Runtime fails at the first run",
            "set axis to the axis the scale was made for (qdq_tools.py fix-int4-axis) or "
            "re-quantize",
            {"valid_axes": fits}))
    if red is not None and axis != red and (axis in fits or not fits):
        out.append(Finding(
            "block_axis", node.name, w["data_name"],
            f"{label}: its weight {list(q.shape)} is quantized in blocks of {w['block']} along "
            f"axis {axis}, but the node sums over axis {red} (K = {q.shape[red]}): each block "
            f"spans {min(w['block'], q.shape[axis])} output channels, so small channels lose "
            "their weights",
            "quantize with blocks along the reduction axis K (5b_quantize_int4.py lays Gemm "
            "weights out as [K, N] before ModelOpt and verifies every block axis)",
            {"axis": axis, "reduction_axis": red, "block_size": w["block"]}))
    return out


def _fp32_weight(fp32_model, fp32_consts: dict, node, pos: int,
                 data_name: str | None = None) -> np.ndarray | None:
    """The float weight of the node called ``node.name`` in the float model (its input ``pos``),
    laid out like ``node``'s (a Gemm whose ``transB`` differs between the two models gets the
    transposed float weight: 5b_quantize_int4.py hands ModelOpt ``[K, N]`` weights); failing
    that (a quantizer that renames nodes), the float model's initializer called ``data_name``
    (the float weight a QuantizeLinear quantizes keeps its name); else None."""
    for n in fp32_model.graph.node:
        if n.name == node.name and n.op_type == node.op_type and len(n.input) > pos:
            w = fp32_consts.get(n.input[pos])
            if (w is not None and node.op_type == "Gemm" and pos == 1 and w.ndim == 2
                    and int(attr(n, "transB", 0)) != int(attr(node, "transB", 0))):
                w = w.T
            return w
    w = fp32_consts.get(data_name) if data_name else None
    return w if w is not None and np.issubdtype(w.dtype, np.floating) else None


def check_against_float(model, fp32_model, consts: dict | None = None
                        ) -> tuple[list[Finding], list[dict]]:
    """Dequantize every weight and compare it with the float model's weight of the same node
    (per output channel relative error ``||w_dq - w|| / ||w||``).

    Returns:
        ``(findings, rows)`` with one row per compared weight (max/median error, tolerance).
    """
    consts = constants(model) if consts is None else consts
    fc = constants(fp32_model)
    findings, rows = [], []
    for w in _weight_dqs(model, consts):
        node, q = w["node"], w["q"]
        ref = _fp32_weight(fp32_model, fc, node, w["pos"], w["data_name"])
        row = {"node": node.name, "weight": w["data_name"], "shape": list(q.shape)}
        if ref is None:
            row["status"] = "no float counterpart (node not in the float model)"
            rows.append(row)
            continue
        bits = 4 if np.dtype(w["dtype"]).name in ("int4", "uint4") else (
            16 if np.dtype(w["dtype"]).itemsize == 2 else 8)
        tol = WEIGHT_REL_TOL[bits]
        try:
            deq = dequantize(q, w["scale"], w["zp"], w["axis"], w["block"])
        except (ValueError, IndexError):
            row["status"] = "not compared: the scale does not fit its axis (block_scale_shape)"
            rows.append(row)
            continue
        if ref.shape != deq.shape:
            msg = (f"{node.name}: dequantized weight shape {list(deq.shape)} differs from the "
                   f"float weight {list(ref.shape)}")
            findings.append(Finding("weight_error", node.name, w["data_name"], msg,
                                    "check the weight layout the quantizer wrote", row))
            row["status"] = "shape differs"
            rows.append(row)
            continue
        oax = output_axis(node, q.ndim, w["pos"]) or 0
        r, e = channel_rows(ref.astype(np.float64), oax), channel_rows(deq - ref, oax)
        nr = np.linalg.norm(r, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(nr > 0, np.linalg.norm(e, axis=1) / nr,
                           np.where(np.linalg.norm(e, axis=1) > 0, np.inf, 0.0))
        rel = np.where(np.isnan(rel), np.inf, rel)
        bad = np.flatnonzero(rel > tol)
        row.update(status="ok" if not bad.size else "fail", bits=bits, tolerance=tol,
                   rel_err_max=float(rel.max()), rel_err_median=float(np.median(rel)),
                   n_channels_over=int(bad.size))
        rows.append(row)
        if bad.size:
            k = int(bad[np.argmax(rel[bad])])
            findings.append(Finding(
                "weight_error", node.name, w["data_name"],
                f"{node.name} ({node.op_type}): the dequantized weight {w['data_name']} differs "
                f"from the float weight by {100 * rel[k]:.3g} % in output channel {k} (relative "
                f"error per channel; {bad.size} of {rel.size} channels above the {bits}-bit "
                f"tolerance {100 * tol:.0f} %, median {100 * np.median(rel):.2g} %): wrong "
                "quantization axis, block layout or scale for these channels",
                "re-quantize this weight with per-output-channel scales or blocks along the "
                "reduction axis; compare the axis/layout the quantizer wrote with the node",
                row))
    return findings, rows


# --------------------------------------------------------------------------------------------
# Everything
# --------------------------------------------------------------------------------------------
def check_model(model, *, path: Path | str | None = None, fp32_model=None,
                calib: dict[str, np.ndarray] | None = None, calib_limit: int = 32,
                tol_steps: float = TOL_STEPS) -> dict:
    """Run every check on a Q/DQ model.

    Args:
        model: the Q/DQ ``onnx.ModelProto``; ``path`` its file (needed with ``calib``).
        fp32_model: the float model it was made from (enables ``weight_error``).
        calib: ``{input name: array [N, ...]}``: judge bias re-quantization on the first
            ``calib_limit`` samples instead of from the scales alone.
    Returns:
        ``{"ok", "n_findings", "kinds" {kind: count}, "findings" [dict], "bias_requant" [rows],
        "weights_vs_float" [rows] or None, "basis"}``.
    Raises:
        StageError: ``calib`` given but the model cannot run on it.
    """
    consts = constants(model)
    findings = check_scales(model, consts)
    activations = None
    if calib is not None:
        if path is None:
            raise ValueError("check_model: calib needs the model's path")
        names = [c["node"].output[0] for c in wbq_candidates(model, consts) if c["bias"]]
        activations = candidate_outputs(path, calib, names, calib_limit, concat=False)
    f, bias_rows = check_bias_requant(model, consts, activations, tol_steps)
    findings += (f + check_bias_scales(model, consts) + check_weights(model, consts)
                 + check_trt_placement(model, consts))
    wrows = None
    if fp32_model is not None:
        f, wrows = check_against_float(model, fp32_model, consts)
        findings += f
    kinds: dict[str, int] = defaultdict(int)
    for x in findings:
        kinds[x.kind] += 1
    return {"ok": not findings, "n_findings": len(findings), "kinds": dict(kinds),
            "findings": [x.as_dict() for x in findings], "bias_requant": bias_rows,
            "weights_vs_float": wrows,
            "basis": "calibration data" if calib is not None else "scales alone",
            "checked": {"n_wbq_candidates": len(bias_rows),
                        "n_weights": len(_weight_dqs(model, consts)),
                        "fp32": fp32_model is not None,
                        "n_compared": sum(r.get("status") in ("ok", "fail")
                                          for r in wrows or [])}}


def summary_line(report: dict) -> str:
    """One short line for logs and the report: ``check: clean`` or the finding kinds."""
    if report.get("ok"):
        return "check: clean"
    kinds = ", ".join(f"{k} x{v}" for k, v in sorted(report["kinds"].items()))
    return f"check: {report['n_findings']} finding(s) ({kinds})"
