"""Backend runners: one interface for PyTorch, ONNX Runtime, TensorRT and a null backend.

Every stage and tool that runs a model goes through these classes (after Polygraphy's
``BaseRunner`` and timm's ``benchmark.py``):

- a context manager: ``with OrtRunner(path) as r: ...``;
- ``infer(feed) -> {output name: np.ndarray}``: ``feed`` maps input names to host arrays with the
  batch on axis 0; outputs come back on the host (floating outputs as float32);
- ``time(feed, warmup, iters) -> Timing``: the runner's own timer (``time.perf_counter`` around
  a host call on the CPU, plus CUDA events around the GPU work on a GPU); preprocessing is never
  inside the timed region;
- ``describe() -> dict``: backend, device, the EP or engine really used, versions, TF32 state;
- ``input_names`` / ``output_names``; ``batch_range``: the batch sizes the model accepts.

The timed loops themselves live in :mod:`deploykit.timing`.

Terms (trtexec's): *end-to-end* latency is host wall-clock from host inputs to host outputs
(H2D copy + compute + D2H copy + synchronisation); *GPU Compute Time* is the device time of the
work alone, from CUDA events. Units: milliseconds (ms).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Sequence
import numpy as np

from deploykit.envinfo import device_info
from deploykit.errors import StageError, UsageError, ort_load_error, out_of_memory_message
from deploykit.torch_cpu import (CPU_CHUNK, ORT_CHUNK_MIN_FEED, ORT_CPU_CHUNK,
                                 forward_cpu_layout, infer_in_chunks)
from deploykit.timing import MAX_SECONDS, Timing, cuda_event_loop, try_extra, wall_loop
from deploykit.trt.parsers import PLAN_HEADER_BYTES, classify_plan_load_error, parse_layer_info


# --------------------------------------------------------------------------------------------
# Interface
# --------------------------------------------------------------------------------------------
class Runner:
    """Base class: a model on one backend. Subclasses set ``input_names``/``output_names`` and
    implement :meth:`infer`, :meth:`time` and :meth:`describe`."""

    #: Time budget (s) of one timed loop (:data:`deploykit.timing.MAX_SECONDS`); a stage's
    #: ``--max-seconds`` sets it on the runner it times (``float('inf')``: every iteration).
    max_seconds: float = MAX_SECONDS

    backend = "?"
    input_names: list[str] = []
    output_names: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Release the backend's resources (idempotent)."""

    @property
    def batch_range(self) -> tuple[int, int | None]:
        """``(min, max)`` batch size the model accepts; ``max`` None = unbounded. A static batch
        B gives ``(B, B)``."""
        return 1, None

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch.

        Args:
            feed: ``{input name: array}``, batch on axis 0, dtypes as the model declares.
        Returns:
            ``{output name: host array}``, floating outputs as float32.
        """
        raise NotImplementedError

    def time(self, feed: dict[str, np.ndarray], warmup: int, iters: int) -> Timing:
        """Latency of :meth:`infer`-equivalent work on ``feed`` (see :class:`Timing`)."""
        return Timing(wall_loop(lambda: self.infer(feed), warmup, iters,
                                max_seconds=self.max_seconds),
                      "time.perf_counter around infer() (host arrays in and out)")

    def describe(self) -> dict:
        """What really ran: ``{"backend", "device" ("cpu"/"cuda"), "device_name", "ep_requested",
        "ep_used", "cpu_fallback", "versions", "tf32", ...}``."""
        raise NotImplementedError


class NullRunner(Runner):
    """A backend that does nothing: its :meth:`time` is the harness's own cost (MLPerf's "null
    backend" idea); latencies within a few times it are not meaningful."""

    backend = "null"

    def infer(self, feed):
        return {}

    def time(self, feed, warmup, iters):
        return Timing(wall_loop(lambda: None, warmup, iters, max_seconds=self.max_seconds),
                      "time.perf_counter around a no-op")

    def describe(self):
        return {"backend": self.backend, "device": "cpu"}


def _same_outputs(a: dict, b: dict) -> bool:
    """Two runs' outputs: the same names, dtypes, shapes and bytes (-0.0 is not +0.0)."""
    arr = {k: (np.asarray(a[k]), np.asarray(b.get(k))) for k in a}
    return list(a) == list(b) and all(
        x.dtype == y.dtype != object and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in arr.values())


def _batch_of(feed: dict) -> int | None:
    """Samples per call of ``feed`` (axis 0 of its first array; None when it has none)."""
    for a in feed.values():
        shape = getattr(a, "shape", None)
        return int(shape[0]) if shape else None
    return None


