"""deploykit.runners: the runner contract (TorchRunner, OrtRunner, TrtRunner), torch.compile on CPU,
one copy of runner and graph logic."""

from __future__ import annotations

import re

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


# ------------------------------------------------------- ONNX Runtime's errors, translated
def _graph(nodes, opsets=(("", 17),), dims=("N", 3, 4, 4), ir=None, dtype=None):
    import onnx
    from onnx import TensorProto, helper

    dtype = TensorProto.FLOAT if dtype is None else dtype
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", dtype, list(dims))],
                          [helper.make_tensor_value_info("y", dtype, list(dims))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    if ir is not None:
        m.ir_version = ir
    return m


def _relu(name="r"):
    from onnx import helper
    return helper.make_node("Relu", ["x"], ["y"], name=name)


def test_ort_feed_mismatches_name_the_input_and_the_fix(tmp_path):
    import onnx

    onnx.save(_graph([_relu()]), str(tmp_path / "m.onnx"))
    r = OrtRunner(tmp_path / "m.onnx")
    ok = np.zeros((2, 3, 4, 4), np.float32)
    assert r.infer({"x": ok, "unused": ok})["y"].shape == (2, 3, 4, 4)
    label = str(tmp_path / "m.onnx")
    cases = [
        ({"x": ok.astype(np.float64)}, r"input 'x' is float64, the model takes float32 "
                                       r"\(tensor\(float\)\): cast it \(x\.astype\(np\.float32\)\)"),
        ({"x": ok[0]}, r"input 'x' has rank 3 \(shape \[3, 4, 4\]\), the model takes rank 4 "
                       r"\['N', 3, 4, 4\]"),
        ({"x": np.zeros((2, 5, 4, 4), np.float32)},
         r"input 'x' has shape \[2, 5, 4, 4\], the model takes \['N', 3, 4, 4\] \(axis 1: 5 vs 3\)"),
        ({"z": ok}, r"the feed lacks model input\(s\) \['x'\] \(model inputs: \['x'\]; given: "
                    r"\['z'\]\): name each array by its model input"),
    ]
    for feed, msg in cases:
        for call in (lambda: r.infer(feed), lambda: r.time(feed, 1, 2)):
            with pytest.raises(StageError, match=re.escape(label) + ": " + msg):
                call()


@pytest.mark.parametrize("what, model, message", [
    ("opset", lambda: _graph([_relu()], opsets=(("", 99),)),
     r"it is stamped opset 99 of ai\.onnx, this onnxruntime runs up to opset \d+: re-export "
     r"with an opset <= \d+ \(2_export_onnx\.py --opset\)"),
    ("ir", lambda: _graph([_relu()], ir=99),
     r"ONNX IR version 99, this onnxruntime reads up to \d+"),
    ("custom", lambda: _graph([_node("Foo", "foo1", "com.example")],
                              opsets=(("", 17), ("com.example", 1))),
     r"node 'foo1' uses com\.example:Foo, a custom op this onnxruntime does not implement: "
     r"register its kernel library \(SessionOptions\.register_custom_ops_library\)"),
    ("unknown", lambda: _graph([_node("Rleu", "typo")]),
     r"node 'typo' has op Rleu, which opset 17 of ai\.onnx does not define"),
])
def test_ort_load_errors_name_the_node_or_opset_and_the_fix(tmp_path, what, model, message):
    import onnx

    path = tmp_path / f"{what}.onnx"
    onnx.save(model(), str(path))
    with pytest.raises(StageError, match=r"onnxruntime [\d.]+ cannot load " + re.escape(str(path))
                       + ": " + message):
        OrtRunner(path)
    with pytest.raises(StageError, match=message):  # serialized bytes too
        OrtRunner(path.read_bytes())


def _node(op, name, domain=""):
    from onnx import helper
    return helper.make_node(op, ["x"], ["y"], name=name, domain=domain)


def test_ort_runtime_node_failure_names_the_node(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="head/reshape")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([-1, 2], np.int64), "shape")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
              str(tmp_path / "r.onnx"))
    r = OrtRunner(tmp_path / "r.onnx")
    assert r.infer({"x": np.zeros((2, 3), np.float32)})["y"].shape == (3, 2)
    with pytest.raises(StageError, match=r"onnxruntime failed running .*r\.onnx at node "
                                         r"'head/reshape': "):
        r.infer({"x": np.zeros((1, 3), np.float32)})


