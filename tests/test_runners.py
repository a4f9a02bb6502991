"""deploykit.runners: the runner contract (TorchRunner, OrtRunner, TrtRunner), torch.compile on CPU,
one copy of runner and graph logic."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.errors import StageError
from deploykit.runners import harness_overhead_ms, OrtRunner, TorchRunner, TrtRunner

from tests.helpers.stages import ROOT
from tests.helpers.runners import _export, _tiny_torch


def test_every_runner_honours_the_interface(tmp_path):
    model = _tiny_torch()
    onnx_path = _export(model, tmp_path / "m.onnx")
    feed = {"input": np.random.default_rng(1).standard_normal((3, 3, 8, 8)).astype(np.float32)}
    with TorchRunner(model) as t, OrtRunner(onnx_path) as o:
        a, b = t.infer(feed), o.infer(feed)
        assert list(a) == ["logits"] and list(b) == ["logits"]
        assert a["logits"].dtype == np.float32 and a["logits"].shape == (3, 10)
        np.testing.assert_allclose(a["logits"], b["logits"], atol=1e-5)
        for r in (t, o):
            timing = r.time(feed, warmup=1, iters=3)
            assert len(timing.end_to_end_ms) == 3 and min(timing.end_to_end_ms) > 0
            assert timing.gpu_compute_ms is None  # CPU runners have no GPU time
            d = r.describe()
            assert d["device"] == "cpu" and d["backend"] in ("PyTorch", "ORT")
            assert d["versions"]
        assert o.describe()["ep_used"] == "CPUExecutionProvider"
    assert harness_overhead_ms(50) < 1.0  # a no-op loop costs microseconds


def test_no_second_copy_of_runner_or_graph_logic():
    """Runners, timing loops and graph walking live in one module each."""
    import re

    owners = {ROOT / "deploykit" / "runners.py", ROOT / "deploykit" / "timing.py",
              ROOT / "deploykit" / "onnx" / "graph.py"}
    files = [*ROOT.glob("*.py"), *(ROOT / "deploykit").rglob("*.py")]
    assert len(files) > 40  # the package is searched, not only the root
    for f in files:
        if f in owners:
            continue
        text = f.read_text()
        assert not re.search(r"^class \w*Runner\b", text, re.M), f"{f.name} defines a runner"
        timing_loop = "perf_counter()" in text and re.search(r"for \w+ in range\(iters\)", text)
        assert not timing_loop, f"{f.name} has its own latency loop"
        assert "numpy_helper.to_array(i) for i in model.graph.initializer" not in text, f.name


@pytest.mark.slow  # torch.compile starts the C++ compiler (inductor): about a minute on 2 cores
def test_torch_compile_figure_on_cpu():
    """``compile=True`` adds a torch.compile figure (or the reason it could not be had), and a
    Sequential model is not truth-tested (its __len__ made the first version fail)."""
    model = _tiny_torch()
    feed = {"input": np.zeros((1, 3, 8, 8), np.float32)}
    with TorchRunner(model, compile=True) as t:
        timing = t.time(feed, warmup=1, iters=3)
    times, how = timing.extra["compile"]
    assert "__len__" not in how and "len()" not in how, how
    if times is not None:  # a C++ toolchain is needed for inductor on the CPU
        assert len(times) == 3 and "torch.compile" in how


def test_trt_runner_names_an_unreadable_plan(tmp_path):
    """--engine given a folder (e.g. artifacts/M/engines) or a missing file: a message naming the
    path, not an IsADirectoryError traceback from reading it."""

    for bad in (tmp_path, tmp_path / "missing.plan"):
        with pytest.raises(StageError, match=f"cannot read the plan {bad}"):
            TrtRunner(bad)


def test_torch_runner_names_dict_outputs_by_their_keys():
    torch = pytest.importorskip("torch")

    class DictOut(torch.nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "embed": x + 1}

    class Nested(torch.nn.Module):
        def forward(self, x):
            return x, (x, x)

    r = TorchRunner(DictOut(), "cpu", input_names=["x"])
    out = r.infer({"x": np.ones((2, 3), np.float32)})
    assert list(out) == ["logits", "embed"] and r.outputs_named
    assert np.allclose(out["logits"], 2) and np.allclose(out["embed"], 2)
    with pytest.raises(StageError, match="output 'output_1' is a tuple, not a tensor"):
        TorchRunner(Nested(), "cpu", input_names=["x"]).infer({"x": np.ones((2, 3), np.float32)})
