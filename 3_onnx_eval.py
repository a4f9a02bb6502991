#!/usr/bin/env python3
"""Stage 3: evaluate any ONNX file with ONNX Runtime: top-1/top-5, latency, size, and parity
against the PyTorch FP32 reference logits; records the execution provider (EP) asked for and
the one the session really used.

Reads:  ``--onnx PATH``; ``artifacts/<model>/ref_logits.npz`` (1_pytorch_baseline.py) and the
        eval split cache (0_prepare_data.py); for custom models ``ref_outputs.npz``.
Writes: ``results/<model>/<tag>.json``.
Rerun:  ``python 3_onnx_eval.py --model efficientnet_lite0 --onnx artifacts/efficientnet_lite0/onnx/fp16.onnx --tag ort_fp16``

Backend cross-check (Q/DQ models): ONNX Runtime is not a neutral judge of Q/DQ graphs: some of its
graph optimisations (e.g. ``WeightBiasQuantization``) change the numerics of a Q/DQ model. For a
Q/DQ file this stage therefore also runs the first ``--cross-check-images`` images with all graph
optimisations disabled (plain DequantizeLinear + float ops, the graph's reference semantics) and
flags a backend disagreement when top-1 differs by more than ``--cross-check-tol`` points. A
"collapse" that disappears there is an ORT optimiser effect, not a quantization failure.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

import common
import onnx_graph


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__)
    p.add_argument("--onnx", type=Path, required=True, help="ONNX file to evaluate")
    p.add_argument("--tag", required=True, help="row id, e.g. ort_fp32 (results/<model>/<tag>.json)")
    common.add_shared_args(p, "model")
    p.add_argument("--precision", default="auto",
                   help="FP32/FP16/INT8/INT4 label for the report (auto: read from the file)")
    p.add_argument("--ep", default=os.environ.get("ORT_EP", "cpu"), choices=sorted(common.ORT_EPS),
                   help="execution provider to ask for (default from $ORT_EP)")
    p.add_argument("--allow-cpu-fallback", action="store_true",
                   help="run on CPU (and record it) if the requested GPU EP cannot be used")
    p.add_argument("--opt-level", default="all", choices=("disable", "basic", "extended", "all"),
                   help="ORT graph optimisation level")
    p.add_argument("--disable-optimizer", action="append", default=[],
                   help="ORT optimizer to disable (repeatable), e.g. WeightBiasQuantization")
    common.add_shared_args(p, "batch_size", "limit", "latency_batch", "warmup", "iters",
                           "threads")
    p.add_argument("--cross-check-images", type=int, default=-1,
                   help="images for the Q/DQ backend cross-check (-1: the whole eval split; "
                        "0 disables it)")
    p.add_argument("--cross-check-tol", type=float, default=2.0,
                   help="top-1 difference (points) that counts as a backend disagreement")
    p.add_argument("--layerwise", action="store_true",
                   help="also compare every layer with the FP32 ONNX on ORT CPU (layerwise.py); "
                        "writes results/<model>/layerwise_<tag>/")
    p.add_argument("--layerwise-images", type=int, default=8,
                   help="eval images for --layerwise")
    return p


def is_qdq(precision: str) -> bool:
    return precision.startswith("INT")


def cross_check(path: Path, x, y, spec, input_name: str, logits_main: np.ndarray,
                n: int, tol: float, batch: int) -> dict:
    """Top-1 of the first ``n`` images with ORT graph optimisations disabled vs the main session.

    Returns:
        ``{"n", "top1_main", "top1_unoptimized", "top1_agreement", "disagreement": bool}``.
    """
    n = len(y) if n < 0 else min(n, len(y))
    with common.OrtRunner(path, "cpu", opt_level="disable") as r:
        ref = common.run_batched(r, x[:n], spec, input_name, batch)
    t_main = common.topk_accuracy(logits_main[:n], y[:n], (1,))["top1"]
    t_ref = common.topk_accuracy(ref, y[:n], (1,))["top1"]
    agree = float(100.0 * (ref.argmax(1) == logits_main[:n].argmax(1)).mean())
    return {"n": n, "top1_main": t_main, "top1_unoptimized": t_ref, "top1_agreement": agree,
            "tolerance_points": tol, "disagreement": bool(abs(t_main - t_ref) > tol)}


def main(args: argparse.Namespace) -> dict:
    started = time.time()
    spec = common.model_spec(args.model)
    onnx_path = common.require(args.onnx, "2_export_onnx.py / 5_quantize.sh (whichever makes it)")
    precision = (onnx_graph.detect_precision(onnx_graph.load(onnx_path, external=False))
                 if args.precision == "auto" else args.precision)
    art = common.model_artifacts(args.model)
    base = dict(ep_requested=common.ORT_EPS[args.ep], onnx=str(onnx_path),
                opt_level=args.opt_level, disabled_optimizers=args.disable_optimizer)
    for name in ("limit", "batch_size", "latency_batch", "iters"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise common.UsageError(f"--{name.replace('_', '-')} must be >= 1 (got {v})")
    data = None
    if spec.classifier:
        ref_path = common.require(art / "ref_logits.npz", "1_pytorch_baseline.py")
        # Checked before any session exists, so a mismatch never overwrites a good row.
        x, y, files = common.load_split("eval", spec, args.limit)
        data = (x, y, aligned_reference(ref_path, files, args.limit))
    else:
        ref_path = common.require(art / "ref_outputs.npz", "1_pytorch_baseline.py --input-shape ...")
    try:
        runner = common.OrtRunner(onnx_path, args.ep, args.allow_cpu_fallback, args.opt_level,
                                  args.disable_optimizer, args.threads)
    except common.StageError as e:
        rec = common.result_record("3_onnx_eval", "ORT", precision, args.model, args.tag,
                                   status="failed", reason=str(e), **base)
        rec["provenance"] = common.provenance(args, [onnx_path], started)
        common.write_result(args.model, args.tag, rec)
        raise
    rec = common.result_record("3_onnx_eval", "ORT", precision, args.model, args.tag, **base,
                               ep_used=runner.used, cpu_fallback=runner.fallback_reason)
    try:
        return _evaluate(args, spec, onnx_path, precision, ref_path, data, runner, rec, started)
    except Exception as e:
        # ORT can load a model and still fail at the first run (e.g. a blocked
        # DequantizeLinear whose axis disagrees with its scale): record why, then fail.
        if isinstance(e, (common.UsageError, KeyboardInterrupt)):
            raise
        msg = _short_ort_error(e)
        failed = common.result_record("3_onnx_eval", "ORT", precision, args.model, args.tag,
                                      status="failed", reason=f"inference failed: {msg}", **base,
                                      ep_used=runner.used)
        failed["provenance"] = common.provenance(args, [onnx_path], started)
        common.write_result(args.model, args.tag, failed)
        if isinstance(e, common.StageError):
            raise
        raise common.StageError(f"onnxruntime failed to run {onnx_path}: {msg}") from e


def _short_ort_error(e: Exception) -> str:
    """One line naming the failing node and ORT's own explanation (the end of its message)."""
    text = " ".join(str(e).split())
    node = re.search(r"Name:'([^']+)'", text)
    detail = text.split("Status Message:")[-1].strip()
    if " was false. " in detail:  # ORT_ENFORCE: "<condition> was false. <explanation>"
        detail = detail.split(" was false. ", 1)[1]
    head = f"{type(e).__name__}" + (f" in node {node.group(1)}" if node else "")
    return f"{head}: {detail[-300:]}"


