"""ModelOpt's ONNX PTQ with a calibration batch of its own, its log warnings, and an ORT smoke
run of its output.
"""
from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.io import load_npz
from deploykit.errors import StageError, UsageError
from deploykit.quant.calibration import calibration_plan, deployment_shapes
from deploykit.quant.modelopt_log import report_sessions

#: ModelOpt 0.47.0 converts a file below this opset up to it before quantizing
#: (``modelopt/onnx/utils.py`` ``BASE_MIN_OPSET``; intermediate ``<name>_opset19.onnx``).
MODELOPT_MIN_OPSET = 19


#: Printed by the child between the fp32 run and its FP16 conversion (:func:`modelopt_quantize`
#: with ``fp16_output``): the log before it is the fp32 variant's, the whole log the FP16's.
FP16_MARK = "deploykit: FP16 conversion of the calibrated model (ModelOpt convert_to_f16) -> "


#: ModelOpt and onnxruntime versions on which :func:`entropy_as_max` holds, checked byte for byte
#: (tests/quant/test_modelopt.py builds a small CNN and runs both; EfficientNet-Lite0's
#: ``baseline.onnx`` is the same file both ways, sha256 ``adcfcd9237c4...``). Other versions run
#: ModelOpt's entropy calibration as it is.
ENTROPY_AS_MAX_VERIFIED = frozenset({("0.47.0", "1.32.0")})

#: Measured on this project's 2-core Intel Xeon, EfficientNet-Lite0, 100 samples in one batch,
#: ``qdq_tools.py modelopt`` whole process: entropy 24.6 s wall, 29.2 s CPU, 6.5 GB peak; max
#: (with the NaN term of :func:`_nan_into_minimum`) 13.5 s, 18.5 s, 6.0 GB; the same file. (Max
#: calibration in runs of 10 took 9.9 s and 2.2 GB, but a layer that mixes the samples of a
#: batch, e.g. ``x - x.mean(0)``, then sees other batches than entropy's one: another file.)
#: Printed by the child before ModelOpt's entropy calibration is computed as max calibration
#: (:func:`entropy_as_max`); the rest of the line says why (:func:`entropy_computed_as_max`).
ENTROPY_AS_MAX_MARK = "deploykit: entropy calibration computed as max calibration: "

#: Printed by the child when the max calibration it tried is not what entropy calibration gives
#: (a NaN/Inf activation, a range entropy's histogram cannot bin): ModelOpt's entropy runs next.
ENTROPY_FALLBACK_MARK = "deploykit: max calibration is not what entropy gives here"


class _RangeNotEquivalent(Exception):
    """A max calibration range that ModelOpt's entropy path would not give (non-finite, or not
    float32): the run is made again with entropy calibration."""


def entropy_as_max(args, plan: dict | None) -> str | None:
    """Why this ModelOpt run's entropy calibration gives the file max calibration gives, or None.

    ModelOpt 0.47.0 runs INT8 entropy calibration through ONNX Runtime's ``EntropyCalibrater``
    with ``num_bins = num_quantized_bins = 128`` (``ort_patching._create_calibrator_with_extra_
    options``; its ``trt_guided_options`` set neither) and its own ``_collect_value``: one
    histogram of 128 bins over ``[-t, t]``, ``t = max(|min|, |max|)`` of the tensor, for a single
    calibration batch. ORT's ``HistogramCollector.get_entropy_threshold`` tries the thresholds
    ``i = num_quantized_bins // 2 .. num_bins // 2``: with 128 and 128 that is one candidate, the
    whole histogram ``(edges[0], edges[128]) = (-t, t)``, which it then clips to the tensor's
    ``(min, max)``. So every tensor gets exactly its ``(min, max)``: what max calibration (ORT's
    ``MinMaxCalibrater`` with ModelOpt's patches, not symmetric, no moving average) gives.
    Max calibration reads each tensor through a ReduceMin/ReduceMax in the graph instead of
    returning every activation of the batch and binning it with NumPy; it runs in the same one
    batch (a layer may mix the samples of a batch).

    It holds when: INT8, entropy (ModelOpt's default), the whole calibration set in one batch
    (with several batches the histograms grow bins and the search has more candidates), no
    per-node calibration, no calibration cache, and the ModelOpt/onnxruntime versions of
    :data:`ENTROPY_AS_MAX_VERIFIED`. Where the two could still differ the run goes again with
    entropy (:func:`modelopt_quantize`, :func:`_ranges_as_entropy_gives`): a NaN or Inf in a
    tensor (ModelOpt's entropy path replaces a NaN/Inf min by float32's tiny and max by its
    max; ORT's ReduceMin/ReduceMax skip a NaN unless it comes first, so a NaN-propagating
    sum is folded into each minimum), a range that is not float32, or a range whose
    128-bin histogram NumPy cannot make (``Too many bins for data range`` for a tensor of
    subnormal values; an index overflow where its max plus max |x| exceeds FP32's largest
    value), on which ModelOpt's entropy path fails.

    Args:
        args: ModelOpt's parsed CLI arguments. plan: :func:`deploykit.quant.calibration.
            calibration_plan` of the run (None: no calibration data given).
    Returns:
        one line for the log, or None (run entropy as it is).
    """
    import modelopt
    import onnxruntime as ort

    versions = (getattr(modelopt, "__version__", "?"), ort.__version__)
    if (plan is None or args.quantize_mode != "int8"
            or (args.calibration_method or "entropy") != "entropy"  # ModelOpt's default: None
            or len(plan["batches"]) != 1 or getattr(args, "calibrate_per_node", False)
            or getattr(args, "calibration_cache_path", None)
            or versions not in ENTROPY_AS_MAX_VERIFIED):
        return None
    return (f"one batch of {plan['n_samples']} samples and 128 histogram bins leave ORT's entropy "
            "search one candidate, each tensor's (min, max): the same file (ModelOpt "
            f"{versions[0]}, onnxruntime {versions[1]}; deploykit.quant.modelopt.entropy_as_max;"
            " ModelOpt's log below says 'method: max')")


