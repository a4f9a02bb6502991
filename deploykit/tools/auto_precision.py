"""Mixed precision chosen for an accuracy budget: which nodes of an INT8 Q/DQ model to keep in
float, found by measurement (the ``int8_auto`` variant of stage 5).

No existing tool does this for a Q/DQ ONNX model headed to TensorRT: Polygraphy's precision
bisection works on TensorRT layers and on builder precision flags that TensorRT 11 removed;
ModelOpt's AutoQuantize works on PyTorch modules and optimises a bit budget, not an accuracy
budget. How it works:

1. **Quantize once.** ModelOpt quantizes every candidate with the ``int8_auto`` recipe of
   ``variants.py`` and no exclusion (Conv+Gemm, fp32 scales; run through ``qdq_tools.py
   modelopt``, the calibration batch of ``deploykit.quant.calibration.calibration_plan``). The candidates are the
   Conv/ConvTranspose/Gemm/MatMul nodes it quantized.
2. **Edit, do not re-quantize.** "Only node k in INT8" and "only node k in float" are made by
   editing that Q/DQ graph: a node kept in float reads its float weight and its float input
   instead of their DequantizeLinear outputs. An activation Q/DQ pair is shared by every
   consumer of the tensor (ONNX Runtime's quantizer, which ModelOpt drives, rewires all of them,
   ``DedicatedQDQPair=False``), so an input stays quantized while any other INT8 candidate reads
   it: exactly what ModelOpt's ``--nodes_to_exclude`` produces.
3. **Measure on the graph's own semantics.** Every configuration runs on ONNX Runtime's CPU EP
   with all graph optimisations disabled (DequantizeLinear + float operators), on the tuning
   split (disjoint from calibration and evaluation), against the FP32 ONNX model run the same
   way: top-1 agreement, logits cosine (mean and min over images; with several outputs the
   worst output's), top-1; NaN/Inf outputs miss every budget. Never ORT's fused
   int8 kernels: on x86-64 CPUs without VNNI their u8s8 arithmetic saturates (onnxruntime PR
   #12088) and would be measured instead of the quantization.
4. **Choose.** Per node: the error it adds when it alone is INT8 and the error removed when it
   alone is kept in float (cosine and agreement). Nodes are ranked by error per MAC (score =
   the larger of the two cosine errors; ties by graph order: deterministic) and every prefix of
   that ranking is measured once (the *path*: MACs in INT8 against accuracy, independent of the
   budget). The budget picks the shortest prefix that meets it; then (unless ``--no-prune``)
   each node of it is tried back in INT8, largest MACs first, and stays INT8 when the budget
   still holds (one measured configuration per node; ranking mistakes of the single-node
   estimates are undone here).
5. **Re-quantize and verify.** ``5_quantize.sh int8_auto`` re-runs ModelOpt with the chosen
   ``--nodes_to_exclude`` (anchored ``^name$``: ModelOpt uses ``re.match``), then ``verify``
   measures that file on the tuning split (it must meet the budget and match the searched
   configuration) and on the evaluation split (reported as met or missed, by how much).

Every configuration's metrics are cached (``artifacts/<model>/auto_precision/cache/<key>.json``,
key = SHA-256 of the FP32 model, the base Q/DQ model, the calibration data, the tuning data and
the measurement mode), and so is the base Q/DQ model: a rerun with another budget reads the
per-node measurements and the path from the cache and only measures the pruning trials it has
not seen (none with ``--no-prune``: seconds).

Subcommands::

    python auto_precision.py search --model M [budget flags]   # prints the ^name$ regexes
    python auto_precision.py verify --model M --onnx artifacts/M/onnx/int8_auto.onnx
    python auto_precision.py macs F.onnx                       # MACs per node, fraction in INT8

Writes: ``artifacts/<model>/auto_precision/`` (base model, cache, logs, and
``auto_precision.{json,md,png}``: exclusion list with each node's sensitivity and MACs, the
fraction of MACs in INT8, tuning and evaluation metrics, the per-node sensitivity plot), which
``5_quantize.sh int8_auto`` publishes to ``results/<model>/`` once the file is installed (as
``auto_precision.failed.*`` beside the good record when it is not).

"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import time
from pathlib import Path
import numpy as np

from deploykit.layout import calib_path, fp32_onnx_path
from deploykit.cli import HelpFormatter, add_shared_args, check_positive, stage_parser
from deploykit.io import require
from deploykit.envinfo import device_info, versions
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import classifier_data
from deploykit.io import check_writable, load_json, sha256_file
from deploykit.layout import model_artifacts, model_results
from deploykit.lock import lock_folders
from deploykit.models import model_spec
from deploykit.onnx.graph import graph_inputs, load_onnx
from deploykit.quant.auto.inputs import base_qdq, tuning_data
from deploykit.quant.auto.report import fmt_num, publish, record_paths, write_outputs
from deploykit.quant.auto.search import (
    Budget,
    Cache,
    DEFAULT_BUDGET,
    MODE,
    SEMANTICS,
    VARIANT,
    anchored,
    budget_warnings,
    cached_outputs,
    data_digest,
    fmt_metrics,
    output_metrics,
    run_model,
    search,
)
from deploykit.quant.auto.space import QdqSpace
from deploykit.quant.macs import MAC_OPS, mac_summary, mac_table
from deploykit.results import provenance


def _budget_arg(text: str) -> float | None:
    if text.lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number, or 'off'") from None


def budget_from_args(args: argparse.Namespace) -> Budget:
    """:class:`Budget` from ``--min-agreement/--min-cosine/--max-top1-drop``.

    Raises:
        UsageError: a bound outside its range, or every bound off.
    """
    b = Budget(args.min_agreement, args.min_cosine, args.max_top1_drop)
    if b.min_agreement is not None and not 0 <= b.min_agreement <= 100:
        raise UsageError(f"--min-agreement {b.min_agreement}: a percentage in [0, 100]")
    if b.min_cosine is not None and not -1 <= b.min_cosine <= 1:
        raise UsageError(f"--min-cosine {b.min_cosine}: a cosine similarity lies in "
                         "[-1, 1]")
    if b.max_top1_drop is not None and b.max_top1_drop < 0:
        raise UsageError(f"--max-top1-drop {b.max_top1_drop}: points, >= 0")
    if b.min_agreement is None and b.min_cosine is None and b.max_top1_drop is None:
        raise UsageError("every budget bound is off: give at least one of "
                         "--min-agreement, --min-cosine, --max-top1-drop")
    return b


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
def _paths(args) -> tuple[Path, Path]:
    art = model_artifacts(args.model)
    fp32 = Path(args.fp32) if args.fp32 else fp32_onnx_path(args.model)
    work = Path(args.work_dir) if args.work_dir else art / "auto_precision"
    return fp32, work


def _lock(args, *folders: Path) -> None:
    """One writer per folder (:func:`deploykit.lock.lock_folders`): the model's artifacts and
    results folders and the folders this command writes, held until the process exits; a
    second writer is refused at once (exit 1), naming the holder. Stage 5 runs this tool as its
    child: its own lock covers it."""
    lock_folders(model_artifacts(args.model), model_results(args.model), *folders)


def _fp32_reference(fp32: Path, data, work: Path, digest: str, batch: int, what: str
                    ) -> dict[str, np.ndarray]:
    key = hashlib.sha256(f"{sha256_file(fp32)}:{digest}:{MODE}".encode()).hexdigest()[:20]
    return cached_outputs(work / "cache" / f"{key}.{what}_fp32.npz",
                          lambda: run_model(fp32, data, batch, desc=f"FP32 reference ({what})"))


def cmd_search(args: argparse.Namespace) -> dict:
    """``search``: measure, choose, write the record; print the anchored exclusion regexes on
    stdout (one per line; nothing else goes to stdout)."""
    started = time.time()
    check_positive(args, "batch", "tune_images")
    budget = budget_from_args(args)
    fp32, work = _paths(args)
    outputs = record_paths(args.model, args.out_dir)
    _lock(args, work, outputs["json"].parent)
    require(fp32, "2_export_onnx.py")
    check_writable(work, outputs["json"].parent)
    data, tuning = tuning_data(args.model, fp32, args.tune_npz, args.tune_images, args.seed)
    if args.qdq:
        qdq = require(Path(args.qdq), "5_quantize.sh (or your own Q/DQ model)")
        calib_sha = sha256_file(args.calib) if args.calib else None
        base = {"command": f"given: {qdq}", "reused": True, "sha256": sha256_file(qdq)}
    else:
        calib = Path(args.calib) if args.calib else calib_path(args.model)
        require(calib, "4_make_calib.py")
        calib_sha = sha256_file(calib)
        qdq, base = base_qdq(args.model, fp32, calib, args.calib_batch, args.eps, work,
                             args.variant)
    fp32_model = load_onnx(fp32, "2_export_onnx.py")
    try:
        space = QdqSpace(load_onnx(qdq), fp32_model)
    except StageError as e:
        if "nothing to choose" not in str(e):
            raise
        ops = sorted({n.op_type for n in fp32_model.graph.node if n.op_type in MAC_OPS})
        raise StageError(
            f"{e}: {qdq} ({base['command']}) has no Q/DQ on them; the FP32 model has "
            f"{ops or 'no Conv/Gemm/MatMul'}. ModelOpt says why in "
            f"{base.get('log', 'its log')} ('Final number of nodes to quantize'); e.g. its "
            "GEMV rule leaves a Gemm/MatMul that reads one vector per sample in float, and "
            "--op_types_to_quantize of the variant (variants.py) may not list the op. Nothing "
            "to search: use another variant for this model") from None
    key_fields = {"fp32": sha256_file(fp32), "qdq": base["sha256"], "calib": calib_sha,
                  "tune": tuning["sha256"], "mode": MODE,
                  "onnxruntime": versions().get("onnxruntime")}
    cache = Cache(work / "cache", key_fields)
    ref = _fp32_reference(fp32, data, work, tuning["sha256"], args.batch, "tune")
    warnings = budget_warnings(budget, tuning["n"])
    for w in warnings:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"auto-precision: budget {budget.describe()}; tuning data: {tuning['source']}; "
          f"cache {cache.path} ({len(cache.data['configs'])} configurations)", file=sys.stderr)
    t0 = time.time()
    try:
        res = search(space, data, ref, budget, cache, args.batch, prune=not args.no_prune)
    except KeyboardInterrupt:
        print(f"\nauto-precision: interrupted; {len(cache.data['configs'])} measured "
              f"configurations are cached in {cache.path}: the same command resumes from "
              "there", file=sys.stderr)
        raise
    wall = round(time.time() - t0, 1)
    evaluations = res.pop("evaluations")
    rec = {"stage": "auto_precision", "model": args.model, "variant": args.variant,
           "budget": dataclasses.asdict(budget), "budget_text": budget.describe(),
           "semantics": SEMANTICS, "fp32": str(fp32), "qdq_base": str(qdq), "base": base,
           "tuning": tuning, "seed": args.seed, "warnings": warnings, **res,
           "exclude_regexes": anchored(res["excluded"]),
           "search": {"wall_s": wall, "evaluations": evaluations,
                      "cache": str(cache.path), "machine": _machine()},
           "outputs": {k: str(v) for k, v in outputs.items()}}
    rec["provenance"] = provenance(args, [fp32, qdq], started)
    rec["plot"] = not args.no_plot
    write_outputs(rec, plot=not args.no_plot)
    frac = rec["int8_mac_fraction"]
    print(f"auto-precision: keep {len(rec['excluded'])} node(s) in float "
          f"({', '.join(rec['excluded'][:6])}{' ...' if len(rec['excluded']) > 6 else ''}); "
          f"{100 * frac:.2f} % of MACs in INT8; tuning split: {fmt_metrics(rec['predicted'])}; "
          f"{rec['search']['evaluations']['run']} configurations run, "
          f"{rec['search']['evaluations']['cached']} cached, {wall} s -> {outputs['md']}",
          file=sys.stderr)
    for r in rec["exclude_regexes"]:
        print(r)
    return rec


def _machine() -> str:
    d = device_info()
    return (f"{d.get('cpu')} ({d.get('cpu_count')} cores; shared with other jobs, times vary)")


def cmd_verify(args: argparse.Namespace) -> dict:
    """``verify``: measure ModelOpt's re-quantized file on the tuning split (against the budget
    and the searched configuration) and on the evaluation split; update the record.

    Raises:
        StageError: no search record, other tuning data than the search's, or the file misses
            the budget on the tuning split.
    """

    started = time.time()
    check_positive(args, "batch")
    outputs = record_paths(args.model, args.out_dir)
    fp32, work = _paths(args)
    _lock(args, work, outputs["json"].parent)
    rec = load_json(require(outputs["json"], "auto_precision.py search "
                            "(5_quantize.sh int8_auto runs both)"))
    onnx_path = require(Path(args.onnx), "5_quantize.sh int8_auto")
    budget = Budget(**rec["budget"])
    t = rec["tuning"]
    data, tuning = tuning_data(args.model, fp32, t.get("tune_npz"), t.get("images"), t["seed"])
    if tuning["sha256"] != t["sha256"]:
        raise StageError("the tuning data changed since the search (another split or "
                         "npz): rerun auto_precision.py search (5_quantize.sh int8_auto)")
    ref = _fp32_reference(fp32, data, work, t["sha256"], args.batch, "tune")
    labels = data.y if data.classifier else None
    q_model = load_onnx(onnx_path)
    out = run_model(q_model, data, args.batch, desc="int8_auto (tuning)")
    m_tune = output_metrics(ref, out, labels)
    space = QdqSpace(load_onnx(rec["qdq_base"]), load_onnx(fp32))
    predicted = run_model(space.model(rec["excluded"]), data, args.batch,
                          desc="searched configuration")
    match = output_metrics(predicted, out)
    expected_int8 = {n for n in space.names if n not in rec["excluded"]}
    actual = {r["name"]: r["int8"] for r in mac_table(q_model)}
    diffs = {"float_but_searched_int8": sorted(n for n in expected_int8 if not actual.get(n)),
             "int8_but_searched_float": sorted(n for n in rec["excluded"] if actual.get(n))}
    v = {"onnx": str(args.installed_as or onnx_path), "sha256": sha256_file(onnx_path),
         "macs": mac_summary(q_model), "tune": m_tune, "tune_budget_met": budget.met(m_tune),
         "tune_misses": budget.misses(m_tune), "tune_margins": budget.margins(m_tune),
         "vs_searched_configuration": match,
         "structure_differences": {k: v for k, v in diffs.items() if v}, "eval": None}
    try:
        spec = model_spec(args.model)
    except UsageError:
        spec = None
    if spec is not None and spec.classifier and not args.no_eval:
        name = graph_inputs(q_model)[0][0]
        ev = classifier_data(spec, args.limit, input_name=name)
        digest = data_digest(ev)
        ref_e = _fp32_reference(fp32, ev, work, digest, args.batch, "eval")
        m_eval = output_metrics(ref_e, run_model(q_model, ev, args.batch, desc="int8_auto (eval)"),
                                ev.y)
        v.update(eval=m_eval, eval_budget_met=budget.met(m_eval),
                 eval_misses=budget.misses(m_eval), eval_margins=budget.margins(m_eval))
    v["wall_s"] = round(time.time() - started, 1)
    rec["verify"] = v
    rec["provenance_verify"] = provenance(args, [onnx_path, fp32], started)
    write_outputs(rec, plot=False)
    frac = v["macs"]["int8_fraction"]
    print(f"auto-precision verify: {onnx_path.name}: {100 * (frac or 0):.2f} % of MACs in INT8; "
          f"tuning: {fmt_metrics(m_tune)} (budget {'met' if v['tune_budget_met'] else 'MISSED'}); "
          f"vs searched configuration cosine min {fmt_num(match['cosine_min'], 6)}"
          + (f"; evaluation: {fmt_metrics(v['eval'])} (budget "
             f"{'met' if v['eval_budget_met'] else 'missed: ' + '; '.join(v['eval_misses'])})"
             if v["eval"] else ""), file=sys.stderr)
    if v["structure_differences"]:
        print(f"WARNING: ModelOpt's file differs from the searched configuration: "
              f"{v['structure_differences']}", file=sys.stderr)
    if not v["tune_budget_met"]:
        raise StageError(
            f"{onnx_path}: ModelOpt's re-quantized model misses the budget on the tuning split "
            f"({'; '.join(v['tune_misses'])}) although the searched configuration met it "
            f"({fmt_metrics(rec['predicted'])}); outputs vs the searched configuration: cosine min "
            f"{fmt_num(match['cosine_min'], 6)}; structure differences: "
            f"{v['structure_differences'] or 'none'}")
    return rec


def cmd_macs(args: argparse.Namespace) -> dict:
    """``macs``: MACs per node and the fraction in INT8."""
    model = load_onnx(args.onnx)
    rows = mac_table(model)
    s = mac_summary(model)
    if not args.summary:
        for r in rows:
            print(f"{'INT8 ' if r['int8'] else 'float'} {r['macs'] if r['macs'] is not None else '?':>12}"
                  f"  {r['op_type']:<8} {r['name']}")
    frac = s["int8_fraction"]
    print(f"{args.onnx}: {s['n_int8_nodes']}/{s['n_nodes']} Conv/Gemm/MatMul nodes in INT8, "
          f"{s['int8_macs']:,} of {s['total_macs']:,} MACs per sample"
          + (f" ({100 * frac:.2f} %)" if frac is not None else "")
          + (f"; MACs unknown for {len(s['unknown'])} node(s)" if s["unknown"] else ""))
    return s


def _add_common(p: argparse.ArgumentParser) -> None:
    add_shared_args(p, "model")
    p.add_argument("--fp32", type=Path, default=None,
                   help="FP32 ONNX model (default: artifacts/<model>/onnx/fp32.onnx)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="base Q/DQ model, cache and logs (default: "
                        "artifacts/<model>/auto_precision)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where auto_precision.{json,md,png} go (default: the work dir; "
                        "5_quantize.sh int8_auto publishes them to results/<model> once the "
                        "file is installed)")
    p.add_argument("--batch", type=int, default=64, help="samples per ORT run")


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__, prog="auto_precision.py")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    s = sub.add_parser("search", help="measure every candidate, choose the nodes to keep in "
                       "float, print their ^name$ regexes", formatter_class=HelpFormatter)
    _add_common(s)
    s.add_argument("--calib", type=Path, default=None,
                   help="calibration npz for the base quantization (default: "
                        "artifacts/<model>/calib.npz)")
    s.add_argument("--calib-batch", default="all",
                   help="calibration batch of the base quantization (qdq_tools.py check-calib "
                        "prints the one stage 5 uses)")
    s.add_argument("--eps", default="cpu", help="ModelOpt --calibration_eps")
    s.add_argument("--variant", default=VARIANT,
                   help="variants.py entry whose recipe (without exclusions) makes the base "
                        "Q/DQ model")
    s.add_argument("--qdq", type=Path, default=None,
                   help="use this Q/DQ model as the base instead of running ModelOpt")
    s.add_argument("--tune-npz", type=Path, default=None,
                   help="tuning samples keyed by input name (default: the tune split for an "
                        "image classifier, else artifacts/<model>/tune.npz)")
    s.add_argument("--tune-images", type=int, default=None,
                   help="use a seeded subset of this many tuning samples (default: all)")
    s.add_argument("--seed", type=int, default=0, help="seed of --tune-images' subset")
    s.add_argument("--min-agreement", type=_budget_arg, default=DEFAULT_BUDGET["min_agreement"],
                   help="budget: top-1 agreement with FP32 on the tuning split, %% ('off' to "
                        "skip)")
    s.add_argument("--min-cosine", type=_budget_arg, default=DEFAULT_BUDGET["min_cosine"],
                   help="budget: mean logits cosine similarity with FP32 ('off' to skip)")
    s.add_argument("--max-top1-drop", type=_budget_arg, default=None,
                   help="budget: top-1 may drop at most this many points below FP32 (default: "
                        "off)")
    s.add_argument("--no-prune", action="store_true",
                   help="take the shortest prefix of the measured ranking path that meets the "
                        "budget, without trying its nodes back in INT8 (a rerun with another "
                        "budget then measures nothing new)")
    s.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    s = sub.add_parser("verify", help="measure the re-quantized file on the tuning and "
                       "evaluation splits", formatter_class=HelpFormatter)
    _add_common(s)
    s.add_argument("--onnx", type=Path, required=True, help="the re-quantized Q/DQ model")
    s.add_argument("--installed-as", type=Path, default=None,
                   help="the path the file will have (5_quantize.sh verifies it before "
                        "installing it)")
    s.add_argument("--limit", type=int, default=None,
                   help="evaluation split: the first N images only (smoke runs)")
    s.add_argument("--no-eval", action="store_true", help="tuning split only")
    s = sub.add_parser("publish", help="copy a search record into a results folder (as "
                       "auto_precision.failed.* with --failed)", formatter_class=HelpFormatter)
    s.add_argument("--from", dest="src", type=Path, required=True,
                   help="folder holding auto_precision.{json,md,png}")
    s.add_argument("--to", dest="dst", type=Path, required=True, help="results folder")
    s.add_argument("--failed", action="store_true",
                   help="the run's file was not installed: publish beside the good record")
    s = sub.add_parser("macs", help="MACs per Conv/Gemm/MatMul node and the fraction in INT8",
                       formatter_class=HelpFormatter)
    s.add_argument("onnx", type=Path, help="any ONNX model")
    s.add_argument("--summary", action="store_true", help="only the summary line")
    return p


def main(args: argparse.Namespace):
    if args.cmd == "publish":
        lock_folders(args.dst)  # one writer per folder (stage 5, its parent, already holds it)
        for k, v in publish(args.src, args.dst, args.failed).items():
            if v.exists():
                print(f"{k}: {v}")
        return None
    return {"search": cmd_search, "verify": cmd_verify, "macs": cmd_macs}[args.cmd](args)
