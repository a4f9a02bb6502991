"""The numerics a Q/DQ graph states, run at ORT's speed: the backend cross-check's reference.

A Q/DQ graph says what it computes: each weight is dequantized as its DequantizeLinear states,
each activation is rounded and clamped where a QuantizeLinear/DequantizeLinear pair stands, and
everything else is float arithmetic. ONNX Runtime with every graph optimisation off
(``ORT_DISABLE_ALL``) runs exactly that, but slowly: its plain NCHW convolution is most of the
time (Lite0's ``int8_hp32.onnx``: 17 ms an image against 8 ms for the same numerics below, on
the 2-core Intel Xeon of benchmarks/README.md, stop 45).

:func:`qdq_reference_runner` gets the same numerics from ORT's default level with its Q/DQ
rewrites off (``session.disable_quant_qdq``, ``session.disable_double_qdq_remover``, and the
``WeightBiasQuantization`` optimizer disabled; onnxruntime's ``onnxruntime_session_options_
config_keys.h``): ORT then folds each weight's Q/DQ into a float constant with its own
DequantizeLinear kernel (the bits the unoptimised run computes) and fuses and re-lays out the
float ops (NCHWc convolutions with their activation, Conv+Add, ...: FP32 reordering, as every
backend, TensorRT too, does). It does not take that on trust: ORT writes the graph it will run
(``optimized_model_filepath``) and :func:`unfaithful` checks it against the file before a sample
runs, node by node:

- every activation QuantizeLinear/DequantizeLinear of the file (one whose input is not computed
  from constants alone) is still there, under its output name, with the same attributes and
  the same scale and zero-point values, and there is no other;
- every other node is an op the file has, a Cast (ORT's CPU EP inserts them around FP16 ops at
  every level), an NCHWc op (``com.microsoft.nchwc``) or one of :data:`FLOAT_FUSIONS`: no
  integer kernel (QLinearConv, MatInteger, MatMulNBits, ...) and no op this check does not know.

Anything else, a graph with control flow (If/Loop/Scan: their subgraphs are not checked), or a
graph ORT cannot write, runs unoptimised as before, and the record says why.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

#: Session config entries that turn ORT's Q/DQ rewrites off (onnxruntime
#: ``onnxruntime_session_options_config_keys.h``: ``kOrtSessionOptionsDisableQuantQDQ``, and
#: ``kOrtSessionOptionsDisableDoubleQDQRemover``, which the first one leaves on).
QDQ_REWRITES_OFF = {"session.disable_quant_qdq": "1", "session.disable_double_qdq_remover": "1"}

#: Optimizers disabled by name as well: ``WeightBiasQuantization`` re-quantizes Conv biases to
#: int32 whatever the first key says (benchmarks/README.md, stop 42).
QDQ_OPTIMIZERS_OFF = ("WeightBiasQuantization",)

_QDQ = ("QuantizeLinear", "DequantizeLinear")
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")

#: ORT's float fusions (contrib ops, domain ``com.microsoft``) whose kernels compute the float
#: ops they replace, reordered (onnxruntime docs, "Graph optimizations"; ``FastGelu``, the tanh
#: approximation, is left out: ORT's ``GeluApproximation`` makes it from an exact Gelu).
FLOAT_FUSIONS = frozenset(("com.microsoft", op) for op in (
    "FusedConv", "FusedGemm", "FusedMatMul", "Gelu", "BiasGelu", "QuickGelu", "BiasAdd",
    "BiasSoftmax", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization",
    "SimplifiedLayerNormalization", "LayerNormalization"))

#: Standard ops ORT's float fusions may create where the file has none (MatMul+Add -> Gemm,
#: a LayerNorm pattern -> LayerNormalization), and the Casts of its FP16 handling.
_MADE_BY_FUSIONS = frozenset({("", "Gemm"), ("", "LayerNormalization"), ("", "Cast")})

_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def _domain(node) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _constant_tensors(graph) -> set[str]:
    """Names of the tensors computed from constants alone (initializers that are no graph
    input, Constant nodes, and nodes whose every input is one): what ORT's constant folding may
    fold. The graph's nodes are in topological order (ONNX requires it)."""
    inputs = {i.name for i in graph.input}
    const = {t.name for t in graph.initializer if t.name not in inputs}
    const |= {t.values.name for t in graph.sparse_initializer if t.values.name not in inputs}
    for n in graph.node:
        if n.op_type == "Constant" and _domain(n) == "":
            const.update(o for o in n.output if o)
        elif [i for i in n.input if i] and all(i in const for i in n.input if i) \
                and not n.op_type.startswith("Random"):
            const.update(o for o in n.output if o)
    return const


