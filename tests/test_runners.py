"""The runner contract (deploykit.runners) and the one evaluation path (deploykit.evaluate) shared by stages 1,
3 and 7: same interface and row schema for every backend, static batches respected, diagnostics
that never fail a row, and stage CLIs declared once with help on every flag."""
from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_stage
from deploykit.errors import UsageError
from deploykit.evaluate import (
    EvalData,
    base_record,
    batch_plan,
    diagnose,
    evaluate,
    latency,
    run_outputs,
)
from deploykit.models import parse_input_shape, parse_input_shapes
from deploykit.results import write_result
from deploykit.runners import OrtRunner, TorchRunner, harness_overhead_ms
from deploykit.timing import MIN_ITERS, Timing, wall_loop


def _tiny_torch():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(4, 10)).eval()


def _export(model, path: Path, batch: int | None = None) -> Path:
    """ONNX of ``model``; ``batch`` None = dynamic batch axis, else static."""
    import torch

    x = torch.zeros(batch or 2, 3, 8, 8)
    axes = None if batch else {"input": {0: "b"}, "logits": {0: "b"}}
    torch.onnx.export(model, (x,), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes=axes, dynamo=False, opset_version=17)
    return path


def _data(n: int = 10) -> EvalData:
    rng = np.random.default_rng(0)
    return EvalData(x_u8=rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8),
                             y=rng.integers(0, 10, n), files=[f"f{i}" for i in range(n)],
                             mean=(0.5,) * 3, std=(0.5,) * 3)


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


def test_rows_of_every_backend_share_one_schema(tmp_path):
    model = _tiny_torch()
    onnx_path = _export(model, tmp_path / "m.onnx")
    data = _data()
    args = argparse.Namespace(x=1)
    recs = []
    for runner in (TorchRunner(model), OrtRunner(onnx_path)):
        with runner:
            rec, out = evaluate(runner, data, stage="t", precision="FP32", model="m",
                                         tag="t", args=args, started=time.time(), warmup=1,
                                         iters=3, latency_batch=4, write=False)
        recs.append(rec)
        assert out["logits"].shape == (10, 10)
        assert rec["latency"]["batch"] == 1 and rec["latency_batch"]["batch"] == 4
        assert rec["latency"]["end_to_end_ms"]["p50_ms"] > 0
        assert rec["n_images"] == 10 and 0 <= rec["accuracy"]["top1"] <= 100
    assert set(recs[0]) == set(recs[1])
    assert recs[0]["device"] == recs[1]["device"] == "cpu"  # never "cuda:0" vs "cuda"


def test_static_batch_model_is_fed_in_its_own_batch(tmp_path):
    """A model exported with a static batch of 4 gets batches of 4 (last one padded), whatever
    --batch-size asks for, and a latency batch it cannot take is a usage error."""
    model = _tiny_torch()
    with OrtRunner(_export(model, tmp_path / "s.onnx", batch=4)) as o:
        assert o.batch_range == (4, 4)
        data = _data(10)
        out = run_outputs(o, data, batch=64)["logits"]
        with TorchRunner(model) as t:
            ref = run_outputs(t, data, batch=3)["logits"]
        assert out.shape == (10, 10)
        np.testing.assert_allclose(out, ref, atol=1e-5)
        with pytest.raises(UsageError, match="accepts batch 4..4"):
            latency(o, data, 1, 0, 1)
        assert latency(o, data, 4, 0, 2)["batch"] == 4


def test_batch_plan():
    assert batch_plan(100, 64, (1, None)) == (64, 0)
    assert batch_plan(100, 64, (1, 32)) == (32, 0)  # engine profile max
    assert batch_plan(100, 64, (1, 1)) == (1, 1)
    assert batch_plan(100, 2, (8, 8)) == (8, 8)


def test_a_failing_diagnostic_never_fails_the_row(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path))
    rec = base_record("t", "FP32", "m", "row", {"backend": "ORT", "device": "cpu"})
    write_result("m", "row", rec)

    def broken():
        raise NameError("name 'art' is not defined")

    assert diagnose(rec, "layerwise", broken) is None
    saved = json.loads((tmp_path / "m" / "row.json").read_text())
    assert saved["status"] == "ok"
    assert saved["diagnostics"]["layerwise"]["status"] == "error"
    assert "art" in saved["diagnostics"]["layerwise"]["error"]
    assert diagnose(rec, "ok_one", lambda: {"x": 1}) == {"x": 1}
    assert json.loads((tmp_path / "m" / "row.json").read_text())["diagnostics"]["ok_one"] == {"x": 1}


