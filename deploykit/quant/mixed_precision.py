"""Keep chosen Conv/Gemm nodes of a Q/DQ model in float without re-calibrating, and rank nodes
by the error they remove when kept float (the measurement ``auto_precision.py`` makes with
ModelOpt, here directly on any Q/DQ file, e.g. ORT ``quantize_static``'s).

A node is made float by feeding it its float weight (the float model's initializer) and its
float activation: the tensor the float model feeds it. When that tensor no longer exists in the
Q/DQ graph (ORT removes a Clip/Relu after a Conv and lets the quantized range clamp instead),
the float model's nodes between the last tensor both graphs share and the node's input are
copied in (e.g. the Clip), so the float node still sees the activation's output.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import onnx

from . import graph


def make_float(qmodel: onnx.ModelProto, fp32: onnx.ModelProto, names: Iterable[str]
               ) -> onnx.ModelProto:
    """Copy of ``qmodel`` with the Conv/Gemm nodes ``names`` computed in float.

    Tensors are matched through their producer node, not their name: ORT's ``quantize_static``
    gives a conv whose Clip it removed the Clip's output name, so that name holds pre-activation
    values in the Q/DQ graph. A float-graph node absent from the Q/DQ graph (the removed Clip)
    is copied in (output ``<tensor>_float``).

    Args:
        qmodel: Q/DQ model; fp32: the float model it was made from (same node names).
        names: node names to keep float.
    Returns:
        the new model (unused Q/DQ nodes are left; they are dead code).
    Raises:
        KeyError: a name that is not a node of both models.
    """
    m = onnx.ModelProto()
    m.CopyFrom(qmodel)
    fprod = graph.producers(fp32)
    finits = graph.initializers(fp32)
    fnodes = {n.name: n for n in fp32.graph.node}
    qnodes = {n.name: n for n in m.graph.node}
    have_init = {t.name for t in m.graph.initializer}
    graph_inputs = {i.name for i in m.graph.input}
    mapped: dict[str, str] = {}
    pending: list[tuple[str, onnx.NodeProto]] = []  # (consumer name, copied node)

    def q_tensor(t: str, consumer: str) -> str:
        """Q/DQ-graph tensor holding the float graph's values of ``t``."""
        if t in mapped:
            return mapped[t]
        if t in finits:
            if t not in have_init:
                m.graph.initializer.append(finits[t])
                have_init.add(t)
            return t
        if t in graph_inputs:
            return t
        p = fprod[t]
        j = list(p.output).index(t)
        if p.name in qnodes:
            out = qnodes[p.name].output[j]
        else:
            c = onnx.NodeProto()
            c.CopyFrom(p)
            c.name = p.name + "_float_copy"
            for k, i in enumerate(p.input):
                if i:
                    c.input[k] = q_tensor(i, consumer)
            for k, o in enumerate(p.output):
                c.output[k] = o + "_float"
            pending.append((consumer, c))
            out = c.output[j]
        mapped[t] = out
        return out

    for name in names:
        qn, fn = qnodes[name], fnodes[name]
        for i, t in enumerate(fn.input):
            if t:
                qn.input[i] = q_tensor(t, name)
    for before, c in pending:
        k = next(j for j, n in enumerate(m.graph.node) if n.name == before)
        m.graph.node.insert(k, c)
    return m


def rank_nodes(qmodel: onnx.ModelProto, fp32: onnx.ModelProto,
               error: Callable[[onnx.ModelProto], float], candidates: Sequence[str],
               macs: dict[str, int]) -> list[dict]:
    """Error removed by keeping each candidate alone in float, ranked by removal per MAC.

    Args:
        error: model -> scalar error on the tuning data (e.g. ``1 - mean cosine``).
        candidates: node names; macs: ``{node: MACs}`` (:func:`graph.macs`).
    Returns:
        ``[{"node", "macs", "error", "removed", "per_mac"}]`` best first (the all-INT8 error
        is ``removed + error`` of any row).
    """
    e0 = error(qmodel)
    rows = []
    for c in candidates:
        e = error(make_float(qmodel, fp32, [c]))
        rows.append({"node": c, "macs": int(macs[c]), "error": e, "removed": e0 - e,
                     "per_mac": (e0 - e) / max(macs[c], 1)})
    rows.sort(key=lambda r: -r["per_mac"])
    return rows
