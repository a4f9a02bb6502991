#!/usr/bin/env python3
"""Stage 5: INT8 (and the broken INT4 CLI reproduction) with ModelOpt's ONNX PTQ (its CLI flags,
run through qdq_tools.py modelopt for the calibration batch), any number of variants per
command in one process: int8 and int8_hp32 come from one calibration, ModelOpt's entropy
calibration of one batch is computed as max calibration (the same file:
deploykit.quant.modelopt.entropy_as_max), and a later variant takes the calibration statistics an
earlier run of the command already made for its tensors (same files as one ModelOpt CLI run per
variant).

Reads:  artifacts/<model>/onnx/fp32.onnx (2_export_onnx.py), artifacts/<model>/calib.npz
        (4_make_calib.py).
Writes: artifacts/<model>/onnx/<variant>.onnx, artifacts/<model>/onnx/<variant>.quant.log,
        results/<model>/quant_<variant>.json (wall time, exact command, ModelOpt warnings,
        calibration samples/batch/order seed and the SHA-256 of the calibration bytes used,
        `qdq_tools.py inspect` summary and the `qdq_tools.py check` findings of the file).
Rerun:  MODEL=efficientnet_lite0 ./5_quantize.sh int8   (5_quantize.sh runs this file)

The whole stage in one command (what run_all.sh runs): every ModelOpt run of the stage goes to
one ModelOpt child process, which imports ModelOpt once while this process reads the calibration
data (deploykit.quant.modelopt_runner.ModelOptWorker). ``int4`` among the variants runs
5b_quantize_int4.py: beside the ModelOpt variants, in a process of its own (it needs only
fp32.onnx and calib.npz, and nothing in this phase is timed; its output is printed after
theirs; deploykit.quant.beside), where the machine has two CPUs and 12 GiB available, else in
this process after them, its ModelOpt run in the stage's ModelOpt process. ``--eval`` then gives
each file, once every file is made, its results row, 3_onnx_eval.py --onnx <file> --tag ort_<variant> run in this process (the row
records that command; ``--eval-args`` adds flags to every row; failure reproductions such as
int4_cli_broken are left out), and the stage ends with one summary line per row.

int8_auto (mixed precision for an accuracy budget; needs a tuning split: 0_prepare_data.py
--tune-fraction F or run_all.sh --auto-precision): auto_precision.py search quantizes every
candidate once, measures each node on the tuning split and chooses the nodes to keep in float;
ModelOpt then re-quantizes with them as --nodes_to_exclude, and auto_precision.py verify
measures the file (tuning and evaluation splits) before it is installed. Budget and search
flags: AUTO_ARGS="--min-agreement 99 --min-cosine 0.998" (auto_precision.py search --help).
Writes also results/<model>/auto_precision.{json,md,png}.

Env:    MODEL (default mobilenet_v3_small; package.module:factory works too), EPS (calibration
        EP: cpu, cuda:0, trt; default cuda:0 when onnxruntime has the CUDA EP, else cpu),
        CALIB_BATCH (calibration batch: all (default: one batch, see
        deploykit.quant.calibration.calibration_plan for why) or a number), CALIB_STATS_CHECK (1; 0 skips the comparison
        of the calibration data with the evaluation data, recorded), PYTHON (5_quantize.sh
        only: the interpreter, default python), AUTO_ARGS (int8_auto only: extra flags of
        auto_precision.py search, e.g. the budget).

One process: the output folders are checked writable first; the calibration npz is read once
(its SHA-256 is that of the bytes read), validated against the model (input names, shapes,
dtypes, NaN/Inf, statistics vs the evaluation data) and its batch planned once, before any
quantizer runs; ModelOpt gets a private copy of those bytes and of fp32.onnx (it rewrites its
--onnx_path) and runs in the stage's ModelOpt child process (deploykit.quant.modelopt_runner:
ModelOpt patches ONNX Runtime's calibrators; a run that kills that process fails as any failed
run does, and a later run starts a fresh one); every file is then health-checked (findings recorded, printed,
not fatal). The work folder sits beside the outputs (the final rename is atomic) and is
removed on any exit; a file is installed only when its run succeeded, so a failure leaves an
earlier good <variant>.onnx as it was.

The depthwise list comes from the graph (deploykit.quant.nodes.list_depthwise, as ^name$ regexes, because
ModelOpt matches --nodes_to_exclude with re.match, a prefix match).

Exit status: 0; 1 on a runtime failure (a missing input, refused calibration data, ModelOpt
failed, a variant that does not apply to the model, e.g. excl_stem without a stem conv: the
other variants are still made); 2 on a usage error; int8_auto: the search's own exit status
when it fails (2 for a bad AUTO_ARGS).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from deploykit.cli import HelpFormatter, add_shared_args, cli, load_script, run_script
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import summary_line
from deploykit.io import check_writable, load_json, remove_leftovers, report_leftovers
from deploykit.lock import lock_folders
from deploykit import layout
from deploykit.quant import modelopt_runner
from deploykit.quant.beside import ScriptBeside, beside_ok
from deploykit.layout import calib_path, fp32_onnx_path, model_artifacts, model_results
from deploykit.checks.lint import lint_opset_conversion
from deploykit.onnx.graph import load_onnx, onnx_opset
from deploykit.quant.modelopt import MODELOPT_MIN_OPSET
from deploykit.quant.auto.search import anchored
from deploykit.quant.nodes import list_depthwise, list_stem
from deploykit.variants import for_stage, get_variant
from deploykit.quant.modelopt_log import calibration_ep
from deploykit.quant.quantize import quantize_all, default_eps, env_settings

#: The INT4 variant: made by 5b_quantize_int4.py (ModelOpt's Python API), run inside this
#: stage's process when the variant is named.
INT4 = "int4"


# --------------------------------------------------------------------------------------------
# Variants (the registry, variants.py)
# --------------------------------------------------------------------------------------------
def cli_variants(include_all: bool = False, auto_precision_: bool = False) -> list[str]:
    """Stage-5 variants made by the ModelOpt CLI, in pipeline order (int4 comes from
    5b_quantize_int4.py).

    Args:
        include_all: also the ablations and failure reproductions (``--all-variants``).
        auto_precision_: also the variants made on request only (``int8_auto``).
    Returns:
        the variant names.
    """
    return [v.name for v in for_stage(5, include_all, auto_precision_)
            if v.name != "int4"]


def variants_help() -> str:
    """The variant list shown by ``--help`` and after a usage error."""
    lines = ["variants (ModelOpt CLI; int4 is made by 5b_quantize_int4.py, run in this process "
             "when named here):"]
    lines += [f"  {v:<16} {get_variant(v).description}"
              for v in cli_variants(True, True) + [INT4]]
    on_request = [v for v in cli_variants(True, True) if v not in cli_variants(True)]
    lines.append(f"--default = {' '.join(cli_variants())}")
    lines.append("--all-variants = all of the above except those made on request only: "
                 + " ".join(on_request))
    lines.append('int8_auto needs a tuning split (0_prepare_data.py --tune-fraction F); its '
                 'budget and search flags go in AUTO_ARGS, e.g. AUTO_ARGS="--min-agreement 99 '
                 '--min-cosine 0.998" (python auto_precision.py search --help)')
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
class _Select(argparse.Action):
    """Appends variant names to ``args.selected`` in command-line order (``--default``,
    ``--all-variants`` and the positional names share it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.const is not None:  # --default / --all-variants
            names = list(self.const)
        else:
            names = list(values or [])
            known = cli_variants(True, True) + [INT4]
            for n in names:
                if n not in known:
                    parser.error(f"unknown variant {n}")
        setattr(namespace, "selected", list(getattr(namespace, "selected", None) or []) + names)


class _List(argparse.Action):
    """``--list``: every stage-5 variant name, one per line, then exit 0."""

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(cli_variants(True, True)))
        parser.exit(0)


