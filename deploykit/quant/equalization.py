"""Cross-layer equalization (CLE) of consecutive convolutions in a float ONNX model
(Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization and Bias Correction",
section 4.1).

For a pair ``conv1 -> act -> conv2`` with a positively homogeneous ``act`` (identity, Relu, or
Clip(0, c) rewritten as below), output channel ``i`` of conv1 is divided by ``s_i`` and input
channel ``i`` of conv2 multiplied by ``s_i``, with ``s_i = sqrt(r1_i / r2_i)`` (``r1_i``: range
of conv1's output channel i weights, ``r2_i``: range of conv2's input channel i weights), so
both become ``sqrt(r1_i * r2_i)``: the per-channel weight ranges are equalized and the function
is unchanged. A depthwise conv2 (group = channels) takes ``s_i`` on its channel ``i``.

ReLU6 is not positively homogeneous (``relu6(x / s) != relu6(x) / s``); the paper replaces it
by ReLU. Here ``Clip(x, 0, c)`` between the pair becomes ``Min(Relu(x), c / s)`` with a
per-channel bound, which is exact: the float function is unchanged.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import graph


def _scalar(model, name, default):
    if not name:
        return default
    inits = graph.initializers(model)
    if name in inits:
        return float(numpy_helper.to_array(inits[name]))
    return None


def find_pairs(model: onnx.ModelProto) -> list[tuple[str, str | None, str]]:
    """``(conv1, activation node or None, conv2)`` pairs CLE can rescale: conv1's output (or its
    single Relu/Clip(0, c)) feeds only conv2 and is no graph output, conv2 is group 1 or depthwise over those channels,
    weights are initializers.

    Returns:
        node-name triples in graph order.
    """
    inits = graph.initializers(model)
    cons = graph.consumers(model)
    outs = {o.name for o in model.graph.output}
    pairs = []
    for n in model.graph.node:
        if n.op_type != "Conv" or n.input[1] not in inits:
            continue
        c = cons.get(n.output[0], [])
        if len(c) != 1 or n.output[0] in outs:
            continue
        act, nxt = None, c[0]
        if nxt.op_type in ("Relu", "Clip"):
            if nxt.op_type == "Clip":
                lo = _scalar(model, nxt.input[1] if len(nxt.input) > 1 else "", None)
                if lo != 0.0:
                    continue
            act = nxt
            c2 = cons.get(nxt.output[0], [])
            if len(c2) != 1 or nxt.output[0] in outs:
                continue
            nxt = c2[0]
        if nxt.op_type != "Conv" or nxt.input[1] not in inits or len(cons.get(nxt.input[0], [])) != 1:
            continue
        w1 = numpy_helper.to_array(inits[n.input[1]])
        w2 = numpy_helper.to_array(inits[nxt.input[1]])
        g2 = graph.attr(nxt, "group", 1)
        ok = (g2 == 1 and w2.shape[1] == w1.shape[0]) or (
            g2 == w1.shape[0] and w2.shape[0] == w1.shape[0] and w2.shape[1] == 1)
        if not ok:
            continue
        pairs.append((n.name, act.name if act is not None else None, nxt.name))
    return pairs


def _precision(r: np.ndarray) -> float:
    """DFQ's per-tensor precision of per-tensor weight quantization: mean_i r_i / max_j r_j."""
    return float(np.mean(r / max(r.max(), 1e-30)))


def channel_ranges(w: np.ndarray, axis: int) -> np.ndarray:
    """max |w| per index of ``axis`` (float64)."""
    axes = tuple(i for i in range(w.ndim) if i != axis)
    return np.abs(w).max(axis=axes).astype(np.float64)


