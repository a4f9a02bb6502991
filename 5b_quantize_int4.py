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
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from deploykit.layout import calib_path, fp32_onnx_path, variant_onnx_path
from deploykit.io import load_npz
from deploykit.cli import add_shared_args, cli, require, stage_parser
from deploykit.errors import StageError, UsageError
from deploykit.io import atomic_path, file_size_mb, sha256_file, write_json
from deploykit.layout import ROOT, model_results
from deploykit.onnx.graph import attr, constants, consumers, load_onnx
from deploykit.quant.calibration import (
    calibration_plan,
    calibration_reference,
    validate_calibration,
)
from deploykit.quant.health import check_against_float, check_weights
from deploykit.quant.inspect import inspect_model
from deploykit.quant.int4 import check_blocked_dq
from deploykit.quant.modelopt import log_warnings
from deploykit.quant.qdq import reduction_axis, weight_consumers
from deploykit.quant.record import calibration_summary, check_record
from deploykit.results import provenance


DEFAULT_CANDIDATES = (128, 64, 32, 16)


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    add_shared_args(p, "model")
    p.add_argument("--onnx", type=Path, default=None,
                   help="float model (default: artifacts/<model>/onnx/fp32.onnx)")
    p.add_argument("--output", type=Path, default=None,
                   help="output (default: artifacts/<model>/onnx/int4.onnx)")
    p.add_argument("--calib", type=Path, default=None,
                   help="calibration npz (default: artifacts/<model>/calib.npz)")
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


def quantized_k_dims(model) -> list[dict]:
    """The Gemm/MatMul nodes ModelOpt's INT4 path quantizes (constant 2-D weight) with their
    reduction dimension K.

    Returns:
        ``[{"node", "op", "weight", "shape", "k"}]``; for Gemm ``K = shape[1]`` if ``transB``
        else ``shape[0]``; for MatMul ``K = shape[-2]``.
    """
    consts = constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type not in ("Gemm", "MatMul") or len(n.input) < 2 or n.input[1] not in consts:
            continue
        shape = consts[n.input[1]].shape
        if len(shape) < 2:
            continue
        if n.op_type == "Gemm":
            k = shape[1] if int(attr(n, "transB", 0)) else shape[0]
        else:
            k = shape[-2]
        out.append({"node": n.name, "op": n.op_type, "weight": n.input[1],
                    "shape": list(shape), "k": int(k)})
    return out


def choose_block_size(ks: list[int], override: int | None = None,
                      candidates=DEFAULT_CANDIDATES) -> int:
    """Block size for INT4: ``override`` if given (checked), else the first of ``candidates``
    that divides every K.

    Raises:
        UsageError: ``override`` is not positive or does not divide every K.
        StageError: no K at all, or no candidate divides every K (message lists the K values).
    """
    if not ks:
        raise StageError("no Gemm/MatMul with a constant weight: nothing to quantize "
                         "to INT4 (ModelOpt's ONNX INT4 path is Gemm/MatMul only)")
    if override is not None:
        if override <= 0:
            raise UsageError(f"--block-size {override}: must be > 0")
        bad = sorted({k for k in ks if k % override})
        if bad:
            raise UsageError(f"--block-size {override} does not divide K = {bad}")
        return override
    for b in candidates:
        if b > 0 and all(k % b == 0 for k in ks):
            return int(b)
    raise StageError(f"no block size in {list(candidates)} divides every K "
                     f"({sorted(set(ks))}): pass --block-size or --block-candidates")


