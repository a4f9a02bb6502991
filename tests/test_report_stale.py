"""The report's stale rows (deploykit.report.stale_reasons / deploykit.results.staleness) and
the warning for rows of several ARTIFACTS folders: synthetic rows that record the hashes of real
small files in tmp_path, whose contents the tests then change."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from deploykit.io import write_json
from deploykit.layout import ROOT
from deploykit.report import (artifacts_warning, is_stale, load_rows, render_markdown,
                              stale_reasons,
                              stale_section, summary, table_rows)
from deploykit.results import staleness

MODEL = "m"


def _entry(p: Path) -> dict:
    return {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


def _row(tag, against, backend="ORT", precision="INT8", agree=99.0, root="/art/a", **kw):
    return {"stage": "3_onnx_eval", "backend": backend, "precision": precision, "model": MODEL,
            "tag": tag, "status": "ok", "reason": None, "n_images": 10,
            "accuracy": {"top1": 70.0, "top5": 90.0},
            "parity": {"cosine_mean": 0.999, "top1_agreement": agree},
            "latency": {"end_to_end_ms": {"p50_ms": 1.0, "mean_ms": 1.0, "fps": 1000.0}},
            "measured_against": against,
            "provenance": {"command": f"3_onnx_eval.py --tag {tag} --onnx 'a b.onnx'",
                           "artifacts_root": root, "device": {"cpu": "test cpu"},
                           "versions": {}}, **kw}


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    f = {}
    for name in ("ref_logits.npz", "fp32.onnx", "int8.onnx", "int8b.onnx", "calib.npz"):
        f[name] = tmp_path / name
        f[name].write_bytes(name.encode())
    return f


def _record(folder, name, output):
    """A stage 5 record (``quant_<variant>.json``) whose ``source.output`` names ``output``."""
    write_json(folder / name, {"stage": "5_quantize", "status": "ok",
                               "source": {"output": _entry(output), "fp32": None,
                                          "calibration": None, "onnx": None,
                                          "made_by": ["python 5_quantize.py --model m int8"]}})


def _write(rows, tmp_path):
    folder = tmp_path / "r" / MODEL
    for r in rows:
        write_json(folder / f"{r['tag']}.json", r)
    return folder


def test_changed_reference_or_calibration_makes_a_row_stale_and_names_the_rerun(files, tmp_path):
    ref, fp32, calib = files["ref_logits.npz"], files["fp32.onnx"], files["calib.npz"]
    src = {"record": "quant_int8.json", "made_by": ["python 5_quantize.py --model m int8"]}
    rows = [_row("ort_int8", {"reference": _entry(ref), "evaluated": _entry(files["int8.onnx"]),
                              "fp32": _entry(fp32), "calibration": _entry(calib)},
                 agree=99.5, source=src),
            _row("ort_int8b", {"reference": _entry(ref),
                               "evaluated": _entry(files["int8b.onnx"])}, agree=98.0),
            _row("ort_old", None, agree=99.9)]  # a committed row without hashes: unknown
    rows[2].pop("measured_against")
    folder = _write(rows, tmp_path)
    for name in ("int8", "int8b"):  # the producer records that name both files
        _record(folder, f"quant_{name}.json", files[f"{name}.onnx"])
    assert not any(is_stale(r) for r in load_rows(folder))
    calib.write_bytes(b"rewritten by a stage 4 rerun")
    loaded = {r["tag"]: r for r in load_rows(folder)}
    (why,) = stale_reasons(loaded["ort_int8"])
    assert why.startswith(f"the calibration data the file evaluated was made from {calib} "
                          "has changed")
    # the producer first, then this row's own command, shell-quoted as recorded
    # (a row written before the full rerun record: its command, run in the repository root)
    assert why.endswith(f"rerun python 5_quantize.py --model m int8 && cd {ROOT} && "
                        f"ARTIFACTS=/art/a RESULTS={(tmp_path / 'r').resolve()} python "
                        "3_onnx_eval.py --tag ort_int8 --onnx 'a b.onnx'")
    assert not is_stale(loaded["ort_int8b"]) and not is_stale(loaded["ort_old"])
    ref.write_bytes(b"stage 1 rerun with other weights")
    rows = load_rows(folder)
    stale = {r["tag"] for r in rows if is_stale(r)}
    assert stale == {"ort_int8", "ort_int8b"}
    trs = {t["tag"]: t for t in table_rows(rows)}
    assert trs["ort_int8b"]["status"].startswith("STALE (see Stale rows) ok")
    assert not trs["ort_old"]["status"].startswith("STALE")
    line = summary(MODEL, rows, Path("REPORT.md"))
    # stale rows are neither counted nor chosen: the best is the only current INT8 row
    assert "1 ok" in line and "2 stale (not counted: ort_int8, ort_int8b" in line
    assert "best quantized row ort_old" in line
    md = render_markdown(MODEL, rows, None)
    assert "Stale rows (" in md and "- ort_int8b: the PyTorch reference" in md


def test_missing_recorded_file_is_unknown_not_stale(files):
    row = _row("t", {"reference": {"path": "/nowhere/ref.npz", "sha256": "0" * 64}})
    assert staleness(row) == [] and stale_section([row]) == ""


def test_stale_source_recorded_at_measurement_stays_stale(files):
    row = _row("t", {"evaluated": _entry(files["int8.onnx"])},
               stale_source="it was made from an fp32.onnx with sha256 abc",
               source={"made_by": ["python 5_quantize.py"]})
    (why,) = staleness(row)
    assert why.startswith("measured a stale file: it was made from") and "5_quantize" in why


def test_rows_of_two_artifacts_folders_are_named(files, tmp_path):
    rows = [_row("ort_a", {}, root="/art/a"), _row("ort_b", {}, root="/art/b"),
            _row("gpu", {}, root="/elsewhere", _source="results/gpu/m")]
    warn = artifacts_warning(MODEL, rows)
    assert "/art/a (ort_a)" in warn and "/art/b (ort_b)" in warn and "gpu" not in warn
    assert artifacts_warning(MODEL, rows[:1] + rows[2:]) is None
    assert warn in render_markdown(MODEL, rows[:2], None)


# --------------------------------------------------------------------------------------------
# Issue 19: a row whose file no current record names, or whose recorded file is gone, is
# never the row to ship
# --------------------------------------------------------------------------------------------
def _pipeline_rows(tmp_path):
    """A PyTorch reference row, an ORT FP32 row (10 ms) and a faster INT8 ``warn`` row (2 ms,
    within the default budget) of files in this run's ARTIFACTS folder."""
    onnx = tmp_path / "a" / MODEL / "onnx"
    onnx.mkdir(parents=True)
    ref = tmp_path / "a" / MODEL / "ref_logits.npz"
    fp32, int8 = onnx / "fp32.onnx", onnx / "int8.onnx"
    for p in (ref, fp32, int8):
        p.write_bytes(p.name.encode())
    root = str((tmp_path / "a").resolve())
    pt = _row("pytorch_fp32_cpu", {"reference": _entry(ref)}, backend="PyTorch",
              precision="FP32", root=root)
    f32 = _row("ort_fp32", {"reference": _entry(ref), "evaluated": _entry(fp32)},
               precision="FP32", agree=100.0, root=root, variant="fp32")
    f32["latency"]["end_to_end_ms"]["p50_ms"] = 10.0
    i8 = _row("ort_int8", {"reference": _entry(ref), "evaluated": _entry(int8)}, agree=99.5,
              root=root, variant="int8", status_reason="logits cosine_mean 0.97 < 0.98")
    i8["status"] = "warn"
    i8["latency"]["end_to_end_ms"]["p50_ms"] = 2.0
    return [pt, f32, i8], int8


