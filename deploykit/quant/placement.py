"""Q/DQ placements that TensorRT executes differently from ONNX Runtime (``qdq_tools.py check``).

ONNX Runtime runs a Q/DQ graph exactly as written (DequantizeLinear + float op). TensorRT
fuses Q/DQ into its INT8 kernels under placement rules, so two placements give a TensorRT
result that differs from ONNX Runtime's (and a slower engine):

- ``trt_add_float_input``: an Add with one quantized input (a DequantizeLinear output, or the
  output of a Conv/Gemm/MatMul whose input is quantized: the epilogue TensorRT fuses the Add
  into) and one float input without Q/DQ. TensorRT fuses the Add into the INT8 conv only when
  the other (residual) input is quantized too; otherwise the Add runs in FP32/FP16 behind a
  reformat. Sources: NVIDIA TensorRT Developer Guide, "Working with Quantized Types", Q/DQ
  layer-placement recommendations (quantize the residual input of an element-wise addition);
  NVIDIA TensorFlow Quantization Toolkit, "Add Custom QDQ Insertion Case" (ResNet residual
  connections need Q/DQ for optimal INT8 fusion in TensorRT,
  https://docs.nvidia.com/deeplearning/tensorrt/tensorflow-quantization-toolkit/docs/docs/add_custom_qdq_cases.html);
  ModelOpt's ``modelopt.onnx.quantization.qdq_graph.build_non_residual_input_map``;
  NVIDIA/TensorRT#3861, #4079.
- ``trt_concat_scales``: a Concat whose inputs are dequantized with different scales (or zero
  points). ONNX Runtime concatenates the float values; TensorRT moves the Q/DQ across the
  Concat and runs it in INT8 at one scale, requantizing the inputs (ModelOpt's
  ``get_concat_eliminated_tensors`` gives Concat inputs one scale for this reason;
  NVIDIA/TensorRT#3861).
"""
from __future__ import annotations

import numpy as np

from deploykit.onnx.graph import constants, producers
from deploykit.quant.qdq import Finding

#: Ops whose output TensorRT can fuse a following Add into (their epilogue) when quantized.
WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


def _quantized_source(t: str, prod: dict) -> str | None:
    """How tensor ``t`` is quantized: ``"Q/DQ"`` (a DequantizeLinear output), ``"INT8 <op>
    <name>"`` (the output of a weighted op with a dequantized input), or None (float)."""
    n = prod.get(t)
    if n is None:
        return None
    if n.op_type == "DequantizeLinear":
        return "Q/DQ"
    if n.op_type in WEIGHTED_OPS and n.input and getattr(prod.get(n.input[0]), "op_type",
                                                         None) == "DequantizeLinear":
        return f"INT8 {n.op_type} {n.name or n.output[0]}"
    return None


def check_trt_placement(model, consts: dict | None = None) -> list[Finding]:
    """Findings ``trt_add_float_input`` and ``trt_concat_scales`` (see the module docstring)
    of a Q/DQ model; none for a model without DequantizeLinear.

    Returns:
        one :class:`~deploykit.quant.qdq.Finding` per Add / Concat node, naming the node, its
        inputs and (Concat) their scales, with the fix.
    """
    consts = constants(model) if consts is None else consts
    prod = producers(model)
    if not any(n.op_type == "DequantizeLinear" for n in model.graph.node):
        return []
    out: list[Finding] = []
    for n in model.graph.node:
        name = n.name or n.output[0]
        if n.op_type == "Add" and len(n.input) == 2:
            acts = [t for t in n.input if t not in consts]
            if len(acts) != 2:
                continue  # a bias-like Add of a constant
            src = [_quantized_source(t, prod) for t in acts]
            if not any(src):
                continue  # a float Add
            if "Q/DQ" in src and all(src):
                continue  # TensorRT's fusable pattern: one input Q/DQ, the other quantized
            # the input without Q/DQ: a float one, else (two INT8 conv outputs) the second
            fi = next((i for i, s in enumerate(src) if s is None), 1)
            fl, qi = [acts[fi]], acts[1 - fi]
            what = "float, no Q/DQ" if src[fi] is None else f"{src[fi]} output, no Q/DQ"
            out.append(Finding(
                "trt_add_float_input", name, None,
                f"Add {name} adds {qi!r} ({src[acts.index(qi)]}) and {fl[0]!r} ({what}): "
                "ONNX Runtime adds them in float; TensorRT fuses an Add into a quantized "
                "conv's epilogue only when the other input is quantized too, so it runs this "
                "Add in FP32/FP16 behind a reformat and its result differs from ONNX Runtime's",
                f"put a QuantizeLinear/DequantizeLinear pair on input {fl[0]!r} of {name} "
                "(calibrated on that tensor; ModelOpt quantizes the residual input of an Add "
                "by default: quantize the float model with ModelOpt rather than editing Q/DQ "
                "by hand), or keep the Add's other input in float too",
                {"quantized_input": qi, "float_input": fl[0]}))
        elif n.op_type == "Concat" and len(n.input) > 1:
            params = {}
            for t in n.input:
                dq = prod.get(t)
                if dq is None or dq.op_type != "DequantizeLinear":
                    continue
                s = consts.get(dq.input[1]) if len(dq.input) > 1 else None
                z = consts.get(dq.input[2]) if len(dq.input) > 2 else None
                if s is None or np.size(s) != 1:
                    continue
                params[t] = (float(np.ravel(s)[0]), 0 if z is None else int(np.ravel(z)[0]))
            if len(params) < 2 or len(set(params.values())) == 1:
                continue
            scales = [p[0] for p in params.values()]
            lst = ", ".join(f"{t!r} scale {s:.6g} zero point {z}" for t, (s, z) in
                            params.items())
            out.append(Finding(
                "trt_concat_scales", name, None,
                f"Concat {name} joins inputs dequantized with different parameters ({lst}; "
                f"scales {max(scales) / min(scales):.3g}x apart): ONNX Runtime concatenates "
                "the float values; TensorRT runs the Concat in INT8 at one scale and "
                "requantizes its inputs, so its result differs from ONNX Runtime's",
                f"give every input of {name} one scale and zero point (the largest scale, "
                "or the Concat output's calibrated scale, as ModelOpt does)",
                {"inputs": {t: {"scale": s, "zero_point": z} for t, (s, z) in
                            params.items()}}))
    return out
