"""Q/DQ arithmetic and graph helpers: integer ranges, quantize/dequantize with axis and block,
scale/zero-point lookup, weight DequantizeLinear nodes and their consumers, and findings.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable
import numpy as np

from deploykit.onnx.graph import attr


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


def broadcast_param(p: np.ndarray, shape: tuple, axis: int, block: int) -> np.ndarray:
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
    s = broadcast_param(scale, q.shape, axis, block_size)
    zp = 0.0 if zero_point is None else broadcast_param(zero_point, q.shape, axis, block_size)
    return (q.astype(np.float64) - zp) * s


def quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, dtype,
             axis: int = 1, block_size: int = 0) -> np.ndarray:
    """ONNX QuantizeLinear (round half to even, saturate to ``dtype``) as int64."""
    x = np.asarray(x, np.float64)
    s = broadcast_param(scale, x.shape, axis, block_size)
    zp = 0.0 if zero_point is None else broadcast_param(zero_point, x.shape, axis, block_size)
    lo, hi = int_range(dtype) or (-(2 ** 31), 2 ** 31 - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x / s) + zp
    return np.clip(np.nan_to_num(q), lo, hi).astype(np.int64)


def scale_zero_point(model_consts: dict, node) -> tuple[np.ndarray | None, np.ndarray | None]:
    s = model_consts.get(node.input[1]) if len(node.input) > 1 else None
    zp = model_consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return s, zp


def qdq_int_dtype(model, node, consts: dict, prod: dict):
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
            return qdq_int_dtype(model, src, consts, prod)
    out_dt = attr(node, "output_dtype", 0)
    if out_dt:
        return np.dtype(helper.tensor_dtype_to_np_dtype(out_dt))
    return np.dtype(np.uint8)


def dq_weight(dq, consts: dict, prod: dict) -> dict | None:
    """Integer weight behind a DequantizeLinear: the constant data, or a float constant behind
    a QuantizeLinear (quantized here as ONNX does). None if the data is not constant.

    Returns:
        ``{"q" int64, "scale", "zp", "axis", "block", "dtype", "float": float weight or None,
        "data_name"}``.
    """
    s, zp = scale_zero_point(consts, dq)
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
        qs, qzp = scale_zero_point(consts, src)
        dtype = qdq_int_dtype(None, src, consts, prod)
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


def weight_consumers(tensor: str, cons: dict) -> list[tuple[Any, int]]:
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


def channel_rows(a: np.ndarray, axis: int) -> np.ndarray:
    """``[C, -1]`` view of ``a`` with the ``axis`` channels first."""
    return np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)


def fmt_list(items: Iterable, n: int = 6) -> str:
    items = list(items)
    more = f" ... ({len(items)} in all)" if len(items) > n else ""
    return ", ".join(map(str, items[:n])) + more
