"""deploykit.checks.export: the export check against PyTorch on small models built with each known fault
(frozen index, frozen batch reshape, static-batch files, batch-dependent models, opset-11 Softmax,
batch parity of a Squeeze)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from deploykit.checks.base import format_result, worst
from deploykit.checks.export import check_batch_parity, check_export
from deploykit.checks.lint import lint

from tests.helpers.export_models import _by, _legacy, _model, _vi
from tests.helpers.verdict_models import _sq_model


torch = pytest.importorskip("torch")
nn = torch.nn


def test_check_passes_a_correct_boolean_mask_export_and_flags_it_for_tensorrt(user_models,
                                                                              tmp_path):
    _, mods = user_models
    m = mods.masked()
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((4, 6, 16)).astype(np.float32),
            "m": rng.integers(0, 2, (4, 6)).astype(bool)}
    path = _legacy(m, feed, tmp_path / "mask.onnx", ["y"])
    res = check_export(m, path, feed)
    assert worst(res) != "fail", [format_result(r) for r in res if r["status"] == "fail"]
    dd = _by(res, "data_dependent_ops")[0]
    assert dd["status"] == "warn" and "NonZero" in dd["ops"] and "TensorRT" in dd["detail"]


def test_check_names_a_frozen_index_and_the_unused_input(user_models, tmp_path):
    _, mods = user_models
    m = mods.pyint()
    feed = {"x": np.random.default_rng(0).standard_normal((1, 6, 16)).astype(np.float32),
            "m": np.eye(6, dtype=bool)[[4]]}
    path = _legacy(m, feed, tmp_path / "pyint.onnx", ["y"], dynamic=False)
    res = check_export(m, path, {k: np.repeat(v, 3, 0) for k, v in feed.items()})
    assert _by(res, "unused_inputs")[0]["unused"] == ["m"]
    paths = _by(res, "input_paths")[0]
    assert paths["status"] == "fail" and "frozen" in paths["detail"] and paths["node"] == "m"


def test_check_static_batch_file_is_fed_its_batch(user_models, tmp_path):
    _, mods = user_models
    m = mods.plain()
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    path = _legacy(m, {"input": x}, tmp_path / "b1.onnx", ["y"], dynamic=False)
    res = check_export(m, path, {"input": np.repeat(x, 4, 0)})
    assert _by(res, "batch_parity")[0]["status"] == "pass"
    assert _by(res, "dynamic_axes")[0]["status"] == "warn"


def test_check_frozen_batch_reshape_named(user_models, tmp_path):
    _, mods = user_models
    m = mods.shuffle()
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    path = _legacy(m, {"input": x}, tmp_path / "shuffle.onnx", ["y"])
    res = check_export(m, path, {"input": x})
    bp = _by(res, "batch_parity")[0]
    assert bp["status"] == "fail" and bp["node"] and "Reshape" in bp["node"]
    assert _by(res, "shape_constants", "fail")


def test_check_batch_dependent_model_warned_not_blamed_on_export(tmp_path):
    class BatchMix(nn.Module):
        def forward(self, x):
            return x.flatten(1) - x.flatten(1).mean(0, keepdim=True)

    feed = {"input": np.random.default_rng(0).standard_normal((4, 3, 4, 4)).astype(np.float32)}
    path = _legacy(BatchMix(), feed, tmp_path / "mix.onnx", ["y"])
    res = check_export(BatchMix(), path, feed)
    assert _by(res, "batch_parity")[0]["status"] == "pass"  # the export is faithful
    assert _by(res, "batch_independence")[0]["status"] == "warn"


def test_check_blames_an_opset11_softmax_not_a_frozen_value(tmp_path):
    """A Softmax(axis=1) on a rank-4 tensor at opset 11 normalises over C*H*W: parity fails and
    the finding names the Softmax node, not a "traced constant"."""
    class Soft(nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=1)

    m = _model([helper.make_node("Softmax", ["x"], ["y"], name="softmax_c", axis=1)],
               [_vi("x", ["N", 5, 4, 4])], [_vi("y", ["N", 5, 4, 4])], opset=11)
    onnx.save(m, str(tmp_path / "sm11.onnx"))
    feed = {"x": np.random.default_rng(0).standard_normal((3, 5, 4, 4)).astype(np.float32)}
    res = check_export(Soft().eval(), tmp_path / "sm11.onnx", feed)
    bp = _by(res, "batch_parity")[0]
    assert bp["status"] == "fail" and bp["node"] == "softmax_c" and "opset >= 13" in bp["fix"]
    assert "frozen" not in _by(res, "input_paths")[0]["detail"]


def test_batch_parity_names_the_squeeze_and_its_fix():
    """When PyTorch's own output rank depends on the batch, the row names the lint's Squeeze
    and repeats its fix (it printed the ``.squeeze()`` advice for a ``squeeze(0)``)."""
    found = [r for r in lint(_sq_model(["batch", 10], [0])) if r["check"] == "squeeze_axes"]
    ref = {1: {"y": np.zeros(10, np.float32)}, 3: {"y": np.zeros((3, 10), np.float32)}}
    feeds = {1: {"x": np.zeros((1, 10), np.float32)}, 3: {"x": np.zeros((3, 10), np.float32)}}

    def run(feed):
        return {"y": feed["x"][0]}

    (r,) = check_batch_parity(ref, feeds, run, 0.99999, found)
    assert r["status"] == "fail" and r["node"] == "head/sq" and "squeeze(0)" in r["fix"], r
