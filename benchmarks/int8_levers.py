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
from deploykit.quant import (act_calibration, adaround, bias_correction, equalization,  # noqa: E402
                             graph, metrics, mixed_precision, ort_static)

MODEL = os.environ.get("INT8Q_MODEL", "efficientnet_lite0")  # real Lite0 weights only
ART = Path(common.model_artifacts(MODEL))
FP32 = ART / "onnx" / "fp32.onnx"
OUTDIR = Path(os.environ.get("INT8Q_OUT", ROOT / "results" / "int8_quality"))
QDIR = Path(os.environ.get("INT8Q_FILES", ART / "int8q"))
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
    # INT8Q_REF: a reference npz covering only some files (e.g. the tuning split, to fit a
    # transfer); the other rows are NaN and must not be evaluated (--no-held)
    ref_path = Path(os.environ.get("INT8Q_REF", ART / "ref_logits.npz"))
    part, mask = common.align_reference(ref_path, fe)
    if "INT8Q_REF" in os.environ:
        ref = np.full((len(fe), part.shape[1]), np.nan, np.float32)
        ref[mask] = part
    else:
        assert mask.all(), "reference logits do not cover the eval split (rerun stage 1)"
        ref = part
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


BASES = {"cg": {}, "cle": {"cle": True}, "s8": {"activation_type": "s8"}}


def cle_fp32() -> Path:
    """The float model after cross-layer equalization (same function)."""
    p = QDIR / "_fp32_cle.onnx"
    if not p.exists():
        onnx = _onnx()
        m, log = equalization.equalize(onnx.load(str(FP32)))
        onnx.save(m, str(p))
        (QDIR / "_fp32_cle.json").write_text(json.dumps(log, indent=1))
    return p


def cached_base(name: str) -> Path:
    """A base quantize_static file shared by the recipes that edit it."""
    p = QDIR / f"_base_{name}.onnx"
    if not p.exists():
        kw = dict(BASES[name])
        src = cle_fp32() if kw.pop("cle", False) else FP32
        d = data()
        ort_static.quantize(src, p, d["calib"], batch=25,
                            op_types=("Conv", "Gemm", "Clip", "Relu"), **kw)
    return p


def base_fp(name: str) -> Path:
    return cle_fp32() if BASES[name].get("cle") else FP32


def with_levers(out: Path, base: Path, calib: str | None = None, bc_passes: int = 0,
                float_nodes=(), fp_path: Path = FP32, ada: bool = False) -> dict:
    """Levers in this order: float nodes, activation ranges, AdaRound (weights rounded on the
    calibration images with those ranges), bias correction (measured on the rounded weights)."""
    onnx = _onnx()
    fp = onnx.load(str(fp_path))
    q = onnx.load(str(base))
    info: dict = {"base": base.name}
    if float_nodes:
        q = mixed_precision.make_float(q, fp, float_nodes)
        info["float_nodes"] = list(float_nodes)
    if calib:
        q, rec = act_calibration.calibrate(fp, q, data()["calib"], calib)
        info["act_calibration"] = calib
    if ada:
        q, alog = adaround.adaround(fp, q, data()["calib"], ADA_CFG)
        info["adaround"] = {"mode": alog["mode"], "seconds": alog["seconds"],
                            "config": alog["config"], "skipped": alog["skipped"],
                            "layers": alog["layers"]}
    if bc_passes:
        q, log = bias_correction.bias_correct(fp, q, data()["calib"])
        info["bias_correction"] = {"mode": "sequential", "layers": len(log),
                                   "mean_abs_shift": float(np.mean([r["mean_abs_shift"] for r in log]))}
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


def _lever(base, calib=None, bc=False, float_from=None, ada=False):
    def f(out):
        fl = ()
        if float_from:
            fl = json.loads((OUTDIR / f"search_{float_from}.json").read_text())["float_nodes"]
        return with_levers(out, cached_base(base), calib=calib, bc_passes=int(bc),
                           float_nodes=fl, fp_path=base_fp(base), ada=ada)
    return f