def _graph_file(tmp_path, name, nodes, x_dims, y_dims, dtype=None):
    from onnx import TensorProto, helper

    t = dtype or TensorProto.FLOAT
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", t, x_dims)],
                          [helper.make_tensor_value_info("y", t, y_dims)])
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=8).SerializeToString())
    return path


def _count_runs(monkeypatch, runner):
    sizes = []
    real = runner._run

    def run(session, feed):
        sizes.append(len(next(iter(feed.values()))))
        return real(session, feed)

    monkeypatch.setattr(runner, "_run", run)
    return sizes


def test_ort_cpu_runs_a_large_batch_in_chunks_once_both_ways_agree(tmp_path, monkeypatch):
    """With cpu_chunk, the first feed of ORT_CHUNK_MIN_FEED or more samples runs whole and in
    chunks of ORT_CPU_CHUNK; equal
    bits, dtypes and shapes: chunks from then on (the last one shorter), the graph's dtype kept
    with ``native``, said in describe(). Without cpu_chunk: never."""
    from onnx import TensorProto, helper

    from deploykit.runners import ORT_CHUNK_MIN_FEED, ORT_CPU_CHUNK as CPU_CHUNK

    path = _graph_file(tmp_path, "tanh", [helper.make_node("Tanh", ["x"], ["y"])],
                       ["N", 5], ["N", 5])
    x = np.random.default_rng(0).standard_normal((ORT_CHUNK_MIN_FEED + 3, 5)).astype(np.float32)
    n = len(x)
    full = ORT_CHUNK_MIN_FEED // CPU_CHUNK
    with OrtRunner(path, cpu_chunk=True) as r:
        sizes = _count_runs(monkeypatch, r)
        assert r.describe()["cpu_chunk"] is None  # not decided before a run
        y = r.infer({"x": x})["y"]
        assert sizes == [n] + [CPU_CHUNK] * full + [3] and r.describe()["cpu_chunk"] == CPU_CHUNK
        np.testing.assert_allclose(y, np.tanh(x), atol=1e-6)
        sizes.clear()
        y2 = r.infer({"x": x})["y"]
        assert sizes == [CPU_CHUNK] * full + [3]
        np.testing.assert_array_equal(y2, r.session.run(None, {"x": x})[0])
        sizes.clear()
        r.infer({"x": x[:ORT_CHUNK_MIN_FEED - 1]})  # a shorter feed: one run
        assert sizes == [ORT_CHUNK_MIN_FEED - 1]
    with OrtRunner(path) as r:
        sizes = _count_runs(monkeypatch, r)
        r.infer({"x": x})
        assert sizes == [n] and r.describe()["cpu_chunk"] is None
    h = _graph_file(tmp_path, "half", [helper.make_node("Tanh", ["x"], ["y"])], ["N", 5],
                    ["N", 5], TensorProto.FLOAT16)
    with OrtRunner(h, cpu_chunk=True) as r:
        for _ in range(2):
            y16 = r.infer({"x": x.astype(np.float16)}, native=True)["y"]
            assert y16.dtype == np.float16 and y16.shape == x.shape
        assert r.chunked is True


def _mean_centred(tmp_path):
    from onnx import helper

    return _graph_file(tmp_path, "centred", [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
        helper.make_node("Sub", ["x", "m"], ["y"])], ["N", 4], ["N", 4])


def _fixed_16(tmp_path):
    """y [16, 4]: a constant whose first axis is 16 whatever the batch (beside a per-sample
    output)."""
    from onnx import TensorProto, helper, numpy_helper

    c = numpy_helper.from_array(np.arange(64, dtype=np.float32).reshape(16, 4), "c")
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["z"]),
                           helper.make_node("Identity", ["c"], ["y"])], "fixed16",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 4])], [c])
    path = tmp_path / "fixed16.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=8).SerializeToString())
    return path


