"""Tools for Q/DQ (QuantizeLinear/DequantizeLinear) ONNX models, used by stages 5 and 5b.

Subcommands
- ``list-depthwise ONNX [--names-only] [--anchored]``: grouped convolutions (``group > 1``;
  in MobileNet/EfficientNet all of them are depthwise). Stage 5 excludes them from INT8 with
  ``--nodes_to_exclude``; ``--anchored`` prints ``^name$`` regexes because ModelOpt matches
  ``--nodes_to_exclude`` with ``re.match`` (a prefix match: ``node_Conv_77`` also hits
  ``node_Conv_775``).
- ``list-stem ONNX [--names-only] [--anchored]``: the first convolution fed by the graph input.
- ``fix-int4-axis IN [-o OUT] [--check]``: find blocked DequantizeLinear nodes whose ``axis``
  disagrees with the layout of their scale (ModelOpt 0.47.0 writes ``axis=0`` for Gemm weights
  with ``transB=1`` whose scale is blocked along axis 1; ORT rejects them at run time) and set
  ``axis`` to the one axis the scale shape fits. Nodes that are consistent are left untouched;
  ``--check`` only reports (exit 1 if anything is wrong).
- ``inspect ONNX [--json PATH]``: Q/DQ counts by consumer op type, per-tensor / per-channel /
  blocked scales, scale dtypes, the smallest scales and how many underflow fp16, bias
  quantization (and the products ``act_scale * weight_scale`` that ORT's
  ``WeightBiasQuantization`` optimiser would form: in fp16 they underflow and predict an ORT-only
  collapse), and which compute nodes stay float.
- ``act-stats ONNX --calib NPZ [--top N] [--batch B] [--json PATH]``: per-tensor activation
  max |x|, p99.9 of |x| and their ratio on the calibration set, worst first (why one per-tensor
  INT8 scale fails), for 4-D tensors the spread of per-channel max, and an FP16 flag (max above
  65504, or most of the mass below FP16's smallest normal). A static batch is respected.
- ``check Q.onnx [--fp32 F.onnx] [--calib C.npz]``: the Q/DQ health check (``deploykit.quant.health``);
  exit 1 on any finding, each naming the node or initializer and the fix; among them the
  placements TensorRT runs differently from ONNX Runtime (``trt_add_float_input``: an Add
  with one quantized and one float input; ``trt_concat_scales``: a Concat of inputs at
  different scales; ``deploykit.quant.placement``).
- ``check-calib F.onnx --calib C.npz [--model M]``: refuse calibration data that does not fit the
  model or the evaluation data; print the calibration batch stage 5 uses.
- ``modelopt [--calib-batch B] [--fp16-output F] [--histogram-cache DIR] [--entropy-histograms]
  -- FLAGS``: ModelOpt's ONNX PTQ with its own flags and a calibration batch of its own
  (:func:`modelopt_quantize`); ``--fp16-output``: also the ``--high_precision_dtype fp16`` file
  of the same calibration; ``--histogram-cache``: calibration histograms shared with earlier runs
  of the same inputs; ``--entropy-histograms``: ORT's entropy histograms even where max
  calibration gives the same file.
- ``modelopt-int4 --onnx F --output O --log L --method M --block B --eps E [--calib NPZ]``:
  stage 5b's ModelOpt INT4 run alone (:func:`deploykit.quant.int4.run_modelopt`; what stage 5's
  worker runs for 5b).
- ``modelopt-worker``: stage 5's ModelOpt worker: the ``modelopt`` and ``modelopt-int4`` commands it reads on stdin
  (one JSON job per line) in one process (:class:`deploykit.quant.modelopt_runner.ModelOptWorker`).
- ``layer-diff A B [args...]``: delegated to ``layerwise.py`` (imported lazily).
- ``record-quant``: write ``results/<model>/quant_<variant>.json`` (used by 5_quantize.sh).

Rerun:  ``python qdq_tools.py inspect artifacts/efficientnet_lite0/onnx/int8.onnx``

"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploykit.tools import layerwise as layerwise_cli
from deploykit.cli import check_positive
from deploykit.commands import script_command
from deploykit.errors import StageError, UsageError
from deploykit.io import atomic_path, write_json
from deploykit.onnx.graph import load_onnx, onnx_opset
from deploykit.quant.bias import check_bias_requant
from deploykit.quant.calibration import check_calib_cli
from deploykit.quant.inspect import activation_stats, inspect_model, print_inspect
from deploykit.quant.int4 import check_blocked_dq, fix_int4_axis
from deploykit.quant.modelopt import modelopt_quantize
from deploykit.quant.nodes import list_depthwise, list_stem, print_nodes
from deploykit.quant.record import print_check, record_quant, run_check


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name in ("list-depthwise", "list-stem"):
        s = sub.add_parser(name, help=f"{name.split('-')[1]} convolutions of a float ONNX model")
        s.add_argument("onnx", type=Path)
        s.add_argument("--names-only", action="store_true", help="one node name per line")
        s.add_argument("--anchored", action="store_true",
                       help="print ^name$ regexes (ModelOpt's --nodes_to_exclude uses re.match)")
        s.add_argument("--expect", type=int, default=None,
                       help="fail (exit 1) unless exactly this many are found")
    s = sub.add_parser("fix-int4-axis", help="repair the axis of blocked DequantizeLinear nodes")
    s.add_argument("onnx", type=Path)
    s.add_argument("-o", "--output", type=Path, default=None,
                   help="output file (default: overwrite the input, atomically)")
    s.add_argument("--check", action="store_true", help="only report; exit 1 if inconsistent")
    s = sub.add_parser("inspect", help="Q/DQ placement, scales, fp16 underflow, float nodes")
    s.add_argument("onnx", type=Path)
    s.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    s = sub.add_parser("act-stats", help="activation max / p99.9 on the calibration set")
    s.add_argument("onnx", type=Path, help="float ONNX model")
    s.add_argument("--calib", type=Path, required=True, help="calibration npz (4_make_calib.py)")
    s.add_argument("--top", type=int, default=20, help="rows to print")
    s.add_argument("--limit", type=int, default=None, help="calibration images to use")
    s.add_argument("--batch", type=int, default=10,
                   help="samples per run (default 10); a model with a static batch is fed "
                        "exactly that many")
    s.add_argument("--json", type=Path, default=None, help="write all rows as JSON")
    s = sub.add_parser("layer-diff", help="layer-wise diff of two ONNX models (layerwise.py)")
    s.add_argument("a", type=Path)
    s.add_argument("b", type=Path)
    s.add_argument("rest", nargs=argparse.REMAINDER, help="passed on to layerwise.py")
    s = sub.add_parser("check", help="Q/DQ health check: scales, ORT bias re-quantization, "
                                     "bias scales, per-tensor/dead channels, INT4 blocks; "
                                     "exit 1 on any finding")
    s.add_argument("onnx", type=Path, help="Q/DQ ONNX model")
    s.add_argument("--fp32", type=Path, default=None,
                   help="the float model it was made from: compare every dequantized weight "
                        "with its float weight")
    s.add_argument("--calib", type=Path, default=None,
                   help="calibration npz: judge ORT's bias re-quantization on these inputs "
                        "instead of from the scales alone")
    s.add_argument("--calib-limit", type=int, default=32, help="calibration samples to run")
    s.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    s = sub.add_parser("check-calib", help="validate calibration data for a model and print "
                                           "the calibration batch (stage 5)")
    s.add_argument("onnx", type=Path, help="float ONNX model to be calibrated")
    s.add_argument("--calib", type=Path, required=True, help="calibration npz")
    s.add_argument("--model", default=None, help="model name: evaluation data for the "
                   "statistics check (eval split, or stage 1's inputs for custom models)")
    s.add_argument("--reference", type=Path, default=None,
                   help="npz of evaluation inputs to compare statistics with (overrides --model)")
    s.add_argument("--calib-batch", dest="batch", default="all",
                   help="calibration batch: 'all' (one batch, order-independent; capped by "
                        "memory) or a number")
    # --batch means samples per run everywhere else; the old spelling keeps working here
    s.add_argument("--batch", dest="batch", help=argparse.SUPPRESS)
    s.add_argument("--no-stats-check", action="store_true",
                   help="skip the comparison with the evaluation data (recorded)")
    s.add_argument("--json", type=Path, default=None, help="write the calibration record here")
    s = sub.add_parser("modelopt", help="ModelOpt ONNX PTQ with its own CLI flags (after --) "
                                        "and a calibration batch of its own (stage 5)")
    s.add_argument("--calib-batch", default="all",
                   help="calibration batch: 'all' (one batch) or a number (check-calib prints "
                        "the one stage 5 uses)")
    s.add_argument("--fp16-output", type=Path, default=None,
                   help="also write the --high_precision_dtype fp16 file of the same "
                        "calibration here (the flags after -- must say --high_precision_dtype "
                        "fp32); the log marks where that conversion starts")
    s.add_argument("--histogram-cache", type=Path, default=None, metavar="DIR",
                   help="keep the calibration statistics (entropy/percentile histograms, or "
                        "the per-tensor ranges of max calibration) in DIR and reuse them when "
                        "an earlier run there had the same graph, calibration data, EP and "
                        "settings (stage 5 passes its work folder)")
    s.add_argument("--entropy-histograms", action="store_true",
                   help="run ORT's entropy histograms even where max calibration gives the "
                        "same file (one calibration batch: see deploykit.quant.modelopt."
                        "entropy_as_max)")
    s.add_argument("modelopt_args", nargs=argparse.REMAINDER,
                   help="-- then the flags of python -m modelopt.onnx.quantization")
    s = sub.add_parser("modelopt-int4", help="stage 5b's ModelOpt INT4 run alone (what stage "
                                             "5's ModelOpt worker runs for 5b)")
    s.add_argument("--onnx", type=Path, required=True, help="float model (ModelOpt gets a copy)")
    s.add_argument("--output", type=Path, required=True)
    s.add_argument("--log", type=Path, required=True, help="ModelOpt's log file")
    s.add_argument("--calib", type=Path, default=None, help="calibration npz (awq_clip)")
    s.add_argument("--method", required=True, help="ModelOpt's --calibration_method")
    s.add_argument("--block", type=int, required=True, help="ModelOpt's --block_size")
    s.add_argument("--eps", required=True, help="ModelOpt's --calibration_eps")
    s.add_argument("--calibration-shapes", default=None)
    sub.add_parser("modelopt-worker", help="stage 5's ModelOpt worker: runs the modelopt and "
                   "modelopt-int4 commands it reads on stdin, one JSON job per line, in one process "
                   "(deploykit.quant.modelopt_runner.ModelOptWorker starts it)")
    s = sub.add_parser("record-quant", help="write results/<model>/quant_<variant>.json "
                                            "(called by 5_quantize.sh)")
    s.add_argument("--model", required=True)
    s.add_argument("--variant", required=True)
    s.add_argument("--onnx", required=True)
    s.add_argument("--source", default=None, help="float model that was quantized")
    s.add_argument("--calib", default=None)
    s.add_argument("--log", type=Path, required=True)
    s.add_argument("--wall-s", type=float, required=True)
    s.add_argument("--status", default="ok", choices=("ok", "failed"))
    s.add_argument("--description", default="")
    s.add_argument("--command", required=True, help="the exact quantization command")
    s.add_argument("--calib-report", type=Path, default=None,
                   help="JSON written by check-calib (calibration samples, batch, order seed)")
    return p


def layer_diff(args: argparse.Namespace):
    """``layerwise.py diff A B rest...`` under its older name."""
    argv = ["diff", str(args.a), str(args.b), *args.rest]
    return layerwise_cli.cli_main(layerwise_cli.get_args_parser().parse_args(argv))


def main(args: argparse.Namespace):
    if not args.cmd:
        raise UsageError("give a subcommand")
    if args.cmd in ("list-depthwise", "list-stem"):
        model = load_onnx(args.onnx, external=False)
        nodes = list_depthwise(model) if args.cmd == "list-depthwise" else list_stem(model)
        print_nodes(nodes, args.names_only, args.anchored)
        if not args.names_only:
            print(f"# {len(nodes)} node(s)", file=sys.stderr)
        if args.expect is not None and len(nodes) != args.expect:
            raise StageError(f"{args.cmd}: found {len(nodes)}, expected {args.expect}")
        return nodes
    if args.cmd == "fix-int4-axis":
        model = load_onnx(args.onnx)
        report = check_blocked_dq(model)
        for r in report:
            print(f"{r['name']}: axis={r['axis']} block={r['block_size']} x {r['x_shape']} "
                  f"scale {r['scale_shape']} fits axes {r['valid_axes']} -> {r['status']}")
        if not report:
            print(f"{args.onnx}: no blocked DequantizeLinear nodes")
        ops = onnx_opset(model)
        if report and ops < 21:
            print(f"{args.onnx}: blocked DequantizeLinear in a model that imports opset {ops}: "
                  "block_size needs opset 21 (DequantizeLinear-21); raise the opset import")
        if args.check:
            if any(r["status"] != "ok" for r in report):
                raise StageError("inconsistent blocked DequantizeLinear axis "
                                 "(run without --check to repair)")
            if report and ops < 21:
                raise StageError(f"opset {ops} does not define block_size")
            return report
        model, fixed = fix_int4_axis(model)
        out = args.output or args.onnx
        if fixed or out != args.onnx:
            import onnx

            with atomic_path(out) as tmp:
                onnx.save(model, str(tmp))
        print(f"repaired {len(fixed)} node(s) -> {out}")
        return fixed
    if args.cmd == "inspect":

        model = load_onnx(args.onnx)
        rep = inspect_model(model)
        rep.pop("_helper", None)
        findings, _ = check_bias_requant(model)
        rep["bias_requant_changes"] = [f.node for f in findings]
        print_inspect(rep, args.onnx)
        # the static part of the health check (no calibration data): its findings, the first
        # of each kind, so that reading the placement never hides a broken file
        chk = run_check(args.onnx, model=model)
        rep["check"] = {"n_findings": chk["n_findings"], "kinds": chk["kinds"],
                        "command": script_command("qdq_tools.py", ["check", str(args.onnx)])}
        print_check(chk, limit=1, more="the command below lists them")
        if chk["n_findings"]:
            print(f"  every finding: {rep['check']['command']} (add --calib C.npz to judge the "
                  "bias re-quantization on calibration data, --fp32 F.onnx to compare the "
                  "weights with the float file)")
        if args.json:
            write_json(args.json, rep)
        return rep
    if args.cmd == "act-stats":
        check_positive(args, "top", "limit", "batch")
        rows = activation_stats(args.onnx, args.calib, batch=args.batch, limit=args.limit)
        flagged = [r for r in rows if r["fp16"]]
        print(f"{'ratio':>7} {'max':>9} {'p99.9':>9} {'ch.spread':>9} {'fp16':>9}  tensor "
              "(producer -> consumers)")
        for r in rows[:args.top] + [r for r in flagged if r not in rows[:args.top]]:
            sp = f"{r['channel_spread']:.1f}" if r["channel_spread"] is not None else "-"
            print(f"{r['ratio']:7.2f} {r['max']:9.3f} {r['p99.9']:9.3f} {sp:>9} "
                  f"{(r['fp16'] or '-').upper() if r['fp16'] else '-':>9}  {r['tensor']} "
                  f"({r['producer']} -> {','.join(r['consumers'])})")
        if flagged:
            print(f"{len(flagged)} tensor(s) outside what FP16 holds (max 65504, normal >= "
                  f"6.1e-05): {', '.join(r['tensor'] for r in flagged[:8])}; keep their "
                  "producers/consumers in FP32 (python export_checks.py fp16-audit names them, "
                  "2_export_onnx.py --fp16-keep-fp32 keeps them)")
        if args.json:
            write_json(args.json, rows)
        return rows
    if args.cmd == "layer-diff":
        return layer_diff(args)
    if args.cmd == "check":
        rep = run_check(args.onnx, args.fp32, args.calib, args.calib_limit)
        print_check(rep)
        if args.json:
            write_json(args.json, rep)
        if not rep["ok"]:
            raise StageError(f"{rep['n_findings']} finding(s) in {args.onnx} (above)")
        return rep
    if args.cmd == "check-calib":
        return check_calib_cli(args)
    if args.cmd == "modelopt":
        argv = args.modelopt_args[1:] if args.modelopt_args[:1] == ["--"] else args.modelopt_args
        return modelopt_quantize(argv, args.calib_batch, args.fp16_output, args.histogram_cache,
                                 args.entropy_histograms)
    if args.cmd == "modelopt-int4":
        from deploykit.quant.int4 import int4_worker_job

        return int4_worker_job(args)
    if args.cmd == "modelopt-worker":
        from deploykit.quant.modelopt_runner import serve
        from deploykit.zygote import fast_exit

        # without the teardown of ModelOpt's, torch's and onnxruntime's modules (0.7 s and
        # more at the stage's end, measured): the stage waits for this exit
        fast_exit(serve((get_args_parser, main)))
    if args.cmd == "record-quant":
        return record_quant(args)
    raise UsageError(f"unknown command {args.cmd}")
