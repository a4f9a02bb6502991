"""Small Q/DQ ONNX models for the quantization tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deploykit.runners import ort_session_options


def _ort(model_or_path, feed, level="all", disabled=()):
    import onnxruntime as ort

    src = str(model_or_path) if isinstance(model_or_path, (str, Path)) else \
        model_or_path.SerializeToString()
    so = ort_session_options(level)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled)).run(None, feed)[0]


def qdq_conv(bias, w_scale, *, dtype=np.float32, relu6=True, s_in=0.01, s_out=6 / 255,
             float_model=False):
    """x [N,2,4,4] -> Q/DQ (uint8, s_in, zp 128) -> Conv 1x1 (int8 weights 10, per-channel
    scales ``w_scale``, float bias ``bias``) -> Clip(0, 6) -> Q/DQ (uint8, s_out, zp 0) -> y.
    ``float_model``: the same Conv in float (dequantized weights), no Q/DQ."""
    from onnx import TensorProto, helper, numpy_helper

    tp = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    c = len(bias)
    wq = np.full((c, 2, 1, 1), 10, np.int8)
    ws = np.asarray(w_scale, dtype)
    wf = (wq.astype(np.float32) * ws.astype(np.float32)[:, None, None, None]).astype(dtype)
    inits = [numpy_helper.from_array(np.asarray(bias, dtype), "b"),
             numpy_helper.from_array(np.array(0, dtype), "lo"),
             numpy_helper.from_array(np.array(6, dtype), "hi")]
    if float_model:
        inits.append(numpy_helper.from_array(wf, "w"))
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
                 helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip")]
    else:
        inits += [numpy_helper.from_array(np.array(s_in, dtype), "xs"),
                  numpy_helper.from_array(np.array(128, np.uint8), "xz"),
                  numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"),
                  numpy_helper.from_array(np.zeros(c, np.int8), "wz"),
                  numpy_helper.from_array(np.array(s_out, dtype), "ys"),
                  numpy_helper.from_array(np.array(0, np.uint8), "yz")]
        nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
                 helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="xdq"),
                 helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0,
                                  name="wdq"),
                 helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv")]
        last = "c"
        if relu6:
            nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["cc"], name="clip"))
            last = "cc"
        nodes += [helper.make_node("QuantizeLinear", [last, "ys", "yz"], ["yq"], name="yq"),
                  helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="ydq")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", tp, ["N", 2, 4, 4])],
                          [helper.make_tensor_value_info("y", tp, ["N", c, 4, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _feed(dtype=np.float32, n=4):
    return {"x": np.random.default_rng(0).uniform(0, 1, (n, 2, 4, 4)).astype(dtype)}


def scaled_gemm_model(k=256, n=64, trans_b=True, opset=18, row_scale=True):
    """x [batch, k] -> Gemm (weight [n, k] with transB=1 as torch Linear exports); output
    channel i scaled by 10^(-2 + 2 i / n) so small channels exist."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    if row_scale:
        w *= np.logspace(-2, 0, n).astype(np.float32)[:, None]
    if not trans_b:
        w = np.ascontiguousarray(w.T)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc", transB=int(trans_b))], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.zeros(n, np.float32), "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def depthwise_models(per_channel: bool, x: np.ndarray):
    """Depthwise Conv (32 channels, channel c scaled to max|w| = 10^(-3 + 3c/31)) in float and
    quantized the way ONNX Runtime's quantize_static does it (symmetric int8 weights per tensor
    or per channel, uint8 activations with min/max ranges of ``x``, int32 bias)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 1, 3, 3))
    w = (w / np.abs(w).max(axis=(1, 2, 3), keepdims=True)
         * 10.0 ** (-3 + 3 * np.arange(32) / 31)[:, None, None, None]).astype(np.float32)
    vi = [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 32, 8, 8]),
          helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 32, 8, 8])]
    conv = dict(group=32, pads=[1] * 4, kernel_shape=[3, 3])

    def model(nodes, inits):
        g = helper.make_graph(nodes, "dw", vi[:1], vi[1:], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    fp32 = model([helper.make_node("Conv", ["input", "w"], ["output"], name="/Conv", **conv)],
                 [numpy_helper.from_array(w, "w")])
    y = _ort(fp32, {"input": x})

    def act(a):  # uint8 min/max quantization parameters (ORT's MinMax calibrator)
        lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
        s = (hi - lo) / 255
        return np.float32(s), np.uint8(round(-lo / s))

    ws = (np.abs(w).max(axis=(1, 2, 3)) if per_channel else np.abs(w).max(keepdims=True)) / 127
    ws = ws.astype(np.float32).reshape(-1)
    wq = np.clip(np.rint(w / ws.reshape(-1, 1, 1, 1)), -127, 127).astype(np.int8)
    (xs, xz), (ys, yz) = act(x), act(y)
    inits = [numpy_helper.from_array(v, k) for k, v in (
        ("xs", np.array(xs)), ("xz", np.array(xz)), ("ys", np.array(ys)), ("yz", np.array(yz)),
        ("wq", wq), ("ws", ws if per_channel else ws.reshape(())),
        ("wz", np.zeros(32 if per_channel else (), np.int8)))]
    nodes = [helper.make_node("QuantizeLinear", ["input", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"],
                              **({"axis": 0} if per_channel else {})),
             helper.make_node("Conv", ["xd", "wd"], ["output_QuantizeLinear_Input"], name="/Conv",
                              **conv),
             helper.make_node("QuantizeLinear", ["output_QuantizeLinear_Input", "ys", "yz"],
                              ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["output"])]
    return fp32, model(nodes, inits)
