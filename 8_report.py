#!/usr/bin/env python3
"""Stage 8: collect ``results/<model>/*.json`` into ``REPORT.md`` and ``REPORT.csv``.

Reads:  every results JSON of the model that describes a backend run (``backend`` key).
Writes: ``results/<model>/REPORT.md``, ``results/<model>/REPORT.csv`` and a copy of the markdown
        at ``results/REPORT.md`` (the last model reported).
Rerun:  ``python 8_report.py --model efficientnet_lite0``

Columns: backend, precision, top-1, top-5, delta top-1 (points vs the PyTorch FP32 row), batch-1
end-to-end p50 ms, GPU Compute Time p50 ms (GPU rows), FPS (batch 1, from the mean), speedup
(PyTorch FP32 end-to-end p50 on the same device / this row's; "n/a" when no PyTorch row ran on
that device; medians resist the stalls of a shared machine), size MB, cosine similarity and top-1
agreement (vs PyTorch FP32 logits).
Rows that could not run (skipped / failed) are listed with the reason; numbers are only ever
copied from the JSON of a real run.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import sys
import time
from pathlib import Path

import common
import evaluate
import variants

COLUMNS = ["backend", "precision", "tag", "EP/device", "images", "top-1 %", "top-5 %",
           "delta top-1", "p50 ms", "GPU compute p50 ms", "FPS", "speedup", "size MB",
           "cosine sim", "top-1 agree %",
           "status"]

# Row order: the hops of the pipeline, then precision, then the variant registry's order.
_ORDER = {"PyTorch": 0, "ORT": 1, "TensorRT": 2}


def _variant(r: dict) -> str:
    """Variant name of a row: its ``variant`` field, else the tag without the backend prefix."""
    tag = r["tag"]
    return r.get("variant") or (tag.split("_", 1)[1] if "_" in tag else tag)


def _is_rerun(r: dict) -> bool:
    """True for a rerun's failure kept beside a good row (``<tag>.failed.json``,
    :func:`common.write_result`)."""
    return r.get("_file", f"{r['tag']}.json") != f"{r['tag']}.json"


def _sort_key(r: dict) -> tuple:
    return (_ORDER.get(r["backend"], 9), variants.PRECISION_ORDER.get(r["precision"][:4], 9),
            variants.order(_variant(r)), r["tag"], _is_rerun(r))


# Types of the row fields the report reads (``evaluate`` schema); None is always allowed for the
# optional ones. A row that breaks them is listed as "invalid" naming the file and the field.
_NUM = (int, float)
_FIELDS = {"backend": (str,), "precision": (str,), "tag": (str,), "status": (str,),
           "reason": (str, type(None)), "device": (str, type(None)),
           "ep_used": (str, type(None)), "n_images": (int, type(None)),
           "size_mb": _NUM + (type(None),), "accuracy": (dict, type(None)),
           "parity": (dict, type(None)), "latency": (dict, type(None)),
           "diagnostics": (dict, type(None)), "reference": (str, type(None))}
_NESTED = {"accuracy": ("top1", "top5"), "parity": ("cosine_mean", "top1_agreement")}
_LATENCY = ("end_to_end_ms", "gpu_compute_ms")
_STATS = ("p50_ms", "mean_ms", "fps")


def row_problem(rec: dict) -> str | None:
    """The first field of ``rec`` whose type the report cannot use, as ``"field X is T
    (value), expected ..."``; None when the row is usable."""
    def bad(name, v, types):
        want = " or ".join("null" if t is type(None) else {"str": "a string", "int": "an "
                           "integer", "float": "a number", "dict": "an object"}[t.__name__]
                           for t in types)
        return f"field {name} is {type(v).__name__} ({json.dumps(v)[:40]}), expected {want}"

    for name, types in _FIELDS.items():
        v = rec.get(name)
        if (name in ("backend", "precision", "tag", "status") or v is not None) and (
                not isinstance(v, types) or isinstance(v, bool)):
            return bad(name, v, types)
    for name, keys in _NESTED.items():
        for k in keys:
            v = (rec.get(name) or {}).get(k)
            if v is not None and (not isinstance(v, _NUM) or isinstance(v, bool)):
                return bad(f"{name}.{k}", v, _NUM)
    for block in _LATENCY:
        stats = (rec.get("latency") or {}).get(block)
        if stats is not None and not isinstance(stats, dict):
            return bad(f"latency.{block}", stats, (dict,))
        for k in _STATS:
            v = (stats or {}).get(k)
            if v is not None and (not isinstance(v, _NUM) or isinstance(v, bool)):
                return bad(f"latency.{block}.{k}", v, _NUM)
    return None


