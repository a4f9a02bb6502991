#!/usr/bin/env python3
"""Stage 2: export the model to ONNX FP32 and ONNX FP16 (fp16 weights and compute, fp32 inputs
and outputs) with a dynamic batch axis, and install a file only when it is a faithful copy.

Reads:  model weights; eval split cache (0_prepare_data.py) for the checks (custom models:
        ``--inputs`` samples, else seeded random inputs of ``--input-shape``).
Writes: ``artifacts/<model>/onnx/fp32.onnx``, ``artifacts/<model>/onnx/fp16.onnx``,
        ``results/<model>/export.json`` (every check of each file, parity vs PyTorch FP32).
        A file that fails a check is kept as ``<name>.rejected.onnx`` with
        ``<name>.rejected.json`` (the reason), never under its final name.
Rerun:  ``python 2_export_onnx.py --model efficientnet_lite0``

Exporter: ``torch.onnx.export(dynamo=True)`` at opset 18 by default (its node metadata keeps the
PyTorch module path and source line, which the checks and layer-wise tools use). For TensorRT
8.5/8.6 (JetPack 5) use ``--exporter legacy --opset 17``. The example batch is 3 (>= 2, so no
exporter can specialise the batch to 1, and unlike any channel or group count). FP16:
onnxconverter-common's ``convert_float_to_float16`` with ``keep_io_types=True`` (Cast nodes at
the graph boundary), its clamp limits set to the FP16 range, ``--fp16-keep-fp32`` nodes kept
in FP32.

The gate (``export_checks.py``; each finding names the node and the fix):
- FP32: every declared dynamic axis symbolic, no shape constant holding the example batch;
  exporter warnings shown, a TracerWarning (a value frozen at trace time) an error unless
  ``--allow-tracer-warnings``; parity with PyTorch at batch 1 and batch N (cosine of the logits,
  minimum over images >= ``--min-cosine-fp32``) and on a second input that takes other
  data-dependent paths; NonZero & co. accepted when parity holds and flagged for TensorRT; lint.
- FP16: lint; constants the converter changed; a range audit of every FP16 tensor from FP32
  activations on the same real inputs (overflow above 65504, mass below 6.1e-5); parity on ORT
  CPU (which computes most FP16 graphs in FP32: said in the row); true FP16 arithmetic with
  ``onnx.reference`` (time-bounded); ORT CUDA EP / TensorRT when present. A failure prints the
  one command that keeps the named nodes in FP32.

FP32 and FP16 are installed together, by rename, after both passed: an earlier good pair stays
until then.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from deploykit.compare import OUTPUT_MIN_COSINE
from deploykit.checks.base import check_result, format_result, with_source, worst
from deploykit.checks.export import (
    capture_warnings,
    check_batch_parity,
    check_export,
    keep_list,
    ort_runner,
    other_paths,
)
from deploykit.checks.fp16 import convert_fp16, fp16_checks
from deploykit.checks.lint import DEFAULT_EXAMPLE_BATCH
from deploykit.cli import add_shared_args, cli, require, stage_parser
from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import require_batch_axis
from deploykit.install import install, install_rejected, rejected_path
from deploykit.io import check_writable, file_size_mb, sha256_file, write_json
from deploykit.layerwise.torch_vs_onnx import torch_vs_onnx
from deploykit.layout import model_artifacts, model_results
from deploykit.models import build_model, example_inputs, parse_input_shapes
from deploykit.onnx.graph import load_onnx
from deploykit.results import provenance
from deploykit.runners import TorchRunner
from deploykit.tools.export_checks import split_names


EXAMPLE_BATCH = DEFAULT_EXAMPLE_BATCH


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    add_shared_args(p, "model", "weights", "random_init", "input_shape")
    p.add_argument("--exporter", choices=("dynamo", "legacy"), default="dynamo",
                   help="torch.onnx.export(dynamo=True) or the legacy TorchScript exporter")
    p.add_argument("--opset", type=int, default=None,
                   help="ONNX opset (default: 18 for dynamo, 17 for legacy)")
    p.add_argument("--check-images", type=int, default=64,
                   help="eval images (or samples of --inputs / random samples) used by the checks")
    p.add_argument("--inputs", type=Path, default=None,
                   help="custom models: .npz of real samples keyed by input name (batch on axis "
                        "0) for parity and the FP16 range audit (default: seeded random inputs "
                        "of --input-shape)")
    p.add_argument("--min-cosine-fp32", type=float, default=OUTPUT_MIN_COSINE["fp32"],
                   help="lowest per-image cosine similarity of the FP32 file vs PyTorch")
    p.add_argument("--min-cosine-fp16", type=float, default=OUTPUT_MIN_COSINE["fp16"],
                   help="lowest per-image cosine similarity of the FP16 file vs PyTorch")
    p.add_argument("--no-fp16", action="store_true", help="export FP32 only")
    p.add_argument("--fp16-keep-fp32", action="append", default=None, metavar="NODE[,NODE]",
                   help="ONNX nodes to keep in FP32 in fp16.onnx (the converter's node block "
                        "list; repeatable, comma-separated): the fix the FP16 checks print")
    p.add_argument("--allow-tracer-warnings", action="store_true",
                   help="accept TracerWarnings of the legacy exporter (values frozen at trace "
                        "time) after checking each line it names")
    p.add_argument("--true-fp16-budget-s", type=float, default=60.0,
                   help="seconds for the onnx.reference run of the FP16 file (true FP16 "
                        "arithmetic, one sample at a time, at most 2); 0 skips it")
    return p


def _check_args(args: argparse.Namespace) -> None:
    """Range checks of the numeric flags (UsageError names the flag)."""
    import onnx

    if args.check_images < 2:
        raise UsageError(f"--check-images must be >= 2 (batch-N check), got "
                         f"{args.check_images}")
    for flag in ("min_cosine_fp32", "min_cosine_fp16"):
        v = getattr(args, flag)
        if not 0.0 < v <= 1.0:  # NaN fails too
            raise UsageError(f"--{flag.replace('_', '-')} {v}: a cosine similarity lies "
                             "in [-1, 1] and a threshold that can fail a file in (0, 1] "
                             "(e.g. 0.999); nothing was exported")
    top = onnx.defs.onnx_opset_version()
    low = 18 if args.exporter == "dynamo" else 7
    if args.opset is not None and not low <= args.opset <= top:
        raise UsageError(f"--opset {args.opset}: the {args.exporter} exporter writes "
                         f"opsets {low}..{top} here")
    if args.true_fp16_budget_s < 0:
        raise UsageError("--true-fp16-budget-s must be >= 0")
    if args.no_fp16 and args.fp16_keep_fp32:
        raise UsageError("--fp16-keep-fp32 with --no-fp16: there is no FP16 file")


def _exporter_error(e: Exception, exporter: str, opset: int) -> StageError:
    """A short message for an exporter failure: its first line and the user's source lines."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # drop terminal colour codes
    user = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File \"")
            and f"{os.sep}torch{os.sep}" not in ln]
    first = next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]
    where = f" (at {user[0]})" if user else ""
    hint = (" The model reads a tensor's value into Python (int()/.item()/bool()/a branch): "
            "keep it a tensor (masks, torch.gather/torch.where), or try --exporter legacy, "
            "whose TracerWarning stage 2 then names." if "data-dependent" in text.lower()
            or "GuardOnDataDependent" in text else "")
    return StageError(f"torch.onnx.export ({exporter}, opset {opset}) failed: "
                      f"{type(e).__name__}: {first}{where}.{hint}")