class Stage5Parser(argparse.ArgumentParser):
    """The stage's parser: ``--help`` goes to stderr (as 5_quantize.sh always printed it), a
    usage error also lists the variants, and variant names may come on both sides of a flag
    (``int8 --default excl_dw``)."""

    def print_help(self, file=None):
        """Print the help to ``file`` (default: stderr)."""
        super().print_help(file or sys.stderr)

    def format_usage(self) -> str:
        """The usage line followed by the variant list."""
        return super().format_usage() + variants_help()

    def parse_args(self, args=None, namespace=None):
        """Like :meth:`argparse.ArgumentParser.parse_args`, but names after a flag are parsed
        too (argparse's ``*`` positional takes only the first run of names)."""
        ns, rest = self.parse_known_args(args, namespace)
        while rest and not rest[0].startswith("-"):
            ns, rest = self.parse_known_args(rest, ns)
        if rest:
            self.error(f"unrecognized arguments: {' '.join(rest)}")
        return ns


def get_args_parser() -> argparse.ArgumentParser:
    """The stage-5 command line (``5_quantize.sh`` passes its arguments through).

    Returns:
        the parser; ``args.selected`` holds the variants in command-line order.
    """
    p = Stage5Parser(description=__doc__.strip(), formatter_class=HelpFormatter,
                     usage="%(prog)s [--model M] VARIANT [VARIANT ...] | --default | "
                           "--all-variants | --list",
                     epilog=variants_help())
    add_shared_args(p, "model", "calib_inputs")
    p.add_argument("--default", action=_Select, nargs=0, dest="selected",
                   const=tuple(cli_variants()), help="the variants of a default run")
    p.add_argument("--all-variants", action=_Select, nargs=0, dest="selected",
                   const=tuple(cli_variants(True)),
                   help="every variant except those made on request only (int8_auto)")
    p.add_argument("--list", action=_List, nargs=0,
                   help="print every variant name, one per line, and exit")
    p.add_argument("variants", nargs="*", action=_Select, metavar="VARIANT",
                   help="variants to make, in this order (listed below)")
    p.add_argument("--eval", action="store_true",
                   help="also evaluate each file made on ORT, in this process (the results "
                        "row of 3_onnx_eval.py --onnx FILE --tag ort_<variant>, as that command "
                        "writes it; failure reproductions such as int4_cli_broken are left out): "
                        "one interpreter and one set of imports for the whole stage (run_all.sh "
                        "uses it)")
    p.add_argument("--eval-args", default="", metavar="ARGS",
                   help="with --eval: more 3_onnx_eval.py flags for every row, one "
                        "shell-quoted string given with = (e.g. --eval-args='--limit 64 "
                        "--iters 20', --eval-args=--full-eval); checked before any "
                        "quantization; --onnx, --tag and --model are set per row")
    p.set_defaults(selected=None)
    return p