def load_rows(folder: Path) -> list[dict]:
    """Results records in ``folder`` that describe a backend run, in pipeline order.

    A file that is not valid JSON, or whose fields have types the report cannot use, becomes
    an ``invalid`` row naming the file and the field (and a warning), so one bad file never
    hides the others.
    """
    rows = []
    for f in sorted(folder.glob("*.json")):
        problem, rec = None, None
        try:
            rec = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"not valid JSON ({e})"
        if rec is not None and not (isinstance(rec, dict) and "backend" in rec):
            continue  # data.json, export.json, quant_*.json, ...: not a backend row
        if problem is None:
            problem = row_problem(rec)
        if problem is not None:
            print(f"WARNING: {f}: {problem}: listed as invalid; rerun the stage that wrote it",
                  file=sys.stderr)
            tag = rec.get("tag") if isinstance(rec, dict) and isinstance(rec.get("tag"), str) \
                else f.stem
            rec = common.result_record("8_report", str(rec.get("backend")) if isinstance(
                rec, dict) else "?", "?", "", tag, status="invalid",
                reason=f"{f.name}: {problem}; rerun the stage that wrote it")
        rec["_file"] = f.name
        rows.append(rec)
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
    pt_ms = {r.get("device") or "cpu": evaluate.primary_latency(r)["p50_ms"] for r in rows
             if r["backend"] == "PyTorch" and r["status"] == "ok"
             and evaluate.primary_latency(r).get("p50_ms")}
    out = []
    for r in rows:
        acc = r.get("accuracy") or {}
        lat = evaluate.primary_latency(r)
        gpu = (r.get("latency") or {}).get("gpu_compute_ms") or {}
        par = r.get("parity") or {}
        dev = r.get("device") or "cpu"
        ep = (r.get("ep_used") or dev).replace("ExecutionProvider", " EP")
        if r.get("cpu_fallback"):
            ep += " (fallback)"
        status = r["status"]
        if _is_rerun(r):
            status = f"latest rerun {status} ({r['_file']}; the ok row above is kept)"
        if r.get("reason"):
            status += f": {r['reason'].splitlines()[0][:320]}"
        cc = (r.get("diagnostics") or {}).get("backend_cross_check") or {}
        if cc.get("disagreement"):
            status += (f"; BACKEND DISAGREEMENT: top-1 {cc['top1_unoptimized']:.1f}% with ORT "
                       f"optimisations disabled ({cc['n']} images)")
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
            "p50 ms": _fmt(lat.get("p50_ms"), 3), "GPU compute p50 ms": _fmt(gpu.get("p50_ms"), 3),
            "FPS": _fmt(lat.get("fps"), 1),
            "speedup": f"{speed:.2f}x" if speed else ("n/a" if lat else ""),
            "size MB": _fmt(r.get("size_mb")),
            "cosine sim": _fmt(par.get("cosine_mean"), 5) if par else
            ("reference" if r.get("reference") else ""),
            "top-1 agree %": _fmt(par.get("top1_agreement"), 1), "status": status})
    return out


def summary_line(rows: list[dict]) -> str:
    """One console line: the fastest row within 1 point of the PyTorch FP32 top-1 (the best
    recipe), its speedup, and the rows that did not run ok."""
    trs = {id(r): t for r, t in zip(rows, table_rows(rows))}
    base = next((r for r in rows if r["backend"] == "PyTorch" and r["status"] == "ok"
                 and (r.get("accuracy") or {}).get("top1") is not None), None)
    good = [r for r in rows if r["backend"] != "PyTorch" and r["status"] == "ok"
            and not _is_rerun(r) and (r.get("accuracy") or {}).get("top1") is not None
            and (base is None or r["accuracy"]["top1"] >= base["accuracy"]["top1"] - 1.0)]

    def speed(r):
        v = trs[id(r)]["speedup"]
        return float(v[:-1]) if v.endswith("x") else 0.0

    parts = []
    if good:
        b = max(good, key=lambda r: (speed(r), r["accuracy"]["top1"]))
        parts.append(f"best recipe {b['tag']} ({b['precision']}, top-1 "
                     f"{b['accuracy']['top1']:.2f}%"
                     + (f" ({b['accuracy']['top1'] - base['accuracy']['top1']:+.2f} points vs "
                        f"{base['tag']})" if base else "")
                     + f", speedup {trs[id(b)]['speedup'] or 'n/a'})")
    else:
        parts.append("no converted row within 1 point of PyTorch FP32 top-1")
    parts.append(f"{sum(r['status'] == 'ok' for r in rows)} ok")
    for st in ("failed", "invalid", "skipped", "not run"):
        tags = [r["tag"] for r in rows if r["status"] == st]
        if tags:
            parts.append(f"{len(tags)} {st}"
                         + (f" ({', '.join(tags[:4])}{', ...' if len(tags) > 4 else ''})"
                            if st != "skipped" else ""))
    return "summary: " + "; ".join(parts)


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
    buf.write("Latency: batch 1, median (p50) of the timed runs after warm-up, end to end (host "
              "arrays in and out); GPU rows also give the GPU Compute Time (CUDA events); p90/p99 "
              "and the timer of each row are in its JSON. Speedup = PyTorch FP32 p50 / this "
              "row's p50, on the same device. Parity vs PyTorch FP32 logits.\n\n")
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
    if rows:
        common.check_writable(folder, common.results_dir())
    if not rows:
        raise common.StageError(f"no results in {folder}: run the stages first "
                                "(bash run_all.sh)")
    if common.model_spec(args.model).classifier:
        rows = sorted(missing_rows(rows, args.model) + rows, key=_sort_key)
    data_file = folder / "data.json"
    data = common.load_json(data_file, "0_prepare_data.py") if data_file.exists() else None
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
    print(summary_line(split_builds(rows)[0]))
    return out_md


if __name__ == "__main__":
    common.cli(get_args_parser, main)
