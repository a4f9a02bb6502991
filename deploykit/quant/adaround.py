"""AdaRound on a Q/DQ ONNX model: the rounding of each quantized Conv/Gemm's int8 weights learned
on calibration data (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training
Quantization", ICML; arXiv:2004.10568).

Round-to-nearest (what ORT's ``quantize_static`` writes) minimises the error of each weight
alone, not the error of the layer's output. AdaRound chooses, per weight, ``floor(W/s)`` or
``floor(W/s) + 1`` to minimise the output error on data (paper eq. 21/25):

    W~ = s * clip(floor(W/s) + h(V) + zp, qmin, qmax) - s*zp,   V learned, one per weight
    h(V) = clip(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)        rectified sigmoid (eq. 23)
    loss = || f_a(W~ x_q + b) - f_a(W x_fp + b) ||^2 + lambda * sum(1 - |2 h(V) - 1|^beta)  (24, 25)

with the paper's constants ``zeta = 1.1, gamma = -0.1`` (sec. 4.1, from Louizos et al. 2018),
``lambda = 0.01``, ``beta`` annealed 20 -> 2, the regulariser off for the first 20 % of the
iterations (sec. 5, "Experimental setup"), Adam, and ``V`` initialised so that ``h(V)`` equals the
fractional part of ``W/s`` (so optimisation starts from the float weights). ``x_q`` is the layer's
input in the *quantized* model with the layers before it already rounded (sequential), and the
target is the float model's output of the layer (the paper's "asymmetric reconstruction", eq. 25),
through the activation ``f_a`` when the float graph applies a Clip/Relu right after the layer
(ORT folds that activation into the quantized output range; ``f_a`` is taken from the float
graph). After optimisation the rounding is made hard (``h(V) >= 0.5`` -> up) and the int8
initializer behind the weight's DequantizeLinear is overwritten; scales, zero points, biases and
the graph are unchanged.

Loss normalisation as in the authors' follow-up code (BRECQ, Li et al. 2021, ``lp_loss``): squared
error summed over output channels, averaged over output positions; the regulariser summed over
the layer's weights, times lambda.

Cost on a 2-core CPU: the loss is computed on output *positions* sampled from the calibration
images (up to ``max_positions`` per layer, their input patches stored once per layer with
``torch.nn.functional.unfold``), ``batch`` positions per Adam step. That is the same per-position
loss as the paper's whole-image batches, estimated on a sample. Deviations from the paper,
stated: ``iters`` (default 500; paper 10k steps of 32 whole images) and ``lr`` (default 1e-2; the
paper's 1e-3 over 10k steps lets ``V`` travel 10, 1e-2 over 500 steps 5, enough to cross the
rectified sigmoid's saturation points at ``|V| = 2.4``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from . import graph
from .ort_static import session

# rectified sigmoid stretch (Nagel et al. 2020, sec. 4.1, eq. 23; Louizos et al. 2018)
ZETA, GAMMA = 1.1, -0.1


@dataclass
class Config:
    """AdaRound hyper-parameters (paper values where marked).

    Attributes:
        iters: Adam steps per layer (paper: 10 000; 500 keeps Lite0 near 10 min on 1 core).
        lr: Adam learning rate (paper: 1e-3; see the module note).
        reg_weight: lambda of the rounding regulariser (paper: 0.01).
        beta: (start, end) of the annealed regulariser exponent (paper: 20 -> 2).
        warmup: fraction of the steps without the regulariser (paper: 0.2).
        batch: output positions per step, at most ``batch_floats / (floats per position)``
            (at least 64): a depthwise 5x5 conv of 1152 channels has 28 800 input floats per
            position, so it gets 145 positions (each channel's 25 weights still see them all).
        max_positions: sampled output positions per layer (pool the batches are drawn from).
        max_pool_bytes: memory cap of one layer's input patches (lowers ``max_positions``).
        capture_batch: images per ORT run when capturing activations.
        seed: position sampling and batch order.
        keep_if_worse: keep round-to-nearest for a layer whose hard AdaRound loss on the pool
            is not lower (a guard; the paper has none).
    """
    iters: int = 500
    lr: float = 1e-2
    reg_weight: float = 0.01
    beta: tuple[float, float] = (20.0, 2.0)
    warmup: float = 0.2
    batch: int = 512
    batch_floats: int = 1 << 22
    max_positions: int = 8192
    max_pool_bytes: int = 512 << 20
    capture_batch: int = 10
    seed: int = 0
    keep_if_worse: bool = True


@dataclass
class Layer:
    """One quantized Conv/Gemm as AdaRound sees it.

    Attributes:
        node: node name (same in the float and the Q/DQ model).
        op: ``"Conv"`` or ``"Gemm"``.
        w_fp: float weight as stored, float32 (Conv ``[O, I/g, kh, kw]``; Gemm as stored).
        q_name: int8 initializer behind the weight's DequantizeLinear.
        q_int: that initializer, int8, same shape as ``w_fp``.
        scale / zp: per-channel scale (float32) and zero point (int), broadcast to ``w_fp``.
        qmin / qmax: integer range of the weights.
        bias: float32 ``[O]`` (zeros if none).
        attrs: Conv ``strides, pads, dilations, group``; Gemm ``transB``.
        act: float-graph activation right after the layer, ``(lo, hi)`` clamp or None.
        x_name: the layer's input tensor in the Q/DQ graph (a DequantizeLinear output).
        y_name: the layer's output tensor in the float graph.
    """
    node: str
    op: str
    w_fp: np.ndarray
    q_name: str
    q_int: np.ndarray
    scale: np.ndarray
    zp: np.ndarray
    qmin: int
    qmax: int
    bias: np.ndarray
    attrs: dict
    act: tuple[float, float] | None
    x_name: str
    y_name: str
    log: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------
# reading the graph
# ------------------------------------------------------------------------------------------
def _const(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    """An initializer's value, or a DequantizeLinear of one dequantized (float32)."""
    if not name:
        return None
    inits = graph.initializers(model)
    if name in inits:
        return numpy_helper.to_array(inits[name])
    p = graph.producers(model).get(name)
    if p is not None and p.op_type == "DequantizeLinear" and p.input[0] in inits:
        q = numpy_helper.to_array(inits[p.input[0]]).astype(np.float32)
        s = numpy_helper.to_array(inits[p.input[1]]).astype(np.float32)
        z = (numpy_helper.to_array(inits[p.input[2]]).astype(np.float32)
             if len(p.input) > 2 and p.input[2] else np.zeros_like(s))
        ax = graph.attr(p, "axis", 1)
        shape = [1] * q.ndim
        if s.ndim:
            shape[ax] = -1
        return (q - z.reshape(shape)) * s.reshape(shape)
    return None


def _activation(fp32: onnx.ModelProto, tensor: str) -> tuple[float, float] | None:
    """``(lo, hi)`` of a Relu/Clip that is the only consumer of ``tensor`` in the float graph."""
    cons = graph.consumers(fp32).get(tensor, [])
    if len(cons) != 1 or tensor in {o.name for o in fp32.graph.output}:
        return None
    c = cons[0]
    if c.op_type == "Relu":
        return (0.0, math.inf)
    if c.op_type == "Clip":
        lo, hi = graph.attr(c, "min", -math.inf), graph.attr(c, "max", math.inf)
        if len(c.input) > 1 and c.input[1]:
            v = _const(fp32, c.input[1])
            if v is None:
                return None
            lo = float(v)
        if len(c.input) > 2 and c.input[2]:
            v = _const(fp32, c.input[2])
            if v is None:
                return None
            hi = float(v)
        return (float(lo), float(hi))
    return None


def quantized_layers(fp32: onnx.ModelProto, qmodel: onnx.ModelProto,
                     op_types: Sequence[str] = ("Conv", "Gemm"),
                     qrange: tuple[int, int] | None = None) -> tuple[list[Layer], list[str]]:
    """The Conv/Gemm nodes of ``qmodel`` whose input and int8 weight come from DequantizeLinear,
    in graph order, with what AdaRound needs of each.

    Args:
        fp32: the float model ``qmodel`` was made from (same node names; float weights).
        qmodel: Q/DQ model (ORT ``quantize_static``: int8 weight initializer -> DQ, axis 0).
        op_types: node types to take.
        qrange: integer range of the weights; default ORT's symmetric int8 range
            ``[-127, 127]`` (``[-128, 127]`` when a layer's stored weights reach -128).
    Returns:
        ``(layers, skipped)``: skipped = ``"name: reason"`` lines.
    """
    qinits = graph.initializers(qmodel)
    finits = graph.initializers(fp32)
    fnodes = {n.name: n for n in fp32.graph.node}
    prod = graph.producers(qmodel)
    layers, skipped = [], []
    for n in qmodel.graph.node:
        if n.op_type not in op_types or not graph.is_quantized(qmodel, n):
            continue
        f = fnodes.get(n.name)
        if f is None or f.input[1] not in finits:
            skipped.append(f"{n.name}: no float weight initializer in the float model")
            continue
        dq = prod[n.input[1]]
        if dq.input[0] not in qinits:
            skipped.append(f"{n.name}: weight DQ input is not an initializer")
            continue
        q = numpy_helper.to_array(qinits[dq.input[0]])
        if q.dtype != np.int8:
            skipped.append(f"{n.name}: weight is {q.dtype}, not int8")
            continue
        w = numpy_helper.to_array(finits[f.input[1]]).astype(np.float32)
        s = numpy_helper.to_array(qinits[dq.input[1]]).astype(np.float32)
        z = (numpy_helper.to_array(qinits[dq.input[2]]).astype(np.int64)
             if len(dq.input) > 2 and dq.input[2] else np.zeros(s.shape, np.int64))
        shape = [1] * w.ndim
        if s.ndim:
            shape[graph.attr(dq, "axis", 1)] = -1
        if n.op_type == "Gemm" and (graph.attr(n, "transA", 0) or graph.attr(n, "alpha", 1.0) != 1
                                    or graph.attr(n, "beta", 1.0) != 1):
            skipped.append(f"{n.name}: Gemm with transA/alpha/beta")
            continue
        if w.shape != q.shape:
            skipped.append(f"{n.name}: float weight {w.shape} vs int8 {q.shape}")
            continue
        b = _const(qmodel, n.input[2]) if len(n.input) > 2 else None
        o = w.shape[0] if n.op_type == "Conv" or graph.attr(n, "transB", 0) else w.shape[1]
        lo, hi = qrange if qrange else ((-128 if int(q.min()) == -128 else -127), 127)
        if n.op_type == "Conv":
            k = w.ndim - 2
            attrs = {"strides": list(graph.attr(n, "strides", [1] * k)),
                     "pads": list(graph.attr(n, "pads", [0] * 2 * k)),
                     "dilations": list(graph.attr(n, "dilations", [1] * k)),
                     "group": int(graph.attr(n, "group", 1))}
            if k != 2 or graph.attr(n, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
                skipped.append(f"{n.name}: only 2-d convs with explicit pads")
                continue
        else:
            attrs = {"transB": int(graph.attr(n, "transB", 0))}
        layers.append(Layer(n.name, n.op_type, w, dq.input[0], q, s.reshape(shape),
                            z.reshape(shape), lo, hi,
                            (np.zeros(o, np.float32) if b is None else b.astype(np.float32)),
                            attrs, _activation(fp32, f.output[0]), n.input[0], f.output[0]))
    return layers, skipped


def _prefix(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """Copy of ``model`` keeping only the nodes the tensors ``outputs`` need; they become the
    graph outputs (float, shape unspecified)."""
    need = set(outputs)
    keep = []
    for n in reversed(model.graph.node):
        if any(o in need for o in n.output):
            keep.append(n)
            need.update(i for i in n.input if i)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.node[:]
    m.graph.node.extend(reversed(keep))
    del m.graph.output[:]
    m.graph.output.extend(onnx.helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None)
                          for o in outputs)
    used = {i for n in keep for i in n.input}
    kept = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(kept)
    return m


# ------------------------------------------------------------------------------------------
# layer maths (torch)
# ------------------------------------------------------------------------------------------
def _patches(layer: Layer, x, pos):
    """Input patches of the output positions ``pos`` of a batch.

    Args:
        x: torch float32 ``[b, C, H, W]`` (Conv) or ``[b, K]`` (Gemm).
        pos: int64 ``[p]`` indices into the flattened ``[b, Ho*Wo]`` outputs (Gemm: ``[b]``).
    Returns:
        float32 ``[p, G, K]``: Conv ``G = group, K = C/G * kh * kw``; Gemm ``G = 1``.
    """
    import torch.nn.functional as F

    if layer.op == "Gemm":
        return x.reshape(x.shape[0], -1)[pos][:, None]
    a = layer.attrs
    kh, kw = layer.w_fp.shape[2:]
    t, l, bo, r = a["pads"][0], a["pads"][1], a["pads"][2], a["pads"][3]
    xp = F.pad(x, (l, r, t, bo)) if any(a["pads"]) else x
    cols = F.unfold(xp, (kh, kw), dilation=a["dilations"], stride=a["strides"])  # [b, C*k, L]
    g = a["group"]
    b, ck, L = cols.shape
    return cols.permute(0, 2, 1).reshape(b * L, g, ck // g)[pos].contiguous()  # [p, G, K]


def _weight_matrix(layer: Layer, w):
    """Weights as ``[G, K, O/G]`` for ``y[:, g] = patches[:, g] @ W[g]`` (torch)."""
    if layer.op == "Gemm":
        return (w if not layer.attrs["transB"] else w.t())[None]
    g = layer.attrs["group"]
    o = w.shape[0]
    return w.reshape(g, o // g, -1).permute(0, 2, 1)


def _forward(layer: Layer, xp, w):
    """Layer output at the sampled positions ``xp`` (``[p, G, K]``), bias and activation
    applied: ``[p, O]`` float32 (torch). Dense: one matmul; depthwise: multiply-sum."""
    import torch

    wm = _weight_matrix(layer, w)                            # [G, K, O/G]
    G, K, og = wm.shape
    if G == 1:
        y = xp[:, 0] @ wm[0]
    elif og == 1:
        y = (xp * wm[:, :, 0]).sum(-1)
    else:
        y = torch.einsum("pgk,gko->pgo", xp, wm).reshape(xp.shape[0], -1)
    y = y + torch.from_numpy(layer.bias)
    if layer.act is not None:
        y = y.clamp(layer.act[0], layer.act[1])
    return y


def _rect_sigmoid(v):
    import torch
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def _recon(y, target):
    """Squared error summed over channels, mean over positions (BRECQ's ``lp_loss``)."""
    return (y - target).pow(2).sum(1).mean()


def optimize_layer(layer: Layer, xp: np.ndarray, target: np.ndarray, cfg: Config
                   ) -> tuple[np.ndarray, dict]:
    """Learn the rounding of one layer's weights.

    Args:
        layer: from :func:`quantized_layers`.
        xp: float32 ``[P, G, K]`` input patches of the quantized model at P output positions.
        target: float32 ``[P, O]``: the float model's output there (activation applied).
        cfg: hyper-parameters.
    Returns:
        ``(int8 weights shaped like layer.w_fp, log)``: each value is ``floor(W/s) + zp`` or one
        more, clipped to ``[qmin, qmax]``; the log has the loss before (round-to-nearest as
        stored) and after (hard AdaRound), on the pool, and the share of weights changed.
    """
    import torch

    g = torch.Generator().manual_seed(cfg.seed)
    w = torch.from_numpy(layer.w_fp)
    s = torch.from_numpy(layer.scale)
    zp = torch.from_numpy(layer.zp.astype(np.float32))
    xp_t, tgt = torch.from_numpy(xp), torch.from_numpy(target)
    w_floor = torch.floor(w / s)
    frac = (w / s - w_floor).clamp(0, 1)
    v0 = -torch.log((ZETA - GAMMA) / (frac - GAMMA) - 1)     # h(v0) = frac (eq. 23 inverted)
    v = torch.nn.Parameter(v0.clone())
    opt = torch.optim.Adam([v], lr=cfg.lr)

    def soft_w(h):
        return (torch.clamp(w_floor + h + zp, layer.qmin, layer.qmax) - zp) * s

    def hard_q(h):
        return torch.clamp(w_floor + h + zp, layer.qmin, layer.qmax)

    def pool_loss(wt):
        with torch.no_grad():
            tot = 0.0
            n = xp_t.shape[0]
            for i in range(0, n, 4096):
                tot += float(_recon(_forward(layer, xp_t[i:i + 4096], wt),
                                    tgt[i:i + 4096])) * min(4096, n - i)
            return tot / n

    q_near = torch.from_numpy(layer.q_int.astype(np.float32))
    before = pool_loss((q_near - zp) * s)
    n = xp_t.shape[0]
    t_warm = int(cfg.warmup * cfg.iters)
    b0, b1 = cfg.beta
    feat = xp_t.shape[1] * xp_t.shape[2]
    bsz = min(n, cfg.batch, max(64, cfg.batch_floats // feat))
    # the pool in one random order; each step takes a random window of it (a view, no copy)
    perm = torch.randperm(n, generator=g)
    xp_t, tgt = xp_t[perm], tgt[perm]
    for it in range(cfg.iters):
        i0 = int(torch.randint(0, n - bsz + 1, (1,), generator=g))
        h = _rect_sigmoid(v)
        rec = _recon(_forward(layer, xp_t[i0:i0 + bsz], soft_w(h)), tgt[i0:i0 + bsz])
        if it < t_warm:
            loss = rec
        else:  # beta decays linearly from b0 to b1 after the warm-up (BRECQ's LinearTempDecay)
            beta = b1 + (b0 - b1) * max(0.0, 1 - (it - t_warm) / max(1, cfg.iters - t_warm))
            loss = rec + cfg.reg_weight * (1 - (2 * h - 1).abs().pow(beta)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        h = _rect_sigmoid(v)
        up = (h >= 0.5).float()
        q_ada = hard_q(up)
        soft_binary = float(((h < 0.01) | (h > 0.99)).float().mean())
    after = pool_loss((q_ada - zp) * s)
    kept = cfg.keep_if_worse and not after < before
    q_out = layer.q_int if kept else q_ada.numpy().astype(np.int8)
    log = {"node": layer.node, "loss_nearest": before, "loss_adaround": after,
           "kept_nearest": bool(kept), "positions": int(n), "batch": int(bsz),
           "changed_pct": float(100 * (q_out != layer.q_int).mean()),
           "h_binary_pct": 100 * soft_binary}
    return q_out, log


# ------------------------------------------------------------------------------------------
# data capture (ORT, optimisations off = the Q/DQ model's exact semantics)
# ------------------------------------------------------------------------------------------
def _run(model: onnx.ModelProto, outs: Sequence[str], x: np.ndarray, batch: int):
    s = session(_prefix(model, outs).SerializeToString(), optimize=False)
    yield from graph.run_batches(s, x, list(outs), batch)


def _pool_size(layer: Layer, n_out: int, cfg: Config) -> int:
    if layer.op == "Gemm":
        feat = layer.w_fp.shape[1 if layer.attrs["transB"] else 0]
    else:  # C_in * kh * kw floats per output position
        feat = int(np.prod(layer.w_fp.shape[1:])) * layer.attrs["group"]
    return int(max(1, min(n_out, cfg.max_positions, cfg.max_pool_bytes // (4 * feat))))


def adaround(fp32: onnx.ModelProto, qmodel: onnx.ModelProto, x: np.ndarray,
             cfg: Config | None = None, layers: Sequence[str] | None = None,
             op_types: Sequence[str] = ("Conv", "Gemm"),
             progress: Callable[[str], None] | None = print) -> tuple[onnx.ModelProto, dict]:
    """AdaRound every quantized Conv/Gemm of ``qmodel``, sequentially in graph order: layer k's
    input is captured from the Q/DQ model with layers ``< k`` already rounded.

    Args:
        fp32: the float model (node names and float weights of ``qmodel``'s layers).
        qmodel: Q/DQ model with int8 weight initializers (ORT ``quantize_static``).
        x: calibration inputs, float32 ``[N, C, H, W]`` (normalised).
        cfg: hyper-parameters (default :class:`Config`).
        layers: node names to round (default: every quantized Conv/Gemm of ``op_types``).
        progress: one line per layer (None: silent).
    Returns:
        ``(model with the new int8 weights, {"layers": [per-layer log], "skipped", "config",
        "seconds", "mode": "sequential"})``.
    """
    import torch

    cfg = cfg or Config()
    t0 = time.time()
    found, skipped = quantized_layers(fp32, qmodel, op_types)
    if layers is not None:
        want = set(layers)
        found = [L for L in found if L.node in want]
    m = onnx.ModelProto()
    m.CopyFrom(qmodel)
    x = np.asarray(x, np.float32)
    rng = np.random.default_rng(cfg.seed)
    # float targets of every layer, at each layer's sampled positions (one pass over x)
    shapes = dict(zip([L.y_name for L in found],
                      (a.shape for a in next(_run(fp32, [L.y_name for L in found], x[:1], 1))[1])))
    pos = {}
    for L in found:
        per = int(np.prod(shapes[L.y_name][2:])) if L.op == "Conv" else 1
        n_out = len(x) * per
        pos[L.node] = np.sort(rng.choice(n_out, _pool_size(L, n_out, cfg), replace=False))
    tgt = {L.node: [] for L in found}
    for sl, ys in _run(fp32, [L.y_name for L in found], x, cfg.capture_batch):
        for L, y in zip(found, ys):
            t = torch.from_numpy(y)
            t = t.reshape(t.shape[0], t.shape[1], -1).permute(0, 2, 1).reshape(-1, t.shape[1])
            per = t.shape[0] // y.shape[0]                   # output positions per image
            lo = sl.start * per
            p = pos[L.node]
            sel = p[(p >= lo) & (p < lo + t.shape[0])] - lo
            tgt[L.node].append(t[torch.from_numpy(sel)])
    logs = []
    for L in found:
        t1 = time.time()
        target = torch.cat(tgt.pop(L.node))
        if L.act is not None:
            target = target.clamp(L.act[0], L.act[1])
        parts = []
        p = pos[L.node]
        for sl, (xb,) in _run(m, [L.x_name], x, cfg.capture_batch):
            xb_t = torch.from_numpy(xb)
            per = (int(np.prod(shapes[L.y_name][2:])) if L.op == "Conv" else 1)
            lo, hi = sl.start * per, (sl.start + len(xb)) * per
            sel = p[(p >= lo) & (p < hi)] - lo
            if len(sel):
                parts.append(_patches(L, xb_t, torch.from_numpy(sel)))
        xp = torch.cat(parts).numpy()
        t_cap = time.time() - t1
        q_new, log = optimize_layer(L, xp, target.numpy(), cfg)
        log["capture_s"] = round(t_cap, 2)
        del xp, parts
        graph.set_initializer(m, L.q_name, q_new)
        log["seconds"] = round(time.time() - t1, 2)
        logs.append(log)
        if progress:
            kind = L.op + ("/dw" if L.attrs.get("group", 1) > 1 else "")
            progress(f"adaround {L.node:24s} {kind} P={log['positions']:5d} B={log['batch']:4d}"
                     f" loss nearest {log['loss_nearest']:.5g} -> adaround "
                     f"{log['loss_adaround']:.5g}"
                     f"{' (kept nearest)' if log['kept_nearest'] else ''}"
                     f" changed {log['changed_pct']:.1f}% binary {log['h_binary_pct']:.0f}%"
                     f" [{log['seconds']:.1f}s, capture {log['capture_s']:.1f}s]")
    secs = time.time() - t0
    if progress:
        progress(f"adaround: {len(logs)} layers, {sum(r['kept_nearest'] for r in logs)} kept "
                 f"nearest, {secs:.0f} s")
    cfgd = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
    return m, {"mode": "sequential", "layers": logs, "skipped": skipped, "config": cfgd,
               "seconds": round(secs, 1)}