def test_stage3_layerwise_works_and_row_stays_ok(stage_env):
    """The README's `3_onnx_eval.py ... --layerwise` (it raised NameError after writing the
    row, and the catch-all then rewrote the good row as failed)."""
    env = stage_env
    art = Path(env["ARTIFACTS"]) / "efficientnet_lite0"
    if not (art / "onnx" / "fp32.onnx").exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    if not (art / "ref_logits.npz").exists():
        run_stage(["1_pytorch_baseline.py", "--iters", "3", "--warmup", "1", "--limit", "48"],
                  env)
    run_stage(["3_onnx_eval.py", "--onnx", str(art / "onnx" / "fp16.onnx"), "--tag", "lw_fp16",
               "--limit", "8", "--iters", "3", "--warmup", "1", "--layerwise",
               "--layerwise-images", "2"], env)
    res = Path(env["RESULTS"]) / "efficientnet_lite0"
    row = json.loads((res / "lw_fp16.json").read_text())
    assert row["status"] == "ok"
    lw = row["diagnostics"]["layerwise"]
    assert "error" not in lw and lw["first_divergent"] is None
    assert (res / "layerwise_lw_fp16" / "layerwise.md").exists()


STAGE_SCRIPTS = ["0_prepare_data", "1_pytorch_baseline", "2_export_onnx", "3_onnx_eval",
                 "4_make_calib", "5b_quantize_int4", "7_trt_eval", "8_report", "variants"]


@pytest.mark.parametrize("name", STAGE_SCRIPTS)
def test_every_flag_has_help_and_descriptions_are_whole(name):
    parser = importlib.import_module(name).get_args_parser()
    desc = parser.description.strip()
    first_para = desc.split("\n\n")[0]
    assert first_para.rstrip().endswith((".", ":")), first_para  # not cut mid-sentence
    parsers = [parser] + [sp for a in parser._actions
                          if isinstance(a, argparse._SubParsersAction)
                          for sp in a.choices.values()]
    for p in parsers:
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help, f"{name}: {a.option_strings or a.dest} has no help"
    text = parser.format_help()
    if any(a.option_strings == ["--warmup"] for a in parser._actions):
        assert "(default: 20)" in text  # defaults are shown


def test_shared_flags_have_one_default_everywhere():
    seen: dict[str, set] = {}
    for name in STAGE_SCRIPTS:
        for a in importlib.import_module(name).get_args_parser()._actions:
            for flag in ("--warmup", "--iters", "--batch-size", "--latency-batch", "--model"):
                if flag in a.option_strings:
                    seen.setdefault(flag, set()).add(repr(a.default))
    assert seen["--warmup"] == {"20"} and seen["--iters"] == {"200"}
    assert all(len(v) == 1 for v in seen.values()), seen


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


def test_timed_loop_is_bounded_by_iterations_and_time():
    """A slow model stops after the time budget (but never before MIN_ITERS); a fast one runs
    all iterations. The row records how many ran."""
    slow = wall_loop(lambda: time.sleep(0.005), 0, 1000, max_seconds=0.01)
    assert len(slow) == MIN_ITERS
    fast = wall_loop(lambda: None, 2, 150, max_seconds=5.0)
    assert len(fast) == 150
    assert len(wall_loop(lambda: None, 0, 5, max_seconds=0.0)) == 5  # iters < MIN_ITERS
    t = Timing(slow, "t").stats(batch=1, warmup=0)
    assert t["iters"] == MIN_ITERS


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


def test_one_input_shape_parser_for_every_stage():
    """Stages 1-3 and 6 read --input-shape with one parser: quoted names holding ':', dtypes,
    'x' or ',' between dims, and a clear error for dims < 1."""
    assert parse_input_shapes(["x:2,3,8,8", "'ids:0':1x16:int64", "4,3"]) == [
        ("x", (2, 3, 8, 8), "float32"), ("ids:0", (1, 16), "int64"), ("input_2", (4, 3), "float32")]
    assert parse_input_shape("input:0:1x3x32x32") == ("input:0", (1, 3, 32, 32), None)
    with pytest.raises(UsageError, match="every dimension must be >= 1"):
        parse_input_shapes(["x:0,3,8,8"])
    with pytest.raises(UsageError, match="unknown dtype"):
        parse_input_shapes(["x:1,3:floaty"])