def _ship(rows):
    from deploykit.verdict import Budget, verdicts

    (v,) = verdicts(rows, Budget())
    return v["ship"]["tag"] if v["ship"] else None, v


def test_a_warn_row_of_a_file_no_record_names_is_stale_and_never_shipped(files, tmp_path):
    rows, int8 = _pipeline_rows(tmp_path)
    folder = _write(rows, tmp_path)
    loaded = load_rows(folder)
    ship, v = _ship(loaded)
    assert ship == "ort_fp32", ship  # not the faster INT8 row: nothing says what it came from
    (why,) = stale_reasons(next(r for r in loaded if r["tag"] == "ort_int8"))
    assert f"names the file evaluated {int8}" in why
    # the stage that remakes it (and records it), then this row's own command
    assert why.index("bash 5_quantize.sh --model m int8") < why.index("3_onnx_eval.py --tag")
    j = dict((r["tag"], j) for r, j in v["judged"])["ort_int8"]
    assert not j.eligible and j.why.startswith("stale: no current record")
    md = render_markdown(MODEL, loaded, None)
    assert "- ort_int8: no current record" in md and "ship `ort_int8`" not in md
    assert not is_stale(next(r for r in loaded if r["tag"] == "ort_fp32"))
    # once stage 5's record names the file, the same row is current and the faster one ships
    _record(folder, "quant_int8.json", int8)
    ship, _ = _ship(load_rows(folder))
    assert ship == "ort_int8"
    # after a re-quantization the record names another file: the row is stale again
    _record(folder, "quant_int8.json", files["int8b.onnx"])
    ship, _ = _ship(load_rows(folder))
    assert ship == "ort_fp32"