def _raise_exit(signum, frame):
    """SIGTERM/SIGHUP: leave through ``finally`` (work folder removed, child killed)."""
    raise SystemExit(128 + signum)


def _exit_on_signals() -> dict:
    """:func:`_raise_exit` for SIGTERM and SIGHUP (in the main thread); the handlers it
    replaced, for :func:`_restore_signals`."""
    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, _raise_exit)
        except ValueError:  # not the main thread: signals stay as they are
            pass
    return old


def _restore_signals(old: dict) -> None:
    for s, h in old.items():
        signal.signal(s, h)


def main(args: argparse.Namespace) -> list[dict]:
    """Quantize the selected variants (``int4`` last, through 5b_quantize_int4.py) and, with
    ``--eval``, evaluate each file; return their records.

    Args:
        args: :func:`get_args_parser`'s arguments (``selected``, ``model``).
    Returns:
        the ``quant_<variant>.json`` records written, in order.
    Raises:
        UsageError: no variant selected, or a bad ``CALIB_BATCH``.
        StageError: a missing input, an unwritable output folder, refused calibration data,
            a failed ModelOpt run or verification, or a variant that does not apply.
        SystemExit: int8_auto's search failed: its exit status.
    """
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # in order with the children's output
    selected = list(dict.fromkeys(args.selected or []))  # a variant given twice is made once
    if not selected:
        raise UsageError("give one or more variants, --default or --all-variants")
    try:
        eval_args = shlex.split(getattr(args, "eval_args", "") or "")
    except ValueError as e:
        raise UsageError(f"--eval-args {args.eval_args!r}: {e}") from e
    want_eval = bool(getattr(args, "eval", False))
    if eval_args and not want_eval:
        raise UsageError("--eval-args is for --eval: add --eval, or drop --eval-args")
    if eval_args:
        _check_eval_args(args.model, eval_args)  # before any quantization: fail in seconds
    made = [v for v in selected if v != INT4]
    # Every file first, in one ModelOpt process (modelopt_runner.shared_worker: ModelOpt is
    # imported once, in that process, never in this one), then every row. INT4 needs only
    # fp32.onnx and calib.npz: with INT8 variants to make, it runs meanwhile in a process of
    # its own (deploykit.quant.beside), its output printed after theirs.
    int4_rec, int4_error = None, None
    int4_argv = ["--model", args.model, "--no-eval"] + (
        ["--calib-inputs", str(args.calib_inputs)] if args.calib_inputs else [])
    beside = None
    old_handlers = _exit_on_signals()  # SIGTERM/SIGHUP leave through the worker's kill
    try:
        with modelopt_runner.shared_worker():
            if INT4 in selected and made:
                beside, beside_why = _start_int4_beside(args.model, int4_argv)
            records = _quantize(args, made) if made else []
            if INT4 in selected:
                if beside is not None:
                    print(f"Stage 5: quantize {INT4}: 5b_quantize_int4.py in a process of its "
                          f"own, beside the variants above ({beside_why}); its output:",
                          flush=True)
                    int4_rec, int4_error = _collect_int4(beside, args.model)
                else:
                    print(f"Stage 5: quantize {INT4}: 5b_quantize_int4.py in this process "
                          "(ModelOpt in the stage's ModelOpt process)"
                          + (f"; not beside the others: {beside_why}" if made else ""),
                          flush=True)
                    try:
                        int4_rec = run_script("5b_quantize_int4", int4_argv)
                    except StageError as e:  # the other rows are still made, then it fails
                        int4_error = e
    except BaseException as e:
        if beside is not None:  # the stage failed first: end it (its output is printed)
            beside.stop("the stage was interrupted" if isinstance(e, KeyboardInterrupt) else
                        "the stage ended first: a signal" if isinstance(e, SystemExit) else
                        "the stage failed first")
        raise
    finally:
        _restore_signals(old_handlers)
    rows: list[dict] = []
    if want_eval:
        left = [v for v in made if get_variant(v).expected_failure]
        if left:
            print(f"Stage 5: not evaluated here: {' '.join(left)} (failure reproductions: "
                  "ORT is expected to refuse them; run_all.sh checks that it does)", flush=True)
        rows += _evaluate(args.model, [v for v in made if v not in left], eval_args)
    if int4_rec is not None:
        records.append(int4_rec)
        if want_eval and int4_rec.get("status") == "ok":
            rows += _evaluate(args.model, [INT4], eval_args)
        elif want_eval:  # its line among the rows': why there is none
            rows.append({"tag": get_variant(INT4).ort_tag, "no_row": (
                f"no row: int4 {int4_rec.get('status')}: "
                f"{int4_rec.get('reason') or 'see quant_int4.json'}")})
    if int4_error is not None:
        rows.append({"tag": get_variant(INT4).ort_tag, "no_row": "no row: int4 failed (above)"})
    for row in rows:  # the stage's last lines: one per row (run_all.sh shows them)
        print(f"{row['tag']}: {row.get('no_row') or summary_line(row)}")
    if int4_error is not None:
        raise int4_error
    return records


