"""The search's record: paths, publishing next to the installed file, the sensitivity plot and
the markdown summary.
"""
from __future__ import annotations

import shutil
from pathlib import Path
import numpy as np

from deploykit.io import require
from deploykit.io import atomic_path, load_json, write_json
from deploykit.layout import model_artifacts
from deploykit.quant.auto.search import cosine_error, fmt_metrics


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------
def record_paths(model: str, out_dir: Path | None = None,
                 stem: str = "auto_precision") -> dict[str, Path]:
    """``{"json", "md", "png"}``: ``<out_dir>/<stem>.*``, by default in the search's work folder
    ``artifacts/<model>/auto_precision/``. ``results/<model>/auto_precision.*`` are written only
    by :func:`publish` (``5_quantize.sh int8_auto`` once the file it describes is installed), so
    a search by hand or a run that fails verification never replaces the record of the
    installed ``int8_auto.onnx``."""
    d = Path(out_dir) if out_dir else model_artifacts(model) / "auto_precision"
    return {k: d / f"{stem}.{k}" for k in ("json", "md", "png")}


def publish(src_dir: Path, dst_dir: Path, failed: bool = False) -> dict[str, Path]:
    """Copy a search record (``auto_precision.{json,md,png}`` in ``src_dir``) to ``dst_dir``
    as ``auto_precision.*``, or as ``auto_precision.failed.*`` beside the good one when
    ``failed`` (the run's file was not installed); the record's ``outputs`` and the markdown's
    image link name the published files. Each file is written atomically.

    Raises:
        StageError: no record in ``src_dir``.
    """
    src = record_paths("", src_dir)
    rec = load_json(require(src["json"], "auto_precision.py search"))
    dst = record_paths("", dst_dir, "auto_precision.failed" if failed else "auto_precision")
    rec["outputs"] = {k: str(v) for k, v in dst.items()}
    rec["published"] = {"failed": failed, "from": str(src_dir)}
    if src["png"].exists() and rec.get("plot", True):
        with atomic_path(dst["png"]) as tmp:
            shutil.copyfile(src["png"], tmp)
    else:
        rec["plot"] = False
        dst["png"].unlink(missing_ok=True)
    write_json(dst["json"], rec)
    with atomic_path(dst["md"]) as tmp:
        tmp.write_text(render_markdown(rec))
    return dst