def test_a_row_whose_file_was_set_aside_is_stale_not_unknown(files, tmp_path):
    """A re-export whose FP16 check failed moves fp16.onnx to fp16.stale.onnx: the row of the
    old file must not stay 'unknown' (and shippable) because its file is no longer there."""
    rows, int8 = _pipeline_rows(tmp_path)
    folder = _write(rows, tmp_path)
    _record(folder, "quant_int8.json", int8)
    assert _ship(load_rows(folder))[0] == "ort_int8"
    int8.rename(int8.with_name("int8.stale.onnx"))
    loaded = load_rows(folder)
    assert _ship(loaded)[0] == "ort_fp32"
    (why,) = stale_reasons(next(r for r in loaded if r["tag"] == "ort_int8"))
    assert why.startswith(f"the file evaluated {int8} is gone") and "5_quantize.sh" in why
    # the same file path recorded by another ARTIFACTS folder's row stays unknown
    other = dict(rows[2], provenance=dict(rows[2]["provenance"], artifacts_root="/art/other"))
    assert staleness(other) == []


def test_budget_line_says_when_the_reference_has_random_weights():
    from deploykit.sweep.spec import Budget
    from deploykit.verdict import budget_text

    ref = {"tag": "pytorch_fp32_cpu", "accuracy": None}
    assert "random weights" not in budget_text(Budget(), ref)
    text = budget_text(Budget(), {**ref, "weights": "random-init"})
    assert "random weights (--random-init): no accuracy claim" in text


def test_the_verdict_names_why_a_row_is_stale_but_leaves_its_commands_whole_to_stale_rows(
        monkeypatch):
    """A rerun command cut at a fixed width left an unbalanced quote in the Verdict."""
    import deploykit.verdict as verdict
    from deploykit.sweep.spec import Budget

    cmd = "cd /repo && PYTHONPATH='/tmp/it'\"'\"'s $(touch x)' python 3_onnx_eval.py"
    monkeypatch.setattr(verdict, "staleness", lambda r: [
        f"the reference /a/ref.npz has changed since this row was measured: rerun {cmd}"])
    j = verdict.judge_row({"tag": "ort_fp32", "status": "ok"}, None, Budget())
    assert not j.eligible
    assert j.why == ("stale: the reference /a/ref.npz has changed since this row was measured "
                     "(the commands that remake it: Stale rows, below)")
    long = "; ".join(f"reason {i} with words" for i in range(40))
    from deploykit.errors import clip_text

    clipped = clip_text(long, 100)
    assert len(clipped) <= 104 and clipped.endswith(" ...") and "; reason" in clipped
    assert clip_text("short", 100) == "short"
    # a multi-line message (ORT, torch) is one line: a markdown table row must not break
    assert clip_text("ORT failed:\n  node | Conv_3\n  more", 100) == "ORT failed: node | Conv_3 more"


def test_the_data_line_tells_a_first_look_row_from_a_limit_row():
    """A row failed on its first look ran on fewer images than the split, but not by --limit:
    each such row with its own look size (in numeric order), and a first-look row of a --limit
    run still counts as a --limit row by the size of its split."""
    data = {"n_eval": 900, "layout": "flat", "data_root": "d", "n_calib": 100,
            "preprocessing": {}}
    full = _row("ort_fp32", {}, precision="FP32", n_images=900)

    def looked(tag, n, n_total=900):
        return _row(tag, {}, n_images=n, status="failed",
                    first_look={"n": n, "n_total": n_total, "decided": "failed"})

    rows = [full, looked("ort_mid", 128), looked("ort_baseline", 32)]
    line = render_markdown(MODEL, rows, data).split("Data: ", 1)[1].split("\n")[0]
    assert "`ort_baseline` on 32 of 900, `ort_mid` on 128 of 900" in line
    assert "--full-eval" in line and "--limit" not in line
    line = render_markdown(MODEL, [*rows, looked("ort_lim", 32, 300), _row("ort_int8", {},
                                                                         n_images=64)],
                           data).split("Data: ", 1)[1].split("\n")[0]
    assert "`ort_lim` on 32 of 300" in line and "fewer images (64, 300: --limit)" in line