def _values(graph) -> dict[str, np.ndarray]:
    """Initializer and Constant-node tensors of ``graph`` by name, and the tensors Cast (or
    Identity) nodes make of them: ORT's CPU EP casts FP16 scales to float32 at every level and
    folds the cast where it optimises (a float16 to float32 cast is exact; NumPy rounds to
    float16 to nearest even, as IEEE 754 conversion does)."""
    from onnx import helper, numpy_helper

    vals = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for n in graph.node:
        if not n.output:
            continue
        if n.op_type == "Constant" and _domain(n) == "":
            for a in n.attribute:
                if a.name == "value":
                    vals[n.output[0]] = numpy_helper.to_array(a.t)
        elif n.op_type in ("Cast", "Identity") and _domain(n) == "" and n.input \
                and n.input[0] in vals:
            to = {a.name: a.i for a in n.attribute}.get("to")
            x = vals[n.input[0]]
            try:
                vals[n.output[0]] = x if to is None else x.astype(
                    helper.tensor_dtype_to_np_dtype(to))
            except (KeyError, TypeError, ValueError):
                pass  # a type NumPy does not have: not a known constant
    return vals


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


#: Attribute defaults of QuantizeLinear/DequantizeLinear (ONNX operator specs, opsets 10-23),
#: which ORT writes out where the file left them implicit.
_QDQ_DEFAULTS = {"axis": 1, "saturate": 1, "block_size": 0, "output_dtype": 0, "precision": 0}


def _attrs(node) -> dict:
    from onnx import helper

    return {**_QDQ_DEFAULTS, **{a.name: helper.get_attribute_value(a) for a in node.attribute}}


