"""The configurations of one Q/DQ model: which candidate nodes keep their Q/DQ (INT8) and
which run in float.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from deploykit.errors import StageError
from deploykit.onnx.graph import constants, consumers, producers
from deploykit.quant.macs import MAC_OPS, mac_table


# --------------------------------------------------------------------------------------------
# Configurations of one Q/DQ model
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Candidate:
    """A node the base Q/DQ model computes in INT8.

    Attributes:
        name: node name (as in the FP32 model: ModelOpt keeps names). index: graph position.
        op_type: Conv, Gemm, ...; macs: MACs per sample (0 when unknown).
        weight_dqs: ``{input index: DequantizeLinear node}`` of its constant inputs.
        act_dqs: names of the activation DequantizeLinear nodes it reads.
    """

    name: str
    index: int
    op_type: str
    macs: int
    weight_dqs: dict
    act_dqs: list


class QdqSpace:
    """All "which candidates stay INT8" configurations of one Q/DQ model (see the module
    docstring, step 2), built by editing the graph.

    Args:
        qdq_model: the Q/DQ ``ModelProto`` (every candidate quantized).
        fp32_model: the float model, only needed when a quantized weight has no float copy
            in the Q/DQ model (a DequantizeLinear of a constant integer tensor, ``--dq_only``).
    Raises:
        StageError: the model has no quantized Conv/Gemm/MatMul, a candidate has no name, or a
            quantized weight has no float value to restore.
    """

    def __init__(self, qdq_model, fp32_model=None):
        self.base = qdq_model
        self.consts = constants(qdq_model)
        self.prod = producers(qdq_model)
        cons = consumers(qdq_model)
        table = mac_table(qdq_model)
        macs = {r["name"]: r["macs"] for r in table}
        self.candidates: list[Candidate] = []
        self.float_weights: dict[tuple[str, int], str] = {}
        self.extra_inits: dict[str, object] = {}
        fp32_nodes = {n.name: n for n in fp32_model.graph.node} if fp32_model is not None else {}
        fp32_consts = constants(fp32_model) if fp32_model is not None else {}
        for idx, n in enumerate(qdq_model.graph.node):
            if n.op_type not in MAC_OPS:
                continue
            dqs = {i: self.prod.get(t) for i, t in enumerate(n.input)}
            dqs = {i: d for i, d in dqs.items() if d is not None and d.op_type == "DequantizeLinear"}
            if not dqs:
                continue
            if not n.name:
                raise StageError(f"a quantized {n.op_type} has no node name: it could not "
                                 "be excluded by name (re-export with node names)")
            weight, act = {}, []
            for i, d in dqs.items():
                if self._is_weight(d):
                    weight[i] = d
                    self.float_weights[(n.name, i)] = self._float_weight(
                        n, i, d, fp32_nodes, fp32_consts)
                elif self._act_source(d) is not None:
                    act.append(d.name)
            self.candidates.append(Candidate(n.name, idx, n.op_type, int(macs.get(n.name) or 0),
                                             weight, act))
        if not self.candidates:
            raise StageError("the Q/DQ model has no quantized Conv/ConvTranspose/Gemm/"
                             "MatMul: nothing to choose")
        self.names = [c.name for c in self.candidates]
        by_name = {c.name: c for c in self.candidates}
        # Activation DQ -> the candidates that read it (its "owners": while any of them is INT8,
        # ModelOpt keeps the shared Q/DQ pair, and every consumer reads the dequantized tensor).
        self.owners: dict[str, set[str]] = {}
        self.fixed: list[str] = []
        for n in qdq_model.graph.node:
            if n.op_type != "DequantizeLinear" or self._is_weight(n):
                continue
            readers = {c.name for c in cons.get(n.output[0], []) if c.name in by_name
                       and n.name in by_name[c.name].act_dqs}
            if readers:
                self.owners[n.name] = readers
            else:
                self.fixed.append(n.name)
        self.total_macs = sum(r["macs"] or 0 for r in table)

    def _is_weight(self, dq) -> bool:
        x = dq.input[0]
        if x in self.consts:
            return True
        q = self.prod.get(x)
        return q is not None and q.op_type == "QuantizeLinear" and q.input[0] in self.consts

    def _act_source(self, dq) -> str | None:
        q = self.prod.get(dq.input[0])
        return q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None

    def _float_weight(self, node, i: int, dq, fp32_nodes: dict, fp32_consts: dict) -> str:
        q = self.prod.get(dq.input[0])
        if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in self.consts:
            return q.input[0]
        src = fp32_nodes.get(node.name)
        if src is not None and len(src.input) > i and src.input[i] in fp32_consts:
            name = f"{src.input[i]}__auto_precision_float"
            self.extra_inits[name] = fp32_consts[src.input[i]]
            return name
        raise StageError(
            f"node {node.name}: its quantized input {i} ({dq.input[0]}) has no float value in the "
            "Q/DQ model (integer weights, --dq_only): pass the FP32 model it was made from "
            "(--fp32) so the float weight can be restored")

    def model(self, float_nodes: Iterable[str]):
        """The Q/DQ model with the candidates ``float_nodes`` kept in float (all others INT8).

        Returns:
            a new ``ModelProto``; dead Q/DQ nodes and unused initializers are removed.
        Raises:
            KeyError: a name that is not a candidate.
        """
        import onnx
        from onnx import numpy_helper

        float_nodes = set(float_nodes)
        unknown = float_nodes - set(self.names)
        if unknown:
            raise KeyError(f"not a quantized candidate: {sorted(unknown)}")
        m = onnx.ModelProto()
        m.CopyFrom(self.base)
        g = m.graph
        dq_by_name = {n.name: n for n in g.node if n.op_type == "DequantizeLinear"}
        # activation DQ outputs no INT8 owner reads any more -> their float source
        act_map = {}
        for dq_name, owners in self.owners.items():
            if owners <= float_nodes:
                d = dq_by_name[dq_name]
                act_map[d.output[0]] = self._act_source(d)
        weight_map = {}  # (node name, input index) -> float weight
        for c in self.candidates:
            if c.name in float_nodes:
                for i in c.weight_dqs:
                    weight_map[(c.name, i)] = self.float_weights[(c.name, i)]
        for n in g.node:
            for i, t in enumerate(n.input):
                if (n.name, i) in weight_map:
                    n.input[i] = weight_map[(n.name, i)]
                elif t in act_map:
                    n.input[i] = act_map[t]
        for name, arr in self.extra_inits.items():
            if any(v == name for v in weight_map.values()):
                g.initializer.append(numpy_helper.from_array(arr, name))
        prune_unused(m)
        return m


def prune_unused(model) -> None:
    """Remove nodes whose outputs nothing reads (not graph outputs) and unused initializers."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output if o):
            keep.append(n)
            needed.update(i for i in n.input if i)
    keep.reverse()
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)
    inits = [t for t in g.initializer if t.name in needed]
    if len(inits) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(inits)