def entropy_computed_as_max(log_text: str) -> str | None:
    """The reason a child gave for computing entropy calibration as max calibration (its last
    :data:`ENTROPY_AS_MAX_MARK` line), or None when it ran entropy calibration as it is (no such
    line, or an :data:`ENTROPY_FALLBACK_MARK` line after it)."""
    why = None
    for line in log_text.splitlines():
        if ENTROPY_AS_MAX_MARK in line:
            why = line.split(ENTROPY_AS_MAX_MARK, 1)[1].strip()
        elif ENTROPY_FALLBACK_MARK in line:
            why = None
    return why


@contextlib.contextmanager
def _own_tempdir():
    """While the block runs, ``tempfile``'s default folder is a private one, removed afterwards
    with whatever is left in it (ModelOpt's ``mkstemp`` intermediate files stay behind when an
    exception leaves ``quantize()``). Not used with ModelOpt's ``--keep_intermediate_files``."""
    import shutil
    import tempfile

    before = tempfile.tempdir
    own = tempfile.mkdtemp(prefix="deploykit-modelopt-")
    tempfile.tempdir = own
    try:
        yield own
    finally:
        tempfile.tempdir = before
        shutil.rmtree(own, ignore_errors=True)


def _nan_into_minimum(model) -> int:
    """Fold a NaN-propagating term into each minimum that ORT's ``MinMaxCalibrater.augment_graph``
    added (node ``<t>_ReduceMin`` -> ``<t>_ReduceMin_Reshape``): the minimum becomes
    ``ReduceMin(t) - 0 * |ReduceSum(t)|``, the same value bit for bit while ``t`` is finite (the
    term is +0), NaN when ``t`` holds a NaN or an Inf (or when its sum overflows FP32: then
    entropy runs, which is only slower). ORT's CPU ReduceMin/ReduceMax return NaN only when the
    NaN is a tensor's first element. Float32 tensors only (another type fails the range check
    anyway). Returns the number of minima changed."""
    import uuid

    import onnx
    from onnx import helper, numpy_helper

    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(g.value_info) + list(g.input) + list(g.output)}
    zero = f"deploykit_zero_{uuid.uuid4().hex}"
    changed = 0
    for i in range(len(g.node) - 1, -1, -1):
        n = g.node[i]
        t = n.input[0] if n.input else ""
        if (n.op_type != "ReduceMin" or n.name != f"{t}_ReduceMin"
                or list(n.output) != [f"{t}_ReduceMin_Reshape"]
                or types.get(t) != onnx.TensorProto.FLOAT):
            continue
        raw, total, size, term = (f"{t}_deploykit_{k}" for k in ("min", "sum", "abs", "term"))
        out = n.output[0]
        n.output[0] = raw
        new = [helper.make_node("ReduceSum", [t], [total], keepdims=1, name=total),
               helper.make_node("Abs", [total], [size], name=size),
               helper.make_node("Mul", [size, zero], [term], name=term),
               helper.make_node("Sub", [raw, term], [out], name=f"{t}_deploykit_sub")]
        for k, node in enumerate(new):
            g.node.insert(i + 1 + k, node)
        changed += 1
    if changed:
        g.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
    return changed


