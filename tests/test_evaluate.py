"""deploykit.evaluate: the one evaluation path of stages 1, 3 and 7 (one row schema, static batches,
the batch plan, diagnostics that never fail the row, NaN outputs, the latency budget)."""

from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from deploykit.errors import UsageError
from deploykit.evaluate import (
    base_record, batch_plan, diagnose, EvalData, evaluate, latency, run_outputs, score,
    summary_line,
)
from deploykit.results import write_result
from deploykit.runners import OrtRunner, Runner, TorchRunner
from deploykit.timing import MIN_ITERS

from tests.helpers.runners import _export, _tiny_torch
from tests.helpers.verdict_models import static_batch_model
from tests.helpers.stages import load_stage


# ----------------------------------------------------------------- latency: --iters honoured
class _SlowRunner:
    """A runner whose every call takes 20 ms (deploykit.runners.Runner.time's default loop)."""

    batch_range = (1, None)
    max_seconds = Runner.max_seconds

    def infer(self, feed):
        time.sleep(0.02)
        return {}

    def time(self, feed, warmup, iters):
        return Runner.time(self, feed, warmup, iters)


def test_latency_loop_cut_by_the_budget_says_so_and_0_runs_every_iteration(monkeypatch, capsys):

    data = EvalData(x_u8=np.zeros((2, 3, 4, 4), np.uint8), y=np.zeros(2, np.int64),
                             files=["a", "b"], mean=(0.5,) * 3, std=(0.5,) * 3)
    slow = _SlowRunner()
    slow.max_seconds = 0.1  # what --max-seconds 0.1 sets on the runner evaluate() times
    cut = latency(slow, data, 1, 0, 40)
    assert MIN_ITERS <= cut["iters"] < 40 and cut["max_seconds"] == 0.1
    err = capsys.readouterr().err
    assert f"{cut['iters']} of --iters 40 timed runs" in err and "--max-seconds 0" in err
    slow.max_seconds = float("inf")  # what --max-seconds 0 sets
    full = latency(slow, data, 1, 0, 40)
    assert full["iters"] == 40 and full["max_seconds"] is None
    assert "note: latency" not in capsys.readouterr().err


def test_evaluation_of_a_static_batch_file_without_latency_flag(tmp_path):
    """Stage 3's evaluation path on a file with a static batch of 4: without any flag it
    stopped with "--latency-batch 1: the model accepts batch 4..4" (a usage error about a
    flag the user never gave); the batch-1 latency is measured at the smallest batch the model
    takes, so the default needs no second measurement."""
    import argparse
    import time


    src = tmp_path / "static4.onnx"
    onnx.save(static_batch_model(4), str(src))
    x = np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32)
    data = EvalData(feed={"x": x}, ref=None)
    with OrtRunner(src) as r:
        rec, out = evaluate(r, data, stage="3_onnx_eval", precision="FP32",
                                     model="review:static4", tag="t", args=argparse.Namespace(),
                                     started=time.time(), iters=3, warmup=1, write=False)
        assert rec["latency"]["end_to_end_ms"]["batch"] == 4 and rec["latency_batch"] is None
        assert out["y"].shape == (6, 3)
        with pytest.raises(Exception, match="accepts batch 4"):  # an explicit other batch
            evaluate(r, data, stage="3_onnx_eval", precision="FP32", model="m", tag="t",
                              args=argparse.Namespace(), started=time.time(), iters=3,
                              warmup=1, write=False, latency_batch=2)


