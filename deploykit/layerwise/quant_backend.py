"""Quantization error versus backend error, per layer: the Q/DQ model's tensors against the FP32
model, in cosine and in quantization steps, on the reference semantics and on the EP.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.compare import BACKEND_TOLERANCE, TOLERANCES, TensorStat, tolerances_for
from deploykit.io import atomic_path, write_json
from deploykit.layerwise.diff import b_name_for
from deploykit.layerwise.report import fmt_value
from deploykit.onnx.activations import (
    MARKING_NOTE,
    chunk_size,
    collect_outputs,
    lookthrough_aliases,
    ort_activations,
)
from deploykit.onnx.graph import constants, consumers, load_onnx, tolerance_precision
from deploykit.runners import ORT_EPS


# --------------------------------------------------------------------------------------------
# Quantization error vs backend error (Q/DQ models)
# --------------------------------------------------------------------------------------------


def quantization_steps(model) -> dict[str, float]:
    """``{tensor: scale}`` for every tensor of a Q/DQ ``model`` that a QuantizeLinear with a
    constant per-tensor scale quantizes (under its own name and its DequantizeLinear output's,
    so both sides of a Q/DQ pair map to the same step)."""
    consts = constants(model)
    out: dict[str, float] = {}
    cons = consumers(model)
    for n in model.graph.node:
        if n.op_type != "QuantizeLinear" or len(n.input) < 2:
            continue
        s = consts.get(n.input[1])
        if s is None or s.size != 1:
            continue
        v = float(np.asarray(s, np.float64).ravel()[0])
        out.setdefault(n.input[0], v)
        for dq in cons.get(n.output[0], []):
            if dq.op_type == "DequantizeLinear":
                out.setdefault(dq.output[0], v)
    return out


def _pair_result(st: TensorStat, tol: dict, step: float | None, backend: bool) -> dict:
    """:meth:`TensorStat.result` plus the error in quantization steps (``steps_max``,
    ``steps_mean``) when the tensor has a step; backend rows judged by :data:`BACKEND_TOLERANCE`."""
    r = st.result(tol)
    if step and "max_abs_err" in r:
        r["steps_max"] = r["max_abs_err"] / step
        r["steps_mean"] = r["mean_abs_err"] / step
    if backend and "max_abs_err" in r:
        mean_ok = (r["steps_mean"] <= BACKEND_TOLERANCE["max_mean_steps"] if step else
                   r["mean_abs_err"] <= 1e-6 + BACKEND_TOLERANCE["max_mean_rel_err"] * r["ref_abs_max"])
        ok = (st.nonfinite_b == 0 and np.isfinite(r["cosine_min"])
              and r["cosine_min"] >= BACKEND_TOLERANCE["min_cosine"] and mean_ok)
        r["status"] = "pass" if ok else "fail"
    return r


def _severity(r: dict) -> float:
    """Sort key of a comparison (lower = worse): non-finite first, then by cosine."""
    c = r.get("cosine_min")
    return -np.inf if (r.get("note") and "NaN" in r["note"]) or c is None or not np.isfinite(c) \
        else float(c)


def _describe(r: dict) -> str:
    """``cosine 0.61`` or ``NaN/Inf`` for a verdict."""
    if _severity(r) == -np.inf:
        return "NaN/Inf"
    text = f"cosine {r['cosine_min']:.4g}"
    if r.get("top1_agreement") is not None:
        text += f", top-1 agreement {r['top1_agreement']:.1f} %"
    return text


def _channel_cosines(acc: np.ndarray) -> dict:
    """Per-channel cosine from accumulated ``[sum a*b, sum a*a, sum b*b]`` (axis 1 of the
    tensor): ``channel_cosine_min`` over channels the reference does not leave at zero, and
    ``channels_lost`` (cosine < 0.5: the channel is gone or another signal; a per-tensor cosine
    hides them when they are small, e.g. per-tensor weights of a depthwise convolution)."""
    dot, na, nb = acc
    live = na > 1e-24 * max(float(na.max()), 1e-300)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(nb > 0, dot / np.sqrt(na * nb), 0.0)
    cos = cos[live]
    lost = np.flatnonzero(live)[cos < 0.5]
    return {"channel_cosine_min": float(cos.min()) if cos.size else None,
            "channels_lost": lost[:50].tolist(), "n_channels_lost": int(lost.size)}


def _shown_dtype(x: np.ndarray) -> str:
    """The dtype a tensor is reported with: float32 for every float tensor (what
    :meth:`deploykit.runners.OrtRunner.infer` returns), else its own."""
    dt = np.asarray(x).dtype
    return "float32" if np.issubdtype(dt, np.floating) else str(dt)


def quant_backend_table(fp32_onnx: Path | str, qdq_onnx: Path | str, feed: dict[str, np.ndarray],
                        *, ep: str = "cpu", opt_level: str = "all",
                        disabled_optimizers: Sequence[str] = (), batch: int | None = None,
                        precision: str | None = None, out_dir: Path | str | None = None) -> dict:
    """Per layer, how much error the quantization itself adds and how much the backend adds.

    Three runs of the same inputs, every tensor exposed (see :data:`MARKING_NOTE`):

    - **F**: the float graph, ORT CPU, optimisations off (reference);
    - **Q0**: the Q/DQ graph, ORT CPU, optimisations off: the graph's own semantics
      (DequantizeLinear + float ops);
    - **Q1**: the Q/DQ graph as the backend runs it (``ep``, ``opt_level``).

    quantization error = F vs Q0 (the precision's tolerance, :data:`TOLERANCES`); backend error
    = Q0 vs Q1 (:data:`BACKEND_TOLERANCE`). Both in cosine (min over samples) and, for tensors that
    the graph quantizes, in quantization steps of that tensor (max and mean |error| / scale).
    The final outputs are compared on unmarked models too (fusions intact).

    Args:
        fp32_onnx: float model. qdq_onnx: the Q/DQ model made from it.
        feed: ``{input name: array}``, batch on axis 0 (:func:`load_feed`).
        ep, opt_level, disabled_optimizers: how the backend run Q1 is made.
        batch: chunk size (memory); None = all samples at once.
        precision: tolerance class of the quantization error (default: detected from the file).
        out_dir: write ``quant_backend.json`` / ``quant_backend.md`` there.
    Returns:
        ``{"layers": [{"index", "node", "op_type", "tensor", "step", "quant": {...},
        "backend": {...}, "verdict"}], "final_outputs": {name: {"quant", "backend"}},
        "first_quant", "first_backend", "verdict", "tolerances", ...}``; ``verdict`` per layer is
        ``ok``, ``quantization``, ``backend`` or ``both``.
    Raises:
        StageError: a model cannot be loaded or run.
    """
    t0 = time.time()
    a_model, q_model = load_onnx(fp32_onnx), load_onnx(qdq_onnx)
    precision = precision or tolerance_precision(q_model).lower()
    tol = tolerances_for(precision if precision in TOLERANCES else "int8")
    batch = chunk_size([a_model, q_model], batch)
    steps = quantization_steps(q_model)
    alias = lookthrough_aliases(q_model)
    alias_inv: dict[str, list[str]] = {}
    for t, r in alias.items():
        alias_inv.setdefault(r, []).append(t)

    def run(model, backend: bool, mark_all: bool = True, native: bool = False):
        return ort_activations(model, feed, ep=ep if backend else "cpu", batch=batch,
                               opt_level=opt_level if backend else "disable", mark_all=mark_all,
                               disabled_optimizers=disabled_optimizers if backend else (),
                               native=native)

    # tensors as ORT returns them (an FP16 graph's stay float16); TensorStat converts them to
    # float64 a block at a time
    f_it, q0_it, q1_it = (run(a_model, False, native=True), run(q_model, False, native=True),
                          run(q_model, True, native=True))
    quant: dict[str, TensorStat] = {}
    backend: dict[str, TensorStat] = {}
    b_of: dict[str, str | None] = {}
    # each tensor on one of two threads (NumPy releases the GIL; each TensorStat is updated by
    # one task at a time, in chunk order: the same figures as one after the other)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for (f, n), (q0, _), (q1, _) in zip(f_it, q0_it, q1_it):
            names = set(q0)
            todo = []
            for name, a in f.items():
                if name not in b_of:
                    b_of[name] = b_name_for(name, names, alias_inv)
                b = b_of[name]
                if b is None or b not in q0 or b not in q1:
                    continue
                quant.setdefault(name, TensorStat())
                backend.setdefault(name, TensorStat())
                todo.append((name, a, b))

            def update(item, q0=q0, q1=q1, n=n):
                name, a, b = item
                # the dtype recorded is the one the runs' float32 outputs had before (reports);
                # per channel (axis 1) too for the quantization error (channel_sums)
                quant[name].update(a, q0[b], n, _shown_dtype(q0[b]), channels=True)
                backend[name].update(q0[b], q1[b], n, _shown_dtype(q1[b]))

            list(pool.map(update, todo))
    inits = {t.name for t in a_model.graph.initializer}
    rows = []
    for i, node in enumerate(a_model.graph.node):
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if not out or out not in quant:
                continue
            b = b_of.get(out)
            step = steps.get(b) or steps.get(alias.get(b, b)) or steps.get(out)
            qr = _pair_result(quant[out], tol, step, backend=False)
            if quant[out].channel_sums is not None:
                qr.update(_channel_cosines(quant[out].channel_sums))
            br = _pair_result(backend[out], tol, step, backend=True)
            qf, bf = qr["status"] == "fail", br["status"] == "fail"
            rows.append({"index": len(rows), "node": node.name or f"node_{i}",
                         "op_type": node.op_type, "tensor": out, "b_tensor": b, "step": step,
                         "inputs": [t for t in node.input if t and t not in inits],
                         "quant": qr, "backend": br,
                         "verdict": "both" if qf and bf else "quantization" if qf else
                         "backend" if bf else "ok"})
    # Unmarked final outputs: what the deployed models return. Each run again: marking every
    # tensor changes the computation even with optimisations off (an FP16 graph's tensors are
    # rounded to float16 where ORT CPU would keep them in float32 between its inserted Casts).
    f_fin = collect_outputs(run(fp32_onnx, False, mark_all=False))
    q0_fin = collect_outputs(run(qdq_onnx, False, mark_all=False))
    q1_fin = collect_outputs(run(qdq_onnx, True, mark_all=False))
    finals = {}
    for name, a in f_fin.items():
        if name in q0_fin and name in q1_fin:
            sq, sb = TensorStat(), TensorStat()
            nb = len(a) if np.ndim(a) else 1
            sq.update(a, q0_fin[name], nb)
            sb.update(q0_fin[name], q1_fin[name], nb)
            step = steps.get(name) or steps.get(alias.get(name, name))
            finals[name] = {"quant": _pair_result(sq, tol, step, False),
                            "backend": _pair_result(sb, tol, step, True)}
            if np.ndim(a) == 2 and len(a):
                finals[name]["quant"]["top1_agreement"] = float(
                    100 * (a.argmax(1) == q0_fin[name].argmax(1)).mean())
                finals[name]["backend"]["top1_agreement"] = float(
                    100 * (q0_fin[name].argmax(1) == q1_fin[name].argmax(1)).mean())
    first_q = next((r for r in rows if r["verdict"] in ("quantization", "both")), None)
    first_b = next((r for r in rows if r["verdict"] in ("backend", "both")), None)
    fin_b = [k for k, v in finals.items() if v["backend"]["status"] == "fail"]
    fin_q = [k for k, v in finals.items() if v["quant"]["status"] == "fail"]
    lost_rows = [r for r in rows if r["quant"].get("n_channels_lost")]
    backend_name = f"ORT {ORT_EPS.get(ep, ep)} at optimisation level {opt_level}" + (
        f" without {', '.join(disabled_optimizers)}" if disabled_optimizers else "")
    parts = []
    if first_b or fin_b:
        where = f"first at {first_b['node']} ({first_b['op_type']})" if first_b else \
            "in the final outputs only (a fused kernel)"
        bad = [r for r in rows if r["verdict"] in ("backend", "both")]
        worst = min(bad, key=lambda r: _severity(r["backend"]), default=None)
        if worst is not None and worst is not first_b:
            where += (f", worst at {worst['node']} ({worst['op_type']}, "
                      f"{_describe(worst['backend'])})")
        if fin_b:
            where += "; final output " + ", ".join(
                f"{k} {_describe(finals[k]['backend'])}" for k in fin_b)
        parts.append(f"backend error: {backend_name} does not reproduce the Q/DQ graph, {where}")
    if first_q or fin_q:
        where = f"first at {first_q['node']} ({first_q['op_type']})" if first_q else \
            "in the final outputs only"
        parts.append(f"quantization error beyond the {precision} tolerance, {where}")
    if lost_rows:
        r0 = lost_rows[0]
        parts.append(f"quantization loses {r0['quant']['n_channels_lost']} channel(s) of "
                     f"{r0['node']} ({r0['op_type']}) (per-channel cosine < 0.5: small channels "
                     "a shared scale leaves at zero; the tensor's cosine hides them)")
    result = {"a": str(fp32_onnx), "b": str(qdq_onnx), "backend": backend_name,
              "precision": precision, "tolerances": {"quantization": tol, "backend": BACKEND_TOLERANCE},
              "n_samples": int(len(next(iter(feed.values())))) if feed else 0,
              "layers": rows, "final_outputs": finals,
              "first_quant": first_q and {k: first_q[k] for k in ("index", "node", "op_type")},
              "first_backend": first_b and {k: first_b[k] for k in ("index", "node", "op_type")},
              "channels_lost": [{"node": r["node"], "channels": r["quant"]["channels_lost"]}
                                for r in lost_rows],
              "verdict": "; ".join(parts) or ("the backend reproduces the Q/DQ graph and the "
                                              "quantization error stays within tolerance"),
              "note": MARKING_NOTE, "wall_time_s": round(time.time() - t0, 3), "status": "ok"}
    if out_dir:
        out_dir = Path(out_dir)
        md = out_dir / "quant_backend.md"
        with atomic_path(md) as tmp:
            tmp.write_text(render_quant_backend(result))
        write_json(out_dir / "quant_backend.json", result)
        result["files"] = {"json": str(out_dir / "quant_backend.json"), "md": str(md)}
    return result


def render_quant_backend(result: dict, max_rows: int | None = None) -> str:
    """Markdown of :func:`quant_backend_table`: verdict, final outputs, then one row per layer
    with the quantization error (F vs Q0) beside the backend error (Q0 vs Q1)."""
    def lost(r):
        return f"; {r['n_channels_lost']} channel(s) lost" if r.get("n_channels_lost") else ""

    def steps(r):
        if r.get("steps_max") is not None:
            return f"{fmt_value(r['steps_max'], '.3g')} / {fmt_value(r.get('steps_mean'), '.2g')} steps"
        if r.get("rel_err") is not None:
            mean = (100 * r["mean_abs_err"] / r["ref_abs_max"]) if r.get("ref_abs_max") else None
            return (f"{fmt_value(100 * r['rel_err'], '.3g')} / {fmt_value(mean, '.2g')} % of range")
        return "-"

    tq = result["tolerances"]["quantization"]
    lines = [f"# Quantization error vs backend error: `{Path(result['b']).name}`", "",
             f"- quantization error: Q/DQ graph vs float graph, both ORT CPU with optimisations "
             f"off (fail if cosine_min < {tq['min_cosine']})",
             f"- backend error: {result['backend']} vs the same Q/DQ graph with optimisations off "
             f"(fail if cosine_min < {BACKEND_TOLERANCE['min_cosine']} or the mean error exceeds "
             f"{BACKEND_TOLERANCE['max_mean_steps']:g} quantization step, or "
             f"{100 * BACKEND_TOLERANCE['max_mean_rel_err']:g} % of the range of a tensor the graph "
             "does not quantize)",
             "- error: max / mean |error| in steps of the tensor's quantization scale; for a "
             "tensor the graph does not quantize, in % of the tensor's range",
             f"- samples: {result['n_samples']}", "", f"**Verdict:** {result['verdict']}.", "",
             "| final output | quant cosine_min | quant error | quant top-1 agree % | backend "
             "cosine_min | backend error | backend top-1 agree % |", "|---|---|---|---|---|---|---|"]
    for k, v in result["final_outputs"].items():
        lines.append(f"| `{k}` | {fmt_value(v['quant'].get('cosine_min'))} | {steps(v['quant'])} | "
                     f"{fmt_value(v['quant'].get('top1_agreement'), '.1f')} | "
                     f"{fmt_value(v['backend'].get('cosine_min'))} | {steps(v['backend'])} | "
                     f"{fmt_value(v['backend'].get('top1_agreement'), '.1f')} |")
    lines += ["", "| # | node | op | quant cosine_min | quant error | backend cosine_min "
              "| backend error | verdict |", "|---|---|---|---|---|---|---|---|"]
    rows = result["layers"] if max_rows is None else result["layers"][:max_rows]
    for r in rows:
        lines.append(f"| {r['index']} | `{r['node']}` | {r['op_type']} | "
                     f"{fmt_value(r['quant'].get('cosine_min'))} | {steps(r['quant'])}{lost(r['quant'])}"
                     f" | {fmt_value(r['backend'].get('cosine_min'))} | {steps(r['backend'])} | "
                     f"{r['verdict']} |")
    if len(rows) < len(result["layers"]):
        lines.append(f"| ... | {len(result['layers']) - len(rows)} more rows in quant_backend.json"
                     " | | | | | | |")
    return "\n".join(lines + ["", f"_{result['note']}_"]) + "\n"