def equalize(model: onnx.ModelProto, s_min: float = 1e-3, s_max: float = 1e3) -> tuple[onnx.ModelProto, list[dict]]:
    """Cross-layer equalization of every pair :func:`find_pairs` finds.

    Args:
        model: float ONNX model (Conv weights/biases as initializers).
        s_min, s_max: clamp of the per-channel scale (channels with all-zero weights).
    Returns:
        ``(model, [{"conv1", "conv2", "depthwise", "precision_before", "precision_after",
        "max_range_ratio_after"}])``; precision = ``mean_i r_i / max_j r_j`` of conv1's output
        channels and conv2's input channels (the quantity DFQ maximises, 1 = equal ranges);
        after CLE ``r1_i == r2_i`` (ratio 1 up to the scale clamp). Pairs are processed once, in graph order (a depthwise conv is conv2 of one pair
        and conv1 of the next: the second pair sees the first one's scaling).
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    log = []
    pairs = find_pairs(m)
    for c1, a, c2 in pairs:
        nodes = {n.name: n for n in m.graph.node}
        inits = graph.initializers(m)
        n1, n2 = nodes[c1], nodes[c2]
        w1 = numpy_helper.to_array(inits[n1.input[1]]).astype(np.float64)
        w2 = numpy_helper.to_array(inits[n2.input[1]]).astype(np.float64)
        dw = graph.attr(n2, "group", 1) != 1
        r1 = channel_ranges(w1, 0)
        r2 = channel_ranges(w2, 0 if dw else 1)
        s = np.clip(np.sqrt(r1 / np.maximum(r2, 1e-12)), s_min, s_max)
        s = np.where((r1 > 0) & (r2 > 0), s, 1.0)
        shp1 = (-1,) + (1,) * (w1.ndim - 1)
        w1n = w1 / s.reshape(shp1)
        graph.set_initializer(m, n1.input[1], w1n.astype(np.float32))
        if len(n1.input) > 2 and n1.input[2]:
            b1 = numpy_helper.to_array(inits[n1.input[2]]).astype(np.float64)
            graph.set_initializer(m, n1.input[2], (b1 / s).astype(np.float32))
        w2n = w2 * (s.reshape(shp1) if dw else s.reshape((1, -1) + (1,) * (w2.ndim - 2)))
        graph.set_initializer(m, n2.input[1], w2n.astype(np.float32))
        if a is not None and nodes[a].op_type == "Clip":
            an = nodes[a]
            hi = _scalar(m, an.input[2] if len(an.input) > 2 else "", np.inf)
            if hi is None:
                raise ValueError(f"{a}: Clip bound is not an initializer")
            if np.isfinite(hi):
                _clip_to_relu_min(m, an, hi / s)
        r1n = channel_ranges(w1n, 0)
        r2n = channel_ranges(w2n, 0 if dw else 1)
        log.append({"conv1": c1, "conv2": c2, "depthwise": bool(dw),
                    "precision_before": [_precision(r1), _precision(r2)],
                    "precision_after": [_precision(r1n), _precision(r2n)],
                    "max_range_ratio_after": float(np.max(np.maximum(r1n, 1e-30) /
                                                          np.maximum(r2n, 1e-30)))})
    return m, log


def _clip_to_relu_min(m: onnx.ModelProto, clip: onnx.NodeProto, bound: np.ndarray) -> None:
    """Replace ``Clip(x, 0, c)`` by ``Min(Relu(x), bound[C])`` in place (bound per channel,
    broadcast over N, H, W)."""
    bname = f"{clip.name}_cle_bound"
    arr = bound.astype(np.float32).reshape(1, -1, 1, 1)
    m.graph.initializer.append(numpy_helper.from_array(arr, bname))
    relu_out = f"{clip.output[0]}_cle_relu"
    relu = helper.make_node("Relu", [clip.input[0]], [relu_out], name=f"{clip.name}_cle_relu")
    mn = helper.make_node("Min", [relu_out, bname], [clip.output[0]], name=f"{clip.name}_cle_min")
    nodes = list(m.graph.node)
    k = next(i for i, n in enumerate(nodes) if n.name == clip.name)
    del m.graph.node[k]
    m.graph.node.insert(k, mn)
    m.graph.node.insert(k, relu)
