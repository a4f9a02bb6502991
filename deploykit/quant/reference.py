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
(``optimized_model_filepath``) and :func:`unfaithful` checks it against ORT's unoptimised graph
of the file before a sample runs, node by node:

- every activation QuantizeLinear/DequantizeLinear of the file (one whose input is not computed
  from constants alone) is still there, under its output name, reading the same input tensor
  (no float op in front of it folded into it: ORT's ``ReluQuantFusion`` drops a Relu before a
  QuantizeLinear whatever its zero point and scale sign, and the session keys leave it on),
  with the same attributes and the same scale and zero-point values, and there is no other;
- every other node is an op the file has, a Cast (ORT's CPU EP inserts them around FP16 ops at
  every level), an NCHWc op (``com.microsoft.nchwc``) or one of :data:`FLOAT_FUSIONS`: no
  integer kernel (QLinearConv, MatMulInteger, MatMulNBits, ...) and no op this check does not know.

Anything else runs unoptimised as before, and the record says why; so does a graph with control
flow (If/Loop/Scan: their subgraphs are not checked), one ORT cannot write, and one that holds
FP16/BF16 constants (ORT's constant folding computes, e.g., an FP16 weight's DequantizeLinear in
FP16, where its unoptimised run casts the scale to FP32 first: ModelOpt's default fp16-scale
INT8 files moved 1000 times more activations by a step than FP32 reordering does; found by the
stop-45 review).
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

#: ORT's float fusions (contrib ops, domain ``com.microsoft``) whose kernels compute the float
#: ops they replace, reordered (onnxruntime docs, "Graph optimizations"). Left out: ``FastGelu``
#: (the tanh approximation: ORT's ``GeluApproximation`` makes it from an exact Gelu) and the
#: LayerNorm fusions: on ill-conditioned rows (mean 300, spread 0.01) the fused kernel's
#: variance moved 4.7 % of the int8 values after it by a step, far more than reordering does
#: (stop-45 review); a graph ORT fuses that way runs unoptimised (a LayerNormalization the file
#: has itself is its own op and stays).
FLOAT_FUSIONS = frozenset(("com.microsoft", op) for op in (
    "FusedConv", "FusedGemm", "FusedMatMul", "Gelu", "BiasGelu", "QuickGelu", "BiasAdd",
    "BiasSoftmax"))

#: Standard ops ORT's float fusions may create where the file has none (MatMul+Add -> Gemm),
#: and the Casts of its FP16 handling.
_MADE_BY_FUSIONS = frozenset({("", "Gemm"), ("", "Cast")})

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


class _Values:
    """Initializer and Constant-node tensors of a graph by name, read on demand (a large model's
    weights are never converted; external data is read for the tensors asked for, from
    ``base_dir``), and the tensors Cast (or Identity) nodes make of them: ORT's CPU EP casts
    FP16 scales to float32 at every level and folds the cast where it optimises (a float16 to
    float32 cast is exact; NumPy rounds to float16 to nearest even, as IEEE 754 conversion
    does)."""

    def __init__(self, graph, base_dir: Path | str | None = None):
        self.base_dir = str(base_dir) if base_dir is not None else None
        self.tensors = {t.name: t for t in graph.initializer}
        self.made = {n.output[0]: n for n in graph.node if n.output and _domain(n) == ""
                     and n.op_type in ("Constant", "Cast", "Identity")}
        self.memo: dict[str, np.ndarray | None] = {}

    def get(self, name: str) -> np.ndarray | None:
        if name not in self.memo:
            self.memo[name] = None  # a cycle reads as unknown
            self.memo[name] = self._read(name)
        return self.memo[name]

    def _read(self, name: str) -> np.ndarray | None:
        from onnx import helper, numpy_helper
        from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

        t = self.tensors.get(name)
        if t is not None:
            if uses_external_data(t):
                if self.base_dir is None:
                    return None
                load_external_data_for_tensor(t, self.base_dir)
            return numpy_helper.to_array(t)
        n = self.made.get(name)
        if n is None:
            return None
        if n.op_type == "Constant":
            return next((numpy_helper.to_array(a.t) for a in n.attribute if a.name == "value"),
                        None)
        x = self.get(n.input[0]) if n.input else None
        to = {a.name: a.i for a in n.attribute}.get("to")
        if x is None or to is None:
            return x
        try:
            return x.astype(helper.tensor_dtype_to_np_dtype(to))
        except (KeyError, TypeError, ValueError):
            return None  # a type NumPy does not have: not a known constant


