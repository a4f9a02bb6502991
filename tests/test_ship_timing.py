"""The verdict's interleaved re-timing of CPU EP rows (deploykit.ship_timing, 8_report.py
--retime): the loop's order, which rows it applies to, and that the verdict ranks and words the
rows by it. Rows are synthetic; the files they measured are tiny ONNX models made here."""
from __future__ import annotations

import argparse
import hashlib
import json
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit import ship_timing
from deploykit.envinfo import device_info
from deploykit.timing import interleaved_times
from deploykit.verdict import INTERLEAVED, Budget, render_verdicts, verdicts
from tests.helpers.stages import load_stage


def test_interleaved_times_warms_up_then_rotates_the_order_every_round():
    log: list[str] = []
    calls = {n: (lambda n=n: log.append(n)) for n in "abc"}
    times = interleaved_times(calls, rounds=4, iters=2, warmup=1)
    assert log[:3] == ["a", "b", "c"]  # one warm-up run each
    rounds = ["".join(log[3 + 6 * r: 3 + 6 * (r + 1)]) for r in range(4)]
    assert rounds == ["aabbcc", "bbccaa", "ccaabb", "aabbcc"]
    assert {k: len(v) for k, v in times.items()} == {"a": 8, "b": 8, "c": 8}
    assert all(t >= 0 for v in times.values() for t in v)
    with pytest.raises(ValueError):
        interleaved_times({}, rounds=1, iters=1)


