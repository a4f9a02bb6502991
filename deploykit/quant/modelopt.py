"""ModelOpt's ONNX PTQ with a calibration batch of its own, its log warnings, and an ORT smoke
run of its output.
"""
from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.io import atomic_path, load_npz
from deploykit.errors import StageError, UsageError
from deploykit.quant.calibration import calibration_plan, deployment_shapes
from deploykit.runners import ORT_DTYPES, ort_session_options

#: ModelOpt 0.47.0 converts a file below this opset up to it before quantizing
#: (``modelopt/onnx/utils.py`` ``BASE_MIN_OPSET``; intermediate ``<name>_opset19.onnx``).
MODELOPT_MIN_OPSET = 19


#: Printed by the child between the fp32 run and its FP16 conversion (:func:`modelopt_quantize`
#: with ``fp16_output``): the log before it is the fp32 variant's, the whole log the FP16's.
FP16_MARK = "deploykit: FP16 conversion of the calibrated model (ModelOpt convert_to_f16) -> "


def modelopt_quantize(argv: Sequence[str], calib_batch: str | int = "all",
                      fp16_output: str | Path | None = None,
                      histogram_cache: str | Path | None = None) -> None:
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
    cache = (_histogram_cache(histogram_cache, Path(args.output_path).stem)
             if histogram_cache else contextlib.nullcontext())
    if fp16_output is None:
        with cache:
            quantize(args.onnx_path, **kw)
        return
    with cache, _runtime_precision_call() as seen:
        quantize(args.onnx_path, **kw)
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
HISTOGRAM_MARK = "deploykit: calibration histograms reused from "


def histograms_reused_from(log_text: str) -> str | None:
    """The ModelOpt run whose calibration histograms a child took, from its log: the output
    name (stem) of that run (for int8/int8_hp32 made by one calibration, the FP32 twin whose
    flags ran), or None when the child calibrated itself."""
    names = [line.split(HISTOGRAM_MARK, 1)[1].split("'s run", 1)[0].strip()
             for line in log_text.splitlines() if HISTOGRAM_MARK in line]
    return names[-1] if names else None


def _histogram_key(calibrator, feeds: list[dict]) -> str:
    """SHA-256 of everything a histogram calibrator's per-tensor histograms depend on: the graph
    it runs (its calibration outputs left out), the calibration feeds (names, dtypes, shapes,
    bytes), the histogram settings, the EPs and the onnxruntime version."""
    import hashlib

    import onnx
    import onnxruntime as ort

    h = hashlib.sha256()
    g = onnx.GraphProto()
    g.CopyFrom(calibrator.model.graph)
    del g.output[:]  # the tensors this run calibrates were added as outputs
    h.update(g.SerializeToString(deterministic=True))
    for feed in feeds:
        for name in sorted(feed):
            a = np.ascontiguousarray(feed[name])
            h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
            h.update(a.tobytes())
    settings = (type(calibrator).__name__, calibrator.method, calibrator.symmetric,
                calibrator.num_bins, calibrator.num_quantized_bins, calibrator.percentile,
                calibrator.scenario, list(getattr(calibrator, "execution_providers", []) or []),
                list(getattr(calibrator, "providers", []) or []), ort.__version__)
    h.update(repr(settings).encode())
    return h.hexdigest()


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
    folder.mkdir(parents=True, exist_ok=True)
    real = ort_patching._collect_data_histogram_calibrator

    class Replay:  # a CalibrationDataReader over the feeds already read
        def __init__(self, feeds):
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

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
        with atomic_path(path) as tmp:
            np.savez(tmp, **arrays)

    def collect(calibrator, data_reader):
        if calibrator.group_qdq_tensors or not hasattr(calibrator, "num_quantized_bins"):
            return real(calibrator, data_reader)
        feeds = []
        while (f := data_reader.get_next()):
            feeds.append(f)
        path = folder / f"{_histogram_key(calibrator, feeds)}.npz"
        known, source = load(path) if path.exists() else ({}, "")
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
        out = real(calibrator, Replay(feeds))
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


