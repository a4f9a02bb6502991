"""Reports of a layer-wise diff: the text table, the per-layer similarity plot and the files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
import numpy as np

from deploykit.io import atomic_path, write_json


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
def fmt_value(v: Any, spec: str = ".6f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if not np.isfinite(v) else format(v, spec)
    return str(v)


def failing_final_outputs(result: dict) -> list[str]:
    """Names of the final outputs (unmarked runs: what the deployed model returns) that are
    out of tolerance (``status`` ``fail``) in a :func:`deploykit.layerwise.diff.run_layer_diff`
    result."""
    return [k for k, v in (result.get("final_outputs") or {}).items()
            if v.get("status") == "fail"]


def render_table(result: dict, max_rows: int | None = None) -> str:
    """Markdown: summary, first divergent layer, final outputs and the per-layer table."""
    tol = result.get("tolerances", {})
    lines = [f"# Layer-wise parity: {result['b'].get('backend')} {result.get('precision')} vs "
             f"{result['a'].get('backend')} (reference)",
             "", f"- A (reference): `{result['a']['onnx']}`", f"- B: `{result['b']['onnx']}`"
             + (f" (engine `{result['b']['engine']}`)" if result["b"].get("engine") else ""),
             f"- precision class: {result.get('precision')}; pass if cosine_min >= "
             f"{tol.get('min_cosine')} and max_abs_err <= {tol.get('atol')} + {tol.get('rtol')}"
             " * max|ref|", f"- samples: {result.get('n_samples')}"]
    if result.get("fp16_note"):
        lines.append(f"- note: {result['fp16_note']}")
    if result.get("status") == "skipped":
        return "\n".join(lines + ["", f"**Skipped:** {result.get('reason')}", ""])
    fd = result.get("first_divergent")
    lines.append("")
    if result.get("failure"):
        lines += [f"**FAILED:** {result['failure']}.", ""]
    if fd:
        lines.append(f"**First divergent layer:** `{fd['node']}` ({fd['op_type']}, tensor "
                     f"`{fd['tensor']}`), cosine_min {fmt_value(fd.get('cosine_min'))}, inputs agreed: "
                     f"{fd['inputs_agreed']}. {fd['verdict']}.")
        det = fd.get("detail") or {}
        if det.get("op_type_a") and det.get("op_type_a") != det.get("op_type_b"):
            lines.append(f"- op type differs: {det['op_type_a']} (A) vs {det['op_type_b']} (B)")
        for k, v in (det.get("weights_differ") or {}).items():
            lines.append(f"- weight `{k}` differs: {v}")
        for k, v in (det.get("attributes_differ") or {}).items():
            lines.append(f"- attribute `{k}`: {v[0]} (A) vs {v[1]} (B)")
        if result.get("origins") and len(result["origins"]) > 1:
            lines.append(f"- other layers whose inputs agreed but output failed: "
                         f"{', '.join('`%s`' % o for o in result['origins'][1:6])}"
                         + (" ..." if len(result["origins"]) > 6 else ""))
    elif not result.get("failure") and failing_final_outputs(result):
        bad = failing_final_outputs(result)
        lines.append(f"**No divergent layer when every layer is marked, but the final output "
                     f"{', '.join('`%s`' % k for k in bad)} is out of tolerance** in the unmarked "
                     "run (fusions intact): a fused kernel of the deployed graph computes it "
                     "differently; rerun with --opt-level disable to confirm.")
    elif not result.get("failure"):
        lines.append("**No divergent layer:** every compared tensor is within tolerance.")
    for r in result.get("remedies", []):
        lines.append(f"- try: `{r}`")
    lines += ["", f"_{result.get('note', '')}_", "", "Final outputs (unmarked models):", "",
              "| output | cosine_min | max_abs_err | status |", "|---|---|---|---|"]
    for k, v in (result.get("final_outputs") or {}).items():
        lines.append(f"| `{k}` | {fmt_value(v.get('cosine_min'))} | {fmt_value(v.get('max_abs_err'), '.4g')}"
                     f" | {v.get('status')} |")
    lines += ["", "| # | node | op | cosine_min | max_abs_err | rel_err | inputs agreed | status |",
              "|---|---|---|---|---|---|---|---|"]
    rows = [r for r in result.get("layers", []) if not r.get("shape_only")]
    shown = rows if max_rows is None else rows[:max_rows]
    first_idx = fd["index"] if fd else None
    for r in shown:
        mark = " **<- first**" if r["index"] == first_idx else ""
        lines.append(f"| {r['index']} | `{r['node']}` | {r['op_type']} | {fmt_value(r.get('cosine_min'))}"
                     f" | {fmt_value(r.get('max_abs_err'), '.4g')} | {fmt_value(r.get('rel_err'), '.3g')} | "
                     f"{r.get('inputs_agreed')} | {r['status']}{mark} |")
    if len(shown) < len(rows):
        lines.append(f"| ... | {len(rows) - len(shown)} more rows in layerwise.json | | | | | | |")
    n_shape = len(result.get("layers", [])) - len(rows)
    if n_shape:
        lines.append(f"\n{n_shape} shape-computation rows (Shape/Gather/Concat on shapes) are "
                     "left out here; they are in layerwise.json.")
    return "\n".join(lines) + "\n"


def plot_rows(result: dict) -> list[dict]:
    """The layer rows the plot draws: every compared layer (a NaN/Inf cosine included), shape
    arithmetic left out."""
    return [r for r in result.get("layers", []) if "cosine_min" in r and not r.get("shape_only")]


def plot_similarity(result: dict, path: Path | str, title: str | None = None) -> Path:
    """PNG of cosine similarity (top) and 1 - cosine (log, bottom) along the reference graph's
    topological order, with the tolerance line and the first divergent layer marked; layers
    whose output is NaN/Inf get a black cross at the bottom of both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plot_rows(result)
    x = np.arange(len(rows))  # compact: shape-arithmetic rows are not plotted
    cos = np.array([r["cosine_min"] if r["cosine_min"] is not None else np.nan for r in rows],
                   np.float64)
    bad = np.array([r["status"] == "fail" for r in rows], bool)
    # A layer whose output is NaN/Inf has no finite cosine; it is drawn as its own marker at
    # the bottom of each panel, so the first divergent layer always has a point.
    nonfin = ~np.isfinite(cos)
    tol = result["tolerances"]["min_cosine"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    finite = cos[~nonfin]
    lo1 = min(float(finite.min()) if finite.size else tol, tol)
    floor1 = lo1 - 0.05 * max(1.0 - lo1, 1e-6)
    gap = np.clip(1.0 - finite, 1e-12, None)
    floor2 = 10.0 ** np.ceil(np.log10(max(float(gap.max()) if gap.size else 1.0, 1 - tol)) + 1)
    for ax, y, floor in ((ax1, cos, floor1), (ax2, np.clip(1.0 - cos, 1e-12, None), floor2)):
        ax.plot(x[~nonfin], y[~nonfin], "-", color="0.6", lw=0.8)
        ok = ~bad & ~nonfin
        ax.scatter(x[ok], y[ok], s=10, color="tab:blue", label="pass")
        ax.scatter(x[bad & ~nonfin], y[bad & ~nonfin], s=14, color="tab:red", label="fail")
        if nonfin.any():
            ax.scatter(x[nonfin], np.full(int(nonfin.sum()), floor), s=40, marker="X",
                       color="black", label="NaN/Inf output", zorder=5)
        ax.grid(alpha=0.3)
    ax1.axhline(tol, color="tab:orange", ls="--", lw=1, label=f"min cosine {tol}")
    ax2.axhline(1 - tol, color="tab:orange", ls="--", lw=1)
    ax1.set_ylabel("cosine (min over samples)")
    ax2.set_ylabel("1 - cosine")
    ax2.set_yscale("log")
    ax2.set_xlabel("layer (reference graph, topological order; shape arithmetic omitted)")
    fd = result.get("first_divergent")
    pos = next((k for k, r in enumerate(rows) if fd and r["index"] == fd["index"]), None)
    if pos is not None:
        for ax in (ax1, ax2):
            ax.axvline(pos, color="tab:red", ls=":", lw=1)
        ax1.annotate(f"first divergent: {fd['node']}", (pos, 1.0), fontsize=8,
                     color="tab:red", xytext=(4, -12), textcoords="offset points")
    ax1.legend(fontsize=8, loc="lower left")
    ax1.set_title(title or f"{result['b']['backend']} ({Path(result['b']['onnx']).name}) vs "
                  f"{result['a']['backend']} ({Path(result['a']['onnx']).name})", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def write_reports(result: dict, out_dir: Path | str, title: str | None = None) -> dict[str, Path]:
    """Write ``layerwise.json``, ``layerwise.md`` and (if there are rows) ``layerwise.png``
    atomically into ``out_dir``; the paths are also stored in ``result["files"]``."""
    out_dir = Path(out_dir)
    files = {"json": out_dir / "layerwise.json", "md": out_dir / "layerwise.md"}
    if result.get("layers"):
        files["png"] = plot_similarity(result, out_dir / "layerwise.png", title)
    result["files"] = {k: str(v) for k, v in files.items()}
    with atomic_path(files["md"]) as tmp:
        tmp.write_text(render_table(result))
    write_json(files["json"], result)
    return files
