#!/usr/bin/env python3
"""Mixed precision chosen for an accuracy budget: which nodes of an INT8 Q/DQ model to keep in
float, found by measurement (the ``int8_auto`` variant of stage 5).

No existing tool does this for a Q/DQ ONNX model headed to TensorRT: Polygraphy's precision
bisection works on TensorRT layers and on builder precision flags that TensorRT 11 removed;
ModelOpt's AutoQuantize works on PyTorch modules and optimises a bit budget, not an accuracy
budget. How it works:

1. **Quantize once.** ModelOpt quantizes every candidate with the ``int8_auto`` recipe of
   ``variants.py`` and no exclusion (Conv+Gemm, fp32 scales; run through ``qdq_tools.py
   modelopt``, the calibration batch of ``qdq_tools.calibration_plan``). The candidates are the
   Conv/ConvTranspose/Gemm/MatMul nodes it quantized.
2. **Edit, do not re-quantize.** "Only node k in INT8" and "only node k in float" are made by
   editing that Q/DQ graph: a node kept in float reads its float weight and its float input
   instead of their DequantizeLinear outputs. An activation Q/DQ pair is shared by every
   consumer of the tensor (ONNX Runtime's quantizer, which ModelOpt drives, rewires all of them,
   ``DedicatedQDQPair=False``), so an input stays quantized while any other INT8 candidate reads
   it: exactly what ModelOpt's ``--nodes_to_exclude`` produces.
3. **Measure on the graph's own semantics.** Every configuration runs on ONNX Runtime's CPU EP
   with all graph optimisations disabled (DequantizeLinear + float operators), on the tuning
   split (disjoint from calibration and evaluation), against the FP32 ONNX model run the same
   way: top-1 agreement, logits cosine (mean and min over images; with several outputs the
   worst output's), top-1; NaN/Inf outputs miss every budget. Never ORT's fused
   int8 kernels: on x86-64 CPUs without VNNI their u8s8 arithmetic saturates (onnxruntime PR
   #12088) and would be measured instead of the quantization.
4. **Choose.** Per node: the error it adds when it alone is INT8 and the error removed when it
   alone is kept in float (cosine and agreement). Nodes are ranked by error per MAC (score =
   the larger of the two cosine errors; ties by graph order: deterministic) and every prefix of
   that ranking is measured once (the *path*: MACs in INT8 against accuracy, independent of the
   budget). The budget picks the shortest prefix that meets it; then (unless ``--no-prune``)
   each node of it is tried back in INT8, largest MACs first, and stays INT8 when the budget
   still holds (one measured configuration per node; ranking mistakes of the single-node
   estimates are undone here).
5. **Re-quantize and verify.** ``5_quantize.sh int8_auto`` re-runs ModelOpt with the chosen
   ``--nodes_to_exclude`` (anchored ``^name$``: ModelOpt uses ``re.match``), then ``verify``
   measures that file on the tuning split (it must meet the budget and match the searched
   configuration) and on the evaluation split (reported as met or missed, by how much).

Every configuration's metrics are cached (``artifacts/<model>/auto_precision/cache/<key>.json``,
key = SHA-256 of the FP32 model, the base Q/DQ model, the calibration data, the tuning data and
the measurement mode), and so is the base Q/DQ model: a rerun with another budget reads the
per-node measurements and the path from the cache and only measures the pruning trials it has
not seen (none with ``--no-prune``: seconds).

Subcommands::

    python auto_precision.py search --model M [budget flags]   # prints the ^name$ regexes
    python auto_precision.py verify --model M --onnx artifacts/M/onnx/int8_auto.onnx
    python auto_precision.py macs F.onnx                       # MACs per node, fraction in INT8

Writes: ``artifacts/<model>/auto_precision/`` (base model, cache, logs, and
``auto_precision.{json,md,png}``: exclusion list with each node's sensitivity and MACs, the
fraction of MACs in INT8, tuning and evaluation metrics, the per-node sensitivity plot), which
``5_quantize.sh int8_auto`` publishes to ``results/<model>/`` once the file is installed (as
``auto_precision.failed.*`` beside the good record when it is not).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

import common
import onnx_graph
from onnx_graph import attr, constants, consumers, producers

MAC_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
INT8_TYPES = ("int8", "uint8")
VARIANT = "int8_auto"
DEFAULT_BUDGET = {"min_agreement": 99.5, "min_cosine": 0.999, "max_top1_drop": None}
#: What every measurement of the search runs on (written into every output).
SEMANTICS = ("ONNX Runtime CPU EP, all graph optimisations disabled: the Q/DQ graph's own "
             "semantics (DequantizeLinear + float ops), never ORT's fused int8 kernels (u8s8, "
             "which saturate on x86-64 CPUs without VNNI, onnxruntime PR #12088); reference: "
             "the FP32 ONNX model run the same way")
MODE = "ort-cpu-opt-disable"
CACHE_VERSION = 2  # 2: every output measured, NaN/Inf counted (metrics)


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


def _dq_is_int8(dq, consts: dict, prod: dict) -> bool:
    """True when DequantizeLinear ``dq`` dequantizes 8-bit integers (int8/uint8): its constant
    input's dtype, else its zero point's, else the output type of the QuantizeLinear feeding
    it (uint8 when it has neither, ONNX's default)."""
    x = dq.input[0]
    if x in consts:
        return consts[x].dtype.name in INT8_TYPES
    if len(dq.input) > 2 and dq.input[2] in consts:
        return consts[dq.input[2]].dtype.name in INT8_TYPES
    q = prod.get(x)
    if q is not None and q.op_type == "QuantizeLinear":
        if len(q.input) > 2 and q.input[2] in consts:
            return consts[q.input[2]].dtype.name in INT8_TYPES
        od = attr(q, "output_dtype", 0)
        return od in (0, 2, 3)  # unset (uint8), UINT8, INT8 (onnx.TensorProto)
    return False


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
        dq_in = [prod.get(i) for i in n.input[:2]]
        int8 = len(dq_in) == 2 and all(d is not None and d.op_type == "DequantizeLinear"
                                       and _dq_is_int8(d, consts, prod) for d in dq_in)
        rows.append({"name": n.name, "op_type": n.op_type, "macs": macs, "int8": bool(int8)})
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
                raise common.StageError(f"a quantized {n.op_type} has no node name: it could not "
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
            raise common.StageError("the Q/DQ model has no quantized Conv/ConvTranspose/Gemm/"
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
        raise common.StageError(
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
        _prune(m)
        return m


def _prune(model) -> None:
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


# --------------------------------------------------------------------------------------------
# Budget and metrics
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Budget:
    """The accuracy a configuration must keep, against the FP32 model on the same images.

    Attributes:
        min_agreement: top-1 agreement with FP32, % of images (None: not checked).
        min_cosine: mean cosine similarity of the logits (None: not checked).
        max_top1_drop: top-1 (vs labels) may be at most this many points below FP32's (None:
            not checked).
    """

    min_agreement: float | None = DEFAULT_BUDGET["min_agreement"]
    min_cosine: float | None = DEFAULT_BUDGET["min_cosine"]
    max_top1_drop: float | None = DEFAULT_BUDGET["max_top1_drop"]

    def misses(self, m: dict) -> list[str]:
        """What ``m`` (:func:`metrics`) misses, one phrase each (empty: the budget is met)."""
        out = []
        if self.min_agreement is not None:
            a = m.get("agreement")
            if a is None:
                out.append("top-1 agreement: not defined for this output (not 2-D)")
            elif a < self.min_agreement:
                out.append(f"top-1 agreement {a:.2f}% < {self.min_agreement}%")
        if m.get("nonfinite"):  # whatever the bounds: a model that returns NaN/Inf fails
            out.append(f"{m['nonfinite']} of {m['n']} samples give NaN/Inf outputs")
        c = m.get("cosine_mean")
        if self.min_cosine is not None:
            if c is None or not np.isfinite(c):
                if not m.get("nonfinite"):
                    out.append("cosine undefined (NaN/Inf outputs)")
            elif c < self.min_cosine:
                out.append(f"cosine {c:.5f} < {self.min_cosine}")
        if self.max_top1_drop is not None:
            d = m.get("delta_top1")
            if d is None:
                out.append("delta top-1: no labels")
            elif -d > self.max_top1_drop:
                out.append(f"top-1 {d:+.2f} points vs FP32 (allowed -{self.max_top1_drop})")
        return out

    def met(self, m: dict) -> bool:
        return not self.misses(m)

    def describe(self) -> str:
        bits = []
        if self.min_agreement is not None:
            bits.append(f"top-1 agreement >= {self.min_agreement}%")
        if self.min_cosine is not None:
            bits.append(f"logits cosine (mean) >= {self.min_cosine}")
        if self.max_top1_drop is not None:
            bits.append(f"top-1 drop <= {self.max_top1_drop} points")
        return ", ".join(bits) or "none"

    def margins(self, m: dict) -> dict:
        """Signed distance of ``m`` to each bound (>= 0 = met), in the bound's unit."""
        out = {}
        if self.min_agreement is not None and m.get("agreement") is not None:
            out["agreement_points"] = m["agreement"] - self.min_agreement
        if self.min_cosine is not None and m.get("cosine_mean") is not None:
            out["cosine"] = m["cosine_mean"] - self.min_cosine
        if self.max_top1_drop is not None and m.get("delta_top1") is not None:
            out["top1_points"] = m["delta_top1"] + self.max_top1_drop
        return out


def _as_outputs(x) -> dict[str, np.ndarray]:
    """``{name: array}`` of a model's outputs (a bare array is one output named ``output``)."""
    return dict(x) if isinstance(x, dict) else {"output": np.asarray(x)}


def metrics(ref, out, labels: np.ndarray | None = None) -> dict:
    """Accuracy of ``out`` against the FP32 reference ``ref`` on the same samples.

    Every output counts: the cosine figures are the worst over the model's outputs (a node that
    only feeds a second output is judged too); top-1 agreement, flips and top-1 come from the
    first output (the logits of a classifier). A sample whose output holds NaN/Inf where the
    reference is finite is counted in ``nonfinite``, disagrees, and leaves the cosine undefined
    (None): :meth:`Budget.misses` counts that as a miss, never as a pass.

    Args:
        ref, out: ``{output name: [N, ...] float}`` in graph order (or one array, the only
            output; logits ``[N, classes]`` for a classifier). labels: int ``[N]`` or None.
    Returns:
        ``{"n", "agreement" (%, None unless the first output is 2-D), "cosine_mean",
        "cosine_min" (None when an output is non-finite), "nonfinite" (samples), "top1",
        "top1_fp32", "delta_top1" (points; None without labels), "flips" (samples whose top-1
        differs), "outputs" (per output ``{"cosine_mean", "cosine_min", "nonfinite"}``, only
        with several outputs)}``.
    Raises:
        StageError: the outputs' names or shapes differ from the reference's.
    """
    ref, out = _as_outputs(ref), _as_outputs(out)
    if list(ref) != list(out):
        raise common.StageError(f"outputs {list(out)} differ from the FP32 model's {list(ref)}")
    per = {}
    bad_rows = None
    for k, r in ref.items():
        o = out[k]
        if r.shape != o.shape:
            raise common.StageError(f"output {k!r}: shape {o.shape} != FP32 {r.shape}")
        n = len(o) if o.ndim else 1
        bad = ~np.isfinite(np.asarray(o, np.float64).reshape(n, -1)).all(1) & \
            np.isfinite(np.asarray(r, np.float64).reshape(n, -1)).all(1)
        bad_rows = bad if bad_rows is None else bad_rows | bad
        par = common.parity(r, o)
        ok = bool(np.isfinite([par["cosine_mean"], par["cosine_min"]]).all())
        per[k] = {"cosine_mean": par["cosine_mean"] if ok else None,
                  "cosine_min": par["cosine_min"] if ok else None, "nonfinite": int(bad.sum())}
    first = next(iter(ref))
    r0, o0 = ref[first], out[first]
    undefined = any(v["cosine_mean"] is None for v in per.values())
    m = {"n": int(len(o0)), "agreement": None,
         "cosine_mean": None if undefined else min(v["cosine_mean"] for v in per.values()),
         "cosine_min": None if undefined else min(v["cosine_min"] for v in per.values()),
         "nonfinite": int(bad_rows.sum()) if bad_rows is not None else 0,
         "top1": None, "top1_fp32": None, "delta_top1": None, "flips": None}
    if r0.ndim == 2:
        rows_ok = np.isfinite(o0).all(1)
        same = (r0.argmax(-1) == o0.argmax(-1)) & rows_ok
        m["agreement"] = float(100.0 * same.mean())
        m["flips"] = int((~same).sum())
        if labels is not None:
            hit = (o0.argmax(-1) == labels) & rows_ok
            m["top1"] = float(100.0 * hit.mean())
            m["top1_fp32"] = common.topk_accuracy(r0, labels, (1,))["top1"]
            m["delta_top1"] = m["top1"] - m["top1_fp32"]
    if len(per) > 1:
        m["outputs"] = per
    return m


def cosine_error(m: dict) -> float:
    """``1 - cosine_mean`` of metrics ``m``; 2.0 (the largest possible) when the cosine is
    undefined (NaN/Inf outputs), so a node that breaks the model ranks as the most sensitive."""
    c = m.get("cosine_mean")
    return 2.0 if c is None or not np.isfinite(c) else 1.0 - c


# --------------------------------------------------------------------------------------------
# Running configurations, and the cache
# --------------------------------------------------------------------------------------------
def run_model(model_or_path, data, batch: int = 64, desc: str = "auto-precision"
              ) -> dict[str, np.ndarray]:
    """Every output of ``model_or_path`` (``ModelProto``, bytes or path) over ``data``
    (``evaluate.EvalData``) on ORT's CPU EP with graph optimisations disabled.

    Returns:
        ``{output name: float32 [N, ...]}`` in the graph's output order.
    Raises:
        StageError: ORT cannot load or run the model.
    """
    import evaluate
    import runners

    src = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") \
        else model_or_path
    with runners.OrtRunner(src, "cpu", opt_level="disable") as r:
        outs = evaluate.run_outputs(r, data, batch, progress=desc)
        return {k: np.asarray(outs[k], np.float32) for k in r.output_names}


def data_digest(data) -> str:
    """SHA-256 of the samples of an ``evaluate.EvalData`` (images, labels and normalisation,
    or the feed arrays)."""
    h = hashlib.sha256()
    if data.classifier:
        for a in (data.x_u8, data.y):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(json.dumps([list(data.mean), list(data.std), data.input_name]).encode())
    else:
        for k in sorted(data.feed):
            h.update(k.encode())
            h.update(np.ascontiguousarray(data.feed[k]).tobytes())
    return h.hexdigest()


class Cache:
    """Metrics of configurations, keyed by the set of candidates kept in float, in one JSON
    file per measurement key (:func:`cache_key`); written after every new measurement (an
    interrupted search resumes), atomically.

    Args:
        folder: cache folder. key_fields: what the measurements depend on (hashed).
    """

    def __init__(self, folder: Path | str, key_fields: dict):
        self.folder = Path(folder)
        self.key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
        self.path = self.folder / f"{self.key}.json"
        self.data = {"version": CACHE_VERSION, "key_fields": key_fields, "configs": {}}
        if self.path.exists():
            try:
                d = json.loads(self.path.read_text())
                if d.get("version") == CACHE_VERSION and d.get("key_fields") == key_fields:
                    self.data = d
            except (OSError, json.JSONDecodeError):
                print(f"WARNING: unreadable cache {self.path}: starting a new one",
                      file=sys.stderr)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def config_id(float_nodes: Iterable[str]) -> str:
        return hashlib.sha256("\n".join(sorted(float_nodes)).encode()).hexdigest()[:20]

    def get(self, float_nodes: Iterable[str]) -> dict | None:
        rec = self.data["configs"].get(self.config_id(float_nodes))
        if rec is not None:
            self.hits += 1
            return rec["metrics"]
        return None

    def put(self, float_nodes: Iterable[str], m: dict) -> None:
        self.misses += 1
        self.data["configs"][self.config_id(float_nodes)] = {"float": sorted(float_nodes),
                                                            "metrics": m}
        common.write_json(self.path, self.data)

    def array_path(self, what: str) -> Path:
        return self.folder / f"{self.key}.{what}.npy"


def cached_outputs(path: Path, make: Callable[[], dict]) -> dict[str, np.ndarray]:
    """The ``{name: array}`` saved in ``path`` (an ``.npz``) if it exists and is readable, else
    ``make()`` saved there atomically."""
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                names = json.loads(str(z["__names__"]))
                return {k: z[f"o{i}"] for i, k in enumerate(names)}
        except (OSError, ValueError, KeyError, EOFError):
            print(f"WARNING: unreadable {path}: recomputing", file=sys.stderr)
    outs = make()
    with common.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # keys o0, o1...: output names need not be valid npz keys
            np.savez(f, __names__=np.array(json.dumps(list(outs))),
                     **{f"o{i}": v for i, v in enumerate(outs.values())})
    return outs


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------
def search(space: QdqSpace, data, ref: np.ndarray, budget: Budget, cache: Cache,
           batch: int = 64, prune: bool = True, log: Callable[[str], None] | None = None
           ) -> dict:
    """Measure every candidate's sensitivity and the ranking path, and choose the nodes to keep
    in float (module docstring, step 4).

    Args:
        space: the configurations (:class:`QdqSpace`). data: ``evaluate.EvalData`` of the tuning
            split; ref: FP32 outputs on it (``{name: [N, ...]}``, :func:`run_model`); budget:
            what must hold there.
        cache: measured configurations (read and extended).
        prune: try each chosen node back in INT8 (measured); False = the path's prefix only.
    Returns:
        ``{"candidates": [per-node rows in graph order], "full_int8", "all_float", "path"
        ([{"n_float", "node", "int8_mac_fraction", "metrics", "met"}] for 0..n nodes in
        float), "excluded" (names, graph order), "predicted" (metrics of the chosen
        configuration), "budget_met", "budget_misses", "budget_margins", "int8_mac_fraction"
        (of all MACs of the model), "order" (ranking), "steps" (pruning trials),
        "evaluations": {"run", "cached"}, "fixed_qdq"}``.
    Raises:
        StageError: the budget cannot be met even with every candidate in float (the message
            names what still misses it and the Q/DQ outside the candidates).
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    labels = data.y if data.classifier else None
    names = space.names
    everything = frozenset(names)
    counter = {"n": 0}

    def measure(float_nodes: Iterable[str]) -> dict:
        float_nodes = frozenset(float_nodes)
        m = cache.get(float_nodes)
        if m is None:
            counter["n"] += 1
            out = run_model(space.model(float_nodes), data, batch,
                            desc=f"config {counter['n']} ({len(float_nodes)} float)")
            m = metrics(ref, out, labels)
            cache.put(float_nodes, m)
        return m

    t0 = time.time()
    full = measure(())
    none = measure(everything)
    log(f"auto-precision: {len(names)} candidates; all INT8: {_fmt_m(full)}; all float: "
        f"{_fmt_m(none)}")
    rows = []
    for i, c in enumerate(space.candidates):
        q_alone = measure(everything - {c.name})
        f_alone = measure({c.name})
        added = max(0.0, cosine_error(q_alone))
        removed = max(0.0, cosine_error(full) - cosine_error(f_alone))
        rows.append({
            "name": c.name, "op_type": c.op_type, "index": c.index, "macs": c.macs,
            "mac_share": c.macs / space.total_macs if space.total_macs else None,
            "int8_alone": q_alone, "float_alone": f_alone,
            "cosine_error_added": added, "cosine_error_removed": removed,
            "flips_added": q_alone.get("flips"),
            "flips_removed": (full["flips"] - f_alone["flips"])
            if full.get("flips") is not None else None,
            "score": max(added, removed)})
        if (i + 1) % 10 == 0 or i + 1 == len(names):
            log(f"auto-precision: sensitivity measured for {i + 1}/{len(names)} nodes "
                f"({time.time() - t0:.0f} s)")
    # error per MAC, highest first; ties (and zero-MAC nodes) by graph order
    order = sorted(rows, key=lambda r: (-(r["score"] / max(r["macs"], 1)), r["index"]))
    order_names = [r["name"] for r in order]
    macs = {c.name: c.macs for c in space.candidates}

    def int8_fraction(float_nodes) -> float | None:
        if not space.total_macs:
            return None
        return (sum(macs.values()) - sum(macs[n] for n in float_nodes)) / space.total_macs

    path = []
    t1 = time.time()
    for p in range(len(order_names) + 1):
        m = full if p == 0 else none if p == len(order_names) else measure(order_names[:p])
        path.append({"n_float": p, "node": order_names[p - 1] if p else None,
                     "int8_mac_fraction": int8_fraction(order_names[:p]), "metrics": m,
                     "met": budget.met(m)})
        if p and p % 10 == 0:
            log(f"auto-precision: path measured up to {p}/{len(order_names)} nodes in float "
                f"({time.time() - t1:.0f} s)")
    if not budget.met(none):
        raise common.StageError(
            f"the budget ({budget.describe()}) is not met even with every candidate in float "
            f"({'; '.join(budget.misses(none))}); Q/DQ outside the candidates stay quantized: "
            f"{space.fixed[:8] or 'none'}. Loosen the budget (--min-agreement, --min-cosine, "
            "--max-top1-drop) or quantize fewer op types")
    first = next(r["n_float"] for r in path if r["met"])
    excluded = order_names[:first]
    steps = []
    if prune:
        for name in sorted(excluded, key=lambda n: (-macs[n], names.index(n))):
            trial = [n for n in excluded if n != name]
            m = measure(trial)
            steps.append({"why": f"prune: {name} back in INT8", "float": sorted(trial),
                          "metrics": m, "met": budget.met(m)})
            if budget.met(m):
                excluded = trial
    excluded = sorted(excluded, key=names.index)
    chosen = measure(excluded)
    rank = {n: i + 1 for i, n in enumerate(order_names)}
    for r in rows:
        r["rank"] = rank[r["name"]]
        r["kept_float"] = r["name"] in excluded
    return {"candidates": rows, "full_int8": full, "all_float": none, "path": path,
            "path_choice": first, "pruned": prune, "excluded": excluded,
            "predicted": chosen, "budget_met": budget.met(chosen),
            "budget_misses": budget.misses(chosen), "budget_margins": budget.margins(chosen),
            "int8_mac_fraction": int8_fraction(excluded), "order": order_names,
            "steps": steps, "evaluations": {"run": cache.misses, "cached": cache.hits},
            "fixed_qdq": space.fixed}


def budget_warnings(budget: Budget, n: int) -> list[str]:
    """What the tuning split's size ``n`` cannot resolve in ``budget`` (empty: nothing).

    On ``n`` samples top-1 agreement moves in steps of 100 / n points: below
    ``100 / (100 - min_agreement)`` samples a single flip already misses the bound, so the
    budget means "no flip at all" and says little about the evaluation split (with 1-3
    samples it is met by chance).
    """
    out = []
    if budget.min_agreement is not None and budget.min_agreement < 100 and n > 0:
        need = int(np.ceil(100.0 / (100.0 - budget.min_agreement) - 1e-9))
        if n < need:
            out.append(f"the tuning split has {n} sample(s): one flip moves top-1 agreement by "
                       f"{100.0 / n:.2f} points, so --min-agreement {budget.min_agreement} "
                       f"allows no flip at all and the choice rests on very few samples; use "
                       f">= {need} samples (0_prepare_data.py --tune-fraction, --tune-npz) or "
                       f"a lower --min-agreement")
    return out


def _fmt_m(m: dict) -> str:
    bits = []
    if m.get("agreement") is not None:
        bits.append(f"agreement {m['agreement']:.2f}%")
    if m.get("cosine_mean") is None:
        bits.append("cosine undefined")
    else:
        bits.append(f"cosine {m['cosine_mean']:.5f} (min {m['cosine_min']:.4f})")
    if m.get("nonfinite"):
        bits.append(f"{m['nonfinite']} sample(s) NaN/Inf")
    if m.get("delta_top1") is not None:
        bits.append(f"top-1 {m['top1']:.2f}% ({m['delta_top1']:+.2f})")
    return ", ".join(bits)


def anchored(names: Sequence[str]) -> list[str]:
    """``^name$`` regexes (ModelOpt matches ``--nodes_to_exclude`` with ``re.match``)."""
    return [f"^{re.escape(n)}$" for n in names]


# --------------------------------------------------------------------------------------------
# Inputs: tuning/evaluation data, the base Q/DQ model
# --------------------------------------------------------------------------------------------
def _subset(data, idx: np.ndarray):
    """``evaluate.EvalData`` restricted to sample indices ``idx``."""
    if data.classifier:
        return dataclasses.replace(data, x_u8=data.x_u8[idx], y=data.y[idx],
                                   files=[data.files[i] for i in idx])
    return dataclasses.replace(data, feed={k: v[idx] for k, v in data.feed.items()})


def tuning_data(model: str, onnx_path: Path, tune_npz: Path | None = None,
                images: int | None = None, seed: int = 0):
    """The tuning samples of the search, with where they come from.

    Image classifiers: the ``tune`` split of ``artifacts/splits.json`` (``0_prepare_data.py
    --tune-fraction``), preprocessed as evaluation, checked disjoint from the evaluation and
    calibration splits. Other models: ``tune_npz`` or ``artifacts/<model>/tune.npz`` (arrays
    keyed by input name, batch on axis 0). ``images``: a seeded subset of that many samples.

    Returns:
        ``(evaluate.EvalData, {"source", "n", "sha256", "images", "seed"})``.
    Raises:
        StageError: no tuning split / npz (the message names ``--tune-fraction`` /
            ``run_all.sh --auto-precision`` / ``--tune-npz``), or the splits overlap.
        UsageError: ``images`` < 1.
    """
    import evaluate

    if images is not None and images < 1:
        raise common.UsageError(f"--tune-images must be >= 1 (got {images})")
    try:
        spec = common.model_spec(model)
    except common.UsageError:
        spec = None
    if tune_npz is None and spec is not None and spec.classifier:
        x, y, files = common.load_split("tune", spec)
        split = common.load_splits()
        other = {p for p, _ in split.get("eval", [])} | {p for p, _ in split.get("calib", [])}
        both = sorted(set(files) & other)
        if both:
            raise common.StageError(f"{len(both)} tuning image(s) are also evaluation or "
                                    f"calibration images (first: {both[0]}): rerun "
                                    "0_prepare_data.py --tune-fraction F")
        name = onnx_graph.inputs(onnx_graph.load(onnx_path, external=False))[0][0]
        data = evaluate.EvalData(x_u8=x, y=y, files=files, mean=spec.mean, std=spec.std,
                                 input_name=name)
        source = f"tune split of {common.splits_path()} ({len(files)} images)"
    else:
        path = Path(tune_npz) if tune_npz else common.model_artifacts(model) / "tune.npz"
        if not path.exists():
            raise common.StageError(
                f"no tuning data for {model}: {path} missing. The mixed-precision search needs "
                "samples disjoint from calibration and evaluation: for an image classifier run "
                "0_prepare_data.py --tune-fraction 0.25 (or bash run_all.sh --auto-precision); "
                "for another model save them with np.savez (keyed by input name, batch on "
                "axis 0) as that file or pass --tune-npz")
        feed = common.load_npz(path, None, "np.savez (tuning samples)")
        # the checks calibration data gets (input names, rank, static dims, dtype, sample
        # counts, NaN/Inf): a wrong file is refused here, not as an ONNX Runtime traceback
        import qdq_tools

        qdq_tools.validate_calibration(onnx_path, feed, None, source=f"tuning data {path}",
                                       reference_source="tuning data: not compared",
                                       producer="the tuning samples must be disjoint from "
                                                "the calibration and evaluation data")
        data = evaluate.EvalData(feed=feed)
        source = str(path)
    n = len(data)
    if images is not None and images < n:
        idx = np.sort(np.random.default_rng(seed).choice(n, size=images, replace=False))
        data = _subset(data, idx)
        source += f", seeded subset of {images} (seed {seed})"
    return data, {"source": source, "n": len(data), "sha256": data_digest(data),
                  "images": images, "seed": seed, "tune_npz": str(tune_npz) if tune_npz else None}


def base_qdq(model: str, fp32: Path, calib: Path, calib_batch: str, eps: str, work: Path,
             variant: str = VARIANT) -> tuple[Path, dict]:
    """ModelOpt's quantization of every candidate: ``variant``'s recipe without exclusions,
    through ``qdq_tools.py modelopt`` (its own process: ModelOpt patches ORT's calibrators),
    reused from ``work/base.onnx`` when the FP32 model, calibration data, flags, calibration
    batch and ModelOpt version are the same.

    Returns:
        ``(path of the base Q/DQ model, {"command", "key", "reused", "wall_s"})``.
    Raises:
        StageError: ModelOpt failed (the log's last lines are in the message).
    """
    import variants

    flags = variants.modelopt_args(variant, str(calib), eps)
    key = {"fp32": common.sha256_file(fp32), "calib": common.sha256_file(calib),
           "flags": ["<calib>" if f == str(calib) else f for f in flags],
           "calib_batch": str(calib_batch),
           "modelopt": common.versions().get("nvidia-modelopt")}
    out, meta = work / "base.onnx", work / "base.json"
    if out.exists() and meta.exists():
        try:
            old = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        if old.get("key") == key and old.get("sha256") == common.sha256_file(out):
            return out, {**old, "reused": True}
    work.mkdir(parents=True, exist_ok=True)
    log = work / "base.quant.log"
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=work, prefix=".tmp-base-") as tmp:
        src = Path(tmp) / "fp32.onnx"
        src.write_bytes(Path(fp32).read_bytes())  # ModelOpt rewrites its --onnx_path
        cmd = [sys.executable, str(common.ROOT / "qdq_tools.py"), "modelopt", "--calib-batch",
               str(calib_batch), "--", "--onnx_path", str(src), *flags,
               "--output_path", str(Path(tmp) / "base.onnx")]
        shown = " ".join(cmd).replace(str(src), str(fp32)).replace(
            str(Path(tmp) / "base.onnx"), str(out))
        print(f"auto-precision: quantizing every candidate once: {shown}", file=sys.stderr)
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=common.ROOT)
        if p.returncode != 0 or not (Path(tmp) / "base.onnx").exists():
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise common.StageError(f"ModelOpt failed on the base quantization (exit "
                                    f"{p.returncode}); last lines of {log}:\n  "
                                    + "\n  ".join(tail))
        os.replace(Path(tmp) / "base.onnx", out)
    rec = {"key": key, "command": shown, "log": str(log), "sha256": common.sha256_file(out),
           "wall_s": round(time.time() - t0, 1)}
    common.write_json(meta, rec)
    return out, {**rec, "reused": False}


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------
def record_paths(model: str, out_dir: Path | None = None,
                 stem: str = "auto_precision") -> dict[str, Path]:
    """``{"json", "md", "png"}``: ``<out_dir>/<stem>.*``, by default in the search's work folder
    ``artifacts/<model>/auto_precision/``. ``results/<model>/auto_precision.*`` are written only
    by :func:`publish` (``5_quantize.sh int8_auto`` once the file it describes is installed), so
    a search by hand or a run that fails verification never replaces the record of the
    installed ``int8_auto.onnx``."""
    d = Path(out_dir) if out_dir else common.model_artifacts(model) / "auto_precision"
    return {k: d / f"{stem}.{k}" for k in ("json", "md", "png")}


def publish(src_dir: Path, dst_dir: Path, failed: bool = False) -> dict[str, Path]:
    """Copy a search record (``auto_precision.{json,md,png}`` in ``src_dir``) to ``dst_dir``
    as ``auto_precision.*``, or as ``auto_precision.failed.*`` beside the good one when
    ``failed`` (the run's file was not installed); the record's ``outputs`` and the markdown's
    image link name the published files. Each file is written atomically.

    Raises:
        StageError: no record in ``src_dir``.
    """
    src = record_paths("", src_dir)
    rec = common.load_json(common.require(src["json"], "auto_precision.py search"))
    dst = record_paths("", dst_dir, "auto_precision.failed" if failed else "auto_precision")
    rec["outputs"] = {k: str(v) for k, v in dst.items()}
    rec["published"] = {"failed": failed, "from": str(src_dir)}
    if src["png"].exists() and rec.get("plot", True):
        with common.atomic_path(dst["png"]) as tmp:
            shutil.copyfile(src["png"], tmp)
    else:
        rec["plot"] = False
        dst["png"].unlink(missing_ok=True)
    common.write_json(dst["json"], rec)
    with common.atomic_path(dst["md"]) as tmp:
        tmp.write_text(render_markdown(rec))
    return dst


def plot_sensitivity(rec: dict, path: Path) -> Path:
    """PNG of the per-node sensitivity (graph order): cosine error added when the node alone is
    INT8 and removed when it alone is kept in float (log scale), each node's share of the MACs
    (nodes kept in float marked), and the ranking path: % of MACs in INT8 against the tuning
    split's cosine error and top-1 agreement, with the budget and the choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rec["candidates"]
    x = np.arange(len(rows))
    floor = 1e-7
    added = np.maximum([r["cosine_error_added"] for r in rows], floor)
    removed = np.maximum([r["cosine_error_removed"] for r in rows], floor)
    share = np.array([100 * (r["mac_share"] or 0) for r in rows])
    kept = np.array([r["kept_float"] for r in rows])
    fig = plt.figure(figsize=(max(8, 0.22 * len(rows) + 2), 10))
    grid = fig.add_gridspec(3, 1, height_ratios=[2.2, 1, 1.8], hspace=0.55)
    ax = fig.add_subplot(grid[0])
    bx = fig.add_subplot(grid[1], sharex=ax)
    cx = fig.add_subplot(grid[2])
    w = 0.4
    ax.bar(x - w / 2, added, w, color="tab:red", label="1 - cosine, node alone in INT8")
    ax.bar(x + w / 2, removed, w, color="tab:blue",
           label="cosine gained, node alone kept in float")
    ax.set_yscale("log")
    ax.set_ylabel("logits cosine error")
    budget = rec["budget"].get("min_cosine")
    if budget is not None:
        ax.axhline(1 - budget, color="0.3", ls="--", lw=0.8, label=f"1 - budget ({budget})")
    full = cosine_error(rec["full_int8"])
    ax.axhline(max(full, floor), color="tab:red", ls=":", lw=0.8,
               label=f"all INT8 (cosine {1 - full:.5f})")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{rec['model']}: per-node sensitivity on {rec['tuning']['n']} tuning samples "
                 f"(ORT CPU, optimisations off); kept in float: {len(rec['excluded'])}",
                 fontsize=9)
    bx.bar(x, share, color=np.where(kept, "tab:orange", "tab:green"))
    bx.set_ylabel("% of MACs")
    bx.set_xticks(x)
    bx.set_xticklabels([r["name"] for r in rows], rotation=90, fontsize=6)
    for t, k in zip(bx.get_xticklabels(), kept):
        if k:
            t.set_color("tab:orange")
            t.set_fontweight("bold")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:green", "tab:orange")]
    bx.legend(handles, ["INT8", "kept in float"], fontsize=7, loc="upper right")
    bx.grid(alpha=0.3, axis="y")
    plt.setp(ax.get_xticklabels(), visible=False)
    ranking = [r for r in rec.get("path", []) if r["int8_mac_fraction"] is not None]
    if ranking:
        px = [100 * r["int8_mac_fraction"] for r in ranking]
        cx.plot(px, [max(cosine_error(r["metrics"]), floor) for r in ranking], "o-",
                color="tab:red", ms=3, label="1 - cosine (mean)")
        if budget is not None:
            cx.axhline(1 - budget, color="0.3", ls="--", lw=0.8)
        cx.set_yscale("log")
        cx.set_xlabel("% of MACs in INT8 (prefixes of the ranking kept in float; right = all "
                      "INT8)")
        cx.set_ylabel("1 - cosine", color="tab:red")
        cx.grid(alpha=0.3)
        if ranking[0]["metrics"].get("agreement") is not None:
            dx = cx.twinx()
            dx.plot(px, [r["metrics"]["agreement"] for r in ranking], "s-", color="tab:blue",
                    ms=3, label="top-1 agreement %")
            if rec["budget"].get("min_agreement") is not None:
                dx.axhline(rec["budget"]["min_agreement"], color="tab:blue", ls=":", lw=0.8)
            dx.set_ylabel("top-1 agreement %", color="tab:blue")
        frac = rec.get("int8_mac_fraction")
        if frac is not None:
            cx.axvline(100 * frac, color="tab:orange", lw=1.2,
                       label=f"chosen ({100 * frac:.1f} % INT8)")
        cx.axvline(90, color="0.5", ls=":", lw=0.8, label="90 % INT8")
        cx.legend(fontsize=7, loc="upper left")
        cx.set_title("ranking path on the tuning split", fontsize=9)
    else:
        cx.set_axis_off()
    with common.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def _num(v, digits: int) -> str:
    return "undefined" if v is None else f"{v:.{digits}f}"


def _metrics_line(m: dict | None) -> str:
    return _fmt_m(m) + f" on {m['n']} samples" if m else "-"


def render_markdown(rec: dict) -> str:
    """The search (and verification) as markdown: summary, the nodes kept in float with their
    sensitivity and MACs, then every candidate."""
    pct = lambda v: "" if v is None else f"{100 * v:.2f}"  # noqa: E731
    out = [f"# Mixed precision for an accuracy budget: {rec['model']}\n",
           f"Budget: {rec['budget_text']} (tuning split: {rec['tuning']['source']}).  ",
           f"Measured on: {rec['semantics']}.  ",
           *[f"**Warning:** {w}.  " for w in rec.get("warnings", [])],
           f"Candidates: {len(rec['candidates'])} nodes ModelOpt quantized (`{rec['base']['command']}`)."
           f" Search: {rec['search']['evaluations']['run']} configurations run, "
           f"{rec['search']['evaluations']['cached']} from the cache, {rec['search']['wall_s']} s"
           f" on {rec['search']['machine']}.\n",
           f"- all INT8: {_metrics_line(rec['full_int8'])}",
           f"- all candidates float: {_metrics_line(rec['all_float'])}",
           f"- chosen ({len(rec['excluded'])} kept in float, {pct(rec['int8_mac_fraction'])} % "
           f"of MACs in INT8): {_metrics_line(rec['predicted'])}; budget "
           + ("met" if rec["budget_met"] else "MISSED: " + "; ".join(rec["budget_misses"]))]
    v = rec.get("verify")
    if v:
        out.append(f"- re-quantized by ModelOpt (`{v['onnx']}`, {pct(v['macs']['int8_fraction'])}"
                   f" % of MACs in INT8), tuning split: {_metrics_line(v['tune'])}; budget "
                   + ("met" if v["tune_budget_met"] else "MISSED: " + "; ".join(v["tune_misses"])))
        if v.get("eval"):
            out.append(f"- **evaluation split**: {_metrics_line(v['eval'])}; budget "
                       + ("met" if v["eval_budget_met"] else
                          "MISSED: " + "; ".join(v["eval_misses"])))
        if v.get("structure_differences"):
            out.append(f"- ModelOpt's file differs from the searched configuration: "
                       f"{v['structure_differences']}")
    out.append("\n## Kept in float\n")
    out.append("| node | op | MACs | % of MACs | 1-cos INT8 alone | flips INT8 alone | "
               "cos gained float alone | flips removed | rank |\n|---|---|---|---|---|---|---|---|---|")
    rows = [r for r in rec["candidates"] if r["kept_float"]]
    for r in rows:
        out.append(f"| `{r['name']}` | {r['op_type']} | {r['macs']:,} | {pct(r['mac_share'])} | "
                   f"{r['cosine_error_added']:.2e} | {r['flips_added']} | "
                   f"{r['cosine_error_removed']:.2e} | {r['flips_removed']} | {r['rank']} |")
    if not rows:
        out.append("| (none: every candidate stays INT8) | | | | | | | | |")
    out.append(f"\nExclusion list (ModelOpt `--nodes_to_exclude`): "
               f"`{' '.join(rec['exclude_regexes']) or '(none)'}`\n")
    out.append("## Every candidate (graph order)\n")
    out.append("| node | op | % of MACs | 1-cos INT8 alone | cos gained float alone | "
               "score/MAC rank | kept float |\n|---|---|---|---|---|---|---|")
    for r in rec["candidates"]:
        out.append(f"| `{r['name']}` | {r['op_type']} | {pct(r['mac_share'])} | "
                   f"{r['cosine_error_added']:.2e} | {r['cosine_error_removed']:.2e} | "
                   f"{r['rank']} | {'yes' if r['kept_float'] else ''} |")
    if rec.get("path"):
        out.append("\n## Ranking path (tuning split; first N of the ranking kept in float)\n")
        out.append("| N float | last added | % of MACs in INT8 | cosine | agreement % | top-1 % | "
                   "budget |\n|---|---|---|---|---|---|---|")
        num = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        for r in rec["path"]:
            m = r["metrics"]
            out.append(f"| {r['n_float']} | `{r['node'] or '-'}` | {pct(r['int8_mac_fraction'])} | "
                       f"{_num(m.get('cosine_mean'), 5)} | {num(m.get('agreement'))} | "
                       f"{num(m.get('top1'))} | {'met' if r['met'] else ''} |")
    if rec.get("plot", True):
        out.append(f"\n![per-node sensitivity]({Path(rec['outputs']['png']).name})\n")
    return "\n".join(out) + "\n"


def write_outputs(rec: dict, plot: bool = True) -> None:
    """Write the record's JSON, markdown and (``plot``) PNG to ``rec["outputs"]``."""
    paths = {k: Path(v) for k, v in rec["outputs"].items()}
    if plot:
        plot_sensitivity(rec, paths["png"])
    elif not rec.get("plot", True):  # search --no-plot: a PNG there shows an older search
        paths["png"].unlink(missing_ok=True)
    common.write_json(paths["json"], rec)
    with common.atomic_path(paths["md"]) as tmp:
        tmp.write_text(render_markdown(rec))


def _budget_arg(text: str) -> float | None:
    if text.lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number, or 'off'") from None


def budget_from_args(args: argparse.Namespace) -> Budget:
    """:class:`Budget` from ``--min-agreement/--min-cosine/--max-top1-drop``.

    Raises:
        UsageError: a bound outside its range, or every bound off.
    """
    b = Budget(args.min_agreement, args.min_cosine, args.max_top1_drop)
    if b.min_agreement is not None and not 0 <= b.min_agreement <= 100:
        raise common.UsageError(f"--min-agreement {b.min_agreement}: a percentage in [0, 100]")
    if b.min_cosine is not None and not -1 <= b.min_cosine <= 1:
        raise common.UsageError(f"--min-cosine {b.min_cosine}: a cosine similarity lies in "
                                "[-1, 1]")
    if b.max_top1_drop is not None and b.max_top1_drop < 0:
        raise common.UsageError(f"--max-top1-drop {b.max_top1_drop}: points, >= 0")
    if b.min_agreement is None and b.min_cosine is None and b.max_top1_drop is None:
        raise common.UsageError("every budget bound is off: give at least one of "
                                "--min-agreement, --min-cosine, --max-top1-drop")
    return b


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
def _paths(args) -> tuple[Path, Path]:
    art = common.model_artifacts(args.model)
    fp32 = Path(args.fp32) if args.fp32 else art / "onnx" / "fp32.onnx"
    work = Path(args.work_dir) if args.work_dir else art / "auto_precision"
    return fp32, work


def _fp32_reference(fp32: Path, data, work: Path, digest: str, batch: int, what: str
                    ) -> dict[str, np.ndarray]:
    key = hashlib.sha256(f"{common.sha256_file(fp32)}:{digest}:{MODE}".encode()).hexdigest()[:20]
    return cached_outputs(work / "cache" / f"{key}.{what}_fp32.npz",
                          lambda: run_model(fp32, data, batch, desc=f"FP32 reference ({what})"))


def cmd_search(args: argparse.Namespace) -> dict:
    """``search``: measure, choose, write the record; print the anchored exclusion regexes on
    stdout (one per line; nothing else goes to stdout)."""
    started = time.time()
    common.check_positive(args, "batch", "tune_images")
    budget = budget_from_args(args)
    fp32, work = _paths(args)
    common.require(fp32, "2_export_onnx.py")
    outputs = record_paths(args.model, args.out_dir)
    common.check_writable(work, outputs["json"].parent)
    data, tuning = tuning_data(args.model, fp32, args.tune_npz, args.tune_images, args.seed)
    if args.qdq:
        qdq = common.require(Path(args.qdq), "5_quantize.sh (or your own Q/DQ model)")
        calib_sha = common.sha256_file(args.calib) if args.calib else None
        base = {"command": f"given: {qdq}", "reused": True, "sha256": common.sha256_file(qdq)}
    else:
        calib = Path(args.calib) if args.calib else common.model_artifacts(args.model) / "calib.npz"
        common.require(calib, "4_make_calib.py")
        calib_sha = common.sha256_file(calib)
        qdq, base = base_qdq(args.model, fp32, calib, args.calib_batch, args.eps, work,
                             args.variant)
    fp32_model = onnx_graph.load(fp32, "2_export_onnx.py")
    try:
        space = QdqSpace(onnx_graph.load(qdq), fp32_model)
    except common.StageError as e:
        if "nothing to choose" not in str(e):
            raise
        ops = sorted({n.op_type for n in fp32_model.graph.node if n.op_type in MAC_OPS})
        raise common.StageError(
            f"{e}: {qdq} ({base['command']}) has no Q/DQ on them; the FP32 model has "
            f"{ops or 'no Conv/Gemm/MatMul'}. ModelOpt says why in "
            f"{base.get('log', 'its log')} ('Final number of nodes to quantize'); e.g. its "
            "GEMV rule leaves a Gemm/MatMul that reads one vector per sample in float, and "
            "--op_types_to_quantize of the variant (variants.py) may not list the op. Nothing "
            "to search: use another variant for this model") from None
    key_fields = {"fp32": common.sha256_file(fp32), "qdq": base["sha256"], "calib": calib_sha,
                  "tune": tuning["sha256"], "mode": MODE,
                  "onnxruntime": common.versions().get("onnxruntime")}
    cache = Cache(work / "cache", key_fields)
    ref = _fp32_reference(fp32, data, work, tuning["sha256"], args.batch, "tune")
    warnings = budget_warnings(budget, tuning["n"])
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"auto-precision: budget {budget.describe()}; tuning data: {tuning['source']}; "
          f"cache {cache.path} ({len(cache.data['configs'])} configurations)", file=sys.stderr)
    t0 = time.time()
    try:
        res = search(space, data, ref, budget, cache, args.batch, prune=not args.no_prune)
    except KeyboardInterrupt:
        print(f"\nauto-precision: interrupted; {len(cache.data['configs'])} measured "
              f"configurations are cached in {cache.path}: the same command resumes from "
              "there", file=sys.stderr)
        raise
    wall = round(time.time() - t0, 1)
    evaluations = res.pop("evaluations")
    rec = {"stage": "auto_precision", "model": args.model, "variant": args.variant,
           "budget": dataclasses.asdict(budget), "budget_text": budget.describe(),
           "semantics": SEMANTICS, "fp32": str(fp32), "qdq_base": str(qdq), "base": base,
           "tuning": tuning, "seed": args.seed, "warnings": warnings, **res,
           "exclude_regexes": anchored(res["excluded"]),
           "search": {"wall_s": wall, "evaluations": evaluations,
                      "cache": str(cache.path), "machine": _machine()},
           "outputs": {k: str(v) for k, v in outputs.items()}}
    rec["provenance"] = common.provenance(args, [fp32, qdq], started)
    rec["plot"] = not args.no_plot
    write_outputs(rec, plot=not args.no_plot)
    frac = rec["int8_mac_fraction"]
    print(f"auto-precision: keep {len(rec['excluded'])} node(s) in float "
          f"({', '.join(rec['excluded'][:6])}{' ...' if len(rec['excluded']) > 6 else ''}); "
          f"{100 * frac:.2f} % of MACs in INT8; tuning split: {_fmt_m(rec['predicted'])}; "
          f"{rec['search']['evaluations']['run']} configurations run, "
          f"{rec['search']['evaluations']['cached']} cached, {wall} s -> {outputs['md']}",
          file=sys.stderr)
    for r in rec["exclude_regexes"]:
        print(r)
    return rec


def _machine() -> str:
    d = common.device_info()
    return (f"{d.get('cpu')} ({d.get('cpu_count')} cores; shared with other jobs, times vary)")


def cmd_verify(args: argparse.Namespace) -> dict:
    """``verify``: measure ModelOpt's re-quantized file on the tuning split (against the budget
    and the searched configuration) and on the evaluation split; update the record.

    Raises:
        StageError: no search record, other tuning data than the search's, or the file misses
            the budget on the tuning split.
    """
    import evaluate

    started = time.time()
    common.check_positive(args, "batch")
    outputs = record_paths(args.model, args.out_dir)
    rec = common.load_json(common.require(outputs["json"], "auto_precision.py search "
                                          "(5_quantize.sh int8_auto runs both)"))
    fp32, work = _paths(args)
    onnx_path = common.require(Path(args.onnx), "5_quantize.sh int8_auto")
    budget = Budget(**rec["budget"])
    t = rec["tuning"]
    data, tuning = tuning_data(args.model, fp32, t.get("tune_npz"), t.get("images"), t["seed"])
    if tuning["sha256"] != t["sha256"]:
        raise common.StageError("the tuning data changed since the search (another split or "
                                "npz): rerun auto_precision.py search (5_quantize.sh int8_auto)")
    ref = _fp32_reference(fp32, data, work, t["sha256"], args.batch, "tune")
    labels = data.y if data.classifier else None
    q_model = onnx_graph.load(onnx_path)
    out = run_model(q_model, data, args.batch, desc="int8_auto (tuning)")
    m_tune = metrics(ref, out, labels)
    space = QdqSpace(onnx_graph.load(rec["qdq_base"]), onnx_graph.load(fp32))
    predicted = run_model(space.model(rec["excluded"]), data, args.batch,
                          desc="searched configuration")
    match = metrics(predicted, out)
    expected_int8 = {n for n in space.names if n not in rec["excluded"]}
    actual = {r["name"]: r["int8"] for r in mac_table(q_model)}
    diffs = {"float_but_searched_int8": sorted(n for n in expected_int8 if not actual.get(n)),
             "int8_but_searched_float": sorted(n for n in rec["excluded"] if actual.get(n))}
    v = {"onnx": str(args.installed_as or onnx_path), "sha256": common.sha256_file(onnx_path),
         "macs": mac_summary(q_model), "tune": m_tune, "tune_budget_met": budget.met(m_tune),
         "tune_misses": budget.misses(m_tune), "tune_margins": budget.margins(m_tune),
         "vs_searched_configuration": match,
         "structure_differences": {k: v for k, v in diffs.items() if v}, "eval": None}
    try:
        spec = common.model_spec(args.model)
    except common.UsageError:
        spec = None
    if spec is not None and spec.classifier and not args.no_eval:
        name = onnx_graph.inputs(q_model)[0][0]
        ev = evaluate.classifier_data(spec, args.limit, input_name=name)
        digest = data_digest(ev)
        ref_e = _fp32_reference(fp32, ev, work, digest, args.batch, "eval")
        m_eval = metrics(ref_e, run_model(q_model, ev, args.batch, desc="int8_auto (eval)"),
                         ev.y)
        v.update(eval=m_eval, eval_budget_met=budget.met(m_eval),
                 eval_misses=budget.misses(m_eval), eval_margins=budget.margins(m_eval))
    v["wall_s"] = round(time.time() - started, 1)
    rec["verify"] = v
    rec["provenance_verify"] = common.provenance(args, [onnx_path, fp32], started)
    write_outputs(rec, plot=False)
    frac = v["macs"]["int8_fraction"]
    print(f"auto-precision verify: {onnx_path.name}: {100 * (frac or 0):.2f} % of MACs in INT8; "
          f"tuning: {_fmt_m(m_tune)} (budget {'met' if v['tune_budget_met'] else 'MISSED'}); "
          f"vs searched configuration cosine min {_num(match['cosine_min'], 6)}"
          + (f"; evaluation: {_fmt_m(v['eval'])} (budget "
             f"{'met' if v['eval_budget_met'] else 'missed: ' + '; '.join(v['eval_misses'])})"
             if v["eval"] else ""), file=sys.stderr)
    if v["structure_differences"]:
        print(f"WARNING: ModelOpt's file differs from the searched configuration: "
              f"{v['structure_differences']}", file=sys.stderr)
    if not v["tune_budget_met"]:
        raise common.StageError(
            f"{onnx_path}: ModelOpt's re-quantized model misses the budget on the tuning split "
            f"({'; '.join(v['tune_misses'])}) although the searched configuration met it "
            f"({_fmt_m(rec['predicted'])}); outputs vs the searched configuration: cosine min "
            f"{_num(match['cosine_min'], 6)}; structure differences: "
            f"{v['structure_differences'] or 'none'}")
    return rec


def cmd_macs(args: argparse.Namespace) -> dict:
    """``macs``: MACs per node and the fraction in INT8."""
    model = onnx_graph.load(args.onnx)
    rows = mac_table(model)
    s = mac_summary(model)
    if not args.summary:
        for r in rows:
            print(f"{'INT8 ' if r['int8'] else 'float'} {r['macs'] if r['macs'] is not None else '?':>12}"
                  f"  {r['op_type']:<8} {r['name']}")
    frac = s["int8_fraction"]
    print(f"{args.onnx}: {s['n_int8_nodes']}/{s['n_nodes']} Conv/Gemm/MatMul nodes in INT8, "
          f"{s['int8_macs']:,} of {s['total_macs']:,} MACs per sample"
          + (f" ({100 * frac:.2f} %)" if frac is not None else "")
          + (f"; MACs unknown for {len(s['unknown'])} node(s)" if s["unknown"] else ""))
    return s


def _add_common(p: argparse.ArgumentParser) -> None:
    common.add_shared_args(p, "model")
    p.add_argument("--fp32", type=Path, default=None,
                   help="FP32 ONNX model (default: artifacts/<model>/onnx/fp32.onnx)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="base Q/DQ model, cache and logs (default: "
                        "artifacts/<model>/auto_precision)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where auto_precision.{json,md,png} go (default: the work dir; "
                        "5_quantize.sh int8_auto publishes them to results/<model> once the "
                        "file is installed)")
    p.add_argument("--batch", type=int, default=64, help="samples per ORT run")


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__, prog="auto_precision.py")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    s = sub.add_parser("search", help="measure every candidate, choose the nodes to keep in "
                       "float, print their ^name$ regexes", formatter_class=common.HelpFormatter)
    _add_common(s)
    s.add_argument("--calib", type=Path, default=None,
                   help="calibration npz for the base quantization (default: "
                        "artifacts/<model>/calib.npz)")
    s.add_argument("--calib-batch", default="all",
                   help="calibration batch of the base quantization (qdq_tools.py check-calib "
                        "prints the one stage 5 uses)")
    s.add_argument("--eps", default="cpu", help="ModelOpt --calibration_eps")
    s.add_argument("--variant", default=VARIANT,
                   help="variants.py entry whose recipe (without exclusions) makes the base "
                        "Q/DQ model")
    s.add_argument("--qdq", type=Path, default=None,
                   help="use this Q/DQ model as the base instead of running ModelOpt")
    s.add_argument("--tune-npz", type=Path, default=None,
                   help="tuning samples keyed by input name (default: the tune split for an "
                        "image classifier, else artifacts/<model>/tune.npz)")
    s.add_argument("--tune-images", type=int, default=None,
                   help="use a seeded subset of this many tuning samples (default: all)")
    s.add_argument("--seed", type=int, default=0, help="seed of --tune-images' subset")
    s.add_argument("--min-agreement", type=_budget_arg, default=DEFAULT_BUDGET["min_agreement"],
                   help="budget: top-1 agreement with FP32 on the tuning split, %% ('off' to "
                        "skip)")
    s.add_argument("--min-cosine", type=_budget_arg, default=DEFAULT_BUDGET["min_cosine"],
                   help="budget: mean logits cosine similarity with FP32 ('off' to skip)")
    s.add_argument("--max-top1-drop", type=_budget_arg, default=None,
                   help="budget: top-1 may drop at most this many points below FP32 (default: "
                        "off)")
    s.add_argument("--no-prune", action="store_true",
                   help="take the shortest prefix of the measured ranking path that meets the "
                        "budget, without trying its nodes back in INT8 (a rerun with another "
                        "budget then measures nothing new)")
    s.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    s = sub.add_parser("verify", help="measure the re-quantized file on the tuning and "
                       "evaluation splits", formatter_class=common.HelpFormatter)
    _add_common(s)
    s.add_argument("--onnx", type=Path, required=True, help="the re-quantized Q/DQ model")
    s.add_argument("--installed-as", type=Path, default=None,
                   help="the path the file will have (5_quantize.sh verifies it before "
                        "installing it)")
    s.add_argument("--limit", type=int, default=None,
                   help="evaluation split: the first N images only (smoke runs)")
    s.add_argument("--no-eval", action="store_true", help="tuning split only")
    s = sub.add_parser("publish", help="copy a search record into a results folder (as "
                       "auto_precision.failed.* with --failed)", formatter_class=common.HelpFormatter)
    s.add_argument("--from", dest="src", type=Path, required=True,
                   help="folder holding auto_precision.{json,md,png}")
    s.add_argument("--to", dest="dst", type=Path, required=True, help="results folder")
    s.add_argument("--failed", action="store_true",
                   help="the run's file was not installed: publish beside the good record")
    s = sub.add_parser("macs", help="MACs per Conv/Gemm/MatMul node and the fraction in INT8",
                       formatter_class=common.HelpFormatter)
    s.add_argument("onnx", type=Path, help="any ONNX model")
    s.add_argument("--summary", action="store_true", help="only the summary line")
    return p


def main(args: argparse.Namespace):
    if args.cmd == "publish":
        for k, v in publish(args.src, args.dst, args.failed).items():
            if v.exists():
                print(f"{k}: {v}")
        return None
    return {"search": cmd_search, "verify": cmd_verify, "macs": cmd_macs}[args.cmd](args)


if __name__ == "__main__":
    common.cli(get_args_parser, main)