def aligned_reference(ref_path: Path, files: list[str], limit: int | None) -> np.ndarray:
    """Reference logits ``[N, C]`` for the eval ``files`` (:func:`common.align_reference`).

    Raises:
        StageError: the reference does not cover every file (stage 1 ran with a smaller
            ``--limit`` or on another split); the message says which rerun fixes it.
    """
    logits, mask = common.align_reference(ref_path, files)
    if not mask.all():
        with np.load(ref_path) as z:
            n_ref = len(z["files"])
        hint = (f"pass --limit {n_ref} (or less), or rerun 1_pytorch_baseline.py "
                "without --limit" if n_ref < len(files) else
                "rerun 1_pytorch_baseline.py after 0_prepare_data.py")
        raise common.StageError(
            f"{ref_path} covers {n_ref} eval images but {int((~mask).sum())} of the "
            f"{len(files)} asked for (--limit {limit}) are not among them: {hint}")
    return logits


def _evaluate(args, spec, onnx_path: Path, precision: str, ref_path: Path, data, runner,
              rec: dict, started: float) -> dict:
    """Accuracy, parity, cross-check and latency of an open ORT session; writes the row."""
    with runner:
        if spec.classifier:
            x, y, ref_logits = data
            inp = runner.input_names[0]
            logits = common.run_batched(runner, x, spec, inp, args.batch_size)
            acc = common.topk_accuracy(logits, y)
            par = common.parity(ref_logits, logits)
            rec.update(n_images=len(y), accuracy=acc, parity=par)
            feed = {inp: common.normalize(x[:args.latency_batch], spec.mean, spec.std)}
            if is_qdq(precision) and args.cross_check_images and args.opt_level != "disable":
                cc = cross_check(onnx_path, x, y, spec, inp, logits, args.cross_check_images,
                                 args.cross_check_tol, args.batch_size)
                rec["backend_cross_check"] = cc
                if cc["disagreement"]:
                    print(f"WARNING: ORT backend disagreement on {onnx_path.name}: top-1 "
                          f"{cc['top1_main']:.1f}% at opt level {args.opt_level} vs "
                          f"{cc['top1_unoptimized']:.1f}% with graph optimisations disabled "
                          f"({cc['n']} images). The ORT optimiser, not the quantization, changes "
                          "the result: do not report this as a collapse.", file=sys.stderr)
            summary = (f"top-1 {acc['top1']:.2f}% top-5 {acc['top5']:.2f}% cosine "
                       f"{par['cosine_mean']:.5f} top-1 agreement {par['top1_agreement']:.1f}%")
        else:
            with np.load(ref_path) as z:
                feed_ref = {k[3:]: z[k] for k in z.files if k.startswith("in:")}
                ref_out = {k[4:]: z[k] for k in z.files if k.startswith("out:")}
            outs = runner.infer(feed_ref)
            rec["parity_outputs"] = {
                name: common.parity(ref, o) for (name, ref), o in zip(ref_out.items(),
                                                                      outs.values())}
            rec["parity"] = next(iter(rec["parity_outputs"].values()))
            rec.update(accuracy=None, reason_accuracy="not an ImageNet classifier")
            feed = {k: v[:args.latency_batch] for k, v in feed_ref.items()}
            summary = f"cosine min {rec['parity']['cosine_min']:.6f} (accuracy does not apply)"
        times = common.time_callable(lambda: runner.infer(feed), args.warmup, args.iters)
    rec["latency"] = common.latency_stats(times, args.latency_batch)
    rec["latency_timer"] = "time.perf_counter around InferenceSession.run"
    rec["harness_overhead_ms"] = common.null_backend_ms()
    rec["size_mb"] = common.file_size_mb(onnx_path)
    rec["device"] = "cpu" if runner.used == "CPUExecutionProvider" else "cuda"
    rec["provenance"] = common.provenance(args, [onnx_path, ref_path], started)
    path = common.write_result(args.model, args.tag, rec)
    print(f"ORT {precision} ({runner.used}) {onnx_path.name}: {summary}; batch-"
          f"{args.latency_batch} p50 {rec['latency']['p50_ms']:.3f} ms -> {path}")
    if args.layerwise:
        try:
            import layerwise
        except ImportError as e:
            raise common.StageError("--layerwise needs layerwise.py beside this script") from e
        ref_onnx = common.require(art / "onnx" / "fp32.onnx", "2_export_onnx.py")
        feed = layerwise.load_feed(None,
                                   args.model if spec.classifier else None,
                                   args.layerwise_images, ref_onnx)
        res = layerwise.run_layer_diff(
            ref_onnx, onnx_path, feed, ep_b=args.ep, precision=precision.lower(),
            opt_level=args.opt_level,
            out_dir=common.model_results(args.model) / f"layerwise_{args.tag}")
        print(layerwise.render_table(res, max_rows=40))
    return rec


if __name__ == "__main__":
    common.cli(get_args_parser, main)
