"""Stage 7: evaluate TensorRT engines (a row each): accuracy, GPU compute latency, parity, layers.

Reads  artifacts/<model>/engines/<variant>.plan (6_build_engines.sh), its <variant>.build.log
       (trtexec's own GPU Compute Time, for a cross-check), results/<model>/trt_build_<variant>.json
       (the optimisation profile and DLA core stage 6 built with), artifacts/<model>/ref_logits.npz
       (reference logits) and the eval split (0_prepare_data.py).
Writes results/<model>/<tag>.json (backend "TensorRT"), with the diagnostic batch_invariance:
       the same images at batch 1 and at the accuracy batch (max |difference|, top-1 agreement),
       flagged with the known-issue note when they differ. A plan the runtime refuses is
       reported with its class and fix (not a plan, truncated, another TensorRT, another GPU,
       library path).

Status: as stage 3's (``deploykit.evaluate.judge``): the engine's parity with the PyTorch
reference under its precision's band of ``deploykit.compare.ROW_TOLERANCES`` makes the row ok,
warn or failed (``status_reason``, ``next_step``: the ``layerwise.py diff --engine-b`` command);
the row is written, a ``WARNING:`` line printed, and the exit status stays 0.

Without the TensorRT Python package or without a CUDA GPU it prints why, writes a row with
``status: skipped`` and exits 0.

Rerun alone:
    python 7_trt_eval.py --engine artifacts/mobilenet_v3_small/engines/fp16.plan --tag trt_fp16
Several engines in one process (run_all.sh does so; each row records its one-engine command):
    python 7_trt_eval.py --engine .../fp32.plan --tag trt_fp32 --engine .../fp16.plan --tag trt_fp16

Runtime: ``deploykit.runners.TrtRunner`` (tensor-name API, ``execute_async_v3``; TensorRT 8.5+; device
buffers are torch CUDA tensors, no pycuda), through the evaluation path shared with stages 1 and
3 (``deploykit.evaluate``). Latency, as trtexec names it: ``end_to_end_ms`` is host arrays to host
arrays (H2D + ``execute_async_v3`` + D2H + sync), ``gpu_compute_ms`` the CUDA-event time of
``execute_async_v3`` alone on bound device buffers (comparable with trtexec's "GPU Compute
Time", which the row also carries from the build log). Preprocessing is outside the timed
region.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from deploykit.layout import ref_outputs_path
from deploykit.layout import fp32_onnx_path, ref_logits_path
from deploykit.cli import (add_shared_args, check_positive, cli, command_argv, run_script,
                           stage_parser)
from deploykit.io import require
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import (
    base_record,
    classifier_data,
    custom_data,
    diagnose,
    evaluate,
    summary_line,
    verdict_warning,
)
from deploykit.feeds import load_feed
from deploykit.io import check_writable, file_size_mb, load_json
from deploykit.layerwise.diff import diff_command, run_layer_diff
from deploykit.layerwise.report import render_table
from deploykit.layout import check_row_tag, engine_paths, model_artifacts, model_results
from deploykit.lock import lock_folders
from deploykit.models import model_spec
from deploykit.results import check_source, provenance, write_result
from deploykit.runners import TrtRunner
from deploykit.trt.parsers import (
    layer_dtype_table,
    layer_summary,
    parse_inference_shapes,
    parse_performance_summary,
)
from deploykit.trt.plans import batch_invariance, fit_batch
from deploykit.variants import variant_of_file


STAGE = "7_trt_eval"
REF_PRODUCER = "1_pytorch_baseline.py"


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__, prog="7_trt_eval.py")
    p.add_argument("--engine", required=True, type=Path, action="append",
                   help="TensorRT plan file; repeat it, each with its --tag in the same order, "
                        "to evaluate several engines in one process (each row written and "
                        "recorded as its one-engine command would write it)")
    p.add_argument("--tag", required=True, action="append",
                   help="results row id (results/<model>/<tag>.json), one per --engine")
    add_shared_args(p, "model", "inputs", "logits_output")
    p.add_argument("--precision", default=None,
                   help="label for the row (default: the precision of the engine's variant, "
                        "from its file name); one engine only")
    add_shared_args(p, "batch_size", "limit", "latency_batch", "warmup", "iters",
                    "max_seconds")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--layerwise", action="store_true",
                   help="also compare every layer of the engine with ORT CPU FP32 "
                        "(layerwise.py; marking outputs changes TensorRT's fusion)")
    p.add_argument("--layerwise-images", type=int, default=8,
                   help="eval images for --layerwise")
    p.add_argument("--onnx", type=Path, default=None,
                   help="ONNX the engine was built from (default: artifacts/<model>/onnx/"
                        "<variant>.onnx), for --layerwise; one engine only")
    return p


def _precision(args) -> str:
    if args.precision:
        return args.precision
    v = variant_of_file(args.engine)
    return v.precision if v else "unknown"


def _row(args, status: str, reason: str | None, started: float, desc: dict | None = None,
         **fields) -> dict:
    """A row without measurements (skipped / failed), :mod:`deploykit.evaluate` schema."""
    v = variant_of_file(args.engine)
    rec = base_record(STAGE, _precision(args), args.model, args.tag, desc,
                      backend="TensorRT", status=status, reason=reason,
                      engine=str(args.engine), variant=v.name if v else None,
                      device="cuda", **fields)
    rec["provenance"] = provenance(args, [], started)
    return rec


def _skip(args, reason: str, started: float) -> dict:
    """Write and return the ``status: skipped`` row of ``args.engine``, saying why."""
    print(f"{STAGE}: SKIPPED {args.tag}: {reason}")
    rec = _row(args, "skipped", reason, started)
    print(f"  wrote {write_result(args.model, args.tag, rec)}")
    return rec


def trtexec_cross_check(model: str, variant, in_name: str, rec: dict) -> dict | None:
    """trtexec's own GPU Compute Time from the engine's build log next to ours (same engine,
    trtexec's timing loop at its ``--optShapes`` batch).

    Returns:
        ``{"build_log", "trtexec_batch", "trtexec_gpu_compute_time", "trtexec_throughput_qps",
        "ratio_p50_to_trtexec_median"}`` or None when there is no build log.
    """
    if variant is None:
        return None
    log = engine_paths(model, variant.name)["log"]
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    perf = parse_performance_summary(text)
    shapes = parse_inference_shapes(text)["inputs"]
    gct = perf.get("gpu_compute_time") if perf else None
    tb = shapes.get(in_name, [None])[0]
    ours = None
    for key in ("latency", "latency_batch"):
        block = rec.get(key) or {}
        if block.get("batch") == tb and block.get("gpu_compute_ms"):
            ours = block["gpu_compute_ms"]
    return {"build_log": str(log), "trtexec_batch": tb, "trtexec_gpu_compute_time": gct,
            "trtexec_throughput_qps": perf.get("throughput_qps") if perf else None,
            "ratio_p50_to_trtexec_median": (ours["p50_ms"] / gct["median_ms"]
                                            if ours and gct and gct.get("median_ms") else None)}


def batch_invariance_check(runner, data, batch: int) -> dict:
    """The same images at batch 1 and at the accuracy pass's batch (deploykit.trt.plans.batch_invariance):
    max |difference| and top-1 agreement, with the known-issue note when they differ. Not
    applicable (``ok`` None) when the engine cannot run batch 1 or batch >= 2."""
    lo, hi = runner.batch_range
    n_batch = min(batch, hi) if hi else batch
    if lo > 1 or n_batch < 2:
        return {"ok": None, "reason": f"the engine accepts batch {lo}..{hi}: no batch-1 vs "
                                      "batch-N comparison"}
    n = min(len(data), max(2 * n_batch, 16), 128)
    res = batch_invariance(runner.infer, data.batch(np.arange(n)), n_batch)
    if not res["ok"]:
        print(f"{STAGE}: WARNING: batch-1 and batch-{n_batch} outputs differ (max |diff| "
              f"{res['max_abs_diff']:.3g}, top-1 agreement {res['top1_agreement']}): "
              f"{res['note']}", file=sys.stderr)
    return res


#: Flags that name one engine's files: refused with several --engine.
ONE_ENGINE_FLAGS = {"onnx": "--onnx", "precision": "--precision"}


def main(args) -> dict | list | None:
    """Evaluate each ``--engine`` and write its ``results/<model>/<tag>.json`` (skipped rows
    without TensorRT or CUDA). Several engines run one after another in this process, each as
    its one-engine command (:func:`deploykit.cli.run_script` of the arguments
    :func:`deploykit.cli.command_argv` writes back: its row records that command and reruns
    it); one that fails does not stop the others.

    Returns:
        the row (one engine), or the list of them (several; the stage's last lines are one per
        row written).
    Raises:
        UsageError: bad flags (not as many --tag as --engine, a tag twice, --onnx or
            --precision with several engines, an engine that is a folder, a tag no row may
            have: all checked before any engine runs). StageError: missing inputs, a plan the
            runtime refuses (with several engines: after the others, naming each engine that
            failed and why; any error of one engine's run counts so).
    """
    engines, tags = list(args.engine), list(args.tag)
    if len(engines) != len(tags):
        raise UsageError(f"{len(engines)} --engine but {len(tags)} --tag: give one --tag per "
                         "--engine, in the same order")
    if len(engines) == 1:
        one = argparse.Namespace(**vars(args))
        one.engine, one.tag = engines[0], tags[0]
        return _evaluate_one(one)
    twice = sorted({t for t in tags if tags.count(t) > 1})
    if twice:
        raise UsageError(f"--tag {' '.join(twice)} given twice: each engine's row needs a tag "
                         "of its own")
    said = [flag for dest, flag in ONE_ENGINE_FLAGS.items() if getattr(args, dest)]
    if said:
        raise UsageError(f"{' and '.join(said)} apply to one engine: give one --engine with "
                         "them")
    for engine, tag in zip(engines, tags):  # refused before any engine runs
        _check_flags(args, engine, tag)
    parser = get_args_parser()
    rows, failed = [], []
    for engine, tag in zip(engines, tags):
        # written whenever set: the environment a rerun starts in may give other defaults
        argv = command_argv(parser, args, keep=("model", "preprocess", "logits_output"),
                            engine=engine, tag=tag)
        try:
            rows.append(run_script(STAGE, argv))
        except Exception as e:  # noqa: BLE001 - TensorRT, CUDA, the file system: the next
            # engine still runs; the stage fails at the end, naming this one
            what = str(e) or type(e).__name__
            print(f"{STAGE}: FAILED {tag} ({engine}): "
                  + (f"{type(e).__name__}: {e}" if str(e) else what), file=sys.stderr)
            failed.append(f"{tag}: {what.splitlines()[0][:200]}")
    for rec in rows:  # the stage's last lines: one per row written (a skip said above)
        if rec["status"] == "skipped":  # lower case: run_all.sh shows each SKIPPED line once
            print(f"{rec['tag']}: skipped (why: above)")
        else:
            print(f"{rec['tag']}: " + ("" if rec["status"] == "ok" else
                                       f"{rec['status'].upper()}: ") + summary_line(rec))
    if failed:
        raise StageError(f"{len(failed)} of {len(engines)} engines failed; "
                         + ("the other rows are written" if rows else "no row was written")
                         + ":\n" + "\n".join(f"  {f}" for f in failed))
    return rows


def _check_flags(args, engine: Path, tag: str) -> None:
    """What one engine's command refuses before it reads anything: the tag, the counts, an
    engine path that is a folder.

    Raises:
        UsageError: naming the flag and the fix.
    """
    check_row_tag(args.model, tag, stage=STAGE)
    check_positive(args, "iters", "batch_size", "latency_batch", "limit")
    check_positive(args, "warmup", allow_zero=("warmup",))
    if Path(engine).is_dir():
        raise UsageError(f"--engine {engine} is a folder: give the .plan file")


def _evaluate_one(args) -> dict:
    """Evaluate one engine (``args.engine``, ``args.tag``: one each) and write
    ``results/<model>/<tag>.json`` (skipped rows without TensorRT or CUDA).

    Raises:
        UsageError: bad flags. StageError: missing inputs, a plan the runtime refuses.
    """
    started = time.time()
    _check_flags(args, args.engine, args.tag)
    check_writable(model_results(args.model))
    # one writer per folder, held until this process exits (a second writer is refused)
    lock_folders(model_artifacts(args.model), model_results(args.model))
    # The engine file is checked before TensorRT, so a wrong path is named on any machine and
    # writes no row; a variant that stage 6 did not build on purpose is reported as skipped.
    variant = variant_of_file(args.engine)
    if not Path(args.engine).exists():
        build_row = (model_results(args.model) / f"{variant.build_tag}.json"
                     if variant else None)
        row = load_json(build_row) if build_row is not None and build_row.exists() else {}
        if isinstance(row, dict) and row.get("status") not in (None, "ok"):
            # e.g. no TensorRT here, INT4 on TensorRT 8.x, the int4_cli_broken reproduction
            return _skip(args, f"engine not built by 6_build_engines.sh ({row.get('status')}: "
                         f"{row.get('reason')})", started)
        raise StageError(f"--engine {args.engine}: no such file (build it with "
                         "6_build_engines.sh, or check the path); no row written")
    try:
        import tensorrt as trt  # noqa: F401 - availability check
    except ImportError as e:
        return _skip(args, f"TensorRT Python package not importable ({e}); TensorRT is not "
                     "installed on this machine", started)
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return _skip(args, "no CUDA GPU visible to torch (TensorRT needs one)", started)

    spec = model_spec(args.model)
    # stage 6's build row of this engine (the engine exists: checked above)
    build_row = (model_results(args.model) / f"{variant.build_tag}.json"
                 if variant else None)
    build = load_json(build_row) if build_row is not None and build_row.exists() else {}
    build = build if isinstance(build, dict) else {}
    dla_core = build.get("dla_core") if build.get("status") == "ok" else None
    art = model_artifacts(args.model)
    if spec.classifier:
        if args.inputs:
            raise UsageError(f"--model {args.model} is an ImageNet classifier, judged on the "
                             "eval split; --inputs is for models with their own data")
        ref_path = require(ref_logits_path(args.model), REF_PRODUCER)
        data = classifier_data(spec, args.limit, ref_path)
    else:
        ref_path = ref_outputs_path(args.model)
        data = custom_data(ref_path, args.limit, args.inputs, args.model)

    # What the engine was built from (stage 6's build row, matched by the plan's hash): an
    # engine built from an ONNX made from another fp32.onnx is measured, said and recorded.
    source, stale, warn = check_source(args.model, args.engine, fp32_onnx_path(args.model))
    if warn:
        print(warn, file=sys.stderr)
    onnx_b = args.onnx or (art / "onnx" / variant.onnx_file if variant else args.engine)
    next_step = diff_command(args.model, fp32_onnx_path(args.model), onnx_b, _precision(args),
                             model_results(args.model) / f"layerwise_{args.tag}",
                             classifier=spec.classifier, engine=args.engine,
                             inputs=getattr(args, "inputs", None) or (
                                 ref_outputs_path(args.model) if not spec.classifier else None))
    with TrtRunner(args.engine, args.device, dla_core=dla_core) as r:
        if data.classifier:
            data.input_name = r.input_names[0]
            # the profile stage 6 built (and recorded) must hold the eval images
            fit_batch(r.profile_shapes[data.input_name], args.batch_size,
                      data.x_u8.shape[1:], what=f"engine {args.engine}")
        rec, _ = evaluate(
            r, data, stage=STAGE, precision=_precision(args), model=args.model, tag=args.tag,
            args=args, started=started, inputs=[args.engine, ref_path],
            batch_size=args.batch_size, latency_batch=args.latency_batch, warmup=args.warmup,
            iters=args.iters, write=False, next_step=next_step, engine=str(args.engine),
            variant=variant.name if variant else None,
            size_mb=file_size_mb(args.engine), reference=ref_path, evaluated=args.engine,
            source=source, stale_source=stale)
        layers = r.layer_info()
        rec["layer_info"] = layer_summary(layers)
        rec["layer_dtypes"] = layer_dtype_table(layers)
        rec["trtexec_cross_check"] = trtexec_cross_check(args.model, variant, r.input_names[0],
                                                         rec)
        rec["build_profile"] = build.get("profile")
        rec["dla_core"] = dla_core
        path = write_result(args.model, args.tag, rec, keep_good=rec["status"] == "ok")
        print(f"{summary_line(rec)}, reformat layers {layers['reformat_layers']} -> "
              f"{path}")
        if verdict_warning(rec):
            print(verdict_warning(rec), file=sys.stderr)
        diagnose(rec, "batch_invariance",
                 lambda: batch_invariance_check(r, data, rec["batch_size"] or 1))
    if args.layerwise:
        diagnose(rec, "layerwise", lambda: layerwise_engine(args, variant))
    return rec


def layerwise_engine(args, variant) -> dict:
    """Layer-wise comparison of the engine's ONNX through TensorRT against ORT CPU FP32.

    Writes ``results/<model>/layerwise_<tag>/layerwise.{json,md,png}``, prints the first
    divergent layer with the rebuild commands that exist in the installed TensorRT, and returns
    a summary for the row.
    """

    art = model_artifacts(args.model)
    ref_onnx = require(fp32_onnx_path(args.model), "2_export_onnx.py")
    onnx_b = args.onnx or (art / "onnx" / variant.onnx_file if variant else None)
    if onnx_b is None:
        raise UsageError("--layerwise: give --onnx (cannot tell the engine's ONNX from its name)")
    require(onnx_b, "the stage that wrote the engine's ONNX")
    feed = load_feed(None, args.model, args.layerwise_images, ref_onnx)
    prec = _precision(args).lower()
    out_dir = model_results(args.model) / f"layerwise_{args.tag}"
    res = run_layer_diff(
        ref_onnx, onnx_b, feed, b_engine=args.engine, precision=prec,
        trt_build={"fp16": prec == "fp16", "int8": prec.startswith("int8")}, out_dir=out_dir)
    print(render_table(res, max_rows=40))
    return {"out_dir": str(out_dir), "first_divergent": res.get("first_divergent"),
            "remedies": res.get("remedies")}


if __name__ == "__main__":
    cli(get_args_parser, main)
