"""Stage 8 (8_report.py): rows in the shared schema become the table, speedups, GPU rows, plots,
the console summary, status texts and refused or wrongly typed rows."""

from __future__ import annotations
import json
from pathlib import Path

import pytest

from deploykit.report import gpu_table, markdown_table, row_sort_key
from deploykit.evaluate import base_record
from deploykit.io import write_json
from deploykit.results import result_record
from deploykit.sweep.report import p50_ms

from tests.helpers.stages import load_stage, run_stage
from tests.helpers.artifacts import _stage3
from tests.helpers.run_all import _env, _good_row


report = load_stage("8_report")


# --------------------------------------------------------------------------------- report
def test_report_shows_int8_macs_beside_agreement(tmp_path):
    rows = [base_record("t", "FP32", "m", "pytorch_fp32_cpu",
                                 {"backend": "PyTorch", "device": "cpu"},
                                 accuracy={"top1": 88.0, "top5": 97.0}, n_images=675),
            base_record("t", "INT8", "m", "ort_int8_auto",
                                 {"backend": "ORT", "device": "cpu"},
                                 accuracy={"top1": 87.5, "top5": 97.0},
                                 parity={"cosine_mean": 0.999, "top1_agreement": 99.6},
                                 n_images=675)]
    folder = tmp_path / "m"  # results/<model>/: rows name their model
    for r in rows:
        write_json(folder / f"{r['tag']}.json", r)
    write_json(folder / "quant_int8_auto.json",
                      {"macs": {"int8_fraction": 0.9123}, "check": {"summary": "check: clean"}})
    t = {r["tag"]: r for r in report.table_rows(report.load_rows(folder))}
    assert t["ort_int8_auto"]["INT8 MACs %"] == "91.2"
    assert t["pytorch_fp32_cpu"]["INT8 MACs %"] == ""
    cols = report.COLUMNS
    assert cols.index("top-1 agree %") == cols.index("top-1 %") + 1
    md = report.render_markdown("m", report.load_rows(folder), {"n_eval": 675, "n_tune": 225})
    assert "225 more images" in md and "[auto_precision.md](auto_precision.md)" in md


def test_long_reasons_are_cut_between_words_with_an_ellipsis(tmp_path):
    """The report cut a row's reason and a TensorRT build's detail at a fixed width, mid-word
    ("...requires TensorRT 10.x; installe"); the whole text stays in the row's JSON."""
    words = " ".join(f"word{i:03d}" for i in range(80))  # 639 characters, no clause breaks
    folder = tmp_path / "m"
    build = result_record("6_build_engines", "TensorRT", "INT8", "m", "trt_build_int8",
                          status="skipped", reason="trtexec not found: " + words)
    row = base_record("t", "FP32", "m", "ort_fp32", {"backend": "ORT", "device": "cpu"},
                      accuracy=None, n_images=0)
    row.update(status="skipped", reason="no data: " + words)
    for r in (build, row):
        write_json(folder / f"{r['tag']}.json", r)
    md = report.render_markdown("m", report.load_rows(folder), None)
    build_line = next(ln for ln in md.splitlines() if ln.startswith("| int8 |"))
    detail = build_line.split(" | ")[2].removesuffix(" |")
    assert detail.endswith(" ...") and len(detail) <= 204
    assert all(w.startswith("word") and len(w) == 7 for w in detail[:-4].split()[4:]), detail
    row_line = next(ln for ln in md.splitlines() if "no data: word000" in ln)
    shown = row_line.split("no data: ", 1)[1].split(" ...", 1)[0]
    assert all(len(w) == 7 for w in shown.split()), shown  # no word cut short
    assert " ..." in row_line


