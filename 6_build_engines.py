#!/usr/bin/env python3
"""Stage 6: build one TensorRT engine per ONNX variant with trtexec.

Reads artifacts/<model>/onnx/<variant>.onnx (written by 2_export_onnx.py, 5_quantize.sh and
5b_quantize_int4.py). Writes artifacts/<model>/engines/<variant>.plan, <variant>.build.log and
<variant>.layers.json, the shared engines/timing.cache (kept between builds), for TensorRT 8.x
Q/DQ builds engines/<variant>.opset17.onnx, for implicit INT8 builds (DLA, or 8.x when the Q/DQ
file has no exact opset-17 form) engines/<variant>.calib.cache, and results/<model>/
trt_build_<variant>.json with the command, the versions, the optimisation profile that stage 7
uses, the DLA placement and the plan check.

The trtexec flags follow the TensorRT version that trtexec really loads (trt_tools.py; the rule
table with its sources is in the README, section "TensorRT"). Every input and every dynamic axis
gets a profile: the batch axis from --min-batch/--opt-batch/--max-batch, other dynamic axes from
--input-shape or --min-shapes/--opt-shapes/--max-shapes; DLA builds get a static profile. Without
trtexec every variant gets a skipped row and the stage exits 0. --dry-run prints the exact command
lines for --trt-version without TensorRT or a GPU and writes nothing.

Variants: the default list is `python variants.py list --stage 6` (those whose ONNX exists);
any registry variant can be named. Rerun alone:

    bash 6_build_engines.sh --model efficientnet_lite0 fp16 int8
    bash 6_build_engines.sh --dry-run --trt-version 8.6.2 --dla-core 0 fp16 int8
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from deploykit.variants import VARIANTS
from deploykit.cli import add_shared_args, cli, stage_parser
from deploykit.io import require
from deploykit.errors import StageError, UsageError
from deploykit.layout import engines_dir, model_artifacts, model_results, variant_onnx_path
from deploykit.lock import lock_folders
from deploykit.trt.detect import detect_with_loader_fix, find_trtexec, jetson_info
from deploykit.trt.rules import (
    DEFAULT_VARIANTS,
    DLA_MIN_FRACTION_WARN,
    check_supported,
)
from deploykit.trt.build import (
    STAGE,
    build_one,
    check_args,
    check_sources,
    check_dla_version,
    dry_run,
    build_record,
    write_build_record,
    plan_variant,
)




def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__, prog="6_build_engines.py")
    add_shared_args(p, "model", "input_shape")
    p.add_argument("variants", nargs="*", metavar="VARIANT",
                   help=f"any of {', '.join(VARIANTS)} (default: "
                        f"{' '.join(DEFAULT_VARIANTS)}, those whose ONNX exists)")
    p.add_argument("--allow-stale-source", action="store_true",
                   help="build from a variant ONNX whose recorded fp32.onnx (quant_<variant>.json"
                        ", export.json) is not the current fp32.onnx (refused by default)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the trtexec command lines for --trt-version and exit (writes "
                        "nothing, needs no TensorRT)")
    p.add_argument("--trt-version", help="TensorRT version for --dry-run, e.g. 8.6.2, 10.3, 11.0")
    p.add_argument("--min-batch", type=int, default=1,
                   help="smallest batch of a dynamic batch axis")
    p.add_argument("--opt-batch", type=int, default=1,
                   help="batch the builder optimises for (trtexec's timing in the build log uses "
                        "it; the fixed batch of DLA builds)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="largest batch of a dynamic batch axis")
    for which in ("min", "opt", "max"):
        p.add_argument(f"--{which}-shapes", action="append", default=None, metavar="SPEC",
                       help=f"{which} shapes of inputs in trtexec syntax, name:DxDxD[,name2:DxD]; "
                            "quote names with ':' ('input:0':1x3x32x32); repeatable; --opt-shapes "
                            "alone fixes min = opt = max")
    p.add_argument("--mem-pool-mb", type=int, default=None,
                   help="workspace memory pool limit in MiB (--memPoolSize); default: trtexec's")
    p.add_argument("--dla-core", type=int, default=None,
                   help="Jetson: build FP16/INT8 variants for DLA core N (static profile, GPU "
                        "fallback, INT8 from a calibration cache); others stay on the GPU")
    p.add_argument("--dla-min-fraction", type=float, default=None,
                   help="fail a DLA build row when fewer than this fraction (0..1) of the model's "
                        "layers run on the DLA (default: only warn below "
                        f"{DLA_MIN_FRACTION_WARN * 100:.0f} %%)")
    p.add_argument("--int8-path", choices=("auto", "qdq", "implicit"), default="auto",
                   help="INT8 Q/DQ variants: auto = the rule for the TensorRT version and device "
                        "(README, 'TensorRT'), qdq = the Q/DQ file (opset 17 on 8.x), implicit = "
                        "FP32 ONNX + calibration cache from the Q/DQ scales")
    p.add_argument("--no-tf32", action="store_true", help="pass --noTF32")
    return p


def main(args: argparse.Namespace) -> None:
    """Build (or, with ``--dry-run``, print) the engines of the requested variants."""
    started = time.time()
    check_args(args)
    names = list(dict.fromkeys(args.variants)) or list(DEFAULT_VARIANTS)
    if args.dry_run:
        dry_run(args, names)
        return
    # one writer per folder, held until this process exits (a second writer is refused)
    lock_folders(model_artifacts(args.model), model_results(args.model))
    trtexec, how = find_trtexec()
    if trtexec is None:
        reason = f"{how}; engines not built (set TRTEXEC=/path/to/trtexec on a GPU machine)"
        print(f"{STAGE}: SKIPPED: {reason}")
        for var in names:
            src = variant_onnx_path(args.model, var)
            why = reason if src.exists() else (
                f"{src} missing (made by {VARIANTS[var].producer}); and {reason}")
            path = write_build_record(args, var, build_record(args, var, "skipped", why, started))
            print(f"  wrote {path}")
        return
    if args.variants:
        for var in names:
            require(variant_onnx_path(args.model, var), VARIANTS[var].producer)
    else:
        names = [v for v in names if variant_onnx_path(args.model, v).exists()]
        if not names:
            wanted = ", ".join(f"{variant_onnx_path(args.model, v)} ({VARIANTS[v].producer})"
                               for v in DEFAULT_VARIANTS)
            raise StageError(f"no ONNX model to build; expected any of: {wanted}")
    check_sources(args, names)  # an ONNX made from another fp32.onnx: refused (override)
    det, probs = detect_with_loader_fix(trtexec)
    print(f"{STAGE}: trtexec {trtexec} ({how}); " + json.dumps(det.as_dict()))
    if det.loader_fix:
        print(f"{STAGE}: versions agree with {det.loader_fix} first on LD_LIBRARY_PATH "
              "(put it there in env.sh to make this permanent)")
    if probs:
        raise StageError("TensorRT versions disagree, refusing to build plans the runtime cannot "
                         "load:\n  - " + "\n  - ".join(probs) +
                         "\n  The loader-path fix (library folder of the Python runtime, "
                         "<trtexec>/../lib, $TENSORRT_HOME/lib first on LD_LIBRARY_PATH; env.sh "
                         "does this) did not help: install trtexec and the Python tensorrt "
                         "package of the same version, or point TRTEXEC at the matching trtexec.")
    if det.version is None:
        raise StageError(f"cannot tell which TensorRT {trtexec} uses ({det.ldd})")
    check_supported(det.version)
    if det.python_runtime is None:
        print(f"{STAGE}: warning: Python tensorrt not importable ({det.python_detail}); "
              "7_trt_eval.py will skip", file=sys.stderr)
    jetson = jetson_info()
    if args.dla_core is not None:
        if jetson is None:
            raise UsageError("--dla-core: DLA exists on Jetson (Xavier/Orin) only; this is not "
                             "a Jetson")
    check_dla_version(args, det.version)
    for var in names:  # usage problems (shapes, flags) surface before anything is built
        plan_variant(args, var, det.version, str(trtexec), build=False)
    failed = []
    for var in names:
        try:
            rec, bad_fail = build_one(args, var, det, jetson)
        except StageError as e:
            rec, bad_fail = build_record(args, var, "failed", str(e), started), True
        path = write_build_record(args, var, rec)
        print(f"  {var}: {rec['status']}{': ' + rec['reason'] if rec['reason'] else ''} -> {path}")
        if bad_fail:
            failed.append(var)
    if failed:
        raise StageError(f"engine build failed for {', '.join(failed)} (logs in "
                         f"{engines_dir(args.model)})")


if __name__ == "__main__":
    cli(get_args_parser, main)
