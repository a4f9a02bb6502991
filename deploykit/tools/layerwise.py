"""Layer-wise parity: which layer of a deployed model first disagrees with the reference?

Four tools, one module (library + CLI):

- ``diff``: run two versions of an ONNX graph with every intermediate tensor exposed as an output
  (Polygraphy's "mark all", :class:`polygraphy.backend.onnx.ModifyOutputs` with
  ``constants.MARK_ALL``), match tensors by name across the graphs (Q/DQ and Cast nodes looked
  through), compare them in the reference graph's topological order (cosine similarity, max abs
  and relative error, tolerances that depend on the precision) and name the first divergent
  layer, together with whether its inputs still agreed ("this layer is wrong") or not ("the
  error arrived from upstream"). Side A is the reference (ORT CPU FP32); side B is ORT on any EP,
  the FP16 ONNX, a Q/DQ ONNX or a TensorRT engine.
- ``quant-backend``: for a Q/DQ model, per layer, the quantization error (float graph vs Q/DQ
  graph, both with ORT optimisations off) beside the backend error (the same Q/DQ graph,
  optimised vs not), in cosine and in quantization steps (:func:`quant_backend_table`).
- ``torch-vs-onnx``: PyTorch module outputs (forward hooks) against the ONNX tensors of the same
  module path, to catch export bugs before any runtime is blamed.
- ``export-check``: the silent export bugs (batch-dependent outputs, batch frozen into the
  graph, data-dependent paths, HardSigmoid attributes); a thin front end of
  ``python export_checks.py check``, where the checks live.

Reads: ONNX files (and optionally a TensorRT plan), an ``.npz`` of inputs or ``--model M --n N``
eval images (``artifacts/splits.json`` via :func:`deploykit.data.splits.load_split`).
Writes (``--out-dir``): ``layerwise.json``, ``layerwise.md`` (table), ``layerwise.png`` (cosine
along the graph), all atomically.

Rerun alone, e.g.::

    python layerwise.py diff artifacts/M/onnx/fp32.onnx artifacts/M/onnx/int8.onnx \
        --model M --n 8 --out-dir results/M/layerwise_int8

Exit status of ``diff``, like diff(1): 0 when no layer diverges (also when TensorRT is
skipped), 1 when a divergent layer is found (the table and verdict are printed and written
first; ``--exit-zero`` makes it 0) or on a runtime failure (``FAILED:`` line), 2 usage error.
A final output missing from one side and NaN/Inf outputs (the first non-finite layer is named)
are failures: a ``FAILED:`` line and exit 1. ``--exit-zero`` makes every finished diff exit 0
(for walk-throughs and scripts that read ``layerwise.json``); the lines are printed all the same.
The other subcommands: 0 ok, 1 runtime failure, 2 usage error.

"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploykit.tools import export_checks as export_checks_cli
from deploykit.compare import OUTPUT_MIN_COSINE, TOLERANCES
from deploykit.errors import StageError, UsageError
from deploykit.feeds import feed_plan, input_shape_batch, load_feed, match_inputs
from deploykit.layerwise.diff import run_layer_diff
from deploykit.layerwise.quant_backend import quant_backend_table, render_quant_backend
from deploykit.layerwise.report import failing_final_outputs, render_table
from deploykit.layerwise.torch_vs_onnx import torch_vs_onnx
from deploykit.models import build_model, example_inputs
from deploykit.onnx.graph import load_onnx
from deploykit.runners import ORT_EPS


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="layerwise.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_inputs(sp):
        sp.add_argument("--inputs", type=Path, help=".npz of inputs (keys = input names)")
        sp.add_argument("--model", help="take --n eval images of this model (splits.json)")
        sp.add_argument("--n", type=int, default=8, help="samples (default 8)")
        sp.add_argument("--input-shape", action="append", help="name:d0,d1,...[:dtype] for "
                        "random inputs (non-image models)")
        sp.add_argument("--out-dir", type=Path, help="write JSON/Markdown/PNG here")

    d = sub.add_parser("diff", help="layer-wise comparison of two ONNX runs (or TensorRT)",
                       epilog="exit status, like diff(1): 0 no divergent layer (or TensorRT "
                              "skipped), 1 a divergent layer was found (after the table; "
                              "--exit-zero: 0), a final output missing from one side or "
                              "NaN/Inf outputs (FAILED: line; --exit-zero: 0) or a "
                              "runtime failure, 2 usage error")
    d.add_argument("a", type=Path, help="reference ONNX (FP32, ORT)")
    d.add_argument("b", type=Path, help="candidate ONNX (FP16, Q/DQ, same file on another EP, "
                   "or the ONNX of --engine-b)")
    d.add_argument("--ep-a", default="cpu", choices=sorted(set(ORT_EPS)))
    d.add_argument("--ep-b", default="cpu", choices=sorted(set(ORT_EPS)))
    d.add_argument("--engine-b", type=Path, help="TensorRT plan built from B: compare through "
                   "TensorRT (skipped cleanly without tensorrt)")
    d.add_argument("--trt", action="store_true", help="side B through TensorRT (marked build)")
    d.add_argument("--trt-fp16", action="store_true", help="build flag for the marked engine")
    d.add_argument("--trt-int8", action="store_true", help="build flag for the marked engine")
    d.add_argument("--precision", choices=sorted(TOLERANCES), help="tolerance class (default: "
                   "detected from B)")
    d.add_argument("--atol", type=float)
    d.add_argument("--rtol", type=float)
    d.add_argument("--min-cosine", type=float)
    d.add_argument("--batch", type=int, default=None,
                   help="samples per run (memory; default 8, or the batch of --input-shape; "
                        "0 = all); a model with a static batch is fed exactly that many")
    d.add_argument("--opt-level", default="all", choices=["disable", "basic", "extended", "all"])
    d.add_argument("--max-rows", type=int, default=60, help="rows printed (all are in the JSON)")
    d.add_argument("--fail-on-divergence", action="store_true",
                   help="kept for old scripts: a divergence exits 1 by default")
    d.add_argument("--exit-zero", action="store_true",
                   help="exit 0 whatever a finished diff found (default: exit 1 on a "
                        "divergent layer or a FAILED: line, like diff(1))")
    d.add_argument("--map-input", action="append", metavar="B_NAME=A_NAME",
                   help="B's input B_NAME takes A's input A_NAME (files whose input names "
                        "differ; repeatable)")
    d.add_argument("--map-output", action="append", metavar="B_NAME=A_NAME",
                   help="B's output B_NAME is compared with A's output A_NAME (files whose "
                        "output names differ; repeatable)")
    add_inputs(d)

    qb = sub.add_parser("quant-backend", help="per layer: quantization error (float vs Q/DQ "
                        "graph, both unoptimised) beside backend error (Q/DQ graph optimised vs "
                        "not)")
    qb.add_argument("a", type=Path, help="float ONNX the Q/DQ model was made from")
    qb.add_argument("b", type=Path, help="Q/DQ ONNX")
    qb.add_argument("--ep", default="cpu", choices=sorted(set(ORT_EPS)),
                    help="EP of the backend run (default cpu)")
    qb.add_argument("--opt-level", default="all", choices=["basic", "extended", "all"],
                    help="ORT optimisation level of the backend run (default all)")
    qb.add_argument("--disable-optimizer", action="append", default=[],
                    help="ORT optimizer to disable in the backend run (repeatable)")
    qb.add_argument("--batch", type=int, default=8, help="samples per run (memory); 0 = all")
    qb.add_argument("--max-rows", type=int, default=60, help="rows printed (all are in the JSON)")
    add_inputs(qb)

    t = sub.add_parser("torch-vs-onnx", help="PyTorch modules vs the exported ONNX nodes")
    t.add_argument("--onnx", type=Path, required=True)
    t.add_argument("--weights", type=Path, help="state dict (default: the model's weights)")
    t.add_argument("--random-init", action="store_true",
                   help="the seeded random weights of stage 1/2's --random-init")
    add_inputs(t)
    t.set_defaults(n=2)

    e = sub.add_parser("export-check", help="export checks of an exported ONNX against its "
                       "PyTorch model (same as: python export_checks.py check)")
    e.add_argument("--onnx", type=Path, required=True)
    e.add_argument("--weights", type=Path)
    e.add_argument("--batches", default=None, help="batch sizes to compare (default: 1 and "
                   "--n; a static batch is used as it is)")
    e.add_argument("--min-cosine", type=float, default=OUTPUT_MIN_COSINE["fp32"],
                   help="lowest cosine similarity per sample against PyTorch (default "
                        f"{OUTPUT_MIN_COSINE['fp32']})")
    add_inputs(e)
    e.set_defaults(n=4)
    return p


def exit_status(args, res) -> int:
    """The exit status of a finished command: 1 for a ``diff`` with a ``failure`` (a final
    output missing from one side, NaN/Inf outputs), a divergent layer or a final output out of
    tolerance; 0 otherwise, and always 0 with ``--exit-zero`` (the lines are printed all the
    same)."""
    if getattr(args, "cmd", None) != "diff" or not isinstance(res, dict):
        return 0
    if getattr(args, "exit_zero", False):
        return 0
    return 1 if (res.get("failure") or res.get("first_divergent")
                 or failing_final_outputs(res)) else 0


def parse_output_map(pairs: list[str] | None) -> dict[str, str]:
    """``--map-output B_NAME=A_NAME`` values as ``{B name: A name}``.

    Raises:
        UsageError: a value without ``=`` or with an empty side.
    """
    out = {}
    for p in pairs or []:
        b, sep, a = p.partition("=")
        if not sep or not a or not b:
            raise UsageError(f"--map-output {p!r}: give B_NAME=A_NAME (B's output name, then "
                             "A's, e.g. --map-output logits=output)")
        out[b] = a
    return out


def cli_main(args) -> dict:
    """:func:`main`, then exit with :func:`exit_status` (the command ``layerwise.py`` runs)."""
    res = main(args)
    code = exit_status(args, res)
    if code:
        raise SystemExit(code)
    return res


def main(args) -> dict:
    if args.cmd == "diff":
        if args.inputs and args.model:
            raise UsageError("give --inputs or --model, not both")
        feed = load_feed(args.inputs, args.model, args.n, args.a, args.input_shape)
        feed = match_inputs(args.a, args.b, feed, args.map_input)
        batch = args.batch if args.batch is not None else (input_shape_batch(args.input_shape)
                                                           or 8)
        feed, batch = feed_plan(feed, [args.a, args.b], batch or None)
        res = run_layer_diff(
            args.a, args.b, feed, ep_a=args.ep_a, ep_b=args.ep_b, b_engine=args.engine_b,
            b_trt=args.trt, trt_build={
                "fp16": args.trt_fp16 or None, "int8": args.trt_int8 or None},
            tolerances={"atol": args.atol, "rtol": args.rtol, "min_cosine": args.min_cosine},
            precision=args.precision, batch=batch, opt_level=args.opt_level,
            out_dir=args.out_dir, output_map=parse_output_map(args.map_output))
        print(render_table(res, max_rows=args.max_rows))
        if res.get("status") == "skipped":
            print(f"SKIPPED: {res['reason']}", file=sys.stderr)
        if args.out_dir:
            print(f"wrote {', '.join(res.get('files', {}).values())}")
        if res.get("first_divergent"):
            print(f"DIVERGENT: {res.get('verdict')}", file=sys.stderr)
        elif failing_final_outputs(res) and not res.get("failure"):
            print(f"DIVERGENT: final output {', '.join(failing_final_outputs(res))} out of "
                  "tolerance in the unmarked run although no marked layer diverges (a fused "
                  "kernel); rerun with --opt-level disable to confirm", file=sys.stderr)
        if res.get("failure"):
            print(f"FAILED: {res['failure']}", file=sys.stderr)
        return res
    if args.cmd == "export-check":  # the checks live in export_checks.py

        if args.out_dir:
            args.json = args.out_dir / "export_check.json"
        else:
            args.json = None
        args.cmd = "check"
        return export_checks_cli.main(args)
    if args.cmd == "quant-backend":
        if args.inputs and args.model:
            raise UsageError("give --inputs or --model, not both")
        feed = load_feed(args.inputs, args.model, args.n, args.a, args.input_shape)
        res = quant_backend_table(args.a, args.b, feed, ep=args.ep, opt_level=args.opt_level,
                                  disabled_optimizers=args.disable_optimizer,
                                  batch=args.batch or None, out_dir=args.out_dir)
        print(render_quant_backend(res, max_rows=args.max_rows))
        return res
    if not args.model:
        raise UsageError(f"{args.cmd} needs --model NAME (the PyTorch model that was exported)")
    model, spec = build_model(args.model, args.weights,
                              pretrained=not getattr(args, "random_init", False))
    if args.inputs or args.input_shape or not spec.classifier:
        feed = load_feed(args.inputs, None, args.n, args.onnx, args.input_shape)
    else:
        feed = {load_onnx(args.onnx).graph.input[0].name: example_inputs(
            spec, None, batch=args.n)["input"]}
    res = torch_vs_onnx(model, args.onnx, feed, out_dir=args.out_dir)
    for r in res["modules"]:
        print(f"{r['index']:4d} {r['module']:40s} {r['node']:40s} "
              f"cos {r.get('cosine_min', float('nan')):.6f} {r['status']}")
    fd = res["first_divergent"]
    if fd and fd.get("inputs_agree") is False:
        print(f"first divergent module: {fd['module']} ({fd['node']}), but its input "
              f"{fd['input_tensor']} (from node {fd['input_node']}) already differs: the error "
              "is upstream, in code between modules")
    else:
        print(f"first divergent module: {fd['module']} ({fd['node']})" if fd else
              "every mapped module matches its ONNX tensor")
    return res
