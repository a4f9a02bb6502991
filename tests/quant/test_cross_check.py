"""deploykit.quant.cross_check: the adaptive backend cross-check."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.evaluate import EvalData, run_outputs
from deploykit.quant.cross_check import (CROSS_CHECK_FIRST, CROSS_CHECK_PEEK, backend_cross_check,
                                         first_look_verdict)
from deploykit.runners import OrtRunner

from tests.helpers.auto_models import _save


def _qdq_classifier(w_scale, path):
    """x [N,3,4,4] -> Q/DQ -> Conv 1x1 (2 classes, int8 weights, per-channel ``w_scale``,
    bias [5, 3]) -> Clip(0, 6) -> Q/DQ -> ReduceMean over H, W -> logits [N, 2]."""
    from onnx import helper, numpy_helper

    ws = np.asarray(w_scale, np.float32)
    inits = [numpy_helper.from_array(x, n) for x, n in (
        (np.array([5.0, 3.0], np.float32), "b"), (np.array(0, np.float32), "lo"),
        (np.array(6, np.float32), "hi"), (np.array(0.01, np.float32), "xs"),
        (np.array(128, np.uint8), "xz"), (np.full((2, 3, 1, 1), 10, np.int8), "wq"), (ws, "ws"),
        (np.zeros(2, np.int8), "wz"), (np.array(6 / 255, np.float32), "ys"),
        (np.array(0, np.uint8), "yz"), (np.array([2, 3], np.int64), "axes"))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="xdq"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0, name="wdq"),
             helper.make_node("Conv", ["xd", "wd", "b"], ["c"], name="conv"),
             helper.make_node("Clip", ["c", "lo", "hi"], ["cc"], name="clip"),
             helper.make_node("QuantizeLinear", ["cc", "ys", "yz"], ["yq"], name="yq"),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"], name="ydq"),
             helper.make_node("ReduceMean", ["y", "axes"], ["logits"], keepdims=0, name="gap")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 3, 4, 4])],
                          [helper.make_tensor_value_info("logits", 1, ["N", 2])], inits)
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9),
                 path)


@pytest.mark.parametrize("broken", [True, False])
def test_adaptive_cross_check_escalates_exactly_when_the_backend_differs(broken, tmp_path):
    """Classifier cross-check (stage 3's): a backend disagreement (WeightBiasQuantization on a
    tiny weight channel under a large bias) is seen on the first 32 samples, beyond doubt
    there (no rerun of the rest), and measured on all 200 when asked for exactly 200; a model
    the backend runs faithfully stops after 128 (agreement is never decided on 32)."""
    q = _qdq_classifier([1e-12, 0.01] if broken else [0.01, 0.01], tmp_path / "q.onnx")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (200, 3, 4, 4), dtype=np.uint8)
    data = EvalData(x_u8=x, y=np.zeros(200, np.int64), files=[str(i) for i in range(200)],
                             mean=(0.5,) * 3, std=(0.5,) * 3, input_name="x")
    with OrtRunner(q, opt_level="disable") as r:  # labels: the graph's own answer
        data.y = run_outputs(r, data, 64)["logits"].argmax(1)
    with OrtRunner(q) as r:
        main = run_outputs(r, data, 64)
    cc = backend_cross_check(q, data, main, batch=64)
    assert cc["adaptive"] and cc["disagreement"] is broken
    assert cc["n"] == (CROSS_CHECK_PEEK if broken else CROSS_CHECK_FIRST)
    assert cc["decided_on_first_look"] is broken
    if broken:
        assert cc["top1_unoptimized"] == 100.0 and cc["top1_main"] < 90
        assert "32 of 200 images, decided on the first look" in cc["reason"]
        exact = backend_cross_check(q, data, main, n=200, batch=64)
        assert exact["n"] == 200 and not exact["adaptive"] and exact["disagreement"]
        assert "(200 images)" in exact["reason"]


def test_first_look_verdict_decides_only_beyond_doubt():
    """The paired top-1 difference must clear the tolerance by 4 standard errors."""
    n = 128
    right = np.ones(n, bool)
    collapsed = np.zeros(n, bool)
    assert first_look_verdict(collapsed, right, 2.0) is True  # 100 points apart, se 0
    # same answers (the runs differ only in cosine): agreement, no rerun needed
    assert first_look_verdict(right, right, 2.0) is False
    one_flip = right.copy()
    one_flip[0] = False
    assert first_look_verdict(one_flip, right, 2.0) is None  # 0.8 + 4 * 0.8 > 2: rerun
    assert first_look_verdict(one_flip, right, 5.0) is False  # within 5 points beyond doubt
    some = right.copy()
    some[:6] = False  # 4.7 points, se 1.9: 4.7 - 7.5 < 2 < 4.7 + 7.5
    assert first_look_verdict(some, right, 2.0) is None
    assert first_look_verdict(np.zeros(0, bool), np.zeros(0, bool), 2.0) is None