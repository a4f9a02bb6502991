#!/usr/bin/env python3
"""Stage 8: collect ``results/<model>/*.json`` into ``REPORT.md`` and ``REPORT.csv``.

Reads:  every results JSON of the model that describes a backend run (``backend`` key).
Writes: ``results/<model>/REPORT.md``, ``results/<model>/REPORT.csv`` and a copy of the markdown
        at ``results/REPORT.md`` (the last model reported).
Rerun:  ``python 8_report.py --model efficientnet_lite0``

Columns: backend, precision, top-1, top-5, delta top-1 (points vs the PyTorch FP32 row), mean ms,
FPS, speedup (PyTorch FP32 mean ms on the same device / this row's mean ms; "n/a" when no PyTorch
row ran on that device), size MB, cosine similarity and top-1 agreement (vs PyTorch FP32 logits).
Rows that could not run (skipped / failed) are listed with the reason; numbers are only ever
copied from the JSON of a real run.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import time
from pathlib import Path

import common
import variants

COLUMNS = ["backend", "precision", "tag", "EP/device", "images", "top-1 %", "top-5 %",
           "delta top-1", "mean ms", "FPS", "speedup", "size MB", "cosine sim", "top-1 agree %",
           "status"]

# Row order: the hops of the pipeline, then precision, then the variant registry's order.
_ORDER = {"PyTorch": 0, "ORT": 1, "TensorRT": 2}


def _variant(r: dict) -> str:
    """Variant name of a row: its ``variant`` field, else the tag without the backend prefix."""
    tag = r["tag"]
    return r.get("variant") or (tag.split("_", 1)[1] if "_" in tag else tag)


def _sort_key(r: dict) -> tuple:
    return (_ORDER.get(r["backend"], 9), variants.PRECISION_ORDER.get(r["precision"][:4], 9),
            variants.order(_variant(r)), r["tag"])


def load_rows(folder: Path) -> list[dict]:
    """Results records in ``folder`` that describe a backend run, in pipeline order.

    Raises:
        StageError: a JSON file cannot be parsed (named).
    """
    rows = []
    for f in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise common.StageError(f"{f} is not valid JSON ({e}); rerun the stage that wrote it")
        if isinstance(rec, dict) and "backend" in rec:
            rec["_file"] = f.name
            rows.append(rec)
    # The Q/DQ health check of the file a row ran (stages 5/5b record it in quant_<variant>.json).
    for rec in rows:
        q = folder / f"quant_{_variant(rec)}.json"
        if rec["precision"].startswith("INT") and q.exists():
            try:
                rec["_quant_check"] = (json.loads(q.read_text()).get("check") or {}).get("summary")
            except json.JSONDecodeError:
                pass
    rows.sort(key=_sort_key)
    return rows


# Rows every classifier run should have, with the command that makes each.
EXPECTED = [("PyTorch", "FP32", "pytorch_fp32_cpu", "1_pytorch_baseline.py"),
            ("ORT", "FP32", "ort_fp32", "2_export_onnx.py, then 3_onnx_eval.py --tag ort_fp32"),
            ("ORT", "FP16", "ort_fp16", "2_export_onnx.py, then 3_onnx_eval.py --tag ort_fp16")]


def missing_rows(rows: list[dict], model: str) -> list[dict]:
    """Placeholder rows (status "not run") for the expected rows that have no results JSON."""
    have = {r["tag"] for r in rows}
    return [common.result_record("8_report", b, p, model, tag, status="not run",
                                 reason=f"no results/{common.model_tag(model)}/{tag}.json: "
                                        f"run {cmd}")
            for b, p, tag, cmd in EXPECTED if tag not in have]


def _fmt(v, nd=2):
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def table_rows(rows: list[dict]) -> list[dict]:
    """One dict per report row with the :data:`COLUMNS` keys (strings, ready to print)."""
    base = next((r for r in rows if r["backend"] == "PyTorch" and r["status"] == "ok"
                 and (r.get("accuracy") or {}).get("top1") is not None), None)
    base_top1 = base["accuracy"]["top1"] if base else None
    # Speedup from medians (p50): robust to the stalls a shared machine adds to the mean.
    pt_ms = {r.get("device", "cpu"): r["latency"]["p50_ms"] for r in rows
             if r["backend"] == "PyTorch" and r["status"] == "ok" and r.get("latency")}
    out = []
    for r in rows:
        acc = r.get("accuracy") or {}
        lat = r.get("latency") or {}
        par = r.get("parity") or {}
        dev = r.get("device", "cpu")
        ep = r.get("ep_used") or r.get("device") or ""
        ep = ep.replace("ExecutionProvider", " EP")
        if r.get("cpu_fallback"):
            ep += " (fallback)"
        status = r["status"]
        if r.get("reason"):
            status += f": {r['reason'].splitlines()[0][:320]}"
        cc = r.get("backend_cross_check")
        if cc and cc.get("disagreement"):
            status += (f"; BACKEND DISAGREEMENT: top-1 {cc['top1_unoptimized']:.1f}% with ORT "
                       f"optimisations disabled ({cc['n']} images)")
        if r.get("_quant_check") and r["_quant_check"] != "check: clean":
            status += f"; Q/DQ {r['_quant_check']} (qdq_tools.py check)"
        if lat.get("mean_ms") and lat.get("p50_ms") and lat["mean_ms"] > 1.5 * lat["p50_ms"]:
            status += (f"; noisy timing: mean {lat['mean_ms']:.1f} ms vs p50 "
                       f"{lat['p50_ms']:.1f} ms (busy machine?)")
        top1 = acc.get("top1")
        speed = (pt_ms[dev] / lat["p50_ms"]) if lat.get("p50_ms") and dev in pt_ms else None
        out.append({
            "backend": r["backend"], "precision": r["precision"], "tag": r["tag"],
            "EP/device": ep, "images": _fmt(r.get("n_images")), "top-1 %": _fmt(top1),
            "top-5 %": _fmt(acc.get("top5")),
            "delta top-1": _fmt(top1 - base_top1) if top1 is not None and base_top1 is not None
            else "",
            "mean ms": _fmt(lat.get("mean_ms"), 3), "FPS": _fmt(lat.get("fps"), 1),
            "speedup": f"{speed:.2f}x" if speed else ("n/a" if lat else ""),
            "size MB": _fmt(r.get("size_mb")),
            "cosine sim": _fmt(par.get("cosine_mean"), 5) if par else
            ("reference" if r.get("reference") else ""),
            "top-1 agree %": _fmt(par.get("top1_agreement"), 1), "status": status})
    return out


def split_builds(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(run rows for the table, stage-6 engine-build rows listed separately)``."""
    return ([r for r in rows if r.get("stage") != "6_build_engines"],
            [r for r in rows if r.get("stage") == "6_build_engines"])


