"""ONNX helpers of the quantization levers beyond :mod:`deploykit.onnx.graph` (whose producers,
consumers and attributes they use): initializers, weight sources, Q/DQ introspection, MACs at a
given input shape, intermediate tensors."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

# Graph queries are deploykit.onnx.graph's; re-exported for the levers' ``graph.X`` calls.
from deploykit.onnx.graph import attr, consumers, producers  # noqa: F401


def initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Initializers by name."""
    return {t.name: t for t in model.graph.initializer}


def set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    """Replace initializer ``name`` by ``value`` (dtype kept from ``value``).

    Raises:
        KeyError: no initializer of that name.
    """
    for i, t in enumerate(model.graph.initializer):
        if t.name == name:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(value, name))
            return
    raise KeyError(name)


def weight_source(model: onnx.ModelProto, node: onnx.NodeProto, index: int = 1
                  ) -> tuple[str, onnx.NodeProto | None]:
    """Where input ``index`` of ``node`` comes from: ``(initializer name, DequantizeLinear node
    or None)``; the initializer is the float weight, or the quantized one behind the DQ.

    Raises:
        ValueError: the input is neither an initializer nor a DequantizeLinear of one.
    """
    inits = initializers(model)
    name = node.input[index]
    if name in inits:
        return name, None
    p = producers(model).get(name)
    if p is not None and p.op_type == "DequantizeLinear" and p.input[0] in inits:
        return p.input[0], p
    raise ValueError(f"{node.name}: input {index} ({name}) is no initializer / DQ of one")


def is_quantized(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    """True if the activation input and the weight of a Conv/Gemm come from DequantizeLinear."""
    prod = producers(model)
    if len(node.input) < 2:
        return False
    a, w = prod.get(node.input[0]), prod.get(node.input[1])
    return bool(a is not None and a.op_type == "DequantizeLinear" and w is not None
                and w.op_type == "DequantizeLinear")


def macs(model: onnx.ModelProto, input_shape: Sequence[int]) -> dict[str, int]:
    """Multiply-accumulates of every Conv and Gemm/MatMul node for one input of
    ``input_shape`` (batch included), from ONNX shape inference.

    Returns:
        ``{node name: MACs}``.
    """
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inp = m.graph.input[0]
    dims = inp.type.tensor_type.shape.dim
    for d, v in zip(dims, input_shape):
        d.Clear()
        d.dim_value = int(v)
    m = onnx.shape_inference.infer_shapes(m)
    shapes = {}
    for vi in list(m.graph.value_info) + list(m.graph.output) + list(m.graph.input):
        shapes[vi.name] = [d.dim_value for d in vi.type.tensor_type.shape.dim]
    inits = {t.name: t for t in m.graph.initializer}
    prod = producers(m)

    def wshape(name):
        if name in inits:
            return list(inits[name].dims)
        p = prod.get(name)
        if p is not None and p.op_type == "DequantizeLinear" and p.input[0] in inits:
            return list(inits[p.input[0]].dims)
        return shapes.get(name)

    out: dict[str, int] = {}
    for n in m.graph.node:
        if n.op_type == "Conv":
            w = wshape(n.input[1])
            y = shapes.get(n.output[0])
            if w and y:
                out[n.name] = int(np.prod(y) * np.prod(w[1:]))
        elif n.op_type in ("Gemm", "MatMul"):
            w = wshape(n.input[1])
            y = shapes.get(n.output[0])
            if w and y:
                k = w[1] if (n.op_type == "Gemm" and attr(n, "transB", 0)) else w[0]
                out[n.name] = int(np.prod(y) * k)
    return out


def int8_mac_share(qmodel: onnx.ModelProto, input_shape: Sequence[int]) -> tuple[float, int, int]:
    """Fraction of Conv/Gemm MACs whose activation and weight are both quantized.

    Returns:
        ``(share in [0, 1], quantized node count, Conv/Gemm node count)``.
    """
    mc = macs(qmodel, input_shape)
    names = {n.name: n for n in qmodel.graph.node}
    q = [k for k in mc if is_quantized(qmodel, names[k])]
    total = sum(mc.values())
    return (sum(mc[k] for k in q) / total if total else 0.0), len(q), len(mc)


def with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """Copy of ``model`` that also outputs the tensors ``names`` (float, shape unspecified)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for n in names:
        if n not in have:
            m.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT,
                                                                     None))
    return m


def run_batches(sess, x: np.ndarray, outputs: Sequence[str] | None = None, batch: int = 25):
    """Run ``sess`` over ``x`` in batches, yielding ``(slice, [arrays])`` per batch."""
    name = sess.get_inputs()[0].name
    for i in range(0, len(x), batch):
        yield slice(i, i + batch), sess.run(outputs, {name: x[i:i + batch]})
