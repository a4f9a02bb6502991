#!/usr/bin/env python3
"""Stage 5b: INT4 weight-only blocked quantization of Gemm/MatMul through ModelOpt's Python API,
with blocks along the reduction axis K of every quantized weight, a block size that divides
every K, every block axis verified, then ORT evaluation.

Reads:  ``artifacts/<model>/onnx/fp32.onnx`` (2_export_onnx.py), ``artifacts/<model>/calib.npz``
        (4_make_calib.py; awq_clip needs it, rtn_dq does not).
Writes: ``artifacts/<model>/onnx/int4.onnx``, ``artifacts/<model>/onnx/int4.quant.log``,
        ``results/<model>/quant_int4.json`` (block size, K dims, layout changes, per-weight
        verification, calibration record, health check, wall time, warnings); with evaluation,
        ``results/<model>/ort_int4.json`` via 3_onnx_eval.py.
Rerun:  ``python 5b_quantize_int4.py --model efficientnet_lite0``

Block axis: ModelOpt 0.47.0's INT4 path assumes MatMul's ``[K, N]`` weight layout and blocks
along axis 0 (modelopt/onnx/quantization/int4.py writes ``axis=0``). For a Gemm with
``transB=1`` (``[N, K]``, how ``torch.nn.Linear`` exports) that is the output axis: ``rtn_dq``
then quantizes blocks of output channels (small channels lose their weights) and ``awq_clip``
lays the scale out along K but writes ``axis=0`` (ORT: "x_scale must be ceil(Di/block_size) on
the quantize axis"; ``5_quantize.sh int4_cli_broken`` reproduces it). This stage therefore hands
ModelOpt every Gemm weight as ``[K, N]`` (``transB=0``, the same function), so axis 0 is K for
every quantized weight, then verifies each blocked DequantizeLinear: its axis is the reduction
axis of its consumer, its scale fits that axis, and the dequantized weight matches the float
weight per output channel (``deploykit.quant.health``). An ``axis`` attribute that disagrees with a scale laid
out along K is repaired; anything else is refused (nothing is written).
"""
from __future__ import annotations

import argparse
import os
import shlex
import time
from pathlib import Path
from deploykit.layout import calib_path, fp32_onnx_path, variant_onnx_path
from deploykit.io import check_writable, load_npz
from deploykit.lock import lock_folders
from deploykit.cli import add_shared_args, cli, run_script, stage_parser
from deploykit.io import require
from deploykit.errors import StageError
from deploykit.io import atomic_path, file_size_mb, sha256_file, write_json
from deploykit.layout import model_artifacts, model_results
from deploykit.onnx.graph import load_onnx
from deploykit.quant.calibration import (
    calibration_plan,
    calibration_reference,
    validate_calibration,
)
from deploykit.quant.inspect import inspect_model
from deploykit.quant.record import calibration_summary, check_record
from deploykit.results import file_sha256, provenance, rerun_command, source_block
from deploykit.quant.quantize import health_check, read_calibration
from deploykit.quant.int4 import (
    check_blocked_dq,
    DEFAULT_CANDIDATES,
    stage4_seed,
    choose_block_size,
    layout_for_int4,
    preload_modelopt,
    quantized_k_dims,
    repair_axes,
    run_modelopt,
    verify_blocks,
)


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    add_shared_args(p, "model")
    p.add_argument("--onnx", type=Path, default=None,
                   help="float model (default: artifacts/<model>/onnx/fp32.onnx)")
    p.add_argument("--output", type=Path, default=None,
                   help="output (default: artifacts/<model>/onnx/int4.onnx)")
    p.add_argument("--calib-inputs", "--calib", dest="calib", type=Path, default=None,
                   metavar="NPZ",
                   help="calibration npz keyed by input name (default: "
                        "artifacts/<model>/calib.npz, stage 4's)")
    p.add_argument("--block-size", type=int, default=None,
                   help="override the automatic choice (must divide every quantized K)")
    p.add_argument("--block-candidates", type=int, nargs="+", default=list(DEFAULT_CANDIDATES),
                   help="block sizes tried in order; the first dividing every K wins")
    p.add_argument("--calibration-method", choices=("awq_clip", "rtn_dq"), default="awq_clip",
                   help="ModelOpt INT4 method: awq_clip (needs calibration data) or rtn_dq")
    p.add_argument("--eps", default=os.environ.get("EPS", "cpu"),
                   help="calibration execution provider for ModelOpt (default from $EPS)")
    p.add_argument("--no-repair", action="store_true",
                   help="keep ModelOpt's axis as written (reproduces the ORT failure; the file "
                        "is still verified and refused if wrong)")
    p.add_argument("--keep-layout", action="store_true",
                   help="hand ModelOpt the Gemm weights as they are (transB=1 stays [N, K]); "
                        "the result is verified and refused if a block axis is wrong")
    p.add_argument("--no-stats-check", action="store_true",
                   help="do not compare the calibration data with the evaluation data (recorded)")
    p.add_argument("--no-eval", action="store_true", help="skip 3_onnx_eval.py")
    p.add_argument("--eval-ep", default="cpu", help="EP for the evaluation (blocked "
                   "DequantizeLinear runs on ORT's CPU EP)")
    add_shared_args(p, "limit")
    return p


