"""The layer-wise diff of two ONNX models (or backends) on one feed: per-tensor statistics in
topological order and the first divergent layer with its verdict.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any
import numpy as np

from deploykit.compare import TensorStat, compare_outputs, tolerances_for
from deploykit.feeds import feed_plan
from deploykit.layerwise.remedies import trt_remedies
from deploykit.layerwise.report import write_reports
from deploykit.onnx.activations import (
    MARKING_NOTE,
    chunk_size,
    collect_outputs,
    lookthrough_aliases,
    ort_activations,
    trt_activations,
    trt_available,
)
from deploykit.onnx.graph import (
    attrs,
    constants,
    graph_inputs,
    load_onnx,
    producers,
    tolerance_precision,
)
from deploykit.runners import ORT_EPS
from deploykit.compare import TOLERANCES


# --------------------------------------------------------------------------------------------
# Layer-wise diff
# --------------------------------------------------------------------------------------------
def b_name_for(ref_name: str, b_names: set[str], b_alias_inv: dict[str, list[str]]) -> str | None:
    """Tensor of B that represents reference tensor ``ref_name`` (exact name first, then the
    look-through aliases: the float tensor a Q/DQ or Cast chain was built from or leads to)."""
    if ref_name in b_names:
        return ref_name
    for cand in b_alias_inv.get(ref_name, []):
        if cand in b_names:
            return cand
    return None


def _node_detail(a_model, b_model, node_name: str) -> dict:
    """What differs between the node named ``node_name`` in A and B: op type, attributes and
    (same-name or positional) weights. Empty fields mean "no difference found"."""
    def find(m):
        return next((n for n in m.graph.node if n.name == node_name), None)

    na, nb = find(a_model), find(b_model)
    if na is None or nb is None:
        return {"node_in_b": nb is not None}
    det: dict[str, Any] = {"node_in_b": True, "op_type_a": na.op_type, "op_type_b": nb.op_type}
    aa, ab = attrs(na), attrs(nb)
    det["attributes_differ"] = {k: [repr(aa.get(k)), repr(ab.get(k))]
                                for k in set(aa) | set(ab) if repr(aa.get(k)) != repr(ab.get(k))}
    ia, ib = constants(a_model), constants(b_model)
    b_alias = lookthrough_aliases(b_model)
    wd = {}
    for pos, name in enumerate(na.input):
        if name not in ia or pos >= len(nb.input):
            continue
        bn = b_alias.get(nb.input[pos], nb.input[pos])
        if bn not in ib:
            continue
        wa, wb = ia[name].astype(np.float64), ib[bn].astype(np.float64)
        if wa.shape != wb.shape:
            wd[name] = f"shape {wb.shape} vs {wa.shape}"
        elif not np.allclose(wa, wb, rtol=1e-2, atol=1e-3 * max(np.abs(wa).max(), 1e-12)):
            wd[name] = f"max abs diff {np.abs(wa - wb).max():.4g} (|w|max {np.abs(wa).max():.4g})"
    det["weights_differ"] = wd
    return det


#: Said by a diff of an FP16 file on ORT's CPU EP: what it cannot show ({audit}: the command
#: of the FP16 range audit of the two files).
FP16_ON_CPU_NOTE = ("ORT's CPU EP computes most FP16 ops in FP32 (Casts around them), so this "
                    "diff cannot show FP16 overflow or underflow; the FP16 range audit can "
                    "({audit}), and so can this diff on a GPU EP (onnxruntime-gpu)")


def run_layer_diff(a_onnx: Path | str, b_onnx: Path | str, feed: dict[str, np.ndarray], *,
                   ep_a: str = "cpu", ep_b: str = "cpu", b_engine: Path | str | None = None,
                   b_trt: bool = False, trt_build: dict | None = None,
                   tolerances: dict[str, float] | None = None, precision: str | None = None,
                   batch: int | None = None, opt_level: str = "all",
                   out_dir: Path | str | None = None, title: str | None = None,
                   output_map: dict[str, str] | None = None) -> dict:
    """Compare every intermediate tensor of two runs of an ONNX graph and name the first
    divergent layer.

    Args:
        a_onnx: reference ONNX (run with ORT on ``ep_a``; normally the FP32 model on CPU).
        b_onnx: candidate ONNX: the same file on another EP, the FP16 or Q/DQ model, or the
            ONNX a TensorRT engine was built from.
        feed: ``{input name: array}`` with the batch on axis 0; any dtypes/ranks (non-image
            inputs are fine). Keys not in a model are ignored by it.
        ep_a, ep_b: ORT execution providers (``cpu``/``cuda``/``trt``).
        b_engine: serialized TensorRT plan of ``b_onnx``; implies ``b_trt``. Its unmarked
            final outputs are compared as deployed.
        b_trt: run side B through TensorRT (a marked-all engine built from ``b_onnx``).
            Without ``tensorrt`` the result has ``status: "skipped"`` and a reason.
        trt_build: builder flags for the marked engine, see :func:`trt_activations`.
        tolerances: overrides of ``min_cosine``/``atol``/``rtol``.
        precision: tolerance class (default: :func:`tolerance_precision` of B, ``tf32`` for FP32
            on a GPU EP or TensorRT).
        batch: run in chunks of this many samples (memory; None = all at once); a model with a
            static batch is fed exactly that many (:func:`feed_plan`).
        opt_level: ORT graph optimisation level for both sides.
        out_dir: if given, write ``layerwise.json``/``.md``/``.png`` there.
        output_map: ``{B output name: A output name}`` for files whose output names differ
            (``--map-output``): B's output is compared with A's under A's name.
    Returns:
        dict with ``status`` (``ok``/``skipped``), ``tolerances``, ``layers`` (one row per
        reference node in topological order: ``index``, ``node``, ``op_type``, ``tensor``,
        ``b_tensor``, ``status`` pass/fail/unmatched, metrics, ``inputs_agreed``),
        ``first_divergent`` (row + ``inputs_agreed`` + ``verdict`` + node ``detail``) or None,
        ``origins`` (failing nodes whose inputs all agreed), ``final_outputs`` (unmarked runs),
        ``note``, for TensorRT, ``remedies``, and ``failure``: the one-line reason the diff
        must fail although no layer may diverge (:func:`failure_reason`: a final output
        missing from one side, non-finite values), or None.
    Raises:
        StageError: a model cannot be loaded or run. UsageError: bad tolerance/precision.
    """
    t0 = time.time()
    a_onnx, b_onnx = Path(a_onnx), Path(b_onnx)
    a_model, b_model = load_onnx(a_onnx), load_onnx(b_onnx)
    feed, batch = feed_plan(feed, [a_model, b_model], batch)  # a static batch decides
    b_trt = b_trt or b_engine is not None
    if precision is None:
        precision = tolerance_precision(b_model).lower()
        if precision == "fp32" and (b_trt or ep_b in ("cuda", "trt", "tensorrt")):
            precision = "tf32"
    tol = tolerances_for(precision, tolerances)
    batch = chunk_size([a_model, b_model], batch)
    backend_b = "TensorRT" if b_trt else f"ORT {ORT_EPS.get(ep_b, ep_b)}"
    result: dict[str, Any] = {
        "a": {"onnx": str(a_onnx), "backend": f"ORT {ORT_EPS.get(ep_a, ep_a)}"},
        "b": {"onnx": str(b_onnx), "backend": backend_b,
              "engine": str(b_engine) if b_engine else None},
        "precision": precision, "tolerances": tol, "note": MARKING_NOTE,
        "n_samples": int(len(next(iter(feed.values())))) if feed else 0,
        "inputs": {k: [list(v.shape), str(v.dtype)] for k, v in feed.items()},
    }
    if precision == "fp16" and not b_trt and ep_b == "cpu":
        # the CPU EP casts around most FP16 ops (stage 3 says so of its ort_fp16 row too)
        from deploykit.commands import script_command

        result["fp16_note"] = FP16_ON_CPU_NOTE.format(audit=script_command(
            "export_checks.py", ["fp16-audit", str(a_onnx), "--fp16", str(b_onnx)]))
    if b_trt:
        ok, info = trt_available()
        result["b"]["tensorrt"] = info if ok else None
        if not ok:
            result.update(status="skipped", reason=info, first_divergent=None, layers=[])
            if out_dir:
                write_reports(result, out_dir, title)
            return result

    # Unmarked final outputs: what the deployed model returns (fusions intact).
    a_final = collect_outputs(ort_activations(a_onnx, feed, ep=ep_a, batch=batch, opt_level=opt_level,
                                              mark_all=False))
    if b_trt:
        b_final_iter = trt_activations(b_onnx, feed, build=trt_build, batch=batch,
                                       mark_all=False, engine_path=b_engine)
    else:
        b_final_iter = ort_activations(b_onnx, feed, ep=ep_b, batch=batch, opt_level=opt_level,
                                       mark_all=False)
    output_map = dict(output_map or {})
    b_final = {output_map.get(k, k): v for k, v in collect_outputs(b_final_iter).items()}
    result["final_outputs"] = compare_outputs(a_final, b_final, tol)
    result["final_missing"] = {"in_b": [k for k in a_final if k not in b_final],
                               "in_a": [k for k in b_final if k not in a_final],
                               "a_outputs": list(a_final), "b_outputs": list(b_final)}

    # Marked runs, compared chunk by chunk so memory stays at one chunk of activations.
    a_iter = ort_activations(a_model, feed, ep=ep_a, batch=batch, opt_level=opt_level)
    b_iter = (trt_activations(b_onnx, feed, build=trt_build, batch=batch) if b_trt else
              ort_activations(b_model, feed, ep=ep_b, batch=batch, opt_level=opt_level))
    b_alias = lookthrough_aliases(b_model)
    b_alias_inv: dict[str, list[str]] = {}
    for t, r in b_alias.items():
        b_alias_inv.setdefault(r, []).append(t)
    for b_out_name, a_out_name in output_map.items():  # --map-output: B's name for A's tensor
        b_alias_inv.setdefault(a_out_name, []).insert(0, b_out_name)
    stats: dict[str, TensorStat] = {}
    b_of: dict[str, str | None] = {}
    for (a_out, n), (b_out, _) in zip(a_iter, b_iter):
        b_names = set(b_out)
        for name, a_val in a_out.items():
            if name not in b_of:
                b_of[name] = b_name_for(name, b_names, b_alias_inv)
            bn = b_of[name]
            if bn is None or bn not in b_out:
                continue
            stats.setdefault(name, TensorStat()).update(a_val, b_out[bn], n)

    rows = _rows_from_stats(a_model, stats, b_of, tol)
    result["layers"] = rows
    _attach_verdict(result, a_model, b_model, rows)
    fd = result["first_divergent"]
    if fd and not b_trt and precision in ("int8", "int4") and opt_level != "disable":
        _backend_check(result, a_onnx, b_onnx, feed, ep_a=ep_a, ep_b=ep_b, tolerances=tolerances,
                       precision=precision, batch=batch)
    if b_trt and result["first_divergent"]:
        result["remedies"] = trt_remedies(result["first_divergent"]["node"], b_onnx, precision,
                                          result["b"].get("tensorrt"), b_engine)
    result["status"] = "ok"
    result["failure"] = failure_reason(result)
    result["wall_time_s"] = round(time.time() - t0, 3)
    if out_dir:
        write_reports(result, out_dir, title)
    return result


def failure_reason(result: dict) -> str | None:
    """Why a finished diff must exit non-zero whatever its per-layer rows say: one line, or
    None.

    In this order: a final output of one side that the other does not have (the deployed
    model's result was never compared; names both sides' outputs and the fix); the first
    layer, in topological order, whose output holds NaN/Inf on either side (naming the side:
    a NaN reference means the inputs or A are broken, not B); a final output of B that is
    NaN/Inf although every marked layer is finite (a fused kernel of the unmarked graph).

    Args:
        result: :func:`run_layer_diff`'s dict (``layers``, ``final_outputs``,
            ``final_missing``, ``a``/``b``; ``--map-output`` already applied).
    """
    a, b = Path(result["a"]["onnx"]).name, Path(result["b"]["onnx"]).name
    miss = result.get("final_missing") or {}
    in_b, in_a = miss.get("in_b") or [], miss.get("in_a") or []
    if in_b or in_a:
        side, src, other, dst, names, have = (
            ("A", a, "B", b, in_b, miss.get("b_outputs")) if in_b else
            ("B", b, "A", a, in_a, miss.get("a_outputs")))
        # the --map-output pair that matches them: B's unmatched name = A's unmatched name
        pair = f"{in_a[0] if in_a else 'B_NAME'}={in_b[0] if in_b else 'A_NAME'}"
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        return (f"final output {names[0]!r} of {side} ({src}){more} is missing from {other} "
                f"({dst}, outputs: {', '.join(have or []) or 'none'}): the deployed result was "
                "never compared; export both with the same output names, or pass "
                f"--map-output {pair}")
    for r in result.get("layers") or []:
        na, nb = r.get("nonfinite_a") or 0, r.get("nonfinite_b") or 0
        if na or nb:
            where = ("in both A (the reference) and B" if na and nb else
                     "in A, the reference itself: check the inputs (NaN in the feed?) and "
                     f"{a}" if na else f"in B ({b}) where the reference is finite")
            return (f"first non-finite layer: {r['node']} ({r['op_type']}), output "
                    f"{r['tensor']!r} holds NaN/Inf {where}; every later comparison is "
                    "meaningless")
    for name, f in (result.get("final_outputs") or {}).items():
        if f.get("nonfinite_b") or f.get("nonfinite_a"):
            side = f"B ({b})" if f.get("nonfinite_b") else f"A ({a}, the reference)"
            return (f"final output {name!r} of {side} holds NaN/Inf in the unmarked run "
                    "(fusions intact) although every marked layer is finite: a fused kernel "
                    "makes it; rerun with --opt-level disable to confirm")
    return None


def _backend_check(result: dict, a_onnx: Path, b_onnx: Path, feed: dict[str, np.ndarray],
                   **kw) -> None:
    """Rule out the backend before blaming quantisation: repeat a Q/DQ comparison with all ORT
    graph optimisations disabled (the graph's reference semantics). If the divergence goes
    away or moves later, ORT's optimiser, not the quantised graph, caused it (seen with ModelOpt
    fp16 scales and ORT's ``WeightBiasQuantization``), and the verdict says so."""
    ref = run_layer_diff(a_onnx, b_onnx, feed, opt_level="disable", **kw)
    fd, fd_ref = result["first_divergent"], ref["first_divergent"]
    check = {"opt_level": "disable",
             "first_divergent": fd_ref["node"] if fd_ref else None,
             "final_outputs": ref.get("final_outputs")}
    result["backend_check"] = check
    if fd_ref is None or fd_ref["index"] > fd["index"]:
        where = (f"the first divergent layer becomes {fd_ref['node']}" if fd_ref else
                 "no layer diverges")
        fd["verdict"] = (f"ORT graph optimisations cause this divergence, not the quantised "
                         f"graph: with them disabled {where} (compare 3_onnx_eval.py "
                         f"--disable-optimizer WeightBiasQuantization). " + fd["verdict"])
        result["verdict"] = fd["verdict"]
        check["backend_caused"] = True
    else:
        check["backend_caused"] = False


def _rows_from_stats(a_model, stats: dict[str, TensorStat], b_of: dict, tol: dict) -> list[dict]:
    """One row per reference node output (topological order of the reference graph)."""
    producer = producers(a_model)
    inits = {t.name for t in a_model.graph.initializer}
    input_names = {name for name, _, _ in graph_inputs(a_model)}
    rows = []
    tensor_status: dict[str, str] = {}
    # Tensors computed only from Shape/Size and constants (dynamic padding, reshape targets):
    # compared like the others but left out of the table and plot, where they are noise.
    const = {o for n in a_model.graph.node if n.op_type == "Constant" for o in n.output} | inits
    shape_derived: set[str] = set()
    for node in a_model.graph.node:
        ins = [t for t in node.input if t and t not in const]
        if node.op_type in ("Shape", "Size") or (
                ins and all(t in shape_derived for t in ins)):
            shape_derived.update(o for o in node.output if o)
    for i, node in enumerate(a_model.graph.node):
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if not out:
                continue
            if out in stats:
                row = stats[out].result(tol)
            else:
                row = {"status": "unmatched", "note": "no counterpart in B (renamed, fused away "
                       "or not exposed)"}
            tensor_status[out] = row["status"]
            inputs = [t for t in node.input if t and t not in inits]
            agreed = []
            for t in inputs:
                if t in input_names or (t in shape_derived and tensor_status.get(t) != "fail"):
                    # shape arithmetic depends only on the (identical) input shapes
                    agreed.append(True)
                elif tensor_status.get(t) == "pass":
                    agreed.append(True)
                elif tensor_status.get(t) == "fail":
                    agreed.append(False)
                elif t in producer and producer[t].op_type == "Constant":
                    agreed.append(True)
                else:
                    agreed.append(None)
            inputs_agreed = (False if False in agreed else None if None in agreed else True)
            rows.append({"index": len(rows), "node_index": i, "node": node.name or f"node_{i}",
                         "op_type": node.op_type, "tensor": out, "b_tensor": b_of.get(out),
                         "inputs": inputs, "inputs_agreed": inputs_agreed,
                         "shape_only": out in shape_derived, **row})
    return rows


def _attach_verdict(result: dict, a_model, b_model, rows: list[dict]) -> None:
    """Fill ``first_divergent``, ``origins`` and summary counts from the rows."""
    fails = [r for r in rows if r["status"] == "fail"]
    result["summary"] = {k: sum(r["status"] == k for r in rows if not r["shape_only"])
                         for k in ("pass", "fail", "unmatched")}
    result["summary"]["shape_rows"] = sum(r["shape_only"] for r in rows)
    result["origins"] = [r["node"] for r in fails if r["inputs_agreed"] is True]
    if not fails:
        result["first_divergent"] = None
        result["verdict"] = "all compared tensors agree within tolerance"
        return
    first = dict(fails[0])
    cos = first.get("cosine_min")
    nonfinite = cos is None or (isinstance(cos, float) and not np.isfinite(cos))
    if nonfinite:
        verdict = (f"{first['node']} ({first['op_type']}) returns non-finite values (NaN/Inf)"
                   + (" although its inputs agree with the reference" if first["inputs_agreed"]
                      is True else ""))
    elif first["inputs_agreed"] is True and result.get("precision") in ("int8", "int4"):
        verdict = (f"quantisation error first exceeds the {result['precision']} tolerance at "
                   f"{first['node']} ({first['op_type']}): its inputs were within tolerance")
    elif first["inputs_agreed"] is True:
        verdict = (f"{first['node']} ({first['op_type']}) is wrong: its inputs agree with the "
                   "reference, its output does not")
    elif first["inputs_agreed"] is False:
        verdict = f"{first['node']}: error arrived from upstream (its inputs already differ)"
    else:
        verdict = (f"{first['node']}: output differs; some inputs are not observable in B, so "
                   "the error may have arrived from upstream")
    first["verdict"] = verdict
    first["detail"] = _node_detail(a_model, b_model, first["node"])
    result["first_divergent"] = first
    result["verdict"] = verdict


def diff_command(model: str, a_onnx: Path | str, b_onnx: Path | str, precision: str,
                 out_dir: Path | str, *, classifier: bool = True, ep: str = "cpu",
                 engine: Path | str | None = None, n: int = 8,
                 inputs: Path | str | None = None, weights: str | None = None) -> str:
    """The shell-quoted ``layerwise.py`` command that names the first layer where ``b_onnx``
    (or the TensorRT ``engine`` built from it) leaves the reference ``a_onnx``: the first
    diagnostic of a row whose parity failed. When both files are the same (the FP32 ONNX
    itself), the command compares the PyTorch modules with the ONNX (``torch-vs-onnx``).

    Args:
        precision: the row's precision label (``FP16``, ``INT8``...), mapped to the diff's
            tolerance class. classifier: feed ``--n`` eval images of ``--model`` (else random
            inputs of the model's shapes, or ``inputs``). ep: ORT EP of side B.
        inputs: a model with its own data: the ``.npz`` its rows ran on (stage 1's
            ``ref_outputs.npz`` serves: :func:`deploykit.feeds.load_feed` reads its ``in:*``
            inputs); None: random inputs.
        weights: the PyTorch reference's weights (its stage-1 row's ``weights``: a path, or
            ``random-init``; ``default``/None: the model's own), for ``torch-vs-onnx``.
    Returns:
        one command line that pastes from any folder
        (:func:`deploykit.commands.script_command`: ``cd`` into the root, this run's
        environment, absolute paths, every argument quoted with :func:`shlex.quote`).
    """
    from deploykit.commands import script_command

    feed = ["--inputs", str(inputs)] if inputs is not None and not classifier else []
    if engine is None and Path(a_onnx).resolve() == Path(b_onnx).resolve():
        own = (["--random-init"] if weights == "random-init" else
               ["--weights", str(weights)] if weights and weights != "default" else [])
        argv = ["torch-vs-onnx", "--model", model, "--onnx",
                str(b_onnx), "--n", str(n), "--out-dir", str(out_dir), *feed, *own]
        return script_command("layerwise.py", argv, model)
    argv = ["diff", str(a_onnx), str(b_onnx), *feed]
    if classifier:
        argv += ["--model", model, "--n", str(n)]
    prec = str(precision).lower()[:4]
    if prec in TOLERANCES:
        argv += ["--precision", prec]
    if engine is not None:
        argv += ["--engine-b", str(engine)]
    elif ep != "cpu":
        argv += ["--ep-b", ep]
    argv += ["--out-dir", str(out_dir)]
    return script_command("layerwise.py", argv, model)