def _start_int4_beside(model: str, argv: list[str]) -> tuple[ScriptBeside | None, str]:
    """5b_quantize_int4.py ARGV started in a child process (:mod:`deploykit.quant.beside`)
    when :func:`deploykit.quant.beside.beside_ok` says it pays, after this process has taken
    the writer locks of every folder 5b writes (it is their holder's child, so it may write
    there too; no other writer can come in between).

    Returns:
        ``(the running child or None, why)``: None runs 5b in this process after the others.
    """
    ok, why = beside_ok()
    if not ok:
        return None, why
    folders = [model_artifacts(model), layout.variant_onnx_path(model, INT4).parent,
               model_results(model)]
    lock_folders(*folders)
    try:
        return ScriptBeside("5b_quantize_int4.py", argv, writes_in=folders).start(), why
    except OSError as e:
        return None, f"could not start it: {e}"


def _collect_int4(beside: ScriptBeside, model: str) -> tuple[dict | None, Exception | None]:
    """Wait for the INT4 child, print its output, and give what its in-process run would have
    given :func:`main`: ``(its record, None)`` on exit 0 (``quant_int4.json``, which it has just
    written), else ``(None, StageError)``.

    Raises:
        UsageError: it exited 2 (a usage error, as in-process it would have raised).
        KeyboardInterrupt: it was interrupted (exit 130, or SIGINT).
    """
    rc = beside.collect()
    if rc == 0:
        path = model_results(model) / "quant_int4.json"
        try:
            return load_json(path, "5b_quantize_int4.py"), None
        except StageError as e:
            return None, e
    what = (f"5b_quantize_int4.py {shlex.join(beside.argv)} exited {rc}; its last lines (all "
            f"above):\n{beside.tail()}")
    if rc == 2:
        raise UsageError(what)
    if rc in (130, -signal.SIGINT):
        raise KeyboardInterrupt
    return None, StageError(what)