def test_a_row_timed_on_a_busy_machine_is_marked_in_its_status_and_under_the_table(tmp_path):
    """The mean-vs-p50 check cannot see a loop slowed evenly by another process: the row's
    other_cpu record (deploykit.timing.OtherCpu) can."""
    folder = tmp_path / "m"
    for tag, cores in (("pytorch_fp32_cpu", 1.1), ("ort_fp32", 0.02)):
        r = base_record("t", "FP32", "m", tag, {"backend": "PyTorch" if tag[0] == "p" else "ORT",
                                                "device": "cpu"},
                        accuracy={"top1": 88.0, "top5": 97.0}, n_images=900)
        r["latency"] = {"batch": 1, "iters": 200, "end_to_end_ms": {
            "p50_ms": 9.0, "mean_ms": 9.2, "p90_ms": 9.5, "p99_ms": 9.9},
            "other_cpu": {"cores": cores, "steal_cores": 0.0, "of_cores": 2, "seconds": 1.8}}
        write_json(folder / f"{tag}.json", r)
    rows = report.load_rows(folder)
    status = {t["tag"]: t["status"] for t in report.table_rows(rows)}
    assert "BUSY MACHINE while timed: other processes used 1.10 of the machine's 2" in \
        status["pytorch_fp32_cpu"]
    assert "BUSY" not in status["ort_fp32"]
    md = report.render_markdown("m", rows, None)
    assert "Timed on a busy machine" in md and "`pytorch_fp32_cpu`" in md.split(
        "Timed on a busy machine")[1].splitlines()[0]


MODEL = "efficientnet_lite0"


# ------------------------------------------------------------------------------- report
@pytest.mark.slow
def test_report_names_file_and_field_of_a_wrongly_typed_json_and_keeps_the_rest(env):
    _stage3(env, "fp32.onnx", "ort_fp32")
    res = Path(env["RESULTS"]) / MODEL
    bad = json.loads((res / "ort_fp32.json").read_text())
    bad["tag"] = "ort_fp16"
    bad["accuracy"]["top1"] = "88.4"
    (res / "ort_fp16.json").write_text(json.dumps(bad))
    (res / "ort_int8.json").write_text('{"backend": "ORT", "tag": ')  # truncated JSON
    p = run_stage(["8_report.py", "--model", MODEL], env)
    assert "ort_fp16.json: field accuracy.top1 is str (\"88.4\"), expected" in p.stderr
    assert "ort_int8.json: not valid JSON" in p.stderr
    md = (res / "REPORT.md").read_text()
    assert "| ORT | FP32 | ort_fp32 |" in md  # the good row is still reported
    assert "invalid: ort_fp16.json: field accuracy.top1" in md
    assert "invalid: ort_int8.json: not valid JSON" in md
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith(f"report {MODEL}: ") and "2 invalid" in last
    assert "invalid (see the warnings): ort_fp16.json, ort_int8.json" in last


def test_report_summary_takes_the_good_row_not_a_failed_rerun_beside_it():
    report = load_stage("8_report")

    def row(tag, backend, prec, top1, p50, agree=None, status="ok", file=None):
        r = result_record("x", backend, prec, MODEL, tag, status=status,
                                 reason=None if status == "ok" else "broke")
        r.update(device="cpu", accuracy={"top1": top1, "top5": top1} if top1 else None,
                 latency={"end_to_end_ms": {"p50_ms": p50, "mean_ms": p50, "fps": 1e3 / p50}}
                 if p50 else None, parity={"cosine_mean": 0.99, "top1_agreement": agree}
                 if agree else None, _file=file or f"{tag}.json")
        return r

    rows = [row("pytorch_fp32_cpu", "PyTorch", "FP32", 88.4, 20.0),
            row("ort_int8", "ORT", "INT8", 11.8, 5.0, agree=12.3),
            row("ort_int8_hp32", "ORT", "INT8", 88.3, 8.0, agree=98.6),
            row("ort_int8_hp32", "ORT", "INT8", None, None, status="failed",
                file="ort_int8_hp32.failed.json"),
            row("ort_int4_cli_broken", "ORT", "INT4", None, None, status="failed")]
    rows.sort(key=row_sort_key)
    line = report.summary(MODEL, rows, Path("REPORT.md"))
    assert ("best quantized row ort_int8_hp32 (top-1 88.30%, agreement 98.6%, speedup 2.50x vs "
            "PyTorch FP32)") in line
    assert "failed: ort_int8_hp32 (a rerun; its ok row is kept), ort_int4_cli_broken" in line


def _lat(p50: float, **extra) -> dict:
    block = {"batch": 1, "warmup": 1, "iters": 3,
             "end_to_end_ms": {"p50_ms": p50, "mean_ms": p50, "fps": 1000 / p50},
             "end_to_end_timer": "t", "gpu_compute_ms": None, "gpu_compute_timer": None}
    block.update(extra)
    return block


