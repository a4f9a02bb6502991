"""The report of one model's rows (stage 8): loading and validating result rows, the table and its\ncolumns, speedups, the GPU table, plots and the markdown/CSV, and the one-line summary.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from deploykit.compare import rejudge_row
from deploykit.evaluate import primary_latency
from deploykit.errors import clip_text
from deploykit.io import atomic_path
from deploykit.layout import model_tag, results_dir
from deploykit.results import result_record, row_artifacts_root, staleness
from deploykit.timing import BUSY_CORES, busy_machine_note
from deploykit.variants import PRECISION_ORDER, VARIANTS, variant_order
from deploykit.verdict import (Budget, deploy_baselines, deploy_group, is_rerun, render_verdicts,
                              verdicts)


COLUMNS = ["backend", "precision", "tag", "EP/device", "images", "top-1 %", "top-1 agree %",
           "top-5 %", "delta top-1", "INT8 MACs %", "p50 ms", "GPU compute p50 ms", "FPS",
           "speedup vs PyTorch FP32", "speedup vs ORT/TRT FP32", "size MB", "cosine sim", "status"]


# Row order: the hops of the pipeline, then precision, then the variant registry's order.
_ORDER = {"PyTorch": 0, "ORT": 1, "TensorRT": 2}


def _variant(r: dict) -> str:
    """Variant name of a row: its ``variant`` field, else the tag without the backend prefix."""
    tag = r["tag"]
    return r.get("variant") or (tag.split("_", 1)[1] if "_" in tag else tag)


_is_rerun = is_rerun


def row_sort_key(r: dict) -> tuple:
    return (_ORDER.get(r["backend"], 9), PRECISION_ORDER.get(r["precision"][:4], 9),
            variant_order(_variant(r)), r["tag"], _is_rerun(r))


# Types of the row fields the report reads (``evaluate`` schema); None is always allowed for the
# optional ones. A row that breaks them is listed as "invalid" naming the file and the field.
_NUM = (int, float)


_FIELDS = {"backend": (str,), "precision": (str,), "tag": (str,), "status": (str,),
           "reason": (str, type(None)), "device": (str, type(None)),
           "ep_used": (str, type(None)), "n_images": (int, type(None)),
           "size_mb": _NUM + (type(None),), "accuracy": (dict, type(None)),
           "parity": (dict, type(None)), "latency": (dict, type(None)),
           "diagnostics": (dict, type(None)), "reference": (str, type(None)),
           "nonfinite_outputs": (dict, type(None))}


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


# what the stages write (deploykit.results.write_result; warn/failed of a measured row:
# deploykit.evaluate.judge)
ROW_STATUSES = ("ok", "warn", "failed", "skipped")


def row_identity_problem(rec: dict, f: Path) -> str | None:
    """Why the row in file ``f`` is not a row of this folder, or None: its status is not one
    the stages write, its tag is not the file's name (``<tag>.json``, or the rerun sidecars
    ``<tag>.failed.json`` / ``<tag>.skipped.json``), or its model is not the folder's
    (``results/<model tag>/``). A copied or hand-edited file otherwise showed another model's
    numbers, or stood in for another tag, as if this run had made them."""
    if rec["status"] not in ROW_STATUSES:
        return f"field status is {rec['status']!r}, expected one of {', '.join(ROW_STATUSES)}"
    names = {f"{rec['tag']}{s}.json" for s in ("", ".failed", ".skipped")}
    if f.name not in names:
        return (f"field tag is {rec['tag']!r} but the file is {f.name} (a row is written as "
                f"<tag>.json): a renamed or copied file")
    model = rec.get("model")
    if isinstance(model, str) and model_tag(model) != f.parent.name:
        return (f"field model is {model!r} but the folder is {f.parent.name}/: a row of "
                "another model, copied here")
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
        if rec is not None and not isinstance(rec, dict):
            problem = (f"a JSON {type(rec).__name__}, not a results row (an object with "
                       "backend, tag, status, ...)")
        elif rec is not None and "backend" not in rec:
            continue  # data.json, export.json, quant_*.json, ...: not a backend row
        if problem is None:
            problem = row_problem(rec) or row_identity_problem(rec, f)
        if problem is not None:
            print(f"WARNING: {f}: {problem}: listed as invalid; rerun the stage that wrote it",
                  file=sys.stderr)
            # The file names the row (<tag>.json, <tag>.failed.json): its own tag field may be
            # what is wrong.
            tag = f.name[:-len(".json")].removesuffix(".failed").removesuffix(".skipped")
            rec = result_record("8_report", str(rec.get("backend")) if isinstance(
                rec, dict) else "?", "?", "", tag, status="invalid",
                reason=f"{f.name}: {problem}; rerun the stage that wrote it")
        rec["_file"] = f.name
        rows.append(rejudge_row(rec))  # a row's status follows its parity, also an old row's
    # The Q/DQ health check of the file a row ran (stages 5/5b record it in quant_<variant>.json).
    for rec in rows:
        q = folder / f"quant_{_variant(rec)}.json"
        if str(rec.get("precision", "")).startswith("INT") and q.exists():
            try:
                qrec = json.loads(q.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            rec["_quant_check"] = (qrec.get("check") or {}).get("summary")
            rec["_int8_macs"] = (qrec.get("macs") or {}).get("int8_fraction")
    rows.sort(key=row_sort_key)
    return rows


# --------------------------------------------------------------------------------------------
# Stale rows and rows of several ARTIFACTS folders (callable by any section of the report)
# --------------------------------------------------------------------------------------------
def stale_reasons(r: dict) -> list[str]:
    """Why row ``r`` no longer describes the files on disk (:func:`deploykit.results.staleness`:
    reference, file, fp32.onnx, calibration data or engine changed since, each with the command
    to rerun); computed once per row and kept in ``r["_stale"]``. Empty: current, or unknown
    (a row that records no hashes)."""
    if "_stale" not in r:
        r["_stale"] = staleness(r) if r.get("status") in ROW_STATUSES else []
    return r["_stale"]


def is_stale(r: dict) -> bool:
    """True when :func:`stale_reasons` names anything: the row is left out of the summary's
    counts and of the best-row choice."""
    return bool(stale_reasons(r))


def stale_section(rows: list[dict]) -> str:
    """The markdown "Stale rows" list (empty string when no row is stale): each stale row, what
    changed and the command(s) to rerun."""
    stale = [r for r in rows if is_stale(r)]
    if not stale:
        return ""
    out = ["\nStale rows (measured against files that have changed since; left out of the "
           "summary and the best-row choice; each command pastes from any folder):\n"]
    for r in stale:
        for why in stale_reasons(r):
            out.append(f"- {r['tag']}: {why}")
    return "\n".join(out) + "\n"


def artifacts_warning(model: str, rows: list[dict]) -> str | None:
    """The ``WARNING:`` line when this folder's rows of ``model`` were measured in different
    ARTIFACTS folders (two runs sharing one RESULTS folder), naming each folder and its rows;
    None when they agree (rows from another machine, ``_source``, and rows that do not record
    the folder are left out)."""
    roots: dict[str, list[str]] = {}
    for r in rows:
        root = row_artifacts_root(r)
        if root and not r.get("_source"):
            roots.setdefault(root, []).append(r["tag"])
    if len(roots) < 2:
        return None
    return (f"WARNING: the rows of {model} come from different ARTIFACTS folders: "
            + "; ".join(f"{root} ({', '.join(tags)})" for root, tags in roots.items())
            + ": two runs share this RESULTS folder; rerun one of them with its own RESULTS")


# Rows every classifier run should have, with the command that makes each.
EXPECTED = [("PyTorch", "FP32", "pytorch_fp32_cpu", "1_pytorch_baseline.py"),
            ("ORT", "FP32", "ort_fp32", "2_export_onnx.py, then 3_onnx_eval.py --tag ort_fp32"),
            ("ORT", "FP16", "ort_fp16", "2_export_onnx.py, then 3_onnx_eval.py --tag ort_fp16")]


def missing_rows(rows: list[dict], model: str) -> list[dict]:
    """Placeholder rows (status "not run") for the expected rows that have no results JSON."""
    have = {r["tag"] for r in rows}
    return [result_record("8_report", b, p, model, tag, status="not run",
                          reason=f"no results/{model_tag(model)}/{tag}.json: "
                          f"run {cmd}")
            for b, p, tag, cmd in EXPECTED if tag not in have]


def _fmt(v, nd=2):
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def speedup_references(rows: list[dict]) -> dict[str, float]:
    """Per device ("cpu", "cuda"), the p50 ms (batch 1, end to end) that speedups divide: the
    PyTorch FP32 row of that device, ``pytorch_fp32_<device>`` when present (never a variant
    such as ``pytorch_fp16_cuda`` or ``pytorch_fp32_cuda_notf32``, whose p50 would rescale
    every speedup of the device), else the first ok PyTorch FP32 row of the device."""
    ref: dict[str, float] = {}
    for r in rows:
        p50 = primary_latency(r).get("p50_ms")
        if not (r["backend"] == "PyTorch" and r["precision"] == "FP32" and r["status"] == "ok"
                and p50):
            continue
        dev = r.get("device") or "cpu"
        if r["tag"] == f"pytorch_fp32_{dev}" or dev not in ref:
            ref[dev] = p50
    return ref


# Separators of a status text's parts: "<status>: <reason>", then "; <note>" per note.
_HEAD, _PART = "\x1e", "\x1f"


def table_rows(rows: list[dict]) -> list[dict]:
    """One dict per report row with the :data:`COLUMNS` keys (strings, ready to print), and
    ``_status_parts``: the status text in parts (``"<status>\\x1e<reason>"``, then one per
    note) for the markdown, which shows a part shared by several rows once."""
    base = next((r for r in rows if r["backend"] == "PyTorch" and r["status"] == "ok"
                 and (r.get("accuracy") or {}).get("top1") is not None), None)
    base_top1 = base["accuracy"]["top1"] if base else None
    pt_ms = speedup_references(rows)
    deploy = {g: primary_latency(b)["p50_ms"] for g, b in deploy_baselines(rows).items()}
    out = []
    for r in rows:
        acc = r.get("accuracy") or {}
        lat = primary_latency(r)
        gpu = (r.get("latency") or {}).get("gpu_compute_ms") or {}
        par = r.get("parity") or {}
        dev = r.get("device") or "cpu"
        ep = (r.get("ep_used") or dev).replace("ExecutionProvider", " EP")
        if r.get("cpu_fallback"):
            ep += " (fallback)"
        status = r["status"]
        if is_stale(r):
            status = f"STALE (see Stale rows) {status}"
        if _is_rerun(r):
            status = f"latest rerun {status} ({r['_file']}; the ok row above is kept)"
        if r.get("status_reason"):  # a measured row's verdict: the metrics out of bounds
            status += _HEAD + verdict_summary(r["status_reason"])
        elif r.get("reason"):
            status += _HEAD + clip_text(r['reason'].splitlines()[0], 320)
        if r.get("nonfinite_outputs"):
            status += _PART + "NON-FINITE OUTPUTS: " + ", ".join(
                f"{n} NaN/Inf values in {k}" for k, n in r["nonfinite_outputs"].items()) + (
                " where the reference is finite (no result: see qdq_tools.py check / "
                "layerwise.py diff for the node)")
        if r.get("synthetic_inputs"):
            status += _PART + ("SYNTHETIC INPUTS: parity on seeded N(0,1) samples, latency and "
                               "structure only (give stage 1 --inputs NPZ)")
        if r.get("qdq_without_int8_macs"):
            status += _PART + ("Q/DQ NODES BUT NO INT8 MAC: the file computes in float "
                               "(qdq_without_int8_macs in the row)")
        if r.get("fp16_computed_in"):
            status += _PART + ("FP16 graph computed in "
                               f"{r['fp16_computed_in'].split(' (')[0]} here")
        diags = r.get("diagnostics") or {}
        bi = diags.get("batch_invariance") or {}
        if bi.get("ok") is False:
            agree = bi.get("top1_agreement")
            status += _PART + (f"BATCH-DEPENDENT OUTPUT: batch 1 vs batch {bi.get('batch')} "
                               f"differ by {bi.get('rel_max_diff', 0):.2g} of max |output|"
                               + (f", top-1 agreement {100 * agree:.1f}%" if agree is not None else ""))
        for name, d in diags.items():
            if isinstance(d, dict) and d.get("status") == "error":
                status += _PART + f"diagnostic {name} failed: {clip_text(str(d.get('error')), 120)}"
        cc = diags.get("backend_cross_check") or {}
        if cc.get("disagreement"):
            if cc.get("top1_unoptimized") is not None:
                status += _PART + ("BACKEND DISAGREEMENT: top-1 "
                                   f"{cc['top1_unoptimized']:.1f}% in the graph's own "
                                   f"Q/DQ numerics ({cc['n']} images)")
            else:  # a model without labels: the cross-check says what differs
                status += _PART + f"BACKEND DISAGREEMENT: {cc.get('reason')}"
            status += f"; cause: {cc['cause']}" if cc.get("cause") else ""
        if r.get("_quant_check") and r["_quant_check"] != "check: clean":
            status += _PART + f"Q/DQ {r['_quant_check']} (qdq_tools.py check)"
        busy = busy_machine_note((r.get("latency") or {}).get("other_cpu"))
        if busy:
            status += _PART + f"BUSY MACHINE while timed: {busy} (latency not comparable)"
        elif lat.get("mean_ms") and lat.get("p50_ms") and lat["mean_ms"] > 1.5 * lat["p50_ms"]:
            status += _PART + (f"noisy timing: mean {lat['mean_ms']:.1f} ms vs p50 "
                               f"{lat['p50_ms']:.1f} ms (busy machine?)")
        top1 = acc.get("top1")
        speed = (pt_ms[dev] / lat["p50_ms"]) if lat.get("p50_ms") and dev in pt_ms else None
        g = deploy_group(r)
        dspeed = deploy[g] / lat["p50_ms"] if lat.get("p50_ms") and g in deploy else None
        out.append({
            "backend": r["backend"], "precision": r["precision"], "tag": r["tag"],
            "EP/device": ep, "images": _fmt(r.get("n_images")), "top-1 %": _fmt(top1),
            "top-5 %": _fmt(acc.get("top5")),
            "delta top-1": _fmt(top1 - base_top1) if top1 is not None and base_top1 is not None
            else "",
            "INT8 MACs %": _fmt(100 * r["_int8_macs"], 1) if isinstance(
                r.get("_int8_macs"), (int, float)) else "",
            "p50 ms": _fmt(lat.get("p50_ms"), 3), "GPU compute p50 ms": _fmt(gpu.get("p50_ms"), 3),
            "FPS": _fmt(lat.get("fps"), 1),
            "speedup vs PyTorch FP32": f"{speed:.2f}x" if speed else ("n/a" if lat else ""),
            "speedup vs ORT/TRT FP32": f"{dspeed:.2f}x" if dspeed else (
                "n/a" if lat and g is not None else ""),
            "size MB": _fmt(r.get("size_mb")),
            "cosine sim": _fmt(par.get("cosine_mean"), 5) if par else
            ("reference" if r.get("reference") else ""),
            "top-1 agree %": _fmt(par.get("top1_agreement"), 1),
            "status": status.replace(_HEAD, ": ").replace(_PART, "; "),
            "_status_parts": status.split(_PART)})
    return out


# Columns that name a row: always shown. MD_HIDDEN: in REPORT.csv only (FPS = 1000 / mean ms).
_IDENTITY = ("backend", "precision", "tag", "EP/device", "status")
MD_HIDDEN = ("FPS",)


def markdown_table(trs: list[dict]) -> str:
    """The markdown of :func:`table_rows`, shortened for reading: a column whose filled cells
    all hold one value (e.g. ``images``) is one "same in every row" line above the table, a
    column empty in every row is left out, :data:`MD_HIDDEN` columns stay in REPORT.csv, and a
    status part (reason or note) that several rows share becomes ``[n]`` in their cells, its
    text written once below the table with the rows' tags."""
    if not trs:
        return ""
    cols, same = [], []
    for c in COLUMNS:
        vals = {t[c] for t in trs if t[c] != ""}
        if c in _IDENTITY or (c not in MD_HIDDEN and len(vals) > 1):
            cols.append(c)
        elif len(vals) == 1 and c not in MD_HIDDEN:
            same.append(f"{c} {vals.pop()}")
    parts = [t.get("_status_parts") or [t["status"].replace(": ", _HEAD, 1)] for t in trs]
    texts: dict[str, list[str]] = {}
    for t, ps in zip(trs, parts):
        for i, p in enumerate(ps):
            text = p.split(_HEAD, 1)[1] if i == 0 and _HEAD in p else (p if i else "")
            if text and t["tag"] not in texts.setdefault(text, []):
                texts[text].append(t["tag"])
    shared = {text: n for n, text in enumerate(
        (x for x, tags in texts.items() if len(tags) > 1), 1)}

    def cell(ps: list[str]) -> str:
        word, _, head = ps[0].partition(_HEAD)
        out = word + ((f" [{shared[head]}]" if head in shared else f": {head}") if head else "")
        for p in ps[1:]:
            out += f" [{shared[p]}]" if p in shared else f"; {p}"
        return out

    buf = io.StringIO()
    if same:
        buf.write("Same in every row that has a value: " + "; ".join(same) + ". ")
    buf.write("FPS and the full status texts: REPORT.csv.\n\n")
    buf.write("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
    for t, ps in zip(trs, parts):
        row = {**t, "status": cell(ps)}
        buf.write("| " + " | ".join(row[c].replace("|", "/") for c in cols) + " |\n")
    if shared:
        buf.write("\nShared by several rows:\n\n")
        for text, n in shared.items():
            buf.write(f"- [{n}] {', '.join(texts[text])}: {text.replace('|', '/')}\n")
    return buf.getvalue()


def verdict_summary(reason: str, n: int = 2) -> str:
    """The first ``n`` metrics of a row's ``status_reason`` (its cross-check part is left to
    the BACKEND DISAGREEMENT note), ``+k more`` for the rest."""
    parts = [p for p in reason.split("; ") if not p.startswith("the backend cross-check")]
    more = f" (+{len(parts) - n} more)" if len(parts) > n else ""
    return clip_text("; ".join(parts[:n]), 240) + more


def split_builds(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(run rows for the table, stage-6 engine-build rows listed separately)``."""
    return ([r for r in rows if r.get("stage") != "6_build_engines"],
            [r for r in rows if r.get("stage") == "6_build_engines"])


GPU_COLUMNS = ["tag", "GPU", "eager / end-to-end", "GPU compute", "CUDA graph",
               "device buffers", "torch.compile", "batch", "throughput img/s", "TF32"]


def gpu_table(rows: list[dict]) -> str:
    """Markdown table of the GPU rows' latency figures (empty string when there is none)."""
    out = []
    for r in rows:
        if r.get("device") != "cuda" or r["status"] != "ok" or not r.get("latency"):
            continue
        lat, big = r["latency"], r.get("latency_batch") or {}
        p50 = {k: _fmt((lat.get(f"{k}_ms") or {}).get("p50_ms"), 3)
               for k in ("end_to_end", "gpu_compute", "cuda_graph", "device_buffers", "compile")}
        for k in ("cuda_graph", "device_buffers"):
            if lat.get(f"{k}_error"):
                p50[k] = "n/a: " + clip_text(lat[f"{k}_error"], 90).replace("|", "/")
        tf32 = (r.get("runtime") or {}).get("tf32")
        out.append([r["tag"], r.get("device_name") or "", p50["end_to_end"], p50["gpu_compute"],
                    p50["cuda_graph"], p50["device_buffers"], p50["compile"],
                    _fmt(big.get("batch")),
                    _fmt((big.get("end_to_end_ms") or {}).get("fps"), 0),
                    "" if tf32 is None else ("on" if any(tf32.values()) else "off")])
    if not out:
        return ""
    return ("| " + " | ".join(GPU_COLUMNS) + " |\n|" + "---|" * len(GPU_COLUMNS) + "\n"
            + "".join("| " + " | ".join(row) + " |\n" for row in out))


_COLORS = {"FP32": "tab:blue", "FP16": "tab:green", "INT8": "tab:red", "INT4": "tab:purple"}


def _spread(ys: list[float], gap: float, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    """Positions for labels wanted at ``ys`` (axes fraction), in the same order, each at least
    ``gap`` from the next and kept within ``lo..hi``: a deterministic push up, then down."""
    order = sorted(range(len(ys)), key=lambda i: (ys[i], i))
    gap = min(gap, (hi - lo) / max(len(ys), 1))
    pos = [min(max(ys[i], lo), hi) for i in order]
    for k in range(1, len(pos)):
        pos[k] = max(pos[k], pos[k - 1] + gap)
    if pos and pos[-1] > hi:
        pos[-1] = hi
        for k in range(len(pos) - 2, -1, -1):
            pos[k] = min(pos[k], pos[k + 1] - gap)
    out = [0.0] * len(ys)
    for k, i in enumerate(order):
        out[i] = pos[k]
    return out


def accuracy_axis(points: list[float], ref: float | None, budget: Budget) -> tuple[float, float]:
    """The top-1 axis (%) of the accuracy plot, zoomed on the rows that hold: those within
    ``max(2, 4 x max_top1_drop)`` points of the reference ``ref`` (all rows when there is no
    reference), the reference and its budget line; rows below are drawn at the lower edge."""
    near = max(2.0, 4 * budget.max_top1_drop)
    hold = [y for y in points if ref is None or y >= ref - near] or points
    lo, hi = min(hold), max(hold)
    if ref is not None:
        lo, hi = min(lo, ref - budget.max_top1_drop), max(hi, ref)
    pad = max(0.2, 0.15 * (hi - lo))
    return lo - pad, hi + pad


def accuracy_latency_figure(rows: list[dict], budget: Budget | None = None):
    """Top-1 against batch-1 p50 latency, one panel per device (cpu, cuda), as a matplotlib
    figure (the caller saves and closes it), or None without a row to plot.

    Every ok/warn row with top-1 and latency is a marker (square: PyTorch; colour: precision);
    its label sits in a column right of the panel, spread so labels never overlap, joined to
    the marker by a leader line. The top-1 axis is zoomed on the rows that hold
    (:func:`accuracy_axis`); a row far below is a triangle on the lower edge with its top-1 in
    its label. A dashed line marks the budget (PyTorch FP32 top-1 - ``max_top1_drop``); each
    group's recommended row (:func:`deploykit.verdict.verdicts`) is a star whose legend label
    is ``ship <group>: <tag>``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = budget or Budget()
    pts = [r for r in rows if r["status"] in ("ok", "warn") and not _is_rerun(r)
           and (r.get("accuracy") or {}).get("top1") is not None
           and primary_latency(r).get("p50_ms")]
    if not pts:
        return None
    vs = verdicts(rows, budget)
    ship = {id(v["ship"]): v["group"] for v in vs if v["ship"] is not None}
    ref = vs[0]["reference"] if vs else None
    ref_top1 = ((ref or {}).get("accuracy") or {}).get("top1")
    devs = [d for d in ("cpu", "cuda") if any((r.get("device") or "cpu") == d for r in pts)]
    devs += sorted({r.get("device") or "cpu" for r in pts} - set(devs))
    from matplotlib.ticker import FormatStrFormatter

    # inches: each panel 5 wide, its label column 2.9, the y label 0.9
    n, panel, labels, left = len(devs), 5.0, 2.9, 0.9
    width = n * (left + panel + labels)
    fig, axes = plt.subplots(1, n, figsize=(width, 6.0), squeeze=False)
    fig.subplots_adjust(left=left / width, right=1 - labels / width,
                        wspace=(left + labels) / panel, bottom=0.3, top=0.93)
    for ax, dev in zip(axes[0], devs):
        mine = [r for r in pts if (r.get("device") or "cpu") == dev]
        ys = [r["accuracy"]["top1"] for r in mine]
        lo, hi = accuracy_axis(ys, ref_top1, budget)
        xs = [primary_latency(r)["p50_ms"] for r in mine]
        ax.set_xscale("log")
        for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis(FormatStrFormatter("%g"))
        ax.tick_params(axis="x", which="minor", labelsize=6)
        ax.set_xlim(min(xs) / 1.25, max(xs) * 1.25)
        ax.set_ylim(lo, hi)
        wanted, texts = [], []
        for r, x, y in zip(mine, xs, ys):
            below = y < lo
            shown = lo if below else y
            ax.scatter([x], [shown], color=_COLORS.get(r["precision"][:4], "0.4"), s=36,
                       marker="v" if below else ("s" if r["backend"] == "PyTorch" else "o"),
                       clip_on=False, zorder=3)
            if id(r) in ship:
                ax.scatter([x], [shown], marker="*", s=260, facecolor="none",
                           edgecolor="black", linewidth=1.2, zorder=4,
                           label=f"ship {ship[id(r)]}: {r['tag']}")
            wanted.append((shown - lo) / (hi - lo))
            texts.append(r["tag"] + (f" (top-1 {y:.2f} %, off the axis)" if below else "")
                         + (" <- ship" if id(r) in ship else ""))
        for (r, x, shown), yf, text in zip(
                [(r, x, lo if y < lo else y) for r, x, y in zip(mine, xs, ys)],
                _spread(wanted, 0.055), texts):
            ax.annotate(text, (x, shown), xytext=(1.03, yf), textcoords="axes fraction",
                        va="center", fontsize=7, annotation_clip=False,
                        fontweight="bold" if id(r) in ship else "normal",
                        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.55",
                                    "shrinkA": 0, "shrinkB": 3})
        if ref_top1 is not None:
            ax.axhline(ref_top1 - budget.max_top1_drop, ls="--", lw=0.8, color="0.4",
                       label=f"budget: PyTorch FP32 top-1 - {budget.max_top1_drop:g} points")
        ax.set_xlabel("batch-1 end-to-end p50 latency (ms, log)")
        ax.set_ylabel("top-1 (%), zoomed on the rows that hold")
        ax.set_title(f"{dev.upper()} rows", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        handles, labels = ax.get_legend_handles_labels()
        handles += [plt.Line2D([], [], marker="o", ls="", color=c, label=p)
                    for p, c in _COLORS.items()]
        ax.legend(handles=handles, fontsize=7, loc="upper center", ncol=2,
                  bbox_to_anchor=(0.5, -0.13), frameon=False)
    return fig


def size_notes(rows: list[dict]) -> list[str]:
    """Footnotes on sizes: what a variant's ONNX file holds when its size is not its precision's
    (from the variant registry, :mod:`deploykit.variants`): a Q/DQ file keeps float weights with
    a QuantizeLinear per weight (FP16 or FP32 by its high-precision dtype) - the TensorRT engine
    built from it stores INT8 weights; INT4 weight-only quantizes Gemm/MatMul weights only."""

    notes = []
    for name in dict.fromkeys(_variant(r) for r in rows if r.get("size_mb")
                              and r["backend"] == "ORT"):
        v = VARIANTS.get(name)
        if v is None:
            continue
        if v.kind == "qdq":
            dt = "FP16" if v.high_precision_fp16 else "FP32"
            notes.append(f"{name}: the Q/DQ ONNX stores {dt} weights + scales (a "
                         "QuantizeLinear per weight), so it is as large as the "
                         f"{dt} file; the TensorRT engine stores INT8")
        elif v.kind == "int4":
            notes.append(f"{name}: INT4 weight-only on Gemm/MatMul weights only; the other "
                         "layers keep FP32 weights")
    return notes


def render_plots(rows: list[dict], folder: Path, budget: Budget | None = None
                 ) -> dict[str, str]:
    """PNGs beside the report: :func:`accuracy_latency_figure` and model size per row
    (colour: precision; :func:`size_notes` as footnotes; the rows to ship marked).

    Returns:
        ``{file name: alt text}`` of the plots written (none without an ok row with numbers).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    fig = accuracy_latency_figure(rows, budget)
    if fig is not None:
        with atomic_path(folder / "accuracy_latency.png") as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        out["accuracy_latency.png"] = "top-1 against batch-1 latency"
    sized = [r for r in rows if r["status"] in ("ok", "warn") and r.get("size_mb")
             and r["backend"] != "PyTorch" and not _is_rerun(r)]
    if sized:
        ships = {id(v["ship"]) for v in verdicts(rows, budget or Budget())}
        notes = size_notes(sized)
        fig, ax = plt.subplots(figsize=(8, 0.3 * len(sized) + 1.4 + 0.18 * len(notes)))
        ax.barh([r["tag"] + (" (ship)" if id(r) in ships else "") for r in sized],
                [r["size_mb"] for r in sized],
                color=[_COLORS.get(r["precision"][:4], "0.4") for r in sized])
        ax.invert_yaxis()
        ax.set_xlabel("size (MB): the ONNX file of ORT rows, the engine of TensorRT rows")
        ax.set_title("model / engine size by row (colour = precision)", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        if notes:
            h = fig.get_size_inches()[1]
            fig.subplots_adjust(bottom=(0.5 + 0.18 * len(notes)) / h)
            fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom")
        with atomic_path(folder / "size.png") as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        out["size.png"] = "model size by precision"
    return out


def render_markdown(model: str, rows: list[dict], data: dict | None,
                    trs: list[dict] | None = None, plots: dict[str, str] | None = None,
                    budget: Budget | None = None) -> str:
    """The report as markdown: the verdict per deployment group (:mod:`deploykit.verdict`,
    under ``budget``, default :class:`Budget`), a header naming data and machine, the table,
    the GPU details, the plots (``{file: alt}`` relative to the report) and the engine builds
    (``trs``: the :func:`table_rows` of the run rows, when the caller already has them)."""
    runs, builds = split_builds(rows)
    trs = table_rows(runs) if trs is None else trs
    budget = budget or Budget()
    buf = io.StringIO()
    buf.write(f"# Deployment report: {model}\n\n")
    buf.write(render_verdicts(verdicts(runs, budget), budget))
    buf.write("## Rows\n\n")
    if data:
        buf.write(f"Data: {data.get('n_eval')} eval images ({data.get('layout')}, "
                  f"{data.get('data_root')}); {data.get('n_calib')} disjoint calibration images; "
                  f"preprocessing {data.get('preprocessing')}.")
        if data.get("n_tune"):
            buf.write(f" {data['n_tune']} more images (disjoint from both) form the tuning split "
                      "of the mixed-precision search (int8_auto); the evaluation split is smaller "
                      "by as many.")

        def split_size(r):  # the samples a row's split had: a first-look row ran fewer
            return (r.get("first_look") or {}).get("n_total") or r.get("n_images")

        looked = [r for r in rows if (r.get("first_look") or {}).get("decided")]
        fewer = sorted({split_size(r) for r in rows if split_size(r)
                        and split_size(r) != data.get("n_eval")})
        if looked:
            each = ", ".join(f"`{r['tag']}` on {r['n_images']} of {split_size(r)}"
                             for r in sorted(looked, key=lambda r: (r["n_images"], r["tag"])))
            buf.write(f" Failed beyond doubt on a first look at seeded-random images, not run on "
                      f"the rest: {each} (3_onnx_eval.py --full-eval measures every image).")
        if fewer:
            buf.write(f" Some rows ran on fewer images ({', '.join(map(str, fewer))}: "
                      "--limit): compare rows with the same image count only.")
        buf.write("\n\n")
    machines: dict[str, list[str]] = {}
    for r in rows:
        prov = r.get("provenance")
        if not prov:
            continue
        d, v = prov["device"], prov["versions"]
        gpu = f"{d.get('gpu')} (driver {d.get('driver')})" if d.get("gpu") else "none"
        line = (f"{d.get('cpu')} ({d.get('cpu_count')} cores), GPU: {gpu}; torch "
                f"{v.get('torch')}, onnxruntime {v.get('onnxruntime-gpu') or v.get('onnxruntime')}"
                f"{' (GPU build)' if v.get('onnxruntime-gpu') else ''}, modelopt "
                f"{v.get('nvidia-modelopt')}, TensorRT {v.get('tensorrt') or 'not installed'}")
        machines.setdefault(line, []).append(r.get("_source") or "")
    for line, srcs in machines.items():
        src = next((s for s in srcs if s), None)
        buf.write(f"Machine{' of the rows from ' + src if src else ''}: {line}.\n\n")
    buf.write("Latency: batch 1, median (p50) of the timed runs after warm-up, end to end (host "
              "arrays in and out); GPU rows also give the GPU Compute Time (CUDA events); p90/p99 "
              "and the timer of each row are in its JSON. Speedup vs PyTorch FP32 = the PyTorch "
              "FP32 p50 on the same device / this row's p50; speedup vs ORT/TRT FP32 = the "
              "deployment baseline's p50 / this row's: ORT FP32 on the same EP (CPU EP, CUDA EP), the "
              "TensorRT FP32 engine for TensorRT rows. Parity vs PyTorch FP32 logits.\n\n")
    buf.write(markdown_table(trs))
    busy = [r["tag"] for r in runs if busy_machine_note((r.get("latency") or {}).get("other_cpu"))]
    if busy:
        buf.write("\nTimed on a busy machine (other processes used at least "
                  f"{BUSY_CORES:g} of a core during the timed loop): "
                  + ", ".join(f"`{t}`" for t in busy) + ". Their latency, and every speedup "
                  "against them, is not comparable with the other rows': rerun their stages on a "
                  "quiet machine.\n")
    buf.write(stale_section(rows))
    warn = artifacts_warning(model, rows)
    if warn:
        buf.write(f"\n{warn}\n")
    gpu = gpu_table(runs)
    if gpu:
        buf.write("\nGPU rows in detail (batch 1 p50 ms unless named; CUDA graph = replay of a "
                  "captured graph, no launch overhead; device buffers = ORT I/O binding, no host "
                  "copies; throughput at the row's --latency-batch):\n\n" + gpu)
    if plots:
        buf.write("\n" + "".join(f"![{alt}]({name})\n" for name, alt in plots.items()))
        notes = size_notes([r for r in runs if r["status"] in ("ok", "warn")])
        if notes and "size.png" in plots:
            buf.write("\nSizes: " + "; ".join(notes) + ".\n")
    if any(_variant(r) == "int8_auto" for r in runs):
        buf.write("\nint8_auto: which nodes stay in float, each node's sensitivity and MACs, and "
                  "the budget on the tuning and evaluation splits: "
                  "[auto_precision.md](auto_precision.md).\n")
    if builds:
        buf.write("\nTensorRT engine builds (stage 6):\n\n| variant | status | detail |\n"
                  "|---|---|---|\n")
        same: dict[tuple[str, str], list[str]] = {}  # one line per (status, detail)
        for b in builds:
            detail = (b.get("reason") or b.get("plan") or "").splitlines()
            st = b["status"] + (f" (latest rerun, {b['_file']}; the ok row above is kept)"
                                if _is_rerun(b) else "")
            key = (st, clip_text(detail[0] if detail else "", 200).replace("|", "/"))
            same.setdefault(key, []).append(b["tag"].removeprefix("trt_build_"))
        for (st, detail), names in same.items():
            buf.write(f"| {', '.join(names)} | {st} | {detail} |\n")
    return buf.getvalue()


def gpu_rows(model: str, folder: Path) -> list[dict]:
    """The GPU rows (``device == "cuda"``) of ``results/gpu/<model>/`` (made on a GPU machine by
    ``benchmarks/gpu_rows.sh``), shown beside this machine's rows; each gets ``_source``."""
    gpu = results_dir() / "gpu" / model_tag(model)
    if not gpu.is_dir() or gpu.resolve() == folder.resolve():
        return []
    rel = f"results/gpu/{model_tag(model)}"
    return [dict(r, _source=rel) for r in load_rows(gpu) if r.get("device") == "cuda"]


def summary(model: str, runs: list[dict], path: Path, budget: Budget | None = None) -> str:
    """One console line: rows ok/failed/skipped, the row to ship per deployment group (the
    verdict under ``budget``), the best quantized recipe by top-1 agreement with FP32 and its
    speedup vs PyTorch FP32, and where the report is."""
    stale = [r for r in runs if is_stale(r)]
    runs = [r for r in runs if not is_stale(r)]  # stale rows: neither counted nor chosen
    st = {k: sum(r["status"] == k for r in runs)
          for k in ("ok", "warn", "failed", "skipped", "not run", "invalid")}
    # A rerun's failure kept beside a good row has the same tag: look the good row up.
    trs = {t["tag"]: t for r, t in zip(runs, table_rows(runs)) if not _is_rerun(r)}
    q = [r for r in runs if r["status"] == "ok" and r["precision"][:3] == "INT"
         and not r.get("nonfinite_outputs")
         and (r.get("parity") or {}).get("top1_agreement") is not None
         and (r.get("accuracy") or {}).get("top1") is not None]  # custom models: no top-1
    best = max(q, key=lambda r: r["parity"]["top1_agreement"], default=None)
    bits = [f"report {model}: {st['ok']} ok, " + (f"{st['warn']} warn, " if st["warn"] else "")
            + f"{st['failed']} failed, {st['skipped']} skipped"
            + (f", {st['not run']} not run" if st["not run"] else "")
            + (f", {st['invalid']} invalid" if st["invalid"] else "")
            + (f", {len(stale)} stale (not counted: "
               + ", ".join(r["tag"] for r in stale) + "; see Stale rows)" if stale else "")]
    vs = verdicts(runs, budget or Budget())
    if vs:
        bits.append("ship: " + ", ".join(f"{v['group']} {v['ship']['tag'] if v['ship'] else 'none'}"
                                         for v in vs))
    if best:
        bits.append(f"best quantized row {best['tag']} (top-1 {best['accuracy']['top1']:.2f}%, "
                    f"agreement {best['parity']['top1_agreement']:.1f}%, speedup "
                    f"{trs[best['tag']]['speedup vs PyTorch FP32'] or 'n/a'} vs PyTorch FP32)")
    failed = [r["tag"] + (" (a rerun; its ok row is kept)" if _is_rerun(r) else "")
              for r in runs if r["status"] == "failed"]
    if failed:
        bits.append("failed: " + ", ".join(failed))
    warned = [r["tag"] for r in runs if r["status"] == "warn"]
    if warned:
        bits.append("warn: " + ", ".join(warned))
    invalid = [r["_file"] for r in runs if r["status"] == "invalid"]
    if invalid:
        bits.append("invalid (see the warnings): " + ", ".join(invalid))
    return "; ".join(bits) + f" -> {path}"
