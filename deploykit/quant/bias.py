"""Bias checks: ORT's WeightBiasQuantization re-quantization replayed with ORT's kernels and
judged by its effect on the node's output, and quantized bias scale = s_in * s_w.
"""
from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
import numpy as np

from deploykit.checks.base import value_shapes
from deploykit.errors import StageError
from deploykit.onnx.graph import attr, constants, consumers, graph_inputs, load_onnx, producers
from deploykit.quant.qdq import (
    Finding,
    TOL_STEPS,
    channel_rows,
    dequantize,
    dq_weight,
    int_range,
    output_axis,
    qdq_int_dtype,
    scale_zero_point,
)
from deploykit.runners import ort_session_options


# --------------------------------------------------------------------------------------------
# Bias re-quantization by ORT's WeightBiasQuantization
# --------------------------------------------------------------------------------------------
def wbq_candidates(model, consts: dict | None = None) -> list[dict]:
    """The Conv/ConvTranspose/Gemm nodes ORT's ``WeightBiasQuantization`` rewrites, selected by
    its own rules (weight_bias_quantization.cc, ``ApplyImpl``): input 0 from a DequantizeLinear
    with a scalar scale; the output reaches a QuantizeLinear through a chain without branches
    that may contain Relu/Clip; the weight from a DequantizeLinear (not blocked; per-tensor, or
    per-channel on axis 0 for Conv and on ``transB ? 0 : 1`` for Gemm, with as many scales as
    bias values) or a float32 initializer; a 1-D bias initializer (required when the weight is
    already quantized). A MatMul + Add that ORT's ``MatMulAddFusion`` (also level basic) fuses
    into a Gemm first is judged as that Gemm (:func:`matmul_add_gemms`).

    Returns:
        ``[{"node", "dq_in", "dq_w" (or None: float weight), "bias", "chain" (Relu/Clip nodes),
        "q_out", "label" (node name and op for messages), "fused_add" (the Add of a fused
        MatMul, else None)}]`` (ONNX NodeProto objects, bias = initializer name; for a fused
        MatMul ``node`` is the Gemm standing for it).
    """
    consts = constants(model) if consts is None else consts
    prod, cons = producers(model), consumers(model)
    fused = matmul_add_gemms(model)
    out = []
    for n0 in model.graph.node:
        n, add = fused.get(n0.output[0], (n0, None)) if n0.op_type == "MatMul" else (n0, None)
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(n.input) < 2:
            continue
        dq_in, dq_w = prod.get(n.input[0]), prod.get(n.input[1])
        if dq_in is None or dq_in.op_type != "DequantizeLinear":
            continue
        s_in = consts.get(dq_in.input[1])
        if s_in is None or s_in.size != 1 or s_in.ndim > 1:
            continue
        chain, cur, q_out = [], n, None
        while len(cur.output) == 1:
            users = cons.get(cur.output[0], [])
            if len(users) != 1:
                break
            if users[0].op_type == "QuantizeLinear":
                q_out = users[0]
                break
            if users[0].op_type not in ("Relu", "Clip"):
                break
            chain.append(users[0])
            cur = users[0]
        if q_out is None:
            continue
        if dq_w is not None and dq_w.op_type != "DequantizeLinear":
            dq_w = None
        if dq_w is None:
            w = consts.get(n.input[1])
            if w is None or w.dtype != np.float32:
                continue
        bias = n.input[2] if len(n.input) > 2 and n.input[2] else None
        if bias is not None:
            b = consts.get(bias)
            if b is None or b.ndim != 1:
                continue
        if dq_w is not None and bias is None:
            continue
        if dq_w is not None:
            s_w = consts.get(dq_w.input[1])
            if s_w is None:
                continue
            if not (s_w.size == 1 and s_w.ndim <= 1):
                if s_w.ndim != 1 or s_w.shape[0] != consts[bias].shape[0]:
                    continue
                if int(attr(dq_w, "block_size", 0) or 0):
                    continue
                w_rank = len(consts[dq_w.input[0]].shape) if dq_w.input[0] in consts else None
                axis = int(attr(dq_w, "axis", 1))
                if axis < 0:
                    if w_rank is None:
                        continue
                    axis += w_rank
                expected = 0
                if n.op_type == "Gemm":
                    expected = 0 if int(attr(n, "transB", 0)) else 1
                if axis != expected:
                    continue
        label = (f"{n.name} (MatMul + Add {add.name}, fused into a Gemm by ORT's "
                 "MatMulAddFusion)" if add is not None else f"{n.name} ({n.op_type})")
        out.append({"node": n, "dq_in": dq_in, "dq_w": dq_w, "bias": bias, "chain": chain,
                    "q_out": q_out, "label": label, "fused_add": add})
    return out