def export_fp32(model, example: dict[str, np.ndarray], path: Path, exporter: str, opset: int,
                output_names: list[str]) -> tuple[list[dict], dict[str, list[int]]]:
    """Export ``model`` with a dynamic batch axis on every input (and, legacy exporter, output).

    Args:
        example: ``{input name: array}`` with the batch axis first (batch >= 2, see
            :data:`EXAMPLE_BATCH`).
    Returns:
        ``(exporter warnings, declared dynamic axes {name: [axes]})``; the warnings are captured
        (never silenced) for :func:`export_checks.check_exporter_warnings`.
    Raises:
        StageError: the exporter fails (message: its first line and the user's source line).
    """
    import onnx
    import torch

    args = tuple(torch.from_numpy(v) for v in example.values())
    names = list(example)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if exporter == "dynamo":
                batch = torch.export.Dim("batch", min=1, max=4096)
                prog = torch.onnx.export(
                    model, args, input_names=names, output_names=output_names,
                    opset_version=opset, dynamo=True, external_data=False,
                    dynamic_shapes=tuple({0: batch} for _ in args), verbose=False)
                prog.save(str(path), external_data=False)
                declared = {n: [0] for n in names}
            else:
                declared = {n: [0] for n in names + list(output_names)}
                torch.onnx.export(model, args, str(path), input_names=names,
                                  output_names=output_names, opset_version=opset,
                                  dynamo=False, dynamic_axes={n: {0: "batch"} for n in declared},
                                  do_constant_folding=True)
        except Exception as e:  # noqa: BLE001 - exporter errors have many types
            raise _exporter_error(e, exporter, opset) from e
    onnx.checker.check_model(str(path))
    return [w for w in capture_warnings(caught)
            if not _OWN_CALL_NOTICE.search(w["message"])], declared


