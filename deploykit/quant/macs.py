"""MACs per compute node (Conv, Gemm, MatMul) and which run in INT8 in a Q/DQ model.
"""
from __future__ import annotations

import numpy as np

# MAC_OPS, INT8_TYPES and int8_mac_nodes are graph queries (deploykit.onnx.graph); here for the
# modules that count MACs
from deploykit.onnx.graph import (INT8_TYPES, MAC_OPS, attr, constants,  # noqa: F401
                                   int8_mac_nodes, is_int8_mac, producers)


# --------------------------------------------------------------------------------------------
# MACs
# --------------------------------------------------------------------------------------------
def _shapes_at_batch_1(model) -> dict[str, list[int]]:
    """``{tensor: static dims}`` from ONNX shape inference on a copy of ``model`` whose inputs'
    dynamic axis 0 is set to 1 (one sample); tensors with unknown dims are left out."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    inits = {i.name for i in m.graph.initializer}
    for i in m.graph.input:
        if i.name in inits:
            continue
        dims = i.type.tensor_type.shape.dim
        if dims and not (dims[0].HasField("dim_value") and dims[0].dim_value > 0):
            dims[0].ClearField("dim_param")
            dims[0].dim_value = 1
    try:
        m = onnx.shape_inference.infer_shapes(m)
    except Exception:  # noqa: BLE001 - best effort: unknown shapes give unknown MACs
        pass
    out = {}
    for v in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        dims = v.type.tensor_type.shape.dim
        if v.type.tensor_type.HasField("shape") and all(
                d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            out[v.name] = [int(d.dim_value) for d in dims]
    for t in m.graph.initializer:
        out[t.name] = list(t.dims)
    return out


def mac_table(model) -> list[dict]:
    """MACs per sample of every Conv/ConvTranspose/Gemm/MatMul node and whether it computes in
    INT8 (its data input and its weight, inputs 0 and 1, both come from 8-bit
    DequantizeLinear nodes; weight-only INT4 is not INT8 compute).

    MACs (multiply-accumulates, one sample): Conv = output elements x (C_in / group) x kernel
    size = prod(output shape) x prod(weight shape[1:]); ConvTranspose = input elements x
    (C_out / group) x kernel size; Gemm/MatMul = output elements x K. Shapes come from ONNX
    shape inference at batch 1.

    Returns:
        ``[{"name", "op_type", "macs" (int, or None when a shape is unknown), "int8"}]`` in
        graph order.
    """
    shapes = _shapes_at_batch_1(model)
    consts = constants(model)
    prod = producers(model)
    rows = []
    for n in model.graph.node:
        if n.op_type not in MAC_OPS:
            continue
        macs = None
        a = shapes.get(n.input[0]) if n.input else None
        w = shapes.get(n.input[1]) if len(n.input) > 1 else None
        y = shapes.get(n.output[0])
        try:
            if n.op_type == "Conv" and y and w:
                macs = int(np.prod(y)) * int(np.prod(w[1:]))
            elif n.op_type == "ConvTranspose" and a and w:
                macs = int(np.prod(a)) * int(np.prod(w[1:]))
            elif n.op_type == "Gemm" and y and a:
                k = a[0] if attr(n, "transA", 0) else a[-1]
                macs = int(np.prod(y)) * int(k)
            elif n.op_type == "MatMul" and y and a:
                macs = int(np.prod(y)) * int(a[-1])
        except (IndexError, TypeError):
            macs = None
        rows.append({"name": n.name, "op_type": n.op_type, "macs": macs,
                     "int8": is_int8_mac(n, consts, prod)})
    return rows


def mac_summary(model) -> dict:
    """The fraction of a model's MACs that compute in INT8 (:func:`mac_table`).

    Returns:
        ``{"total_macs", "int8_macs", "int8_fraction" (0..1, None when no MACs are known),
        "n_nodes", "n_int8_nodes", "unknown" (nodes whose MACs are unknown)}``.
    """
    rows = mac_table(model)
    known = [r for r in rows if r["macs"] is not None]
    total = sum(r["macs"] for r in known)
    int8 = sum(r["macs"] for r in known if r["int8"])
    return {"total_macs": total, "int8_macs": int8,
            "int8_fraction": (int8 / total) if total else None, "n_nodes": len(rows),
            "n_int8_nodes": sum(r["int8"] for r in rows),
            "unknown": [r["name"] for r in rows if r["macs"] is None]}