# AdaRound (Nagel et al. 2020) settings of the recipes below; INT8Q_ADA_ITERS overrides iters
ADA_CFG = adaround.Config(iters=int(os.environ.get("INT8Q_ADA_ITERS", 500)))


def _tag(m):
    return m.replace(":", "").replace(".", "_")


for _b, _bd in (("cg", "ort_cg"), ("cle", "CLE + ort_cg"), ("s8", "ort_cg with S8 symmetric activations (TensorRT-style)")):
    for _m in (None, "mse", "percentile:99.99", "percentile:99.999", "entropy"):
        for _bc in (False, True):
            name = "ort_" + _b + (f"_{_tag(_m)}" if _m else "") + ("_bc" if _bc else "")
            if name == "ort_cg":
                continue
            desc = _bd + (f", activation ranges by {_m} (our histograms)" if _m else "") + (
                ", + bias correction (layer by layer)" if _bc else "")
            RECIPES[name] = (desc, _lever(_b, _m, _bc))


# ORT's own Entropy calibrator (issue: it returned the MinMax ranges unchanged)
@recipe("ort_cg_ortentropy", "ort_cg calibrated by ORT's CalibrationMethod.Entropy")
def _(out):
    return base_ort(out, method="entropy")


# ------------------------------------------------------------------------------------------
# NNCF anchors (benchmark-only dependency: benchmarks/requirements.txt)
# ------------------------------------------------------------------------------------------
def _nncf_quantize(out, fast_bc=True, disable_bc=False, ignore_dw=False):
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters
    onnx = _onnx()
    m = onnx.load(str(FP32))
    name = m.graph.input[0].name
    xc = data()["calib"]
    ds = nncf.Dataset([xc[i:i + 1] for i in range(len(xc))], lambda b: {name: b})
    kw = {}
    if ignore_dw:
        kw["ignored_scope"] = nncf.IgnoredScope(names=depthwise_nodes(m))
    q = nncf.quantize(m, ds, subset_size=len(xc), fast_bias_correction=fast_bc,
                      advanced_parameters=AdvancedQuantizationParameters(
                          disable_bias_correction=disable_bc), **kw)
    onnx.save(q, str(out))
    return {"nncf": {"version": nncf.__version__, "fast_bias_correction": fast_bc,
                     "disable_bias_correction": disable_bc, "depthwise_ignored": ignore_dw,
                     "subset_size": len(xc)}}


RECIPES["anchor_nncf_default"] = ("anchor: NNCF default (fast bias correction, all quantized)",
                                  lambda o: _nncf_quantize(o))
RECIPES["anchor_nncf_nobc"] = ("anchor: NNCF, bias correction disabled",
                               lambda o: _nncf_quantize(o, disable_bc=True))
RECIPES["anchor_nncf_fullbc"] = ("anchor: NNCF, full bias correction",
                                 lambda o: _nncf_quantize(o, fast_bc=False))
RECIPES["anchor_nncf_fullbc_dw_ignored"] = ("anchor: NNCF, full bias correction, depthwise ignored",
                                            lambda o: _nncf_quantize(o, fast_bc=False, ignore_dw=True))


@recipe("anchor_nncf_ac", "anchor: NNCF quantize_with_accuracy_control, metric = top-1 agreement "
        "on the tuning split, max_drop 0.005 absolute")