def test_the_row_says_how_the_accuracy_pass_ran(tmp_path):
    """The row's runtime block is read after the accuracy pass: an ORT CPU pass that ran in
    chunks says so (it said null, as it was read before the pass: code review of stop 41)."""
    from deploykit.runners import ORT_CHUNK_MIN_FEED, ORT_CPU_CHUNK

    g = helper.make_graph([helper.make_node("Tanh", ["x"], ["y"])], "tanh",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])])
    src = tmp_path / "tanh.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(src))
    x = np.random.default_rng(0).standard_normal((ORT_CHUNK_MIN_FEED + 16, 3)).astype(np.float32)
    for chunk, want in ((True, ORT_CPU_CHUNK), (False, None)):
        with OrtRunner(src, cpu_chunk=chunk) as r:
            rec, out = evaluate(r, EvalData(feed={"x": x}, ref=None), stage="3_onnx_eval",
                                precision="FP32", model="m", tag="t", args=argparse.Namespace(),
                                started=time.time(), iters=3, warmup=1, write=False)
        assert rec["runtime"]["cpu_chunk"] == want and out["y"].shape == x.shape


# --------------------------------------------------------------------------------------------
# A row whose outputs are NaN is not an ordinary "ok" row
# --------------------------------------------------------------------------------------------
def test_nan_outputs_are_named_in_the_row_the_report_and_the_summary(tmp_path):
    """A Q/DQ file whose activation scale was edited to NaN (a custom model, no labels): stage
    3's row said status ok with an empty cosine, and the report listed it as ok with a 3.7x
    speedup. The row now counts the non-finite values and the report says so."""
    import argparse
    import time

    report = load_stage("8_report")
    g = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s"], ["q"], name="q"),
         helper.make_node("DequantizeLinear", ["q", "s"], ["y"], name="dq")], "g",
        [helper.make_tensor_value_info("x", 1, ["N", 4])],
        [helper.make_tensor_value_info("y", 1, ["N", 4])],
        [numpy_helper.from_array(np.array(np.nan, np.float32), "s")])
    src = tmp_path / "nan.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9),
              str(src))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    data = EvalData(feed={"x": x}, ref={"y": x})
    with OrtRunner(src) as r:
        rec, _ = evaluate(r, data, stage="3_onnx_eval", precision="INT8",
                                   model="review:nan", tag="ort_nan", args=argparse.Namespace(),
                                   started=time.time(), iters=3, warmup=1, write=False)
    assert rec["nonfinite_outputs"] == {"y": 20}, rec.get("nonfinite_outputs")
    assert "20 NaN/Inf" in summary_line(rec)
    (row,) = report.table_rows([{**rec, "_file": "ort_nan.json"}])
    assert "NON-FINITE OUTPUTS" in row["status"], row["status"]


def _data(n: int = 10) -> EvalData:
    rng = np.random.default_rng(0)
    return EvalData(x_u8=rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8),
                             y=rng.integers(0, 10, n), files=[f"f{i}" for i in range(n)],
                             mean=(0.5,) * 3, std=(0.5,) * 3)


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


# --------------------------------------------------------------------------------------------
# A row's status follows its parity (deploykit.evaluate.judge)
# --------------------------------------------------------------------------------------------
def _flipped(src, dst):
    """A copy of ``src`` whose classifier (last Gemm/MatMul) weights have their sign bit
    flipped: the file loads and runs, its logits are wrong."""
    m = onnx.load(str(src))
    node = [n for n in m.graph.node if n.op_type in ("Gemm", "MatMul")][-1]
    init = next(t for t in m.graph.initializer if t.name in node.input)
    init.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(init), init.name))
    onnx.save(m, str(dst))
    return dst