_HALF = frozenset({10, 16})  # TensorProto.FLOAT16, TensorProto.BFLOAT16


def _half_constants(graph) -> list[str]:
    """Initializers and Constant nodes of ``graph`` held in FP16 or BF16."""
    out = [t.name for t in graph.initializer if t.data_type in _HALF]
    out += [n.output[0] for n in graph.node if n.op_type == "Constant" and n.output
            and any(a.name == "value" and a.t.data_type in _HALF for a in n.attribute)]
    return out


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


#: Integer ranges of the QuantizeLinear output types (TensorProto codes) whose clamp
#: :func:`_clamp_redundant` can judge.
_Q_RANGES = {2: (0, 255), 3: (-128, 127), 4: (0, 65535), 5: (-32768, 32767), 21: (0, 15),
             22: (-8, 7)}


def _clamp_redundant(clamp, src: str, q, vals) -> bool:
    """Whether ``clamp`` (a Relu, or a Clip with constant bounds, reading ``src``) in front of
    the per-tensor QuantizeLinear ``q`` can change no quantized value: its lower bound quantizes
    to the end of the integer range that values below it reach, and its upper bound to the
    other (ORT's ``ReluQuantFusion``/``ClipQuantFusion`` then drop it; any other case keeps
    the graph on the unoptimised run)."""
    if clamp is None or _domain(clamp) != "" or not clamp.input or clamp.input[0] != src \
            or clamp.op_type not in ("Relu", "Clip") or q.op_type != "QuantizeLinear":
        return False
    s = vals.get(q.input[1]) if len(q.input) > 1 else None
    zp = vals.get(q.input[2]) if len(q.input) > 2 and q.input[2] else np.zeros((), np.uint8)
    if s is None or zp is None or s.size != 1 or zp.size != 1 or s.dtype != np.float32:
        return False
    from onnx import helper

    rng = _Q_RANGES.get(helper.np_dtype_to_tensor_dtype(zp.dtype))
    if rng is None or zp.dtype == np.float32:
        return False
    lo, hi = np.float32(-np.inf), np.float32(np.inf)
    if clamp.op_type == "Relu":
        lo = np.float32(0)
    else:
        attrs = {a.name: a.f for a in clamp.attribute}
        lo, hi = np.float32(attrs.get("min", lo)), np.float32(attrs.get("max", hi))
        for k, name in ((1, "lo"), (2, "hi")):
            if len(clamp.input) > k and clamp.input[k]:
                v = vals.get(clamp.input[k])
                if v is None or v.size != 1:
                    return False
                if name == "lo":
                    lo = np.float32(v.ravel()[0])
                else:
                    hi = np.float32(v.ravel()[0])
    scale, z = np.float32(s.ravel()[0]), int(zp.ravel()[0])

    def quant(v):  # ONNX QuantizeLinear: round half to even, then saturate
        with np.errstate(all="ignore"):
            r = np.rint(np.float32(v) / scale)
        return rng[0] if r == -np.inf else rng[1] if r == np.inf else \
            int(min(max(float(r) + z, rng[0]), rng[1]))

    low_end, high_end = (rng[0], rng[1]) if scale > 0 else (rng[1], rng[0])
    return quant(lo) == low_end and quant(hi) == high_end


def _not_checkable(graph) -> str | None:
    """Why the node check cannot vouch for ``graph`` whatever ORT makes of it (control flow,
    FP16/BF16 constants), or None."""
    if any(n.op_type in _CONTROL_FLOW for n in graph.node):
        return "the graph has control flow (If/Loop/Scan), whose subgraphs this check does not read"
    half = _half_constants(graph)
    if half:
        return (f"the graph holds FP16/BF16 constants ({half[0]}, ...): ORT's constant folding "
                "computes them in FP16 where its unoptimised run casts them to FP32 first")
    return None


