"""Calibration data: statistics, validation against the model and the evaluation data, the
memory-bounded calibration batch plan, and the ``check-calib`` command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
import numpy as np

from deploykit.layout import ref_outputs_path
from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.data.user import reference_inputs
from deploykit.errors import StageError, UsageError
from deploykit.io import load_npz, sha256_file, write_json
from deploykit.layout import model_results, splits_path
from deploykit.models import model_spec
from deploykit.onnx.graph import graph_inputs, load_onnx


# --------------------------------------------------------------------------------------------
# Calibration data: validation (stages 4, 5, 5b) and the calibration batch plan (stage 5)
# --------------------------------------------------------------------------------------------
# Statistics check: calibration vs evaluation data, per input. Refused when the means differ by
# more than STATS_MAX_MEAN_SHIFT standard deviations (the larger of the two stds), the stds by
# more than a factor STATS_MAX_STD_RATIO or the value ranges (max - min) by more than a factor
# STATS_MAX_RANGE_RATIO. Calibration and eval splits of the same images differ far less
# (embedded sample, EfficientNet-Lite0, its 100 calibration images against the first 64 eval
# images that calibration_reference takes: mean shift 0.09 std, std ratio 1.19, ranges equal;
# against all 900: 0.01 std, 1.04); unnormalised 0..255 pixels give a mean shift of ~1.6 std
# and a std ratio of ~150, [0, 1] pixels (no Normalize) a mean shift of 1.3 std, inputs swapped
# between the keys of a two-input model a std ratio of the two inputs' ratio, and ImageNet's
# mean/std instead of the model's 0.5/0.5 a std ratio of 2.6 (inside the std bound) with a
# range of [-2.1, 2.6] for [-1, 1]: a range ratio of 2.4, which the input's quantization scale
# would follow. Ranges are compared on equal numbers of samples (the calibration data's first
# ones, as many as the reference has: the range of unbounded data grows with the sample count)
# and only for inputs whose reference holds at least STATS_RANGE_MIN_VALUES values (two ranges
# of 24 N(0, 1) values differ by more than 2x in 0.8 % of draws, of 96 values in 0.006 %).
STATS_MAX_MEAN_SHIFT = 1.0


STATS_MAX_STD_RATIO = 3.0


STATS_MAX_RANGE_RATIO = 2.0


STATS_RANGE_MIN_VALUES = 1000


SYNTHETIC_REFERENCE = "synthetic: "  # prefix of calibration_reference's source text


def input_stats(a: np.ndarray) -> dict:
    """mean, std, min, max (float64, finite values only) and sample count of an array."""
    v = np.asarray(a).astype(np.float64).ravel()
    v = v[np.isfinite(v)]
    if not v.size:
        return {"n": int(len(a)), "mean": None, "std": None, "min": None, "max": None}
    return {"n": int(len(a)), "mean": float(v.mean()), "std": float(v.std()),
            "min": float(v.min()), "max": float(v.max())}


def calibration_reference(model: str, onnx_path: Path | str, n: int = 64
                          ) -> tuple[dict[str, np.ndarray] | None, str]:
    """The evaluation data the calibration statistics are compared with.

    Image classifiers: the first ``n`` eval images through the evaluation preprocessing
    (:func:`deploykit.data.splits.load_split` + :func:`deploykit.data.images.normalize`). Other models: the inputs stage 1 ran
    the PyTorch reference on (``artifacts/<model>/ref_outputs.npz``, keys ``in:<name>``).

    Returns:
        ``(arrays keyed by input name or None, where they come from / why there are none)``;
        the text starts with :data:`SYNTHETIC_REFERENCE` when stage 1 ran on synthetic inputs
        (:func:`validate_calibration` then warns instead of refusing).
    """
    try:
        spec = model_spec(model)
    except UsageError:
        spec = None
    names = [i[0] for i in graph_inputs(load_onnx(onnx_path, external=False))]
    if spec is not None and spec.classifier:
        if not splits_path().exists():
            return None, f"none: {splits_path()} missing (run 0_prepare_data.py)"
        try:
            x, _, _ = load_split("eval", spec, n)
        except StageError as e:
            return None, f"none: {e}"
        return {names[0]: normalize(x, spec.mean, spec.std)}, \
            f"first {len(x)} eval images, evaluation preprocessing"
    ref = ref_outputs_path(model)
    if not ref.exists():
        return None, f"none: {ref} missing (1_pytorch_baseline.py writes it)"
    data, synthetic, _ = reference_inputs(ref)
    if synthetic:
        return data, (f"{SYNTHETIC_REFERENCE}the seeded N(0,1) inputs stage 1 evaluated ({ref}; "
                      "no --inputs was given to it)")
    return data, f"the inputs stage 1 evaluated ({ref})"


def validate_calibration(onnx_path: Path | str, data: dict[str, np.ndarray],
                         reference: dict[str, np.ndarray] | None = None, *,
                         source: str = "calibration data", reference_source: str = "",
                         producer: str = "4_make_calib.py does") -> dict:
    """Refuse calibration data that does not fit the model, before any quantizer runs.

    Checks: keys equal the model's input names; each array has the input's rank, static dims and
    dtype; every input has the same sample count N >= 1 (a multiple of a static batch); no
    NaN/Inf; with ``reference``, per input mean/std/range within :data:`STATS_MAX_MEAN_SHIFT` /
    :data:`STATS_MAX_STD_RATIO` / :data:`STATS_MAX_RANGE_RATIO` of the evaluation data's.

    Args:
        data: ``{input name: array [N, ...]}``. reference: the same for evaluation data
            (:func:`calibration_reference`), or None to skip the statistics check.
        source: what the data are, in messages. producer: the hint after the missing-key fix.
    Returns:
        ``{"n_samples", "inputs": {name: {"shape", "dtype", "stats", "reference_stats"}},
        "stats_check": "passed" | "skipped: ..."}``.
    Raises:
        StageError: every problem found, with the numbers and the fix.
    """
    inputs = graph_inputs(load_onnx(onnx_path, external=False))
    names = [i[0] for i in inputs]
    problems: list[str] = []
    missing = [k for k in names if k not in data]
    extra = [k for k in data if k not in names]
    if missing or extra:
        what = "; ".join(x for x in (f"missing {missing}" if missing else "",
                                     f"not inputs of the model: {extra}" if extra else "") if x)
        raise StageError(
            f"{source} has keys {sorted(data)} but the model's inputs are {names} ({what}): key "
            "each array by its ONNX input name (np.savez(path, "
            + ", ".join(f"{k}=..." for k in names) + f")); {producer}")
    counts = {}
    info = {}
    for name, dims, dtype in inputs:
        a = np.asarray(data[name])
        info[name] = {"shape": list(a.shape), "dtype": str(a.dtype)}
        if a.ndim != len(dims):
            problems.append(f"input {name!r}: array of shape {list(a.shape)} for an input of rank "
                            f"{len(dims)} {dims} (batch on axis 0, one sample per row)")
            continue
        bad = [(k, d, a.shape[k]) for k, d in enumerate(dims) if k and d and d != a.shape[k]]
        if bad:
            problems.append(f"input {name!r}: shape {list(a.shape)} does not fit the model's "
                            f"{['N' if d is None else d for d in dims]} (axis {bad[0][0]}: "
                            f"{bad[0][2]} vs {bad[0][1]})")
        if a.dtype != dtype:
            problems.append(f"input {name!r} is {a.dtype} but the model takes {dtype}: save it "
                            f"with .astype(np.{dtype.name})")
        counts[name] = len(a) if a.ndim else 0
        if np.issubdtype(a.dtype, np.floating):
            nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
            if nan or inf:
                rows = np.flatnonzero(~np.isfinite(a.reshape(len(a), -1)).all(1))
                problems.append(f"input {name!r} has {nan} NaN and {inf} Inf values (samples "
                                f"{rows[:5].tolist()}{' ...' if rows.size > 5 else ''}): remove "
                                "or repair those samples")
        if dims and dims[0] and counts[name] % dims[0]:
            problems.append(f"input {name!r}: {counts[name]} samples for a static batch of "
                            f"{dims[0]}: use a multiple of {dims[0]} samples")
        info[name]["stats"] = input_stats(a)
    if len(set(counts.values())) > 1:
        problems.append(f"inputs have different sample counts {counts}: one row per sample in "
                        "every input")
    if any(c < 1 for c in counts.values()):
        problems.append(f"no samples ({counts})")
    stats_note = "passed"
    if reference is None:
        stats_note = f"skipped ({reference_source or 'no evaluation data given'})"
    elif not problems:
        for name in names:
            if name not in reference:
                continue
            r = input_stats(reference[name])
            c = info[name]["stats"]
            info[name]["reference_stats"] = r
            if r["std"] is None or c["std"] is None:
                continue
            spread = max(r["std"], c["std"], 1e-12)
            shift = abs(c["mean"] - r["mean"]) / spread
            ratio = max(c["std"], 1e-12) / max(r["std"], 1e-12)
            span = 1.0
            ref_arr = np.asarray(reference[name])
            if ref_arr.size >= STATS_RANGE_MIN_VALUES:
                cs = input_stats(np.asarray(data[name])[:max(len(ref_arr), 1)])
                span = (max(cs["max"] - cs["min"], 1e-12) / max(r["max"] - r["min"], 1e-12)
                        if cs["max"] is not None else 1.0)
            if shift > STATS_MAX_MEAN_SHIFT or not (
                    1 / STATS_MAX_STD_RATIO <= ratio <= STATS_MAX_STD_RATIO) or not (
                    1 / STATS_MAX_RANGE_RATIO <= span <= STATS_MAX_RANGE_RATIO):
                problems.append(
                    f"input {name!r}: {source} mean {c['mean']:.4g} std {c['std']:.4g} range "
                    f"[{c['min']:.4g}, {c['max']:.4g}] vs evaluation data mean {r['mean']:.4g} std "
                    f"{r['std']:.4g} range [{r['min']:.4g}, {r['max']:.4g}] ({reference_source}):"
                    f" mean shift {shift:.2f} std, std ratio {ratio:.3g}, range ratio {span:.3g}"
                    " - not preprocessed like the evaluation data (unnormalised? another "
                    "mean/std? inputs swapped between keys?); the quantization scales would be "
                    "fitted to other data")
        stats_note = f"passed against {reference_source}"
    if problems and reference_source.startswith(SYNTHETIC_REFERENCE):
        # compared with synthetic samples, a difference says nothing about the data: warn
        stat = [p for p in problems if "evaluation data" in p]
        problems = [p for p in problems if "evaluation data" not in p]
        if stat:
            stats_note = ("warned, not judged (the evaluation reference is synthetic): "
                          + "; ".join(stat))
            print(f"WARNING: {source}: statistics differ from stage 1's synthetic N(0,1) inputs "
                  "(not a verdict on your data: give stage 1 your evaluation samples with "
                  "--inputs NPZ for a real check): " + "; ".join(s[:200] for s in stat),
                  file=sys.stderr)
    if problems:
        raise StageError(f"{source} refused: " + "; ".join(problems)
                         + (" (if the data are right and the evaluation inputs are not "
                            "representative, pass --no-stats-check / CALIB_STATS_CHECK=0)"
                            if any("evaluation data" in p for p in problems) else ""))
    return {"n_samples": int(next(iter(counts.values()))), "inputs": info,
            "stats_check": stats_note}


def activation_bytes_per_sample(onnx_path: Path | str, data: dict[str, np.ndarray]) -> int:
    """Bytes of every float intermediate tensor for one sample (ONNX shape inference with the
    inputs' non-batch dims taken from ``data``): what a calibrator that records all activations
    holds per sample. An upper bound: ModelOpt records the inputs of the ops it quantizes
    (measured on EfficientNet-Lite0: estimate 95 MiB per image, ModelOpt's peak RSS grows by
    ~62 MiB per image: 1.4 GiB at batch 1, 7.5 GiB at batch 100)."""
    import onnx

    model = load_onnx(onnx_path, external=False)
    for i in model.graph.input:
        if i.name in data:
            shape = (1,) + tuple(np.shape(data[i.name])[1:])
            dims = i.type.tensor_type.shape.dim
            for d, v in zip(dims, shape):
                d.ClearField("dim_param")
                d.dim_value = int(v)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - shape inference is best effort here
        return 0
    total = 0
    for v in list(model.graph.value_info) + list(model.graph.output):
        t = v.type.tensor_type
        if t.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            continue
        dims = [d.dim_value for d in t.shape.dim]
        if dims and all(d > 0 for d in dims):
            total += int(np.prod(dims)) * (4 if t.elem_type == onnx.TensorProto.FLOAT else 2)
    return total


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# Default calibration batch: the whole calibration set in one batch.
# Why: ModelOpt 0.47.0's ONNX CLI splits the npz into int(N / B) batches of B = the batch dim of
# --calibration_shapes (default: the model's, 1 when dynamic) (modelopt/onnx/quantization/
# calib_utils.py, CalibrationDataProvider), and entropy calibration runs ONNX Runtime's
# HistogramCollector batch by batch: the first batch fixes the bin width, each later batch whose
# range is wider adds bins of that width (onnxruntime/quantization/calibrate.py, merge_histogram),
# and get_entropy_threshold searches only thresholds beyond the first num_quantized_bins (128)
# bins. So with several batches the entropy scales depend on which samples come first. Measured
# (ModelOpt 0.47.0, ORT 1.32.0, 256 N(0,1) samples, 5 random orders, two small CNNs from
# ../shared/cases c13/c17): the spread of an activation scale across orders is up to 46 % / 31 %
# at batch 1, 18 % / 14 % at batch 4, 9-34 % at batch 16-128, and 0.0 % with all 256 samples in
# one batch. With one batch the histogram has exactly 128 bins and the search has one candidate,
# max |x|: entropy then equals max calibration (same scales, measured), deterministic and
# independent of order. A smaller batch (--calib-batch / CALIB_BATCH) is used only when one
# batch would not fit in memory; the sample order (seeded by stage 4) is then recorded.
CALIB_MEMORY_FRACTION = 0.5


def calibration_plan(onnx_path: Path | str, data: dict[str, np.ndarray],
                     batch: str | int = "all", memory_fraction: float = CALIB_MEMORY_FRACTION
                     ) -> dict:
    """Calibration batch for ModelOpt and the ``--calibration_shapes`` that sets it.

    Args:
        data: validated calibration arrays (:func:`validate_calibration`).
        batch: ``"all"`` (default: every sample in one batch, capped by memory) or a number.
        memory_fraction: share of the available memory one batch of activations may use.
    Returns:
        ``{"batch_size", "n_samples", "batches" (sizes ModelOpt will use: it splits N into
        int(N / B) parts with np.array_split), "calibration_shapes", "order_dependent",
        "reason", "bytes_per_sample"}``.
    Raises:
        UsageError: ``batch`` is not "all" or a positive integer.
        StageError: a static batch axis the data cannot be cut into.
    """
    inputs = graph_inputs(load_onnx(onnx_path, external=False))
    n = len(next(iter(data.values())))
    static = {d[0] for _, d, _ in inputs if d and d[0]}
    per = activation_bytes_per_sample(onnx_path, data)
    if static:
        b = min(static)
        reason = f"the model's batch axis is static ({b})"
    elif str(batch) == "all":
        b, reason = n, "whole calibration set in one batch (order-independent)"
        avail = _mem_available()
        if per and avail and n * per > memory_fraction * avail:
            parts = int(np.ceil(n * per / (memory_fraction * avail)))
            b = max(1, n // parts)
            reason = (f"one batch of {n} would hold ~{n * per / 2 ** 30:.1f} GiB of activations, "
                      f"more than {memory_fraction:.0%} of the {avail / 2 ** 30:.1f} GiB "
                      f"available: {parts} batches")
    else:
        try:
            b = int(batch)
        except ValueError:
            b = 0
        if b < 1:
            raise UsageError(f"calibration batch {batch!r}: 'all' or a positive integer")
        b = min(b, n)
        reason = "requested"
    k = max(1, n // b)
    sizes = [len(x) for x in np.array_split(np.arange(n), k)]
    shapes = ",".join(f"{name}:" + "x".join(str(v) for v in (b,) + tuple(np.shape(data[name])[1:]))
                      for name, _, _ in inputs)
    return {"batch_size": b, "n_samples": n, "batches": sizes, "calibration_shapes": shapes,
            "order_dependent": len(sizes) > 1, "reason": reason, "bytes_per_sample": per}


def deployment_shapes(onnx_path: Path | str, data: dict[str, np.ndarray]) -> str:
    """``name:1xCxHxW,...``: the model's inputs at batch 1 (or their static batch) with the other
    dims from ``data``: the shapes ModelOpt's GEMV rule should see (it excludes a MatMul/Gemm
    whose M is 1, a TensorRT performance rule about the deployed batch, not the calibration one)."""
    out = []
    for name, dims, _ in graph_inputs(load_onnx(onnx_path, external=False)):
        shape = (dims[0] or 1,) + tuple(np.shape(data[name])[1:])
        out.append(f"{name}:" + "x".join(str(v) for v in shape))
    return ",".join(out)


def check_calib_cli(args: argparse.Namespace) -> dict:
    """``check-calib``: validate the npz for a model, plan the calibration batch, print the
    ``--calibration_shapes`` value (stdout, one line) and write the record (``--json``)."""
    data = load_npz(args.calib, None, "4_make_calib.py", flag="--calib", feed=True)
    ref, ref_src = (None, "skipped (--no-stats-check)")
    if not args.no_stats_check:
        if args.reference:
            ref, ref_src = load_npz(args.reference, None, "np.savez",
                                          flag="--reference", feed=True), str(args.reference)
        elif args.model:
            ref, ref_src = calibration_reference(args.model, args.onnx)
    rep = validate_calibration(args.onnx, data, ref, source=str(args.calib),
                               reference_source=ref_src)
    plan = calibration_plan(args.onnx, data, args.batch)
    rec = {**rep, "plan": plan, "calib": str(args.calib), "sha256": sha256_file(args.calib)}
    made = model_results(args.model) / "calib.json" if args.model else None
    rec["order_seed"] = None
    rec["made_by"] = "unknown (not the npz stage 4 recorded)"
    if made is not None and made.exists():
        try:
            c = json.loads(made.read_text())
        except json.JSONDecodeError:
            c = {}
        if c.get("sha256") == rec["sha256"]:
            rec["order_seed"] = c.get("order_seed")
            rec["made_by"] = f"4_make_calib.py ({c.get('source')})"
    if args.json:
        write_json(args.json, rec)
    print(plan["batch_size"])
    note = (f"calibration: {plan['n_samples']} samples, batch {plan['batch_size']} "
            f"({len(plan['batches'])} batch(es): {plan['reason']}); statistics "
            f"{rep['stats_check']}")
    print(note, file=sys.stderr)
    if plan["order_dependent"]:
        print(f"NOTE: {len(plan['batches'])} calibration batches: entropy scales depend on the "
              f"sample order (order seed {rec['order_seed']})", file=sys.stderr)
    return rec