def _in_graph_order(calibrator) -> None:
    """Remake the calibrator's ORT session with ``ExecutionOrder.PRIORITY_BASED`` (the same
    file, session options, EPs and EP options otherwise): ORT then runs the nodes in the order
    of the augmented graph, where ``MinMaxCalibrater.augment_graph`` puts each ReduceMin/ReduceMax
    before the tensor's first consumer, so each activation is freed once read. ORT's default
    order runs those reductions last and holds every activation of the batch until then: Lite0,
    100 samples in one batch, 5.5 GB and 1.6 M page faults (7.6 s) against 1.1 GB (3.2 s), the
    ranges bit for bit the same (each node computes the same function of its inputs whatever
    the order; benchmarks/README.md, stop 45). A session that cannot be remade stays as it was."""
    import onnxruntime as ort

    sess = getattr(calibrator, "infer_session", None)
    path = getattr(calibrator, "augmented_model_path", None)
    if sess is None or not path:
        return
    try:
        so = sess.get_session_options()
        if so.execution_order == ort.ExecutionOrder.PRIORITY_BASED:
            return
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        providers = sess.get_providers()
        options = sess.get_provider_options()
        calibrator.infer_session = None  # one session's memory at a time
        calibrator.infer_session = ort.InferenceSession(
            str(path), sess_options=so, providers=providers,
            provider_options=[options.get(p, {}) for p in providers])
    except Exception as e:  # noqa: BLE001 - the default order is only slower
        calibrator.infer_session = sess
        print(f"deploykit: calibration session kept in ORT's default order ({type(e).__name__}: "
              f"{e})", flush=True)


def _session_providers(calibrator) -> list:
    """The EPs of a calibrator's ORT session, as the session runs them (ModelOpt 0.47.0 leaves
    ``calibrator.execution_providers`` empty and hands its EP list to the session itself; a
    requested CUDA EP that this onnxruntime lacks is not in the session's list), then any the
    calibrator keeps: part of a calibration cache's key."""
    sess = getattr(calibrator, "infer_session", None)
    return [list(sess.get_providers()) if sess is not None else None,
            list(getattr(calibrator, "execution_providers", []) or []),
            list(getattr(calibrator, "providers", []) or [])]


def _read_cache(path: Path, load) -> tuple[dict, str]:
    """``load(path)`` of a calibration cache file: ``({tensor: statistics}, the run that wrote
    it)``; ``({}, "")`` when there is none, or when it cannot be read (a truncated or foreign
    file: said in one line, and the run calibrates anew and writes it again)."""
    import zipfile

    if not path.exists():
        return {}, ""
    try:
        return load(path)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        print(f"deploykit: calibration cache {path.name} unreadable ({type(e).__name__}: "
              f"{e}); calibrating anew", flush=True)
        return {}, ""


