"""Empirical bias correction of a Q/DQ ONNX model (Nagel et al. 2019, "Data-Free Quantization
Through Weight Equalization and Bias Correction", section 4.2, empirical variant; the same rule
as NNCF's ``fast_bias_correction``/``BiasCorrection``).

Quantization shifts the mean of a layer's output: ``E[W_q x_q] != E[W x]``. For each quantized
Conv/Gemm the per-output-channel mean of ``y_q - y_fp`` over calibration data (and over the
spatial positions) is subtracted from its float bias, so the quantized layer is unbiased on that
data. ``y_q`` is the layer's output in the Q/DQ graph (upstream quantization error included) and
``y_fp`` the same tensor in the float graph, so the correction also absorbs the mean shift that
arrives from upstream layers, where it starts: the
layers are corrected one at a time in graph order, each measured after the corrections before it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from . import graph
from .ort_static import session


def _quantized_layers(qmodel: onnx.ModelProto, op_types=("Conv", "Gemm")) -> list[onnx.NodeProto]:
    return [n for n in qmodel.graph.node if n.op_type in op_types and graph.is_quantized(qmodel, n)]


def _channel_mean(y: np.ndarray) -> tuple[np.ndarray, int]:
    """Sum over every axis but 1 and the count (for a running mean)."""
    axes = tuple(i for i in range(y.ndim) if i != 1)
    return y.astype(np.float64).sum(axis=axes), int(np.prod([y.shape[a] for a in axes]))


def measure_bias_error(fp32: onnx.ModelProto, qmodel: onnx.ModelProto, x: np.ndarray,
                       layers: Sequence[str] | None = None, batch: int = 10
                       ) -> dict[str, np.ndarray]:
    """Per-channel mean output error ``E[y_q - y_fp]`` of the quantized Conv/Gemm layers.

    Args:
        fp32: the float model the Q/DQ model was made from (same node and tensor names).
        qmodel: Q/DQ model.
        x: float32 inputs ``[N, C, H, W]`` (calibration data).
        layers: node names to measure (default: every quantized Conv/Gemm).
        batch: images per ORT run.
    Returns:
        ``{node name: float64 [C_out]}``.
    Raises:
        KeyError: a layer's output tensor is missing from the float model.
    """
    nodes = {n.name: n for n in qmodel.graph.node}
    fnodes = {n.name: n for n in fp32.graph.node}
    names = list(layers) if layers is not None else [n.name for n in _quantized_layers(qmodel)]
    missing = [k for k in names if k not in fnodes]
    if missing:
        raise KeyError(f"nodes not in the float model: {missing[:5]}")
    # by node, not by tensor name: ORT's quantize_static gives a conv whose Clip it removed the
    # Clip's output name, so the same name holds pre-activation values in the Q/DQ graph
    outs = [nodes[k].output[0] for k in names]
    fouts = [fnodes[k].output[0] for k in names]
    sq = session(graph.with_outputs(qmodel, outs).SerializeToString(), optimize=False)
    sf = session(graph.with_outputs(fp32, fouts).SerializeToString(), optimize=False)
    acc = {k: 0.0 for k in names}
    cnt = {k: 0 for k in names}
    for (sl, yq), (_, yf) in zip(graph.run_batches(sq, x, outs, batch),
                                 graph.run_batches(sf, x, fouts, batch)):
        for k, a, b in zip(names, yq, yf):
            s, c = _channel_mean(a - b)
            acc[k] = acc[k] + s
            cnt[k] += c
    return {k: acc[k] / cnt[k] for k in names}


def apply_bias_shift(qmodel: onnx.ModelProto, shifts: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Copy of ``qmodel`` with ``bias -= shift`` per layer (a zero bias is added where a layer
    has none). Biases must be float initializers (ORT ``quantize_static`` with
    ``QuantizeBias=False``, or ModelOpt's Q/DQ output).

    Raises:
        ValueError: a bias that is not a float initializer (e.g. an int32 quantized bias).
    """
    m = onnx.ModelProto()
    m.CopyFrom(qmodel)
    inits = graph.initializers(m)
    nodes = {n.name: n for n in m.graph.node}
    for k, d in shifts.items():
        n = nodes[k]
        if len(n.input) > 2 and n.input[2]:
            bname = n.input[2]
            if bname not in inits:
                raise ValueError(f"{k}: bias {bname} is not an initializer (quantized bias?)")
            b = numpy_helper.to_array(inits[bname])
            if b.dtype != np.float32:
                raise ValueError(f"{k}: bias {bname} is {b.dtype}, not float32")
            graph.set_initializer(m, bname, (b - d).astype(np.float32))
        else:
            bname = f"{k}_bias_corrected"
            m.graph.initializer.append(numpy_helper.from_array((-d).astype(np.float32), bname))
            while len(n.input) < 3:
                n.input.append("")
            n.input[2] = bname
    return m


def _channel_means(model: onnx.ModelProto, outs: Sequence[str], x: np.ndarray, batch: int,
                   exact: bool) -> list[np.ndarray]:
    sess = session(graph.with_outputs(model, outs).SerializeToString(), optimize=not exact,
                   qdq_as_float=not exact)
    acc = [0.0] * len(outs)
    cnt = [0] * len(outs)
    for _, ys in graph.run_batches(sess, x, list(outs), batch):
        for i, y in enumerate(ys):
            s_, c = _channel_mean(y)
            acc[i] = acc[i] + s_
            cnt[i] += c
    return [a / c for a, c in zip(acc, cnt)]


def bias_correct(fp32: onnx.ModelProto, qmodel: onnx.ModelProto, x: np.ndarray,
                 batch: int = 25, exact: bool = False, layers: Sequence[str] | None = None,
                 ) -> tuple[onnx.ModelProto, list[dict]]:
    """Empirical bias correction (Nagel et al. 2019, sec. 4.2; AIMET's empirical variant),
    layer by layer in graph order: each layer's shift is measured with every layer before it
    already corrected, so a shift that arrives from upstream is removed once, where it starts.
    (Correcting all layers from one measurement over-corrects: each layer would also remove
    the upstream shift its predecessors remove; measured: 1.3 % agreement on Lite0.)

    Args:
        fp32, qmodel: float model and its Q/DQ model (same node names).
        x: calibration inputs, float32 ``[N, C, H, W]``.
        batch: images per ORT run.
        exact: measure with optimisations off (slow); default: Q/DQ run as float ops with ORT's
            graph optimisations (``session.disable_quant_qdq``), enough for a mean.
        layers: node names (default: every quantized Conv/Gemm).
    Returns:
        ``(corrected model, [{"node", "mean_abs_shift"}])``.
    """
    fnodes = {n.name: n for n in fp32.graph.node}
    names = list(layers) if layers is not None else [n.name for n in _quantized_layers(qmodel)]
    ref = dict(zip(names, _channel_means(fp32, [fnodes[k].output[0] for k in names], x, batch,
                                         True)))
    m = qmodel
    log = []
    for k in names:
        out = next(n for n in m.graph.node if n.name == k).output[0]
        (mq,) = _channel_means(m, [out], x, batch, exact)
        d = mq - ref[k]
        log.append({"node": k, "mean_abs_shift": float(np.abs(d).mean())})
        m = apply_bias_shift(m, {k: d})
    return m, log
