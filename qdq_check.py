"""Health check of a Q/DQ ONNX model: the faults that make a quantized model wrong, or wrong on
one backend, found from the file (and, optionally, the float model and calibration data).

Library behind ``python qdq_tools.py check Q.onnx [--fp32 F.onnx] [--calib calib.npz]``. Each
finding names the node or initializer, says what is wrong in numbers and how to fix it:

- ``scale_nan`` / ``scale_inf`` / ``scale_zero`` / ``scale_negative``: a Q/DQ scale that no
  backend can use (ONNX QuantizeLinear divides by it; a negative one flips the sign).
- ``scale_fp16_underflow``: float16 scales below the smallest normal float16 (2^-14): they keep
  only a few significant bits (ModelOpt writes 2^-24 = 5.96e-08 for scales that underflow).
- ``bias_requant``: ONNX Runtime's ``WeightBiasQuantization`` graph optimisation (levels basic
  and above) turns the float bias of a Conv/ConvTranspose/Gemm into int32 with scale
  ``input_scale * weight_scale``, computed in the scales' dtype and cast to int32
  (onnxruntime/core/optimizer/qdq_transformer/weight_bias_quantization.cc, ORT 1.20+); a
  MatMul + Add on a rank-2 input becomes such a Gemm first (``MatMulAddFusion``). The check
  replays exactly that arithmetic with ORT's own kernels (:func:`simulate_bias_requant`) and
  flags only the nodes whose *output* then changes by more than ``tol_steps`` quantization steps
  of the output QuantizeLinear: on calibration data when given, else from the scales alone (the
  worst case over the input range the input scale allows). A large ``bias / (s_in * s_w)``
  alone is not a finding: it often changes nothing (a dead channel clipped either way).
- ``bias_scale_mismatch``: an int32 bias whose DequantizeLinear scale is not
  ``s_in * s_w`` (ONNX QLinearConv: "Bias must be quantized using scale = x_scale * w_scale";
  an integer kernel uses the int32 values with that scale).
- ``per_tensor_grouped``: a grouped/depthwise Conv whose weights share one scale.
- ``dead_channels``: output channels whose quantized weights are all zero or use at most three
  levels (|q - zp| <= 1) because a scale is shared with larger channels (per-tensor, or blocks
  that run across output channels).
- ``block_axis`` / ``block_opset`` / ``block_scale_shape``: a blocked DequantizeLinear whose
  blocks do not run along the reduction axis of its consumer (Gemm ``transB``, MatMul,
  Conv), whose model opset does not define ``block_size`` (DequantizeLinear-21), or whose
  scale shape does not fit its axis.
- ``weight_error`` (with the float model): every weight dequantized and compared with the float
  weight of the same node, relative error per output channel above the bit width's tolerance:
  catches any wrong axis or layout whatever its cause.

Out of scope: what a backend's kernels do with a correct graph, e.g. ORT's u8s8 integer kernels
saturating on x86 CPUs without VNNI (fixed by the session option ``session.x64quantprecision``).
That is measured, not predicted: stage 3's backend cross-check and ``layerwise.py
quant-backend`` compare the optimised run with the graph's own semantics.

Nothing here changes a model.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import common
import onnx_graph
import runners
from onnx_graph import attr, constants, consumers, producers

FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)  # 2^-14 = 6.10e-05

# Integer ranges of the quantized types (ONNX QuantizeLinear saturation bounds).
INT_RANGE = {"int4": (-8, 7), "uint4": (0, 15), "int8": (-128, 127), "uint8": (0, 255),
             "int16": (-32768, 32767), "uint16": (0, 65535),
             "int32": (-2 ** 31, 2 ** 31 - 1)}

# Relative error per output channel (||w_dq - w|| / ||w||) above which a dequantized weight is
# "not the float weight". Uniform max-scaled quantization of a Gaussian-like channel gives about
# step/sqrt(12) / rms = (amax/qmax)/3.46/(amax/3.5) ~ 1/qmax: ~0.8 % at 8 bits, ~14 % at 4 bits
# (measured on the default run's files: INT8 per-channel <= 1.5 %, INT4 awq_clip block 128
# <= 20 %). The tolerances leave a factor 3-7 for heavy-tailed channels; a wrong axis or layout
# gives errors of the order of 100 %.
WEIGHT_REL_TOL = {4: 0.5, 8: 0.1, 16: 0.01}

#: An output that moves by more than this many quantization steps of its QuantizeLinear counts
#: as changed (one step is a rounding tie, which correct int32 bias rounding can cause too).
TOL_STEPS = 1.0


@dataclasses.dataclass
class Finding:
    """One problem: ``kind`` (see the module docstring), the ``node`` and/or ``initializer``
    it is about, a ``message`` with the numbers, the ``fix``, and ``details`` (JSON-able)."""

    kind: str
    node: str | None
    initializer: str | None
    message: str
    fix: str
    details: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------
def int_range(dtype) -> tuple[int, int] | None:
    """``(qmin, qmax)`` of an integer quantized dtype, None for other dtypes."""
    return INT_RANGE.get(np.dtype(dtype).name)


def _broadcast(p: np.ndarray, shape: tuple, axis: int, block: int) -> np.ndarray:
    """A scale or zero point laid out for data of ``shape`` (per-tensor, per-axis along
    ``axis`` or blocked by ``block`` along ``axis``), in float64."""
    p = np.asarray(p, np.float64)
    if p.size == 1 and not block:
        return p.reshape(())
    axis %= len(shape)
    if block:
        return np.take(p, np.arange(shape[axis]) // block, axis=axis)
    lay = [1] * len(shape)
    lay[axis] = -1
    return p.reshape(lay)


def dequantize(q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None,
               axis: int = 1, block_size: int = 0) -> np.ndarray:
    """ONNX DequantizeLinear (per-tensor, per-axis or blocked) in float64.

    Args:
        q: integer data, any shape. scale: scalar/size-1 (per-tensor), 1-D (per-axis along
            ``axis``) or the blocked shape (``ceil(q.shape[axis] / block_size)`` on ``axis``).
        zero_point: same shape as ``scale`` (None = 0). axis: may be negative.
    Returns:
        float64 array of ``q``'s shape.
    """
    q = np.asarray(q)
    s = _broadcast(scale, q.shape, axis, block_size)
    zp = 0.0 if zero_point is None else _broadcast(zero_point, q.shape, axis, block_size)
    return (q.astype(np.float64) - zp) * s


def quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, dtype,
             axis: int = 1, block_size: int = 0) -> np.ndarray:
    """ONNX QuantizeLinear (round half to even, saturate to ``dtype``) as int64."""
    x = np.asarray(x, np.float64)
    s = _broadcast(scale, x.shape, axis, block_size)
    zp = 0.0 if zero_point is None else _broadcast(zero_point, x.shape, axis, block_size)
    lo, hi = int_range(dtype) or (-(2 ** 31), 2 ** 31 - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x / s) + zp
    return np.clip(np.nan_to_num(q), lo, hi).astype(np.int64)


def _scale_zp(model_consts: dict, node) -> tuple[np.ndarray | None, np.ndarray | None]:
    s = model_consts.get(node.input[1]) if len(node.input) > 1 else None
    zp = model_consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return s, zp


def _qdq_int_dtype(model, node, consts: dict, prod: dict):
    """Integer dtype of a Q/DQ node's quantized side: the zero point's dtype, else the data
    initializer's (DQ), else QuantizeLinear's ``output_dtype`` attribute, else uint8 (ONNX
    default)."""
    from onnx import helper

    if len(node.input) > 2 and node.input[2] in consts:
        return consts[node.input[2]].dtype
    if node.op_type == "DequantizeLinear":
        if node.input[0] in consts:
            return consts[node.input[0]].dtype
        src = prod.get(node.input[0])
        if src is not None and src.op_type == "QuantizeLinear":
            return _qdq_int_dtype(model, src, consts, prod)
    out_dt = attr(node, "output_dtype", 0)
    if out_dt:
        return np.dtype(helper.tensor_dtype_to_np_dtype(out_dt))
    return np.dtype(np.uint8)


def _dq_weight(dq, consts: dict, prod: dict) -> dict | None:
    """Integer weight behind a DequantizeLinear: the constant data, or a float constant behind
    a QuantizeLinear (quantized here as ONNX does). None if the data is not constant.

    Returns:
        ``{"q" int64, "scale", "zp", "axis", "block", "dtype", "float": float weight or None,
        "data_name"}``.
    """
    s, zp = _scale_zp(consts, dq)
    if s is None:
        return None
    axis, block = int(attr(dq, "axis", 1)), int(attr(dq, "block_size", 0) or 0)
    if dq.input[0] in consts:
        q = consts[dq.input[0]]
        return {"q": q.astype(np.int64), "scale": s, "zp": zp, "axis": axis, "block": block,
                "dtype": q.dtype, "float": None, "data_name": dq.input[0]}
    src = prod.get(dq.input[0])
    if src is not None and src.op_type == "QuantizeLinear" and src.input[0] in consts:
        w = consts[src.input[0]]
        qs, qzp = _scale_zp(consts, src)
        dtype = _qdq_int_dtype(None, src, consts, prod)
        qaxis, qblock = int(attr(src, "axis", 1)), int(attr(src, "block_size", 0) or 0)
        q = quantize(w, qs if qs is not None else s, qzp, dtype, qaxis, qblock)
        return {"q": q, "scale": s, "zp": zp, "axis": axis, "block": block, "dtype": dtype,
                "float": w, "data_name": src.input[0]}
    return None


def output_axis(node, w_ndim: int, position: int = 1) -> int | None:
    """Axis of a weight (input ``position``) that indexes the node's output channels.

    Conv: 0 (``[C_out, C_in/g, k...]``); ConvTranspose: 1 (``[C_in, C_out/g, k...]``);
    Gemm: 0 with ``transB=1`` (``[N, K]``) else 1; MatMul weight B: the last axis.
    """
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm" and position == 1:
        return 0 if int(attr(node, "transB", 0)) else 1
    if node.op_type == "MatMul" and position == 1:
        return w_ndim - 1
    return None


def reduction_axis(node, w_ndim: int, position: int = 1) -> int | None:
    """Axis of a weight that the node sums over (where INT4 blocks must run).

    Gemm B: 1 with ``transB=1`` (``[N, K]``) else 0; MatMul B ``[..., K, N]``: ndim-2; MatMul A
    ``[..., M, K]``: ndim-1; Conv ``[C_out, C_in/g, k...]``: 1.
    """
    if node.op_type == "Gemm" and position == 1:
        return 1 if int(attr(node, "transB", 0)) else 0
    if node.op_type == "Gemm" and position == 0:
        return 0 if int(attr(node, "transA", 0)) else 1
    if node.op_type == "MatMul":
        return w_ndim - 2 if position == 1 else w_ndim - 1
    if node.op_type in ("Conv", "ConvTranspose"):
        return 1 if node.op_type == "Conv" else 0
    return None


_PASS_THROUGH = ("Cast", "Identity", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze")


def _weight_consumers(tensor: str, cons: dict) -> list[tuple[Any, int]]:
    """``(node, input position)`` of the compute nodes a dequantized weight reaches
    (through Cast/Identity; reshaping ops are followed but make the axis unknown)."""
    out, todo, seen = [], [tensor], set()
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        for c in cons.get(t, []):
            if c.op_type in ("Cast", "Identity"):
                todo.extend(c.output)
            else:
                out.append((c, list(c.input).index(t)))
    return out


def _channels(a: np.ndarray, axis: int) -> np.ndarray:
    """``[C, -1]`` view of ``a`` with the ``axis`` channels first."""
    return np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)


def _fmt_list(items: Iterable, n: int = 6) -> str:
    items = list(items)
    more = f" ... ({len(items)} in all)" if len(items) > n else ""
    return ", ".join(map(str, items[:n])) + more


# --------------------------------------------------------------------------------------------
# Scales
# --------------------------------------------------------------------------------------------
def check_scales(model, consts: dict | None = None) -> list[Finding]:
    """NaN, Inf, zero, negative and float16-subnormal scales of every Q/DQ node, one finding
    per initializer and problem (naming the Q/DQ nodes that use it)."""
    consts = constants(model) if consts is None else consts
    users: dict[str, list[str]] = defaultdict(list)
    for n in model.graph.node:
        if n.op_type in onnx_graph.QDQ_OPS and len(n.input) > 1:
            users[n.input[1]].append(n.name or n.output[0])
    out = []
    fix_dtype = ("quantize with fp32 scales (ModelOpt --high_precision_dtype fp32) and "
                 "recalibrate")
    for name, nodes in users.items():
        s = consts.get(name)
        if s is None or not np.issubdtype(s.dtype, np.floating):
            continue
        v = s.astype(np.float64).ravel()
        where = f"scale {name} ({s.dtype}, {v.size} value(s)) of {_fmt_list(nodes, 3)}"
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
    import export_checks  # value_shapes: ONNX shape inference (imported late: heavier)
    from onnx import helper

    matmuls = [n for n in model.graph.node
               if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]
    if not matmuls:
        return {}
    cons = consumers(model)
    graph_out = {o.name for o in model.graph.output}
    shapes = export_checks.value_shapes(model)
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
        sess = ort.InferenceSession(m.SerializeToString(), runners.ort_session_options("disable"),
                                    providers=["CPUExecutionProvider"])
        y, q = sess.run(["y", "q"], feed)
    except Exception as e:  # noqa: BLE001 - ORT raises its own types
        raise common.StageError(f"cannot replay ORT's bias re-quantization: {e}") from e
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
    s, zp = _scale_zp(consts, q_node)
    dtype = _qdq_int_dtype(model, q_node, consts, prod)
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
    lo, hi = _channels(lo_t, ax).sum(1), _channels(hi_t, ax).sum(1)
    if node.op_type == "ConvTranspose":
        g = int(attr(node, "group", 1))
        lo = np.repeat(lo.reshape(g, -1).sum(0, keepdims=True), g, 0).ravel() if g > 1 else lo
        hi = np.repeat(hi.reshape(g, -1).sum(0, keepdims=True), g, 0).ravel() if g > 1 else hi
    alpha = float(attr(node, "alpha", 1.0)) if node.op_type == "Gemm" else 1.0
    lo, hi = alpha * lo, alpha * hi
    return np.minimum(lo, hi), np.maximum(lo, hi)


def check_bias_requant(model, consts: dict | None = None, activations: dict | None = None,
                       tol_steps: float = TOL_STEPS) -> tuple[list[Finding], list[dict]]:
    """Nodes whose output ORT's bias re-quantization changes by more than ``tol_steps``.

    Args:
        activations: optional ``{node output tensor: float array [N, C, ...] (Gemm [N, C])}``
            of the candidate nodes on calibration data (pre-activation, graph optimisations
            off, see :func:`candidate_outputs`); without it the change is bounded from the
            scales alone.
    Returns:
        ``(findings, rows)``: ``rows`` has one entry per candidate node with the simulated
        bias change and the output change in steps (``basis``: ``calibration`` or ``scales``).
    """
    consts = constants(model) if consts is None else consts
    prod = producers(model)
    findings, rows = [], []
    for c in wbq_candidates(model, consts):
        n, dq_in, dq_w = c["node"], c["dq_in"], c["dq_w"]
        if c["bias"] is None:
            continue  # only the float weight is quantized: not a bias effect
        bias = consts[c["bias"]]
        s_in = consts[dq_in.input[1]]
        if dq_w is not None:
            s_w = consts[dq_w.input[1]]
            wq = _dq_weight(dq_w, consts, prod)
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
        except common.StageError as e:
            findings.append(Finding("bias_requant", n.name, c["bias"],
                                    f"{c['label']}: {e}", "keep the bias float and "
                                    "check the scale dtypes (input and weight scale must match)"))
            continue
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
            y = np.asarray(activations[n.output[0]], np.float64)
            cax = 1 if n.op_type in ("Conv", "ConvTranspose") else y.ndim - 1
            shape = [1] * y.ndim
            shape[cax] = -1
            f0 = _apply_chain(y, bounds, lo_out.reshape(()) if lo_out.size == 1 else lo_out,
                              hi_out.reshape(()) if hi_out.size == 1 else hi_out)
            with np.errstate(invalid="ignore"):
                f1 = _apply_chain(y + d.reshape(shape), bounds,
                                  lo_out.reshape(()) if lo_out.size == 1 else lo_out,
                                  hi_out.reshape(()) if hi_out.size == 1 else hi_out)
                steps = np.abs(np.rint(f1 / s_out_c) - np.rint(f0 / s_out_c))
            steps = np.where(np.isnan(steps), np.inf, steps)
            ch = _channels(steps, cax).max(1)
            cos = common.cosine_rows(f0, np.nan_to_num(f1, nan=0.0))
            row.update(basis="calibration", n_samples=int(len(y)),
                       max_change_steps=float(ch.max()) if ch.size else 0.0,
                       frac_elements_changed=float((steps > tol_steps).mean()),
                       output_cosine_min=float(cos.min()),
                       nonfinite_output=bool(np.isnan(f1).any() and not np.isnan(f0).any()))
        else:
            wq_in = _scale_zp(consts, dq_in)
            x_dtype = _qdq_int_dtype(model, dq_in, consts, prod)
            xr = int_range(x_dtype) or (0, 255)
            sx = float(np.asarray(wq_in[0], np.float64).ravel()[0])
            zx = 0.0 if wq_in[1] is None else float(np.asarray(wq_in[1], np.float64).ravel()[0])
            x_lo, x_hi = min((xr[0] - zx) * sx, 0.0), max((xr[1] - zx) * sx, 0.0)
            if w is None:
                continue
            lo, hi = _contribution_bounds(n, w, x_lo, x_hi)
            ch = _worst_change(beta * b64, d, lo, hi, bounds,
                               np.broadcast_to(lo_out, b64.shape),
                               np.broadcast_to(hi_out, b64.shape))
            ch = ch / np.broadcast_to(np.asarray(s_out, np.float64), b64.shape)
            row.update(basis="scales", max_change_steps=float(ch.max()) if ch.size else 0.0)
        bad = np.flatnonzero(ch > tol_steps)
        row.update(channels_changed=bad[:50].tolist(), n_channels_changed=int(bad.size))
        rows.append(row)
        if not bad.size:
            continue
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
        findings.append(Finding("bias_requant", n.name, c["bias"], msg, fix, row))
    return findings, rows


def candidate_outputs(path: Path | str, data: dict[str, np.ndarray], tensors: list[str],
                      limit: int = 32) -> dict[str, np.ndarray]:
    """Run ``path`` on ORT's CPU EP with graph optimisations off and return ``tensors`` (node
    outputs made graph outputs) for the first ``limit`` samples of ``data``, in chunks that fit a
    static batch axis.

    Raises:
        StageError: ORT cannot load or run the model.
    """
    import onnx
    import onnxruntime as ort

    if not tensors:
        return {}
    model = onnx_graph.load(path)
    have = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=t))
    inputs = onnx_graph.inputs(model)
    static = {d[0] for _, d, _ in inputs if d and d[0]}
    batch = min(static) if static else 8
    n = min(limit, min(len(v) for v in data.values()))
    try:
        sess = ort.InferenceSession(model.SerializeToString(),
                                    runners.ort_session_options("disable"),
                                    providers=["CPUExecutionProvider"])
        parts: dict[str, list] = defaultdict(list)
        for i in range(0, n - n % batch if static else n, batch):
            feed = {name: np.asarray(data[name][i:i + batch]) for name, _, _ in inputs}
            for t, v in zip(tensors, sess.run(tensors, feed)):
                parts[t].append(np.asarray(v))
    except Exception as e:  # noqa: BLE001
        raise common.StageError(f"onnxruntime cannot run {path} on the calibration data: "
                                f"{e}") from e
    return {t: np.concatenate(v) for t, v in parts.items()}


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
        bad = np.flatnonzero(~(np.abs(ratio - 1) <= tol))
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
        wq = _dq_weight(dq, consts, prod)
        if wq is None or wq["q"].ndim < 2:
            continue
        for user, pos in _weight_consumers(dq.output[0], cons):
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
                zp = 0.0 if w["zp"] is None else _broadcast(w["zp"], q.shape, w["axis"],
                                                            w["block"])
            except (ValueError, IndexError):
                own = True  # zero point does not fit its axis: block_scale_shape says so
            if not own and not blocked_own:
                amax = _channels(np.abs(q - zp), oax).max(1)
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
                            f"3 or fewer levels (|q - zp| <= 1: channels {_fmt_list(few.tolist())}"
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
    ops = onnx_graph.opset(model, dom)
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
        r, e = _channels(ref.astype(np.float64), oax), _channels(deq - ref, oax)
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
        activations = candidate_outputs(path, calib, names, calib_limit)
    f, bias_rows = check_bias_requant(model, consts, activations, tol_steps)
    findings += f + check_bias_scales(model, consts) + check_weights(model, consts)
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