def unfaithful(original, optimized, original_dir: Path | str | None = None,
               optimized_dir: Path | str | None = None) -> str | None:
    """Why ``optimized`` (ORT's graph written with its Q/DQ rewrites off) may not compute the
    numerics of ``original`` (ORT's unoptimised graph of the file), or None when it does
    (module docstring).

    Args:
        original, optimized: ``onnx.ModelProto`` (external data need not be loaded: the Q/DQ
            scales and zero points are read from ``original_dir`` / ``optimized_dir``).
    Returns:
        None, or one sentence naming the first node that breaks the rule.
    """
    g0, g1 = original.graph, optimized.graph
    why = _not_checkable(g0)
    if why:
        return why
    const0, const1 = _constant_tensors(g0), _constant_tensors(g1)
    vals0, vals1 = _Values(g0, original_dir), _Values(g1, optimized_dir)
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
    prod0 = {o: n for n in g0.node for o in n.output if o}
    known = {(_domain(n), n.op_type) for n in g0.node} | _MADE_BY_FUSIONS | FLOAT_FUSIONS
    for n in g1.node:
        dom, op = _domain(n), n.op_type
        if op in _QDQ and dom in ("", "com.microsoft"):
            if n.input and n.input[0] in const1:
                continue  # a constant's Q/DQ ORT left unfolded: computed as written
            out = n.output[0] if n.output else "?"
            ref = acts0.get(alias.get(out, ""))
            if ref is None:
                return f"ORT's graph has a {op} ({out}) the file has not"
            if dom != _domain(ref) or op != ref.op_type or _attrs(n) != _attrs(ref):
                return f"ORT changed the {op} that writes {out}"
            # the same input tensor: a float op in front of it was not folded into it (ORT's
            # ReluQuantFusion drops a Relu before a QuantizeLinear whatever its zero point),
            # unless that op cannot change a quantized value (_clamp_redundant)
            if not n.input or (n.input[0] != ref.input[0] and not _clamp_redundant(
                    prod0.get(ref.input[0]), n.input[0], ref, vals0)):
                return (f"ORT feeds the {op} that writes {out} from "
                        f"{n.input[0] if n.input else 'nothing'}, not {ref.input[0]}")
            for k in (1, 2):
                has = len(ref.input) > k and bool(ref.input[k])
                a = vals0.get(ref.input[k]) if has else None
                b = vals1.get(n.input[k]) if len(n.input) > k and n.input[k] else None
                if has and a is None:
                    return (f"the {op} that writes {out} takes a scale or zero point that is "
                            "not a constant")
                if not _same_array(a, b):
                    return (f"ORT changed the {'scale' if k == 1 else 'zero point'} of the "
                            f"{op} that writes {out}")
            seen.add(alias[out])
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
        # initializers of 1 KiB and more go to a file beside each written graph (a model with
        # external data keeps working, and none is read whole: only the Q/DQ scales are)
        ext = lambda name: {  # noqa: E731
            "session.optimized_model_external_initializers_file_name": name,
            "session.optimized_model_external_initializers_min_size_in_bytes": "1024"}
        plain = OrtRunner(onnx_path, "cpu", opt_level="disable", threads=threads,
                          session_config=ext("unoptimised.data"), save_optimized=plain_graph)
        try:
            g0 = onnx.load(str(plain_graph), load_external_data=False)
            why = _not_checkable(g0.graph)
        except Exception as e:  # noqa: BLE001 - any doubt runs the graph unoptimised
            why = (f"ORT could not write its unoptimised graph ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:200] if str(e) else ''})")
        if why is not None:  # this session is the reference
            return plain, {"reference": "unoptimised", "why": why}
        plain = None  # one session at a time (a large model's memory)
        try:
            fast = OrtRunner(onnx_path, "cpu", opt_level="all", threads=threads,
                             session_config={**QDQ_REWRITES_OFF, **ext("optimised.data")},
                             save_optimized=fast_graph, disabled_optimizers=QDQ_OPTIMIZERS_OFF)
            g1 = onnx.load(str(fast_graph), load_external_data=False)
        except Exception as e:  # noqa: BLE001
            why = (f"ORT could not make or write its optimised graph ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:200] if str(e) else ''})")
        if why is None:
            try:
                why = unfaithful(g0, g1, tmp, tmp)
            except Exception as e:  # noqa: BLE001
                why = f"the node check failed ({type(e).__name__}: {e})"
    if why is None:
        return fast, {"reference": "qdq_rewrites_off", "why": None}
    fast = None
    return (OrtRunner(onnx_path, "cpu", opt_level="disable", threads=threads),
            {"reference": "unoptimised", "why": why})