def _row(tag, backend, precision, device, top1, p50, **kw):
    desc = {"backend": backend, "device": device, "device_name": "X", "ep_used": kw.pop("ep", None)}
    return base_record("t", precision, MODEL, tag, desc, accuracy={"top1": top1, "top5": 99.0},
                                parity={"cosine_mean": 0.999, "top1_agreement": kw.pop("agree", 99.0)},
                                latency=_lat(p50, **kw.pop("lat", {})), size_mb=kw.pop("size", 10.0),
                                n_images=900, **kw)


@pytest.fixture
def rows():
    gpu_lat = {"gpu_compute_ms": {"p50_ms": 1.5}, "cuda_graph_ms": {"p50_ms": 0.5},
               "device_buffers_error": "Fail: not all nodes on CUDA EP"}
    return [
        _row("pytorch_fp32_cpu", "PyTorch", "FP32", "cpu", 88.44, 20.0, reference="x"),
        _row("pytorch_fp32_cuda", "PyTorch", "FP32", "cuda", 88.44, 3.0, lat=gpu_lat,
             runtime={"tf32": {"a": False, "b": True}}),
        _row("ort_fp32", "ORT", "FP32", "cpu", 88.44, 10.0, ep="CPUExecutionProvider"),
        _row("ort_int8", "ORT", "INT8", "cpu", 11.8, 30.0, agree=12.0, size=9.0,
             diagnostics={"backend_cross_check": {"disagreement": True, "top1_unoptimized": 88.3,
                                                  "n": 900}}),
        _row("ort_int8_hp32", "ORT", "INT8", "cpu", 88.3, 8.0, agree=98.6),
        base_record("t", "FP32", MODEL, "trt_fp32", {"backend": "TensorRT", "device": "cuda"},
                             status="skipped", reason="TensorRT is not installed"),
    ]


def test_table_uses_p50_end_to_end_and_same_device_speedup(rows):
    t = {r["tag"]: r for r in report.table_rows(rows)}
    assert t["ort_fp32"]["p50 ms"] == "10.000" and t["ort_fp32"]["speedup vs PyTorch FP32"] == "2.00x"
    assert t["pytorch_fp32_cuda"]["speedup vs PyTorch FP32"] == "1.00x"  # vs the CUDA PyTorch row, not CPU
    assert t["pytorch_fp32_cuda"]["GPU compute p50 ms"] == "1.500"
    assert "BACKEND DISAGREEMENT" in t["ort_int8"]["status"]
    assert "88.3% in the graph's own Q/DQ numerics (900 images)" in t["ort_int8"]["status"]
    assert t["trt_fp32"]["status"].startswith("skipped: TensorRT") and t["trt_fp32"]["p50 ms"] == ""


def test_speedup_divides_the_pytorch_fp32_row_of_the_device_not_a_variant(rows):
    """An FP16 or no-TF32 PyTorch row of the same device listed after the FP32 one must not
    become the reference (it rescaled every CUDA speedup: ORT CUDA EP 5.27x instead of 3.18x)."""
    rows = rows + [
        _row("pytorch_fp16_cuda", "PyTorch", "FP16", "cuda", 88.44, 6.0),
        _row("pytorch_fp32_cuda_notf32", "PyTorch", "FP32", "cuda", 88.44, 4.0),
        _row("ort_fp32_cuda", "ORT", "FP32", "cuda", 88.44, 1.5, ep="CUDAExecutionProvider"),
    ]
    t = {r["tag"]: r for r in report.table_rows(rows)}
    assert t["pytorch_fp32_cuda"]["speedup vs PyTorch FP32"] == "1.00x"
    assert t["pytorch_fp16_cuda"]["speedup vs PyTorch FP32"] == "0.50x"
    assert t["pytorch_fp32_cuda_notf32"]["speedup vs PyTorch FP32"] == "0.75x"
    assert t["ort_fp32_cuda"]["speedup vs PyTorch FP32"] == "2.00x"
    assert t["ort_fp32"]["speedup vs PyTorch FP32"] == "2.00x"


def test_gpu_table_shows_graph_replay_and_why_a_figure_is_missing(rows):
    md = gpu_table(rows)
    line = next(ln for ln in md.splitlines() if "pytorch_fp32_cuda" in ln)
    assert "0.500" in line and "1.500" in line and "n/a: Fail: not all nodes" in line
    assert line.rstrip(" |").endswith("on")  # TF32 state is shown
    assert "ort_fp32" not in md  # CPU rows are not GPU rows


