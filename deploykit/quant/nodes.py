"""Graph queries stage 5 needs: grouped (depthwise) convolutions and the stem convolution, as
names or anchored ``^name$`` regexes for ModelOpt's ``--nodes_to_exclude``.
"""
from __future__ import annotations

import re

from deploykit.errors import StageError
from deploykit.onnx.graph import attr, constants, producers


# --------------------------------------------------------------------------------------------
# Graph helpers
# --------------------------------------------------------------------------------------------
def weight_shape(model, node, consts: dict | None = None) -> tuple[int, ...] | None:
    """Shape of a Conv/Gemm/MatMul weight (second input), looking through a DequantizeLinear."""
    consts = constants(model) if consts is None else consts
    if len(node.input) < 2:
        return None
    w = node.input[1]
    if w in consts:
        return tuple(consts[w].shape)
    prod = producers(model).get(w)
    if prod is not None and prod.op_type == "DequantizeLinear" and prod.input[0] in consts:
        return tuple(consts[prod.input[0]].shape)
    return None


def list_depthwise(model) -> list[dict]:
    """Grouped convolutions (``group > 1``) in graph order.

    Returns:
        ``[{"name", "group", "weight_shape", "depthwise"}]``; ``depthwise`` is True when each
        group has one input channel (weight ``[C_out, 1, kh, kw]``).
    Raises:
        StageError: a grouped Conv has no name (it could not be excluded by name).
    """
    consts = constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type != "Conv" or int(attr(n, "group", 1)) <= 1:
            continue
        if not n.name:
            raise StageError("a grouped Conv has no node name: name the nodes (e.g. "
                             "re-export) so it can be excluded from quantization")
        shape = weight_shape(model, n, consts)
        out.append({"name": n.name, "group": int(attr(n, "group", 1)),
                    "weight_shape": list(shape) if shape else None,
                    "depthwise": bool(shape and len(shape) > 1 and shape[1] == 1)})
    return out


def list_stem(model) -> list[dict]:
    """The first Conv (graph order is topological) whose data input descends from a graph
    input: the stem convolution that sees the normalised image."""
    inits = {i.name for i in model.graph.initializer}
    reach = {i.name for i in model.graph.input if i.name not in inits}
    for n in model.graph.node:
        if n.input and n.input[0] in reach:
            if n.op_type == "Conv":
                return [{"name": n.name, "group": int(attr(n, "group", 1))}]
            reach.update(n.output)
    return []


def print_nodes(nodes: list[dict], names_only: bool, anchored: bool) -> None:
    for d in nodes:
        name = f"^{re.escape(d['name'])}$" if anchored else d["name"]
        if names_only:
            print(name)
        else:
            print(f"{name}\t" + "\t".join(f"{k}={v}" for k, v in d.items() if k != "name"))