def matmul_add_gemms(model) -> dict[str, tuple[Any, Any]]:
    """The MatMul + Add pairs ORT's ``MatMulAddFusion`` (level basic, like
    ``WeightBiasQuantization``) turns into one Gemm that the bias re-quantization then sees,
    each as ``{MatMul output tensor: (Gemm NodeProto standing for the fused node, the Add
    node)}``.

    ORT's rules (onnxruntime/core/optimizer/matmul_add_fusion.cc): the MatMul's output has one
    consumer, an Add, and is no graph output; A and B have known shapes, B of rank 2; a float
    type (the DequantizeLinear that ``WeightBiasQuantization`` needs before A guarantees it).
    Only a rank-2 A is kept here: for a higher rank ORT puts a Reshape after the Gemm, so its
    output no longer reaches a QuantizeLinear directly and ``WeightBiasQuantization`` leaves it
    alone. The Gemm keeps the MatMul's name (or its output's), reads ``[A, B, bias]``
    (``transB=0``) and writes the Add's output; :func:`wbq_candidates` then applies ``WeightBiasQuantization``'s own rules
    (a 1-D bias initializer among them).
    """
    pass  # value_shapes: ONNX shape inference (imported late: heavier)
    from onnx import helper

    matmuls = [n for n in model.graph.node
               if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]
    if not matmuls:
        return {}
    cons = consumers(model)
    graph_out = {o.name for o in model.graph.output}
    shapes = value_shapes(model)
    out = {}
    for mm in matmuls:
        users = cons.get(mm.output[0], [])
        if len(users) != 1 or mm.output[0] in graph_out or users[0].op_type != "Add":
            continue
        add = users[0]
        if len(add.input) != 2 or add.input[0] == add.input[1]:
            continue
        a, b = shapes.get(mm.input[0]), shapes.get(mm.input[1])
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            continue
        bias = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
        out[mm.output[0]] = (helper.make_node("Gemm", [mm.input[0], mm.input[1], bias],
                                              list(add.output), name=mm.name or mm.output[0]),
                             add)
    return out


def _ort_weight_scale(w: np.ndarray) -> tuple[np.float32, int]:
    """Scale and zero point ORT gives a float32 weight it quantizes itself
    (``GetQuantizationParameter<int8_t>`` in core/util/qmath.h: range widened to include 0,
    scale = (max - min) / 255, zero point rounded half to even)."""
    lo, hi = min(float(w.min()), 0.0), max(float(w.max()), 0.0)
    scale = np.float32(1.0 if hi == lo else (hi - lo) / 255.0)
    zp = int(np.clip(np.rint(-128 - lo / float(scale)), -128, 127))
    return scale, zp