# The dynamo exporter's notice that inputs sharing our one Dim("batch") share its name: caused by
# this stage's own dynamic_shapes, not by the model (torch 2.14, torch/onnx/_internal/exporter).
_OWN_CALL_NOTICE = re.compile(r"axis name: \w+ will not be used, since it shares the same shape "
                              r"constraints")


def _rows(feed: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """The first ``n`` samples of ``feed`` (samples repeated cyclically when it has fewer)."""
    return {k: v[np.arange(n) % len(v)] for k, v in feed.items()}


def _inputs(args, spec, shapes) -> tuple[dict[str, np.ndarray], dict | None, bool]:
    """``(feed, second feed or None, real)`` for the checks."""
    if args.inputs is not None:
        path = require(args.inputs, "np.savez of your samples")
        with np.load(path) as z:
            feed = {k: z[k] for k in z.files}
        if shapes:
            names = [n for n, _, _ in shapes]
            missing = [n for n in names if n not in feed]
            if missing:
                raise UsageError(f"--inputs {args.inputs}: keys {sorted(feed)} lack "
                                 f"{missing} (names of --input-shape)")
            feed = {n: feed[n] for n in names}
        if not feed or len({len(v) for v in feed.values()}) != 1:
            raise UsageError(f"--inputs {args.inputs}: every array needs the same number "
                             "of samples on axis 0")
        return {k: v[:args.check_images] for k, v in feed.items()}, None, True
    if spec.classifier:
        x, _, _ = load_split("eval", spec, args.check_images)
        if len(x) < 2:
            raise UsageError("--check-images must be >= 2 (batch-N check)")
        return {"input": normalize(x, spec.mean, spec.std)}, None, True
    if not shapes:
        raise UsageError(f"--model {args.model}: give --input-shape for a custom model "
                         "(and --inputs with real samples for the FP16 audit)")
    n = max(EXAMPLE_BATCH, min(args.check_images, 8))
    feed = example_inputs(spec, shapes, batch=n, seed=0)
    return feed, other_paths(feed, seed=1), False


def _fix_command(keep: list[str]) -> str:
    """This stage's command line with ``--fp16-keep-fp32`` set to ``keep``."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--fp16-keep-fp32":
            skip = True
            continue
        if a.startswith("--fp16-keep-fp32="):
            continue
        argv.append(a)
    return shlex.join(["python", Path(sys.argv[0]).name, *argv, "--fp16-keep-fp32",
                       ",".join(keep)])


def _summary(name: str, path: Path, par: dict | None, results: list[dict]) -> None:
    line = f"ONNX {name}: {path.name}"
    if any(r.get("computed_in") for r in results):
        line += " (ORT CPU EP computes it in FP32; FP16 judged by the range audit and onnx.reference)"
    if par:
        line += f", cosine min {par['cosine_min']:.6f}" + (
            f", top-1 agreement {par['top1_agreement']:.1f}%" if "top1_agreement" in par else "")
    line += f" -> {worst(results)}"
    print(line)
    for r in results:  # failures are listed in the stage's error message
        if r["status"] == "warn":
            print("  " + format_result(r).replace("\n", "\n  "))


def main(args: argparse.Namespace) -> dict:
    import onnx

    started = time.time()
    _check_args(args)  # before anything is exported: an impossible threshold fails every file
    check_writable(model_artifacts(args.model), model_results(args.model))
    keep = split_names(args.fp16_keep_fp32)
    model, spec = build_model(args.model, args.weights, pretrained=not args.random_init)
    opset = args.opset or (18 if args.exporter == "dynamo" else 17)
    shapes = parse_input_shapes(args.input_shape)
    feed, second, real = _inputs(args, spec, shapes)
    output_names = ["logits"] if spec.classifier else None
    with TorchRunner(model, "cpu") as tr:
        ref = tr.infer(feed)
    # before anything is exported: the checks compare outputs sample by sample
    require_batch_axis(ref, len(next(iter(feed.values()))))
    if output_names is None:
        output_names = list(ref) if len(ref) > 1 else ["output"]
        ref = dict(zip(output_names, ref.values()))
    n = len(next(iter(feed.values())))
    onnx_dir = model_artifacts(args.model) / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    final = {"fp32": onnx_dir / "fp32.onnx", "fp16": onnx_dir / "fp16.onnx"}
    results_json = model_results(args.model) / "export.json"
    record: dict = {"stage": "2_export_onnx", "model": args.model, "exporter": args.exporter,
                    "opset": opset, "example_batch": EXAMPLE_BATCH, "n_check": n,
                    "check_inputs": "real" if real else "synthetic (seeded N(0,1))",
                    "fp16_keep_fp32": keep, "files": {}}
    cand_dir = Path(tempfile.mkdtemp(dir=onnx_dir, prefix=".stage2-"))
    try:
        cand = {k: cand_dir / p.name for k, p in final.items()}
        ex_warn, declared = export_fp32(model, _rows(feed, EXAMPLE_BATCH), cand["fp32"],
                                        args.exporter, opset, output_names)
        record["exporter_warnings"] = ex_warn
        cache = {("b", n): ref}
        res = {"fp32": check_export(
            model, cand["fp32"], feed, min_cosine=args.min_cosine_fp32, declared=declared,
            example_batch=EXAMPLE_BATCH, exporter_warnings=ex_warn,
            allow_tracer=args.allow_tracer_warnings, second_feed=second,
            input_paths=not (real and spec.classifier), ref_cache=cache)}
        par = {"fp32": _parity(res["fp32"])}
        if worst(res["fp32"]) == "fail" and any(
                r["check"] == "batch_parity" and r["status"] == "fail" and r["node"] is None
                for r in res["fp32"]):
            res["fp32"] += _first_divergent_module(model, cand["fp32"], feed)
        m32 = onnx.load(str(cand["fp32"]))
        if not args.no_fp16 and worst(res["fp32"]) != "fail":
            m16, conv_warn = convert_fp16(m32, keep)
            onnx.save(m16, str(cand["fp16"]))
            onnx.checker.check_model(str(cand["fp16"]))
            r16 = fp16_checks(m32, cand["fp16"], feed, ref, args.min_cosine_fp16,
                              converter_warnings=conv_warn, real_inputs=real, keep_fp32=keep,
                              true_fp16_budget_s=args.true_fp16_budget_s,
                              trained=not args.random_init)
            run16 = ort_runner(cand["fp16"])
            bp = check_batch_parity({b: cache[("b", b)] for b in (1, n) if ("b", b) in cache},
                                    {b: {k: v[:b] for k, v in feed.items()} for b in (1, n)
                                        if ("b", b) in cache}, run16, args.min_cosine_fp16)
            for r in bp:
                r["detail"] = ("ORT CPU EP (computes this FP16 graph in FP32 through inserted "
                               "Casts, blind to FP16 overflow): " + r["detail"])
                r["computed_in"] = "FP32 (ORT CPU EP)"
            res["fp16"] = bp + r16
            par["fp16"] = _parity(res["fp16"])
        failed = [k for k, r in res.items() if worst(r) == "fail"]
        for name, rs in res.items():
            record["files"][name] = {"path": str(final[name]), "status": worst(rs),
                                     "outputs": par.get(name) or {},
                                     "checks": rs, "size_mb": file_size_mb(cand[name]),
                                     "sha256": sha256_file(cand[name]),
                                     "min_cosine_required": getattr(
                                         args, f"min_cosine_{name}")}
            _summary(name, final[name], next(iter((par.get(name) or {None: None}).values())),
                     rs)
        if failed:
            for name in failed:
                rej = install_rejected(cand[name], final[name], res[name])
                record["files"][name]["rejected_as"] = str(rej)
            record["status"], record["installed"] = "failed", False
            record["provenance"] = provenance(args, [], started)
            write_json(results_json, record)
            lines = [format_result(r) for k in failed for r in res[k]
                     if r["status"] == "fail" and not r.get("summary")]
            more = keep_list(res.get("fp16", []), keep) if "fp16" in failed else keep
            fix = (f"\nfix (keep those nodes in FP32): {_fix_command(more)}" if more != keep
                   else "")
            kept = ", ".join(str(rejected_path(final[k])) for k in failed)
            prev = [str(p) for p in final.values() if p.exists()]
            raise StageError(
                f"export check failed for {failed}; kept as {kept} (reason beside it, and in "
                f"{results_json}); nothing installed"
                + (f" (earlier files left as they were: {', '.join(prev)})" if prev else "")
                + ":\n" + "\n".join(lines) + fix)
        for name in res:
            install(cand[name], final[name])
        record["status"], record["installed"] = "ok", True
        record["provenance"] = provenance(args, [final["fp32"]], started)
        write_json(results_json, record)
        print(f"installed {', '.join(str(final[k]) for k in res)} -> {results_json}")
        return record
    finally:
        shutil.rmtree(cand_dir, ignore_errors=True)


def _parity(results: list[dict]) -> dict | None:
    """``{output: common.parity}`` at the largest batch, from the ``batch_parity`` row (None when
    the file did not run)."""
    row = next((r for r in results if r["check"] == "batch_parity" and "parity" in r), None)
    return (row or {}).get("parity") or None


def _first_divergent_module(model, onnx_path: Path, feed: dict) -> list[dict]:
    """Name the first PyTorch module whose ONNX output differs (layerwise.torch_vs_onnx), for a
    parity failure that no graph check explains. Best effort: errors give a ``skip`` row."""

    try:
        res = torch_vs_onnx(model, onnx_path, {k: v[:2] for k, v in feed.items()})
    except Exception as e:  # noqa: BLE001 - diagnostics never hide the real failure
        return [check_result("first_divergent_module", "skip",
                             f"torch-vs-onnx could not run: {' '.join(str(e).split())[:160]}")]
    fd = res.get("first_divergent")
    if not fd:
        return [check_result("first_divergent_module", "skip",
                             "every mapped module matches its ONNX tensor: the difference is in "
                             "unmapped nodes")]
    head = (f"module {fd['module']} ({fd['type']}) is the first whose ONNX output differs "
            f"(cosine min {fd.get('cosine_min', float('nan')):.4f})")
    if fd.get("inputs_agree") is False and fd.get("input_node"):
        src = next((n for n in load_onnx(onnx_path).graph.node
                    if n.name == fd["input_node"]), None)
        where = with_source(src) if src is not None else fd["input_node"]
        return [check_result(
            "first_divergent_module", "fail",
            f"{head}, but its input already differs (tensor {fd['input_tensor']} made by "
            f"{where}, cosine min {fd.get('input_cosine_min', float('nan')):.4f}): the error is "
            f"upstream of {fd['module']}, in code between modules (the parent's forward), at or "
            f"before node {fd['input_node']}", node=fd["input_node"],
            fix=f"look at the ops that compute {fd['module']}'s input (the source line above) "
                "and how they are exported; python layerwise.py torch-vs-onnx shows all rows")]
    return [check_result("first_divergent_module", "fail", head, node=fd["node"],
                         fix="look at how this module is exported (op, attributes, indexing); "
                         "python layerwise.py torch-vs-onnx shows all rows")]


if __name__ == "__main__":
    cli(get_args_parser, main)