def harness_overhead_ms(iters: int = 200) -> float:
    """Median cost (ms) of the timing loop itself (:class:`NullRunner`)."""
    return float(np.median(NullRunner().time({}, 10, iters).end_to_end_ms))


# --------------------------------------------------------------------------------------------
# PyTorch
# --------------------------------------------------------------------------------------------
class TorchRunner(Runner):
    """PyTorch eager runner.

    Args:
        model: ``torch.nn.Module`` (moved to ``device``, eval mode).
        device: ``cpu`` or ``cuda[:i]``.
        output_names: names of the model's outputs (one tensor or a tuple); other counts get
            ``output_<i>``.
        input_names: names of ``forward()``'s arguments, in order (feeds are passed
            positionally in this order).
        A ``forward()`` returning a dict gives outputs named by its keys (``outputs_named``
        True after ``infer``); a tuple/list, ``output_names`` or ``output_<i>``.
        dtype: ``fp32``, or ``fp16`` (``model.half()``, floating inputs cast to float16 on the
            device; CUDA only).
        tf32: on CUDA, allow TF32 in matmul/cuDNN convolutions (PyTorch's own default leaves
            matmul TF32 off and cuDNN TF32 on); False = strict FP32.
        compile: also time ``torch.compile(model)`` (extra figure ``compile``).
    Raises:
        StageError: ``device`` is CUDA and torch sees no GPU.
        UsageError: ``fp16`` on the CPU.
    """

    backend = "PyTorch"

    def __init__(self, model, device: str = "cpu", output_names: Sequence[str] = ("logits",),
                 input_names: Sequence[str] = ("input",), dtype: str = "fp32",
                 tf32: bool | None = None, compile: bool = False):
        import torch

        self.torch = torch
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise StageError(f"device {device}: torch {torch.__version__} sees no CUDA GPU; "
                             "use --device cpu")
        if dtype not in ("fp32", "fp16"):
            raise UsageError(f"dtype {dtype}: choose fp32 or fp16")
        if dtype == "fp16" and not device.startswith("cuda"):
            raise UsageError("FP16 PyTorch runs on CUDA only (CPU half kernels are slow and "
                             "partial): use --device cuda")
        self.device = torch.device(device)
        self.dtype = dtype
        if self.device.type == "cuda" and tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
            torch.backends.cudnn.allow_tf32 = bool(tf32)
        self.model = model.to(self.device).eval()
        if dtype == "fp16":
            self.model = self.model.half()
        self.compile = compile
        self.output_names = list(output_names)
        self.input_names = list(input_names)
        self.outputs_named = False
        # CPU: channels-last weights and 4-D inputs (oneDNN's native layout), tried on the first
        # call and dropped for good when the model cannot take it (e.g. ``x.view`` of a
        # conv output); see :data:`CPU_CHUNK` for the chunking.
        self.channels_last: bool | None = None if self.device.type == "cpu" else False
        self.chunked: bool | None = None

    def close(self) -> None:
        """Give the module back in its own (contiguous) layout: the caller may export it
        (``describe()`` still says what ran)."""
        if self.channels_last:
            with self.torch.no_grad():
                self.model.to(memory_format=self.torch.contiguous_format)

    def sync(self) -> None:
        """Wait for the device (no-op on the CPU)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _args(self, feed: dict[str, np.ndarray]) -> list:
        names = [n for n in self.input_names if n in feed] or list(feed)
        if len(names) != len(feed):
            names = list(feed)
        out = []
        for n in names:
            t = self.torch.from_numpy(np.ascontiguousarray(feed[n])).to(self.device)
            if self.dtype == "fp16" and t.is_floating_point():
                t = t.half()
            out.append(t)
        return out

    def _forward(self, args, model=None):
        # not ``model or self.model``: truth-testing a module calls __len__ (Sequential)
        return forward_cpu_layout(self, args, self.model if model is None else model)

    def _raise_oom(self, e: BaseException, feed, doing: str) -> None:
        """Raise StageError (:func:`deploykit.errors.out_of_memory_message`) when ``e`` is an
        out-of-memory error of ``doing`` the model on ``feed``; return otherwise."""
        oom = out_of_memory_message(e, _batch_of(feed), f"PyTorch ({self.device}) {doing} the "
                                    "model")
        if oom:
            raise StageError(oom) from e

    def infer(self, feed):
        n = _batch_of(feed)
        if self.device.type == "cpu" and self.chunked is not False and (n or 0) > CPU_CHUNK:
            self.chunked = (out := infer_in_chunks(self.infer, feed, n)) is not None
            if out is not None:  # else outputs not per sample: whole batches for good
                return out
        try:
            out = self._forward(self._args(feed))
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            self._raise_oom(e, feed, "running")
            raise
        if isinstance(out, dict):  # named outputs: the keys, in order (as the exporters flatten)
            names, outs = [str(k) for k in out], list(out.values())
        else:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            names = self.output_names if len(self.output_names) == len(outs) else [
                f"output_{i}" for i in range(len(outs))]
        bad = [(n, type(o).__name__) for n, o in zip(names, outs)
               if not isinstance(o, self.torch.Tensor)]
        if bad:
            raise StageError(
                f"forward() returns {type(out).__name__} whose output {bad[0][0]!r} is a "
                f"{bad[0][1]}, not a tensor: return a tensor, a tuple/list of tensors or a dict "
                "of tensors (nested containers and Python values cannot be compared or exported "
                "as outputs)")
        self.outputs_named = isinstance(out, dict)
        return {n: o.float().cpu().numpy() if o.is_floating_point() else o.cpu().numpy()
                for n, o in zip(names, outs)}

    def time(self, feed, warmup, iters):
        """Inputs are copied to the device once, outside the timed region; end-to-end is the
        wall-clock of ``forward()`` with a device sync (on CUDA this is launch overhead plus
        GPU time), GPU Compute Time the CUDA-event time of the same call. On CUDA also the
        replay of a CUDA graph of ``forward()`` (extra ``cuda_graph``: no launch overhead) and,
        with ``compile``, ``torch.compile``'s module (extra ``compile``)."""
        args = self._args(feed)
        cuda = self.device.type == "cuda"
        try:
            wall = wall_loop(lambda: self._forward(args), warmup, iters,
                             self.sync if cuda else None, max_seconds=self.max_seconds)
        except (RuntimeError, MemoryError) as e:
            self._raise_oom(e, feed, "timing")
            raise
        t = Timing(wall, "time.perf_counter around forward() on device-resident inputs"
                   + (" + torch.cuda.synchronize" if cuda else ""))
        if cuda:
            t.gpu_compute_ms = cuda_event_loop(lambda: self._forward(args), warmup, iters,
                                               max_seconds=self.max_seconds)
            t.gpu_compute_timer = "torch.cuda.Event pair around forward()"
            try_extra(t, "cuda_graph", lambda: self._time_graph(args, warmup, iters))
        if self.compile:
            try_extra(t, "compile", lambda: self._time_compiled(args, warmup, iters))
        return t

    def _time_graph(self, args, warmup: int, iters: int) -> tuple[list[float], str]:
        torch = self.torch
        static = [a.clone() for a in args]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up on a side stream before capture (PyTorch docs)
            for _ in range(3):
                self._forward(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward(static)
        times = cuda_event_loop(graph.replay, warmup, iters, max_seconds=self.max_seconds)
        return times, "torch.cuda.Event pair around torch.cuda.CUDAGraph.replay() of forward()"

    def _time_compiled(self, args, warmup: int, iters: int) -> tuple[list[float], str]:
        compiled = self.torch.compile(self.model)
        for _ in range(3):  # compilation happens here, outside the timed loop
            self._forward(args, compiled)
        self.sync()
        cuda = self.device.type == "cuda"
        if cuda:
            return (cuda_event_loop(lambda: self._forward(args, compiled), warmup, iters,
                                    max_seconds=self.max_seconds),
                    "torch.cuda.Event pair around torch.compile(model)(...)")
        return (wall_loop(lambda: self._forward(args, compiled), warmup, iters,
                          max_seconds=self.max_seconds),
                "time.perf_counter around torch.compile(model)(...)")

    def describe(self):
        torch = self.torch
        d: dict[str, Any] = {"backend": self.backend, "device": self.device.type,
                             "device_index": self.device.index, "ep_requested": None,
                             "ep_used": None, "cpu_fallback": None, "dtype": self.dtype,
                             "versions": {"torch": torch.__version__}}
        if self.device.type == "cuda":
            d["device_name"] = torch.cuda.get_device_name(self.device)
            d["versions"]["cuda"] = torch.version.cuda
            d["tf32"] = {"torch.backends.cuda.matmul.allow_tf32":
                         bool(torch.backends.cuda.matmul.allow_tf32),
                         "torch.backends.cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32)}
        else:
            d["device_name"] = device_info()["cpu"]
            d["threads"] = torch.get_num_threads()
            d["memory_format"] = {True: "channels_last", False: "contiguous (NCHW)",
                                  None: "not run yet"}[self.channels_last]
            d["cpu_chunk"] = CPU_CHUNK if self.chunked else None
        return d


# --------------------------------------------------------------------------------------------
# ONNX Runtime
# --------------------------------------------------------------------------------------------
ORT_EPS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
           "trt": "TensorrtExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def ort_session_options(level: str = "all", threads: int = 0):
    """``onnxruntime.SessionOptions`` with a named graph-optimisation level
    (``disable``/``basic``/``extended``/``all``) and intra-op threads (0 = ORT default)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return so


# ONNX Runtime's input type strings -> numpy dtypes
ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
              "tensor(double)": np.float64, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(int8)": np.int8, "tensor(uint8)": np.uint8,
              "tensor(bool)": np.bool_, "tensor(int16)": np.int16,
              "tensor(uint16)": np.uint16}


class OrtRunner(Runner):
    """ONNX Runtime runner that records the execution provider (EP) it really uses.

    Args:
        path: ONNX file, or serialized model bytes.
        ep: ``cpu``, ``cuda`` or ``trt`` (the EP asked for; CPU is always appended as fallback
            for unsupported nodes, as ORT does).
        allow_cpu_fallback: if False and the session's first EP is not the requested one, raise.
        opt_level / disabled_optimizers: passed to the session (see :func:`ort_session_options`).
        threads: intra-op threads (0 = ORT's default).
        tf32: CUDA EP ``use_tf32`` (None: ORT's default). device_id: CUDA device.
        session_config: ``SessionOptions.add_session_config_entry`` pairs, e.g.
            ``{"session.x64quantprecision": "1"}``.
        save_optimized: file ORT writes its optimised graph to (``optimized_model_filepath``).
        fallback_hint: the way out that the error without the requested EP names (the
            caller's own flag: stage 3's ``--allow-cpu-fallback`` by default).
    Raises:
        UsageError: unknown ``ep``.
        StageError: the requested EP is not used and CPU fallback is not allowed (the message
            gives the reason: EP not in this onnxruntime build, or failed to load), or ORT cannot
            load the model.
    """

    backend = "ORT"

    def __init__(self, path: Path | str | bytes, ep: str = "cpu", allow_cpu_fallback: bool = False,
                 opt_level: str = "all", disabled_optimizers: Sequence[str] = (),
                 threads: int = 0, tf32: bool | None = None, device_id: int = 0,
                 session_config: dict[str, str] | None = None,
                 fallback_hint: str = "or pass --allow-cpu-fallback", cpu_chunk: bool = False,
                 save_optimized: Path | str | None = None):
        if ep not in ORT_EPS:
            raise UsageError(f"--ep {ep}: choose one of {sorted(set(ORT_EPS))}")
        if ep != "cpu":
            # onnxruntime-gpu finds the CUDA/cuDNN libraries that torch's wheels carry once
            # torch is imported (ORT docs, "Compatibility with PyTorch"); harmless otherwise.
            try:
                import torch  # noqa: F401
            except ImportError:
                pass
        import onnxruntime as ort

        self.ort = ort
        self.device_id = device_id
        self.path = path if isinstance(path, bytes) else Path(path)
        self.label = "<in-memory model>" if isinstance(path, bytes) else str(self.path)
        self.requested = ORT_EPS[ep]
        self.opt_level, self.disabled_optimizers = opt_level, list(disabled_optimizers)
        self.session_config, self.save_optimized = dict(session_config or {}), save_optimized
        available = ort.get_available_providers()
        providers = [self.requested] + (["CPUExecutionProvider"]
                                        if self.requested != "CPUExecutionProvider" else [])
        self.fallback_reason = None
        if self.requested not in available:
            self.fallback_reason = (f"{self.requested} is not in this onnxruntime build "
                                    f"({ort.__version__}, available: {available}); install "
                                    "onnxruntime-gpu instead of onnxruntime for CUDA/TensorRT")
            providers = ["CPUExecutionProvider"]
            if not allow_cpu_fallback:
                raise StageError(f"{self.fallback_reason} ({fallback_hint})")
        self.threads = threads
        # GPU EP options: the device, and TF32 (CUDA EP ``use_tf32``, on by default in ORT's
        # CUDA EP; "0" makes FP32 convolutions/matmuls strict FP32).
        self.gpu_options: dict[str, str] = {}
        if self.requested == "CUDAExecutionProvider" and providers[0] == self.requested:
            self.gpu_options = {"device_id": str(device_id)}
            if tf32 is not None:
                self.gpu_options["use_tf32"] = "1" if tf32 else "0"
        self.session = self._session(providers)
        self.used = self.session.get_providers()[0]
        # cpu_chunk: the CPU EP may run a larger batch in chunks of ORT_CPU_CHUNK samples (infer)
        self.chunked: bool | None = None if cpu_chunk else False
        if self.used != self.requested and self.fallback_reason is None:
            self.fallback_reason = (f"{self.requested} failed to initialise (missing CUDA/cuDNN "
                                    "libraries on the loader path? source env.sh), session "
                                    f"runs on {self.used}")
            if not allow_cpu_fallback:
                raise StageError(f"{self.fallback_reason} ({fallback_hint})")
        self.inputs = self.session.get_inputs()
        self.input_names = [i.name for i in self.inputs]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def _session(self, providers: list[str], extra_options: dict | None = None):
        ort = self.ort
        so = ort_session_options(self.opt_level, threads=self.threads)
        for k, v in self.session_config.items():
            so.add_session_config_entry(k, v)
        if self.save_optimized is not None:
            so.optimized_model_filepath = str(self.save_optimized)
        src = self.path if isinstance(self.path, bytes) else str(self.path)
        opts = [({**self.gpu_options, **(extra_options or {})}
                 if p == "CUDAExecutionProvider" else {}) for p in providers]
        try:
            return ort.InferenceSession(src, sess_options=so, providers=providers,
                                        provider_options=opts,
                                        disabled_optimizers=self.disabled_optimizers)
        except Exception as e:  # noqa: BLE001 - ORT raises its own Fail/InvalidGraph types
            raise StageError(ort_load_error(self.label, ort.__version__, str(e),
                                            self._nodes_of)) from e

    def _nodes_of(self, domain: str, op: str) -> list[str]:
        """Names of the nodes of op ``domain:op`` (empty where the file cannot be parsed)."""
        import onnx

        try:
            m = (onnx.load_from_string(self.path) if isinstance(self.path, bytes)
                 else onnx.load(str(self.path), load_external_data=False))
        except Exception:  # noqa: BLE001 - only for a better message
            return []
        return [n.name or f"<unnamed {op}>" for n in m.graph.node
                if n.op_type == op and n.domain == domain]

    _ORT_DTYPES = ORT_DTYPES

    def check_feed(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's inputs of ``feed`` (extra keys dropped), checked against the session's
        inputs before ``run``, where ORT's message names neither the model nor the fix.

        Raises:
            StageError: an input missing, or one whose dtype, rank or fixed dimension differs
                from the model's; names the model, the input and the fix.
        """
        missing = [n for n in self.input_names if n not in feed]
        if missing:
            raise StageError(f"{self.label}: the feed lacks model input(s) {missing} (model "
                             f"inputs: {self.input_names}; given: {sorted(feed)}): name each "
                             "array by its model input (np.savez(path, <input name>=array))")
        for i in self.inputs:
            a = np.asarray(feed[i.name])
            want = self._ORT_DTYPES.get(i.type)
            if want is not None and a.dtype != want:
                raise StageError(f"{self.label}: input {i.name!r} is {a.dtype}, the model takes "
                                 f"{np.dtype(want)} ({i.type}): cast it "
                                 f"(x.astype(np.{np.dtype(want).name})) or use the model made "
                                 "for that dtype")
            dims = list(i.shape) if i.shape is not None else None
            if dims is None:
                continue
            if a.ndim != len(dims):
                raise StageError(f"{self.label}: input {i.name!r} has rank {a.ndim} (shape "
                                 f"{list(a.shape)}), the model takes rank {len(dims)} {dims}: "
                                 "give the samples as [N, ...] with the model's dimensions")
            bad = [k for k, d in enumerate(dims) if isinstance(d, int) and d > 0
                   and a.shape[k] != d]
            if bad:
                k = bad[0]
                raise StageError(f"{self.label}: input {i.name!r} has shape {list(a.shape)}, "
                                 f"the model takes {dims} (axis {k}: {a.shape[k]} vs "
                                 f"{dims[k]}): resize the data, or export the model for this "
                                 "shape" + (" (a dynamic batch axis)" if k == 0 else ""))
        return {n: feed[n] for n in self.input_names}

    def _run(self, session, feed: dict[str, np.ndarray]):
        """``session.run`` with ORT's runtime errors as a :class:`StageError` naming the model
        (a node's failure names the node ORT reports)."""
        try:
            return session.run(None, feed)
        except Exception as e:  # noqa: BLE001 - ORT's Fail / RuntimeException / InvalidArgument
            import re

            oom = out_of_memory_message(e, _batch_of(feed), f"onnxruntime running {self.label}")
            if oom:
                raise StageError(oom) from e
            node = re.search(r"node\. Name:'([^']*)'", str(e))
            raise StageError(f"onnxruntime failed running {self.label}"
                             + (f" at node {node[1]!r}" if node else "")
                             + f": {str(e).splitlines()[0][:400]}") from e

    @property
    def batch_range(self):
        dims = [i.shape[0] for i in self.inputs if i.shape]
        fixed = {d for d in dims if isinstance(d, int) and d > 0}
        if len(fixed) == 1:
            b = fixed.pop()
            return b, b
        return 1, None

    def infer(self, feed, native: bool = False):
        """Outputs of ``run`` on ``feed`` (floating outputs as float32, or in the dtype ORT
        returned them with ``native``: e.g. float16 tensors of an FP16 graph, for callers that
        convert them themselves). With ``cpu_chunk`` (stage 3's accuracy pass), on the CPU EP a
        feed of at least :data:`ORT_CHUNK_MIN_FEED` samples whose axis 0 the model leaves free
        may run in chunks of :data:`ORT_CPU_CHUNK`. Decided once, on the first such feed, run
        both ways: chunks from then on only when every output has the same dtype, shape and
        bytes (else whole batches for good: e.g. a model that mixes samples across that batch).
        A later feed whose chunks fail runs whole. ``cpu_chunk`` in :meth:`describe`.

        Raises:
            StageError: the feed does not fit the model (:meth:`check_feed`), or ORT fails.
        """
        feed = self.check_feed(feed)
        n = _batch_of(feed)
        one = lambda part: self._infer_one(part, native)  # noqa: E731
        if (self.chunked is False or self.used != "CPUExecutionProvider" or not n
                or n < ORT_CHUNK_MIN_FEED or self.batch_range[1] is not None):
            return one(feed)
        whole = None if self.chunked else one(feed)
        try:
            parts = infer_in_chunks(one, feed, n, ORT_CPU_CHUNK)
        except Exception:  # noqa: BLE001 - a chunk the model refuses: whole batches
            parts = None
        if whole is None:  # decided before
            return one(feed) if parts is None else parts
        self.chunked = parts is not None and _same_outputs(whole, parts)
        return whole

    def _infer_one(self, feed, native: bool):
        outs = self._run(self.session, feed)
        return {n: (o.astype(np.float32) if not native and np.issubdtype(o.dtype, np.floating)
                    and o.dtype != np.float32 else o)
                for n, o in zip(self.output_names, outs)}

    def time(self, feed, warmup, iters):
        """End-to-end: ``InferenceSession.run`` on host arrays (copies included). On the CUDA EP
        also I/O binding on device buffers (extra ``device_buffers``: no host copies) and the
        CUDA EP's CUDA graph (``enable_cuda_graph``; extra ``cuda_graph``; a model with nodes
        outside the CUDA EP or with dynamic shapes inside cannot be captured, and the reason is
        recorded)."""
        feed = self.check_feed(feed)
        try:
            times = wall_loop(lambda: self.session.run(None, feed), warmup, iters,
                              max_seconds=self.max_seconds)
        except Exception as e:  # noqa: BLE001 - ORT's errors: named like infer's
            if isinstance(e, StageError):
                raise
            self._run(self.session, feed)  # raises the translated error (or ORT's again)
            raise
        t = Timing(times, "time.perf_counter around InferenceSession.run (host arrays in and out)")
        if self.used == "CUDAExecutionProvider":
            try_extra(t, "device_buffers",
                      lambda: self._time_bound(self.session, feed, warmup, iters, "I/O binding"))
            try_extra(t, "cuda_graph", lambda: self._time_bound(
                self._session(["CUDAExecutionProvider"], {"enable_cuda_graph": "1"}), feed,
                warmup, iters, "CUDA graph replay (enable_cuda_graph=1)"))
        return t

    def _time_bound(self, session, feed, warmup: int, iters: int, what: str
                    ) -> tuple[list[float], str]:
        """Wall-clock of ``run_with_iobinding`` with inputs and outputs bound to CUDA buffers
        (the call returns once the GPU work is done)."""
        ort = self.ort
        binding = session.io_binding()
        keep = []
        for name, arr in feed.items():
            v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda",
                                                 self.device_id)
            keep.append(v)
            binding.bind_ortvalue_input(name, v)
        for o in session.get_outputs():
            binding.bind_output(o.name, "cuda", self.device_id)
        session.run_with_iobinding(binding)  # first run: allocation / graph capture
        binding.synchronize_outputs()
        times = wall_loop(lambda: session.run_with_iobinding(binding), warmup, iters,
                          binding.synchronize_outputs, max_seconds=self.max_seconds)
        return times, f"time.perf_counter around run_with_iobinding ({what}, device buffers)"

    def describe(self):
        ort = self.ort
        cuda = self.used in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
        d: dict[str, Any] = {"backend": self.backend, "device": "cuda" if cuda else "cpu",
                             "ep_requested": self.requested, "ep_used": self.used,
                             "cpu_fallback": self.fallback_reason, "opt_level": self.opt_level,
                             "disabled_optimizers": self.disabled_optimizers,
                             "session_config": self.session_config,
                             "versions": {"onnxruntime": ort.__version__}}
        if cuda:
            opts = self.session.get_provider_options().get(self.used, {})
            d["device_index"] = int(opts.get("device_id", 0))
            d["provider_options"] = dict(opts)
            if "use_tf32" in opts:  # what the session really uses, read back from ORT
                d["tf32"] = {"use_tf32": opts["use_tf32"] in ("1", "True", "true")}
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_available():
                d["device_name"] = torch.cuda.get_device_name(d["device_index"])
        else:
            d["device_name"] = device_info()["cpu"]
            d["threads"] = self.threads or None
            d["cpu_chunk"] = ORT_CPU_CHUNK if self.chunked else None
        return d


# --------------------------------------------------------------------------------------------
# TensorRT
# --------------------------------------------------------------------------------------------
class TrtRunner(Runner):
    """TensorRT engine runner (tensor-name API, ``execute_async_v3``; TensorRT 8.5+), with
    torch CUDA tensors as device buffers (no pycuda).

    Args:
        plan: serialized engine (path or bytes).
        device: CUDA device index.
        profile: optimisation profile index.
        dla_core: DLA core of a plan built for DLA (``runtime.DLA_core`` before loading).
    Attributes:
        profile_shapes: ``{input: (min, opt, max) shapes}``; ``version``: ``tensorrt.__version__``.
    Raises:
        StageError: the plan cannot be read (a folder, a missing file), TensorRT or CUDA
            missing, or the runtime refuses the plan (the message gives
            the class of the failure and its fix: not a plan, truncated, built by another
            TensorRT (both versions named), built for another GPU, or a library-path mismatch
            that a rebuild would not fix).
    """

    backend = "TensorRT"

    def __init__(self, plan: Path | str | bytes, device: int = 0, profile: int = 0,
                 dla_core: int | None = None):
        try:  # first: a folder or a missing file is named, whatever is installed
            blob = plan if isinstance(plan, bytes) else Path(plan).read_bytes()
        except OSError as e:
            raise StageError(f"cannot read the plan {plan}: {e.strerror or e} (pass the .plan "
                             "file 6_build_engines.sh wrote)") from e
        try:
            import tensorrt as trt
        except Exception as e:  # noqa: BLE001 - ImportError, missing libnvinfer (OSError)
            raise StageError(f"TensorRT is not installed here (import tensorrt: "
                             f"{type(e).__name__}: {e})") from e
        import torch

        if not torch.cuda.is_available():
            raise StageError("no CUDA GPU visible to torch (TensorRT needs one)")

        self.trt, self.torch = trt, torch
        self.dev = torch.device("cuda", device)
        torch.cuda.set_device(self.dev)

        class _Logger(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.messages: list[str] = []

            def log(self, severity, msg):
                self.messages.append(str(msg))
                if severity <= trt.ILogger.Severity.WARNING:
                    print(f"[TRT] {msg}", file=sys.stderr)

        self.logger = _Logger()
        self.runtime = trt.Runtime(self.logger)
        if dla_core is not None:  # a plan built for DLA runs on the core set before loading
            self.runtime.DLA_core = int(dla_core)
        self.label = "<in-memory plan>" if isinstance(plan, bytes) else str(plan)
        self.engine = self.runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            # Classified with its fix (not a plan / truncated / another TensorRT / another GPU /
            # library path), deploykit.trt.parsers.classify_plan_load_error.
            why = classify_plan_load_error(
                "\n".join(self.logger.messages), blob[:PLAN_HEADER_BYTES],
                runtime_version=tuple(int(p) for p in re.findall(r"\d+", trt.__version__)[:4]),
                file_size=len(blob), plan=self.label)
            raise StageError(f"TensorRT {trt.__version__} cannot load {self.label} "
                             f"[{why['kind']}]: {why['message']}. Fix: {why['fix']}")
        self.context = self.engine.create_execution_context()
        self.profile = profile
        if profile:
            self.context.set_optimization_profile_async(
                profile, torch.cuda.current_stream().cuda_stream)
        self.version = trt.__version__
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names
                            if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.profile_shapes = {
            n: tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(n, profile))
            for n in self.input_names}
        self.dtypes = {n: self._torch_dtype(self.engine.get_tensor_dtype(n)) for n in names}
        self.stream = torch.cuda.Stream(self.dev)
        self.device_name = torch.cuda.get_device_name(self.dev)
        self._bufs: dict[str, Any] = {}

    def _torch_dtype(self, dt):
        t = self.torch
        return {np.dtype(np.float32): t.float32, np.dtype(np.float16): t.float16,
                np.dtype(np.int8): t.int8, np.dtype(np.int32): t.int32,
                np.dtype(np.int64): t.int64, np.dtype(np.bool_): t.bool,
                np.dtype(np.uint8): t.uint8}[np.dtype(self.trt.nptype(dt))]

    def close(self):
        self._bufs.clear()

    @property
    def batch_range(self):
        first = self.profile_shapes[self.input_names[0]]
        return int(first[0][0]), int(first[2][0])

    def bind(self, feed: dict[str, np.ndarray]) -> None:
        """Copy ``feed`` to device buffers, set input shapes, allocate outputs, set addresses."""
        torch = self.torch
        for name in self.input_names:
            x = torch.from_numpy(np.ascontiguousarray(feed[name])).to(self.dev, self.dtypes[name])
            self._bufs[name] = x
            self.context.set_input_shape(name, tuple(x.shape))
            self.context.set_tensor_address(name, x.data_ptr())
        for name in self.output_names:
            shape = tuple(self.context.get_tensor_shape(name))
            y = torch.empty(shape, dtype=self.dtypes[name], device=self.dev)
            self._bufs[name] = y
            self.context.set_tensor_address(name, y.data_ptr())

    def execute(self) -> None:
        """Enqueue one inference on the runner's stream (no synchronisation)."""
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise StageError("execute_async_v3 returned False (see the [TRT] messages above)")

    def _outputs(self) -> dict[str, np.ndarray]:
        return {n: self._bufs[n].float().cpu().numpy() if self._bufs[n].is_floating_point()
                else self._bufs[n].cpu().numpy() for n in self.output_names}

    def infer(self, feed):
        self.bind(feed)
        self.execute()
        self.stream.synchronize()
        return self._outputs()

    def time(self, feed, warmup, iters):
        """End-to-end: host arrays to host arrays (H2D, ``execute_async_v3``, D2H, sync), as
        trtexec's "Latency"; GPU Compute Time: CUDA events around ``execute_async_v3`` alone on
        bound device buffers, as trtexec's "GPU Compute Time"."""
        wall = wall_loop(lambda: self.infer(feed), warmup, iters,
                         max_seconds=self.max_seconds)
        self.bind(feed)
        gpu = cuda_event_loop(self.execute, warmup, iters, self.stream,
                              max_seconds=self.max_seconds)
        return Timing(wall, "time.perf_counter around H2D + execute_async_v3 + D2H + sync",
                      gpu, "torch.cuda.Event pair around execute_async_v3 on bound buffers")

    def layer_info(self) -> dict:
        """Engine inspector JSON summarised by :func:`deploykit.trt.parsers.parse_layer_info`."""

        insp = self.engine.create_engine_inspector()
        insp.execution_context = self.context
        return parse_layer_info(
            insp.get_engine_information(self.trt.LayerInformationFormat.JSON))

    def describe(self):
        return {"backend": self.backend, "device": "cuda", "device_index": self.dev.index,
                "device_name": self.device_name, "ep_requested": "TensorRT",
                "ep_used": f"TensorRT {self.version} on {self.device_name}",
                "cpu_fallback": None, "versions": {"tensorrt": self.version},
                "inputs": self.input_names, "outputs": self.output_names,
                "profile": {k: [list(s) for s in v] for k, v in self.profile_shapes.items()}}