def render_markdown(model: str, rows: list[dict], data: dict | None,
                    trs: list[dict] | None = None) -> str:
    """The report as markdown: a header naming model, data and machine, then the table
    (``trs``: the :func:`table_rows` of the run rows, when the caller already has them)."""
    runs, builds = split_builds(rows)
    trs = table_rows(runs) if trs is None else trs
    buf = io.StringIO()
    buf.write(f"# Deployment report: {model}\n\n")
    if data:
        buf.write(f"Data: {data.get('n_eval')} eval images ({data.get('layout')}, "
                  f"{data.get('data_root')}); {data.get('n_calib')} disjoint calibration images; "
                  f"preprocessing {data.get('preprocessing')}.")
        fewer = sorted({r["n_images"] for r in rows if r.get("n_images")
                        and r["n_images"] != data.get("n_eval")})
        if fewer:
            buf.write(f" Some rows ran on fewer images ({', '.join(map(str, fewer))}: "
                      "--limit): compare rows with the same image count only.")
        buf.write("\n\n")
    prov = next((r.get("provenance") for r in rows if r.get("provenance")), None)
    if prov:
        d, v = prov["device"], prov["versions"]
        buf.write(f"Machine: {d.get('cpu')} ({d.get('cpu_count')} cores), GPU: "
                  f"{d.get('gpu') or 'none'}; torch {v.get('torch')}, onnxruntime "
                  f"{v.get('onnxruntime') or v.get('onnxruntime-gpu')}, modelopt "
                  f"{v.get('nvidia-modelopt')}, TensorRT {v.get('tensorrt') or 'not installed'}; "
                  f"git {prov.get('git_sha')}.\n\n")
    buf.write("Latency: batch 1, mean of timed runs after warm-up (p50/p90/p99 in the JSON); "
              "speedup = PyTorch FP32 p50 / this row's p50, on the same device. Parity vs "
              "PyTorch FP32 logits.\n\n")
    buf.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
    for t in trs:
        buf.write("| " + " | ".join(t[c].replace("|", "/") for c in COLUMNS) + " |\n")
    if builds:
        buf.write("\nTensorRT engine builds (stage 6):\n\n| variant | status | detail |\n"
                  "|---|---|---|\n")
        for b in builds:
            detail = (b.get("reason") or b.get("plan") or "").splitlines()
            buf.write(f"| {b['tag'].removeprefix('trt_build_')} | {b['status']} | "
                      f"{(detail[0] if detail else '')[:200].replace('|', '/')} |\n")
    return buf.getvalue()


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__)
    common.add_shared_args(p, "model")
    return p


def main(args: argparse.Namespace) -> Path:
    started = time.time()
    folder = common.model_results(args.model)
    rows = load_rows(folder) if folder.is_dir() else []
    if not rows:
        raise common.StageError(f"no results in {folder}: run the stages first "
                                "(bash run_all.sh)")
    if common.model_spec(args.model).classifier:
        rows = sorted(missing_rows(rows, args.model) + rows, key=_sort_key)
    data_file = folder / "data.json"
    data = json.loads(data_file.read_text()) if data_file.exists() else None
    trs = table_rows(split_builds(rows)[0])
    md = render_markdown(args.model, rows, data, trs)
    md += f"\nGenerated by `python 8_report.py --model {args.model}` in " \
          f"{time.time() - started:.1f} s.\n"
    out_md, out_csv = folder / "REPORT.md", folder / "REPORT.csv"
    with common.atomic_path(out_md) as tmp:
        tmp.write_text(md)
    with common.atomic_path(out_csv) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(trs)
    with common.atomic_path(common.results_dir() / "REPORT.md") as tmp:
        shutil.copyfile(out_md, tmp)
    print(md)
    return out_md


if __name__ == "__main__":
    common.cli(get_args_parser, main)
