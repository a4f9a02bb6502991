"""Blocked (INT4) DequantizeLinear: axis / scale-shape consistency, the axis repair for ModelOpt
0.47.0's Gemm weights, and blocked dequantization.
"""
from __future__ import annotations

import numpy as np

from deploykit.errors import StageError
from deploykit.onnx.graph import attr, constants


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
        raise StageError(
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
