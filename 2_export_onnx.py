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

Installing (by rename, after the checks): FP32 failing installs nothing (exit 1; an earlier good
pair stays). FP32 passing is installed even when FP16 fails: fp16.onnx is then kept as
``fp16.rejected.onnx`` (+ reason), an earlier fp16.onnx (converted from the earlier fp32.onnx) is
moved to ``fp16.stale.onnx``, export.json gets ``status: partial`` (``files.fp16.status: fail``),
and the stage exits 0 with a ``WARNING:`` line (the failure, the fix command, ``--no-fp16``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from deploykit.compare import OUTPUT_MIN_COSINE
from deploykit.checks.base import format_result, worst
from deploykit.checks.export import (
    check_batch_parity,
    check_export,
    keep_list,
    ort_runner,
)
from deploykit.checks.fp16 import convert_fp16, fp16_checks
from deploykit.cli import add_shared_args, cli, stage_parser
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import require_batch_axis
from deploykit.install import install, install_rejected, rejected_path, set_aside
from deploykit.lock import lock_folders
from deploykit.io import (check_writable, file_size_mb, remove_leftovers, report_leftovers,
                          sha256_file, write_json)
from deploykit.layout import model_artifacts, model_results
from deploykit.model_errors import forward_error
from deploykit.models import build_model, parse_input_shapes
from deploykit.results import provenance, weights_sha256
from deploykit.runners import TorchRunner
from deploykit.tools.export_checks import split_names
from deploykit.export import (
    EXAMPLE_BATCH,
    check_batch_statistics,
    check_export_args,
    first_divergent_module,
    fp16_candidate_error,
    fp16_fix_command,
    fp16_rejected_warning,
    no_fp16_command,
    export_inputs,
    export_parity,
    repeat_rows,
    print_export_summary,
    export_fp32,
)


#: Check samples (at most) on which deploykit.export.out_of_place compares the model's outputs
#: in place and out of place, besides the example batch.
OUT_OF_PLACE_CHECK = 16


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
    p.add_argument("--true-fp16-samples", type=int, default=2,
                   help="samples the onnx.reference run of the FP16 file takes at most (one "
                        "at a time; a smoke run takes 1)")
    p.add_argument("--true-fp16-budget-s", type=float, default=60.0,
                   help="seconds for the onnx.reference run of the FP16 file (true FP16 "
                        "arithmetic, one sample at a time, at most 2); 0 skips it")
    return p


#: Where a failed export is recorded while ``export.json`` still describes the earlier files,
#: installed and unchanged (as stage 5 keeps ``quant_<variant>.failed.json``).
FAILED_RECORD = "export.failed.json"


def _write_failed_record(results_json: Path, record: dict, final: dict[str, Path]) -> Path:
    """Record a failed export (nothing installed): in ``export.json`` when it describes no
    installed file, else beside it in :data:`FAILED_RECORD`, so the earlier files keep the
    record that stages 3-8 match them by (``deploykit.results.source_of``: their SHA-256).
    Returns the file written."""
    try:
        earlier = json.loads(results_json.read_text())
    except (OSError, ValueError):
        earlier = None
    files = earlier.get("files") if isinstance(earlier, dict) else None
    keeps = isinstance(files, dict) and earlier.get("status") in ("ok", "partial") and any(
        isinstance(f, dict) and f.get("installed") and final[k].is_file()
        and f.get("sha256") == sha256_file(final[k])
        for k, f in files.items() if k in final)
    out = results_json.with_name(FAILED_RECORD) if keeps else results_json
    write_json(out, record)
    if not keeps:
        results_json.with_name(FAILED_RECORD).unlink(missing_ok=True)  # an older failure's
    else:
        print(f"note: {results_json} describes the earlier files, still installed: kept; this "
              f"failed export is recorded in {out.name}", file=sys.stderr)
    return out


def main(args: argparse.Namespace) -> dict:
    import onnx

    started = time.time()
    check_export_args(args)  # before anything is exported: an impossible threshold fails every file
    check_writable(model_artifacts(args.model), model_results(args.model))
    lock_folders(model_artifacts(args.model), model_results(args.model))  # one writer per folder
    keep = split_names(args.fp16_keep_fp32)
    model, spec = build_model(args.model, args.weights, pretrained=not args.random_init)
    opset = args.opset or (18 if args.exporter == "dynamo" else 17)
    shapes = parse_input_shapes(args.input_shape)
    feed, second, real = export_inputs(args, spec, shapes, model)
    output_names = ["logits"] if spec.classifier else None
    with TorchRunner(model, "cpu") as tr:
        check_batch_statistics(tr.model)  # after eval(): a module that stays in training mode
        try:
            ref = tr.infer(feed)
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's forward() may raise anything
            raise forward_error(args.model, model, feed, e,
                                "--inputs key" if args.inputs else "--input-shape",
                                None if args.inputs else args.input_shape) from e
    # before anything is exported: the checks compare outputs sample by sample
    require_batch_axis(ref, len(next(iter(feed.values()))))
    if output_names is None:  # dict keys name the outputs; else output_<i> / output
        output_names = list(ref) if len(ref) > 1 or tr.outputs_named else ["output"]
        ref = dict(zip(output_names, ref.values()))
    n = len(next(iter(feed.values())))
    onnx_dir = model_artifacts(args.model) / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    final = {"fp32": onnx_dir / "fp32.onnx", "fp16": onnx_dir / "fp16.onnx"}
    results_json = model_results(args.model) / "export.json"
    record: dict = {"stage": "2_export_onnx", "model": args.model, "exporter": args.exporter,
                    "opset": opset, "example_batch": EXAMPLE_BATCH, "n_check": n,
                    "check_inputs": "real" if real else "synthetic (seeded N(0,1))",
                    "fp16_keep_fp32": keep, "weights_sha256": weights_sha256(model),
                    "files": {}}
    cand_dir = Path(tempfile.mkdtemp(dir=onnx_dir, prefix=f".stage2-pid{os.getpid()}-"))
    try:
        cand = {k: cand_dir / p.name for k, p in final.items()}
        cache = {("b", n): ref}

        def export_and_check(allow_out_of_place: bool) -> tuple[list, int]:
            warn, declared, switched = export_fp32(
                model, repeat_rows(feed, EXAMPLE_BATCH), cand["fp32"], args.exporter, opset,
                output_names, check=repeat_rows(feed, min(n, OUT_OF_PLACE_CHECK)),
                allow_out_of_place=allow_out_of_place)
            record["exporter_warnings"] = warn
            record["traced_out_of_place"] = switched  # in-place modules (deploykit.export)
            return check_export(
                model, cand["fp32"], feed, min_cosine=args.min_cosine_fp32, declared=declared,
                example_batch=EXAMPLE_BATCH, exporter_warnings=warn,
                allow_tracer=args.allow_tracer_warnings, second_feed=second,
                input_paths=not (real and spec.classifier), ref_cache=cache), switched

        fp32_res, switched = export_and_check(True)
        if switched and worst(fp32_res) == "fail":
            # the out-of-place check is evidence on a few samples: never the cause of a failure
            print(f"export: the FP32 checks failed with {switched} in-place module(s) traced out "
                  "of place; exporting again with the model exactly as it is", file=sys.stderr,
                  flush=True)
            fp32_res, _ = export_and_check(False)
            record["out_of_place_retried"] = switched
        res = {"fp32": fp32_res}
        par = {"fp32": export_parity(res["fp32"])}
        if worst(res["fp32"]) == "fail" and any(
                r["check"] == "batch_parity" and r["status"] == "fail" and r["node"] is None
                for r in res["fp32"]):
            res["fp32"] += first_divergent_module(model, cand["fp32"], feed)
        m32 = onnx.load(str(cand["fp32"]))
        if not args.no_fp16 and worst(res["fp32"]) != "fail":
            try:
                m16, conv_warn = convert_fp16(m32, keep)
                onnx.save(m16, str(cand["fp16"]))
                onnx.checker.check_model(str(cand["fp16"]))
                run16 = ort_runner(cand["fp16"])  # a file ORT refuses is named before the checks
                r16 = fp16_checks(m32, cand["fp16"], feed, ref, args.min_cosine_fp16,
                                  converter_warnings=conv_warn, real_inputs=real, keep_fp32=keep,
                                  true_fp16_budget_s=args.true_fp16_budget_s,
                                  true_fp16_samples=args.true_fp16_samples,
                                  trained=not args.random_init)
                bp = check_batch_parity({b: cache[("b", b)] for b in (1, n) if ("b", b) in cache},
                                        {b: {k: v[:b] for k, v in feed.items()} for b in (1, n)
                                            if ("b", b) in cache}, run16, args.min_cosine_fp16)
                for r in bp:
                    r["detail"] = ("ORT CPU EP (computes this FP16 graph in FP32 through inserted "
                                   "Casts, blind to FP16 overflow): " + r["detail"])
                    r["computed_in"] = "FP32 (ORT CPU EP)"
                res["fp16"] = bp + r16
                par["fp16"] = export_parity(res["fp16"])
            except (UsageError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - converter/ORT errors: the FP16 candidate fails
                res["fp16"] = [fp16_candidate_error(e, cand["fp16"], "FP16")]
                par["fp16"] = None
        failed = [k for k, r in res.items() if worst(r) == "fail"]
        for name, rs in res.items():
            made = cand[name].exists()
            record["files"][name] = {"path": str(final[name]), "status": worst(rs),
                                     "outputs": par.get(name) or {},
                                     "checks": rs,
                                     "size_mb": file_size_mb(cand[name]) if made else None,
                                     "sha256": sha256_file(cand[name]) if made else None,
                                     "min_cosine_required": getattr(
                                         args, f"min_cosine_{name}")}
            print_export_summary(name, final[name], next(iter((par.get(name) or {None: None}).values())),
                     rs)
        if "fp32" in failed:  # nothing is installed: an FP16 file without its FP32 is no pair
            for name in failed:
                rej = install_rejected(cand[name], final[name], res[name])
                record["files"][name]["rejected_as"] = str(rej)
            record["status"], record["installed"] = "failed", []
            record["provenance"] = provenance(args, [], started)
            failed_json = _write_failed_record(results_json, record, final)
            lines = [format_result(r) for k in failed for r in res[k]
                     if r["status"] == "fail" and not r.get("summary")]
            kept = ", ".join(str(rejected_path(final[k])) for k in failed)
            prev = [str(p) for p in final.values() if p.exists()]
            raise StageError(
                f"export check failed for {failed}; kept as {kept} (reason beside it, and in "
                f"{failed_json}); nothing installed"
                + (f" (earlier files left as they were: {', '.join(prev)})" if prev else "")
                + ":\n" + "\n".join(lines))
        # FP32 passed: it is installed whatever FP16 gives. An earlier fp16.onnx was converted
        # from the earlier fp32.onnx: it is set aside (not deleted) unless a new one replaces it.
        stale = set_aside(final["fp16"]) if "fp16" not in res or "fp16" in failed else None
        installed = [k for k in res if k not in failed]
        for name in installed:
            install(cand[name], final[name])
            record["files"][name]["installed"] = True
        if "fp16" in failed:
            rej = install_rejected(cand["fp16"], final["fp16"], res["fp16"])
            record["files"]["fp16"].update(installed=False, rejected_as=str(rej))
        if stale is not None:
            record["fp16_set_aside"] = str(stale)
        # "partial": fp32.onnx installed, fp16.onnx rejected (files.fp16.status "fail")
        record["status"] = "partial" if failed else "ok"
        record["installed"] = installed
        record["provenance"] = provenance(args, [final["fp32"]], started)
        write_json(results_json, record)
        results_json.with_name(FAILED_RECORD).unlink(missing_ok=True)
        print(f"installed {', '.join(str(final[k]) for k in installed)} -> {results_json}")
        if stale is not None:
            print(f"note: the earlier {final['fp16'].name} (converted from an earlier "
                  f"{final['fp32'].name}) moved to {stale}: no stage or report reads that name")
        if "fp16" in failed:
            more = keep_list(res["fp16"], keep)
            print(fp16_rejected_warning(res["fp16"], final["fp16"], results_json,
                                        fp16_fix_command(more) if more != keep else None,
                                        no_fp16_command()), file=sys.stderr)
        report_leftovers(remove_leftovers(onnx_dir, started))
        return record
    finally:
        shutil.rmtree(cand_dir, ignore_errors=True)


if __name__ == "__main__":
    cli(get_args_parser, main)