def test_a_wrong_file_is_a_failed_row_written_over_an_ok_one(tmp_path, monkeypatch):
    """The user's report: an ONNX with bit-flipped classifier weights got ``status: ok``. The
    row is now failed, names the metric, value and bound, carries the next step, is still
    written (a measurement) and replaces an earlier ok row of the tag."""
    from deploykit.evaluate import verdict_warning

    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    good = _export(_tiny_torch(), tmp_path / "good.onnx")
    data = _data(16)
    with OrtRunner(good) as r:
        data.ref = run_outputs(r, data, 8)["logits"]
        ok, _ = evaluate(r, data, stage="3_onnx_eval", precision="FP32", model="m", tag="t",
                         args=argparse.Namespace(), started=time.time(), iters=2, warmup=0,
                         next_step="python layerwise.py diff a b")
    assert ok["status"] == "ok" and ok["status_reason"] is None and ok["next_step"] is None
    assert ok["tolerance"]["band"] == "fp32" and verdict_warning(ok) is None
    with OrtRunner(_flipped(good, tmp_path / "bad.onnx")) as r:
        bad, _ = evaluate(r, data, stage="3_onnx_eval", precision="FP32", model="m", tag="t",
                          args=argparse.Namespace(), started=time.time(), iters=2, warmup=0,
                          next_step="python layerwise.py diff a b")
    assert bad["status"] == "failed", bad["status_reason"]
    assert "cosine_min" in bad["status_reason"] and "(FP32 failed bound)" in bad["reason"]
    assert bad["next_step"] == "python layerwise.py diff a b"
    saved = json.loads((tmp_path / "r" / "m" / "t.json").read_text())
    assert saved["status"] == "failed" and saved["parity"] == bad["parity"]
    assert not (tmp_path / "r" / "m" / "t.failed.json").exists()
    line = verdict_warning(bad)
    assert line.startswith("WARNING: row t is FAILED: FP32") and "layerwise.py diff" in line
    # the report shows the status with the metric that failed
    (row,) = load_stage("8_report").table_rows([{**saved, "_file": "t.json"}])
    assert row["status"].startswith("failed: ") and "cosine" in row["status"]


def test_judge_leaves_a_reference_row_alone_and_fails_nonfinite_rows():
    from deploykit.evaluate import judge

    ref = base_record("1_pytorch_baseline", "FP32", "m", "pytorch_fp32_cpu")
    assert judge(ref, "x")["status"] == "ok" and ref["next_step"] is None
    nan = base_record("3_onnx_eval", "INT8", "m", "t", nonfinite_outputs={"y": 3})
    judge(nan, "cmd")
    assert nan["status"] == "failed" and "y: 3 NaN/Inf" in nan["status_reason"]
    assert nan["next_step"] == "cmd"