def simulate_bias_requant(bias: np.ndarray, s_in: np.ndarray, s_w: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
    """The bias ORT's ``WeightBiasQuantization`` hands the node, computed by ONNX Runtime itself.

    The optimizer inserts ``Mul(s_in, s_w) -> Div(bias, .) -> Round -> Cast(int32) ->
    DequantizeLinear(., Mul)`` (weight_bias_quantization.cc). The same subgraph is built here in
    the stored dtypes and run on ORT's CPU EP, so float16 arithmetic (ORT runs it through
    inserted fp32 casts) and the float -> int32 cast of out-of-range values (on x86: -2^31, for
    +inf, NaN and values beyond int32 alike) are exactly what the session would do.

    Args:
        bias: 1-D float bias. s_in: the input's scalar scale. s_w: the weight scale (scalar or
            per output channel).
    Returns:
        ``(effective bias float64 [C], int32 values [C])``.
    Raises:
        StageError: ORT cannot run the subgraph (e.g. mixed scale dtypes: the optimizer's
            rewrite would not be valid either).
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def vi(name, a):
        return helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.asarray(a).dtype), list(np.shape(a)))

    per_channel = np.asarray(s_w).size > 1
    nodes = [helper.make_node("Mul", ["s_in", "s_w"], ["s_b"]),
             helper.make_node("Div", ["b", "s_b"], ["d"]),
             helper.make_node("Round", ["d"], ["r"]),
             helper.make_node("Cast", ["r"], ["q"], to=TensorProto.INT32),
             helper.make_node("DequantizeLinear", ["q", "s_b"], ["y"],
                              **({"axis": 0} if per_channel else {}))]
    feed = {"b": np.asarray(bias), "s_in": np.asarray(s_in), "s_w": np.asarray(s_w)}
    y_dtype = helper.np_dtype_to_tensor_dtype(np.asarray(s_w).dtype)
    g = helper.make_graph(nodes, "wbq", [vi(k, v) for k, v in feed.items()],
                          [helper.make_tensor_value_info("y", y_dtype, None),
                           helper.make_tensor_value_info("q", TensorProto.INT32, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    try:
        sess = ort.InferenceSession(m.SerializeToString(), ort_session_options("disable"),
                                    providers=["CPUExecutionProvider"])
        y, q = sess.run(["y", "q"], feed)
    except Exception as e:  # noqa: BLE001 - ORT raises its own types
        raise StageError(f"cannot replay ORT's bias re-quantization: {e}") from e
    return np.asarray(y, np.float64).reshape(-1), np.asarray(q).reshape(-1)


def _activation_bounds(chain: list, consts: dict) -> list[tuple[float, float]]:
    """``[(lo, hi)]`` of each Relu/Clip in ``chain`` (Clip bounds from inputs or, before opset
    11, attributes; a missing bound is infinite)."""
    out = []
    for c in chain:
        if c.op_type == "Relu":
            out.append((0.0, np.inf))
            continue
        lo = consts.get(c.input[1]) if len(c.input) > 1 and c.input[1] else attr(c, "min")
        hi = consts.get(c.input[2]) if len(c.input) > 2 and c.input[2] else attr(c, "max")
        out.append((-np.inf if lo is None else float(np.asarray(lo, np.float64)),
                    np.inf if hi is None else float(np.asarray(hi, np.float64))))
    return out


def _q_params(q_node, consts: dict, prod: dict, model) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Scale, zero point (float64) and integer range of a QuantizeLinear."""
    s, zp = scale_zero_point(consts, q_node)
    dtype = qdq_int_dtype(model, q_node, consts, prod)
    s = np.asarray(s, np.float64)
    zp = np.zeros_like(s) if zp is None else np.asarray(zp, np.float64)
    return s, zp, int_range(dtype) or (0, 255)


def _apply_chain(v: np.ndarray, bounds: list[tuple[float, float]], lo_out, hi_out) -> np.ndarray:
    for lo, hi in bounds:
        v = np.clip(v, lo, hi)
    return np.clip(v, lo_out, hi_out)


def _worst_change(b: np.ndarray, d: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                  bounds: list[tuple[float, float]], lo_out: np.ndarray, hi_out: np.ndarray
                  ) -> np.ndarray:
    """Per channel, the largest ``|F(v + d) - F(v)|`` over ``v`` in ``[b + lo, b + hi]`` where
    ``F`` is the clip chain then the output clamp (monotone, piecewise linear): the maximum is
    at an end of the interval or where ``v`` or ``v + d`` meets a bound."""
    C = b.shape[0]
    pts = [b + lo, b + hi]
    for t in [x for pair in bounds for x in pair] + [lo_out, hi_out]:
        t = np.broadcast_to(np.asarray(t, np.float64), (C,))
        for cand in (t, t - d):
            pts.append(np.clip(np.where(np.isfinite(cand), cand, b + lo), b + lo, b + hi))
    best = np.zeros(C)
    for v in pts:
        with np.errstate(invalid="ignore"):
            g = np.abs(_apply_chain(v + d, bounds, lo_out, hi_out)
                       - _apply_chain(v, bounds, lo_out, hi_out))
        best = np.maximum(best, np.where(np.isnan(g), np.inf, g))
    return best


def _contribution_bounds(node, w: np.ndarray, x_lo: float, x_hi: float
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Per output channel, the range of the weighted sum (without bias) when every input lies in
    ``[x_lo, x_hi]`` (``x_lo <= 0 <= x_hi``, so zero padding stays inside): the sum over the
    channel's weights of ``min``/``max(w * x_lo, w * x_hi)``. ConvTranspose: every tap of the
    group counted (an upper bound). Gemm: times ``alpha``."""
    ax = output_axis(node, w.ndim)
    w = w.astype(np.float64)
    a, b = w * x_lo, w * x_hi
    lo_t, hi_t = np.minimum(a, b), np.maximum(a, b)
    lo, hi = channel_rows(lo_t, ax).sum(1), channel_rows(hi_t, ax).sum(1)
    if node.op_type == "ConvTranspose":
        g = int(attr(node, "group", 1))
        lo = np.repeat(lo.reshape(g, -1).sum(0, keepdims=True), g, 0).ravel() if g > 1 else lo
        hi = np.repeat(hi.reshape(g, -1).sum(0, keepdims=True), g, 0).ravel() if g > 1 else hi
    alpha = float(attr(node, "alpha", 1.0)) if node.op_type == "Gemm" else 1.0
    lo, hi = alpha * lo, alpha * hi
    return np.minimum(lo, hi), np.maximum(lo, hi)


def _output_change(y: np.ndarray, d: np.ndarray, cax: int, bounds, lo_out, hi_out, s_out,
                   tol_steps: float) -> tuple[np.ndarray, float, np.ndarray, bool]:
    """How a bias change ``d`` (per channel, axis ``cax``) moves a node's output through its
    clip chain and output quantizer, on the pre-activations ``y`` (float64 ``[N, C, ...]``).

    Only the channels whose bias changes can move; they are simulated alone, and the
    per-sample cosine of the whole output is assembled from the unchanged channels' part
    (identical in both runs) and the changed ones'.

    Returns:
        ``(per-channel max change in output steps [C], share of output elements that change by
        more than tol_steps, per-sample output cosine [N], True when the change makes an output
        NaN that was not)``.
    """
    C = y.shape[cax]
    lo = lo_out.reshape(()) if np.size(lo_out) == 1 else lo_out
    hi = hi_out.reshape(()) if np.size(hi_out) == 1 else hi_out
    f0 = _apply_chain(y, bounds, lo, hi)
    n = len(f0)
    flat0 = f0.reshape(n, -1)
    norm0 = np.einsum("ij,ij->i", flat0, flat0)
    sel = np.flatnonzero(d != 0)
    ch = np.zeros(C)
    if not sel.size:
        return ch, 0.0, np.ones(n), False
    shape = [1] * y.ndim
    shape[cax] = -1

    def pick(a, idx):  # the channels idx of a per-channel array (a scalar stays one)
        return a if np.size(a) == 1 else np.asarray(a).reshape(-1)[idx].reshape(shape)

    ys, f0s = np.take(y, sel, axis=cax), np.take(f0, sel, axis=cax)
    with np.errstate(invalid="ignore"):
        f1s = _apply_chain(ys + d[sel].reshape(shape), bounds, pick(lo, sel), pick(hi, sel))
        step = pick(s_out, sel)
        steps = np.abs(np.rint(f1s / step) - np.rint(f0s / step))
    steps = np.where(np.isnan(steps), np.inf, steps)
    ch[sel] = channel_rows(steps, cax).max(1)
    frac = float((steps > tol_steps).sum()) / y.size
    f1z = np.nan_to_num(f1s, nan=0.0).reshape(n, -1)
    f0z = f0s.reshape(n, -1)
    same = norm0 - np.einsum("ij,ij->i", f0z, f0z)  # the unchanged channels' part
    dot = same + np.einsum("ij,ij->i", f0z, f1z)
    norm1 = same + np.einsum("ij,ij->i", f1z, f1z)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((norm0 == 0) & (norm1 == 0), 1.0,
                       dot / np.maximum(np.sqrt(np.maximum(norm0, 0) * np.maximum(norm1, 0)),
                                        1e-300))
    nonfinite = bool(np.isnan(f1s).any() and not np.isnan(f0).any())
    return ch, frac, cos, nonfinite


#: Samples simulated at a time by :func:`check_bias_requant` (its float64 temporaries stay a few
#: MB: whole-tensor temporaries of 32 samples cost more in the kernel's page zeroing than in
#: the arithmetic, measured on Lite0's baseline: 6.3 s of system time in a 10.3 s check).
SIM_CHUNK = 4


def _output_change_by_samples(y, d: np.ndarray, cax: int, bounds, lo_out, hi_out,
                              s_out, tol_steps: float, chunk: int = SIM_CHUNK
                              ) -> tuple[np.ndarray, float, np.ndarray, int, bool]:
    """:func:`_output_change` of ``y`` (an array ``[N, ...]`` of any float dtype, or a list of
    such arrays, consecutive samples, as :func:`candidate_outputs` returns them) computed
    ``chunk`` samples at a time in float64, with the same results: every figure is per sample
    (the cosine), a maximum (the channel change), a count (the share of elements) or an any
    (NaN). Returns ``(ch, frac, cos, n_samples, nonfinite)``."""
    parts = y if isinstance(y, list) else [y]
    ch, count, size, cos, new_nan, had_nan = None, 0, 0, [], False, False
    for arr in parts:
        for i in range(0, len(arr), chunk):
            part = np.asarray(arr[i:i + chunk], np.float64)
            c, f, cs, nf = _output_change(part, d, cax, bounds, lo_out, hi_out, s_out, tol_steps)
            ch = c if ch is None else np.maximum(ch, c)
            count += int(round(f * part.size))
            size += part.size
            cos.append(cs)
            new_nan = new_nan or nf
            had_nan = had_nan or bool(np.isnan(part).any())  # the clip chain keeps a NaN
    # the whole batch's flag: NaN after the change and none before, anywhere in the batch (a
    # chunk with a NaN before says nothing of its own after; the batch's answer is then False)
    nonfinite = new_nan and not had_nan
    return ch, count / size, np.concatenate(cos), sum(len(c) for c in cos), nonfinite


def check_bias_requant(model, consts: dict | None = None, activations: dict | None = None,
                       tol_steps: float = TOL_STEPS) -> tuple[list[Finding], list[dict]]:
    """Nodes whose output ORT's bias re-quantization changes by more than ``tol_steps``.

    Args:
        activations: optional ``{node output tensor: float array [N, C, ...] (Gemm [N, C]), or
            a list of such arrays of consecutive samples}``
            of the candidate nodes on calibration data (pre-activation, in the graph's own
            numerics, see :func:`candidate_outputs`); without it the change is bounded from the
            scales alone. The candidate nodes are simulated on two threads (NumPy releases the
            GIL), the results in the graph's order.
    Returns:
        ``(findings, rows)``: ``rows`` has one entry per candidate node with the simulated
        bias change and the output change in steps (``basis``: ``calibration`` or ``scales``).
    """
    consts = constants(model) if consts is None else consts
    prod = producers(model)
    def one(c: dict) -> tuple[list[dict], list[Finding]]:
        row_out: list[dict] = []
        found: list[Finding] = []
        n, dq_in, dq_w = c["node"], c["dq_in"], c["dq_w"]
        if c["bias"] is None:
            return row_out, found  # only the float weight is quantized: not a bias effect
        bias = consts[c["bias"]]
        s_in = consts[dq_in.input[1]]
        if dq_w is not None:
            s_w = consts[dq_w.input[1]]
            wq = dq_weight(dq_w, consts, prod)
            w = None if wq is None else dequantize(wq["q"], wq["scale"], wq["zp"], wq["axis"],
                                                   wq["block"])
        else:
            w = consts[n.input[1]]
            s_w, _ = _ort_weight_scale(w)
            s_w = np.asarray(s_w, np.float32)
        row = {"node": n.name, "op_type": n.op_type, "bias": c["bias"],
               "scale_dtype": str(np.asarray(s_w).dtype), "n_channels": int(bias.size)}
        try:
            b_new, q_int = simulate_bias_requant(bias, s_in, s_w)
        except StageError as e:
            found.append(Finding("bias_requant", n.name, c["bias"],
                                    f"{c['label']}: {e}", "keep the bias float and "
                                    "check the scale dtypes (input and weight scale must match)"))
            return row_out, found
        beta = float(attr(n, "beta", 1.0)) if n.op_type == "Gemm" else 1.0
        b64 = bias.astype(np.float64).ravel()
        b_new = np.broadcast_to(b_new, b64.shape)
        d = beta * (b_new - b64)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.abs(b64) / (np.abs(s_in.astype(np.float64)).ravel()[0]
                                   * np.abs(np.asarray(s_w, np.float64)).ravel())
        row.update(max_abs_ratio=float(np.nanmax(ratio)) if np.isfinite(ratio).any() else None,
                   n_over_int32=int((ratio > 2 ** 31 - 1).sum()),
                   n_nonfinite=int((~np.isfinite(b_new)).sum()),
                   max_bias_change=float(np.nanmax(np.abs(d))) if d.size else 0.0)
        s_out, zp_out, (qmin, qmax) = _q_params(c["q_out"], consts, prod, model)
        s_out_c = float(s_out.ravel()[0]) if s_out.size == 1 else s_out
        lo_out = (qmin - zp_out) * s_out
        hi_out = (qmax - zp_out) * s_out
        bounds = _activation_bounds(c["chain"], consts)
        if activations is not None and n.output[0] in activations:
            y = activations[n.output[0]]
            ndim = np.ndim(y[0] if isinstance(y, list) else y)
            cax = 1 if n.op_type in ("Conv", "ConvTranspose") else ndim - 1
            ch, frac, cos, n_samples, nonfinite = _output_change_by_samples(
                y, d, cax, bounds, lo_out, hi_out, s_out_c, tol_steps)
            row.update(basis="calibration", n_samples=n_samples,
                       max_change_steps=float(ch.max()) if ch.size else 0.0,
                       frac_elements_changed=frac, output_cosine_min=float(cos.min()),
                       nonfinite_output=nonfinite)
        else:
            wq_in = scale_zero_point(consts, dq_in)
            x_dtype = qdq_int_dtype(model, dq_in, consts, prod)
            xr = int_range(x_dtype) or (0, 255)
            sx = float(np.asarray(wq_in[0], np.float64).ravel()[0])
            zx = 0.0 if wq_in[1] is None else float(np.asarray(wq_in[1], np.float64).ravel()[0])
            x_lo, x_hi = min((xr[0] - zx) * sx, 0.0), max((xr[1] - zx) * sx, 0.0)
            if w is None:
                return row_out, found
            lo, hi = _contribution_bounds(n, w, x_lo, x_hi)
            ch = _worst_change(beta * b64, d, lo, hi, bounds,
                               np.broadcast_to(lo_out, b64.shape),
                               np.broadcast_to(hi_out, b64.shape))
            ch = ch / np.broadcast_to(np.asarray(s_out, np.float64), b64.shape)
            row.update(basis="scales", max_change_steps=float(ch.max()) if ch.size else 0.0)
        bad = np.flatnonzero(ch > tol_steps)
        row.update(channels_changed=bad[:50].tolist(), n_channels_changed=int(bad.size))
        row_out.append(row)
        if not bad.size:
            return row_out, found
        k = int(bad[np.argmax(ch[bad])])
        how = ("on calibration data" if row["basis"] == "calibration" else
               "at worst over the input range its scales allow (no --calib)")
        extra = ""
        if row["basis"] == "calibration":
            extra = (f"; {100 * row['frac_elements_changed']:.2g} % of its output elements change,"
                     f" output cosine min {row['output_cosine_min']:.4f}")
        msg = (f"{c['label']}: ORT's WeightBiasQuantization re-quantizes bias "
               f"{c['bias']} to int32 with scale input_scale x weight_scale in "
               f"{row['scale_dtype']}; {bad.size} of {b64.size} channel(s) change enough to move "
               f"the output by more than {tol_steps:g} quantization step(s) {how}: worst channel "
               f"{k}, bias {b64[k]:.4g} -> {b_new[k]:.4g} (int32 {int(q_int[k % q_int.size])}), "
               f"output change {ch[k]:.4g} steps of {float(np.asarray(s_out).ravel()[0]):.4g}"
               + extra)
        fix = ("keep the scales fp32 (ModelOpt --high_precision_dtype fp32) if they are fp16; "
               "otherwise quantize the bias yourself (int32, scale s_in*s_w) or keep this node in "
               "float; meanwhile run ORT with --disable-optimizer WeightBiasQuantization (stage 3) "
               "or --opt-level disable, and do not report its ORT numbers as the quantization "
               "result")
        found.append(Finding("bias_requant", n.name, c["bias"], msg, fix, row))
        return row_out, found

    findings, rows = [], []
    # one candidate node per task: NumPy's array operations release the GIL, so the nodes of a
    # large model are simulated on two threads (the same results, in the graph's order)
    cands = list(wbq_candidates(model, consts))
    with ThreadPoolExecutor(max_workers=min(2, max(1, len(cands)))) as pool:
        for r, f in pool.map(one, cands):
            rows += r
            findings += f
    return findings, rows


def candidate_outputs(path: Path | str, data: dict[str, np.ndarray], tensors: list[str],
                      limit: int = 32, concat: bool = True) -> dict[str, np.ndarray | list]:
    """Run ``path`` on ORT's CPU EP in the graph's own numerics (its Q/DQ rewrites off, the
    optimised graph checked node by node, else every optimisation off:
    :func:`deploykit.quant.reference.qdq_reference_runner`) and return ``tensors`` (node
    outputs made graph outputs) for the first ``limit`` samples of ``data``, in chunks that fit a
    static batch axis: ``{tensor: array [n, ...]}``, or with ``concat=False`` the list of the
    runs' arrays in sample order (no copy of them into one: what check_bias_requant takes).

    Raises:
        StageError: ORT cannot load or run the model.
    """
    import onnx

    from deploykit.quant.reference import qdq_reference_runner

    if not tensors:
        return {}
    model = load_onnx(path)
    have = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=t))
    inputs = graph_inputs(model)
    static = {d[0] for _, d, _ in inputs if d and d[0]}
    batch = min(static) if static else 8
    n = min(limit, min(len(v) for v in data.values()))
    try:
        runner, _ = qdq_reference_runner(model.SerializeToString())
        with runner:
            parts: dict[str, list] = defaultdict(list)
            for i in range(0, n - n % batch if static else n, batch):
                feed = {name: np.asarray(data[name][i:i + batch]) for name, _, _ in inputs}
                for t, v in zip(tensors, runner.session.run(tensors, feed)):
                    parts[t].append(np.asarray(v))
    except Exception as e:  # noqa: BLE001
        raise StageError(f"onnxruntime cannot run {path} on the calibration data: "
                         f"{e}") from e
    return {t: np.concatenate(v) if concat else v for t, v in parts.items()}


# --------------------------------------------------------------------------------------------
# Quantized bias scale
# --------------------------------------------------------------------------------------------
def check_bias_scales(model, consts: dict | None = None) -> list[Finding]:
    """int32 biases (DequantizeLinear of a constant) whose scale is not ``s_in * s_w``."""
    consts = constants(model) if consts is None else consts
    prod = producers(model)
    out = []
    for n in model.graph.node:
        if n.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(n.input) < 3 or not n.input[2]:
            continue
        dq_b, dq_in, dq_w = (prod.get(n.input[i]) for i in (2, 0, 1))
        if not all(d is not None and d.op_type == "DequantizeLinear" for d in (dq_b, dq_in, dq_w)):
            continue
        s_b, s_in, s_w = (consts.get(d.input[1]) for d in (dq_b, dq_in, dq_w))
        if s_b is None or s_in is None or s_w is None or s_in.size != 1:
            continue
        expected = (float(np.asarray(s_in, np.float64).ravel()[0])
                    * np.asarray(s_w, np.float64).ravel())
        actual = np.broadcast_to(np.asarray(s_b, np.float64).ravel(), expected.shape) \
            if np.asarray(s_b).size in (1, expected.size) else None
        if actual is None:
            continue
        tol = 2e-3 if np.float16 in (s_b.dtype, s_in.dtype, s_w.dtype) else 1e-5
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = actual / expected
        # equal scales match, zeros too (a pruned channel: weight scale 0, bias scale 0)
        bad = np.flatnonzero(~((np.abs(ratio - 1) <= tol) | (actual == expected)))
        if not bad.size:
            continue
        k = int(bad[0])
        out.append(Finding(
            "bias_scale_mismatch", n.name, dq_b.input[1],
            f"{n.name} ({n.op_type}): int32 bias {dq_b.input[0]} has scale {actual[k]:.6g} but "
            f"input_scale x weight_scale is {expected[k]:.6g} (ratio {ratio[k]:.4g}) in {bad.size} "
            f"of {expected.size} channel(s): ONNX QLinearConv requires bias scale = x_scale x "
            "w_scale, and an integer kernel that fuses this node reads the int32 values with that "
            "scale, i.e. a bias off by the ratio",
            "re-quantize the bias as round(b_float / (s_in * s_w)) with scale s_in * s_w, or "
            "leave the bias in float",
            {"ratio_min": float(np.nanmin(ratio)), "ratio_max": float(np.nanmax(ratio)),
             "n_channels": int(bad.size)}))
    return out