def _with_table(tmp_path):
    """y = x + t[:, None] * 0 + sum(t): a second input ``t`` [K] without the batch axis."""
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("ReduceSum", ["t"], ["s"], keepdims=0),
                           helper.make_node("Add", ["x", "s"], ["y"])], "table",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                           helper.make_tensor_value_info("t", TensorProto.FLOAT, ["K"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    path = tmp_path / "table.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=8).SerializeToString())
    return path


def _groups_of_3(tmp_path):
    """Reshape [N, 4] -> [-1, 12]: a batch of 66 runs whole, a chunk of 16 fails."""
    from onnx import TensorProto, helper, numpy_helper

    shape = numpy_helper.from_array(np.array([-1, 12], np.int64), "shape")
    g = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "groups",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
    path = tmp_path / "groups.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=8).SerializeToString())
    return path


@pytest.mark.parametrize("make,n", [(_mean_centred, 80), (_fixed_16, 64), (_with_table, 64),
                                    (_groups_of_3, 66)])
def test_ort_cpu_keeps_whole_batches_when_chunks_would_change_anything(tmp_path, monkeypatch,
                                                                       make, n):
    """Samples mixed across the batch, an output [16, 4] whatever the batch, an input without
    the batch axis that happens to be N long, a chunk the model refuses: whole batches, for
    good, with ORT's own outputs (code review of stop 41)."""
    import onnxruntime as ort

    rng = np.random.default_rng(2)
    feed = {"x": rng.standard_normal((n, 4)).astype(np.float32)}
    if make is _with_table:
        feed["t"] = rng.standard_normal(n).astype(np.float32)
    path = make(tmp_path)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)
    with OrtRunner(path, cpu_chunk=True) as r:
        sizes = _count_runs(monkeypatch, r)
        for _ in range(2):
            got = r.infer(feed)
            for a, b in zip(got.values(), want):
                np.testing.assert_array_equal(a, b, strict=True)
        assert r.chunked is False and r.describe()["cpu_chunk"] is None
        assert sizes[-1] == n  # the second feed: one whole run


def test_ort_cpu_never_chunks_a_fixed_batch_or_outputs_that_are_not_per_sample(
        tmp_path, monkeypatch):
    from onnx import helper

    from deploykit.runners import ORT_CHUNK_MIN_FEED

    n = ORT_CHUNK_MIN_FEED
    x = np.random.default_rng(1).standard_normal((n, 4)).astype(np.float32)
    fixed = _graph_file(tmp_path, "fixed", [helper.make_node("Relu", ["x"], ["y"])], [n, 4],
                        [n, 4])
    with OrtRunner(fixed, cpu_chunk=True) as r:
        sizes = _count_runs(monkeypatch, r)
        r.infer({"x": x})
        assert sizes == [n] and r.describe()["cpu_chunk"] is None
    # a sum over the batch: one value per feature, not per sample
    pooled = _graph_file(tmp_path, "pooled", [helper.make_node("ReduceSum", ["x"], ["y"],
                                                               keepdims=0, noop_with_empty_axes=0)],
                         ["N", 4], [])
    with OrtRunner(pooled, cpu_chunk=True) as r:
        sizes = _count_runs(monkeypatch, r)
        y = r.infer({"x": x})["y"]
        np.testing.assert_allclose(y, x.sum(), rtol=1e-5)
        assert r.chunked is False and r.describe()["cpu_chunk"] is None
        sizes.clear()
        r.infer({"x": x})  # decided for good: whole from then on
        assert sizes == [n]


def test_chunks_are_compared_by_bytes_and_a_later_failing_chunk_runs_whole(tmp_path,
                                                                           monkeypatch):
    """-0.0 is not +0.0 and NaN is NaN (the same bytes); once chunks were chosen, a later feed
    whose chunks fail runs whole instead of raising (re-review of stop 41)."""
    from onnx import helper

    from deploykit.runners import ORT_CHUNK_MIN_FEED, ORT_CPU_CHUNK, _same_outputs

    z = np.zeros(3, np.float32)
    assert not _same_outputs({"y": z}, {"y": -z})
    assert _same_outputs({"y": np.full(3, np.nan, np.float32)},
                         {"y": np.full(3, np.nan, np.float32)})
    assert not _same_outputs({"y": z}, {"y": z.astype(np.float64)})
    path = _graph_file(tmp_path, "relu", [helper.make_node("Relu", ["x"], ["y"])], ["N", 4],
                       ["N", 4])
    x = np.random.default_rng(3).standard_normal((ORT_CHUNK_MIN_FEED, 4)).astype(np.float32)
    with OrtRunner(path, cpu_chunk=True) as r:
        r.infer({"x": x})
        assert r.chunked is True
        real = r._infer_one

        def refuse_chunks(feed, native):
            if len(feed["x"]) <= ORT_CPU_CHUNK:
                raise StageError("a chunk the model refuses")
            return real(feed, native)

        monkeypatch.setattr(r, "_infer_one", refuse_chunks)
        np.testing.assert_array_equal(r.infer({"x": x})["y"], np.maximum(x, 0))