def test_plots_are_written_and_linked(rows, tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path))
    folder = tmp_path / "efficientnet_lite0"
    folder.mkdir()
    for r in rows:
        (folder / f"{r['tag']}.json").write_text(json.dumps(r))
    report.main(report.get_args_parser().parse_args(["--model", "efficientnet_lite0"]))
    assert (folder / "accuracy_latency.png").stat().st_size > 5000
    assert (folder / "size.png").stat().st_size > 2000
    md = (folder / "REPORT.md").read_text()
    assert "![top-1 against batch-1 latency](accuracy_latency.png)" in md
    top = (tmp_path / "REPORT.md").read_text()
    assert "](efficientnet_lite0/accuracy_latency.png)" in top  # the copy one folder up still finds them


def test_console_summary_names_best_recipe_and_failures(rows, tmp_path):
    rows = rows + [base_record("t", "INT4", "m", "ort_int4_cli_broken",
                                        {"backend": "ORT", "device": "cpu"}, status="failed",
                                        reason="x")]
    line = report.summary("m", rows, tmp_path / "REPORT.md")
    assert "5 ok, 1 failed, 1 skipped" in line
    assert "best quantized row ort_int8_hp32" in line and "speedup 2.50x" in line
    assert "failed: ort_int4_cli_broken" in line


def test_gpu_rows_from_results_gpu_join_the_report(rows, tmp_path, monkeypatch):
    """Rows made on a GPU machine (results/gpu/<model>/) appear beside this machine's rows;
    their CPU rows (the GPU machine's own reference run) do not mix into the CPU speedups."""
    monkeypatch.setenv("RESULTS", str(tmp_path))
    here, gpu = tmp_path / "efficientnet_lite0", tmp_path / "gpu" / "efficientnet_lite0"
    here.mkdir()
    gpu.mkdir(parents=True)
    prov = {"device": {"cpu": "EPYC", "cpu_count": 2, "gpu": None}, "versions": {}}
    gprov = {"device": {"cpu": "Xeon", "cpu_count": 16, "gpu": "NVIDIA H200", "driver": "580"},
             "versions": {"onnxruntime-gpu": "1.31.1"}}
    for r in rows[:1] + rows[2:5]:
        (here / f"{r['tag']}.json").write_text(json.dumps(dict(r, provenance=prov)))
    cpu_there = dict(rows[0], provenance=gprov)
    cpu_there["latency"] = _lat(5.0)
    (gpu / "pytorch_fp32_cpu.json").write_text(json.dumps(cpu_there))
    (gpu / "pytorch_fp32_cuda.json").write_text(json.dumps(dict(rows[1], provenance=gprov)))
    report.main(report.get_args_parser().parse_args(["--model", "efficientnet_lite0"]))
    md = (here / "REPORT.md").read_text()
    assert md.count("| PyTorch | FP32 | pytorch_fp32_cuda |") == 1
    assert md.count("| PyTorch | FP32 | pytorch_fp32_cpu |") == 1
    assert "rows from results/gpu/efficientnet_lite0: Xeon (16 cores), GPU: NVIDIA H200 " \
           "(driver 580)" in md
    t = {r["tag"]: r for r in report.table_rows(report.load_rows(here))}
    assert t["ort_fp32"]["speedup vs PyTorch FP32"] == "2.00x"  # still vs this machine's CPU PyTorch row
    report.main(report.get_args_parser().parse_args(["--model", "efficientnet_lite0",
                                                     "--no-gpu-rows"]))
    assert "pytorch_fp32_cuda" not in (here / "REPORT.md").read_text()


def test_status_says_when_fp16_was_computed_in_fp32(rows):
    r = dict(rows[2], precision="FP16", fp16_computed_in="FP32 (ORT CPU EP: Casts ...)")
    assert "FP16 graph computed in FP32 here" in report.table_rows([rows[0], r])[1]["status"]


def test_status_shows_batch_dependence_and_failed_diagnostics(rows):
    r = dict(rows[2], diagnostics={
        "batch_invariance": {"ok": False, "batch": 64, "rel_max_diff": 0.031,
                             "top1_agreement": 0.97},
        "layerwise": {"status": "error", "error": "NameError: name 'art' is not defined"}})
    status = report.table_rows([rows[0], r])[1]["status"]
    assert status.startswith("ok; BATCH-DEPENDENT OUTPUT: batch 1 vs batch 64")
    assert "top-1 agreement 97.0%" in status
    assert "diagnostic layerwise failed: NameError" in status


