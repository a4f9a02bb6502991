"""AdaRound (Nagel et al. 2020) on a small Q/DQ Conv model the test builds: the rounding it writes
is floor or floor + 1 of W/s, lowers the layer's output error on the calibration inputs below
round-to-nearest, and the written ONNX still runs in ORT and computes the same function."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit.quant import adaround, ort_static
from tests.quant._models import run

torch = pytest.importorskip("torch")


def _conv_model(seed=0, c_in=16, c_out=8, hw=6):
    """One 3x3 conv (stride 1, pads 1) + Clip(0, 6), weights of varied magnitude per channel."""
    r = np.random.default_rng(seed)
    w = (r.normal(size=(c_out, c_in, 3, 3)) * np.linspace(0.05, 0.5, c_out)[:, None, None, None]
         ).astype(np.float32)
    b = (r.normal(size=c_out) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in
             [(w, "w"), (b, "b"), (np.array(0, np.float32), "lo"), (np.array(6, np.float32), "hi")]]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["y", "lo", "hi"], ["out"], name="clip")]
    g = helper.make_graph(nodes, "c", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["N", c_in, hw, hw])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                         ["N", c_out, hw, hw])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _setup(tmp_path, n=16):
    torch.set_num_threads(1)
    m = _conv_model()
    x = (np.random.default_rng(1).normal(size=(n, 16, 6, 6)) * 2 + 1).astype(np.float32)
    onnx.save(m, tmp_path / "fp.onnx")
    ort_static.quantize(tmp_path / "fp.onnx", tmp_path / "q.onnx", x, batch=n,
                        op_types=("Conv", "Clip"))
    q = onnx.load(tmp_path / "q.onnx")
    cfg = adaround.Config(iters=150, batch=128, lr=2e-2, keep_if_worse=False)
    qa, info = adaround.adaround(m, q, x, cfg, progress=None)
    return m, q, qa, info, x


def _wq(model):
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return inits["w_quantized"], inits["w_scale"]


def _conv_out(x, w, b):
    """Float conv + Clip(0, 6) the reference way (torch)."""
    y = torch.nn.functional.conv2d(torch.from_numpy(np.array(x)), torch.from_numpy(np.array(w)),
                                   torch.from_numpy(np.array(b)), padding=1)
    return y.clamp(0, 6).numpy()


def test_rounding_is_floor_or_ceil_and_beats_nearest(tmp_path):
    m, q, qa, info, x = _setup(tmp_path)
    w = numpy_helper.to_array(m.graph.initializer[0])
    b = numpy_helper.to_array(m.graph.initializer[1])
    q0, s = _wq(q)
    q1, s1 = _wq(qa)
    assert q1.dtype == np.int8 and q1.shape == q0.shape
    np.testing.assert_array_equal(s1, s)                     # scales untouched
    r = w / s[:, None, None, None]
    fl = np.floor(r)
    # (a) every weight is floor(W/s) or floor(W/s) + 1, inside the int8 range ORT used
    assert np.all((q1 == fl) | (q1 == fl + 1)), "a weight outside {floor, floor+1}"
    assert q1.min() >= -127 and q1.max() <= 127
    assert np.array_equal(q0, np.round(r)), "ORT's weights are round-to-nearest"
    changed = (q1 != q0).mean()
    assert changed > 0.01, f"AdaRound changed only {changed:.3%} of the weights"
    # (b) lower output MSE on the calibration inputs than round-to-nearest: the layer fed the
    # quantized input x_q = DQ(Q(x)) (the model's), against the float layer on x
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    sx, zx = inits["x_scale"], inits["x_zero_point"].astype(np.float32)
    xq = ((np.clip(np.round(x / sx) + zx, 0, 255) - zx) * sx).astype(np.float32)
    y = _conv_out(x, w, b)
    e_near = ((_conv_out(xq, q0 * s[:, None, None, None], b) - y) ** 2).mean()
    e_ada = ((_conv_out(xq, (q1 * s[:, None, None, None]).astype(np.float32), b) - y) ** 2).mean()
    assert e_ada < 0.95 * e_near, (e_ada, e_near)
    (log,) = info["layers"]
    assert log["node"] == "conv" and log["loss_adaround"] < log["loss_nearest"]
    assert info["mode"] == "sequential"


def test_written_onnx_runs_and_computes_the_same_function(tmp_path):
    m, q, qa, info, x = _setup(tmp_path)
    onnx.save(qa, tmp_path / "qa.onnx")
    onnx.checker.check_model(onnx.load(tmp_path / "qa.onnx"))
    s = ort_static.session(tmp_path / "qa.onnx", optimize=False)
    out = s.run(None, {"x": x})[0]
    y_fp = run(m, x)[0]
    y_near = run(q, x)[0]
    # (c) same function up to the rounding: close to the float model, as close as nearest,
    # and closer on the calibration data
    assert out.shape == y_fp.shape
    e_near = ((y_near - y_fp) ** 2).mean()
    e_ada = ((out - y_fp) ** 2).mean()
    assert e_ada < e_near, (e_ada, e_near)
    cos = (out * y_fp).sum() / np.linalg.norm(out) / np.linalg.norm(y_fp)
    assert cos > 0.999
    # graph structure unchanged: same nodes, only the int8 weight initializer differs
    assert [n.op_type for n in qa.graph.node] == [n.op_type for n in q.graph.node]
    diff = [t.name for t, u in zip(q.graph.initializer, qa.graph.initializer)
            if t.SerializeToString() != u.SerializeToString()]
    assert diff == ["w_quantized"]


def test_soft_init_equals_fractional_part():
    """h(V0) reproduces the fractional part (the paper's initialisation) and h is in [0, 1]."""
    frac = torch.linspace(0, 0.999, 50)
    v0 = -torch.log((adaround.ZETA - adaround.GAMMA) / (frac - adaround.GAMMA) - 1)
    torch.testing.assert_close(adaround._rect_sigmoid(v0), frac, atol=1e-5, rtol=0)
    h = adaround._rect_sigmoid(torch.linspace(-20, 20, 100))
    assert float(h.min()) == 0.0 and float(h.max()) == 1.0