def _write_cache(path: Path, arrays: dict) -> None:
    """Write a calibration cache file atomically; one that cannot be written is said in one line
    (the run's own file does not depend on it; a later run calibrates itself)."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"deploykit: calibration cache {path} not written ({e.strerror or e}; "
              "--histogram-cache names the folder); later runs calibrate themselves", flush=True)


@contextlib.contextmanager
def _ranges_as_entropy_gives(cache: str | Path | None = None, label: str = ""):
    """While the block runs, ModelOpt's max calibration (``MinMaxCalibrater.collect_data`` as
    ModelOpt 0.47.0's ``ort_patching`` installs it) raises :class:`_RangeNotEquivalent` when a
    collected range is not finite or not float32 (see :func:`entropy_as_max`), and, with
    ``cache``, keeps its per-tensor ranges in that folder and takes them from there.

    A tensor's range depends only on that tensor's values (ORT runs the calibration graph with
    every optimisation off; the ReduceMin/ReduceMax nodes added for other tensors read it and
    change nothing), so a run whose tensors an earlier run with the same graph (before ORT adds
    its ReduceMin/ReduceMax nodes), feeds, settings, EPs and onnxruntime version covered gets
    exactly those ranges and skips the calibration session (the ``baseline`` variant's tensors
    cover the Conv/Gemm inputs of ``int8``/``int8_hp32``). Prints :data:`HISTOGRAM_MARK` and the
    earlier run on a reuse. Grouped Q/DQ tensors or a moving average run as ModelOpt would.

    Args:
        cache: the cache folder (created; one ``ranges-<key>.npz`` per key, written atomically).
        label: this run's name, recorded with the ranges it writes.
    """
    import hashlib

    import onnx
    import onnxruntime as ort
    from modelopt.onnx.quantization import ort_patching
    from onnxruntime.quantization.calibrate import (CalibrationMethod, MinMaxCalibrater,
                                                    TensorData, TensorsData)

    real_collect = ort_patching._collect_data_minmax_calibrator
    real_augment = MinMaxCalibrater.augment_graph
    folder = Path(cache) if cache else None

    def augment(calibrator):
        g = onnx.GraphProto()
        g.CopyFrom(calibrator.model.graph)
        calibrator._deploykit_graph = hashlib.sha256(
            g.SerializeToString(deterministic=True)).hexdigest()
        out = real_augment(calibrator)
        if _nan_into_minimum(calibrator.model):  # saved again where the session reads it
            onnx.save(calibrator.model, calibrator.augmented_model_path,
                      save_as_external_data=calibrator.use_external_data_format)
        return out

    def key(calibrator, feeds: list[dict]) -> str:
        settings = (type(calibrator).__name__, calibrator.symmetric, calibrator.per_channel,
                    _session_providers(calibrator), ort.__version__)
        return _cache_key(calibrator._deploykit_graph.encode(), feeds, settings)

    def load(path: Path) -> tuple[dict, str]:
        with np.load(path, allow_pickle=False) as z:
            return ({str(n): (z[f"{i}_lo"], z[f"{i}_hi"]) for i, n in enumerate(z["names"])},
                    str(z["label"]))

    def check(ranges) -> None:
        for name, td in (ranges.data.items() if ranges else []):
            lo, hi = (np.asarray(v) for v in td.range_value)
            for a in (lo, hi):
                if a.dtype != np.float32 or not np.all(np.isfinite(a)):
                    raise _RangeNotEquivalent(f"tensor {name}: range value {a!r}")
            # ModelOpt's entropy path bins the tensor over [-t, t] in 128 bins of its dtype
            # (ort_patching._collect_value). NumPy refuses bins that cannot all be finite-sized
            # (subnormal t), and its index arithmetic overflows where max + t exceeds FP32's
            # largest value: binning the two extreme values runs that same code.
            t = float(max(np.max(np.abs(lo)), np.max(np.abs(hi))))
            ends = np.concatenate([lo.ravel(), hi.ravel()]).astype(lo.dtype)
            try:
                with np.errstate(all="ignore"):
                    np.histogram(ends, 128, range=(-t, t))
            except (ValueError, IndexError, FloatingPointError) as e:
                raise _RangeNotEquivalent(f"tensor {name}: max |x| {t:.3g}: {e}") from None

    def collect(calibrator, data_reader):
        if (folder is None or calibrator.group_qdq_tensors or calibrator.moving_average
                or not hasattr(calibrator, "_deploykit_graph")):
            _in_graph_order(calibrator)
            out = real_collect(calibrator, data_reader)
            check(calibrator.calibrate_tensors_range)
            return out
        feeds = _read_feeds(data_reader)
        path = folder / f"ranges-{key(calibrator, feeds)}.npz"
        known, source = _read_cache(path, load)
        added = [o.name for o in calibrator.model.graph.output][calibrator.num_model_outputs:]
        want = [added[i].rpartition("_")[0] for i in range(0, len(added), 2)]
        if feeds and want and all(t in known for t in want):
            calibrator.calibrate_tensors_range = TensorsData(CalibrationMethod.MinMax, {
                t: TensorData(lowest=known[t][0], highest=known[t][1]) for t in want})
            check(calibrator.calibrate_tensors_range)
            print(f"{HISTOGRAM_MARK}{source}'s run: {len(want)} tensor ranges (min, max), same "
                  "graph, calibration data, EP and settings (ORT's calibration session not run)",
                  flush=True)
            return None
        _in_graph_order(calibrator)
        out = real_collect(calibrator, _Replay(feeds))
        ranges = calibrator.calibrate_tensors_range
        check(ranges)
        if ranges:
            known.update({n: td.range_value for n, td in ranges.data.items()})
            arrays = {"names": np.array(list(known)), "label": np.array(label)}
            for i, (lo, hi) in enumerate(known.values()):  # each as it was: dtype and shape
                arrays[f"{i}_lo"], arrays[f"{i}_hi"] = np.asarray(lo), np.asarray(hi)
            _write_cache(path, arrays)
        return out

    ort_patching._collect_data_minmax_calibrator = collect  # installed by patch_ort_modules
    MinMaxCalibrater.augment_graph = augment
    try:
        yield
    finally:
        ort_patching._collect_data_minmax_calibrator = real_collect
        if MinMaxCalibrater.collect_data is collect:
            MinMaxCalibrater.collect_data = real_collect
        MinMaxCalibrater.augment_graph = real_augment


def modelopt_quantize(argv: Sequence[str], calib_batch: str | int = "all",
                      fp16_output: str | Path | None = None,
                      histogram_cache: str | Path | None = None,
                      entropy_histograms: bool = False) -> None:
    """``python -m modelopt.onnx.quantization ARGV`` (ModelOpt's own argument parser and
    ``quantize()``), with the calibration batch set on its own.

    ModelOpt 0.47.0's CLI has one knob for two things: ``--calibration_shapes`` is both the
    calibration batch (calib_utils.CalibrationDataProvider) and the shapes its GEMV rule reads
    (graph_utils.find_nodes_from_matmul_to_exclude: a Gemm whose M is 1 stays float). Without
    it the batch is the model's batch dim, 1 when dynamic. Here the calibration data reader gets
    the batch of :func:`calibration_plan` and, unless ARGV says otherwise, the GEMV rule keeps
    seeing the deployment batch (:func:`deployment_shapes`), so the nodes ModelOpt quantizes are
    the same as with its CLI; only the calibration batch differs.

    ``fp16_output``: the same calibration also gives the ``--high_precision_dtype fp16`` file.
    ModelOpt 0.47.0's INT8 path calibrates and places Q/DQ in FP32 and only then converts the
    float tensors (``modelopt/onnx/quantization/int8.py`` ``quantize`` ->
    ``precision_utils._convert_to_runtime_precision`` -> ``modelopt.onnx.autocast.convert_to_f16``,
    nothing in between reads the dtype). With ``--high_precision_dtype fp32`` in ARGV, that
    conversion's model and arguments are recorded and the conversion is run once more with
    ``fp16`` (:func:`fp16_from_fp32_qdq`), written to ``fp16_output``: the file the CLI writes with
    ``--high_precision_dtype fp16`` (byte-identical on EfficientNet-Lite0 and in
    tests/quant/test_modelopt.py), for one calibration instead of two.

    Entropy calibration (ModelOpt's default) of one batch runs as max calibration where
    :func:`entropy_as_max` shows both give the same file (printed with
    :data:`ENTROPY_AS_MAX_MARK`); ``entropy_histograms`` runs ORT's histograms anyway.

    Raises:
        UsageError: ``--autotune`` (use ModelOpt's CLI for it); ``fp16_output`` without
            ``--quantize_mode int8 --high_precision_dtype fp32``.
        StageError: ModelOpt did not convert the model (its INT8 path changed).
    """
    import inspect

    from modelopt.onnx.quantization import quantize
    from modelopt.onnx.quantization.__main__ import get_parser
    from modelopt.onnx.quantization.calib_utils import CalibrationDataProvider

    report_sessions()
    args = get_parser().parse_args(list(argv))
    if args.autotune is not None:
        raise UsageError("--autotune: run python -m modelopt.onnx.quantization directly")
    if fp16_output is not None and (args.high_precision_dtype != "fp32"
                                    or args.quantize_mode != "int8"):
        raise UsageError("--fp16-output needs --quantize_mode int8 --high_precision_dtype fp32 "
                         "(it converts that run's calibrated model as ModelOpt's fp16 "
                         "high-precision dtype does)")
    params = inspect.signature(quantize).parameters
    kw = {k: v for k, v in vars(args).items() if k in params and k != "onnx_path"}
    kw["autotune"] = False
    plan = data = None
    if args.calibration_data_path:
        data = load_npz(args.calibration_data_path, None, "4_make_calib.py",
                        flag="--calibration_data_path", feed=True)
        plan = calibration_plan(args.onnx_path, data, calib_batch)
        kw["calibration_data"] = data
        kw["calibration_data_reader"] = CalibrationDataProvider(args.onnx_path, data,
                                                                plan["calibration_shapes"])
        if not args.calibration_shapes:
            kw["calibration_shapes"] = deployment_shapes(args.onnx_path, data)
        print(f"calibration batch {plan['batch_size']} ({len(plan['batches'])} batch(es) of "
              f"{plan['batches'][:4]}); ModelOpt's GEMV rule sees {kw['calibration_shapes']}")
    why = None if entropy_histograms else entropy_as_max(args, plan)
    if why:  # the same one batch as entropy's (a fresh reader: the other one may run after)
        kw_max = {**kw, "calibration_method": "max",
                  "calibration_data_reader": CalibrationDataProvider(
                      args.onnx_path, data, plan["calibration_shapes"])}
    cache = (_histogram_cache(histogram_cache, Path(args.output_path).stem)
             if histogram_cache else contextlib.nullcontext())

    def calibrate_and_quantize():
        if why:
            print(ENTROPY_AS_MAX_MARK + why, flush=True)
            try:
                keep = getattr(args, "keep_intermediate_files", False)  # ModelOpt's own files
                with _ranges_as_entropy_gives(histogram_cache, Path(args.output_path).stem), \
                        (contextlib.nullcontext() if keep else _own_tempdir()):
                    quantize(args.onnx_path, **kw_max)
                return
            except _RangeNotEquivalent as e:
                print(f"{ENTROPY_FALLBACK_MARK} ({e}): entropy calibration as ModelOpt runs it; "
                      "the rest of this log is that run's", flush=True)
                seen[:] = []
        with cache:
            quantize(args.onnx_path, **kw)

    if fp16_output is None:
        seen: list = []
        calibrate_and_quantize()
        return
    with _runtime_precision_call() as seen:
        calibrate_and_quantize()
    if not seen:
        raise StageError("ModelOpt never converted the calibrated model to its runtime "
                         "precision (modelopt.onnx.quantization.int8 changed?): the FP16 file "
                         "cannot be derived; quantize the variants one by one")
    print(FP16_MARK + str(fp16_output), flush=True)
    fp16_from_fp32_qdq(seen[-1], fp16_output, bool(args.use_external_data_format))


@contextlib.contextmanager
def _runtime_precision_call():
    """Record the model and the arguments of ModelOpt's conversion to the runtime precision
    (``modelopt.onnx.quantization.int8._convert_to_runtime_precision``, which returns an
    ``--high_precision_dtype fp32`` model unchanged) while the block runs; yields the list of
    ``(model, kwargs)`` seen. ModelOpt's own call is left as it is."""
    from modelopt.onnx.quantization import int8

    real = int8._convert_to_runtime_precision
    seen: list[tuple] = []

    def spy(model, **kwargs):
        out = real(model, **kwargs)
        seen.append((copy.deepcopy(out), kwargs))  # before quantize() goes on with it
        return out

    int8._convert_to_runtime_precision = spy
    try:
        yield seen
    finally:
        int8._convert_to_runtime_precision = real


#: Printed by the child when a variant's calibration histograms come from an earlier run
#: (:func:`_histogram_cache`); the rest of the line names that run (:func:`histograms_reused_from`).
HISTOGRAM_MARK = "deploykit: calibration statistics reused from "


def histograms_reused_from(log_text: str) -> str | None:
    """The ModelOpt run whose calibration histograms a child took, from its log: the output
    name (stem) of that run (for int8/int8_hp32 made by one calibration, the FP32 twin whose
    flags ran), or None when the child calibrated itself."""
    names = [line.split(HISTOGRAM_MARK, 1)[1].split("'s run", 1)[0].strip()
             for line in log_text.splitlines() if HISTOGRAM_MARK in line]
    return names[-1] if names else None


class _Replay:
    """A ``CalibrationDataReader`` over feeds already read (:func:`_read_feeds`)."""

    def __init__(self, feeds: list[dict]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)


def _read_feeds(data_reader) -> list[dict]:
    """Every feed a ``CalibrationDataReader`` gives, in order."""
    feeds = []
    while (f := data_reader.get_next()):
        feeds.append(f)
    return feeds


def _cache_key(graph: bytes, feeds: list[dict], settings: tuple) -> str:
    """SHA-256 of what a calibration's per-tensor statistics depend on: ``graph`` (the graph's
    bytes as the key's owner defines them), the feeds (names, dtypes, shapes, bytes) and
    ``settings`` (calibrator, EPs, onnxruntime version...)."""
    import hashlib

    h = hashlib.sha256(graph)
    for feed in feeds:
        for name in sorted(feed):
            a = np.ascontiguousarray(feed[name])
            h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
            h.update(a.tobytes())
    h.update(repr(settings).encode())
    return h.hexdigest()


def _histogram_key(calibrator, feeds: list[dict]) -> str:
    """:func:`_cache_key` of a histogram calibrator's per-tensor histograms: the graph it runs
    (its calibration outputs left out), the feeds, the histogram settings, the EPs and the
    onnxruntime version."""
    import onnx
    import onnxruntime as ort

    g = onnx.GraphProto()
    g.CopyFrom(calibrator.model.graph)
    del g.output[:]  # the tensors this run calibrates were added as outputs
    settings = (type(calibrator).__name__, calibrator.method, calibrator.symmetric,
                calibrator.num_bins, calibrator.num_quantized_bins, calibrator.percentile,
                calibrator.scenario, _session_providers(calibrator), ort.__version__)
    return _cache_key(g.SerializeToString(deterministic=True), feeds, settings)


#: Threads that make the calibration histograms of a batch, at most (each takes whole tensors;
#: NumPy's reductions and histogram binning release the GIL for most of their time).
HISTOGRAM_THREADS_MAX = 4


def _histogram_threads() -> int:
    """Threads for :func:`_threaded_collector`: the CPUs this process may run on
    (:func:`deploykit.cli.usable_cpus`), at most :data:`HISTOGRAM_THREADS_MAX`."""
    from deploykit.cli import usable_cpus

    return max(1, min(HISTOGRAM_THREADS_MAX, usable_cpus()))


def _threaded_collector(calibrator, threads: int):
    """An ``onnxruntime.quantization.calibrate.HistogramCollector`` for ``calibrator`` whose
    ``collect`` splits each batch's tensors over ``threads`` threads, each running the class's
    own ``collect`` (as ModelOpt 0.47.0's ``ort_patching`` patches it) on its share.

    A tensor's histogram depends only on that tensor's arrays, batch after batch
    (``collect_value`` / ``collect_absolute_value`` / ``merge_histogram`` read and write that
    tensor's entry alone), and each batch's tensors are all done before the next batch starts,
    so every histogram is the one a single thread makes, bit for bit; the dict's order is put
    back to the order one thread would have made it in (tests/quant/test_modelopt.py).

    Measured on this project's 2-core Intel Xeon (benchmarks/README.md, stop 41): ORT's
    ``collect`` on EfficientNet-Lite0's 92 calibration tensors (100 samples) took 12.6-13.6 s on
    one thread, 10.7-11.5 s on two. Each thread holds a flattened copy of the tensor it works
    on, so the peak memory of this step grows with the threads (7.1 against 6.6 GiB for the
    whole ``baseline`` run on two).
    """
    from concurrent.futures import ThreadPoolExecutor

    from onnxruntime.quantization.calibrate import HistogramCollector

    class ThreadedHistogramCollector(HistogramCollector):
        def collect(self, name_to_arr):
            names = list(name_to_arr)
            if len(names) < 2:
                return super().collect(name_to_arr)
            sizes = {n: sum(map(np.size, v)) if isinstance(v, list) else np.size(v)
                     for n, v in name_to_arr.items()}
            shares: list[list[str]] = [[] for _ in range(min(threads, len(names)))]
            load = [0] * len(shares)
            for n in sorted(names, key=lambda n: -sizes[n]):  # largest first, to the lightest
                i = load.index(min(load))
                shares[i].append(n)
                load[i] += sizes[n]
            order = list(self.histogram_dict) + [n for n in names if n not in self.histogram_dict]
            with ThreadPoolExecutor(len(shares)) as pool:
                done = [pool.submit(super(ThreadedHistogramCollector, self).collect,
                                    {n: name_to_arr[n] for n in names if n in share})
                        for share in map(set, shares)]
                for f in done:
                    f.result()  # a thread's exception is raised here
            self.histogram_dict = {n: self.histogram_dict[n] for n in order}
            return None

    return ThreadedHistogramCollector(
        method=calibrator.method, symmetric=calibrator.symmetric, num_bins=calibrator.num_bins,
        num_quantized_bins=calibrator.num_quantized_bins, percentile=calibrator.percentile,
        scenario=calibrator.scenario)


@contextlib.contextmanager
def _histogram_cache(folder: str | Path, label: str):
    """While the block runs, ModelOpt's histogram calibration (entropy, percentile,
    distribution: ``HistogramCalibrater.collect_data``, as ModelOpt 0.47.0's ``ort_patching``
    installs it) keeps its per-tensor histograms in ``folder`` and takes them from there.

    Each tensor's histogram is made from that tensor's values alone (``HistogramCollector``
    ``collect_value`` / ``collect_absolute_value``), which depend only on the graph, the feeds
    and the EP, not on which other tensors the session also returns (ORT runs the calibration
    graph with every optimisation off). So a run whose tensors an earlier run with the same
    :func:`_histogram_key` already covered (the ``baseline`` variant's Conv/Gemm/Add/Clip inputs
    cover the recipe's Conv/Gemm ones) gets exactly those histograms, in the order its own run
    would have made them, and skips the calibration session; the thresholds are computed from
    them as usual. A run with grouped Q/DQ tensors (concat elimination mixes tensors), with
    ModelOpt's per-node calibration, or with a tensor the cache lacks runs as ModelOpt would and
    then adds its histograms. Prints :data:`HISTOGRAM_MARK` and the earlier run on a reuse.

    Args:
        folder: the cache folder (created; one ``<key>.npz`` per key, written atomically).
        label: this run's name, recorded with the histograms it writes.
    """
    from modelopt.onnx.quantization import ort_patching
    from onnxruntime.quantization.calibrate import HistogramCalibrater, HistogramCollector

    folder = Path(folder)
    real = ort_patching._collect_data_histogram_calibrator

    def load(path: Path) -> tuple[dict, str]:
        with np.load(path, allow_pickle=False) as z:
            names = [str(n) for n in z["names"]]
            sizes = [int(k) for k in z["sizes"]]
            hist = {n: tuple(z[f"{i}_{j}"][()] if z[f"{i}_{j}"].ndim == 0 else z[f"{i}_{j}"]
                             for j in range(k)) for i, (n, k) in enumerate(zip(names, sizes))}
            return hist, str(z["label"])

    def save(path: Path, hist: dict) -> None:
        arrays = {"names": np.array(list(hist)), "label": np.array(label),
                  "sizes": np.array([len(v) for v in hist.values()])}
        for i, v in enumerate(hist.values()):
            for j, a in enumerate(v):
                arrays[f"{i}_{j}"] = np.asarray(a)
        _write_cache(path, arrays)

    def collect(calibrator, data_reader):
        if calibrator.group_qdq_tensors or not hasattr(calibrator, "num_quantized_bins"):
            return real(calibrator, data_reader)
        feeds = _read_feeds(data_reader)
        path = folder / f"{_histogram_key(calibrator, feeds)}.npz"
        known, source = _read_cache(path, load)
        want = [o.name for o in calibrator.model.graph.output
                if o.name in calibrator.tensors_to_calibrate]
        if feeds and want and all(t in known for t in want):
            calibrator.collector = HistogramCollector(
                method=calibrator.method, symmetric=calibrator.symmetric,
                num_bins=calibrator.num_bins, num_quantized_bins=calibrator.num_quantized_bins,
                percentile=calibrator.percentile, scenario=calibrator.scenario)
            calibrator.collector.histogram_dict = {t: known[t] for t in want}
            print(f"{HISTOGRAM_MARK}{source}'s run: {len(want)} tensors, same graph, "
                  f"calibration data, EP and histogram settings (ORT's calibration session "
                  "not run)", flush=True)
            return None
        threads = _histogram_threads()
        if calibrator.collector is None and threads > 1:
            # ModelOpt's loop keeps a collector it finds (``if not calibrator.collector``)
            calibrator.collector = _threaded_collector(calibrator, threads)
        out = real(calibrator, _Replay(feeds))
        if calibrator.collector is not None:
            save(path, {**known, **calibrator.collector.histogram_dict})
        return out

    ort_patching._collect_data_histogram_calibrator = collect  # installed by patch_ort_modules
    try:
        yield
    finally:
        ort_patching._collect_data_histogram_calibrator = real
        if HistogramCalibrater.collect_data is collect:
            HistogramCalibrater.collect_data = real


def fp16_from_fp32_qdq(call: tuple, dst: str | Path, external: bool = False) -> None:
    """Write ``dst``: the calibrated INT8 Q/DQ model of an ``--high_precision_dtype fp32`` run,
    converted to FP16 by ModelOpt's own conversion with the arguments ModelOpt passed it in that
    run, only the dtype changed (``_convert_to_runtime_precision(model,
    high_precision_dtype="fp16", ...)``, which calls ``modelopt.onnx.autocast.convert_to_f16``),
    then saved and checked as ModelOpt's ``quantize()`` does (``save_onnx``, ``onnx.checker``:
    a failed check is a printed warning there too).

    Args:
        call: ``(model, kwargs)`` recorded by :func:`_runtime_precision_call`.
        dst: output path. external: ``--use_external_data_format``.
    """
    import onnx
    from modelopt.onnx.quantization import int8
    from modelopt.onnx.utils import save_onnx

    model, kwargs = call
    model16 = int8._convert_to_runtime_precision(model,
                                                 **{**kwargs, "high_precision_dtype": "fp16"})
    save_onnx(model16, str(dst), external)
    try:
        onnx.checker.check_model(str(dst))
    except onnx.checker.ValidationError as e:
        print(f"WARNING: ONNX model checker failed on {dst}: {e}", flush=True)