# ----------------------------------------------------------------- report: rows that are not ours
@pytest.mark.slow
@pytest.mark.parametrize("case", ["list", "status", "tag", "model"])
def test_report_refuses_a_valid_json_that_is_not_this_folders_row(tmp_path, case):
    """Valid JSON that is no row of this folder was shown as one (another model's numbers, a
    row standing in for another tag, status 'weird') or, for a list, silently dropped with a
    'not run: no ort_fp32.json' that named a file which is there."""
    from tests.helpers.stages import run_stage

    env = _env(tmp_path)
    good = _good_row(env)
    res = good.parent
    other = json.loads(good.read_text())
    other.update(backend="ORT", tag="ort_fp32")
    if case == "list":
        other = [other]
    elif case == "status":
        other["status"] = "weird"
    elif case == "tag":
        other["tag"] = "ort_fp16"  # a copy of another row's file
    else:
        other["model"] = "resnet50"  # a row copied from results/resnet50/
    (res / "ort_fp32.json").write_text(json.dumps(other))
    p = run_stage(["8_report.py", "--model", MODEL], env)
    want = {"list": "a JSON list, not a results row",
            "status": "field status is 'weird', expected one of ok, warn, failed, skipped",
            "tag": "field tag is 'ort_fp16' but the file is ort_fp32.json",
            "model": f"field model is 'resnet50' but the folder is {MODEL}/"}[case]
    assert f"{res / 'ort_fp32.json'}: {want}" in p.stderr
    md = (res / "REPORT.md").read_text()
    assert f"| ort_fp32 | cpu |" in md and f"invalid: ort_fp32.json: {want}" in md
    assert not [ln for ln in md.splitlines() if "| ort_fp16 |" in ln and "not run" not in ln]
    assert "| PyTorch | FP32 | pytorch_fp32_cpu |" in md  # the good row is still reported
    assert "1 invalid" in p.stdout and "invalid (see the warnings): ort_fp32.json" in p.stdout


# ------------------------------------------------------------------------ verdict: what to ship
def _cpu_rows(int8_top1=88.30, int8_agree=98.6, int8_p50=8.0, int8_status="ok"):
    """PyTorch FP32 reference, ORT FP32 (10 ms), ORT FP16 (10.5 ms, half size), one INT8 row."""
    return [_row("pytorch_fp32_cpu", "PyTorch", "FP32", "cpu", 88.44, 20.0, reference="x"),
            _row("ort_fp32", "ORT", "FP32", "cpu", 88.44, 10.0, ep="CPUExecutionProvider",
                 agree=100.0, size=18.0),
            _row("ort_fp16", "ORT", "FP16", "cpu", 88.50, 10.5, ep="CPUExecutionProvider",
                 agree=99.6, size=9.0),
            _row("ort_int8_hp32", "ORT", "INT8", "cpu", int8_top1, int8_p50,
                 ep="CPUExecutionProvider", agree=int8_agree, size=18.0, status=int8_status)]


def _write(folder: Path, rows: list[dict]) -> Path:
    for r in rows:
        write_json(folder / f"{r['tag']}.json", r)
    return folder


def _verdict_line(md: str, group: str) -> str:
    (line,) = [ln for ln in md.splitlines() if ln.startswith(f"- **{group}: ")]
    return line


def test_cpu_verdict_ships_ort_fp32_when_every_int8_row_fails_the_budget(tmp_path):
    """INT8 faster (8 ms vs 10) but agreement 98.6 % < 99 %: ORT FP32 ships; the INT8 row's
    cost is named with the bound it misses; ORT FP16 (same accuracy, half size) is offered."""
    rows = report.load_rows(_write(tmp_path / MODEL, _cpu_rows()))
    md = report.render_markdown(MODEL, rows, None)
    assert md.index("## Verdict") < md.index("| backend |")  # the report opens with it
    line = _verdict_line(md, "CPU EP")
    assert line.startswith("- **CPU EP: ship `ort_fp32`**") and "ORT FP32 baseline" in line
    (cost,) = [ln for ln in md.splitlines() if ln.startswith("  - `ort_int8_hp32`")]
    assert "1.25x vs ORT FP32 = 1.25x faster" in cost
    assert "agreement 98.60 % < 99 %" in cost and "not shippable at this budget" in cost
    (fp16,) = [ln for ln in md.splitlines() if ln.startswith("  - `ort_fp16`")]
    assert "within budget but slower" in fp16 and "0.50x the size" in fp16
    assert "top-1 agreement with the PyTorch FP32 logits >= 99 %" in md
    assert "delta top-1 >= -0.5 points" in md


