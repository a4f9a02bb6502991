"""ONNX Runtime ``quantize_static`` recipe for the ORT CPU EP, with its pitfalls handled.

Pitfalls (measured on EfficientNet-Lite0, onnxruntime 1.32):

* ORT's graph optimizer ``WeightBiasQuantization`` (level >= basic) quantizes the float weight
  and bias of any Conv/Gemm whose activation input comes from a DequantizeLinear, i.e. it turns
  the convolutions you excluded (``nodes_to_exclude``) back into INT8 when their input tensor is
  quantized for another consumer. Sessions made by :func:`session` disable it
  (``disabled_optimizers=["WeightBiasQuantization"]``).
* ``CalibrationMethod.Entropy`` in ``quantize_static`` has returned the MinMax ranges unchanged
  on this model (the issue's measurement); choose activation ranges with
  :mod:`deploykit.quant.act_calibration` instead (max / percentile / MSE / entropy computed from
  our own histograms and written into the Q/DQ scales).
* ORT's u8s8 INT8 kernels saturate on x86-64 CPUs without VNNI (onnxruntime PR #12088): with
  graph optimisations on, the fused QLinearConv sums pairs of u8*s8 products in int16. Either run
  on a VNNI CPU, set ``session.x64quantprecision=1`` (:func:`session` ``x64_precision``), or
  quantize weights to 7 bits (``reduce_range=True``). Accuracy of the Q/DQ *model* is measured
  with optimisations off (:func:`session` ``optimize=False``), which computes DQ -> float op -> Q
  exactly as the ONNX spec defines it.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


class NpzReader:
    """``CalibrationDataReader`` over an in-memory array, ``batch`` samples per call.

    Args:
        input_name: the model's input name.
        x: float32 array ``[N, ...]`` (already normalised like evaluation data).
        batch: samples per ``get_next`` (the model must accept that batch size).
    """

    def __init__(self, input_name: str, x: np.ndarray, batch: int = 16):
        self.name, self.x, self.batch, self.i = input_name, np.asarray(x, np.float32), batch, 0

    def get_next(self):
        if self.i >= len(self.x):
            return None
        out = {self.name: self.x[self.i:self.i + self.batch]}
        self.i += self.batch
        return out

    def rewind(self):
        self.i = 0


def quantize(fp32: str | Path, out: str | Path, calib_x: np.ndarray, *,
             per_channel: bool = True, activation_type: str = "u8", weight_type: str = "s8",
             op_types: Sequence[str] | None = ("Conv", "Gemm"),
             nodes_to_exclude: Iterable[str] = (), method: str = "minmax",
             reduce_range: bool = False, quantize_bias: bool = False,
             symmetric_activation: bool | None = None,
             no_output_quantization: Sequence[str] = ("Gemm",), batch: int = 16) -> Path:
    """Q/DQ INT8 with ``onnxruntime.quantization.quantize_static``.

    Args:
        fp32: float ONNX file (single image input, dynamic or matching batch).
        out: output Q/DQ ONNX path.
        calib_x: calibration inputs, float32 ``[N, C, H, W]``, normalised.
        per_channel: per-output-channel weight scales (needed for depthwise convolutions).
        activation_type / weight_type: ``"u8"`` or ``"s8"``. U8 activations / S8 weights is
            the combination ORT's CPU kernels are built for; S8/S8 symmetric is what TensorRT
            accepts.
        op_types: op types to quantize (None: everything ORT's QDQ registry knows).
        nodes_to_exclude: node names kept in float.
        method: ``minmax``, ``entropy``, ``percentile`` or ``distribution`` (ORT's calibrators;
            see the module note on Entropy).
        reduce_range: 7-bit weights (avoids the u8s8 saturation on CPUs without VNNI).
        quantize_bias: False keeps biases float (so bias correction can edit them and no int32
            bias is made with a scale other than ``s_in * s_w``); ORT folds them at load time.
        symmetric_activation: force symmetric activation ranges (None: ORT's default, which is
            symmetric for s8 and asymmetric for u8).
        no_output_quantization: op types whose output is not quantized (default Gemm: the
            classifier's logits stay float; ORT would otherwise quantize them to 8 bits).
        batch: calibration batch.
    Returns:
        ``Path(out)``.
    Raises:
        ValueError: unknown type or method names.

    When ModelOpt has been imported in this process (it patches ORT's calibrators), the
    quantization runs in a fresh child process instead (same arguments, same result).
    """
    import onnx
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    types = {"u8": QuantType.QUInt8, "s8": QuantType.QInt8}
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile,
               "distribution": CalibrationMethod.Distribution}
    if activation_type not in types or weight_type not in types:
        raise ValueError(f"types must be u8 or s8, got {activation_type}/{weight_type}")
    if method not in methods:
        raise ValueError(f"method must be one of {sorted(methods)}, got {method}")
    model = onnx.load(str(fp32))
    name = model.graph.input[0].name
    extra = {"QuantizeBias": quantize_bias,
             "OpTypesToExcludeOutputQuantization": list(no_output_quantization)}
    if symmetric_activation is not None:
        extra["ActivationSymmetric"] = symmetric_activation
    if "modelopt" in sys.modules:
        # ModelOpt patches ORT's calibrators and QDQ registry when it quantizes
        # (modelopt/onnx/quantization/ort_patching.py, patch_ort_modules; ort_utils.configure_ort)
        # and never undoes it: ORT's own recipe runs in a fresh process, where nothing is patched.
        return _in_fresh_process(fp32, out, calib_x, per_channel=per_channel,
                                 activation_type=activation_type, weight_type=weight_type,
                                 op_types=op_types, nodes_to_exclude=tuple(nodes_to_exclude),
                                 method=method, reduce_range=reduce_range,
                                 quantize_bias=quantize_bias,
                                 symmetric_activation=symmetric_activation,
                                 no_output_quantization=tuple(no_output_quantization),
                                 batch=batch)
    quantize_static(str(fp32), str(out), NpzReader(name, calib_x, batch),
                    quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=list(op_types) if op_types else None,
                    per_channel=per_channel, reduce_range=reduce_range,
                    activation_type=types[activation_type], weight_type=types[weight_type],
                    nodes_to_exclude=list(nodes_to_exclude), calibrate_method=methods[method],
                    extra_options=extra)
    return Path(out)


def _in_fresh_process(fp32, out, calib_x, **kwargs) -> Path:
    """:func:`quantize` run by a fresh Python interpreter (no ModelOpt patches in it): the
    calibration array and the arguments travel in a temporary folder.

    Raises:
        RuntimeError: the child failed (its last error line is quoted)."""
    import json
    import os
    import subprocess
    import tempfile

    root = str(Path(__file__).resolve().parents[2])
    code = ("import json, sys, numpy as np\n"
            "from deploykit.quant.ort_static import quantize\n"
            "a = json.load(open(sys.argv[1]))\n"
            "quantize(a.pop('fp32'), a.pop('out'), np.load(sys.argv[2]), **a)\n")
    with tempfile.TemporaryDirectory(prefix="ort-quantize-") as d:
        args = dict(kwargs, fp32=str(fp32), out=str(out),
                    op_types=None if kwargs["op_types"] is None else list(kwargs["op_types"]))
        Path(d, "args.json").write_text(json.dumps(args))
        np.save(Path(d, "calib.npy"), np.asarray(calib_x, np.float32))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        p = subprocess.run([sys.executable, "-c", code, str(Path(d, "args.json")),
                            str(Path(d, "calib.npy"))], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        raise RuntimeError(f"ORT quantize_static (run in a fresh process, ModelOpt being "
                           f"imported here) failed: {last}")
    return Path(out)


def session(path: str | Path | bytes, *, optimize: bool = True, x64_precision: bool = False,
            threads: int = 1, qdq_as_float: bool = False):
    """CPU EP session for a Q/DQ model with ORT's pitfalls handled.

    Args:
        path: ONNX file (or serialized bytes).
        optimize: False = ``ORT_DISABLE_ALL``: the Q/DQ model's own semantics (DQ -> float op
            -> Q), the accuracy of the model independent of ORT's fused kernels. True =
            ``ORT_ENABLE_ALL`` with ``WeightBiasQuantization`` disabled (excluded nodes stay
            float): what the CPU EP deploys.
        x64_precision: ``session.x64quantprecision=1`` (u8s8 without int16 saturation on
            x86-64 without VNNI; onnxruntime PR #12088).
        threads: ``intra_op_num_threads`` (and inter-op 1).
        qdq_as_float: ``session.disable_quant_qdq=1``: Q/DQ run as float ops, no int8 kernels
            (with ``optimize``: fast, close to the Q/DQ semantics but not bit-exact).
    Returns:
        ``onnxruntime.InferenceSession``.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    if qdq_as_float:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    if x64_precision:
        so.add_session_config_entry("session.x64quantprecision", "1")
    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), so,
                                providers=["CPUExecutionProvider"],
                                disabled_optimizers=["WeightBiasQuantization"])
