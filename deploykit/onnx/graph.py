"""ONNX graph helpers shared by every tool: loading, graph inputs, precision, constants,
attributes, producers/consumers, and marking every tensor as an output.

Nothing here runs a model. Each function takes an ``onnx.ModelProto`` (or a path for
:func:`load`) and reads its main graph; subgraphs (If/Loop bodies) are not walked.

"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any
import numpy as np

from deploykit.io import require
from deploykit.errors import StageError


QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def load_onnx(path: Path | str, producer: str = "2_export_onnx.py / 5_quantize.sh",
              external: bool = True):
    """``onnx.load`` of an artifact (``external``: also its external weight data).

    Args:
        path: the ONNX file.
        producer: the command that writes it, named when the file is missing.
    Raises:
        StageError: the file is missing (naming ``producer``) or not a readable ONNX model.
    """
    import onnx

    path = require(Path(path), producer)
    try:
        return onnx.load(str(path), load_external_data=external)
    except Exception as e:  # noqa: BLE001 - protobuf DecodeError and friends
        raise StageError(f"cannot read ONNX model {path}: {e}") from e


def graph_inputs(model) -> list[tuple[str, list[int | None], np.dtype]]:
    """Real graph inputs (initializers that old exporters also list as inputs are skipped).

    Returns:
        ``[(name, dims with None for dynamic ones, numpy dtype)]`` in graph order.
    """
    from onnx import helper

    inits = {i.name for i in model.graph.initializer}
    out = []
    for i in model.graph.input:
        if i.name in inits:
            continue
        t = i.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                for d in t.shape.dim]
        out.append((i.name, dims, np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))))
    return out


def static_batch(model) -> int | None:
    """The fixed batch (axis 0) of the model's real inputs, or None when any input's axis 0 is
    dynamic (symbolic or unknown) or the inputs disagree. Inputs of rank 0 are ignored.

    Returns:
        e.g. ``1`` for a file exported with a static ``[1, 3, 224, 224]`` input.
    """
    sizes = {dims[0] for _, dims, _ in graph_inputs(model) if dims}
    if len(sizes) != 1 or None in sizes:
        return None
    return sizes.pop()


def onnx_opset(model, domain: str = "") -> int:
    """Opset version the model imports for ``domain`` (default ONNX domain), 0 if none."""
    doms = ("", "ai.onnx") if domain in ("", "ai.onnx") else (domain,)
    return max((o.version for o in model.opset_import if o.domain in doms), default=0)


#: Operators that compute on quantized data themselves (no Q/DQ pair needed around them).
QLINEAR_OPS = ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger")


MAC_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


INT8_TYPES = ("int8", "uint8")


def dq_is_int8(dq, consts: dict, prod: dict) -> bool:
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


def is_int8_mac(n, consts: dict, prod: dict) -> bool:
    """True when MAC node ``n``'s data input and weight (inputs 0 and 1) both come from 8-bit
    DequantizeLinear nodes."""
    dq_in = [prod.get(i) for i in n.input[:2]]
    return len(dq_in) == 2 and all(d is not None and d.op_type == "DequantizeLinear"
                                   and dq_is_int8(d, consts, prod) for d in dq_in)


def int8_mac_nodes(model) -> list[str]:
    """Names of the MAC nodes (:data:`MAC_OPS`) that compute in INT8 (input and weight from
    8-bit DequantizeLinear, as :func:`deploykit.quant.macs.mac_table` decides), without shape inference: what
    :func:`detect_precision` asks. A Q/DQ pair that feeds no MAC node
    adds none."""
    consts, prod = constants(model), producers(model)
    return [n.name for n in model.graph.node
            if n.op_type in MAC_OPS and is_int8_mac(n, consts, prod)]


def detect_precision(model) -> str:
    """Precision label of an ONNX model, decided by what computes, not by which ops appear.

    ``INT4``: 4-bit quantized initializers. ``INT8``: at least one MAC node (Conv,
    ConvTranspose, Gemm, MatMul) with 8-bit quantized input and weight
    (:func:`deploykit.quant.macs.mac_summary`), or a QLinear/Integer op. A file whose Q/DQ
    nodes quantize no MAC (a dead QuantizeLinear->DequantizeLinear pair, Q/DQ on tensors that
    feed no MAC op) computes in float and gets the float label: ``FP16`` (most float
    initializers are float16) or ``FP32``; :func:`precision_note` says why.

    Args:
        model: an ``onnx.ModelProto``.
    Returns:
        ``"INT4"``, ``"INT8"``, ``"FP16"`` or ``"FP32"``.
    """
    from onnx import TensorProto

    ops = {n.op_type for n in model.graph.node}
    inits = list(model.graph.initializer)
    if any(t.data_type in (TensorProto.INT4, TensorProto.UINT4) for t in inits):
        return "INT4"
    if ops & set(QLINEAR_OPS):
        return "INT8"
    if ops & {"QuantizeLinear", "DequantizeLinear"} and int8_mac_nodes(model):
        return "INT8"
    # float values of the file, counted by element (a Resize's four FP32 scales or an FP16
    # scalar never outvote the weights): initializers, and the Constant nodes' values (the
    # legacy exporter's FP16 graphs can keep their weights there)
    tensors = inits + [a.t for n in model.graph.node if n.op_type == "Constant"
                       for a in n.attribute if a.name == "value"]

    def size(t) -> int:
        return int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1

    n16 = sum(size(t) for t in tensors if t.data_type == TensorProto.FLOAT16)
    n32 = sum(size(t) for t in tensors if t.data_type == TensorProto.FLOAT)
    return "FP16" if n16 > n32 else "FP32"


def tolerance_precision(model) -> str:
    """The tolerance class to compare ``model`` with its float reference at, layer by layer
    (``layerwise.py diff``, ``quant-backend``): :func:`detect_precision`, except that a file
    with Q/DQ nodes is ``INT8`` even when they quantize no MAC: each QuantizeLinear rounds its
    tensor to the INT8 grid, an error the float tolerances would call a divergence.

    Returns:
        ``"INT4"``, ``"INT8"``, ``"FP16"`` or ``"FP32"``.
    """
    label = detect_precision(model)
    if label in ("FP32", "FP16") and any(
            n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node):
        return "INT8"
    return label


def precision_note(model) -> str | None:
    """Why a model with Q/DQ nodes is not labelled INT8 by :func:`detect_precision` (None when
    it has no Q/DQ node, is INT4, or quantizes at least one MAC): the count of Q/DQ nodes and
    of MAC nodes, all computing in float, with the fix. Worded like stage 5's "0 of N
    MatMul/Conv/Gemm quantized" warning (:func:`deploykit.quant.record.unquantized_warning`)."""
    qdq = sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    if not qdq or detect_precision(model) in ("INT8", "INT4"):
        return None
    n_mac = sum(n.op_type in MAC_OPS for n in model.graph.node)
    return (f"{qdq} QuantizeLinear/DequantizeLinear node(s) but 0 of {n_mac} MatMul/Conv/Gemm "
            "quantized (no MAC has INT8 input and weight: a dead Q/DQ pair, or Q/DQ on tensors "
            f"that feed no MAC op): the file computes in float, labelled "
            f"{detect_precision(model)}, not INT8; requantize it (5_quantize.sh) or pass "
            "--precision INT8 to judge it as INT8 anyway")


def constants(model) -> dict[str, np.ndarray]:
    """``{tensor name: numpy array}`` for initializers and Constant-node outputs (``value``)."""
    from onnx import numpy_helper

    out = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def attr(node, name: str, default: Any = None) -> Any:
    """Value of attribute ``name`` of ``node`` (``default`` if absent)."""
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def attrs(node) -> dict[str, Any]:
    """All attributes of ``node`` as ``{name: value}``."""
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def producers(model) -> dict:
    """``{tensor name: node that writes it}`` for every non-empty node output."""
    return {o: n for n in model.graph.node for o in n.output if o}


def consumers(model) -> dict:
    """``{tensor name: [nodes that read it]}`` (a defaultdict: unknown names give ``[]``)."""
    out: dict = defaultdict(list)
    for n in model.graph.node:
        for i in n.input:
            out[i].append(n)
    return out


def mark_all_outputs(model):
    """Copy of ``model`` with every node output marked as a graph output (Polygraphy's
    ``ModifyOutputs(outputs=constants.MARK_ALL)``, which keeps the original outputs)."""
    from polygraphy import constants as pg_constants
    from polygraphy.backend.onnx import ModifyOutputs

    return ModifyOutputs(model, outputs=pg_constants.MARK_ALL, copy=True)()
