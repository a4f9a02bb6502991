#!/usr/bin/env python3
"""Stage 3: evaluate any ONNX file with ONNX Runtime: top-1/top-5, latency, size, and parity
against the PyTorch FP32 reference logits; records the execution provider (EP) asked for and
the one the session really used.

Reads:  ``--onnx PATH``; ``artifacts/<model>/ref_logits.npz`` (1_pytorch_baseline.py) and the
        eval split cache (0_prepare_data.py); for custom models ``ref_outputs.npz``.
Writes: ``results/<model>/<tag>.json``.
Rerun:  ``python 3_onnx_eval.py --model efficientnet_lite0 --onnx artifacts/efficientnet_lite0/onnx/fp16.onnx --tag ort_fp16``

Provenance: the row records what it was measured against (``measured_against``: SHA-256 of
the reference, of the file evaluated and, for an FP16/Q/DQ file, of the fp32.onnx and
calibration data its producer recorded: ``export.json`` / ``quant_<variant>.json``, matched by
the file's hash). A file whose recorded fp32.onnx is not the current one is still measured
(it was given explicitly) with a ``WARNING: ... is stale`` line and ``stale_source`` in the row;
a derived file no record names gets a ``WARNING: no record ...`` line (unknown source).

Status: the row's parity with the PyTorch reference under its precision's band of
``deploykit.compare.ROW_TOLERANCES``: ``failed`` (non-finite outputs, or cosine / top-1 agreement
below the failed bound), ``warn`` (below the ok bound) or ``ok``, with ``status_reason`` (metric,
value, bound) and ``next_step`` (the ``layerwise.py`` command that names the first divergent
layer). A warn/failed row is still written and replaces an earlier ok row of the tag, a
``WARNING:`` line says why, and the exit status stays 0: ``run_all.sh`` measures the known INT8
collapses (``ort_baseline``, ``ort_int8``) on purpose and goes on. Exit 1 only when nothing could
be measured (no session, a run that raised).

First look: the accuracy pass starts with 128 seeded-random samples of the split, 32 of them
first; when either look already proves the row ``failed`` beyond doubt (``deploykit.sequential``:
NaN/Inf, a cosine minimum under the failed bound, or a mean whose Hoeffding bound at alpha 5e-5
per look, 1e-4 over both, stays under it) the other samples are not run, the row says so
(``first_look``, its reason) and its diagnostics use those samples; any other row runs every
sample once. ``--full-eval`` measures all of them.

Backend cross-check (Q/DQ models): ONNX Runtime is not a neutral judge of Q/DQ graphs: some of its
graph optimisations (e.g. ``WeightBiasQuantization``) change the numerics of a Q/DQ model. For a
Q/DQ file this stage therefore also runs images in the graph's own numerics (each Q/DQ as
written + float ops, the graph's reference semantics: ORT's default level with its Q/DQ rewrites
off, its optimised graph checked node by node, else every optimisation off;
``deploykit.quant.reference``): by default a seeded random 32,
128, then 512 images (4 times more per look on larger splits), stopping at a look only when a
disagreement or an agreement is beyond doubt there (exact bounds), else every image; and flags a
backend disagreement when top-1 differs by more than ``--cross-check-tol`` points. A row decided
on its first look is cross-checked on those samples, and the verdict is one beyond doubt about
the whole split or none (``disagreement`` null). A "collapse" that disappears there is an ORT optimiser
effect, not a quantization failure. A model that is not a classifier gets the same cross-check
on every output (cosine; ``deploykit.quant.cross_check.backend_cross_check``). When the backend disagrees (and
with ``--layerwise``) the stage also writes the per-layer table that separates quantization error
(float vs Q/DQ graph, both unoptimised) from backend error (the Q/DQ graph optimised vs not):
``results/<model>/quant_backend_<tag>/`` (``layerwise.py quant-backend``). These diagnostics run
after the row is written and never change its status; a cross-check that blames ORT names that
in the reason of a warn/failed row and makes its next step the run with the graph's own numerics.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from deploykit.layout import ref_outputs_path
from deploykit.layout import fp32_onnx_path, ref_logits_path
from deploykit.commands import script_command
from deploykit.cli import add_shared_args, check_positive, cli, stage_parser
from deploykit.io import require
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import (
    EvalData,
    base_record,
    classifier_data,
    custom_data,
    diagnose,
    evaluate,
    evaluated_data,
    summary_line,
    verdict_warning,
)
from deploykit.feeds import load_feed
from deploykit.install import rejected_reason
from deploykit.io import check_writable, file_size_mb
from deploykit.lock import lock_folders
from deploykit.layerwise.diff import diff_command, run_layer_diff
from deploykit.layerwise.quant_backend import quant_backend_table, render_quant_backend
from deploykit.layerwise.report import render_table
from deploykit.layout import check_row_tag, model_artifacts, model_results
from deploykit.models import model_spec
from deploykit.onnx.graph import (detect_precision, load_onnx, precision_note,
                                  tolerance_precision)
from deploykit.quant.cross_check import X64_QUANT_PRECISION, backend_cross_check
from deploykit.results import (check_source, provenance, reference_row, weights_mismatch,
                               write_result)
from deploykit.runners import ORT_EPS, OrtRunner
from deploykit.sequential import FIRST_LOOK
from deploykit.variants import variant_of_file


STAGE = "3_onnx_eval"


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    p.add_argument("--onnx", type=Path, required=True, help="ONNX file to evaluate")
    p.add_argument("--tag", required=True,
                   help="row id, e.g. ort_fp32 (results/<model>/<tag>.json)")
    add_shared_args(p, "model", "inputs", "logits_output")
    p.add_argument("--precision", default="auto",
                   help="FP32/FP16/INT8/INT4 label for the report (auto: read from the file)")
    p.add_argument("--ep", default=os.environ.get("ORT_EP", "cpu"), choices=sorted(ORT_EPS),
                   help="execution provider to ask for (default from $ORT_EP)")
    p.add_argument("--allow-cpu-fallback", action="store_true",
                   help="run on CPU (and record it) if the requested GPU EP cannot be used")
    p.add_argument("--no-tf32", action="store_true",
                   help="CUDA EP: strict FP32 (use_tf32=0) for a parity pass without TF32; the "
                        "row records the TF32 state the session really used")
    p.add_argument("--x64-quant-precision", action="store_true",
                   help="CPU EP: session option session.x64quantprecision=1 (u8u8 instead of "
                        "u8s8 int8 kernels on x86-64 CPUs without VNNI, whose u8s8 products can "
                        "saturate; ORT PR #12088)")
    p.add_argument("--opt-level", default="all", choices=("disable", "basic", "extended", "all"),
                   help="ORT graph optimisation level")
    p.add_argument("--disable-optimizer", action="append", default=[],
                   help="ORT optimizer to disable (repeatable), e.g. WeightBiasQuantization")
    add_shared_args(p, "batch_size", "limit", "latency_batch", "warmup", "iters",
                    "max_seconds",
                    "threads")
    p.add_argument("--full-eval", action="store_true",
                   help="measure every sample even when a first look at 128 of them (seeded "
                        "random) already proves the row failed beyond doubt (deploykit."
                        "sequential: Hoeffding bound, alpha 1e-4); the exact figure of a "
                        "collapsed file")
    p.add_argument("--cross-check-images", type=int, default=-1,
                   help="images for the Q/DQ backend cross-check (-1: adaptive: seeded "
                        "random looks of 32, 128, 512 (x4 on larger splits), final only on a "
                        "verdict beyond doubt, else every image; N: a seeded random N; 0 "
                        "disables it)")
    p.add_argument("--cross-check-tol", type=float, default=2.0,
                   help="top-1 difference (points) that counts as a backend disagreement")
    p.add_argument("--layerwise", action="store_true",
                   help="also compare every layer with the FP32 ONNX on ORT CPU (layerwise.py); "
                        "writes results/<model>/layerwise_<tag>/")
    p.add_argument("--layerwise-images", type=int, default=8,
                   help="eval images for --layerwise")
    return p


def is_qdq(precision: str) -> bool:
    """True for quantized (Q/DQ) precisions (INT8, INT4)."""
    return precision.startswith("INT")


X64_PRECISION = X64_QUANT_PRECISION


def preflight(args: argparse.Namespace, ahead: bool = False) -> None:
    """The checks of the flags that need no file: counts positive; with ``ahead`` (stage 5,
    on its ``--eval-args``, before it quantizes anything) also the EP present in this
    onnxruntime (unless ``--allow-cpu-fallback``) and ``--inputs`` only for a model with its
    own data, which :func:`main` finds later (an EP it lacks: a failed row).

    Raises:
        UsageError: a bad flag. StageError: the EP is not in this onnxruntime build.
    """
    check_positive(args, "limit", "batch_size", "latency_batch", "iters")
    check_positive(args, "warmup", "threads", allow_zero=("warmup", "threads"))
    if args.cross_check_images < -1:
        raise UsageError(f"--cross-check-images {args.cross_check_images}: give -1 (adaptive), "
                         "0 (off) or a number of images")
    if not 0 <= args.cross_check_tol < 100:
        raise UsageError(f"--cross-check-tol {args.cross_check_tol}: give top-1 points in "
                         "[0, 100), e.g. 2")
    if not ahead:
        return
    import onnxruntime as ort

    have = ort.get_available_providers()
    if ORT_EPS[args.ep] not in have and not args.allow_cpu_fallback:
        raise StageError(f"--ep {args.ep}: this onnxruntime ({ort.__version__}) has no "
                         f"{ORT_EPS[args.ep]} (it has {', '.join(have)}): install "
                         "onnxruntime-gpu, or add --allow-cpu-fallback")
    if args.inputs and model_spec(args.model).classifier:
        raise UsageError(f"--model {args.model} is an ImageNet classifier, judged on the "
                         "eval split; --inputs is for models with their own data")


def main(args: argparse.Namespace) -> dict:
    """Evaluate ``--onnx`` on ORT and write ``results/<model>/<tag>.json``.

    Returns:
        the results row (:mod:`deploykit.evaluate` schema).
    Raises:
        UsageError: bad flags or EP name. StageError: missing inputs, a session that cannot be
            created or run (the failure is recorded in the row first).
    """
    started = time.time()
    check_row_tag(args.model, args.tag, stage=STAGE)
    check_writable(model_results(args.model))
    preflight(args)
    # one writer per folder, held until this process exits (a second writer is refused)
    lock_folders(model_artifacts(args.model), model_results(args.model))
    spec = model_spec(args.model)
    why = rejected_reason(args.onnx) if not Path(args.onnx).exists() else None
    if why is not None:  # stage 2 refused this file (an FP16 candidate): a skipped row, exit 0
        return _skip_rejected(args, why, started)
    onnx_path = require(args.onnx, "2_export_onnx.py / 5_quantize.sh (whichever makes it)")
    graph = load_onnx(onnx_path, external=False)
    precision = detect_precision(graph) if args.precision == "auto" else args.precision
    # the tolerance its layer-wise diagnostics compare at (Q/DQ without a quantized MAC: INT8)
    diff_precision = tolerance_precision(graph) if args.precision == "auto" else precision
    # Q/DQ nodes that quantize no MAC (a dead pair): the file computes in float, said and kept
    qdq_note = precision_note(graph) if args.precision == "auto" else None
    if qdq_note:
        print(f"WARNING: {onnx_path.name}: {qdq_note}", file=sys.stderr)
    del graph
    variant = variant_of_file(onnx_path)
    # What a derived file (FP16, Q/DQ) was made from: its producer's record, matched by hash.
    # A stale source (fp32.onnx re-exported since) is still measured (the file was given), but
    # said and recorded: the report marks the row stale.
    source, stale, warn = check_source(args.model, onnx_path, fp32_onnx_path(args.model),
                                       derived=precision != "FP32" or qdq_note is not None)
    if warn:
        print(warn, file=sys.stderr)
    base = dict(onnx=str(onnx_path), variant=variant.name if variant else None,
                stale_source=stale, qdq_without_int8_macs=qdq_note)
    # Inputs are checked before any session exists, so a mismatch never overwrites a good row.
    if spec.classifier:
        if args.inputs:
            raise UsageError(f"--model {args.model} is an ImageNet classifier, judged on the "
                             "eval split; --inputs is for models with their own data")
        ref_path = require(ref_logits_path(args.model), "1_pytorch_baseline.py")
        data = classifier_data(spec, args.limit, ref_path)
    else:
        ref_path = ref_outputs_path(args.model)
        data = custom_data(ref_path, args.limit, args.inputs, args.model)

    def fail(reason: str, desc: dict | None = None) -> None:
        rec = base_record(STAGE, precision, args.model, args.tag, desc, backend="ORT",
                          status="failed", reason=reason, **base)
        if desc is None:
            rec["ep_requested"] = ORT_EPS[args.ep]
        rec["provenance"] = provenance(args, [onnx_path], started)
        write_result(args.model, args.tag, rec)

    try:
        runner = OrtRunner(onnx_path, args.ep, args.allow_cpu_fallback, args.opt_level,
                           args.disable_optimizer, args.threads,
                           tf32=False if args.no_tf32 else None,
                           session_config=X64_PRECISION if args.x64_quant_precision
                           else None, cpu_chunk=True)
    except StageError as e:
        fail(str(e))
        raise
    if precision == "FP16" and runner.used == "CPUExecutionProvider":
        # ORT's CPU EP has FP16 kernels for few ops and inserts Casts around the rest, so this
        # row's FP16 graph is computed in FP32: it cannot show FP16 overflow (stage 2's range
        # audit and onnx.reference, or a GPU EP, judge real FP16).
        base["fp16_computed_in"] = "FP32 (ORT CPU EP: Casts around ops without FP16 kernels)"
    # the layer-wise diagnostics run on the EP this session really used
    diff_ep = args.ep if runner.used == ORT_EPS[args.ep] else "cpu"
    next_step = diff_command(args.model, fp32_onnx_path(args.model), onnx_path, diff_precision,
                             model_results(args.model) / f"layerwise_{args.tag}",
                             classifier=spec.classifier, ep=diff_ep,
                             inputs=args.inputs or (ref_outputs_path(args.model)
                                                    if not spec.classifier else None),
                             weights=(reference_row(args.model, ref_path) or {}).get("weights"))
    with runner:
        if data.classifier:
            data.input_name = runner.input_names[0]
        try:
            rec, outputs = evaluate(
                runner, data, stage=STAGE, precision=precision, model=args.model, tag=args.tag,
                args=args, started=started, inputs=[onnx_path, ref_path],
                batch_size=args.batch_size, latency_batch=args.latency_batch,
                warmup=args.warmup, iters=args.iters, size_mb=file_size_mb(onnx_path),
                next_step=next_step, reference=ref_path, evaluated=onnx_path, source=source,
                first_look=0 if args.full_eval else FIRST_LOOK, **base)
        except (UsageError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            # ORT can load a model and still fail at the first run (e.g. a blocked
            # DequantizeLinear whose axis disagrees with its scale): record why, then fail.
            msg = _short_ort_error(e) if not isinstance(e, StageError) else str(e)
            fail(f"inference failed: {msg}", runner.describe())
            if isinstance(e, StageError):
                raise
            raise StageError(f"onnxruntime failed to run {onnx_path}: {msg}") from e
    n_split = len(data)
    data = evaluated_data(data, rec)  # a row decided on its first look: those samples
    path = model_results(args.model) / f"{args.tag}.json"
    mismatch = weights_mismatch(args.model, ref_path)
    if mismatch:  # no parity can hold: say why before anyone debugs the ONNX
        rec["weights_mismatch"] = mismatch
        if rec["status"] != "ok":
            rec["status_reason"] = rec["reason"] = (f"{rec['status_reason']}; likely cause: "
                                                    f"{mismatch}")
        write_result(args.model, args.tag, rec)
        print(f"WARNING: {mismatch}", file=sys.stderr)
    print(f"{summary_line(rec)} -> {path}")
    if verdict_warning(rec):
        print(verdict_warning(rec), file=sys.stderr)
    # Diagnostics: after the row is written; they never change its status.
    cc = None
    if is_qdq(precision) and args.cross_check_images and args.opt_level != "disable":
        config = X64_PRECISION if args.x64_quant_precision else None
        cc = diagnose(rec, "backend_cross_check", lambda: backend_cross_check(
            onnx_path, data, outputs, n=args.cross_check_images, batch=args.batch_size,
            tol_points=args.cross_check_tol, opt_level=args.opt_level, session_config=config,
            population=n_split))
        if cc and cc["disagreement"]:
            print(f"WARNING: ORT backend disagreement on {onnx_path.name}: {cc['reason']}. ONNX Runtime, "
                  "not the quantization, changes the result: do not report this as a collapse."
                  + (f" Cause: {cc['cause']}." if cc.get("cause") else ""), file=sys.stderr)
            if rec["status"] != "ok":
                _blame_backend(args, rec, cc, onnx_path)
    # Quantization error vs backend error, per layer: with --layerwise, and whenever the
    # cross-check saw the backend disagree with the graph.
    if is_qdq(precision) and (args.layerwise or (cc and cc.get("disagreement"))):
        diagnose(rec, "quant_backend", lambda: _quant_backend(
            args, spec, data, onnx_path, diff_ep))
    if args.layerwise:
        diagnose(rec, "layerwise", lambda: _layerwise(args, spec, onnx_path, diff_precision,
                                                      diff_ep))
    return rec


def _blame_backend(args, rec: dict, cc: dict, onnx_path: Path) -> None:
    """A row that is not ok while the backend cross-check shows ORT's optimised run, not the
    Q/DQ graph, changing the result: the status stays (the row measures what this session
    computes), its reason says so and the next step becomes the run that shows the graph's own
    numerics (``--x64-quant-precision`` when u8s8 saturation is the cause, else
    ``--opt-level disable``); the row is rewritten."""
    rec["status_reason"] = rec["reason"] = (
        f"{rec['status_reason']}; the backend cross-check shows ONNX Runtime, not the "
        f"quantization, changing the result ({cc['reason']}"
        + (f"; cause: {cc['cause']}" if cc.get("cause") else "") + ")")
    fix = ["--x64-quant-precision"] if cc.get("cause") else ["--opt-level", "disable"]
    argv = ["--model", args.model, "--onnx", str(onnx_path),
            "--tag", f"{args.tag}_{'x64' if cc.get('cause') else 'noopt'}", *fix]
    rec["next_step"] = script_command("3_onnx_eval.py", argv, args.model)
    write_result(args.model, args.tag, rec)
    print(f"WARNING: row {args.tag} stays {rec['status'].upper()} (it measures what this ORT "
          f"session computes); the graph's own numerics: {rec['next_step']}", file=sys.stderr)


def _skip_rejected(args, why: str, started: float) -> dict:
    """The row of a file that its producing stage rejected (``<name>.rejected.json`` beside it):
    ``status: skipped`` with the reason, replacing an earlier row of the file that was there
    before (that file is gone: stage 2 moved it aside), and a ``SKIPPED`` line."""
    variant = variant_of_file(args.onnx)
    precision = args.precision if args.precision != "auto" else (
        variant.precision if variant else "unknown")
    rec = base_record(STAGE, precision, args.model, args.tag, backend="ORT", status="skipped",
                      reason=why, onnx=str(args.onnx),
                      variant=variant.name if variant else None)
    rec["provenance"] = provenance(args, [], started)
    path = write_result(args.model, args.tag, rec, keep_good=False)
    print(f"{STAGE}: SKIPPED {args.tag}: {why}; FP32 and the other files are unaffected "
          f"-> {path}")
    return rec


def _quant_backend(args, spec, data: EvalData, onnx_path: Path, ep: str) -> dict:
    """``deploykit.layerwise.quant_backend.quant_backend_table`` of ``onnx_path`` against the model's FP32 ONNX on
    ``--layerwise-images`` samples; writes ``results/<model>/quant_backend_<tag>/`` and returns
    a summary for the row."""

    ref_onnx = require(fp32_onnx_path(args.model),
                       "2_export_onnx.py")
    n = args.layerwise_images
    feed = (load_feed(None, args.model, n, ref_onnx) if spec.classifier
            else {k: v[:n] for k, v in data.feed.items()})
    out_dir = model_results(args.model) / f"quant_backend_{args.tag}"
    print(f"quantization vs backend error per layer: every tensor of 3 ORT runs (float, Q/DQ "
          f"unoptimised, Q/DQ as run) on {len(next(iter(feed.values())))} samples -> {out_dir}",
          file=sys.stderr, flush=True)
    res = quant_backend_table(ref_onnx, onnx_path, feed, ep=ep,
                              opt_level=args.opt_level,
                              disabled_optimizers=args.disable_optimizer,
                              batch=args.batch_size, out_dir=out_dir)
    print(render_quant_backend(res, max_rows=40))
    return {"out_dir": str(out_dir), "verdict": res["verdict"],
            "first_quant": res["first_quant"], "first_backend": res["first_backend"],
            "channels_lost": res["channels_lost"][:5]}


def _layerwise(args, spec, onnx_path: Path, precision: str, ep: str) -> dict:
    """Layer-wise comparison with the FP32 ONNX on ORT CPU (``layerwise.py``); writes
    ``results/<model>/layerwise_<tag>/`` and returns a summary for the row."""

    ref_onnx = require(fp32_onnx_path(args.model),
                       "2_export_onnx.py")
    feed = load_feed(None, args.model if spec.classifier else None,
                     args.layerwise_images, ref_onnx)
    out_dir = model_results(args.model) / f"layerwise_{args.tag}"
    res = run_layer_diff(ref_onnx, onnx_path, feed, ep_b=ep,
                         precision=precision.lower(), opt_level=args.opt_level,
                         out_dir=out_dir)
    print(render_table(res, max_rows=40))
    return {"out_dir": str(out_dir), "first_divergent": res.get("first_divergent"),
            "verdict": res.get("verdict"), "summary": res.get("summary")}


def _short_ort_error(e: Exception) -> str:
    """One line naming the failing node and ORT's own explanation (the end of its message)."""
    text = " ".join(str(e).split())
    node = re.search(r"Name:'([^']+)'", text)
    detail = text.split("Status Message:")[-1].strip()
    if " was false. " in detail:  # ORT_ENFORCE: "<condition> was false. <explanation>"
        detail = detail.split(" was false. ", 1)[1]
    head = f"{type(e).__name__}" + (f" in node {node.group(1)}" if node else "")
    return f"{head}: {detail[-300:]}"


if __name__ == "__main__":
    cli(get_args_parser, main)
