"""Stage 6's engine builds: one build plan per variant (inputs, profiles, DLA, the INT8 route,\nthe opset-17 copy for TensorRT 8.x), the trtexec run, plan verification, the DLA placement check\nand the build record.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from deploykit.variants import VARIANTS
from deploykit.cli import check_positive
from deploykit.io import require
from deploykit.errors import StageError, UsageError
from deploykit.io import atomic_path, file_size_mb
from deploykit.layout import engine_paths, engines_dir, fp32_onnx_path, variant_onnx_path
from deploykit.models import MODEL_TABLE, model_spec
from deploykit.onnx.graph import load_onnx, onnx_opset
from deploykit.results import (check_source, provenance, rerun_command, result_record,
                               source_block, source_of, write_result)
from deploykit.trt.commands import build_command, plan_version_command
from deploykit.trt.detect import Detected, run_tool
from deploykit.trt.onnx_prep import (
    calibration_scales,
    ort_parity,
    parity_feed,
    to_opset,
    write_calibration_cache,
)
from deploykit.trt.parsers import (
    dla_fraction,
    error_lines,
    layer_summary,
    parse_dla_placement,
    parse_inference_shapes,
    parse_layer_info,
    parse_performance_summary,
    parse_plan_version,
    parse_unknown_options,
    same_version,
)
from deploykit.trt.plans import diagnose_plan_load
from deploykit.trt.profiles import (
    check_named_dims,
    fmt_dims,
    input_profiles,
    onnx_inputs,
    parse_shape_specs,
    trt_layer_names,
)
from deploykit.trt.rules import (
    DLA_MIN_FRACTION_WARN,
    MAX_PARSER_OPSET,
    UnsupportedVariant,
    check_supported,
    dla_allowed,
    dla_unavailable,
    encode_version_int,
    full_version,
    int8_route,
    opset_advice,
    parse_version,
    variant_unsupported,
    vstr,
)

STAGE = "6_build_engines"  # the stage named in records and messages


# --------------------------------------------------------------------------------------------
# Planning one variant (shared by the dry run and the build)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class BuildPlan:
    """Everything decided before trtexec runs for one variant."""

    variant: str
    source: Path
    onnx: Path
    profiles: list
    dla_core: int | None
    int8: str | None = None
    calib: Path | None = None
    convert: Any = None           # the opset-17 ModelProto to write, or None
    convert_src: Path | None = None  # the file it was converted from
    notes: list = dataclasses.field(default_factory=list)
    cmd: list | None = None
    skip: str | None = None
    scales: dict | None = None
    parity: dict | None = None

    def record(self) -> dict:
        return {"onnx_built": self.onnx, "source_onnx": self.source,
                "profile": [p.as_dict() for p in self.profiles], "dla_core": self.dla_core,
                "int8_path": self.int8, "calib_cache": self.calib, "notes": self.notes,
                "opset17_from": self.convert_src, "opset17_parity": self.parity,
                "calibration_scales": len(self.scales) if self.scales is not None else None}


def _crop(model: str) -> int | None:
    if ":" in model:
        return None
    try:
        return model_spec(model).crop
    except (UsageError, ImportError):
        return MODEL_TABLE[model].crop if model in MODEL_TABLE else None


def _load(path: Path):
    return load_onnx(path, external=False)


def _opset17_copy(args, plan: BuildPlan, target: Path, model, version, build: bool
                  ) -> str | None:
    """TensorRT 8.x reads ``target`` only at opset <= 17: set ``plan.convert``/``plan.onnx`` to
    an exact opset-17 copy (written and checked on ONNX Runtime at build time). Returns the
    reason when there is no exact copy, None otherwise (also when no copy is needed)."""
    limit = MAX_PARSER_OPSET.get(full_version(version)[0])
    if version[0] != 8 or model is None or onnx_opset(model) <= limit:
        return None
    conv, cnotes, reason = to_opset(model, limit)
    if conv is None:
        return reason
    plan.convert, plan.convert_src = conv, target
    plan.onnx = engines_dir(args.model) / f"{target.stem}.opset{limit}.onnx"
    plan.notes.append(f"{target.name} is opset {onnx_opset(model)}; TensorRT "
                      f"{vstr(version)}'s parser handles up to {limit}: built from "
                      f"{plan.onnx.name} ({'; '.join(cnotes)})"
                      + ("" if build else "; its parity with the original is checked on ONNX "
                                          "Runtime before the build"))
    return None


def plan_variant(args, var: str, version: Sequence[int], tool: str, *, build: bool) -> BuildPlan:
    """Decide how ``var`` is built on ``version``: input file, profile, DLA or GPU, INT8 route,
    and for TensorRT 8.x an exact opset-17 copy of whatever file trtexec reads.

    ``build`` False (dry run) never writes; conversions are checked structurally only.

    Raises:
        UsageError: bad shapes or flags for this model (message names the input and the fix).
        StageError: an input the build needs is missing (names the stage that makes it).
    """
    v = VARIANTS[var]
    paths = engine_paths(args.model, var)
    src = variant_onnx_path(args.model, var)
    plan = BuildPlan(var, src, src, [], args.dla_core)
    plan.skip = variant_unsupported(version, v)
    if plan.skip:  # before any opset handling: its advice would not apply
        return plan
    model = _load(src) if src.exists() else None
    if model is None:
        if build:
            require(src, v.producer)
        plan.notes.append(f"{src.name} not written yet: input assumed 'input' N x 3 x crop x crop")
    if plan.dla_core is not None:
        why = dla_allowed(version, v)
        if why:
            plan.notes.append(f"built for the GPU: {why}")
            plan.dla_core = None
    dla = plan.dla_core is not None

    opset = onnx_opset(model) if model is not None else None
    route, why = int8_route(version, v, dla, opset, args.int8_path)
    plan.int8 = route
    if route:
        plan.notes.append(f"INT8 path {route}: {why}")
    built_from = model
    if route == "qdq_opset17":
        if model is None:
            plan.notes.append("converted to opset 17 at build time when exact (onnx.version_"
                              "converter + onnx.checker + ONNX Runtime parity), else implicit")
            plan.onnx = paths["opset17"]
        else:
            advice = opset_advice(opset, version, quantized=True)
            if advice:
                plan.notes.append(f"NOTE: {advice}")
            reason = _opset17_copy(args, plan, src, model, version, build)
            if reason is None and plan.convert is None:
                plan.int8 = "qdq"  # already opset <= 17
            elif reason is not None:
                if args.int8_path == "qdq":
                    plan.skip = (f"--int8-path qdq: {src.name} has no exact opset-17 form for "
                                 f"TensorRT {vstr(version)}: {reason}")
                    return plan
                plan.notes.append(f"no exact opset-17 copy of {src.name} ({reason}): implicit "
                                  "INT8 instead")
                plan.int8 = "implicit"
    if plan.int8 == "implicit":
        fp32 = variant_onnx_path(args.model, "fp32")
        plan.onnx, plan.calib = fp32, paths["calib"]
        fp32_model = _load(fp32) if fp32.exists() else None
        built_from = fp32_model if fp32_model is not None else model
        if fp32_model is not None and model is not None:
            plan.scales, skipped = calibration_scales(model, fp32_model)
            plan.notes.append(f"calibration cache: {len(plan.scales)} activation scales of "
                              f"{src.name} (ModelOpt, stage-4 calibration split) keyed to "
                              f"{fp32.name}'s tensors" + (f"; {len(skipped)} quantizer(s) not "
                                                          "usable" if skipped else ""))
        elif build:
            require(fp32, "2_export_onnx.py")
        else:
            plan.notes.append(f"calibration cache written at build time from {src.name}'s scales"
                              + ("" if fp32.exists() else f"; {fp32} missing: run "
                                 "2_export_onnx.py first"))
        reason = _opset17_copy(args, plan, fp32, fp32_model, version, build)
    elif plan.int8 is None:
        reason = _opset17_copy(args, plan, src, model, version, build)
    else:
        reason = None
    if reason is not None:
        plan.skip = (f"{plan.onnx.name} is opset {onnx_opset(built_from)} and has no exact "
                     f"opset-17 form for TensorRT {vstr(version)} ({reason}): "
                     + opset_advice(onnx_opset(built_from), version, quantized=False))
        return plan
    if plan.convert is not None:
        built_from = plan.convert
    if built_from is not None:
        inputs = onnx_inputs(built_from)
    else:
        crop = _crop(args.model) or 224
        inputs = [("input", [None, 3, crop, crop], None)]
    plan.profiles = input_profiles(
        inputs, input_shapes=args.input_shape or (),
        min_shapes=parse_shape_specs(args.min_shapes, "--min-shapes"),
        opt_shapes=parse_shape_specs(args.opt_shapes, "--opt-shapes"),
        max_shapes=parse_shape_specs(args.max_shapes, "--max-shapes"),
        min_batch=args.min_batch, opt_batch=args.opt_batch, max_batch=args.max_batch,
        static=dla, default_hw=_crop(args.model))
    if built_from is not None:
        check_named_dims(built_from, plan.profiles)
    if dla and any(p.dynamic and "static for DLA" in p.source for p in plan.profiles):
        plan.notes.append("DLA needs a static profile (min = opt = max, 'DLA Supported Layers "
                          "and Restrictions'): " + ", ".join(
                              f"{p.name} {fmt_dims(p.opt)}" for p in plan.profiles if p.dynamic))
    try:
        plan.cmd = build_command(
            plan.onnx, paths["plan"], var, version, timing_cache=paths["cache"],
            layer_info=paths["layers"], profiles=plan.profiles, mem_pool_mb=args.mem_pool_mb,
            dla_core=plan.dla_core, int8=plan.int8 if plan.int8 == "implicit" else "qdq",
            calib=plan.calib, no_tf32=args.no_tf32, trtexec=tool)
    except UnsupportedVariant as e:
        plan.skip = str(e)
    return plan


def check_args(args) -> None:
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        raise UsageError(f"unknown variant(s) {', '.join(bad)}: choose from {', '.join(VARIANTS)}")
    check_positive(args, "min_batch", "opt_batch", "max_batch", "mem_pool_mb")
    if args.dla_core is not None and args.dla_core < 0:
        raise UsageError(f"--dla-core {args.dla_core}: must be >= 0")
    if args.dla_min_fraction is not None:
        if args.dla_core is None:
            raise UsageError("--dla-min-fraction applies to DLA builds: add --dla-core N")
        if not 0.0 <= args.dla_min_fraction <= 1.0:
            raise UsageError(f"--dla-min-fraction {args.dla_min_fraction}: must be in 0..1")


def check_dla_version(args, version: Sequence[int]) -> None:
    """``--dla-core`` on a TensorRT without DLA is refused, by the build and its dry run alike.

    Raises:
        UsageError: the reason (deploykit.trt.rules.dla_unavailable, with its sources).
    """
    why = dla_unavailable(version) if args.dla_core is not None else None
    if why:
        raise UsageError(f"--dla-core: {why}")


def dry_run(args, names: Sequence[str]) -> None:
    if not args.trt_version:
        raise UsageError("--dry-run needs --trt-version (e.g. 8.6.2, 10.3.0, 11.0.0)")
    ver = full_version(parse_version(args.trt_version))
    check_supported(ver)
    check_dla_version(args, ver)
    tool = os.environ.get("TRTEXEC") or "trtexec"
    for var in names:
        plan = plan_variant(args, var, ver, tool, build=False)
        v = VARIANTS[var]
        where = f"DLA core {plan.dla_core}" if plan.dla_core is not None else "GPU"
        print(f"# {var} ({v.precision}, TensorRT {vstr(ver)}, {where}): profile "
              + "; ".join(f"{p.name} {fmt_dims(p.min)}/{fmt_dims(p.opt)}/"
                          f"{fmt_dims(p.max)} ({p.source})" for p in plan.profiles))
        for n in plan.notes:
            print(f"# {var}: {n}")
        if plan.skip:
            print(f"# {var}: not built with TensorRT {vstr(ver)}: {plan.skip}")
            continue
        print(shlex.join(plan.cmd))
        check = plan_version_command(engine_paths(args.model, var)["plan"], ver, tool)
        print(shlex.join(check) if check else
              "# plan check: deserialise with the Python runtime (trtexec 8.x has no "
              "--getPlanVersionOnly)")


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------
def build_record(args, variant: str, status: str, reason: str | None, started: float,
            inputs: Iterable[Path] = (), **fields) -> dict:
    v = VARIANTS[variant]
    rec = result_record(STAGE, "TensorRT", v.precision, args.model, v.build_tag,
                               status=status, reason=reason, variant=variant,
                               expected_failure=v.expected_failure, **fields)
    rec["provenance"] = provenance(args, list(inputs), started)
    inputs = list(inputs)
    if status == "ok" and fields.get("plan") and inputs:
        rec["source"] = engine_source(args.model, fields["plan"], inputs[0],
                                      rerun_command(rec["provenance"]))
        rec["stale_source"] = check_source(args.model, inputs[0],
                                           fp32_onnx_path(args.model))[1]
    return rec


def engine_source(model: str, plan: Path, onnx: Path, command: str | None) -> dict:
    """The ``source`` block of a built engine (:func:`deploykit.results.source_block`): the
    plan's SHA-256, the ONNX file it was built from, and that file's own recorded fp32.onnx and
    calibration data (its producer's record; the fp32.onnx itself for the FP32 variant), with
    the commands that made it, upstream first."""
    up = source_of(model, onnx) or {}
    is_fp32 = Path(onnx).resolve() == fp32_onnx_path(model).resolve()
    return source_block(plan, [*(up.get("made_by") or []), command],
                        fp32=onnx if is_fp32 else up.get("fp32"),
                        calibration=up.get("calibration"), onnx=onnx)


def check_sources(args, names: Sequence[str]) -> None:
    """Refuse to build an engine from a variant ONNX whose recorded fp32.onnx is not the
    current one (``--allow-stale-source`` builds it anyway, with the warning); an ONNX no
    record names is built with a warning (unknown source).

    Raises:
        StageError: naming the stale file(s), the remaking command(s) and the override.
    """
    stale = []
    for var in names:
        onnx = variant_onnx_path(args.model, var)
        _, why, warn = check_source(args.model, onnx, fp32_onnx_path(args.model))
        if warn:
            print(warn, file=sys.stderr)
        if why:
            stale.append(f"{var} ({onnx})")
    if stale and not getattr(args, "allow_stale_source", False):
        raise StageError(f"refusing to build engines from stale ONNX files: {', '.join(stale)} "
                         "(made from another fp32.onnx than the current one, above): remake "
                         "them with the commands above, or pass --allow-stale-source to build "
                         "them anyway (the rows record stale_source)")


def write_build_record(args, variant: str, rec: dict) -> Path:
    # A failed build that produced no plan keeps an earlier good row (and its plan); a row
    # that describes a plan now on disk (``plan`` set: a check failed after it was written)
    # replaces it (deploykit.results.write_result).
    return write_result(args.model, VARIANTS[variant].build_tag, rec,
                        keep_good=rec.get("plan") is None)


def _python_plan_check(plan: Path, env: Mapping[str, str], runtime) -> tuple[bool | None, str]:
    """Deserialise ``plan`` with the Python runtime in a child process (8.x plan check); a
    refusal is classified (deploykit.trt.parsers.classify_plan_load_error)."""
    code = (
        "import sys, tensorrt as trt\n"
        "class L(trt.ILogger):\n"
        "    def __init__(s):\n        trt.ILogger.__init__(s)\n"
        "    def log(s, sev, msg):\n        print(msg)\n"
        "rt = trt.Runtime(L())\n"
        "e = rt.deserialize_cuda_engine(open(sys.argv[1], 'rb').read())\n"
        "print('DESERIALIZED' if e is not None else 'FAILED')\n")
    rc, text = run_tool([sys.executable, "-c", code, str(plan)], env, timeout=300)
    if "DESERIALIZED" in text:
        return True, "deserialised by the Python runtime"
    if rc != 0 and "No module named" in text:
        return None, "Python tensorrt not importable: plan not checked"
    return False, diagnose_plan_load(plan, text, runtime)["text"]


def _verify_plan(plan: Path, det: Detected) -> dict:
    """Check the plan's TensorRT version against the runtime that will load it."""
    ver = det.version or (0,)
    runtime = det.python_runtime or det.libnvinfer_version
    cmd = plan_version_command(plan, ver, det.trtexec)
    if cmd is None:
        ok, detail = _python_plan_check(plan, det.env, det.python_runtime)
        return {"method": "python-deserialize", "plan_version": None,
                "runtime_version": vstr(det.python_runtime), "ok": ok, "detail": detail}
    rc, text = run_tool(cmd, det.env)
    pv = parse_plan_version(text)
    if pv is None:
        return {"method": "trtexec --getPlanVersionOnly", "plan_version": None,
                "runtime_version": vstr(runtime), "ok": False,
                "detail": f"no plan version in the output (rc={rc}): {text.strip()[-300:]}"}
    ok = same_version(pv, runtime)
    return {"method": "trtexec --getPlanVersionOnly", "plan_version": vstr(pv),
            "runtime_version": vstr(runtime), "ok": ok,
            "detail": "match" if ok else f"plan {vstr(pv)} vs runtime {vstr(runtime)}"}


def _prepare_inputs(args, plan: BuildPlan, version: Sequence[int], tool: str) -> BuildPlan:
    """Write what the build reads besides the variant's ONNX: the opset-17 file (after an exact
    ONNX Runtime parity check; otherwise fall back to the implicit path) or the calibration cache.
    """
    if plan.convert is not None:
        src_model = load_onnx(plan.convert_src)
        feed = parity_feed(src_model, {p.name: p.opt for p in plan.profiles})
        par = ort_parity(src_model, plan.convert, feed)
        plan.parity = par
        if par["exact"]:
            with atomic_path(plan.onnx) as tmp:
                import onnx

                onnx.save(plan.convert, str(tmp))
            plan.notes.append(f"opset-17 copy {plan.onnx.name}: ONNX Runtime parity exact on "
                              f"{par['n_tensors_compared']} tensors")
        else:
            if plan.int8 != "qdq_opset17" or args.int8_path == "qdq":
                raise StageError(f"{plan.variant}: the opset-17 copy of {plan.convert_src.name} "
                                 f"differs from it on ONNX Runtime (max |diff| "
                                 f"{par['max_abs_diff']:.3g}): re-export with `2_export_onnx.py "
                                 "--exporter legacy --opset 17`")
            plan.notes.append(f"opset-17 copy not exact on ONNX Runtime (max |diff| "
                              f"{par['max_abs_diff']:.3g}): implicit INT8 instead")
            args2 = argparse.Namespace(**{**vars(args), "int8_path": "implicit"})
            kept = plan.notes
            plan = plan_variant(args2, plan.variant, version, tool, build=True)
            plan.notes, plan.parity = kept + plan.notes, par
            return _prepare_inputs(args, plan, version, tool)
    if plan.int8 == "implicit":
        if not plan.scales:
            raise StageError(f"{plan.variant}: no per-tensor activation scale in "
                             f"{plan.source.name} matches a tensor of {plan.onnx.name}; the "
                             "implicit INT8 path has nothing to calibrate with")
        write_calibration_cache(plan.calib, plan.scales, encode_version_int(version))
    return plan


def _dla_check(args, plan: BuildPlan, text: str) -> dict:
    """DLA placement of a finished DLA build and its verdict (``ok`` False fails the row)."""
    placement = parse_dla_placement(text)
    res: dict[str, Any] = {"placement_found": bool(placement and placement["block_found"]),
                           "ok": True, "warning": None, "min_fraction": args.dla_min_fraction}
    if placement is None or not placement["block_found"]:
        res["warning"] = ("the build log has no 'Layers Running on DLA' block (builder INFO "
                          "messages missing?): DLA placement not checked")
        if placement and placement["no_dla_layer"]:
            res["warning"] = "TensorRT: no layer in the network can run on DLA"
            res["fraction"] = 0.0
        res["ok"] = args.dla_min_fraction is None
        return res
    nodes = trt_layer_names(_load(plan.onnx))
    frac = dla_fraction(placement, nodes)
    res.update(fraction=frac["fraction"], dla_layers=frac["dla_nodes"],
               gpu_layers=frac["gpu_nodes"], n_dla_subgraphs=frac["n_dla_subgraphs"],
               n_gpu_layers=frac["n_gpu_layers"], unmatched=frac["unmatched"],
               fallback_warnings=placement["fallback"])
    f = frac["fraction"]
    shown = "unknown" if f is None else f"{f:.0%}"
    summary = (f"{len(frac['dla_nodes'])} layer(s) on DLA, {len(frac['gpu_nodes'])} on the GPU "
               f"({shown} on DLA)")
    res["summary"] = summary
    if args.dla_min_fraction is not None:
        res["ok"] = f is not None and f >= args.dla_min_fraction
        if not res["ok"]:
            res["warning"] = f"{summary}: below --dla-min-fraction {args.dla_min_fraction:.0%}"
    elif f is None or f < DLA_MIN_FRACTION_WARN:
        res["warning"] = f"{summary}: below {DLA_MIN_FRACTION_WARN:.0%}"
    return res


def build_one(args, var: str, det: Detected, jetson: dict | None) -> tuple[dict, bool]:
    """Build one variant. Returns ``(record, unexpected_failure)``.

    trtexec writes the plan and its layer information into a fresh private folder beside the
    final plan (``tempfile.mkdtemp``: no predictable temporary name a link could be planted at),
    removed when the build ends, whatever its outcome.
    """
    folder = engine_paths(args.model, var)["plan"].parent
    folder.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=folder, prefix=f".tmp-{var}."))
    try:
        return _build_one(args, var, det, jetson, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build_one(args, var: str, det: Detected, jetson: dict | None, work: Path
               ) -> tuple[dict, bool]:
    """:func:`build_one` with its private work folder ``work``."""
    started = time.time()
    v = VARIANTS[var]
    paths = engine_paths(args.model, var)
    plan = plan_variant(args, var, det.version, str(det.trtexec), build=True)
    if plan.skip:
        return build_record(args, var, "skipped", plan.skip, started, [plan.source],
                       detected=det.as_dict(), **plan.record()), False
    plan = _prepare_inputs(args, plan, det.version, str(det.trtexec))
    inputs = [plan.source] + ([plan.onnx] if plan.onnx != plan.source else [])
    tmp_plan = work / paths["plan"].name
    tmp_layers = work / paths["layers"].name
    cmd = [a.replace(str(paths["plan"]), str(tmp_plan)).replace(str(paths["layers"]),
                                                                str(tmp_layers))
           if a.startswith(("--saveEngine=", "--exportLayerInfo=")) else a for a in plan.cmd]
    paths["plan"].parent.mkdir(parents=True, exist_ok=True)
    for n in plan.notes:
        print(f"[{var}] {n}", flush=True)
    print(f"[{var}] {shlex.join(cmd)}", flush=True)
    t0 = time.time()
    with atomic_path(paths["log"]) as tmp_log:
        with open(tmp_log, "w") as f:
            f.write(f"# command: {shlex.join(cmd)}\n")
            if det.loader_fix:
                f.write(f"# LD_LIBRARY_PATH first entry (loader fix): {det.loader_fix}\n")
            f.flush()
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=det.env)
    build_s = time.time() - t0
    text = paths["log"].read_text(errors="replace")
    passed = p.returncode == 0 and "&&&& PASSED" in text and tmp_plan.exists()
    fields: dict[str, Any] = {
        **plan.record(), "command": shlex.join(cmd), "returncode": p.returncode,
        "build_log": paths["log"], "build_wall_s": round(build_s, 2), "detected": det.as_dict(),
        "jetson": jetson, "unknown_options": parse_unknown_options(text),
        "errors": error_lines(text)}
    if not passed:
        for t in (tmp_plan, tmp_layers):
            t.unlink(missing_ok=True)
        if v.expected_failure:
            reason = ("expected failure reproduced: the CLI-quantised INT4 model does not parse; "
                      f"see {paths['log']}")
            return build_record(args, var, "failed", reason, started, inputs, reproduced=True,
                           **fields), False
        tail = "\n".join(text.splitlines()[-15:])
        print(f"[{var}] FAILED (rc={p.returncode}); log {paths['log']}:\n{tail}", file=sys.stderr)
        return build_record(args, var, "failed", f"trtexec failed (rc={p.returncode}); see "
                       f"{paths['log']}", started, inputs, **fields), True
    # Checked before it replaces anything: a build whose row fails leaves no plan under the final
    # name (stage 7 would evaluate it as built) and keeps the plan of an earlier good build.
    if tmp_layers.exists():
        summary = parse_layer_info(tmp_layers.read_text())
        fields["layer_info"] = layer_summary(summary)
        fields["layer_info_file"] = paths["layers"]
    fields["trtexec_perf"] = parse_performance_summary(text)
    fields["trtexec_inference_shapes"] = parse_inference_shapes(text)
    fields["size_mb"] = file_size_mb(tmp_plan)
    check = _verify_plan(tmp_plan, det)
    check["detail"] = str(check["detail"]).replace(str(tmp_plan), str(paths["plan"]))
    fields["plan_check"] = check
    failure = None
    if plan.dla_core is not None:
        dla = _dla_check(args, plan, text)
        fields["dla"] = dla
        if dla["warning"]:
            print(f"[{var}] DLA: {dla['warning']}", file=sys.stderr)
        if not dla["ok"]:
            failure = f"DLA: {dla['warning']}"
    if failure is None and not v.expected_failure and check["ok"] is False:
        failure = f"plan version check failed: {check['detail']}"
    if failure is not None:
        for t in (tmp_plan, tmp_layers):
            t.unlink(missing_ok=True)
        fields.pop("layer_info_file", None)
        kept = f"; {paths['plan']} left as it was" if paths["plan"].exists() else ""
        return build_record(args, var, "failed", f"{failure} (plan not kept{kept})", started, inputs,
                       **fields), True
    os.replace(tmp_plan, paths["plan"])
    if tmp_layers.exists():
        os.replace(tmp_layers, paths["layers"])
    fields["plan"] = paths["plan"]
    if v.expected_failure:
        return build_record(args, var, "ok", "expected the INT4 parse failure, but the build passed: "
                       "the reproduction no longer reproduces", started, inputs, reproduced=False,
                       **fields), False
    print(f"[{var}] ok: {paths['plan']} ({fields['size_mb']:.2f} MB), plan check: "
          f"{check['detail']}", flush=True)
    return build_record(args, var, "ok", None, started, inputs, **fields), False
