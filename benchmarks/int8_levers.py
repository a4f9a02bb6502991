#!/usr/bin/env python
"""INT8 quality levers for EfficientNet-Lite0, one by one, beside the public anchors (issue 22).

Every recipe is an ONNX Q/DQ file made from ``artifacts/<model>/onnx/fp32.onnx`` with the
calibration split (``artifacts/<model>/calib.npz``'s source images, 100), measured against the
PyTorch FP32 logits (``ref_logits.npz``, stage 1) on two disjoint halves of the evaluation split:
a **tuning** split (choices are made on it) and a **held-out** split (only reported). Accuracy
is the Q/DQ model's own semantics: ORT CPU EP, graph optimisations off, 1 thread (the fused
int8 kernels of this CPU without VNNI saturate; see deploykit/quant/ort_static.py).

Usage (from the repository root, after ``MODEL=efficientnet_lite0 bash run_all.sh --stop-stage 4``):

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/int8_levers.py --recipes ort_cg,ort_cg_bc
    python benchmarks/int8_levers.py --table      # rebuild results/int8_quality/levers.{json,md}

Each recipe's file goes to ``artifacts/<model>/int8q/<recipe>.onnx`` and its row to
``results/int8_quality/rows/<recipe>.json``; ``--table`` joins the rows.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
from deploykit.quant import act_calibration, bias_correction, graph, metrics, ort_static  # noqa: E402

MODEL = os.environ.get("INT8Q_MODEL", "efficientnet_lite0")  # real Lite0 weights only
ART = Path(common.model_artifacts(MODEL))
FP32 = ART / "onnx" / "fp32.onnx"
OUTDIR = ROOT / "results" / "int8_quality"
QDIR = ART / "int8q"
SEED = 0
TUNE_N = 450
SHAPE = (1, 3, 224, 224)


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------
_DATA: dict = {}


def data() -> dict:
    """Calibration inputs, tuning / held-out inputs with reference logits and labels."""
    if _DATA:
        return _DATA
    spec = common.model_spec(MODEL)
    xc, _, _ = common.load_split("calib", spec)
    xe, ye, fe = common.load_split("eval", spec)
    ref, mask = common.align_reference(ART / "ref_logits.npz", fe)
    assert mask.all(), "reference logits do not cover the eval split (rerun stage 1)"
    xc = common.normalize(xc, spec.mean, spec.std)
    xe = common.normalize(xe, spec.mean, spec.std)
    perm = np.random.default_rng(SEED).permutation(len(xe))
    tune, held = np.sort(perm[:TUNE_N]), np.sort(perm[TUNE_N:])
    _DATA.update(calib=xc, x=xe, y=ye, ref=ref, tune=tune, held=held,
                 files=[fe[i] for i in range(len(fe))])
    return _DATA


def evaluate(path: Path, split: str, optimize: bool = False, x64: bool = False) -> dict:
    d = data()
    idx = d[split]
    s = ort_static.session(path, optimize=optimize, x64_precision=x64)
    out = np.concatenate([o[0] for _, o in graph.run_batches(s, d["x"][idx], None, 25)])
    r = metrics.compare(out, d["ref"][idx], d["y"][idx])
    r["disagree_ub95_pct"] = metrics.disagreement_upper_bound(r["flips"], r["n"])
    return r


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# recipes: name -> (description, builder(out_path) -> extra dict)
# ------------------------------------------------------------------------------------------
def _onnx():
    import onnx
    return onnx


def depthwise_nodes(model) -> list[str]:
    inits = graph.initializers(model)
    out = []
    for n in model.graph.node:
        if n.op_type == "Conv" and graph.attr(n, "group", 1) > 1:
            out.append(n.name)
    return out


def base_ort(out: Path, **kw) -> dict:
    d = data()
    kw.setdefault("op_types", ("Conv", "Gemm", "Clip", "Relu"))
    ort_static.quantize(FP32, out, d["calib"], batch=25, **kw)
    return {"quantize_static": {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()}}


def cached_base(name: str, **kw) -> Path:
    """A base quantize_static file shared by the recipes that edit it."""
    p = QDIR / f"_base_{name}.onnx"
    if not p.exists():
        base_ort(p, **kw)
    return p


def with_levers(out: Path, base: Path, calib: str | None = None, bc_passes: int = 0,
                float_nodes=()) -> dict:
    onnx = _onnx()
    fp = onnx.load(str(FP32))
    q = onnx.load(str(base))
    info: dict = {"base": base.name}
    if float_nodes:
        raise NotImplementedError
    if calib:
        q, rec = act_calibration.calibrate(fp, q, data()["calib"], calib)
        info["act_calibration"] = calib
    if bc_passes:
        q, hist = bias_correction.bias_correct(fp, q, data()["calib"], passes=bc_passes)
        info["bias_correction"] = {"passes": bc_passes, "mean_abs_shift_per_pass": hist}
    onnx.save(q, str(out))
    return info


RECIPES: dict = {}


def _copy_stage5(variant):
    def f(out):
        import shutil
        src = ART / "onnx" / f"{variant}.onnx"
        if not src.exists():
            raise SystemExit(f"{src} missing: EPS=cpu MODEL={MODEL} bash 5_quantize.sh {variant}")
        shutil.copy(src, out)
        return {"made_by": f"EPS=cpu MODEL={MODEL} bash 5_quantize.sh {variant}"}
    return f


def recipe(name, desc):
    def deco(fn):
        RECIPES[name] = (desc, fn)
        return fn
    return deco


RECIPES["modelopt_int8_hp32"] = (
    "ours (stage 5): ModelOpt INT8, entropy, fp32 scales, Conv+Gemm, depthwise excluded",
    _copy_stage5("int8_hp32"))


@recipe("anchor_ort_default", "anchor: ORT quantize_static QDQ, U8 act / S8 weight, per-channel, "
        "MinMax, every op type ORT quantizes (logits quantized too), biases int32")
def _(out):
    return base_ort(out, op_types=None, quantize_bias=True, no_output_quantization=())


@recipe("ort_cg", "ours: quantize_static Conv+Gemm (+Clip/Relu folded into the conv's output "
        "range), U8/S8 per-channel, MinMax, logits float, biases float")
def _(out):
    import shutil
    shutil.copy(cached_base("cg"), out)
    return {"quantize_static": {"op_types": ["Conv", "Gemm", "Clip", "Relu"]}}


@recipe("ort_cg_bc", "ort_cg + empirical bias correction (2 passes, calibration split)")
def _(out):
    return with_levers(out, cached_base("cg"), bc_passes=2)


for _m in ("mse", "percentile:99.99", "percentile:99.999", "entropy"):
    def _mk(m):
        def f(out):
            return with_levers(out, cached_base("cg"), calib=m)
        return f
    RECIPES[f"ort_cg_{_m.replace(':', '').replace('.', '_')}"] = (
        f"ort_cg with every activation range by {_m} (our histograms)", _mk(_m))
    def _mk2(m):
        def f(out):
            return with_levers(out, cached_base("cg"), calib=m, bc_passes=2)
        return f
    RECIPES[f"ort_cg_{_m.replace(':', '').replace('.', '_')}_bc"] = (
        f"ort_cg, ranges by {_m}, + bias correction", _mk2(_m))


# ------------------------------------------------------------------------------------------
def machine() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = subprocess.run("grep -o 'avx512_vnni\\|avx_vnni' /proc/cpuinfo | sort -u",
                               shell=True, capture_output=True, text=True).stdout.split()
    except OSError:
        flags = []
    return {"cpu": cpu, "vnni": flags, "nproc": os.cpu_count(), "python": platform.python_version(),
            "versions": common.versions()}


def run_recipe(name: str, force: bool = False, held: bool = True) -> dict:
    QDIR.mkdir(parents=True, exist_ok=True)
    (OUTDIR / "rows").mkdir(parents=True, exist_ok=True)
    desc, fn = RECIPES[name]
    out = QDIR / f"{name}.onnx"
    t = time.time()
    extra = {}
    if force or not out.exists():
        extra = fn(out) or {}
    build_s = time.time() - t
    onnx = _onnx()
    m = onnx.load(str(out))
    share, nq, nall = graph.int8_mac_share(m, SHAPE)
    row = {"recipe": name, "description": desc, "file": str(out.relative_to(ROOT)),
           "sha256_16": sha(out), "int8_mac_pct": 100 * share, "int8_nodes": nq,
           "conv_gemm_nodes": nall, "build_s": round(build_s, 1), **extra}
    t = time.time()
    row["tune"] = evaluate(out, "tune")
    if held:
        row["held"] = evaluate(out, "held")
    row["eval_s"] = round(time.time() - t, 1)
    (OUTDIR / "rows" / f"{name}.json").write_text(json.dumps(row, indent=1))
    print(f"{name}: MACs {row['int8_mac_pct']:.1f}% tune agree {row['tune']['agree_pct']:.2f} "
          f"cos {row['tune']['cos_mean']:.5f}" + (f" | held agree {row['held']['agree_pct']:.2f} "
          f"cos {row['held']['cos_mean']:.5f}" if held else ""), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="", help="comma-separated recipe names (--list)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--force", action="store_true", help="rebuild the recipes' files")
    p.add_argument("--no-held", action="store_true", help="tuning split only")
    p.add_argument("--table", action="store_true", help="join results/int8_quality/rows")
    a = p.parse_args(argv)
    if a.list:
        for k, (d, _) in RECIPES.items():
            print(f"{k:32s} {d}")
        return 0
    for r in [r for r in a.recipes.split(",") if r]:
        run_recipe(r, force=a.force, held=not a.no_held)
    return 0


if __name__ == "__main__":
    sys.exit(main())