def layout_for_int4(model) -> tuple[object, list[dict]]:
    """Copy of ``model`` whose Gemm weights are ``[K, N]``: every Gemm with ``transB=1`` and a
    constant 2-D weight gets the transposed weight (new initializer ``<name>_KN``) and
    ``transB=0`` (the same function). ModelOpt's INT4 path blocks along axis 0, which is then K
    for every Gemm and MatMul weight.

    Returns:
        ``(new model, [{"node", "weight", "new_weight", "shape"}])``.
    """
    import copy

    from onnx import helper, numpy_helper

    model = copy.deepcopy(model)
    consts = constants(model)
    inits = {i.name for i in model.graph.initializer}
    changed = []
    for n in model.graph.node:
        if (n.op_type != "Gemm" or len(n.input) < 2 or n.input[1] not in inits
                or not int(attr(n, "transB", 0))):
            continue
        w = consts[n.input[1]]
        if w.ndim != 2:
            continue
        new = f"{n.input[1]}_KN"
        if new not in inits:
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), new))
            inits.add(new)
        changed.append({"node": n.name, "weight": n.input[1], "new_weight": new,
                        "shape": list(w.T.shape)})
        n.input[1] = new
        keep = [a for a in n.attribute if a.name != "transB"]
        del n.attribute[:]
        n.attribute.extend(keep + [helper.make_attribute("transB", 0)])
    used = {i for n in model.graph.node for i in n.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return model, changed


VERIFY_KINDS = ("block_axis", "block_scale_shape", "block_opset", "weight_error", "dead_channels")


def verify_blocks(q_model, float_model) -> tuple[list[dict], list[dict]]:
    """Every quantized weight checked: blocked DequantizeLinear axis = reduction axis of its
    consumer, scale shape fits, opset defines ``block_size``, dequantized weight within the
    bit width's tolerance of the float weight per output channel (:mod:`deploykit.quant.health`).

    Returns:
        ``(problems [finding dicts of the kinds in VERIFY_KINDS], per-weight rows)``.
    """

    consts = constants(q_model)
    problems = [f.as_dict() for f in check_weights(q_model, consts)
                if f.kind in VERIFY_KINDS]
    found, rows = check_against_float(q_model, float_model, consts)
    problems += [f.as_dict() for f in found]
    return problems, rows


def repair_axes(model) -> list[dict]:
    """Set ``axis`` of blocked DequantizeLinear nodes to the reduction axis of their consumer
    where the scale is laid out along that axis and ``axis`` says otherwise (ModelOpt's
    awq_clip on ``[N, K]`` Gemm weights). Other inconsistencies are left for
    :func:`verify_blocks` to refuse.

    Returns:
        the :func:`qdq_tools.check_blocked_dq` records of the repaired nodes (``new_axis``).
    """
    from onnx import helper

    cons = consumers(model)
    fixed = []
    nodes = {n.name: n for n in model.graph.node}
    for r in check_blocked_dq(model):
        if r["status"] != "mismatch":
            continue
        dq = nodes[r["name"]]
        users = weight_consumers(dq.output[0], cons)
        if not users:
            continue
        node, pos = users[0]
        red = reduction_axis(node, len(r["x_shape"]), pos)
        if red is None or red not in r["valid_axes"]:
            continue
        keep = [a for a in dq.attribute if a.name != "axis"]
        del dq.attribute[:]
        dq.attribute.extend(keep + [helper.make_attribute("axis", red)])
        fixed.append(dict(r, new_axis=red))
    return fixed


def run_modelopt(src: Path, dst: Path, log: Path, calib: Path | None, method: str, block: int,
                 eps: str, calibration_shapes: str | None = None) -> list[str]:
    """``modelopt.onnx.quantization.quantize`` (INT4) with its log captured in ``log``.

    Returns:
        the ModelOpt warnings worth keeping.
    Raises:
        StageError: ModelOpt raised (message carries the log tail).
    """
    import shutil
    import tempfile

    from modelopt.onnx.quantization import quantize

    # ModelOpt 0.47.0 rewrites the file given as onnx_path: hand it a private copy.
    work = Path(tempfile.mkdtemp(prefix="5b_int4_"))
    if isinstance(src, Path):
        src = Path(shutil.copy2(src, work / "fp32.onnx"))
    else:  # a ModelProto (the [K, N] layout)
        import onnx

        onnx.save(src, str(work / "fp32.onnx"))
        src = work / "fp32.onnx"
    kwargs = {"onnx_path": str(src), "quantize_mode": "int4", "calibration_method": method,
              "calibration_eps": [eps], "block_size": block, "output_path": str(dst),
              "log_file": str(log), "log_level": "INFO"}
    if calib is not None:
        with np.load(calib) as z:
            kwargs["calibration_data"] = {k: z[k] for k in z.files}
        if calibration_shapes:
            kwargs["calibration_shapes"] = calibration_shapes
    try:
        quantize(**kwargs)
    except Exception as e:  # noqa: BLE001 - ModelOpt raises many types
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        raise StageError(f"ModelOpt INT4 failed: {type(e).__name__}: {e}\n"
                         + "\n".join(tail)) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for h in list(logging.getLogger("modelopt").handlers):
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == log.resolve():
                h.close()
                logging.getLogger("modelopt").removeHandler(h)
    return log_warnings(log) if log.exists() else []


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
    calib, calib_rec = None, None
    src_model = load_onnx(src)
    ks = quantized_k_dims(src_model)
    block = choose_block_size([k["k"] for k in ks], args.block_size, args.block_candidates)
    if args.calibration_method == "awq_clip":
        calib = require(Path(args.calib or calib_path(args.model)), "4_make_calib.py")
        data = load_npz(calib, None, "4_make_calib.py")
        ref, ref_src = (None, "skipped (--no-stats-check)") if args.no_stats_check else \
            calibration_reference(args.model, src)
        calib_rec = validate_calibration(src, data, ref, source=str(calib),
                                         reference_source=ref_src)
        calib_rec["plan"] = calibration_plan(src, data, "all")
        calib_rec.update(calib=str(calib), sha256=sha256_file(calib))
    print(f"int4: {len(ks)} Gemm/MatMul, K = {sorted({k['k'] for k in ks})} -> block {block}"
          + (" (--block-size)" if args.block_size else ""))
    float_model, laid_out = (src_model, []) if args.keep_layout else layout_for_int4(src_model)
    for r in laid_out:
        print(f"  {r['node']}: weight handed to ModelOpt as [K, N] {r['shape']} (transB=0), so "
              "its blocks run along K")
    log = out.with_name(out.stem + ".quant.log")
    log.unlink(missing_ok=True)
    t0 = time.time()
    with atomic_path(out) as tmp:
        warnings_kept = run_modelopt(src if args.keep_layout else float_model, tmp, log, calib,
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
            dict(calib_rec, order_seed=_stage4_seed(args.model, calib_rec["sha256"])))
    rep = inspect_model(model)
    rep.pop("_helper", None)
    record["inspect"] = rep
    record["check"] = check_record(out, src, calib)
    record["provenance"] = provenance(args, [src, out] + ([calib] if calib else []),
                                      started)
    record["wall_time_s"] = record["provenance"]["wall_time_s"]
    write_json(model_results(args.model) / "quant_int4.json", record)
    print(f"int4: {out} ({record['size_mb']:.2f} MB), quantization {quant_wall:.1f}s, "
          f"{len(laid_out)} weight(s) laid out as [K, N], {len(fixed)} axis repair(s), "
          f"{len(weights)} weight(s) verified; {record['check'].get('summary')}")
    if not args.no_eval:
        cmd = [sys.executable, str(ROOT / "3_onnx_eval.py"), "--onnx", str(out),
               "--tag", "ort_int4", "--model", args.model, "--ep", args.eval_ep]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        print("int4: " + " ".join(cmd[1:]))
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc:
            raise StageError(f"3_onnx_eval.py failed on {out} (exit {rc})")
    return record


def _stage4_seed(model: str, sha: str) -> int | None:
    """Order seed stage 4 recorded for the npz with this sha256 (None if another npz)."""
    import json

    path = model_results(model) / "calib.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec.get("order_seed") if rec.get("sha256") == sha else None


if __name__ == "__main__":
    cli(get_args_parser, main)