def test_cpu_verdict_ships_int8_within_budget_and_faster_and_the_flags_move_the_budget(
        tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path))
    folder = _write(tmp_path / MODEL, _cpu_rows(int8_top1=88.2, int8_agree=99.3))
    report.main(report.get_args_parser().parse_args(["--model", MODEL]))
    md = (folder / "REPORT.md").read_text()
    line = _verdict_line(md, "CPU EP")
    assert line.startswith("- **CPU EP: ship `ort_int8_hp32`**")
    assert "1.25x vs ORT FP32 = 1.25x faster" in line and "agreement 99.3 %" in line
    # a stricter budget (agreement >= 99.5 %) sends the verdict back to ORT FP32
    report.main(report.get_args_parser().parse_args(["--model", MODEL,
                                                     "--min-agreement", "99.5"]))
    md = (folder / "REPORT.md").read_text()
    assert _verdict_line(md, "CPU EP").startswith("- **CPU EP: ship `ort_fp32`**")
    assert ">= 99.5 %" in md and "agreement 99.30 % < 99.5 %" in md
    # a looser top-1 budget is honoured too (delta -0.24 vs -0.1 allowed)
    report.main(report.get_args_parser().parse_args(["--model", MODEL,
                                                     "--max-top1-drop", "0.1"]))
    md = (folder / "REPORT.md").read_text()
    assert _verdict_line(md, "CPU EP").startswith("- **CPU EP: ship `ort_fp32`**")
    assert "delta top-1 -0.24 < -0.1 points" in md


def test_a_verdict_ranked_on_busy_timings_says_so(tmp_path):
    """The verdict ranks rows by p50: one timed on a busy machine gets a caution line, the
    rows' own loops or, when the interleaved re-timing ranks them, that loop's record."""
    from deploykit import ship_timing

    rows = _cpu_rows(int8_top1=88.2, int8_agree=99.3)
    busy = {"cores": 0.9, "steal_cores": 0.0, "of_cores": 2, "seconds": 1.0}
    rows[1]["latency"]["other_cpu"] = busy  # ort_fp32, the baseline
    md = report.render_markdown(MODEL, report.load_rows(_write(tmp_path / "a" / MODEL, rows)),
                                None)
    (caution,) = [ln for ln in md.splitlines() if ln.startswith("  - caution:")]
    assert "`ort_fp32` timed on a busy machine" in caution
    rows[1]["latency"]["other_cpu"] = dict(busy, cores=0.01)  # quiet: no caution
    quiet = report.load_rows(_write(tmp_path / "b" / MODEL, rows))
    assert "caution:" not in report.render_markdown(MODEL, quiet, None)
    # the interleaved re-timing ranks them: its own loop's record decides
    record = {"device": quiet[0]["provenance"]["device"] if quiet[0].get("provenance") else None,
              "input": "the first eval images", "other_cpu": busy,
              "rows": {r["tag"]: {"p50_ms": p50_ms(r), **ship_timing._row_key(r)}
                       for r in quiet if r["tag"] != "pytorch_fp32_cpu"}}
    assert len(ship_timing.annotate(quiet, record)) >= 2
    md = report.render_markdown(MODEL, quiet, None)
    (caution,) = [ln for ln in md.splitlines() if ln.startswith("  - caution:")]
    assert "the interleaved re-timing ran on a busy machine (other processes used 0.90" in caution


@pytest.mark.parametrize("flag,value,needle", [("--min-agreement", "101", "0..100"),
                                               ("--min-agreement", "x", "percentage"),
                                               ("--max-top1-drop", "-1", "points")])