def _onnx(path: Path, depth: int) -> Path:
    """``x [N, 64] -> depth x (MatMul 64x64) -> y``: a file ORT can time."""
    w = numpy_helper.from_array(np.eye(64, dtype=np.float32), "w")
    nodes, cur = [], "x"
    for i in range(depth):
        nodes.append(helper.make_node("MatMul", [cur, "w"], [f"t{i}"]))
        cur = f"t{i}"
    nodes.append(helper.make_node("Identity", [cur], ["y"]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                    ["N", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])],
                          [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


def _row(tag, path: Path, p50: float, precision="FP32", device=None, **kw) -> dict:
    """An ok CPU EP row of ``path`` (its SHA-256 recorded as stage 3 does) with batch-1 p50."""
    return {"stage": "3_onnx_eval", "backend": "ORT", "precision": precision, "model": "m",
            "tag": tag, "status": "ok", "ep_used": "CPUExecutionProvider", "onnx": str(path),
            "accuracy": {"top1": 70.0}, "parity": {"cosine_mean": 1.0, "top1_agreement": 100.0},
            "latency": {"end_to_end_ms": {"p50_ms": p50}},
            "runtime": {"opt_level": "all", "disabled_optimizers": [], "session_config": {},
                        "threads": None},
            "measured_against": {"evaluated": {"path": str(path), "sha256": hashlib.sha256(
                path.read_bytes()).hexdigest()}},
            "provenance": {"time_utc": "2026-12-06T00:00:00Z",
                           "device": device or device_info()}, **{"size_mb": 1.0, **kw}}


@pytest.fixture
def rows(tmp_path):
    """PyTorch reference, ORT FP32 (row p50 5 ms) and a second ORT FP32 row (row p50 4 ms: it ranks first by
    the rows' own figures); both files exist."""
    a, b = _onnx(tmp_path / "fp32.onnx", 1), _onnx(tmp_path / "fp16.onnx", 2)
    ref = {"stage": "1_pytorch_baseline", "backend": "PyTorch", "precision": "FP32",
           "tag": "pytorch_fp32_cpu", "status": "ok", "accuracy": {"top1": 70.0},
           "parity": {}, "latency": {"end_to_end_ms": {"p50_ms": 9.0}}}
    return [ref, _row("ort_fp32", a, 5.0), _row("ort_fp32_noopt", b, 4.0, size_mb=0.5)]


def _record(rows, ms: dict) -> dict:
    return {"device": device_info(), "rows": {
        r["tag"]: {"p50_ms": ms[r["tag"]], "onnx": r["onnx"],
                   "sha256": r["measured_against"]["evaluated"]["sha256"],
                   "row_time_utc": r["provenance"]["time_utc"]} for r in rows if r["tag"] in ms}}


def test_the_verdict_ranks_by_the_interleaved_timing_and_says_when_the_rows_disagree(rows):
    (v,) = verdicts(rows, Budget())
    assert v["ship"]["tag"] == "ort_fp32_noopt" and v["interleaved"] is False
    assert ship_timing.annotate(rows, _record(rows, {"ort_fp32": 7.0, "ort_fp32_noopt": 9.0})) == [
        "ort_fp32", "ort_fp32_noopt"]
    (v,) = verdicts(rows, Budget())
    assert v["ship"]["tag"] == "ort_fp32" and v["interleaved"] is True
    md = render_verdicts([v], Budget())
    assert "ship `ort_fp32`" in md and "interleaved p50 7.000 ms" in md
    assert "put `ort_fp32_noopt` first" in md  # the rows' own p50s ranked them the other way
    other_line = next(x for x in md.splitlines() if x.strip().startswith("- `ort_fp32_noopt`"))
    # the other row is compared with the shipped one on the same (interleaved) figures
    assert "1.29x slower" in other_line and "within budget but slower" in other_line


def test_a_record_applies_only_to_the_rows_it_measured_on_its_kind_of_machine(rows):
    rec = _record(rows, {"ort_fp32": 7.0, "ort_fp32_noopt": 9.0})
    changed = json.loads(json.dumps(rec))
    changed["rows"]["ort_fp32_noopt"]["sha256"] = "0" * 64  # file remade since
    assert ship_timing.annotate(rows, changed) == []
    assert not any(INTERLEAVED in r for r in rows)  # one valid row ranks nothing: all or none
    rerun = json.loads(json.dumps(rec))
    rerun["rows"]["ort_fp32"]["row_time_utc"] = "2026-12-07T00:00:00Z"  # the row was rerun
    assert ship_timing.annotate(rows, rerun) == []
    other = dict(rec, device={**device_info(), "cpu": "another CPU"})
    assert ship_timing.annotate(rows, other) == []
    assert ship_timing.annotate(rows, None) == []
    assert ship_timing.annotate(rows, rec) == ["ort_fp32", "ort_fp32_noopt"]
    assert verdicts(rows, Budget())[0]["ship"]["tag"] == "ort_fp32"


def test_retime_runs_each_file_as_its_row_did_and_its_record_ranks_the_verdict(
        rows, monkeypatch):
    import deploykit.models

    monkeypatch.setattr(deploykit.models, "model_spec",
                        lambda m: types.SimpleNamespace(classifier=False))
    rows[2]["latency"]["batch"] = 2  # timed at batch 2: re-timed at batch 2
    rec = ship_timing.retime(rows, Budget(), "m", rounds=3, iters=4, warmup=1)
    assert set(rec["rows"]) == {"ort_fp32", "ort_fp32_noopt"}
    assert {t: e["batch"] for t, e in rec["rows"].items()} == {"ort_fp32": 1,
                                                               "ort_fp32_noopt": 2}
    for tag, ent in rec["rows"].items():
        row = next(r for r in rows if r["tag"] == tag)
        assert ent["sha256"] == row["measured_against"]["evaluated"]["sha256"]
        assert ent["row_p50_ms"] == row["latency"]["end_to_end_ms"]["p50_ms"]
        assert len(ent["round_p50_ms"]) == 3 and ent["p50_ms"] > 0
    assert rec["input"].startswith("seeded random") and rec["device"] == device_info()
    assert ship_timing.annotate(rows, rec) == ["ort_fp32", "ort_fp32_noopt"]
    v = verdicts(rows, Budget())[0]
    assert v["interleaved"] is True
    fast = min(rec["rows"], key=lambda t: rec["rows"][t]["p50_ms"])
    assert v["ship"]["tag"] == fast
    # rows measured on another kind of machine are not re-timed here
    for r in rows[1:]:
        r["provenance"]["device"] = {**device_info(), "cpu": "another CPU"}
    assert ship_timing.retime(rows, Budget(), "m", rounds=1, iters=1) is None


def test_candidates_need_two_rows_whose_files_are_here(rows):
    assert [r["tag"] for r in ship_timing.candidates(rows, Budget())] == ["ort_fp32", "ort_fp32_noopt"]
    Path(rows[2]["onnx"]).unlink()
    assert ship_timing.candidates(rows, Budget()) == []


def _report(monkeypatch, tmp_path, classifier: bool = False, rounds: int = 2):
    """8_report as a module, a results folder, and a model spec stand-in (the tiny rows'
    model "m" is no registered model)."""
    import deploykit.models

    monkeypatch.setattr(deploykit.models, "model_spec",
                        lambda m: types.SimpleNamespace(classifier=classifier))
    monkeypatch.setattr(ship_timing, "ROUNDS", rounds)
    folder = tmp_path / "res"
    folder.mkdir()
    return load_stage("8_report"), folder


def test_report_retime_writes_the_record_and_a_later_report_reuses_it(rows, tmp_path,
                                                                     monkeypatch):
    """8_report.py --retime times, writes ship_timing.json and ranks by it; a report without
    the flag reads the record back while the rows are unchanged."""
    report, folder = _report(monkeypatch, tmp_path)
    args = argparse.Namespace(model="m", retime=True)
    report._ship_timing(args, rows, Budget(), folder)
    rec = json.loads((folder / ship_timing.FILE).read_text())
    assert set(rec["rows"]) == {"ort_fp32", "ort_fp32_noopt"} and rec["rounds"] == 2
    for r in rows:
        r.pop(INTERLEAVED, None)
    report._ship_timing(argparse.Namespace(model="m", retime=False), rows, Budget(), folder)
    assert {r["tag"]: r.get(INTERLEAVED) for r in rows[1:]} == {
        t: e["p50_ms"] for t, e in rec["rows"].items()}


def test_a_failed_retime_or_a_damaged_record_leaves_the_rows_own_ranking(rows, tmp_path,
                                                                         monkeypatch, capsys):
    """The report is always written: a re-timing that fails (here a classifier whose eval
    images are not in this ARTIFACTS folder, as in the review), or an unreadable record, makes
    the verdict rank by the rows' own p50s, with a WARNING."""
    report, folder = _report(monkeypatch, tmp_path, classifier=True)
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "elsewhere"))
    report._ship_timing(argparse.Namespace(model="m", retime=True), rows, Budget(), folder)
    assert "WARNING: ship timing failed" in capsys.readouterr().err
    assert not (folder / ship_timing.FILE).exists()
    assert verdicts(rows, Budget())[0]["ship"]["tag"] == "ort_fp32_noopt"  # rows' own p50s
    (folder / ship_timing.FILE).write_text("{not json")
    report._ship_timing(argparse.Namespace(model="m", retime=False), rows, Budget(), folder)
    assert "ignored" in capsys.readouterr().err
    assert not any(INTERLEAVED in r for r in rows)


