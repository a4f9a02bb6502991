"""deploykit.quant.auto.report: the search's outputs, plot and published record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploykit.errors import StageError
from deploykit.evaluate import EvalData
from deploykit.layout import model_artifacts
from deploykit.quant.auto.report import publish, record_paths, write_outputs
from deploykit.quant.auto.search import anchored, Budget, Cache, run_model, search
from deploykit.quant.auto.space import QdqSpace

from tests.helpers.auto_models import _chain_qdq


def _record(tmp_path, res, **extra):
    return {**res, "model": "m", "budget": {"min_cosine": 0.99}, "budget_text": "b",
            "semantics": "s", "tuning": {"source": "t", "n": 8}, "base": {"command": "c"},
            "search": {"evaluations": res["evaluations"], "wall_s": 0, "machine": "x"},
            "exclude_regexes": anchored(res["excluded"]),
            "outputs": {k: str(v) for k, v in record_paths("m", tmp_path).items()}, **extra}


def test_no_plot_leaves_no_png_of_an_older_search(tmp_path):
    fp32, q = _chain_qdq()
    space = QdqSpace(q, fp32)
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (4, 3, 16, 16)).astype(np.float32)})
    res = search(space, data, run_model(fp32, data), Budget(None, 0.99),
                    Cache(tmp_path / "c", {"k": 3}))
    png = tmp_path / "auto_precision.png"
    write_outputs(_record(tmp_path, res, warnings=["w1"]), plot=True)
    assert png.exists() and "auto_precision.png" in (tmp_path / "auto_precision.md").read_text()
    assert "**Warning:** w1" in (tmp_path / "auto_precision.md").read_text()
    write_outputs(_record(tmp_path, res, plot=False), plot=False)  # search --no-plot
    assert not png.exists()
    assert "auto_precision.png" not in (tmp_path / "auto_precision.md").read_text()
    write_outputs(_record(tmp_path, res), plot=True)
    write_outputs(_record(tmp_path, res), plot=False)  # verify keeps the search's PNG
    assert png.exists()


def test_publish_keeps_the_installed_files_record_and_writes_a_failed_run_beside_it(tmp_path):
    """results/<model>/auto_precision.* describe the installed int8_auto.onnx: a search by hand
    writes to the work folder, and a run whose file was not installed is published as
    auto_precision.failed.* (it used to overwrite the good record)."""
    fp32, q = _chain_qdq()
    space = QdqSpace(q, fp32)
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (4, 3, 16, 16)).astype(np.float32)})
    res = search(space, data, run_model(fp32, data), Budget(None, 0.99),
                    Cache(tmp_path / "c", {"k": 3}))
    good, bad, results = tmp_path / "good", tmp_path / "bad", tmp_path / "results"
    write_outputs(_record(good, res, budget_text="good budget"), plot=True)
    write_outputs(_record(bad, res, budget_text="bad budget"), plot=True)

    publish(good, results)
    rec = json.loads((results / "auto_precision.json").read_text())
    assert rec["outputs"]["md"] == str(results / "auto_precision.md")
    assert "](auto_precision.png)" in (results / "auto_precision.md").read_text()
    assert (results / "auto_precision.png").stat().st_size > 1000

    publish(bad, results, failed=True)
    assert json.loads((results / "auto_precision.json").read_text())["budget_text"] == \
        "good budget"
    failed = json.loads((results / "auto_precision.failed.json").read_text())
    assert failed["budget_text"] == "bad budget" and failed["published"]["failed"] is True
    assert "](auto_precision.failed.png)" in (results / "auto_precision.failed.md").read_text()
    assert not list(results.glob(".tmp-*"))

    # the default folder of search/verify is the work folder, never results/
    assert record_paths("m")["json"].parent == model_artifacts("m") / "auto_precision"
    with pytest.raises(StageError, match="auto_precision.py search"):
        publish(tmp_path / "empty", results)
