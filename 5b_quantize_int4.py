#!/usr/bin/env python3
"""Stage 5b: INT4 weight-only blocked quantization of Gemm/MatMul through ModelOpt's Python API,
with a block size that divides every quantized K, the DequantizeLinear axis repair where (and
only where) the scale layout and ``axis`` disagree, then ORT evaluation.

Reads:  ``artifacts/<model>/onnx/fp32.onnx`` (2_export_onnx.py), ``artifacts/<model>/calib.npz``
        (4_make_calib.py; awq_clip needs it, rtn_dq does not).
Writes: ``artifacts/<model>/onnx/int4.onnx``, ``artifacts/<model>/onnx/int4.quant.log``,
        ``results/<model>/quant_int4.json`` (block size, K dims, repairs, wall time, warnings);
        with evaluation, ``results/<model>/ort_int4.json`` via 3_onnx_eval.py.
Rerun:  ``python 5b_quantize_int4.py --model efficientnet_lite0``

Why the repair: ModelOpt 0.47.0 writes ``axis=0`` on the blocked DequantizeLinear of a Gemm
weight with ``transB=1`` while laying the scale out along axis 1 (``[N, K/block]``); ONNX Runtime
rejects the node at run time ("x_scale must be ceil(Di/block_size) on the quantize axis").
``5_quantize.sh int4_cli_broken`` reproduces the unrepaired model. Every repaired node is
verified: its weights dequantized with the new axis must match the float weights (cosine).
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

import common
import onnx_graph
import qdq_tools

DEFAULT_CANDIDATES = (128, 64, 32, 16)


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__)
    common.add_shared_args(p, "model")
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
                   help="keep ModelOpt's axis as written (reproduces the ORT failure)")
    p.add_argument("--no-eval", action="store_true", help="skip 3_onnx_eval.py")
    p.add_argument("--eval-ep", default="cpu", help="EP for the evaluation (blocked "
                   "DequantizeLinear runs on ORT's CPU EP)")
    common.add_shared_args(p, "limit")
    return p


def quantized_k_dims(model) -> list[dict]:
    """The Gemm/MatMul nodes ModelOpt's INT4 path quantizes (constant 2-D weight) with their
    reduction dimension K.

    Returns:
        ``[{"node", "op", "weight", "shape", "k"}]``; for Gemm ``K = shape[1]`` if ``transB``
        else ``shape[0]``; for MatMul ``K = shape[-2]``.
    """
    consts = onnx_graph.constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type not in ("Gemm", "MatMul") or len(n.input) < 2 or n.input[1] not in consts:
            continue
        shape = consts[n.input[1]].shape
        if len(shape) < 2:
            continue
        if n.op_type == "Gemm":
            k = shape[1] if int(onnx_graph.attr(n, "transB", 0)) else shape[0]
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
        raise common.StageError("no Gemm/MatMul with a constant weight: nothing to quantize "
                                "to INT4 (ModelOpt's ONNX INT4 path is Gemm/MatMul only)")
    if override is not None:
        if override <= 0:
            raise common.UsageError(f"--block-size {override}: must be > 0")
        bad = sorted({k for k in ks if k % override})
        if bad:
            raise common.UsageError(f"--block-size {override} does not divide K = {bad}")
        return override
    for b in candidates:
        if b > 0 and all(k % b == 0 for k in ks):
            return int(b)
    raise common.StageError(f"no block size in {list(candidates)} divides every K "
                            f"({sorted(set(ks))}): pass --block-size or --block-candidates")


def verify_repairs(model, fixed: list[dict]) -> list[dict]:
    """Sanity check of each repaired node on its own data: dequantize with the new axis and
    record whether the result is finite and the median over blocks of max |q - zp|
    (``block_qmax_median``: about 7 for symmetric INT4 max-scaling when blocks and scales
    belong together). The decisive check against the float weights is :func:`weight_cosine`."""
    consts = onnx_graph.constants(model)
    nodes = {n.name: n for n in model.graph.node}
    for rec in fixed:
        n = nodes[rec["name"]]
        q = consts[n.input[0]].astype(np.int32)
        s = consts[n.input[1]].astype(np.float64)
        zp = consts.get(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        axis, block = rec["new_axis"], rec["block_size"]
        w = qdq_tools.dequantize_blocked(q, s, axis, block, zp)
        rec["dequantized_finite"] = bool(np.isfinite(w).all())
        # Per block, the largest |q| should reach ~7 (symmetric INT4 max-scaling) when the scale
        # belongs to that block; with the wrong axis the blocks and scales are mismatched.
        qa = np.abs(q - (0 if zp is None else np.repeat(zp.astype(np.int32), block, axis=axis)
                         .take(np.arange(q.shape[axis]), axis=axis)))
        pad = (-q.shape[axis]) % block
        if pad:
            widths = [(0, 0)] * q.ndim
            widths[axis] = (0, pad)
            qa = np.pad(qa, widths)
        qa = np.moveaxis(qa, axis, 0)
        blocks = qa.reshape(qa.shape[0] // block, block, *qa.shape[1:]).max(axis=1)
        rec["block_qmax_median"] = float(np.median(blocks))
    return fixed


def weight_cosine(src_model, q_model, fixed: list[dict]) -> None:
    """Add ``cosine_vs_float`` to each repaired record: the dequantized INT4 weight against the
    float weight of the same Gemm/MatMul in the source model (the decisive check that the new
    axis is the one the data were quantized on)."""
    src = onnx_graph.constants(src_model)
    qc = onnx_graph.constants(q_model)
    cons = onnx_graph.consumers(q_model)
    src_nodes = {n.name: n for n in src_model.graph.node}
    qnodes = {n.name: n for n in q_model.graph.node}
    for rec in fixed:
        dq = qnodes[rec["name"]]
        users = cons.get(dq.output[0], [])
        rec["cosine_vs_float"] = None
        if not users or users[0].name not in src_nodes:
            continue
        wf = src.get(src_nodes[users[0].name].input[1])
        zp = qc.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        wq = qdq_tools.dequantize_blocked(qc[dq.input[0]], qc[dq.input[1]], rec["new_axis"],
                                          rec["block_size"], zp)
        if wf is None or wf.shape != wq.shape:
            continue
        rec["cosine_vs_float"] = float(common.cosine_rows(wf.ravel(), wq.ravel())[0])


def run_modelopt(src: Path, dst: Path, log: Path, calib: Path | None, method: str, block: int,
                 eps: str) -> list[str]:
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
    src = Path(shutil.copy2(src, work / "fp32.onnx"))
    kwargs = {"onnx_path": str(src), "quantize_mode": "int4", "calibration_method": method,
              "calibration_eps": [eps], "block_size": block, "output_path": str(dst),
              "log_file": str(log), "log_level": "INFO"}
    if calib is not None:
        with np.load(calib) as z:
            kwargs["calibration_data"] = {k: z[k] for k in z.files}
    try:
        quantize(**kwargs)
    except Exception as e:  # noqa: BLE001 - ModelOpt raises many types
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        raise common.StageError(f"ModelOpt INT4 failed: {type(e).__name__}: {e}\n"
                                + "\n".join(tail)) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for h in list(logging.getLogger("modelopt").handlers):
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == log.resolve():
                h.close()
                logging.getLogger("modelopt").removeHandler(h)
    return qdq_tools.log_warnings(log) if log.exists() else []


def main(args: argparse.Namespace) -> dict:
    started = time.time()
    import onnx

    onnx_dir = common.model_artifacts(args.model) / "onnx"
    src = common.require(Path(args.onnx or onnx_dir / "fp32.onnx"), "2_export_onnx.py")
    out = Path(args.output or onnx_dir / "int4.onnx")
    calib = None
    if args.calibration_method == "awq_clip":
        calib = common.require(Path(args.calib or common.model_artifacts(args.model)
                                    / "calib.npz"), "4_make_calib.py")
    src_model = onnx_graph.load(src)
    ks = quantized_k_dims(src_model)
    block = choose_block_size([k["k"] for k in ks], args.block_size, args.block_candidates)
    print(f"int4: {len(ks)} Gemm/MatMul, K = {sorted({k['k'] for k in ks})} -> block {block}"
          + (" (--block-size)" if args.block_size else ""))
    log = out.with_name(out.stem + ".quant.log")
    log.unlink(missing_ok=True)
    t0 = time.time()
    with common.atomic_path(out) as tmp:
        warnings_kept = run_modelopt(src, tmp, log, calib, args.calibration_method, block,
                                     args.eps)
        quant_wall = time.time() - t0
        model = onnx.load(str(tmp))
        before = qdq_tools.check_blocked_dq(model)
        fixed = []
        if not args.no_repair:
            model, fixed = qdq_tools.fix_int4_axis(model)
            verify_repairs(model, fixed)
            weight_cosine(src_model, model, fixed)
            bad = [r for r in fixed if r.get("cosine_vs_float") is not None
                   and r["cosine_vs_float"] < 0.95]
            if bad:
                raise common.StageError(f"axis repair of {bad[0]['name']} gives weights with "
                                        f"cosine {bad[0]['cosine_vs_float']:.3f} to the float "
                                        "weights: the data layout is not the scale's; not saved")
            onnx.save(model, str(tmp))
        after = qdq_tools.check_blocked_dq(model)
    for r in fixed:
        print(f"  repaired {r['name']}: axis {r['axis']} -> {r['new_axis']} (x {r['x_shape']}, "
              f"scale {r['scale_shape']}, block {r['block_size']}), weight cosine vs float "
              f"{r.get('cosine_vs_float')}")
    untouched = [r["name"] for r in before if r["status"] == "ok"]
    record = {"stage": "5b_quantize_int4", "model": args.model, "variant": "int4",
              "status": "ok", "output": str(out), "block_size": block,
              "block_size_source": "override" if args.block_size else "auto",
              "k_dims": ks, "calibration_method": args.calibration_method,
              "calibration_eps": args.eps, "quant_wall_time_s": round(quant_wall, 3),
              "blocked_dq_before": before, "blocked_dq_after": after, "repaired": fixed,
              "left_untouched": untouched, "warnings": warnings_kept, "log": str(log),
              "size_mb": common.file_size_mb(out)}
    rep = qdq_tools.inspect_model(model)
    rep.pop("_helper", None)
    record["inspect"] = rep
    record["provenance"] = common.provenance(args, [src, out] + ([calib] if calib else []),
                                             started)
    record["wall_time_s"] = record["provenance"]["wall_time_s"]
    common.write_json(common.model_results(args.model) / "quant_int4.json", record)
    print(f"int4: {out} ({record['size_mb']:.2f} MB), quantization {quant_wall:.1f}s, "
          f"{len(fixed)} axis repair(s)")
    if not args.no_eval:
        cmd = [sys.executable, str(common.ROOT / "3_onnx_eval.py"), "--onnx", str(out),
               "--tag", "ort_int4", "--model", args.model, "--ep", args.eval_ep]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        print("int4: " + " ".join(cmd[1:]))
        rc = subprocess.run(cmd, cwd=common.ROOT).returncode
        if rc:
            raise common.StageError(f"3_onnx_eval.py failed on {out} (exit {rc})")
    return record


if __name__ == "__main__":
    common.cli(get_args_parser, main)