def _(out):
    import nncf
    onnx = _onnx()
    m = onnx.load(str(FP32))
    name = m.graph.input[0].name
    d = data()
    xc = d["calib"]
    cal = nncf.Dataset([xc[i:i + 1] for i in range(len(xc))], lambda b: {name: b})
    tune = d["tune"]
    vd = nncf.Dataset([(d["x"][i:i + 1], int(d["ref"][i].argmax())) for i in tune])

    def vfn(model, items):
        s = ort_static.session(model.SerializeToString(), optimize=False)
        return float(np.mean([s.run(None, {name: x})[0].argmax() == y for x, y in items]))

    q = nncf.quantize_with_accuracy_control(m, cal, vd, validation_fn=vfn, max_drop=0.005,
                                            drop_type=nncf.DropType.ABSOLUTE,
                                            subset_size=len(xc))
    onnx.save(q, str(out))
    return {"nncf": {"version": nncf.__version__, "accuracy_control": {"max_drop": 0.005,
                     "metric": "top-1 agreement on the tuning split", "n": int(len(tune))}}}


# ------------------------------------------------------------------------------------------
# mixed precision: rank nodes (float-one) on the tuning split, then keep a prefix float
# ------------------------------------------------------------------------------------------
def _rank_model(base: str):
    """(float model, Q/DQ model) of a base name, or of ``file:<recipe>`` (a built recipe)."""
    onnx = _onnx()
    if base.startswith("file:"):
        return onnx.load(str(FP32)), onnx.load(str(QDIR / f"{base[5:]}.onnx"))
    return onnx.load(str(base_fp(base))), onnx.load(str(cached_base(base)))


def _rank_tag(base: str) -> str:
    return base.replace("file:", "f_")


def rank_shard(base: str, shard: int, nshards: int, n_img: int) -> None:
    fp, q = _rank_model(base)
    mc = graph.macs(q, SHAPE)
    cands = sorted(mc)[shard::nshards]
    d = data()
    idx = d["tune"][:n_img]

    def err(model):
        s = ort_static.session(model.SerializeToString(), optimize=False)
        out = np.concatenate([o[0] for _, o in graph.run_batches(s, d["x"][idx], None, 25)])
        r = metrics.compare(out, d["ref"][idx])
        return {"one_minus_cos": 1 - r["cos_mean"], "flips": r["flips"]}

    rows = []
    for c in cands:
        r = err(mixed_precision.make_float(q, fp, [c]))
        rows.append({"node": c, "macs": mc[c], **r})
    (OUTDIR / "rank").mkdir(parents=True, exist_ok=True)
    (OUTDIR / "rank" / f"{_rank_tag(base)}_{shard}.json").write_text(json.dumps(
        {"n_img": int(len(idx)), "rows": rows}, indent=1))


def rank_join(base: str, n_img: int) -> dict:
    """Join the shards; the all-INT8 error comes from the ort_<base> row measured on the
    same images when present (else from the search's own evaluation)."""
    rows = []
    for f in sorted((OUTDIR / "rank").glob(f"{_rank_tag(base)}_*.json")):
        rows += json.loads(f.read_text())["rows"]
    return {"rows": rows}


def search(base: str, n_img: int, budget_float_mac_pct: float = 10.0) -> dict:
    """Prefixes of the ranking (error removed per MAC) within the MAC budget; writes
    ``search_<base>.json`` with every prefix measured on the tuning split (all images)."""
    fp, q = _rank_model(base)
    mc = graph.macs(q, SHAPE)
    tot = sum(mc.values())
    d = data()
    idx = d["tune"][:n_img]
    s = ort_static.session(q.SerializeToString(), optimize=False)
    out = np.concatenate([o[0] for _, o in graph.run_batches(s, d["x"][idx], None, 25)])
    e0 = 1 - metrics.compare(out, d["ref"][idx])["cos_mean"]
    rows = rank_join(base, n_img)["rows"]
    for r in rows:
        r["removed"] = e0 - r["one_minus_cos"]
        r["per_mac"] = r["removed"] / r["macs"]
    rows.sort(key=lambda r: -r["per_mac"])
    chosen, used = [], 0
    for r in rows:
        if r["removed"] <= 0:
            continue
        if 100 * (used + r["macs"]) / tot > budget_float_mac_pct:
            continue
        chosen.append(r["node"])
        used += r["macs"]
    res = {"base": base, "rank_images": n_img, "all_int8_one_minus_cos": e0, "ranking": rows,
           "float_nodes": chosen, "float_mac_pct": 100 * used / tot,
           "budget_float_mac_pct": budget_float_mac_pct}
    (OUTDIR / f"search_{_rank_tag(base)}.json").write_text(json.dumps(res, indent=1))
    return res


