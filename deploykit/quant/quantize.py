"""Stage 5's procedure: the calibration file read, validated and planned once, every requested\nvariant quantized by ModelOpt (deploykit.quant.modelopt_runner) in a private work folder,\nhealth-checked, installed atomically and recorded in results/<model>/quant_<variant>.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
import numpy as np
from deploykit.quant import modelopt_runner
from deploykit.io import require
from deploykit.errors import StageError, UsageError
from deploykit.io import check_regular_file, file_size_mb, load_npz, sha256_file, write_json
from deploykit.layout import ROOT, model_results
from deploykit.onnx.graph import load_onnx
from deploykit.quant.auto.report import publish
from deploykit.quant.calibration import (
    calibration_plan,
    calibration_reference,
    validate_calibration,
)
from deploykit.quant.health import check_model, summary_line
from deploykit.quant.inspect import inspect_model
from deploykit.quant.macs import mac_summary
from deploykit.quant.modelopt import entropy_computed_as_max, histograms_reused_from
from deploykit.quant.modelopt_log import (calibration_ep, ep_fallback_warning, log_warnings,
                                          ort_smoke)
from deploykit.quant.record import calibration_summary, flag_unquantized, print_check
from deploykit.commands import script_command
from deploykit.results import provenance, source_block
from deploykit.variants import get_variant, modelopt_args


STAGE = "5_quantize"


HEALTH_CHECK_SAMPLES = 32  # calibration samples the health check runs (qdq_tools.py check's)


# --------------------------------------------------------------------------------------------
# Settings from the environment
# --------------------------------------------------------------------------------------------
def env_settings(environ=None) -> dict:
    """The environment variables the stage reads, checked.

    Args:
        environ: the environment (default ``os.environ``).
    Returns:
        ``{"eps" (None: choose), "calib_batch", "stats_check", "auto_args", "auto_text"}``.
    Raises:
        UsageError: ``CALIB_BATCH`` is neither ``all`` nor a positive integer, ``EPS`` is no
            calibration EP ModelOpt takes, or ``CALIB_STATS_CHECK`` is neither 0 nor 1.
    """
    env = os.environ if environ is None else environ
    batch = env.get("CALIB_BATCH") or "all"
    if batch != "all":
        try:
            ok = int(batch) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"CALIB_BATCH={batch!r}: 'all' (one batch) or a positive "
                                    "integer")
    eps = env.get("EPS") or None
    # ModelOpt's --calibration_eps values (modelopt.onnx.quantization: cpu, cuda:<i>, trt, dml)
    if eps is not None and not re.fullmatch(r"cpu|cuda:\d+|trt|dml", eps):
        raise UsageError(f"EPS={eps!r}: the calibration EP is one of cpu, cuda:0 (cuda:<i>), "
                         "trt, dml (lower case; unset: cuda:0 when onnxruntime has the CUDA EP, "
                         "else cpu)")
    stats = env.get("CALIB_STATS_CHECK") or "1"
    if stats not in ("0", "1"):
        raise UsageError(f"CALIB_STATS_CHECK={stats!r}: 1 (compare the calibration data with "
                         "the evaluation data, the default) or 0 (skip it, recorded)")
    text = env.get("AUTO_ARGS") or ""
    # As bash's `read -r -a` did: the first line, split on blanks, no quote processing.
    first = text.splitlines()[0] if text else ""
    return {"eps": eps, "calib_batch": batch, "stats_check": stats != "0",
            "auto_args": first.split(), "auto_text": text}


def default_eps() -> str:
    """``cuda:0`` when onnxruntime offers the CUDA EP, else ``cpu``."""
    try:
        import onnxruntime

        return "cuda:0" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() \
            else "cpu"
    except Exception:  # noqa: BLE001 - no usable onnxruntime: calibrate on the CPU
        return "cpu"


# --------------------------------------------------------------------------------------------
# Calibration data: read once, validated, planned
# --------------------------------------------------------------------------------------------
def read_calibration(path: Path) -> tuple[dict[str, np.ndarray], bytes, str]:
    """Read the calibration npz once.

    Args:
        path: the npz (``artifacts/<model>/calib.npz``).
    Returns:
        ``(arrays by key, the bytes read, their hex SHA-256)``: the arrays are parsed from
        those bytes, so the hash is that of the data used.
    Raises:
        StageError: missing or not an npz of arrays.
    """
    raw = require(check_regular_file(path, "--calib"), "4_make_calib.py").read_bytes()
    data = load_npz(path, None, "4_make_calib.py, or np.savez(path, <input name>=array, ...)",
                    flag="--calib", feed=True, data=raw)
    return data, raw, hashlib.sha256(raw).hexdigest()


def calibration_record(model: str, onnx_path: Path, calib: Path, data: dict[str, np.ndarray],
                       sha256: str, batch: str, stats_check: bool) -> dict:
    """Validate the calibration arrays for the model and plan the calibration batch (what
    ``qdq_tools.py check-calib`` does, on arrays already read).

    Args:
        model: the model name (evaluation data for the statistics check; stage 4's record).
        onnx_path: the float model. calib: the npz's path (named in messages and records).
        data: its arrays. sha256: the hash of its bytes (:func:`read_calibration`).
        batch: ``CALIB_BATCH``. stats_check: compare the statistics with the evaluation data.
    Returns:
        the record ``deploykit.quant.record.calibration_summary`` reads: ``n_samples``, ``inputs``,
        ``stats_check``, ``plan``, ``calib``, ``sha256``, ``order_seed``, ``made_by``.
    Raises:
        StageError: the data do not fit the model or the evaluation data.
    """
    ref, ref_src = (None, "skipped (--no-stats-check)")
    if stats_check:
        ref, ref_src = calibration_reference(model, onnx_path)
    rep = validate_calibration(onnx_path, data, ref, source=str(calib),
                                         reference_source=ref_src)
    plan = calibration_plan(onnx_path, data, batch)
    rec = {**rep, "plan": plan, "calib": str(calib), "sha256": sha256, "order_seed": None,
           "made_by": "unknown (not the npz stage 4 recorded)"}
    made = model_results(model) / "calib.json"
    try:
        stage4 = json.loads(made.read_text()) if made.exists() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        stage4 = {}
    if isinstance(stage4, dict) and stage4.get("sha256") == sha256:
        rec["order_seed"] = stage4.get("order_seed")
        rec["made_by"] = f"4_make_calib.py ({stage4.get('source')})"
    print(f"calibration: {plan['n_samples']} samples, batch {plan['batch_size']} "
          f"({len(plan['batches'])} batch(es): {plan['reason']}); statistics "
          f"{rep['stats_check']}", file=sys.stderr)
    if plan["order_dependent"]:
        print(f"NOTE: {len(plan['batches'])} calibration batches: entropy scales depend on the "
              f"sample order (order seed {rec['order_seed']})", file=sys.stderr)
    return rec


# --------------------------------------------------------------------------------------------
# The quantization record
# --------------------------------------------------------------------------------------------
def health_check(onnx_path: Path, inputs: dict) -> dict:
    """The Q/DQ health check of a stage-5 file (``qdq_tools.py check`` with the float model
    and the calibration arrays already in memory); prints the findings, never raises.

    Args:
        onnx_path: the installed Q/DQ file. inputs: :func:`main`'s inputs (``src``,
            ``fp32_model``, ``calib``, ``calib_data``).
    Returns:
        the check report with ``file``, ``fp32``, ``calib`` and ``summary``, or
        ``{"ok": None, "error", "summary": "check: could not run"}``.
    """
    print(f"  check {onnx_path.name}: Q/DQ health (scales, weights, bias re-quantization on "
          f"{HEALTH_CHECK_SAMPLES} calibration samples)", flush=True)
    try:
        rep = check_model(load_onnx(onnx_path), path=onnx_path,
                                    fp32_model=inputs["fp32_model"], calib=inputs["calib_data"],
                                    calib_limit=HEALTH_CHECK_SAMPLES)
    except (StageError, ValueError) as e:
        print(f"WARNING: qdq_tools.py check could not run on {onnx_path}: {e}", file=sys.stderr)
        return {"ok": None, "error": str(e)[:600], "summary": "check: could not run"}
    rep = {"file": str(onnx_path), "fp32": str(inputs["src"]), "calib": str(inputs["calib"]),
           **rep}
    rep["summary"] = summary_line(rep)
    if rep["ok"]:
        print(f"  {onnx_path.name}: {rep['summary']}")
    else:
        print_check(rep, limit=3)
    return rep


def quant_record(args: argparse.Namespace, inputs: dict, variant: str, status: str, out: Path,
                 log: Path, wall_s: float, command: str, shared: dict | None = None) -> dict:
    """Write ``results/<model>/quant_<variant>.json`` (the fields ``qdq_tools.py
    record-quant`` writes) and return it.

    Args:
        args: the stage's arguments (provenance). inputs: :func:`main`'s inputs.
        variant, status (``ok``/``failed``), out (the installed file), log, wall_s, command:
            what the record says.
        shared: ``{"fp32": variant, "fp16": variant}`` when one ModelOpt run made both
            (:func:`shared_calibration`): recorded as ``shared_calibration`` (``wall_s`` and
            ``command`` are that run's).
    Returns:
        the record: ``stage``, ``model``, ``variant``, ``status``, ``output``,
        ``wall_time_s``, ``command``, ``log``, ``description``, ``warnings``,
        ``calibration``, ``shared_calibration``, ``calibration_histograms_from`` (the earlier
        ModelOpt run of the stage whose calibration histograms this run took, by its output
        name: :func:`deploykit.quant.modelopt.histograms_reused_from`; None: calibrated
        itself), ``entropy_computed_as_max`` (why ModelOpt's entropy calibration ran as max
        calibration, the same file: :func:`deploykit.quant.modelopt.entropy_as_max`; None: as
        requested); when ok also ``inspect``, ``macs``, ``size_mb``, ``ort_cpu_smoke``,
        ``check``, and ``unquantized`` when no MAC node is quantized
        (:func:`deploykit.quant.record.flag_unquantized`); ``provenance`` (input hashes: the bytes ModelOpt was given);
        ``source`` (:func:`deploykit.results.source_block`: the output's, the fp32.onnx's and
        the calibration bytes' SHA-256, and the command that made it).
    Raises:
        StageError: the results folder cannot be written.
    """
    rec = {"stage": STAGE, "model": args.model, "variant": variant, "status": status,
           "output": str(out), "wall_time_s": wall_s, "command": command, "log": str(log),
           "description": get_variant(variant).description,
           "warnings": log_warnings(log) if log.exists() else [],
           "calibration": calibration_summary(inputs["calib_rec"]),
           "shared_calibration": None if shared is None else {
               **shared, "made_by": (
                   f"one ModelOpt run with {shared['fp32']}'s flags (--high_precision_dtype "
                   f"fp32); {shared['fp16']} is its calibrated model after ModelOpt's own FP16 "
                   "conversion (the step --high_precision_dtype fp16 runs after calibration; "
                   "the same file as ModelOpt's CLI with that flag)")},
           "calibration_histograms_from": None, "entropy_computed_as_max": None}
    if log.exists():
        # a variant whose calibration histograms an earlier variant's run of this stage made
        text = log.read_text(errors="replace")
        rec["calibration_histograms_from"] = histograms_reused_from(text)
        # entropy calibration of one batch computed as max calibration (the same file)
        rec["entropy_computed_as_max"] = entropy_computed_as_max(text)
        # the EP ModelOpt's ORT sessions really ran on (a requested CUDA EP that this
        # onnxruntime lacks falls back to the CPU)
        rec["calibration_ep"] = calibration_ep(inputs["eps"], log)
        used = ", ".join(rec["calibration_ep"]["used"]) or "no ORT session seen in the log"
        print(f"  calibration EP: requested {inputs['eps']}, ran on {used}")
        warn = ep_fallback_warning(rec["calibration_ep"])
        if warn:
            print(warn, file=sys.stderr)
            rec["warnings"] = [warn, *rec["warnings"]]
    if status == "ok" and out.exists():
        qmodel = load_onnx(out)
        rep = inspect_model(qmodel)
        rep.pop("_helper", None)
        rec["inspect"] = rep
        rec["macs"] = mac_summary(qmodel)  # the report's INT8 MACs column
        rec["size_mb"] = file_size_mb(out)
        rec["ort_cpu_smoke"] = ort_smoke(out)
        if not rec["ort_cpu_smoke"]["ok"]:
            print(f"WARNING: ONNX Runtime cannot run {out}: "
                  f"{rec['ort_cpu_smoke']['error'][:300]}", file=sys.stderr)
        rec["check"] = health_check(out, inputs)
        flag_unquantized(rec, out)
    settings = {**vars(args), "variant": variant, "eps": inputs["eps"],
                "calib_batch": inputs["calib_batch"], **{
                    k: os.environ.get(k) for k in ("CALIB_BATCH", "CALIB_STATS_CHECK",
                                                   "AUTO_ARGS", "EPS")}}
    prov = provenance(argparse.Namespace(**settings), [out])
    prov["input_sha256"] = {str(inputs["src"]): inputs["src_sha256"],
                            str(inputs["calib"]): inputs["calib_sha256"],
                            **prov["input_sha256"]}
    prov["wall_time_s"] = wall_s
    rec["provenance"] = prov
    # The command that remakes this file alone (the stage's own command line may make other
    # variants and evaluate them: a stale row's rerun must not redo those).
    remake = ["--model", args.model, variant] + (
        ["--calib-inputs", str(Path(args.calib_inputs).absolute())]
        if getattr(args, "calib_inputs", None) else [])
    # What the installed file was made from: the fp32.onnx copy and the calibration bytes
    # ModelOpt was given (hashed in memory, not re-read from paths another run may rewrite).
    # Stages 3/6/7 find this block by the output's hash (deploykit.results.source_of).
    rec["source"] = source_block(
        out if status == "ok" else None, [script_command("5_quantize.py", remake,
                                                          args.model)],
        fp32={"path": str(Path(inputs["src"]).absolute()), "sha256": inputs["src_sha256"]},
        calibration={"path": str(Path(inputs["calib"]).absolute()),
                     "sha256": inputs["calib_sha256"]})
    path = model_results(args.model) / f"quant_{variant}.json"
    side = path.with_name(f"quant_{variant}.failed.json")
    if status != "ok" and _record_ok(path):
        write_json(side, rec)
        print(f"note: {path} describes the good {out.name} still installed: kept; this failed "
              f"run is recorded in {side.name}", file=sys.stderr)
    else:
        write_json(path, rec)
        if status == "ok":
            side.unlink(missing_ok=True)
            Path(log).with_name(f"{variant}.quant.failed.log").unlink(missing_ok=True)
    return rec


def _record_ok(path: Path) -> bool:
    """True when ``path`` holds a quant record whose status is ``ok``."""
    try:
        return json.loads(path.read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


# --------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------
def _python_tool(*argv: str) -> list[str]:
    """A command line of one of the project's Python tools, run in the repository root."""
    return [sys.executable, *argv]


def quantize_all(args, selected, env, eps, src, calib, onnx_dir, res_dir, work, fp32_model,
                  dw, stem) -> list[dict]:
    """:func:`main`'s work inside the work folder."""
    # one ModelOpt process for every run of the stage, started now: it imports ModelOpt while
    # this process reads and checks the calibration data (modelopt_runner.ModelOptWorker)
    with modelopt_runner.shared_worker() as worker:
        worker.start()
        return _quantize_all(args, selected, env, eps, src, calib, onnx_dir, res_dir, work,
                             fp32_model, dw, stem, worker)


def _quantize_all(args, selected, env, eps, src, calib, onnx_dir, res_dir, work, fp32_model,
                  dw, stem, worker) -> list[dict]:
    model = args.model
    work_src = work / "fp32.onnx"
    shutil.copyfile(src, work_src)
    # Calibration data read once, checked before ModelOpt sees it (ModelOpt itself only
    # asserts), and handed to ModelOpt as a private copy of the very bytes that were checked.
    try:
        data, raw, calib_sha = read_calibration(calib)
        calib_rec = calibration_record(model, src, calib, data, calib_sha, env["calib_batch"],
                                       env["stats_check"])
    except StageError as e:
        raise StageError(f"{e}; nothing was quantized") from e
    work_calib = work / "calib.npz"
    work_calib.write_bytes(raw)
    calib_batch = calib_rec["plan"]["batch_size"]
    inputs = {"src": src, "src_sha256": sha256_file(work_src), "fp32_model": fp32_model,
              "calib": calib, "calib_sha256": calib_sha, "calib_data": data,
              "calib_rec": calib_rec, "eps": eps, "calib_batch": calib_batch}

    records, not_made = [], []
    pairs = shared_calibration(selected)  # {fp16 variant: fp32 variant of the same calibration}
    made_with = {b: a for a, b in pairs.items()}
    done: set[str] = set()
    for variant in selected:
        if variant in done:
            continue
        v = get_variant(variant)
        auto: list[str] = []
        auto_dir = work / "auto_precision"
        if v.needs_tuning:
            # The search chooses the nodes to keep in float (anchored regexes on stdout); its
            # record is written in the work folder and published with the installed file.
            print(f"Stage 5: search {variant}: which nodes stay in float (auto_precision.py "
                  f"search {env['auto_text']})")
            p = subprocess.run(_python_tool(
                "auto_precision.py", "search", "--model", model, "--fp32", str(src), "--calib",
                str(work_calib), "--calib-batch", str(calib_batch), "--eps", eps, "--variant",
                variant, "--out-dir", str(auto_dir), *env["auto_args"]),
                stdout=subprocess.PIPE, text=True, cwd=ROOT)
            if p.returncode != 0:  # exit 2 (a usage error in AUTO_ARGS) is passed on as it is
                print(f"{_prog()}: FAILED: the mixed-precision search for {variant} failed "
                      "(above); nothing was installed", file=sys.stderr)
                raise SystemExit(p.returncode if p.returncode > 0 else 128 - p.returncode)
            auto = p.stdout.rstrip("\n").split("\n") if p.stdout.strip() else []
        # a variant whose fp32 twin is also asked for is made by the twin's run (one
        # calibration, then ModelOpt's FP16 conversion): the twin's ModelOpt flags run
        base = pairs.get(variant, variant)
        half = made_with.get(base)  # the FP16 variant made by this run, if any
        try:
            flags = modelopt_args(base, str(work_calib), eps, dw, stem, auto)
        except ValueError as e:
            print(f"{_prog()}: {variant} not made: {str(e).strip(chr(39) + chr(34))}",
                  file=sys.stderr)
            not_made.append(variant)
            continue
        out = onnx_dir / f"{base}.onnx"
        log = work / f"{base}.quant.log"  # installed beside the file once the status is known
        tmp = work / f"{base}.onnx"
        tmp16 = None if half is None else work / f"{half}.onnx"
        replace = {tmp: out, work_src: src, work_calib: calib}
        print(f"Stage 5: quantize {base}: {src} + {calib} -> {out}"
              + (f" (and {half}: the same calibration with ModelOpt's FP16 conversion -> "
                 f"{onnx_dir / f'{half}.onnx'})" if half else "")
              + f"; ModelOpt calibrates on {inputs['calib_rec']['plan']['n_samples']} samples",
              flush=True)
        if tmp16 is not None:
            replace[tmp16] = onnx_dir / f"{half}.onnx"
        # every run of the stage keeps its calibration histograms in one work folder: a later
        # variant whose tensors an earlier one covered (baseline's cover the recipe's) skips
        # ORT's calibration session (deploykit.quant.modelopt._histogram_cache; same files)
        run = modelopt_runner.run_modelopt(work_src, tmp, flags, log, calib_batch=calib_batch,
                                           replace=replace, fp16_output=tmp16,
                                           histogram_cache=work / "histograms",
                                           worker=worker)
        made = [(base, run.status, tmp, out)]
        if half is not None:
            made.insert(0 if selected.index(half) < selected.index(base) else 1,
                        (half, run.fp16_status, tmp16, onnx_dir / f"{half}.onnx"))
        fp32_text, whole_text = run.split_log() if half is not None else (None, None)
        for name, status, tmp_file, out_file in made:
            done.add(name)
            work_log = work / f"{name}.quant.log"
            if half is not None:  # each file's own part of the shared log
                work_log.write_text(whole_text if name == half else fp32_text)
            records.append(_finish(args, inputs, name, status, tmp_file, out_file, work_log,
                                   run, onnx_dir, res_dir, auto_dir, shared=(
                                       None if half is None else
                                       {"fp32": base, "fp16": half})))
    if not_made:
        raise StageError(f"{' '.join(not_made)} not made (reason above); the other "
                                "requested variants were made")
    return records


def shared_calibration(selected: list[str]) -> dict[str, str]:
    """Pairs of requested variants that one ModelOpt calibration makes: ``{FP16 variant: FP32
    variant}`` where their ModelOpt recipes differ only in ``--high_precision_dtype`` (fp16,
    ModelOpt's default, against fp32) and neither needs a search (``needs_tuning``).

    ModelOpt 0.47.0's INT8 path calibrates in FP32 and converts the float tensors to the
    high-precision dtype last (:func:`deploykit.quant.modelopt.modelopt_quantize`), so the FP16
    file is the FP32 run's model after that conversion: one calibration instead of two.

    Args:
        selected: the variants of this run (registry names).
    Returns:
        the mapping (empty when no such pair was asked for).
    """
    def recipe(name: str) -> tuple[str | None, tuple]:
        v = get_variant(name)
        if v.modelopt is None or v.needs_tuning:
            return None, ()
        opts: dict[str, tuple[str, ...]] = {}
        key = None
        for tok in v.modelopt:
            if tok.startswith("--"):
                key = tok
                opts[key] = ()
            elif key is not None:
                opts[key] += (tok,)
        if opts.get("--quantize_mode") != ("int8",):
            return None, ()
        dtype = opts.pop("--high_precision_dtype", ("fp16",))[0]  # ModelOpt's default: fp16
        return dtype, tuple(sorted(opts.items()))

    by_recipe: dict[tuple, dict[str, str]] = {}
    for name in selected:
        dtype, rest = recipe(name)
        if dtype in ("fp16", "fp32"):
            by_recipe.setdefault(rest, {}).setdefault(dtype, name)
    return {d["fp16"]: d["fp32"] for d in by_recipe.values() if "fp16" in d and "fp32" in d}


def _finish(args, inputs: dict, variant: str, status: str, tmp: Path, out: Path, log: Path,
            run, onnx_dir: Path, res_dir: Path, auto_dir: Path, shared: dict | None) -> dict:
    """One variant after its ModelOpt run: verified (``int8_auto``), installed atomically when
    it succeeded, its log installed beside it, its record written; raises on failure.

    Returns:
        the record (:func:`quant_record`).
    Raises:
        StageError: ModelOpt failed (the log's last lines), or ``int8_auto`` misses its
            budget; the installed file is then left as it was.
    """
    model = args.model
    v = get_variant(variant)
    wall = round(run.wall_s, 1)
    try:
        log_tail = log.read_text(errors="replace").splitlines()[-20:]
    except OSError:
        log_tail = []
    # int8_auto: measured on the tuning split (it must meet the budget) and the evaluation
    # split before it replaces anything.
    verify_failed = False
    if status == "ok" and v.needs_tuning and subprocess.run(_python_tool(
            "auto_precision.py", "verify", "--model", model, "--fp32", str(inputs["src"]),
            "--onnx", str(tmp), "--installed-as", str(out), "--out-dir", str(auto_dir)),
            cwd=ROOT).returncode != 0:
        verify_failed, status = True, "failed"
    if status == "ok":
        os.replace(tmp, out)
    else:
        tmp.unlink(missing_ok=True)
    # a failed rerun never replaces the record and log of the good file still installed:
    # they go beside them (quant_<variant>.failed.json, <variant>.quant.failed.log)
    keep_good = status != "ok" and _record_ok(res_dir / f"quant_{variant}.json")
    final_log = onnx_dir / (f"{variant}.quant.failed.log" if keep_good
                            else f"{variant}.quant.log")
    if log.exists():
        os.replace(log, final_log)
    if v.needs_tuning and (auto_dir / "auto_precision.json").exists():
        # results/<model>/auto_precision.* always describe the installed file; a run that
        # was not installed is published beside them as auto_precision.failed.*
        publish(auto_dir, res_dir, failed=status != "ok")
    rec = quant_record(args, inputs, variant, status, out, final_log, wall, run.shown,
                       shared=shared)
    if verify_failed:
        raise StageError(f"{variant} re-quantized by ModelOpt misses its budget on "
                         "the tuning split (auto_precision.py verify, above); "
                         f"{out} left as it was")
    if status != "ok":
        raise StageError(f"ModelOpt failed on {variant} (exit {run.returncode}); "
                         f"last lines of {final_log}:\n" + "\n".join(log_tail))
    print(f"  finished {variant} [elapsed={wall}s] -> {out}")
    return rec


def _prog() -> str:
    """The program name in messages (as :func:`deploykit.cli.cli` prints it)."""
    return Path(sys.argv[0]).name