def test_a_record_covering_only_some_rows_within_budget_ranks_nothing_and_words_nothing(rows):
    """Review finding: the record covered two of three rows within budget; the ranking fell
    back to the rows' own p50s while the words used the record, and the shipped row was called
    slower than the baseline. Now one footing per group."""
    c = _onnx(Path(rows[1]["onnx"]).with_name("c.onnx"), 3)
    rows.append(_row("ort_fp32_threads1", c, 4.5, size_mb=0.8))
    ship_timing.annotate(rows, _record(rows, {"ort_fp32": 4.0, "ort_fp32_noopt": 4.5}))
    (v,) = verdicts(rows, Budget())
    assert v["interleaved"] is False and v["ship"]["tag"] == "ort_fp32_noopt"  # own: 4.0 ms
    md = render_verdicts([v], Budget())
    # no figure of the record is used anywhere
    assert "interleaved p50" not in md and "interleaved re-timing in one" not in md
    ship_line = next(x for x in md.splitlines() if "ship `" in x)
    assert "1.25x vs ORT FP32 = 1.25x faster" in ship_line  # 5.0 / 4.0, the rows' own


def test_candidates_skip_a_row_whose_file_was_remade(rows):
    Path(rows[2]["onnx"]).write_bytes(Path(rows[2]["onnx"]).read_bytes() + b" ")
    assert ship_timing.candidates(rows, Budget()) == []


