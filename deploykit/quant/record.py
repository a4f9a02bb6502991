"""The stage-5 quant record (``results/<model>/quant_<variant>.json``) and the health-check run
that goes into it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from deploykit.errors import StageError
from deploykit.io import file_size_mb, write_json
from deploykit.layout import model_results
from deploykit.onnx.graph import load_onnx
from deploykit.io import load_npz
from deploykit.quant.health import check_model, summary_line
from deploykit.quant.inspect import inspect_model
from deploykit.quant.macs import mac_summary
from deploykit.quant.modelopt_log import log_warnings, ort_smoke
from deploykit.results import provenance


def run_check(onnx_path: Path | str, fp32: Path | str | None = None,
              calib: Path | str | None = None, calib_limit: int = 32, model=None) -> dict:
    """:func:`deploykit.quant.health.check_model` on files (see ``qdq_tools.py check --help``);
    ``model``: ``onnx_path`` already loaded (not read again).

    Returns:
        the check report plus ``file``, ``fp32``, ``calib``.
    Raises:
        StageError: a file is missing/unreadable, or the model cannot run on ``calib``.
    """

    model = load_onnx(onnx_path) if model is None else model
    fp32_model = load_onnx(fp32, "2_export_onnx.py") if fp32 else None
    data = load_npz(calib, None, "4_make_calib.py") if calib else None
    rep = check_model(model, path=onnx_path, fp32_model=fp32_model, calib=data,
                      calib_limit=calib_limit)
    return {"file": str(onnx_path), "fp32": str(fp32) if fp32 else None,
            "calib": str(calib) if calib else None, **rep}


def print_check(rep: dict, limit: int | None = None,
                more: str = "all in the JSON; python qdq_tools.py check prints them") -> None:
    """Findings of :func:`run_check`, one block each (message, then the fix); ``limit``: print
    the first ``limit`` of each kind only, and ``more`` where the others are."""

    print(f"{rep['file']}: {summary_line(rep)} (bias re-quantization judged on "
          f"{rep['basis']}; {rep['checked']['n_wbq_candidates']} Conv/Gemm (or MatMul+Add ORT "
          f"fuses into a Gemm) rewritten by ORT's WeightBiasQuantization, "
          + (f"{rep['checked'].get('n_compared', 0)} of {rep['checked']['n_weights']} quantized "
             "weights compared with the float weights (matched by node, else weight name)"
             if rep["checked"]["fp32"] else f"{rep['checked']['n_weights']} quantized weights")
          + ")")
    shown: dict[str, int] = defaultdict(int)
    for f in rep["findings"]:
        shown[f["kind"]] += 1
        if limit is None or shown[f["kind"]] <= limit:
            print(f"  [{f['kind']}] {f['message']}\n      fix: {f['fix']}")
        elif shown[f["kind"]] == limit + 1:
            print(f"  [{f['kind']}] ... {rep['kinds'][f['kind']] - limit} more ({more})")


def record_quant(args: argparse.Namespace) -> dict:
    """Write ``results/<model>/quant_<variant>.json``: wall time, the exact command, ModelOpt's
    warnings, the calibration record (``--calib-report``: samples, batch, order seed), the
    :func:`inspect_model` summary, the MACs in INT8 (``macs``: :func:`deploykit.quant.macs.mac_summary`)
    and the health check (:func:`run_check` with the float model and the calibration data) of
    the output."""
    onnx_path = Path(args.onnx)
    rec = {"stage": "5_quantize", "model": args.model, "variant": args.variant,
           "status": args.status, "output": str(onnx_path), "wall_time_s": args.wall_s,
           "command": args.command, "log": str(args.log), "description": args.description,
           "warnings": log_warnings(args.log) if Path(args.log).exists() else []}
    if args.calib_report and Path(args.calib_report).exists():
        rec["calibration"] = calibration_summary(json.loads(Path(args.calib_report).read_text()))
    if args.status == "ok" and onnx_path.exists():
        qmodel = load_onnx(onnx_path)
        rep = inspect_model(qmodel)
        rep.pop("_helper", None)
        rec["inspect"] = rep
        # Share of the Conv/Gemm/MatMul MACs that compute in INT8 (the report's column).

        rec["macs"] = mac_summary(qmodel)
        rec["size_mb"] = file_size_mb(onnx_path)
        rec["ort_cpu_smoke"] = ort_smoke(onnx_path)
        if not rec["ort_cpu_smoke"]["ok"]:
            print(f"WARNING: ONNX Runtime cannot run {onnx_path}: "
                  f"{rec['ort_cpu_smoke']['error'][:300]}", file=sys.stderr)
        rec["check"] = check_record(onnx_path, args.source, args.calib)
        flag_unquantized(rec, onnx_path)
    inputs = [p for p in (args.source, args.calib, onnx_path) if p]
    rec["provenance"] = provenance(args, inputs)
    rec["provenance"]["wall_time_s"] = args.wall_s
    path = model_results(args.model) / f"quant_{args.variant}.json"
    write_json(path, rec)
    return rec


def unquantized_warning(macs: dict | None) -> str | None:
    """The warning for a Q/DQ file in which no MAC node is quantized (None otherwise): ModelOpt
    can finish "clean" having quantized nothing (e.g. its rule that leaves a MatMul/Gemm at
    batch 1, a GEMV, in float, on a small MLP), and the file then is the float model.

    Args:
        macs: :func:`deploykit.quant.macs.mac_summary` of the output (``n_nodes``: the
            Conv/ConvTranspose/Gemm/MatMul nodes, ``n_int8_nodes``: those with INT8 input and
            weight).
    Returns:
        ``"0 of N MatMul/Conv/Gemm quantized: ..."`` with the likely causes and what to try.
    """
    if not macs or not macs.get("n_nodes") or macs.get("n_int8_nodes"):
        return None
    n = macs["n_nodes"]
    return (f"0 of {n} MatMul/Conv/Gemm quantized: the output computes in float (no INT8 "
            "speedup, its accuracy is the float model's). ModelOpt leaves nodes it judges not "
            "worth quantizing in float, e.g. a MatMul/Gemm at batch 1 (a GEMV) on a small MLP; "
            "check the op types (--op_types_to_quantize), the calibration batch and shapes "
            "(CALIB_BATCH) and the ModelOpt log")


def flag_unquantized(rec: dict, onnx_path: Path | str) -> str | None:
    """Record and print :func:`unquantized_warning` for a quant record with ``macs``: it goes
    into ``rec["unquantized"]`` and into the check's ``summary`` (the report's Q/DQ note: a
    clean check is no longer shown as clean; ``rec["warnings"]`` stays ModelOpt's log), and a
    ``WARNING:`` line is printed. Returns the warning (None when there is none).
    """
    msg = unquantized_warning(rec.get("macs"))
    if msg is None:
        return None
    rec["unquantized"] = msg
    check = rec.get("check")
    if isinstance(check, dict):
        check["summary"] = f"{check.get('summary') or 'check: not run'}; WARNING: {msg}"
    print(f"WARNING: {Path(onnx_path).name}: {msg}", file=sys.stderr)
    return msg


def calibration_summary(rep: dict) -> dict:
    """The calibration facts a quant JSON records (from ``check-calib --json``)."""
    plan = rep.get("plan", {})
    return {"npz": rep.get("calib"), "sha256": rep.get("sha256"),
            "n_samples": rep.get("n_samples"), "batch_size": plan.get("batch_size"),
            "batches": plan.get("batches"), "order_dependent": plan.get("order_dependent"),
            "batch_reason": plan.get("reason"), "order_seed": rep.get("order_seed"),
            "made_by": rep.get("made_by"), "stats_check": rep.get("stats_check"),
            "calibration_shapes": plan.get("calibration_shapes"),
            "inputs": {k: {"shape": v["shape"], "dtype": v["dtype"], "stats": v.get("stats")}
                       for k, v in rep.get("inputs", {}).items()}}


def check_record(onnx_path: Path, fp32: Path | str | None, calib: Path | str | None) -> dict:
    """:func:`run_check` for a stage record: prints the findings, never raises (a check that
    cannot run is recorded as ``{"ok": None, "error": ...}``)."""

    try:
        rep = run_check(onnx_path, fp32 if fp32 and Path(fp32).exists() else None,
                        calib if calib and Path(calib).exists() else None)
    except (StageError, ValueError) as e:
        print(f"WARNING: qdq_tools.py check could not run on {onnx_path}: {e}", file=sys.stderr)
        return {"ok": None, "error": str(e)[:600], "summary": "check: could not run"}
    rep["summary"] = summary_line(rep)
    if rep["ok"]:
        print(f"  {onnx_path.name}: {rep['summary']}")
    else:
        print_check(rep, limit=3)
    return rep