def test_budget_flags_refuse_impossible_values(flag, value, needle, capsys):
    with pytest.raises(SystemExit) as e:
        report.get_args_parser().parse_args(["--model", MODEL, flag, value])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_failed_or_rerun_row_is_never_shipped_and_a_device_without_eligible_rows_says_why(
        tmp_path):
    """The fast INT8 row failed parity (status failed): not eligible even though its numbers
    would pass; its rerun sidecar is no candidate either. The TensorRT group has only skipped
    rows: 'no row to ship' with the reason once."""
    rows = _cpu_rows(int8_agree=99.9, int8_top1=88.4, int8_status="failed")
    rows[-1]["status_reason"] = "cosine_min 0.2 < 0.9 (INT8 failed bound)"
    skip = "trtexec not found (set TRTEXEC=/path/to/trtexec)"
    rows += [base_record("t", p, MODEL, f"trt_{v}", {"backend": "TensorRT", "device": "cuda"},
                         status="skipped", reason=skip)
             for p, v in (("FP32", "fp32"), ("FP16", "fp16"), ("INT8", "int8"))]
    folder = _write(tmp_path / MODEL, rows)
    rerun = dict(rows[2], status="failed", reason="broke")  # ort_fp16.failed.json
    write_json(folder / "ort_fp16.failed.json", rerun)
    md = report.render_markdown(MODEL, report.load_rows(folder), None)
    assert _verdict_line(md, "CPU EP").startswith("- **CPU EP: ship `ort_fp32`**")
    assert "  - not eligible (1): `ort_int8_hp32`: failed: cosine_min 0.2 < 0.9" in md
    assert "a rerun's record (ort_fp16.failed.json)" in md
    trt = _verdict_line(md, "TensorRT")
    assert trt == ("- **TensorRT: no row to ship**: no row of it is eligible (failed, skipped, "
                   "not run or stale: below).")
    lines = [ln for ln in md.splitlines() if skip in ln and "not eligible" in ln]
    assert lines == [f"  - not eligible (3): `trt_fp32`, `trt_fp16`, `trt_int8`: skipped: {skip}"]


def test_a_group_whose_measured_rows_all_miss_the_budget_ships_nothing():
    rows = [_row("pytorch_fp32_cpu", "PyTorch", "FP32", "cpu", 88.44, 20.0, reference="x"),
            _row("ort_int8", "ORT", "INT8", "cpu", 1.0, 5.0, ep="CPUExecutionProvider",
                 agree=1.2)]
    md = report.render_markdown(MODEL, rows, None)
    assert _verdict_line(md, "CPU EP") == ("- **CPU EP: no row to ship**: none of its 1 "
                                           "measured rows is within budget (below).")
    (cost,) = [ln for ln in md.splitlines() if ln.startswith("  - `ort_int8`")]
    assert "no ORT FP32 row on this CPU EP: speedup n/a" in cost and "agreement 1.20 % < 99" \
        in cost


def test_speedup_vs_the_deployment_baseline_of_the_same_ep(rows):
    """vs ORT FP32 on the same EP (the plain ort_fp32_cuda, not the notf32 variant), beside
    the vs-PyTorch column; PyTorch rows have no deployment speedup."""
    rows = rows + [
        _row("ort_fp32_cuda", "ORT", "FP32", "cuda", 88.44, 1.5, ep="CUDAExecutionProvider"),
        _row("ort_fp32_cuda_notf32", "ORT", "FP32", "cuda", 88.44, 1.0,
             ep="CUDAExecutionProvider"),
        _row("ort_int8_cuda", "ORT", "INT8", "cuda", 88.0, 3.0, ep="CUDAExecutionProvider")]
    t = {r["tag"]: r for r in report.table_rows(rows)}
    assert t["ort_int8_hp32"]["speedup vs ORT/TRT FP32"] == "1.25x"  # 10 ms / 8 ms
    assert t["ort_int8_hp32"]["speedup vs PyTorch FP32"] == "2.50x"
    assert t["ort_int8"]["speedup vs ORT/TRT FP32"] == "0.33x"
    assert t["ort_int8_cuda"]["speedup vs ORT/TRT FP32"] == "0.50x"  # vs 1.5, not CPU's 10
    assert t["ort_fp32_cuda_notf32"]["speedup vs ORT/TRT FP32"] == "1.50x"
    assert t["pytorch_fp32_cpu"]["speedup vs ORT/TRT FP32"] == ""
    assert t["trt_fp32"]["speedup vs ORT/TRT FP32"] == ""  # skipped: no latency
    md = report.render_markdown(MODEL, rows, None)
    assert "| speedup vs PyTorch FP32 | speedup vs ORT/TRT FP32 |" in md


