"""The cross-model report: every model x variant x target, the verdict per target, Pareto plots.

Rows are the stages' results JSON (``results/<model>/<tag>.json``). For each pipeline:

- the **reference** is its PyTorch FP32 row (``backend == "PyTorch"``, ``precision == "FP32"``,
  status ok; the CPU one first);
- a target's **candidates** are the rows of the requested variants that ran on that target:
  ``rows = "cpu"`` targets take ORT rows on the CPU EP, ``rows = "trt"`` targets TensorRT rows;
- a candidate is **within budget** (defaults: :class:`deploykit.sweep.spec.Budget`) when its
  top-1 agreement with the reference is >= ``min_agreement`` % and, when both have accuracy,
  its top-1 is at most ``max_top1_drop`` points below the reference's; a row without accuracy
  (custom models) needs mean logits cosine >= ``min_cosine`` instead. A row with non-finite
  outputs, or whose status is neither ``ok`` nor ``warn`` (a measured row outside its
  precision's ok band: the budget decides), never is.

The **verdict** of a target is the fastest candidate within budget (batch-1 end-to-end p50, ms)
over all models; each (model, target) also gets its own fastest. The reference itself is shown
but is not a candidate: a deployment ships the exported model.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from deploykit.sweep.spec import Budget
from deploykit.sweep.stamp import write_atomic


def p50_ms(row: dict) -> float | None:
    """Batch-1 end-to-end p50 latency of a row.

    Args:
        row: a results row.

    Returns:
        milliseconds, or None when the row has no latency.
    """
    lat = (row.get("latency") or {}).get("end_to_end_ms") or {}
    v = lat.get("p50_ms")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def top1(row: dict) -> float | None:
    """Top-1 accuracy of a row.

    Args:
        row: a results row.

    Returns:
        top-1 in %, or None (custom models have no labels; accuracy stages do not apply).
    """
    v = (row.get("accuracy") or {}).get("top1")
    return float(v) if isinstance(v, (int, float)) else None


def parity(row: dict) -> dict:
    """The row's parity against PyTorch FP32: its ``parity`` block, else the worst output's.

    Args:
        row: a results row.

    Returns:
        ``{"top1_agreement": % or None, "cosine_mean": float or None}``.
    """
    p = row.get("parity")
    if not p and row.get("parity_outputs"):
        outs = list(row["parity_outputs"].values())
        agree = [o.get("top1_agreement") for o in outs if o.get("top1_agreement") is not None]
        cos = [o.get("cosine_mean") for o in outs if o.get("cosine_mean") is not None]
        p = {"top1_agreement": min(agree) if agree else None,
             "cosine_mean": min(cos) if cos else None}
    p = p or {}
    return {"top1_agreement": p.get("top1_agreement"), "cosine_mean": p.get("cosine_mean")}


def reference_row(rows: list[dict]) -> dict | None:
    """The PyTorch FP32 reference of a pipeline's rows (CPU first).

    Args:
        rows: the pipeline's rows.

    Returns:
        the row, or None.
    """
    refs = [r for r in rows if r.get("backend") == "PyTorch" and r.get("precision") == "FP32"
            and r.get("status") == "ok"]
    refs.sort(key=lambda r: r.get("device") != "cpu")
    return refs[0] if refs else None


def is_target_row(row: dict, kind: str) -> bool:
    """Whether a row was computed on a target of this kind.

    Args:
        row: a results row. kind: ``"cpu"`` or ``"trt"``.

    Returns:
        True for ORT rows on the CPU EP (kind cpu) or TensorRT rows (kind trt).
    """
    if kind == "trt":
        return row.get("backend") == "TensorRT"
    ep = row.get("ep_used") or row.get("ep_requested")
    return row.get("backend") == "ORT" and (row.get("device") == "cpu" or
                                            ep == "CPUExecutionProvider")


def judge(row: dict, ref: dict | None, budget: Budget) -> tuple[bool, str]:
    """Whether a candidate row is within the accuracy budget (module docstring).

    Args:
        row: the candidate. ref: the model's PyTorch FP32 row (None: nothing to compare).
        budget: the budget.

    Returns:
        ``(within, reason)``; the reason names the failed bound with both numbers.
    """
    # warn: a measured row outside its precision's ok band (deploykit.evaluate.judge): the
    # budget below decides; failed: broken (or not measured), never within any budget
    if row.get("status") not in ("ok", "warn"):
        return False, f"status {row.get('status')}" + (
            f": {row['status_reason']}" if row.get("status_reason") else "")
    if row.get("nonfinite_outputs"):
        return False, "non-finite outputs"
    if ref is None:
        return False, "no PyTorch FP32 reference row"
    par = parity(row)
    agree = par["top1_agreement"]
    if agree is None:
        return False, "no top-1 agreement in the row"
    if agree < budget.min_agreement:
        why = f"agreement {agree:.2f} % < {budget.min_agreement:g} %"
        n = row.get("n_images")
        # a miss by one image on a small eval set: say so (noise, not a verdict on the recipe)
        if isinstance(n, int) and 0 < n and 100.0 / n > 100.0 - budget.min_agreement \
                and agree >= budget.min_agreement - 100.0 / n - 1e-9:
            why += f" (on {n} images one flip is {100.0 / n:.2f} %: evaluate more images)"
        return False, why
    t, t_ref = top1(row), top1(ref)
    if t is not None and t_ref is not None:
        drop = t - t_ref
        if drop < -budget.max_top1_drop:
            return False, f"delta top-1 {drop:+.2f} < -{budget.max_top1_drop:g} points"
        return True, f"agreement {agree:.2f} %, delta top-1 {drop:+.2f}"
    cos = par["cosine_mean"]
    if cos is None or cos < budget.min_cosine:
        return False, f"cosine {cos} < {budget.min_cosine:g} (no accuracy: parity budget)"
    return True, f"agreement {agree:.2f} %, cosine {cos:.5f} (no accuracy: parity budget)"


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: lower-or-equal latency and higher-or-equal
    accuracy, one of them strictly.

    Args:
        points: ``(latency ms, accuracy %)`` pairs.

    Returns:
        the indices on the front, by increasing latency.
    """
    front = []
    for i, (li, ai) in enumerate(points):
        dominated = any((lj <= li and aj >= ai) and (lj < li or aj > ai)
                        for j, (lj, aj) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def build_report(pipelines: list[dict], budget: Budget) -> dict:
    """The cross-model table, verdicts and Pareto fronts.

    Args:
        pipelines: one record per (model, target): ``{"id", "model", "target": {"name",
            "rows"}, "variants", "requested", "not_applicable", "status", "error", "rows":
            {file: row dict}}``.
        budget: the accuracy budget.

    Returns:
        ``{"budget", "table": [line dicts], "verdicts": {target: line or None},
        "best_per_model": {target: {model: line}}, "pareto": {target: [lines]},
        "pipelines": [{"id", "status", "error"}]}``; a line holds model, target, variant,
        backend, precision, tag, status, top1, delta_top1, agreement, cosine, p50_ms,
        within_budget, budget_reason, role (reference/candidate/missing).
    """
    table: list[dict] = []
    for p in pipelines:
        model, tname, kind = p["model"]["name"], p["target"]["name"], p["target"]["rows"]
        rows = [r for r in (p.get("rows") or {}).values() if isinstance(r, dict)]
        ref = reference_row(rows)
        base = {"model": model, "target": tname}
        if ref is not None and kind == "cpu":
            table.append({**base, **_metrics(ref, ref), "variant": "pytorch_fp32",
                          "role": "reference", "within_budget": None,
                          "budget_reason": "reference"})
        requested = p.get("requested") or p.get("variants") or []
        na = p.get("not_applicable") or {}
        for v in requested:
            cands = [r for r in rows if r.get("variant") == v and is_target_row(r, kind)]
            # a good row beside its rerun's .failed.json sidecar: both shown, the good one judged
            if not cands:
                why = (f"n/a: {na[v]}" if v in na else
                       f"pipeline {p.get('status')}: {p.get('error')}" if p.get("status") != "ok"
                       else "no row")
                table.append({**base, "variant": v, "backend": None, "precision": None,
                              "tag": None, "status": p.get("status") if v not in na else "n/a",
                              "top1": None, "delta_top1": None, "agreement": None,
                              "cosine": None, "p50_ms": None, "role": "missing",
                              "within_budget": False, "budget_reason": why})
                continue
            for r in cands:
                ok, why = judge(r, ref, budget)
                table.append({**base, **_metrics(r, ref), "variant": v, "role": "candidate",
                              "within_budget": ok, "budget_reason": why})
    verdicts, best, fronts = {}, {}, {}
    for tname in dict.fromkeys(p["target"]["name"] for p in pipelines):
        cands = [ln for ln in table if ln["target"] == tname and ln["role"] == "candidate"
                 and ln["within_budget"] and ln["p50_ms"] is not None]
        verdicts[tname] = min(cands, key=lambda ln: ln["p50_ms"]) if cands else None
        best[tname] = {}
        for ln in sorted(cands, key=lambda ln: ln["p50_ms"]):
            best[tname].setdefault(ln["model"], ln)
        pts = pareto_points(table, tname)
        metric = accuracy_metric(pts)
        pts = [ln for ln in pts if ln[metric] is not None]
        fronts[tname] = [pts[i] for i in pareto_front([(ln["p50_ms"], ln[metric]) for ln in pts])]
    for ln in table:
        v = verdicts.get(ln["target"])
        ln["verdict"] = ("ship" if ln is v else
                         "best for model" if best.get(ln["target"], {}).get(ln["model"]) is ln
                         else "")
    return {"budget": dict(budget.__dict__), "table": table, "verdicts": verdicts,
            "best_per_model": best, "pareto": fronts,
            "pipelines": [{"id": p["id"], "status": p.get("status"), "error": p.get("error"),
                           "rerun_command": p.get("rerun_command")} for p in pipelines]}


def pareto_points(table: list[dict], target: str) -> list[dict]:
    """The lines a target's plot and Pareto front use: candidates that ran (status ok), with a
    latency and finite outputs.

    Args:
        table: :func:`build_report` lines. target: the target name.

    Returns:
        the lines.
    """
    return [ln for ln in table if ln["target"] == target and ln["role"] == "candidate"
            and ln["status"] == "ok" and ln["p50_ms"] is not None and not ln.get("nonfinite")]


def accuracy_metric(lines: list[dict]) -> str:
    """The y axis of a target's plot: ``top1`` when every line has it, else ``agreement``.

    Args:
        lines: table lines.

    Returns:
        ``"top1"`` or ``"agreement"``.
    """
    return "top1" if lines and all(ln["top1"] is not None for ln in lines) else "agreement"


def _metrics(row: dict, ref: dict | None) -> dict:
    t, t_ref = top1(row), top1(ref) if ref else None
    par = parity(row)
    return {"backend": row.get("backend"), "precision": row.get("precision"),
            "tag": row.get("tag"), "status": row.get("status"), "top1": t,
            "delta_top1": (t - t_ref) if t is not None and t_ref is not None else None,
            "agreement": par["top1_agreement"], "cosine": par["cosine_mean"],
            "p50_ms": p50_ms(row), "nonfinite": bool(row.get("nonfinite_outputs"))}


def _fmt(v, nd: int) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def to_markdown(report: dict) -> str:
    """The report as markdown: budget, verdict per target, the table, pipeline problems.

    Args:
        report: :func:`build_report`.

    Returns:
        the markdown text.
    """
    b = report["budget"]
    out = ["# Sweep report", "",
           f"Budget: top-1 agreement >= {b['min_agreement']:g} % and delta top-1 >= "
           f"-{b['max_top1_drop']:g} points vs the model's PyTorch FP32 row; rows without "
           f"accuracy: agreement and mean cosine >= {b['min_cosine']:g}. Verdict: the fastest "
           "row within budget (batch-1 p50).", "", "## Verdict per target", ""]
    for t, v in report["verdicts"].items():
        out.append(f"- **{t}**: " + (f"{v['model']} {v['variant']} ({v['backend']} "
                                     f"{v['precision']}, p50 {v['p50_ms']:.3f} ms, "
                                     f"{v['budget_reason']})" if v else
                                     "no row within budget"))
    out += ["", "## Every model x variant x target", "",
            "| model | target | variant | backend | precision | status | top-1 % | delta top-1 |"
            " agree % | cosine | p50 ms | budget | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ln in report["table"]:
        budget = ("reference" if ln["role"] == "reference" else
                  ("within: " if ln["within_budget"] else "out: ") + ln["budget_reason"])
        out.append("| " + " | ".join([
            ln["model"], ln["target"], ln["variant"], _fmt(ln["backend"], 0),
            _fmt(ln["precision"], 0), _fmt(ln["status"], 0), _fmt(ln["top1"], 2),
            _fmt(ln["delta_top1"], 2), _fmt(ln["agreement"], 1), _fmt(ln["cosine"], 5),
            _fmt(ln["p50_ms"], 3), budget.replace("|", "/"),
            "**ship**" if ln["verdict"] == "ship" else ln["verdict"]]) + " |")
    bad = [p for p in report["pipelines"]
           if p["status"] not in ("ok", "up_to_date", "not_applicable")]
    if bad:
        out += ["", "## Pipelines that did not finish", ""]
        for p in bad:
            out.append(f"- `{p['id']}`: {p['status']}: {p['error']}" +
                       (f"; rerun: `{p['rerun_command']}`" if p.get("rerun_command") else ""))
    return "\n".join(out) + "\n"


def plot_target(report: dict, target: str, path: Path) -> bool:
    """Accuracy vs latency of one target's candidates, Pareto front marked, verdict starred.

    Args:
        report: :func:`build_report`. target: the target name.
        path: the PNG to write (written atomically).

    Returns:
        True when written; False when the target has no candidate with latency.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = pareto_points(report["table"], target)
    metric = accuracy_metric(pts)
    pts = [ln for ln in pts if ln[metric] is not None]
    if not pts:
        return False
    front = report["pareto"].get(target) or []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ln in pts:
        ax.scatter(ln["p50_ms"], ln[metric], s=36,
                   color="tab:blue" if ln["within_budget"] else "tab:gray", zorder=3)
        ax.annotate(f"{ln['model'].split(':')[-1]} {ln['variant']}", (ln["p50_ms"], ln[metric]),
                    fontsize=7, xytext=(4, 3), textcoords="offset points")
    if front:
        ax.plot([ln["p50_ms"] for ln in front], [ln[metric] for ln in front], "-o",
                color="tab:orange", mfc="none", ms=10, label="Pareto front", zorder=2)
    v = report["verdicts"].get(target)
    if v is not None and v[metric] is not None:
        ax.scatter(v["p50_ms"], v[metric], marker="*", s=220, color="tab:red", zorder=4,
                   label="verdict (fastest within budget)")
    lats = [ln["p50_ms"] for ln in pts]
    log_x = min(lats) > 0 and max(lats) / min(lats) > 10  # log only when it spans a decade
    if log_x:
        ax.set_xscale("log")
    ax.margins(x=0.2, y=0.1)
    ax.set_xlabel("batch-1 p50 latency, ms" + (" (log)" if log_x else ""))
    ax.set_ylabel("top-1 %" if metric == "top1" else "top-1 agreement with PyTorch FP32, %")
    ax.set_title(f"target {target}: accuracy vs latency (gray: outside the budget)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    try:
        write_atomic(path, writer=lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return True


def write_report(report: dict, out: Path) -> dict[str, Path]:
    """Write REPORT.md, report.json and one ``pareto_<target>.png`` per target.

    Args:
        report: :func:`build_report`. out: the sweep folder.

    Returns:
        ``{"markdown": path, "json": path, "plot:<target>": path, ...}`` of the files written.

    Raises:
        OSError: the folder cannot be written.
    """
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, text in (("REPORT.md", to_markdown(report)),
                       ("report.json", json.dumps(report, indent=1, default=str))):
        write_atomic(out / name, text)
        files["markdown" if name.endswith(".md") else "json"] = out / name
    for t in report["verdicts"]:
        path = out / f"pareto_{t}.png"
        if plot_target(report, t, path):
            files[f"plot:{t}"] = path
    return files