# --------------------------------------------------------------------------------------------
# Several outputs: the one compared with the reference is named
# --------------------------------------------------------------------------------------------
def _two_outputs(path, names):
    """``input [N,3,8,8] -> GlobalAveragePool -> Flatten`` (``feat`` [N, 3]) ``-> Gemm`` (10
    logits); the graph's outputs are ``names[0]`` = the features, ``names[1]`` = the logits."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["p"]),
         helper.make_node("Flatten", ["p"], [names[0]]),
         helper.make_node("Gemm", [names[0], "w", "b"], [names[1]])], "two",
        [helper.make_tensor_value_info("input", 1, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info(names[0], 1, ["N", 3]),
         helper.make_tensor_value_info(names[1], 1, ["N", 10])],
        [numpy_helper.from_array(rng.standard_normal((3, 10)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(10).astype(np.float32), "b")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


def _eval(path, data):
    with OrtRunner(path) as r:
        return evaluate(r, data, stage="3_onnx_eval", precision="FP32", model="m", tag="t",
                        args=argparse.Namespace(), started=time.time(), iters=2, warmup=0,
                        write=False)


def test_an_extra_first_output_is_not_taken_for_the_logits(tmp_path, capsys):
    """The user's report: the real file with an extra first output scored cosine -1 (the first
    output was taken as the logits, nothing said there were two). The output named logits is
    compared, and the row records which one and all of them."""
    data = _data(12)
    path = _two_outputs(tmp_path / "extra.onnx", ["feat", "logits"])
    with OrtRunner(path) as r:
        data.ref = run_outputs(r, data, 4)["logits"]
    rec, out = _eval(path, data)
    assert rec["output_used"] == "logits" and rec["outputs"] == ["feat", "logits"]
    assert rec["parity"]["cosine_min"] > 0.99999 and rec["status"] == "ok"
    assert list(out)[0] == "logits"  # the cross-checks read the first output
    assert "WARNING" not in capsys.readouterr().err
    assert "output 'logits' of 2" in summary_line(rec)


def test_no_output_named_logits_takes_the_first_and_warns_naming_both(tmp_path, capsys):
    """Two [N, 10] outputs, neither named logits, the reference is the second: the first is
    compared (by index), a WARNING names both, and the row fails (cosine -1) instead of
    saying ok."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["input"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("Gemm", ["f", "w", "b"], ["out1"]),
         helper.make_node("Neg", ["out1"], ["out0"])], "anon",
        [helper.make_tensor_value_info("input", 1, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("out0", 1, ["N", 10]),
         helper.make_tensor_value_info("out1", 1, ["N", 10])],
        [numpy_helper.from_array(rng.standard_normal((3, 10)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(10).astype(np.float32), "b")])
    path = tmp_path / "anon.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    data = _data(12)
    with OrtRunner(path) as r:
        data.ref = run_outputs(r, data, 4)["out1"]
    rec, _ = _eval(path, data)
    err = capsys.readouterr().err
    assert "WARNING: the model has 2 outputs (out0, out1)" in err
    assert "output 'out0' (index 0) is compared with the reference's 'logits'" in err
    assert rec["output_used"] == "out0" and rec["outputs"] == ["out0", "out1"]
    assert rec["status"] == "failed" and "out0 cosine_min -1" in rec["status_reason"]


def test_custom_model_outputs_are_matched_by_name(tmp_path):
    """A custom model's reference outputs are paired with its outputs by name, not position."""
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["a"]),
                           helper.make_node("Identity", ["x"], ["b"])], "g",
                          [helper.make_tensor_value_info("x", 1, ["N", 4])],
                          [helper.make_tensor_value_info("a", 1, ["N", 4]),
                           helper.make_tensor_value_info("b", 1, ["N", 4])])
    path = tmp_path / "ab.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    rec, _ = _eval(path, EvalData(feed={"x": x}, ref={"b": x, "a": -x}))
    assert rec["output_used"] == {"b": "b", "a": "a"} and rec["status"] == "ok"
    assert rec["parity_outputs"]["b"]["cosine_min"] > 0.99999


def test_labels_out_of_range_and_few_classes():
    """--labels with ids the model cannot output is refused (the accuracy would be silently
    wrong); a model with at most 5 classes gets top-1 only, and the summary line says so."""
    from deploykit.errors import UsageError as _Usage
    from deploykit.evaluate import EvalData, score, summary_line

    feed = {"x": np.zeros((4, 2), np.float32)}
    out = {"logits": np.eye(4, 4, dtype=np.float32)}
    with pytest.raises(_Usage, match="class ids up to 9 for a model whose first output"):
        score(EvalData(feed=feed, y=np.array([0, 1, 9, 2])), out)
    rec = score(EvalData(feed=feed, y=np.array([0, 1, 2, 0])), out)
    assert rec["accuracy"] == {"top1": 75.0}
    line = summary_line({"backend": "ORT", "precision": "FP32", "device": "cpu",
                         "accuracy": rec["accuracy"], "n_images": 4})
    assert "top-1 75.00% on 4 images" in line and "top-5" not in line