# float nodes ranked on the corrected all-INT8 file (ort_cg_mse_bc), then BC redone on top
for _m in ("mse", "percentile:99.999"):
    RECIPES[f"mp2_cg_{_tag(_m)}_bc"] = (
        f"ort_cg + {_m} ranges + bias correction, the nodes of search_f_ort_cg_mse_bc.json "
        "(ranked on ort_cg_mse_bc itself) kept float (<= 10 % MACs)",
        _lever("cg", _m, True, float_from="f_ort_cg_mse_bc"))

for _b in BASES:
    for _m in (None, "mse", "percentile:99.999"):
        for _bc in (False, True):
            name = "mp_" + _b + (f"_{_tag(_m)}" if _m else "") + ("_bc" if _bc else "")
            RECIPES[name] = (f"ort_{_b}" + (f" + {_m} ranges" if _m else "") +
                             (" + bias correction" if _bc else "") +
                             ", + the nodes of search_" + _b + ".json kept float (<= 10 % MACs)",
                             _lever(_b, _m, _bc, float_from=_b))


# AdaRound: on the all-INT8 base, and before bias correction on the best points (same float
# nodes and activation ranges as mp_cg_mse_bc / mp_cg_percentile99_999_bc)
RECIPES["ort_cg_ar"] = ("ort_cg + AdaRound (weights rounded on the calibration images, "
                        "sequential, Nagel et al. 2020)", _lever("cg", ada=True))
RECIPES["ort_cg_ar_bc"] = ("ort_cg + AdaRound + bias correction", _lever("cg", None, True,
                                                                         ada=True))
for _m in ("mse", "percentile:99.999"):
    RECIPES[f"mp_cg_{_tag(_m)}_ar_bc"] = (
        f"ort_cg + {_m} ranges + AdaRound + bias correction, + the nodes of search_cg.json kept "
        "float (<= 10 % MACs)", _lever("cg", _m, True, float_from="cg", ada=True))
    RECIPES[f"mp_cg_{_tag(_m)}_ar"] = (
        f"ort_cg + {_m} ranges + AdaRound, + the nodes of search_cg.json kept float "
        "(<= 10 % MACs)", _lever("cg", _m, False, float_from="cg", ada=True))


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
           "conv_gemm_nodes": nall, "build_s": round(build_s, 1),
           "machine": {k: v for k, v in machine().items() if k != "versions"},
           "onnxruntime": common.versions().get("onnxruntime"), **extra}
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