def main(args: argparse.Namespace) -> dict:
    """Quantize, lay out, repair and verify; write ``int4.onnx`` and ``quant_int4.json``.

    Raises:
        UsageError: bad flags. StageError: missing inputs, calibration data refused, ModelOpt
            failure, or a quantized weight that cannot be made right (nothing written then).
    """
    started = time.time()
    import onnx

    src = require(Path(args.onnx or fp32_onnx_path(args.model)), "2_export_onnx.py")
    out = Path(args.output or variant_onnx_path(args.model, "int4"))
    check_writable(out.parent, model_results(args.model))
    # one writer per folder, held until this process exits
    lock_folders(model_artifacts(args.model), out.parent, model_results(args.model))
    calib, calib_rec, data = None, None, None
    src_sha = file_sha256(src)  # before it is read: the record names the file that was used
    src_model = load_onnx(src)
    ks = quantized_k_dims(src_model)
    try:
        block = choose_block_size([k["k"] for k in ks], args.block_size, args.block_candidates)
    except StageError as e:
        if args.block_size is not None:
            raise
        # INT4 weight-only quantization does not apply to this model's shapes: a skip, not a
        # failure of the pipeline (a record says why; stage 3 is not run on a file not made)
        record = {"stage": "5b_quantize_int4", "model": args.model, "variant": "int4",
                  "status": "skipped", "reason": f"int4 does not apply: {e}",
                  "output": str(out), "k_dims": sorted({k["k"] for k in ks}),
                  "provenance": provenance(args, [src], started)}
        write_json(model_results(args.model) / "quant_int4.json", record)
        print(f"SKIPPED: {record['reason']} (a block size of your own: --block-size N)")
        return record
    if args.calibration_method == "awq_clip":
        calib = require(Path(args.calib or calib_path(args.model)), "4_make_calib.py")
        # read once: the arrays ModelOpt gets, the health check runs and the hash recorded all
        # come from these bytes (a calib.npz rewritten meanwhile cannot make the record lie)
        data, _, calib_sha = read_calibration(calib)
        ref, ref_src = (None, "skipped (--no-stats-check)") if args.no_stats_check else \
            calibration_reference(args.model, src)
        calib_rec = validate_calibration(src, data, ref, source=str(calib),
                                         reference_source=ref_src)
        calib_rec["plan"] = calibration_plan(src, data, "all")
        calib_rec.update(calib=str(calib), sha256=calib_sha)
    print(f"int4: {len(ks)} Gemm/MatMul, K = {sorted({k['k'] for k in ks})} -> block {block}"
          + (" (--block-size)" if args.block_size else ""))
    float_model, laid_out = (src_model, []) if args.keep_layout else layout_for_int4(src_model)
    for r in laid_out:
        print(f"  {r['node']}: weight handed to ModelOpt as [K, N] {r['shape']} (transB=0), so "
              "its blocks run along K")
    log = out.with_name(out.stem + ".quant.log")
    log.unlink(missing_ok=True)
    preload_modelopt()  # the quantization time below is ModelOpt's run, not its import
    t0 = time.time()
    print(f"int4: ModelOpt {args.calibration_method} on "
          f"{len(next(iter(data.values()))) if data else 0} calibration samples "
          f"(the weights of {len(ks)} Gemm/MatMul; bounded by ModelOpt's ORT calibration runs)",
          flush=True)
    with atomic_path(out) as tmp:
        warnings_kept = run_modelopt(src if args.keep_layout else float_model, tmp, log, data,
                                     args.calibration_method, block, args.eps,
                                     calib_rec["plan"]["calibration_shapes"] if calib_rec else None)
        quant_wall = time.time() - t0
        model = onnx.load(str(tmp))
        before = check_blocked_dq(model)
        fixed = [] if args.no_repair else repair_axes(model)
        problems, weights = verify_blocks(model, float_model)
        if problems:
            lines = "\n".join(f"  [{p['kind']}] {p['message']}" for p in problems[:8])
            raise StageError(
                f"INT4 result refused, {out} not written: {len(problems)} quantized weight "
                f"problem(s):\n{lines}\nfix: " + problems[0]["fix"]
                + ("" if not args.keep_layout else " (drop --keep-layout)"))
        if fixed:
            onnx.save(model, str(tmp))
        after = check_blocked_dq(model)
    for r in fixed:
        print(f"  repaired {r['name']}: axis {r['axis']} -> {r['new_axis']} (x {r['x_shape']}, "
              f"scale {r['scale_shape']}, block {r['block_size']})")
    for w in weights:
        print(f"  verified {w['node']}: {w.get('status')}, per-channel weight error max "
              f"{w.get('rel_err_max', float('nan')):.3f} median "
              f"{w.get('rel_err_median', float('nan')):.3f} (tolerance {w.get('tolerance')})")
    untouched = [r["name"] for r in before if r["status"] == "ok"]
    record = {"stage": "5b_quantize_int4", "model": args.model, "variant": "int4",
              "status": "ok", "output": str(out), "block_size": block,
              "block_size_source": "override" if args.block_size else "auto",
              "k_dims": ks, "calibration_method": args.calibration_method,
              "calibration_eps": args.eps, "quant_wall_time_s": round(quant_wall, 3),
              "layout_kn": laid_out, "blocked_dq_before": before, "blocked_dq_after": after,
              "repaired": fixed, "left_untouched": untouched, "weights_verified": weights,
              "warnings": warnings_kept, "log": str(log), "size_mb": file_size_mb(out)}
    if calib_rec:
        record["calibration"] = calibration_summary(
            dict(calib_rec, order_seed=stage4_seed(args.model, calib_rec["sha256"])))
    rep = inspect_model(model)
    rep.pop("_helper", None)
    record["inspect"] = rep
    record["check"] = health_check(out, {"src": src, "fp32_model": load_onnx(src),
                                         "calib": calib, "calib_data": data})
    record["provenance"] = provenance(args, [out], started)
    record["provenance"]["input_sha256"].update(
        {str(src): src_sha, **({str(calib): calib_sha} if calib else {})})
    record["source"] = source_block(
        out, [rerun_command(record["provenance"])],
        fp32={"path": str(src.absolute()), "sha256": src_sha},
        calibration={"path": str(calib.absolute()), "sha256": calib_sha} if calib else None)
    record["wall_time_s"] = record["provenance"]["wall_time_s"]
    write_json(model_results(args.model) / "quant_int4.json", record)
    print(f"int4: {out} ({record['size_mb']:.2f} MB), quantization {quant_wall:.1f}s, "
          f"{len(laid_out)} weight(s) laid out as [K, N], {len(fixed)} axis repair(s), "
          f"{len(weights)} weight(s) verified; {record['check'].get('summary')}")
    if not args.no_eval:
        argv = ["--onnx", str(out), "--tag", "ort_int4", "--model", args.model,
                "--ep", args.eval_ep] + (["--limit", str(args.limit)] if args.limit else [])
        print("int4: " + shlex.join(["python", "3_onnx_eval.py", *argv]))  # the same run
        run_script("3_onnx_eval", argv)  # in this process (its row records that command)
    return record


if __name__ == "__main__":
    cli(get_args_parser, main)
