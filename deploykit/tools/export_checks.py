"""Export checks: is an ONNX file a faithful, deployable copy of the model, in FP32 and FP16?

One function per check, one result shape. Stage 2 (``2_export_onnx.py``) runs them on every
file it writes and refuses a file that fails one; the command line runs them on any file:

    python export_checks.py lint F.onnx [--example-batch N] [--json OUT]      # any ONNX file
    python export_checks.py check --model M --onnx F [--inputs X.npz | --input-shape ...]
    python export_checks.py fp16-audit FP32.onnx [--fp16 F16.onnx] [--inputs X.npz | --model M]
    python export_checks.py fp16 FP32.onnx -o FP16.onnx [--keep-fp32 NODE ...] [--inputs ...]

``lint`` exits 1 on any warning or error; ``check`` and ``fp16-audit`` exit 1 on a failed check;
``fp16`` writes the FP16 file only when it passes (else ``<name>.rejected.onnx`` + reason).

Every check returns a list of results of this shape::

    {"check": name, "status": "pass" | "warn" | "fail" | "skip", "detail": one sentence,
     "node": ONNX node name or None, "fix": what to change or None, ...check-specific fields}

Checks
- lint (graph only): ``softmax_axis`` (Softmax/LogSoftmax/Hardmax below opset 13 flatten the
  input to 2-D), ``hardsigmoid`` (alpha/beta against PyTorch's 1/6 and 0.5), ``squeeze_axes``
  (Squeeze without axes on a dynamic axis), ``shape_constants`` (Reshape/Expand/Tile shape
  constants that hold a batch size), ``blocked_qdq_opset`` (blocked Q/DQ below opset 21),
  ``fp16_initializers`` (constants outside the FP16 range in an FP16 file).
- export: ``dynamic_axes`` (every declared dynamic axis symbolic), ``exporter_warnings`` (a
  TracerWarning, i.e. a value frozen at trace time, is an error), ``data_dependent_ops``
  (NonZero & co.: accepted when parity holds, flagged for TensorRT).
- against PyTorch: ``batch_parity`` (each batch size, output ranks), ``input_paths`` (a second
  input that takes other data-dependent paths), ``unused_inputs``.
- FP16: ``fp16_range`` (every FP16 tensor's range on real inputs: overflow above 65504, mass
  below the smallest normal 6.1e-5, long reductions), ``fp16_constants`` (constants the
  converter changed), ``fp16_true_arithmetic`` (``onnx.reference`` computes in the graph's
  dtypes, unlike ORT's CPU EP), ``fp16_backends`` (CUDA EP / TensorRT when present).

FP16 limits: IEEE 754 binary16, largest finite 65504, smallest normal 2^-14 = 6.10e-05, smallest
subnormal 2^-24 = 5.96e-08 (``numpy.finfo(numpy.float16)``).

"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.compare import OUTPUT_MIN_COSINE
from deploykit.checks.base import check_result, format_result, output_problems, worst
from deploykit.checks.export import check_export, keep_list, random_feed
from deploykit.checks.fp16 import convert_fp16, fp16_checks, fp16_range_audit
from deploykit.checks.lint import lint
from deploykit.cli import HelpFormatter, add_shared_args, check_positive, stage_parser
from deploykit.errors import StageError, UsageError
from deploykit.feeds import feed_plan, load_feed
from deploykit.install import install, install_rejected, rejected_path
from deploykit.io import write_json
from deploykit.models import build_model, model_spec
from deploykit.onnx.activations import collect_outputs, ort_activations
from deploykit.onnx.graph import graph_inputs, load_onnx, static_batch


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _print_results(results: Sequence[dict], show_pass: bool = True) -> None:
    for r in results:
        if show_pass or r["status"] in ("fail", "warn"):
            print(format_result(r))


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__, prog="export_checks.py")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add_inputs(sp, n_default: int):
        sp.add_argument("--inputs", type=Path, help=".npz of inputs keyed by input name (real "
                        "data: the user's samples)")
        sp.add_argument("--model", help="the PyTorch model (mobilenet_v3_small, "
                        "efficientnet_lite0, a torchvision name or package.module:factory); its "
                        "eval images feed image classifiers")
        sp.add_argument("--n", type=int, default=n_default, help="samples")
        add_shared_args(sp, "input_shape")

    s = sub.add_parser("lint", help="graph-only checks of any ONNX file (exit 1 on a warning "
                       "or error)", formatter_class=HelpFormatter)
    s.add_argument("onnx", type=Path, help="ONNX file")
    s.add_argument("--example-batch", type=int, default=None,
                   help="batch the file was exported with, if known (flags shape constants "
                        "holding it)")
    s.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    s.add_argument("--all", action="store_true", help="also print passing and skipped checks")
    s.add_argument("--target-opset", type=int, action="append", default=[],
                   help="an opset the file will be converted to (repeatable; e.g. 19: "
                        "ModelOpt's quantized file, 17: the TensorRT 8.x copy): flag nodes "
                        "whose operator changes meaning between the two")

    s = sub.add_parser("check", help="export checks against the PyTorch model (batch sizes, "
                       "frozen values, data-dependent paths, lint)",
                       formatter_class=HelpFormatter)
    s.add_argument("--onnx", type=Path, required=True, help="exported ONNX file")
    s.add_argument("--weights", type=Path, default=None, help="state dict for --model")
    s.add_argument("--batches", default=None,
                   help="batch sizes to compare, e.g. 1,3 (default: 1 and --n; a static batch "
                        "is used as it is)")
    s.add_argument("--min-cosine", type=float, default=OUTPUT_MIN_COSINE["fp32"],
                   help="lowest cosine similarity per sample against PyTorch")
    s.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    add_inputs(s, 4)

    s = sub.add_parser("fp16-audit", help="FP16 range audit of every tensor on real inputs "
                       "(overflow above 65504, mass below 6.1e-5)",
                       formatter_class=HelpFormatter)
    s.add_argument("onnx", type=Path, help="FP32 ONNX file (the activations come from it)")
    s.add_argument("--fp16", type=Path, default=None,
                   help="the FP16 file made from it: only tensors it holds in FP16 are judged")
    s.add_argument("--batch", type=int, default=8, help="samples per run (a static batch wins)")
    s.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    add_inputs(s, 32)

    s = sub.add_parser("fp16", help="convert an FP32 file to FP16 (FP32 I/O), keep named nodes "
                       "in FP32, check it; the file stage 6 builds as variant fp16",
                       formatter_class=HelpFormatter)
    s.add_argument("onnx", type=Path, help="FP32 ONNX file")
    s.add_argument("-o", "--output", type=Path, required=True,
                   help="FP16 file to write (artifacts/<model>/onnx/fp16.onnx for the pipeline)")
    s.add_argument("--keep-fp32", action="append", default=None, metavar="NODE[,NODE]",
                   help="nodes to compute in FP32 (repeatable, comma-separated)")
    s.add_argument("--min-cosine", type=float, default=OUTPUT_MIN_COSINE["fp16"],
                   help="lowest cosine similarity per sample against the FP32 file")
    s.add_argument("--batch", type=int, default=8, help="samples per run (a static batch wins)")
    add_inputs(s, 16)
    return p


def _feed(args, onnx_path: Path) -> tuple[dict[str, np.ndarray], bool]:
    """``(feed, real)`` from --inputs / --model / --input-shape (``real``: not synthetic)."""

    spec = model_spec(args.model) if args.model else None
    use_images = bool(args.model and spec.classifier and not args.inputs and not args.input_shape)
    feed = load_feed(args.inputs, args.model if use_images else None, args.n,
                     onnx_path, args.input_shape)
    return feed, bool(args.inputs or use_images)


def split_names(items: Sequence[str]) -> list[str]:
    return [x.strip() for it in items or [] for x in it.split(",") if x.strip()]


def cmd_fp16(args) -> list[dict]:
    """``export_checks.py fp16``: convert, check, install only when every check passes."""
    import onnx


    keep = split_names(args.keep_fp32)
    m32 = load_onnx(args.onnx)
    feed, real = _feed(args, args.onnx)
    names = {n for n, _, _ in graph_inputs(m32)}
    # A static batch is fed exactly (samples that do not fill a run are left out, said on
    # stderr); a dynamic one takes --batch samples per run.
    feed, per_run = feed_plan({k: v for k, v in feed.items() if k in names}, [m32],
                              args.batch)
    ref = collect_outputs(ort_activations(args.onnx, feed, batch=per_run,
                                          mark_all=False))
    m16, warn = convert_fp16(m32, keep)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".fp16-") as tmp:
        cand = Path(tmp) / out_path.name
        onnx.save(m16, str(cand))
        onnx.checker.check_model(str(cand))
        res = fp16_checks(m32, cand, feed, ref, args.min_cosine, converter_warnings=warn,
                          real_inputs=real, keep_fp32=keep, batch=per_run or args.batch)
        par = output_problems(ref, collect_outputs(ort_activations(
            cand, feed, batch=per_run, mark_all=False)), args.min_cosine)
        res.append(check_result("fp16_ort_cpu_parity", "fail" if par else "pass",
                                "; ".join(par) or f"matches the FP32 file on ORT CPU (cosine >= "
                                f"{args.min_cosine}; computed in FP32 there)"))
        _print_results(res, show_pass=False)
        if worst(res) == "fail":
            install_rejected(cand, out_path, res)
            more = keep_list(res, keep)
            hint = (f"; rerun with --keep-fp32 {','.join(more)}" if more != keep else "")
            raise StageError(f"{out_path.name} failed its FP16 checks: kept as "
                             f"{rejected_path(out_path)}{hint}")
        install(cand, out_path)
    print(f"wrote {out_path} (FP16, FP32 inputs/outputs, {len(keep)} node(s) kept in FP32)")
    return res


def main(args) -> list[dict]:
    if args.cmd == "lint":
        res = lint(args.onnx, example_batch=args.example_batch,
                   targets=tuple(args.target_opset))
        _print_results(res, show_pass=args.all)
        if args.json:
            write_json(args.json, {"onnx": str(args.onnx), "results": res})
        bad = [r for r in res if r["status"] in ("fail", "warn")]
        print(f"{args.onnx}: {sum(r['status'] == 'fail' for r in bad)} error(s), "
              f"{sum(r['status'] == 'warn' for r in bad)} warning(s)")
        if bad:
            raise StageError(f"lint found {len(bad)} problem(s) in {args.onnx}")
        return res
    if args.cmd == "fp16":
        check_positive(args, "n", "batch")
        return cmd_fp16(args)
    if args.cmd == "fp16-audit":
        check_positive(args, "n", "batch")
        feed, real = _feed(args, args.onnx)
        res = fp16_range_audit(args.onnx, feed, args.fp16, batch=args.batch, real_inputs=real)
        _print_results(res)
        if args.json:
            write_json(args.json, {"onnx": str(args.onnx), "results": res})
        if worst(res) == "fail":
            raise StageError("tensors outside the FP16 range: keep the named nodes in FP32")
        return res
    # check
    if not args.model:
        raise UsageError("check needs --model NAME (the PyTorch model that was exported)")
    check_positive(args, "n")
    if not 0 < args.min_cosine <= 1:
        raise UsageError(f"--min-cosine {args.min_cosine}: must be in (0, 1]")
    batches = None
    if args.batches:
        try:
            batches = [int(b) for b in args.batches.split(",")]
        except ValueError as e:
            raise UsageError(f"--batches {args.batches!r}: {e}") from e
        if any(b < 1 for b in batches):
            raise UsageError(f"--batches {args.batches!r}: sizes must be >= 1")
    model, spec = build_model(args.model, args.weights)
    feed, _ = _feed(args, args.onnx)
    if len(next(iter(feed.values()))) < 2 and static_batch(
            load_onnx(args.onnx)) is None:
        feed = {k: np.concatenate([v, random_feed({k: v}, 1, 7)[k]]) for k, v in feed.items()}
    res = check_export(model, args.onnx, feed, min_cosine=args.min_cosine, batches=batches)
    _print_results(res)
    if args.json:
        write_json(args.json, {"onnx": str(args.onnx), "status": worst(res),
                               "results": res})
    if worst(res) == "fail":
        raise StageError("export check failed: fix the export before comparing runtimes")
    return res