#: 3_onnx_eval.py flags that ``--eval`` sets for each row itself (file, tag, model), and help.
_PER_ROW = ("--onnx", "--tag", "--model", "-h", "--help")


def _check_eval_args(model: str, extra: list[str]) -> None:
    """``--eval-args`` must be 3_onnx_eval.py flags that its own parser and its checks of the
    flags accept (``preflight``), other than the ones each row gets from ``--eval``
    (:data:`_PER_ROW`, also abbreviated, as argparse would take them).

    Raises:
        UsageError / StageError: a per-row flag, an unknown flag, a bad value or an EP this
            onnxruntime lacks, naming 3_onnx_eval.py.
    """
    for a in extra:
        name = a.split("=", 1)[0]
        if a.startswith("-") and any(name == f or (name.startswith("--") and len(name) > 2
                                                  and f.startswith(name)) for f in _PER_ROW):
            raise UsageError(f"--eval-args: {name} is (or abbreviates) a flag --eval sets for "
                             "each row (--onnx its file, --tag ort_<variant>, --model this "
                             "model) or asks for help: leave it out")
    mod = load_script("3_onnx_eval")
    parser = mod.get_args_parser()
    parser.prog, parser.exit_on_error = "3_onnx_eval.py", False
    row = ["--model", model, "--onnx", "f.onnx", "--tag", "t"]
    try:
        ns, rest = parser.parse_known_args(row + extra)
    except argparse.ArgumentError as e:
        raise UsageError(f"--eval-args: 3_onnx_eval.py refuses it: {e} "
                         "(python 3_onnx_eval.py --help)") from e
    if rest:
        raise UsageError(f"--eval-args: 3_onnx_eval.py has no {' '.join(rest)} "
                         "(python 3_onnx_eval.py --help lists its flags)")
    try:
        mod.preflight(ns, ahead=True)
    except UsageError as e:
        raise UsageError(f"--eval-args: 3_onnx_eval.py refuses it: {e}") from e
    except StageError as e:
        raise StageError(f"--eval-args: 3_onnx_eval.py could not run: {e}") from e