def test_a_retime_with_nothing_to_time_removes_the_earlier_record(rows, tmp_path, monkeypatch):
    report, folder = _report(monkeypatch, tmp_path, rounds=1)
    report._ship_timing(argparse.Namespace(model="m", retime=True), rows, Budget(), folder)
    assert (folder / ship_timing.FILE).exists()
    Path(rows[2]["onnx"]).unlink()  # one row left to choose from
    report._ship_timing(argparse.Namespace(model="m", retime=True), rows, Budget(), folder)
    assert not (folder / ship_timing.FILE).exists()
    assert not any(INTERLEAVED in r for r in rows)


def test_retime_of_a_model_with_its_own_data_times_stage_1s_samples(rows, tmp_path,
                                                                   monkeypatch):
    """A custom model's rows were timed on its own samples: the re-timing takes them from
    stage 1's ref_outputs.npz (not seeded random inputs) and says so."""
    import deploykit.models
    from deploykit.feeds import REF_INPUT_PREFIX
    from deploykit.layout import ref_outputs_path

    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "art"))
    monkeypatch.setattr(deploykit.models, "model_spec",
                        lambda m: types.SimpleNamespace(classifier=False))
    ref = ref_outputs_path("m")
    ref.parent.mkdir(parents=True)
    np.savez(ref, **{f"{REF_INPUT_PREFIX}x": np.ones((5, 64), np.float32),
                     "y": np.ones((5, 64), np.float32)})
    rec = ship_timing.retime(rows, Budget(), "m", rounds=1, iters=2, warmup=0)
    assert rec["input"] == f"the first samples of {ref}"


def test_without_the_baselines_figure_the_group_is_not_ranked_by_the_record(rows):
    """Second review: every row within budget re-timed but the ORT FP32 baseline not (rerun
    since, or out of budget): ranking by the record and speedups by the rows' own p50s
    contradicted each other. Now the group needs the baseline's figure too."""
    c = _onnx(Path(rows[1]["onnx"]).with_name("c.onnx"), 3)
    rows.append(_row("ort_fp32_threads1", c, 4.5, size_mb=0.8))
    rec = _record(rows, {"ort_fp32": 6.0, "ort_fp32_noopt": 3.0, "ort_fp32_threads1": 2.0})
    rec["rows"]["ort_fp32"]["row_time_utc"] = "2026-12-07T00:00:00Z"  # baseline rerun since
    assert ship_timing.annotate(rows, rec) == ["ort_fp32_noopt", "ort_fp32_threads1"]
    (v,) = verdicts(rows, Budget())
    assert v["interleaved"] is False and v["ship"]["tag"] == "ort_fp32_noopt"  # own: 4.0 ms
    assert "interleaved p50" not in render_verdicts([v], Budget())


def test_the_verdict_says_when_the_re_timing_fed_synthetic_inputs(rows):
    rec = dict(_record(rows, {"ort_fp32": 7.0, "ort_fp32_noopt": 9.0}),
               input="seeded random inputs (synthetic)")
    ship_timing.annotate(rows, rec)
    md = render_verdicts(verdicts(rows, Budget()), Budget())
    assert "p50, on seeded random inputs (synthetic)" in md
    ship_timing.annotate(rows, dict(rec, input="the first eval images"))
    assert "synthetic" not in render_verdicts(verdicts(rows, Budget()), Budget())