# --------------------------------------------------------------------------------------------
# The EPs calibration really ran on
# --------------------------------------------------------------------------------------------
# printed by the child for every ONNX Runtime session created in it (ModelOpt's calibration
# sessions among them), read back from the log by :func:`calibration_ep`
SESSION_MARK = "deploykit: ORT session providers: "
# ModelOpt's --calibration_eps names -> ONNX Runtime's provider names
EP_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                "trt": "TensorrtExecutionProvider", "dml": "DmlExecutionProvider"}


def report_sessions() -> None:
    """In the ModelOpt child: print :data:`SESSION_MARK` and the providers of every
    ``onnxruntime.InferenceSession`` created from now on (``session.get_providers()``, what
    ONNX Runtime really assigned: a requested EP it does not have is dropped there)."""
    import onnxruntime as ort

    cls = ort.InferenceSession
    if getattr(cls.__init__, "_deploykit_reports", False):
        return
    orig = cls.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        try:
            print(SESSION_MARK + ",".join(self.get_providers()), flush=True)
        except Exception:  # noqa: BLE001 - reporting never breaks a session
            pass

    init._deploykit_reports = True
    cls.__init__ = init


def calibration_ep(requested: str, log: Path | str) -> dict:
    """What calibrated: the EP asked for and the providers of the ORT sessions ModelOpt
    created (from the child's log, :func:`report_sessions`).

    Args:
        requested: the ``--calibration_eps`` value (``cpu``, ``cuda:0``, ``trt``, ``dml``).
        log: the ModelOpt child's log.
    Returns:
        ``{"requested", "requested_provider", "used" (providers in order of first use, []
        when the log names no session), "available" (onnxruntime.get_available_providers()),
        "fallback" (True when the requested provider ran in no session although sessions
        ran)}``.
    """
    import onnxruntime as ort

    want = EP_PROVIDERS.get(requested.split(":")[0], requested)
    used: list[str] = []
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(SESSION_MARK):
            for p in line[len(SESSION_MARK):].strip().split(","):
                if p and p not in used:
                    used.append(p)
    return {"requested": requested, "requested_provider": want, "used": used,
            "available": list(ort.get_available_providers()),
            "fallback": bool(used) and want not in used}


def ep_fallback_warning(ep: dict) -> str | None:
    """The WARNING line for :func:`calibration_ep`'s record when the requested EP did not
    calibrate (None when it did, or when no session was seen)."""
    if not ep["fallback"]:
        return None
    why = ("this onnxruntime has no " + ep["requested_provider"]
           if ep["requested_provider"] not in ep["available"]
           else "ONNX Runtime did not assign it")
    return (f"WARNING: EPS={ep['requested']} was requested but calibration ran on "
            f"{', '.join(ep['used'])} ({why}; available: {', '.join(ep['available'])}): the "
            "scales are those of that EP; install onnxruntime-gpu for the CUDA EP, or set "
            "EPS=cpu to say so")


# --------------------------------------------------------------------------------------------
# record-quant (5_quantize.sh)
# --------------------------------------------------------------------------------------------
KEEP_WARNINGS = re.compile(r"WARNING|replaced with|smaller than smallest|Error|error:", re.I)


def log_warnings(log: Path, limit: int = 40) -> list[str]:
    """ModelOpt warning lines worth keeping (deduplicated, timestamps stripped)."""
    out: list[str] = []
    for line in Path(log).read_text(errors="replace").splitlines():
        if KEEP_WARNINGS.search(line):
            msg = re.sub(r"^\S+ \S+ - \[modelopt\]\[onnx\] - ", "", line).strip()
            if msg not in out:
                out.append(msg)
    return out[:limit]


def ort_smoke(path: Path) -> dict:
    """Load ``path`` in ORT CPU and run one all-zero batch-1 input (symbolic dims -> 1), at the
    default optimisation level: ``{"ok": bool, "error": str | None}``. A model ORT accepts at
    load time can still fail at the first run (blocked DequantizeLinear shape checks)."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), ort_session_options("all"),
                                    providers=["CPUExecutionProvider"])
        feed = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
            # the input's own dtype: a uint8 image or an int64 mask is fed as such
            dtype = ORT_DTYPES.get(i.type, np.float32)
            feed[i.name] = np.zeros(shape, dtype)
        sess.run(None, feed)
        return {"ok": True, "error": None}
    except Exception as e:  # noqa: BLE001 - ORT raises Fail/InvalidGraph/RuntimeException
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