def unfaithful(original, optimized) -> str | None:
    """Why ``optimized`` (ORT's graph written with its Q/DQ rewrites off) may not compute the
    numerics of ``original`` (the file, or ORT's unoptimised graph of it), or None when it does
    (module docstring).

    Args:
        original, optimized: ``onnx.ModelProto`` (initializers loaded).
    Returns:
        None, or one sentence naming the first node that breaks the rule.
    """
    g0, g1 = original.graph, optimized.graph
    if any(n.op_type in _CONTROL_FLOW for n in g0.node):
        return "the graph has control flow (If/Loop/Scan), whose subgraphs this check does not read"
    const0, const1 = _constant_tensors(g0), _constant_tensors(g1)
    vals0, vals1 = _values(g0), _values(g1)
    acts0, alias = {}, {}  # canonical output -> node; every output -> its canonical one
    first: dict[tuple, str] = {}
    for n in g0.node:
        if n.op_type in _QDQ and _domain(n) in ("", "com.microsoft") and n.input \
                and n.input[0] not in const0:
            # ORT's CPU EP copies a DequantizeLinear per consumer at every level: a copy takes
            # the same inputs and attributes and computes the same tensor
            key = (_domain(n), n.op_type, tuple(n.input), tuple(sorted(_attrs(n).items())))
            alias[n.output[0]] = first.setdefault(key, n.output[0])
            acts0.setdefault(alias[n.output[0]], n)
    seen = set()
    known = {(_domain(n), n.op_type) for n in g0.node} | _MADE_BY_FUSIONS | FLOAT_FUSIONS
    for n in g1.node:
        dom, op = _domain(n), n.op_type
        if op in _QDQ and dom in ("", "com.microsoft"):
            if n.input and n.input[0] in const1:
                continue  # a constant's Q/DQ ORT left unfolded: computed as written
            ref = acts0.get(alias.get(n.output[0] if n.output else "", ""))
            if ref is None:
                return f"ORT's graph has a {op} ({n.output[0] if n.output else '?'}) the file has not"
            if dom != _domain(ref) or op != ref.op_type or _attrs(n) != _attrs(ref):
                return f"ORT changed the {op} that writes {n.output[0]}"
            for k in (1, 2):
                a = vals0.get(ref.input[k]) if len(ref.input) > k and ref.input[k] else None
                b = vals1.get(n.input[k]) if len(n.input) > k and n.input[k] else None
                if len(ref.input) > k and ref.input[k] and a is None:
                    return f"the {op} that writes {n.output[0]} takes a scale or zero point " \
                           "that is not a constant"
                if not _same_array(a, b):
                    return (f"ORT changed the {'scale' if k == 1 else 'zero point'} of the "
                            f"{op} that writes {n.output[0]}")
            seen.add(alias[n.output[0]])
        elif dom == "com.microsoft.nchwc":
            continue
        elif (dom, op) not in known:
            return f"ORT's graph computes with {(dom + ':') if dom else ''}{op}, not an op of the file"
    missing = sorted(set(acts0) - seen)
    if missing:
        return (f"ORT removed or renamed {len(missing)} activation Q/DQ node(s) of the file "
                f"(first: the one writing {missing[0]})")
    return None


def qdq_reference_runner(onnx_path: Path | str | bytes, *, threads: int = 0):
    """An ``OrtRunner`` (CPU EP) that computes the numerics ``onnx_path`` states: fast where
    ORT's optimised graph passes :func:`unfaithful` against ORT's unoptimised graph of the file
    (both as ORT writes them: the unoptimised one has the Casts and DequantizeLinear copies the
    CPU EP inserts at every level), else with every optimisation off.

    Args:
        onnx_path: the Q/DQ ONNX file, or its serialized bytes.
        threads: intra-op threads (0: ORT's default).
    Returns:
        ``(runner, how)``: an open ``deploykit.runners.OrtRunner`` (the caller closes it) and
        ``{"reference": "qdq_rewrites_off" | "unoptimised", "why": str | None}``: the second with
        the reason the first was not used.
    Raises:
        StageError: ORT cannot load the model unoptimised.
    """
    import onnx

    from deploykit.runners import OrtRunner

    why = None
    with tempfile.TemporaryDirectory(prefix="qdq-reference-") as tmp:
        plain_graph, fast_graph = Path(tmp) / "unoptimised.onnx", Path(tmp) / "optimised.onnx"
        # one session at a time (a large model's memory): the unoptimised one is made for its
        # graph and dropped, and made again only when the fast one is not used
        OrtRunner(onnx_path, "cpu", opt_level="disable", threads=threads,
                  save_optimized=plain_graph)
        try:
            fast = OrtRunner(onnx_path, "cpu", opt_level="all", threads=threads,
                             session_config=QDQ_REWRITES_OFF, save_optimized=fast_graph,
                             disabled_optimizers=QDQ_OPTIMIZERS_OFF)
            why = unfaithful(onnx.load(str(plain_graph)), onnx.load(str(fast_graph)))
        except Exception as e:  # noqa: BLE001 - any doubt runs the graph unoptimised
            why = f"ORT's optimised graph could not be written or read ({type(e).__name__}: {e})"
    if why is None:
        return fast, {"reference": "qdq_rewrites_off", "why": None}
    return (OrtRunner(onnx_path, "cpu", opt_level="disable", threads=threads),
            {"reference": "unoptimised", "why": why})