def _evaluate(model: str, variants: list[str], extra: list[str]) -> list[dict]:
    """``--eval``: each variant's results row, ``3_onnx_eval.py`` run in this process
    (:func:`deploykit.cli.run_script`: the row records that command, and its rerun is that
    command); a row that cannot be made stops the stage (exit 1), as the command would.

    Returns:
        the rows written, in order.
    """
    rows = []
    for v in variants:
        var = get_variant(v)
        argv = ["--model", model, "--onnx", str(layout.variant_onnx_path(model, v)),
                "--tag", var.ort_tag, *extra]
        print(f"Stage 5: evaluate {v}: 3_onnx_eval.py {shlex.join(argv)}", flush=True)
        rows.append(run_script("3_onnx_eval", argv))
    return rows


def _quantize(args: argparse.Namespace, selected: list[str]) -> list[dict]:
    """The ModelOpt variants of :func:`main`, in order; their records."""
    started = time.time()
    env = env_settings()
    model = args.model
    art = model_artifacts(model)
    onnx_dir = layout.onnx_dir(model)
    res_dir = model_results(model)
    src = fp32_onnx_path(model)
    calib = Path(args.calib_inputs) if args.calib_inputs else calib_path(model)
    if not src.is_file():
        raise StageError(f"{src} missing: run 2_export_onnx.py --model {model}")
    if not calib.is_file():
        raise StageError(f"{calib} missing: run 4_make_calib.py --model {model}"
                         if not args.calib_inputs else f"--calib-inputs {calib}: no such file")
    tuning = any(get_variant(v).needs_tuning for v in selected)
    check_writable(onnx_dir, res_dir, *([art / "auto_precision"] if tuning else []))
    lock_folders(art, res_dir)  # one writer per folder, held until this process exits
    eps = env["eps"] or default_eps()

    # Graph-derived node lists (anchored regexes), read once.
    fp32_model = load_onnx(src)
    dw = anchored([d["name"] for d in list_depthwise(fp32_model)])
    stem = anchored([d["name"] for d in list_stem(fp32_model)])
    # A model without convolutions (an MLP, a transformer) has no stem: only the variants that
    # exclude it (excl_stem) do not apply, and variants.py says so for them.
    print(f"stage 5: {model}: {len(dw)} depthwise conv(s), stem {' '.join(stem) or 'none'}, "
          f"calibration EP {eps} requested")
    ep = calibration_ep(eps, os.devnull)
    if ep["requested_provider"] not in ep["available"]:
        print(f"WARNING: EPS={eps}: this onnxruntime has no {ep['requested_provider']} "
              f"(available: {', '.join(ep['available'])}): ONNX Runtime will calibrate on the "
              "CPU instead (recorded as calibration_ep in quant_<variant>.json)", file=sys.stderr)
    # ModelOpt converts the file to opset 19 before it quantizes (<name>_opset19.onnx): name
    # the nodes whose operator changes meaning on that conversion.
    for r in (lint_opset_conversion(fp32_model, MODELOPT_MIN_OPSET)
              if onnx_opset(fp32_model) < MODELOPT_MIN_OPSET else []):
        if r["status"] == "warn":
            print(f"WARNING: {r['node']}: {r['detail']}; fix: {r['fix']}", file=sys.stderr)

    # (SIGTERM/SIGHUP: main's handlers, around the whole ModelOpt block, end this through
    # the finally below)
    # ModelOpt 0.47.0 rewrites the file given as --onnx_path (same bytes, new mtime): it gets a
    # private copy, so fp32.onnx is never written while another stage may be reading it. The
    # work folder sits beside the outputs (same file system: the final rename is atomic) and
    # also receives ModelOpt's intermediate files (<name>_opset19.onnx, <name>_reconciled.onnx,
    # written beside --output_path and left there when ModelOpt fails).
    work = Path(tempfile.mkdtemp(dir=onnx_dir, prefix=f".tmp-5_quantize.pid{os.getpid()}."))
    try:
        records = quantize_all(args, selected, env, eps, src, calib, onnx_dir, res_dir, work,
                               fp32_model, dw, stem)
        report_leftovers(remove_leftovers(onnx_dir, started) + remove_leftovers(res_dir, started))
        return records
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    cli(get_args_parser, main)
