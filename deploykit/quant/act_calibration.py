"""Per-tensor activation range choice for a Q/DQ ONNX model: max, percentile, MSE, entropy,
computed from our own histograms of the float model on calibration data and written into the
model's QuantizeLinear/DequantizeLinear scales and zero points.

Rules: *max* = observed [min, max]; *percentile p* = [q_(100-p), q_p] of the values (TensorRT /
ORT "Percentile" calibrators); *mse* = the clipping range (a fraction of [min, max], grid
search) that minimises the expected squared quantization error of the histogram (as in NNCF's
and ModelOpt's MSE calibrators, Banner et al. 2019 "ACIQ" for the idea); *entropy* = the
threshold minimising KL(P || Q) of the 8-bit histogram (Migacz 2017, TensorRT INT8 calibration),
applied to the upper end of non-negative tensors only.

For a tensor whose Q node implements a removed activation (ORT ``quantize_static`` removes
Clip/Relu after a Conv and quantizes the conv output with the Clip's range), the range is
measured on the *activation's* output in the float model, so the clamp of the quantized range
still implements the activation.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from . import graph
from .ort_static import session

BINS = 2048


def activation_q_nodes(qmodel: onnx.ModelProto) -> list[onnx.NodeProto]:
    """QuantizeLinear nodes whose input is an activation (not an initializer)."""
    inits = graph.initializers(qmodel)
    return [n for n in qmodel.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits]


def _stat_tensor(fp32: onnx.ModelProto, qmodel: onnx.ModelProto, name: str) -> str:
    """The float-model tensor whose values the Q node of ``name`` must represent.

    ORT's ``quantize_static`` removes a Clip/Relu after a Conv and gives the conv the Clip's
    output name, so a name both graphs have holds the *activation's* output in the float graph:
    the range the Q node's clamp must implement. A name only the Q/DQ graph has (e.g.
    ``out_QuantizeLinear_Input``) is mapped through its producer node to the float node's
    output (and on through a single Relu/Clip consumer, if the Q/DQ graph dropped it).
    """
    ftensors = {o for n in fp32.graph.node for o in n.output} | {i.name for i in fp32.graph.input}
    if name in ftensors:
        return name
    qp = graph.producers(qmodel).get(name)
    fnodes = {n.name: n for n in fp32.graph.node}
    if qp is None or qp.name not in fnodes:
        raise KeyError(f"{name}: no float tensor to calibrate it from")
    t = fnodes[qp.name].output[list(qp.output).index(name)]
    c = graph.consumers(fp32).get(t, [])
    qnames = {n.name for n in qmodel.graph.node}
    if len(c) == 1 and c[0].op_type in ("Relu", "Clip") and c[0].name not in qnames:
        return c[0].output[0]
    return t


def collect_histograms(fp32: onnx.ModelProto, tensors: Sequence[str], x: np.ndarray,
                       batch: int = 10, bins: int = BINS) -> dict[str, dict]:
    """Min, max and a ``bins``-bin histogram over [min, max] of each float tensor.

    Args:
        fp32: float model; tensors: its tensor names; x: float32 inputs ``[N, ...]``.
    Returns:
        ``{name: {"min": float, "max": float, "hist": int64 [bins], "edges": float64 [bins+1]}}``.
    """
    tensors = list(dict.fromkeys(tensors))
    s = session(graph.with_outputs(fp32, tensors).SerializeToString(), optimize=False)
    lo = {t: np.inf for t in tensors}
    hi = {t: -np.inf for t in tensors}
    for _, ys in graph.run_batches(s, x, tensors, batch):
        for t, y in zip(tensors, ys):
            lo[t] = min(lo[t], float(y.min()))
            hi[t] = max(hi[t], float(y.max()))
    out = {}
    for t in tensors:
        a, b = min(lo[t], 0.0), max(hi[t], 0.0)
        if b <= a:
            b = a + 1e-8
        out[t] = {"min": a, "max": b, "hist": np.zeros(bins, np.int64),
                  "edges": np.linspace(a, b, bins + 1)}
    for _, ys in graph.run_batches(s, x, tensors, batch):
        for t, y in zip(tensors, ys):
            h, _ = np.histogram(y, bins=out[t]["edges"])
            out[t]["hist"] += h
    return out


def _qdq_err(centers, counts, lo, hi, levels):
    scale = (hi - lo) / levels
    if scale <= 0:
        return np.inf
    zp = np.round(-lo / scale)
    q = np.clip(np.round(centers / scale) + zp, 0, levels)
    return float(np.sum(counts * ((q - zp) * scale - centers) ** 2))


def choose_range(h: dict, method: str, levels: int = 255) -> tuple[float, float]:
    """Range ``(lo, hi)`` (lo <= 0 <= hi) of one tensor by ``method``.

    Args:
        h: one entry of :func:`collect_histograms`.
        method: ``max``, ``percentile:<p>`` (e.g. ``percentile:99.99``), ``mse`` or ``entropy``.
        levels: quantization steps (255 for 8 bits).
    Raises:
        ValueError: unknown method.
    """
    lo, hi = h["min"], h["max"]
    counts = h["hist"].astype(np.float64)
    edges = h["edges"]
    centers = 0.5 * (edges[:-1] + edges[1:])
    if method == "max":
        return lo, hi
    if method.startswith("percentile"):
        p = float(method.split(":")[1]) if ":" in method else 99.99
        cdf = np.cumsum(counts) / counts.sum()
        new_hi = float(edges[1:][np.searchsorted(cdf, p / 100.0)]) if hi > 0 else 0.0
        new_lo = float(edges[:-1][np.searchsorted(cdf, 1 - p / 100.0)]) if lo < 0 else 0.0
        return min(new_lo, 0.0), max(new_hi, 0.0)
    if method == "mse":
        best, arg = np.inf, (lo, hi)
        for f in np.linspace(0.2, 1.0, 81):
            e = _qdq_err(centers, counts, lo * f, hi * f, levels)
            if e < best:
                best, arg = e, (lo * f, hi * f)
        return arg
    if method == "entropy":
        if lo < 0:  # signed tensors: entropy only defined here for the upper tail
            return choose_range(h, "mse", levels)
        nb = len(counts)
        best, arg = np.inf, hi
        p_all = counts
        start = max(128, nb // 16)
        for i in range(start, nb + 1, max(1, nb // 256)):
            p = p_all[:i].copy()
            p[-1] += p_all[i:].sum()  # reference: the outliers clipped into the last bin
            if p.sum() == 0:
                continue
            # candidate: the first i bins (without the outliers) merged into 128 levels and
            # expanded back over their non-empty bins (TensorRT's rule, Migacz 2017)
            head = p_all[:i]
            idx = np.linspace(0, i, 129).astype(int)
            qd = np.zeros(i)
            for a_, b_ in zip(idx[:-1], idx[1:]):
                nz = head[a_:b_] > 0
                if nz.any():
                    qd[a_:b_][nz] = head[a_:b_].sum() / nz.sum()
            pn, qn = p / p.sum(), qd / max(qd.sum(), 1e-12)
            m = pn > 0
            kl = float(np.sum(pn[m] * np.log(pn[m] / np.maximum(qn[m], 1e-12))))
            if kl < best:
                best, arg = kl, float(edges[i])
        return 0.0, arg
    raise ValueError(f"unknown method {method}")


def set_ranges(qmodel: onnx.ModelProto, ranges: dict[str, tuple[float, float]]
               ) -> onnx.ModelProto:
    """Copy of ``qmodel`` whose activation Q nodes (by input tensor name) and the DQ nodes fed by
    them get the scale/zero point of the given ranges (uint8: asymmetric; int8: symmetric,
    ``max(|lo|, |hi|) / 127``). Scale/zero-point initializers are written per Q node (a shared
    initializer is split).

    Raises:
        ValueError: a zero-point dtype other than uint8/int8.
    """
    m = onnx.ModelProto()
    m.CopyFrom(qmodel)
    inits = graph.initializers(m)
    cons = graph.consumers(m)
    for q in activation_q_nodes(m):
        t = q.input[0]
        if t not in ranges:
            continue
        lo, hi = ranges[t]
        zp_dtype = numpy_helper.to_array(inits[q.input[2]]).dtype if len(q.input) > 2 else np.uint8
        if zp_dtype == np.uint8:
            scale = max((hi - lo) / 255.0, 1e-12)
            zp = np.uint8(np.clip(np.round(-lo / scale), 0, 255))
        elif zp_dtype == np.int8:
            scale = max(max(abs(lo), abs(hi)) / 127.0, 1e-12)
            zp = np.int8(0)
        else:
            raise ValueError(f"{q.name}: zero point {zp_dtype}")
        sname, zname = f"{q.name}_act_scale", f"{q.name}_act_zp"
        m.graph.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), sname),
                                    numpy_helper.from_array(np.array(zp, zp_dtype), zname)])
        for n in [q] + [d for d in cons.get(q.output[0], []) if d.op_type == "DequantizeLinear"]:
            n.input[1] = sname
            if len(n.input) > 2:
                n.input[2] = zname
            else:
                n.input.append(zname)
    return m


def calibrate(fp32: onnx.ModelProto, qmodel: onnx.ModelProto, x: np.ndarray,
              method: str | dict[str, str] = "max", hists: dict | None = None
              ) -> tuple[onnx.ModelProto, dict]:
    """Rewrite every activation range of ``qmodel`` by ``method``.

    Args:
        fp32: float model with the same tensor names; x: calibration inputs float32 ``[N,...]``.
        method: one method for all tensors, or ``{Q-input tensor name: method}`` (tensors not
            named keep their ranges).
        hists: precomputed :func:`collect_histograms` keyed by the *statistics* tensor names
            (reused between methods).
    Returns:
        ``(model, {"ranges": {tensor: (lo, hi)}, "hists": hists})``.
    """
    qs = activation_q_nodes(qmodel)
    stat = {q.input[0]: _stat_tensor(fp32, qmodel, q.input[0]) for q in qs}
    if hists is None:
        hists = collect_histograms(fp32, list(stat.values()), x)
    ranges = {}
    for t, st in stat.items():
        meth = method if isinstance(method, str) else method.get(t)
        if meth is None:
            continue
        ranges[t] = choose_range(hists[st], meth)
    return set_ranges(qmodel, ranges), {"ranges": ranges, "hists": hists, "stat": stat}