def plot_sensitivity(rec: dict, path: Path) -> Path:
    """PNG of the per-node sensitivity (graph order): cosine error added when the node alone is
    INT8 and removed when it alone is kept in float (log scale), each node's share of the MACs
    (nodes kept in float marked), and the ranking path: % of MACs in INT8 against the tuning
    split's cosine error and top-1 agreement, with the budget and the choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rec["candidates"]
    x = np.arange(len(rows))
    floor = 1e-7
    added = np.maximum([r["cosine_error_added"] for r in rows], floor)
    removed = np.maximum([r["cosine_error_removed"] for r in rows], floor)
    share = np.array([100 * (r["mac_share"] or 0) for r in rows])
    kept = np.array([r["kept_float"] for r in rows])
    fig = plt.figure(figsize=(max(8, 0.22 * len(rows) + 2), 10))
    grid = fig.add_gridspec(3, 1, height_ratios=[2.2, 1, 1.8], hspace=0.55)
    ax = fig.add_subplot(grid[0])
    bx = fig.add_subplot(grid[1], sharex=ax)
    cx = fig.add_subplot(grid[2])
    w = 0.4
    ax.bar(x - w / 2, added, w, color="tab:red", label="1 - cosine, node alone in INT8")
    ax.bar(x + w / 2, removed, w, color="tab:blue",
           label="cosine gained, node alone kept in float")
    ax.set_yscale("log")
    ax.set_ylabel("logits cosine error")
    budget = rec["budget"].get("min_cosine")
    if budget is not None:
        ax.axhline(1 - budget, color="0.3", ls="--", lw=0.8, label=f"1 - budget ({budget})")
    full = cosine_error(rec["full_int8"])
    ax.axhline(max(full, floor), color="tab:red", ls=":", lw=0.8,
               label=f"all INT8 (cosine {1 - full:.5f})")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{rec['model']}: per-node sensitivity on {rec['tuning']['n']} tuning samples "
                 f"(ORT CPU, optimisations off); kept in float: {len(rec['excluded'])}",
                 fontsize=9)
    bx.bar(x, share, color=np.where(kept, "tab:orange", "tab:green"))
    bx.set_ylabel("% of MACs")
    bx.set_xticks(x)
    bx.set_xticklabels([r["name"] for r in rows], rotation=90, fontsize=6)
    for t, k in zip(bx.get_xticklabels(), kept):
        if k:
            t.set_color("tab:orange")
            t.set_fontweight("bold")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:green", "tab:orange")]
    bx.legend(handles, ["INT8", "kept in float"], fontsize=7, loc="upper right")
    bx.grid(alpha=0.3, axis="y")
    plt.setp(ax.get_xticklabels(), visible=False)
    ranking = [r for r in rec.get("path", []) if r["int8_mac_fraction"] is not None]
    if ranking:
        px = [100 * r["int8_mac_fraction"] for r in ranking]
        cx.plot(px, [max(cosine_error(r["metrics"]), floor) for r in ranking], "o-",
                color="tab:red", ms=3, label="1 - cosine (mean)")
        if budget is not None:
            cx.axhline(1 - budget, color="0.3", ls="--", lw=0.8)
        cx.set_yscale("log")
        cx.set_xlabel("% of MACs in INT8 (prefixes of the ranking kept in float; right = all "
                      "INT8)")
        cx.set_ylabel("1 - cosine", color="tab:red")
        cx.grid(alpha=0.3)
        if ranking[0]["metrics"].get("agreement") is not None:
            dx = cx.twinx()
            dx.plot(px, [r["metrics"]["agreement"] for r in ranking], "s-", color="tab:blue",
                    ms=3, label="top-1 agreement %")
            if rec["budget"].get("min_agreement") is not None:
                dx.axhline(rec["budget"]["min_agreement"], color="tab:blue", ls=":", lw=0.8)
            dx.set_ylabel("top-1 agreement %", color="tab:blue")
        frac = rec.get("int8_mac_fraction")
        if frac is not None:
            cx.axvline(100 * frac, color="tab:orange", lw=1.2,
                       label=f"chosen ({100 * frac:.1f} % INT8)")
        cx.axvline(90, color="0.5", ls=":", lw=0.8, label="90 % INT8")
        cx.legend(fontsize=7, loc="upper left")
        cx.set_title("ranking path on the tuning split", fontsize=9)
    else:
        cx.set_axis_off()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def fmt_num(v, digits: int) -> str:
    return "undefined" if v is None else f"{v:.{digits}f}"


def _metrics_line(m: dict | None) -> str:
    return fmt_metrics(m) + f" on {m['n']} samples" if m else "-"


def render_markdown(rec: dict) -> str:
    """The search (and verification) as markdown: summary, the nodes kept in float with their
    sensitivity and MACs, then every candidate."""
    pct = lambda v: "" if v is None else f"{100 * v:.2f}"  # noqa: E731
    out = [f"# Mixed precision for an accuracy budget: {rec['model']}\n",
           f"Budget: {rec['budget_text']} (tuning split: {rec['tuning']['source']}).  ",
           f"Measured on: {rec['semantics']}.  ",
           *[f"**Warning:** {w}.  " for w in rec.get("warnings", [])],
           f"Candidates: {len(rec['candidates'])} nodes ModelOpt quantized (`{rec['base']['command']}`)."
           f" Search: {rec['search']['evaluations']['run']} configurations run, "
           f"{rec['search']['evaluations']['cached']} from the cache, {rec['search']['wall_s']} s"
           f" on {rec['search']['machine']}.\n",
           f"- all INT8: {_metrics_line(rec['full_int8'])}",
           f"- all candidates float: {_metrics_line(rec['all_float'])}",
           f"- chosen ({len(rec['excluded'])} kept in float, {pct(rec['int8_mac_fraction'])} % "
           f"of MACs in INT8): {_metrics_line(rec['predicted'])}; budget "
           + ("met" if rec["budget_met"] else "MISSED: " + "; ".join(rec["budget_misses"]))]
    v = rec.get("verify")
    if v:
        out.append(f"- re-quantized by ModelOpt (`{v['onnx']}`, {pct(v['macs']['int8_fraction'])}"
                   f" % of MACs in INT8), tuning split: {_metrics_line(v['tune'])}; budget "
                   + ("met" if v["tune_budget_met"] else "MISSED: " + "; ".join(v["tune_misses"])))
        if v.get("eval"):
            out.append(f"- **evaluation split**: {_metrics_line(v['eval'])}; budget "
                       + ("met" if v["eval_budget_met"] else
                          "MISSED: " + "; ".join(v["eval_misses"])))
        if v.get("structure_differences"):
            out.append(f"- ModelOpt's file differs from the searched configuration: "
                       f"{v['structure_differences']}")
    out.append("\n## Kept in float\n")
    out.append("| node | op | MACs | % of MACs | 1-cos INT8 alone | flips INT8 alone | "
               "cos gained float alone | flips removed | rank |\n|---|---|---|---|---|---|---|---|---|")
    rows = [r for r in rec["candidates"] if r["kept_float"]]
    for r in rows:
        out.append(f"| `{r['name']}` | {r['op_type']} | {r['macs']:,} | {pct(r['mac_share'])} | "
                   f"{r['cosine_error_added']:.2e} | {r['flips_added']} | "
                   f"{r['cosine_error_removed']:.2e} | {r['flips_removed']} | {r['rank']} |")
    if not rows:
        out.append("| (none: every candidate stays INT8) | | | | | | | | |")
    out.append(f"\nExclusion list (ModelOpt `--nodes_to_exclude`): "
               f"`{' '.join(rec['exclude_regexes']) or '(none)'}`\n")
    out.append("## Every candidate (graph order)\n")
    out.append("| node | op | % of MACs | 1-cos INT8 alone | cos gained float alone | "
               "score/MAC rank | kept float |\n|---|---|---|---|---|---|---|")
    for r in rec["candidates"]:
        out.append(f"| `{r['name']}` | {r['op_type']} | {pct(r['mac_share'])} | "
                   f"{r['cosine_error_added']:.2e} | {r['cosine_error_removed']:.2e} | "
                   f"{r['rank']} | {'yes' if r['kept_float'] else ''} |")
    if rec.get("path"):
        out.append("\n## Ranking path (tuning split; first N of the ranking kept in float)\n")
        out.append("| N float | last added | % of MACs in INT8 | cosine | agreement % | top-1 % | "
                   "budget |\n|---|---|---|---|---|---|---|")
        num = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
        for r in rec["path"]:
            m = r["metrics"]
            out.append(f"| {r['n_float']} | `{r['node'] or '-'}` | {pct(r['int8_mac_fraction'])} | "
                       f"{fmt_num(m.get('cosine_mean'), 5)} | {num(m.get('agreement'))} | "
                       f"{num(m.get('top1'))} | {'met' if r['met'] else ''} |")
    if rec.get("plot", True):
        out.append(f"\n![per-node sensitivity]({Path(rec['outputs']['png']).name})\n")
    return "\n".join(out) + "\n"


def write_outputs(rec: dict, plot: bool = True) -> None:
    """Write the record's JSON, markdown and (``plot``) PNG to ``rec["outputs"]``."""
    paths = {k: Path(v) for k, v in rec["outputs"].items()}
    if plot:
        plot_sensitivity(rec, paths["png"])
    elif not rec.get("plot", True):  # search --no-plot: a PNG there shows an older search
        paths["png"].unlink(missing_ok=True)
    write_json(paths["json"], rec)
    with atomic_path(paths["md"]) as tmp:
        tmp.write_text(render_markdown(rec))
