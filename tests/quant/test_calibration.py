"""deploykit.quant.calibration: calibration data validation and the calibration batch plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from deploykit.data.images import normalize
from deploykit.errors import StageError
from deploykit.quant.calibration import calibration_plan, validate_calibration

from tests.helpers.auto_models import _save


# --------------------------------------------------------------------------------------------
# Calibration data
# --------------------------------------------------------------------------------------------
def two_input_model():
    """a [N, 8] and b [N, 8] -> Add -> y (same shapes: only statistics tell them apart)."""
    from onnx import helper

    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                          [helper.make_tensor_value_info(n, 1, ["N", 8]) for n in "ab"],
                          [helper.make_tensor_value_info("y", 1, ["N", 8])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_calibration_refuses_wrong_keys_swapped_inputs_nan_and_dtype(tmp_path):
    path = _save(two_input_model(), tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    ref = {"a": rng.standard_normal((32, 8)).astype(np.float32),
           "b": (50 + 20 * rng.standard_normal((32, 8))).astype(np.float32)}
    good = {"a": rng.standard_normal((16, 8)).astype(np.float32),
            "b": (50 + 20 * rng.standard_normal((16, 8))).astype(np.float32)}
    rep = validate_calibration(path, good, ref, reference_source="eval")
    assert rep["n_samples"] == 16 and rep["stats_check"].startswith("passed")
    with pytest.raises(StageError, match=r"keys \['a', 'x'\].*inputs are \['a', 'b'\]"):
        validate_calibration(path, {"a": good["a"], "x": good["b"]}, ref)
    with pytest.raises(StageError, match=r"input 'a'.*std ratio"):
        validate_calibration(path, {"a": good["b"], "b": good["a"]}, ref)
    bad = dict(good, a=good["a"].copy())
    bad["a"][3, 1] = np.nan
    with pytest.raises(StageError, match=r"1 NaN.*samples \[3\]"):
        validate_calibration(path, bad, None)
    with pytest.raises(StageError, match="float64 but the model takes float32"):
        validate_calibration(path, dict(good, a=good["a"].astype(np.float64)), None)
    with pytest.raises(StageError, match="different sample counts"):
        validate_calibration(path, dict(good, a=good["a"][:5]), None)


def test_calibration_plan_batches():
    path = None
    from onnx import helper

    def model(batch):
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [batch, 4])],
                              [helper.make_tensor_value_info("y", 1, [batch, 4])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = {"x": np.zeros((10, 4), np.float32)}
        path = _save(model("N"), Path(d) / "dyn.onnx")
        plan = calibration_plan(path, data)
        assert plan["batches"] == [10] and not plan["order_dependent"]
        assert plan["calibration_shapes"] == "x:10x4"
        plan = calibration_plan(path, data, 4)
        assert plan["batches"] == [5, 5] and plan["order_dependent"]
        static = _save(model(1), Path(d) / "static.onnx")
        plan = calibration_plan(static, data)
        assert plan["batch_size"] == 1 and len(plan["batches"]) == 10
        with pytest.raises(StageError, match="static batch of 4"):
            validate_calibration(_save(model(4), Path(d) / "s4.onnx"), data)


# --------------------------------------------------------------------------------------------
# Calibration data normalised with another mean/std
# --------------------------------------------------------------------------------------------
def test_calibration_with_another_normalisation_is_refused(tmp_path):
    """Pixels normalised with ImageNet's mean/std for a model that takes (x - 0.5) / 0.5 (as
    EfficientNet-Lite0 does): std ratio 2.6, inside the std bound, and the range [-2.1, 2.6]
    for [-1, 1] was never compared although the check documents mean/std/range."""

    src = tmp_path / "m.onnx"
    g = helper.make_graph([helper.make_node("Relu", ["input"], ["y"], name="r")], "g",
                          [helper.make_tensor_value_info("input", 1, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", 1, ["N", 3, 8, 8])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(src))
    rng = np.random.default_rng(0)
    px = lambda n: rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8)  # noqa: E731
    ref = {"input": normalize(px(64), (0.5,) * 3, (0.5,) * 3)}
    good = {"input": normalize(px(100), (0.5,) * 3, (0.5,) * 3)}
    assert validate_calibration(src, good, ref)["stats_check"].startswith("passed")
    imagenet = {"input": normalize(px(100), (0.485, 0.456, 0.406),
                                          (0.229, 0.224, 0.225))}
    with pytest.raises(StageError, match="range ratio"):
        validate_calibration(src, imagenet, ref)