def _run_one(args):
    name, force, held = args
    try:
        return run_recipe(name, force=force, held=held)
    except Exception as e:  # a failed recipe is a row too
        import traceback
        row = {"recipe": name, "description": RECIPES[name][0], "status": "failed",
               "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        (OUTDIR / "rows").mkdir(parents=True, exist_ok=True)
        (OUTDIR / "rows" / f"{name}.json").write_text(json.dumps(row, indent=1))
        print(f"{name}: FAILED {row['error']}", flush=True)
        return row


def _pool(fn, items, jobs):
    if jobs <= 1:
        return [fn(i) for i in items]
    import multiprocessing as mp
    with mp.get_context("fork").Pool(jobs, maxtasksperchild=1) as pool:
        return pool.map(fn, items, chunksize=1)


def _rank_job(a):
    rank_shard(*a)


def _base_job(b):
    cached_base(b)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default="", help="comma-separated recipe names (--list)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--force", action="store_true", help="rebuild the recipes' files")
    p.add_argument("--no-held", action="store_true", help="tuning split only")
    p.add_argument("--jobs", type=int, default=1, help="parallel processes (1 thread each)")
    p.add_argument("--bases", default="", help="build these base files first (cg,cle,s8)")
    p.add_argument("--rank", default="", help="base: float-one ranking of every node")
    p.add_argument("--rank-images", type=int, default=TUNE_N,
                   help="tuning images the ranking and search use (the first N of the split)")
    p.add_argument("--search", default="", help="base: choose the float nodes from --rank")
    p.add_argument("--float-mac-budget", type=float, default=10.0)
    p.add_argument("--table", action="store_true", help="join the rows into levers.{json,md}")
    a = p.parse_args(argv)
    if a.list:
        for k, (d, _) in RECIPES.items():
            print(f"{k:32s} {d}")
        return 0
    QDIR.mkdir(parents=True, exist_ok=True)
    OUTDIR.mkdir(parents=True, exist_ok=True)
    data()
    bases = [b for b in a.bases.split(",") if b]
    if bases:
        if "cle" in bases:
            cle_fp32()
        _pool(_base_job, bases, min(a.jobs, len(bases)))
    if a.rank:
        if not a.rank.startswith("file:"):
            cached_base(a.rank)
        n = max(1, a.jobs)
        _pool(_rank_job, [(a.rank, i, n, a.rank_images) for i in range(n)], n)
    if a.search:
        r = search(a.search, a.rank_images, a.float_mac_budget)
        print(f"search {a.search}: {len(r['float_nodes'])} float nodes, "
              f"{r['float_mac_pct']:.2f} % MACs float", flush=True)
    names = [r for r in a.recipes.split(",") if r]
    if names:
        _pool(_run_one, [(n, a.force, not a.no_held) for n in names], a.jobs)
    if a.table:
        write_table()
    return 0


def _fmt(m: dict | None) -> str:
    if not m:
        return " | "
    return f"{m['agree_pct']:.2f} ({m['flips']}) | {m['cos_mean']:.6f} ({m['cos_min']:.4f})"


def write_table() -> None:
    """Join ``rows/`` (this machine: tuning and held-out), ``tuneonly/rows`` (this machine,
    tuning split only) and ``rows_device/`` (a second CPU machine, tuning split only: the
    held-out reference was not sent there) into ``levers.{json,md}``."""
    rows = []
    for sub in ("rows", "tuneonly/rows", "rows_device"):
        for f in sorted((OUTDIR / sub).glob("*.json")):
            r = json.loads(f.read_text())
            r["rows_dir"] = sub
            rows.append(r)
    (OUTDIR / "levers.json").write_text(json.dumps({"machine_here": machine(), "tune_n": TUNE_N,
                                                    "held_n": 900 - TUNE_N, "seed": SEED,
                                                    "rows": rows}, indent=1))
    lines = ["| recipe | INT8 MACs % | tune agree % (flips) | tune cos mean (min) | "
             "held agree % (flips) | held cos mean (min) | held top-1 % | held disagree 95 % UB | "
             "machine (ORT) | description |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") == "failed":
            lines.append(f"| {r['recipe']} | | failed | | | | | | | {r['error'][:120]} |")
            continue
        h = r.get("held")
        mach = r.get("machine", {})
        where = (f"{mach.get('cpu', '')}{' VNNI' if mach.get('vnni') else ' no VNNI'} "
                 f"({r.get('onnxruntime', '')})")
        desc = r["description"] + (f" **INVALID: {r['invalid']}**" if r.get("invalid") else "")
        lines.append(
            f"| {r['recipe']} | {r['int8_mac_pct']:.1f} | {_fmt(r['tune'])} | {_fmt(h)} | "
            + (f"{h['top1_pct']:.2f} | {h['disagree_ub95_pct']:.2f} |" if h else " | |")
            + f" {where} | {desc} |")
    (OUTDIR / "levers.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
