"""Stage 8 and the plots people look at first: rows in the shared schema become the table, the GPU
details, the PNGs beside REPORT.md, and a one-line console summary."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from deploykit.evaluate import base_record
from deploykit.layerwise.report import plot_rows, plot_similarity


report = importlib.import_module("8_report")
MODEL = "efficientnet_lite0"  # the folder the report tests write to: rows name their model


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
    assert t["ort_fp32"]["p50 ms"] == "10.000" and t["ort_fp32"]["speedup"] == "2.00x"
    assert t["pytorch_fp32_cuda"]["speedup"] == "1.00x"  # vs the CUDA PyTorch row, not CPU
    assert t["pytorch_fp32_cuda"]["GPU compute p50 ms"] == "1.500"
    assert "BACKEND DISAGREEMENT" in t["ort_int8"]["status"]
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
    assert t["pytorch_fp32_cuda"]["speedup"] == "1.00x"
    assert t["pytorch_fp16_cuda"]["speedup"] == "0.50x"
    assert t["pytorch_fp32_cuda_notf32"]["speedup"] == "0.75x"
    assert t["ort_fp32_cuda"]["speedup"] == "2.00x"
    assert t["ort_fp32"]["speedup"] == "2.00x"


def test_gpu_table_shows_graph_replay_and_why_a_figure_is_missing(rows):
    md = report.gpu_table(rows)
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


def test_layerwise_plot_keeps_non_finite_layers(tmp_path):
    """A NaN layer used to be a gap in the plot, so the first divergent layer had no point."""
    layers = [{"index": i, "node": f"n{i}", "status": "pass", "cosine_min": 0.9999,
               "shape_only": False} for i in range(5)]
    layers[3] = {"index": 3, "node": "n3", "status": "fail", "cosine_min": float("nan"),
                 "shape_only": False}
    res = {"layers": layers, "tolerances": {"min_cosine": 0.98},
           "first_divergent": {"index": 3, "node": "n3"},
           "a": {"backend": "ORT", "onnx": "a.onnx"}, "b": {"backend": "ORT", "onnx": "b.onnx"}}
    assert [r["node"] for r in plot_rows(res)] == [f"n{i}" for i in range(5)]
    # also after a JSON round trip (NaN is written as null)
    back = json.loads(json.dumps(res).replace("NaN", "null"))
    assert len(plot_rows(back)) == 5
    path = plot_similarity(back, tmp_path / "p.png")
    assert path.stat().st_size > 5000
    assert np.isnan(np.array([r["cosine_min"] if r["cosine_min"] is not None else np.nan
                              for r in plot_rows(back)])).sum() == 1


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
    assert t["ort_fp32"]["speedup"] == "2.00x"  # still vs this machine's CPU PyTorch row
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
