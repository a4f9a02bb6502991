"""deploykit.quant.modelopt: the ModelOpt wrapper's default calibration batch."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.quant.inspect import inspect_model
from deploykit.quant.modelopt import modelopt_quantize


@pytest.mark.slow
def test_default_calibration_batch_makes_entropy_independent_of_order(tmp_path):
    """ModelOpt entropy calibration through stage 5's driver: two sample orders give different
    scales at batch 1 (ModelOpt's CLI default for a dynamic batch) and identical ones with the
    default (one batch); the nodes ModelOpt quantizes do not depend on the batch (its GEMV rule
    still sees batch 1: the classifier Gemm stays float, as with ModelOpt's CLI)."""
    pytest.importorskip("modelopt.onnx.quantization")
    import onnx
    import torch
    from onnx import numpy_helper

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(32, 32)).eval()
    src = tmp_path / "fp32.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 8, 8),), str(src), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    x = np.random.default_rng(0).standard_normal((64, 3, 8, 8)).astype(np.float32)
    x[np.arange(0, 64, 7)] *= 4  # a few wide samples: where they fall decides the histogram

    def quantize(xi, batch):
        np.savez(tmp_path / "c.npz", x=xi)
        out = tmp_path / "q.onnx"
        modelopt_quantize(
            ["--onnx_path", str(src), "--quantize_mode", "int8", "--high_precision_dtype",
             "fp32", "--calibration_data_path", str(tmp_path / "c.npz"), "--calibration_eps",
             "cpu", "--output_path", str(out), "--log_level", "ERROR"], batch)
        q = onnx.load(str(out))
        c = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
        acts = [float(c[n.input[1]]) for n in q.graph.node
                if n.op_type == "QuantizeLinear" and n.input[0] not in c]
        return acts, inspect_model(q)["quantized_nodes_by_op"]

    orders = [x, x[np.random.default_rng(1).permutation(64)]]
    (a0, nodes0), (a1, _) = (quantize(o, "all") for o in orders)
    assert a0 and a0 == a1
    (b0, nodes1), (b1, _) = (quantize(o, 1) for o in orders)
    assert b0 != b1
    assert nodes0 == nodes1 and "Gemm" not in nodes0 and nodes0.get("Conv") == 2


@pytest.mark.slow
def test_fp16_file_of_the_fp32_calibration_is_the_file_modelopts_fp16_run_writes(tmp_path):
    """One calibration for int8 and int8_hp32 (deploykit.quant.modelopt.modelopt_quantize with
    fp16_output): the FP16 file derived from the --high_precision_dtype fp32 run is byte for
    byte the file ModelOpt writes with --high_precision_dtype fp16, and recording the conversion
    leaves the fp32 run's own file as it is."""
    pytest.importorskip("modelopt.onnx.quantization")
    import torch

    from deploykit.errors import UsageError

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 32, 1), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()
    with torch.no_grad():  # tiny weights: the FP16 conversion has subnormals to handle too
        net[4].weight.mul_(1e-4)
    src = tmp_path / "fp32.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 8, 8),), str(src), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    np.savez(tmp_path / "c.npz",
             x=np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))

    def run(dtype, out, fp16_output=None):
        modelopt_quantize(
            ["--onnx_path", str(src), "--quantize_mode", "int8", "--op_types_to_quantize",
             "Conv", "Gemm", "--high_precision_dtype", dtype, "--calibration_data_path",
             str(tmp_path / "c.npz"), "--calibration_eps", "cpu", "--output_path", str(out),
             "--log_level", "ERROR"], "all", fp16_output)
        return out.read_bytes()

    fp16 = run("fp16", tmp_path / "cli16.onnx")
    fp32 = run("fp32", tmp_path / "cli32.onnx")
    shared32 = run("fp32", tmp_path / "s32.onnx", tmp_path / "s16.onnx")
    assert shared32 == fp32
    assert (tmp_path / "s16.onnx").read_bytes() == fp16 != fp32
    with pytest.raises(UsageError, match="high_precision_dtype fp32"):
        run("fp16", tmp_path / "x.onnx", tmp_path / "x16.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("histograms", [True, False], ids=["entropy_histograms", "max_ranges"])
def test_histograms_of_an_earlier_run_give_the_same_file_and_only_for_the_same_inputs(
        tmp_path, capsys, histograms):
    """The stage's calibration cache (modelopt_quantize's histogram_cache): a Conv/Gemm run after
    a run with ModelOpt's default op types (a superset of its tensors) skips ORT's calibration
    session and writes byte for byte the file it writes without the cache; other calibration
    data is a cache miss (a new calibration, another file). Both ways: ORT's entropy histograms,
    and the per-tensor ranges of the max calibration that stands for them (entropy_as_max)."""
    pytest.importorskip("modelopt.onnx.quantization")
    import shutil

    import torch

    from deploykit.quant.modelopt import ENTROPY_AS_MAX_MARK, HISTOGRAM_MARK

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU6(),
                              torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU6(),
                              torch.nn.Conv2d(16, 32, 1), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(32, 10)).eval()
    src = tmp_path / "src.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 8, 8),), str(src), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    rng = np.random.default_rng(0)
    for name in ("c", "d"):
        np.savez(tmp_path / f"{name}.npz",
                 x=rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
    cache = tmp_path / "hist"

    def run(out, calib="c", ops=("Conv", "Gemm"), use_cache=True):
        work = tmp_path / f"{out}.in.onnx"  # ModelOpt rewrites its input: a fresh copy each
        shutil.copyfile(src, work)
        flags = ["--op_types_to_quantize", *ops] if ops else []
        capsys.readouterr()
        modelopt_quantize(
            ["--onnx_path", str(work), "--quantize_mode", "int8", *flags,
             "--calibration_data_path", str(tmp_path / f"{calib}.npz"), "--calibration_eps",
             "cpu", "--output_path", str(tmp_path / f"{out}.onnx"), "--log_level", "ERROR"],
            "all", None, cache if use_cache else None, histograms)
        text = capsys.readouterr().out
        assert (ENTROPY_AS_MAX_MARK in text) is not histograms
        return (tmp_path / f"{out}.onnx").read_bytes(), HISTOGRAM_MARK in text

    plain, seen = run("plain", use_cache=False)
    assert not seen and not cache.exists()
    _, seen = run("all_ops", ops=None)  # default op types: Conv, Gemm, Clip, Add ...
    files = "[!r]*.npz" if histograms else "ranges-*.npz"
    assert not seen and len(list(cache.glob(files))) == 1 == len(list(cache.glob("*.npz")))
    cached, seen = run("cached")
    assert seen and cached == plain
    other, seen = run("other", calib="d")  # other data: calibrated anew, other scales
    assert not seen and other != plain and len(list(cache.glob(files))) == 2


def test_the_shown_command_leaves_the_stages_histogram_cache_out(tmp_path):
    """The record's command is one a user can paste: without the work folder's cache."""
    from deploykit.quant import modelopt_runner

    argv = modelopt_runner.modelopt_argv("w/fp32.onnx", "w/b.onnx", ["--quantize_mode", "int8"],
                                         100, "py", histogram_cache="w/histograms")
    assert argv[argv.index("--histogram-cache") + 1] == "w/histograms"
    run = modelopt_runner.run_modelopt(
        tmp_path / "missing.onnx", tmp_path / "b.onnx", ["--quantize_mode", "int8"],
        tmp_path / "b.log", python="true", cwd=tmp_path, histogram_cache=tmp_path / "h",
        replace={tmp_path / "b.onnx": "final/b.onnx"})
    assert "--histogram-cache" in run.argv and "--histogram-cache" not in run.shown
    assert "final/b.onnx" in run.shown and run.status == "failed"  # `true` wrote nothing


def test_the_record_names_the_run_whose_histograms_were_reused():
    from deploykit.quant.modelopt import HISTOGRAM_MARK, histograms_reused_from

    log = ("calibration batch 100\n"
           f"{HISTOGRAM_MARK}baseline's run: 11 tensors, same graph, calibration data, EP and "
           "histogram settings (ORT's calibration session not run)\nQuantization done\n")
    assert histograms_reused_from(log) == "baseline"
    assert histograms_reused_from("calibration batch 100\nQuantization done\n") is None


@pytest.mark.parametrize("method,symmetric", [("entropy", False), ("percentile", True),
                                              ("percentile", False)])
def test_threaded_histograms_are_the_one_thread_histograms_bit_for_bit(method, symmetric):
    """Stage 5's calibration histograms made by several threads, each taking whole tensors:
    the same arrays, edges, minima, maxima and thresholds, in the same dict order, as ORT's
    collector on one thread, over batches whose ranges grow (merge_histogram widens the bins),
    shrink, and include an all-zero tensor and tensors of very different sizes."""
    from types import SimpleNamespace

    from onnxruntime.quantization.calibrate import HistogramCollector

    from deploykit.quant.modelopt import _threaded_collector

    cal = SimpleNamespace(method=method, symmetric=symmetric, num_bins=128,
                          num_quantized_bins=64, percentile=99.9, scenario="same")
    rng = np.random.default_rng(0)
    shapes = {"big": (4, 16, 32, 32), "mid": (4, 64, 8, 8), "small": (4, 10), "zero": (4, 8),
              "last": (4, 3, 5)}
    one = HistogramCollector(method=method, symmetric=symmetric, num_bins=128,
                             num_quantized_bins=64, percentile=99.9, scenario="same")
    many = _threaded_collector(cal, 3)
    for scale in (1.0, 3.0, 0.5, 7.0):
        batch = {n: [(np.zeros(s, np.float32) if n == "zero" else
                      (scale * rng.standard_normal(s)).astype(np.float32)) for _ in range(2)]
                 for n, s in shapes.items()}
        one.collect({n: [a.copy() for a in v] for n, v in batch.items()})
        many.collect(batch)
    assert list(many.histogram_dict) == list(one.histogram_dict) == list(shapes)
    for n, ref in one.histogram_dict.items():
        got = many.histogram_dict[n]
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
    # and the thresholds ModelOpt computes from them
    one_r, many_r = one.compute_collection_result(), many.compute_collection_result()
    assert list(one_r) == list(many_r)
    for n in one_r:
        assert repr(one_r[n]) == repr(many_r[n])


def test_a_histogram_threads_error_is_raised_in_the_calibration():
    from types import SimpleNamespace

    from deploykit.quant.modelopt import _threaded_collector

    cal = SimpleNamespace(method="nonsense", symmetric=False, num_bins=8, num_quantized_bins=4,
                          percentile=99.9, scenario="same")
    with pytest.raises(ValueError, match="Only 'entropy', 'percentile' or 'distribution'"):
        _threaded_collector(cal, 2).collect({"a": [np.ones(4, np.float32)],
                                            "b": [np.ones(3, np.float32)]})


def _entropy_cnn(tmp_path, scale_last: float = 1.0):
    """A small CNN whose calibrated tensors are signed (a Conv with no activation), clipped
    (ReLU6), depthwise and summed (a residual Add), with a Gemm; its FP32 ONNX path."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
            self.pw = torch.nn.Conv2d(16, 16, 1)
            self.fc = torch.nn.Linear(16, 10)

        def forward(self, x):
            y = self.stem(x)  # signed
            z = torch.nn.functional.relu6(self.dw(y))
            y = y + self.pw(z)  # residual Add of a signed and a mixed tensor
            return self.fc(y.mean((2, 3)))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.pw.weight.mul_(scale_last)
    src = tmp_path / "fp32.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 8, 8),), str(src), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return src


@pytest.mark.slow
def test_entropy_of_one_batch_is_computed_as_max_and_gives_the_same_file(tmp_path, capsys):
    """ModelOpt's default INT8 calibration (entropy) of one batch runs as max calibration
    (entropy_as_max: one candidate threshold, each tensor's (min, max)) and writes byte for byte
    the file ORT's entropy histograms give, for ModelOpt's default op types and for
    --high_precision_dtype fp32; with several batches (the histograms grow bins, the search has
    more candidates) entropy runs as it is; a non-finite range (an activation that overflows
    FP32) makes the run go again with entropy, which ModelOpt handles its own way."""
    pytest.importorskip("modelopt.onnx.quantization")
    from deploykit.quant.modelopt import ENTROPY_AS_MAX_MARK, entropy_computed_as_max

    src = _entropy_cnn(tmp_path)
    x = np.random.default_rng(0).standard_normal((24, 3, 8, 8)).astype(np.float32)
    x[::5] *= 3  # a few wide samples
    np.savez(tmp_path / "c.npz", x=x)

    def run(name, batch="all", histograms=False, flags=(), model=src):
        out = tmp_path / f"{name}.onnx"
        capsys.readouterr()
        modelopt_quantize(["--onnx_path", str(model), "--quantize_mode", "int8", *flags,
                           "--calibration_data_path", str(tmp_path / "c.npz"),
                           "--calibration_eps", "cpu", "--output_path", str(out),
                           "--log_level", "ERROR"], batch, None, None, histograms)
        return out.read_bytes(), capsys.readouterr().out

    for flags in (("--high_precision_dtype", "fp32"), ()):
        as_max, text = run("max", flags=flags)
        assert ENTROPY_AS_MAX_MARK in text and "method: max" in text
        entropy, text = run("entropy", histograms=True, flags=flags)
        assert ENTROPY_AS_MAX_MARK not in text
        assert as_max == entropy
    # the same file as ModelOpt's max calibration itself (one batch, default flags)
    assert run("cli_max", flags=("--calibration_method", "max"), histograms=True)[0] == as_max
    several, text = run("b4", batch=4)
    assert ENTROPY_AS_MAX_MARK not in text and entropy_computed_as_max(text) is None
    assert several == run("b4_hist", batch=4, histograms=True)[0]
    assert several != as_max  # several batches: entropy's own thresholds, not (min, max)

    (tmp_path / "wide").mkdir()
    wide = _entropy_cnn(tmp_path / "wide", scale_last=3e38)  # the residual Add overflows
    # ModelOpt 0.47.0's entropy path fails on it (numpy's histogram of inf values): the run
    # that stood in for it goes back to it and fails the same way
    with pytest.raises(IndexError) as own:
        run("wide_hist", model=wide, histograms=True)
    with pytest.raises(IndexError) as ours:
        run("wide", model=wide)
    text = capsys.readouterr().out
    assert ENTROPY_AS_MAX_MARK in text and entropy_computed_as_max(text) is None
    assert "max calibration is not what entropy gives here" in text and "nan" in text
    assert str(ours.value) == str(own.value)


def test_entropy_as_max_holds_only_where_shown(monkeypatch):
    """entropy_as_max: INT8, entropy (ModelOpt's default, None), one batch, no per-node
    calibration, no calibration cache, verified versions; anything else runs as requested."""
    pytest.importorskip("modelopt.onnx.quantization")
    import argparse

    from deploykit.quant import modelopt as mo

    def args(**kw):
        base = {"quantize_mode": "int8", "calibration_method": None,
                "calibrate_per_node": False, "calibration_cache_path": None}
        return argparse.Namespace(**{**base, **kw})

    one = {"n_samples": 100, "batches": [100]}
    assert mo.entropy_as_max(args(), one)
    assert mo.entropy_as_max(args(calibration_method="entropy"), one)
    assert mo.entropy_as_max(args(), None) is None  # no calibration data: ModelOpt's random
    assert mo.entropy_as_max(args(), {"n_samples": 100, "batches": [50, 50]}) is None
    for kw in ({"calibration_method": "max"}, {"quantize_mode": "fp8"},
               {"calibrate_per_node": True}, {"calibration_cache_path": "c.cache"}):
        assert mo.entropy_as_max(args(**kw), one) is None, kw
    monkeypatch.setattr(mo, "ENTROPY_AS_MAX_VERIFIED", frozenset())
    assert mo.entropy_as_max(args(), one) is None


def test_the_record_says_when_entropy_ran_as_max():
    """quant_<variant>.json's entropy_computed_as_max comes from the child's log line."""
    from deploykit.quant.modelopt import ENTROPY_AS_MAX_MARK, entropy_computed_as_max

    assert entropy_computed_as_max("calibration batch 100\nINFO done\n") is None
    log = f"x\n{ENTROPY_AS_MAX_MARK}one batch of 100 samples ...\ny\n"
    assert entropy_computed_as_max(log) == "one batch of 100 samples ..."


@pytest.mark.slow
@pytest.mark.parametrize("histograms", [True, False], ids=["entropy_histograms", "max_ranges"])
def test_a_calibration_cache_that_cannot_be_read_or_written_is_said_and_skipped(
        tmp_path, capsys, histograms):
    """The calibration cache only saves time: a truncated cache file is a miss (said, then
    written again), a cache folder that cannot be made is said, and either way the file is the
    one a run without a cache writes."""
    pytest.importorskip("modelopt.onnx.quantization")
    import shutil

    src = _entropy_cnn(tmp_path)
    np.savez(tmp_path / "c.npz",
             x=np.random.default_rng(0).standard_normal((12, 3, 8, 8)).astype(np.float32))

    def run(name, cache):
        work = tmp_path / f"{name}.in.onnx"
        shutil.copyfile(src, work)
        capsys.readouterr()
        modelopt_quantize(["--onnx_path", str(work), "--quantize_mode", "int8",
                           "--calibration_data_path", str(tmp_path / "c.npz"),
                           "--calibration_eps", "cpu", "--output_path",
                           str(tmp_path / f"{name}.onnx"), "--log_level", "ERROR"],
                          "all", None, cache, histograms)
        return (tmp_path / f"{name}.onnx").read_bytes(), capsys.readouterr().out

    plain, _ = run("plain", None)
    cache = tmp_path / "cache"
    first, text = run("first", cache)
    (made,) = cache.glob("*.npz")
    made.write_bytes(made.read_bytes()[:100])  # truncated
    again, text = run("again", cache)
    assert "unreadable" in text and made.name in text and "calibrating anew" in text
    assert plain == first == again
    with np.load(made) as z:  # written again, whole
        assert len(z["names"])
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    nowhere, text = run("nowhere", blocker / "cache")
    assert "not written" in text and nowhere == plain


def _export(tmp_path, name, forward):
    """A two-conv model (16 channels: ModelOpt quantizes them) with ``forward(x, c1, c2)``,
    exported to ``tmp_path/<name>.onnx`` (dynamic batch); its path."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
            self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)

        def forward(self, x):
            return forward(x, self.c1, self.c2)

    torch.manual_seed(0)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(Net().eval(), (torch.zeros(1, 3, 8, 8),), str(path), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return path


@pytest.mark.slow
def test_entropy_as_max_holds_where_a_batch_mixes_samples_and_not_where_it_cannot(
        tmp_path, capsys):
    """Cases a review found (the file must be entropy's, byte for byte, or fail as entropy
    fails): a layer that mixes the samples of the batch (max calibration runs in entropy's one
    batch); a NaN that is not a tensor's first element (ORT's ReduceMin/ReduceMax skip it; the
    NaN-propagating term sends the run back to entropy); a tensor of subnormal values, and one
    whose largest value plus max |x| exceeds FP32 (ModelOpt's entropy histogram cannot be made:
    the run fails as entropy's does)."""
    pytest.importorskip("modelopt.onnx.quantization")
    import shutil

    import torch

    from deploykit.quant.modelopt import (ENTROPY_AS_MAX_MARK, ENTROPY_FALLBACK_MARK,
                                          entropy_computed_as_max)

    def run(model, x, histograms):
        np.savez(tmp_path / "c.npz", x=x)
        work, out = tmp_path / "in.onnx", tmp_path / f"out_{histograms}.onnx"
        shutil.copyfile(model, work)
        capsys.readouterr()
        modelopt_quantize(["--onnx_path", str(work), "--quantize_mode", "int8",
                           "--high_precision_dtype", "fp32", "--calibration_data_path",
                           str(tmp_path / "c.npz"), "--calibration_eps", "cpu",
                           "--output_path", str(out), "--log_level", "ERROR"],
                          "all", None, None, histograms)
        return out.read_bytes(), capsys.readouterr().out

    x = np.random.default_rng(0).standard_normal((24, 3, 8, 8)).astype(np.float32)
    mixing = _export(tmp_path, "mix", lambda x, c1, c2: c2(
        c1(x) - c1(x).mean(0, keepdim=True)))
    got, text = run(mixing, x, False)
    assert entropy_computed_as_max(text) and got == run(mixing, x, True)[0]

    nan = _export(tmp_path, "nan", lambda x, c1, c2: c2(torch.relu(c1(torch.sqrt(x + 2.5)))))
    xn = x.copy()
    xn[:, :, :4, :4] = np.maximum(xn[:, :, :4, :4], -2)  # no NaN at a tensor's first element
    assert (xn + 2.5 < 0).any()
    got, text = run(nan, xn, False)
    assert ENTROPY_AS_MAX_MARK in text and ENTROPY_FALLBACK_MARK in text and "nan" in text
    assert entropy_computed_as_max(text) is None
    assert got == run(nan, xn, True)[0]

    tiny = _export(tmp_path, "tiny", lambda x, c1, c2: c2(c1(x) * 1e-44))
    with pytest.raises(ValueError, match="Too many bins") as own:
        run(tiny, x, True)
    with pytest.raises(ValueError, match="Too many bins") as ours:
        run(tiny, x, False)
    text = capsys.readouterr().out
    assert ENTROPY_FALLBACK_MARK in text and str(ours.value) == str(own.value)

    # finite, but max + max|x| exceeds FP32: NumPy's binning overflows in entropy's histogram
    plain = _export(tmp_path, "plain", lambda x, c1, c2: c2(c1(x) * 1e-3))
    xb = x.copy()
    xb[0, 0, 0, 0] = 1.8e38
    with pytest.raises(IndexError) as own:
        run(plain, xb, True)
    with pytest.raises(IndexError) as ours:
        run(plain, xb, False)
    text = capsys.readouterr().out
    assert ENTROPY_FALLBACK_MARK in text and str(ours.value) == str(own.value)


def test_a_fallback_after_the_max_attempt_clears_the_records_reason():
    """The reason is printed before ModelOpt runs; a fallback line after it means entropy ran."""
    from deploykit.quant.modelopt import (ENTROPY_AS_MAX_MARK, ENTROPY_FALLBACK_MARK,
                                          entropy_computed_as_max)

    log = f"{ENTROPY_AS_MAX_MARK}why\nINFO method: max\n{ENTROPY_FALLBACK_MARK} (nan): ...\n"
    assert entropy_computed_as_max(log) is None
    assert entropy_computed_as_max(log + f"{ENTROPY_AS_MAX_MARK}again\n") == "again"


def test_a_calibration_cache_key_holds_the_eps_the_session_runs():
    """ModelOpt 0.47.0 leaves the calibrator's own EP list empty: the key takes the session's
    (a CPU run and a CUDA run must not share statistics)."""
    from types import SimpleNamespace

    from deploykit.quant.modelopt import _session_providers

    def calibrator(eps):
        return SimpleNamespace(infer_session=SimpleNamespace(get_providers=lambda: eps),
                               execution_providers=[], providers=[])

    cpu = _session_providers(calibrator(["CPUExecutionProvider"]))
    cuda = _session_providers(calibrator(["CUDAExecutionProvider", "CPUExecutionProvider"]))
    assert cpu != cuda and cpu[0] == ["CPUExecutionProvider"]
    assert _session_providers(SimpleNamespace())[0] is None


def test_the_calibration_session_runs_in_the_augmented_graphs_order(tmp_path, capsys):
    """_in_graph_order remakes ORT's calibration session with PRIORITY_BASED execution (the
    order in which MinMaxCalibrater.augment_graph placed each reduction before the tensor's
    consumer: activations freed once read); options, EPs and outputs stay as they were, and a
    session that cannot be remade is kept, with a line that says so."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from deploykit.quant.modelopt import _in_graph_order

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(
        (4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("ReduceMin", ["c"], ["c_min"], keepdims=1),
             helper.make_node("ReduceMax", ["c"], ["c_max"], keepdims=1),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 3, 8, 8])],
                          [helper.make_tensor_value_info(n, 1, None)
                           for n in ("y", "c_min", "c_max")], [w])
    path = tmp_path / "augmented.onnx"
    path.write_bytes(helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.enable_cpu_mem_arena = False

    class Calibrator:
        augmented_model_path = str(path)
        infer_session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    cal = Calibrator()
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    before = cal.infer_session.run(None, x)
    _in_graph_order(cal)
    opts = cal.infer_session.get_session_options()
    assert opts.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert not opts.enable_cpu_mem_arena
    assert cal.infer_session.get_providers() == ["CPUExecutionProvider"]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, cal.infer_session.run(None, x)))
    cal.augmented_model_path = str(tmp_path / "gone.onnx")
    cal.infer_session = kept = ort.InferenceSession(str(path), so,
                                                    providers=["CPUExecutionProvider"])
    _in_graph_order(cal)
    assert cal.infer_session is kept
    assert "calibration session kept in ORT's default order" in capsys.readouterr().out