def test_a_reason_shared_by_rows_is_written_once_and_constant_columns_become_a_line(tmp_path):
    skip = "trtexec not found (set TRTEXEC=/path/to/trtexec)"
    rows = _cpu_rows() + [
        base_record("t", p, MODEL, f"trt_{v}", {"backend": "TensorRT", "device": "cuda"},
                    status="skipped", reason=skip)
        for p, v in (("FP32", "fp32"), ("FP16", "fp16"), ("INT8", "int8"))]
    rows += [base_record("6_build_engines", "FP32", MODEL, f"trt_build_{v}",
                         {"backend": "TensorRT"}, status="skipped", reason=skip, variant=v)
             for v in ("fp32", "fp16")]
    rows.sort(key=row_sort_key)
    runs = report.split_builds(rows)[0]
    table = markdown_table(report.table_rows(runs))
    assert table.count(skip) == 1
    (note,) = [ln for ln in table.splitlines() if skip in ln]
    assert note.startswith("- [1] trt_fp32, trt_fp16, trt_int8: ")
    assert [ln.rsplit("|", 2)[1].strip() for ln in table.splitlines() if "| trt_" in ln] == \
        ["skipped [1]"] * 3
    header = next(ln for ln in table.splitlines() if ln.startswith("| backend"))
    assert "images" not in header and "FPS" not in header and "GPU compute" not in header
    assert "Same in every row that has a value: images 900; " in table
    # a reason of one row stays in its cell
    one = markdown_table(report.table_rows(runs[:-1]))
    assert "| skipped [1] |" in one and "- [1] trt_fp32, trt_fp16: " in one
    md = report.render_markdown(MODEL, rows, None)
    (builds,) = [ln for ln in md.splitlines() if ln.startswith("| fp32, fp16 |")]
    assert builds == f"| fp32, fp16 | skipped | {skip} |"


def test_accuracy_plot_marks_the_row_to_ship_zooms_and_keeps_labels_apart(tmp_path, monkeypatch):
    """Rows at one top-1 (88.44 %) used to print their labels on top of each other; a row at
    11.8 % stretched the axis to 0-90 %. Now: labels do not overlap, the axis is zoomed, the
    far row is on the edge with its value, the recommended row is a star in the legend."""
    from deploykit.report import accuracy_latency_figure

    rows = _cpu_rows(int8_top1=88.2, int8_agree=99.3) + [
        _row(f"ort_fp32_v{i}", "ORT", "FP32", "cpu", 88.44, 10.0 + 0.01 * i,
             ep="CPUExecutionProvider", agree=100.0) for i in range(6)] + [
        _row("ort_int8", "ORT", "INT8", "cpu", 11.8, 30.0, ep="CPUExecutionProvider", agree=12.0)]
    fig = accuracy_latency_figure(rows)
    (ax,) = fig.axes
    labels = ax.get_legend_handles_labels()[1]
    assert "ship CPU EP: ort_int8_hp32" in labels
    lo, hi = ax.get_ylim()
    assert 85 < lo < 88.2 and hi < 90  # zoomed on the rows that hold
    texts = [t for t in ax.texts if t.get_text()]
    assert any(t.get_text() == "ort_int8 (top-1 11.80 %, off the axis)" for t in texts)
    assert any(t.get_text() == "ort_int8_hp32 <- ship" for t in texts)
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in texts]  # the text, not its leader
    assert len(boxes) == len(rows)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), "two labels overlap"
    import matplotlib.pyplot as plt
    plt.close(fig)
    # the files: written, the size footnote names what a Q/DQ file stores
    monkeypatch.setenv("RESULTS", str(tmp_path))
    _write(tmp_path / MODEL, rows)
    report.main(report.get_args_parser().parse_args(["--model", MODEL]))
    assert (tmp_path / MODEL / "accuracy_latency.png").stat().st_size > 5000
    md = (tmp_path / MODEL / "REPORT.md").read_text()
    assert "int8_hp32: the Q/DQ ONNX stores FP32 weights + scales" in md
    assert "the TensorRT engine stores INT8" in md