# --------------------------------------------------------------------------------------------
# Issue 19: a model whose first output is auxiliary: --logits-output chooses the logits
# --------------------------------------------------------------------------------------------
def _two_output_model(path, names=("features", "logits")):
    """x [N, 4] -> (features = x @ F [N, 8], logits = x @ L [N, 5]), seeded weights."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "F"], [names[0]], name="feat"),
         helper.make_node("MatMul", ["x", "L"], [names[1]], name="head")], "g",
        [helper.make_tensor_value_info("x", 1, ["N", 4])],
        [helper.make_tensor_value_info(n, 1, ["N", w]) for n, w in zip(names, (8, 5))],
        [numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "F"),
         numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "L")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


def _two_output_data(path, ref_names=("features", "logits")):
    """Own-data samples with the model's true outputs as the reference and the logits' argmax
    as labels, so top-1 is 100 % on the logits and not on the features."""
    x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    with OrtRunner(path) as r:
        out = r.infer({"x": x})
    feats, logits = out[list(out)[0]], out[list(out)[1]]
    return EvalData(feed={"x": x}, ref=dict(zip(ref_names, (feats, logits))),
                    y=logits.argmax(1).astype(np.int64))


def _eval_sel(path, data, sel, capsys):
    with OrtRunner(path) as r:
        rec, _ = evaluate(r, data, stage="3_onnx_eval", precision="FP32", model="review:two",
                          tag="ort_two", args=argparse.Namespace(logits_output=sel),
                          started=time.time(), iters=3, warmup=1, write=False)
    return rec, capsys.readouterr().err


def test_logits_output_chooses_the_output_accuracy_and_parity_come_from(tmp_path, capsys):
    m = _two_output_model(tmp_path / "two.onnx")
    default, _ = _eval_sel(m, _two_output_data(m), None, capsys)
    # the default is unchanged: the first output (here the features) is scored, and named
    assert default["logits_output"]["output"] == "features"
    assert "default" in default["logits_output"]["selected_by"]
    for sel in ("logits", 1):
        rec, err = _eval_sel(m, _two_output_data(m), sel, capsys)
        assert rec["accuracy"]["top1"] == 100.0 != default["accuracy"]["top1"]
        assert rec["parity"] == rec["parity_outputs"]["logits"]
        assert rec["logits_output"] == {"output": "logits", "reference": "logits",
                                        "selected_by": f"--logits-output {sel}",
                                        "matched_by": "name"}
        assert "WARNING" not in err


def test_logits_output_matches_by_index_with_a_warning_naming_both(tmp_path, capsys):
    """Stage 2 exported (output_0, output_1) while the reference stores (features, logits)."""
    m = _two_output_model(tmp_path / "two.onnx", names=("output_0", "output_1"))
    rec, err = _eval_sel(m, _two_output_data(m), "logits", capsys)
    assert rec["logits_output"]["output"] == "output_1"
    assert rec["logits_output"]["matched_by"] == "index"
    assert rec["accuracy"]["top1"] == 100.0
    (warn,) = [ln for ln in err.splitlines() if "--logits-output" in ln]
    assert "'output_1' (index 1)" in warn and "reference's 'logits'" in warn


@pytest.mark.parametrize("sel, needle", [("nope", "no output of the model or of the reference "
                                          "has that name (outputs: 0: features, 1: logits"),
                                         (2, "the model has 2 output(s)")])
def test_logits_output_that_names_nothing_is_a_usage_error(tmp_path, sel, needle):
    m = _two_output_model(tmp_path / "two.onnx")
    data = _two_output_data(m)
    data.logits_output = sel
    with OrtRunner(m) as r:
        out = r.infer(data.feed)
    with pytest.raises(UsageError, match=re.escape(needle)):
        score(data, out)


def test_logits_output_flag_reads_names_indices_and_the_environment(monkeypatch):
    stage = load_stage("3_onnx_eval")
    args = ["--onnx", "x.onnx", "--tag", "t"]
    assert stage.get_args_parser().parse_args(args).logits_output is None
    assert stage.get_args_parser().parse_args(args + ["--logits-output", "1"]).logits_output == 1
    monkeypatch.setenv("LOGITS_OUTPUT", "logits")
    assert stage.get_args_parser().parse_args(args).logits_output == "logits"
    with pytest.raises(SystemExit):
        stage.get_args_parser().parse_args(args + ["--logits-output", " "])
