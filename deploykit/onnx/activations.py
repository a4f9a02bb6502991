"""Capture of intermediate tensors: every node output of an ONNX model marked as a graph
output and run on ORT (or TensorRT) in chunks, with tensor-name matching across two graphs
(through Q/DQ, Cast and Identity).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator, Sequence
import numpy as np

from deploykit.errors import StageError
from deploykit.onnx.graph import graph_inputs, load_onnx, mark_all_outputs, producers
from deploykit.runners import OrtRunner, TrtRunner
from deploykit.trt.rules import TRT_RULES


# Ops whose output is the same tensor value as their (first) input in another precision or
# representation: a tensor produced by one of them is matched to the tensor it came from.
LOOK_THROUGH_OPS = {"QuantizeLinear", "DequantizeLinear", "Cast", "Identity"}


MARKING_NOTE = ("Marking every tensor as an output prevents the fusions that would have "
                "consumed it (TensorRT layer fusion, ORT QDQ->QLinear* and Conv+Act fusion), so "
                "the marked run is not bit-identical to the deployed one; the unmarked model's "
                "final outputs are compared separately under 'final_outputs'.")


# --------------------------------------------------------------------------------------------
# Graph helpers
# --------------------------------------------------------------------------------------------
def lookthrough_aliases(model) -> dict[str, str]:
    """Map every tensor of ``model`` to the tensor it represents once Q/DQ/Cast are ignored.

    ``x -> QuantizeLinear -> x_QuantizeLinear_Output -> DequantizeLinear ->
    x_DequantizeLinear_Output`` (ModelOpt's and ORT's naming) maps both outputs to ``x``;
    ``y_pre_cast -> Cast -> y`` (ModelOpt's FP16 output cast) maps ``y`` to ``y_pre_cast``, and
    onnxconverter-common's ``graph_input_cast_0`` maps to the graph input. The mapping follows
    the graph, not the names, so it works whatever the tool calls the tensors.

    Returns:
        ``{tensor: root tensor}`` for tensors produced by a look-through op (others map to
        themselves implicitly).
    """
    producer = producers(model)
    alias: dict[str, str] = {}

    def root(t: str) -> str:
        seen = 0
        while t in producer and producer[t].op_type in LOOK_THROUGH_OPS and seen < 16:
            t = producer[t].input[0]
            seen += 1
        return t

    for n in model.graph.node:
        if n.op_type in LOOK_THROUGH_OPS:
            for o in n.output:
                alias[o] = root(o)
    return alias


def iter_chunks(feed: dict[str, np.ndarray], batch: int | None) -> Iterator[dict[str, np.ndarray]]:
    """Split ``feed`` along axis 0 into chunks of ``batch`` samples (all inputs alike)."""
    n = {len(v) for v in feed.values() if np.ndim(v) > 0}
    if not batch or len(n) != 1:
        yield feed
        return
    total = n.pop()
    for i in range(0, total, batch):
        yield {k: v[i:i + batch] for k, v in feed.items()}


def chunk_size(models: Sequence, batch: int | None) -> int | None:
    """Samples per run for ``models`` (paths or ModelProtos): a static batch axis (an export
    for a fixed-batch engine) sets it, so N samples become N / B runs instead of one run the
    model refuses; otherwise ``batch``."""
    static = set()
    for m in models:
        m = load_onnx(m, external=False) if isinstance(m, (str, Path)) else m
        static |= {d[0] for _, d, _ in graph_inputs(m) if d and d[0]}
    return min(static) if static else batch


def _ort_session(model_or_path, ep: str, tmp: Path, opt_level: str,
                 disabled_optimizers: Sequence[str] = ()):
    """OrtRunner over a model (written to ``tmp`` if given as a ModelProto)."""
    import onnx

    if isinstance(model_or_path, (str, Path)):
        path = Path(model_or_path)
    else:
        path = tmp / f"m{len(list(tmp.iterdir()))}.onnx"
        big = model_or_path.ByteSize() > 1_500_000_000
        onnx.save(model_or_path, str(path), save_as_external_data=big)
    if opt_level == "reference":  # the graph's own numerics, fast where ORT keeps them
        from deploykit.quant.reference import qdq_reference_runner

        if ep != "cpu":
            raise ValueError("opt_level 'reference' runs on the CPU EP only")
        return qdq_reference_runner(path)[0]
    return OrtRunner(path, ep=ep, opt_level=opt_level, disabled_optimizers=disabled_optimizers,
                     fallback_hint="a layer-wise comparison runs on the EP it names: run it "
                                   "where that EP exists, or name the CPU EP (cpu) instead")


# --------------------------------------------------------------------------------------------
# Collecting activations
# --------------------------------------------------------------------------------------------
def ort_activations(model_or_path, feed: dict[str, np.ndarray], *, ep: str = "cpu",
                    batch: int | None = None, opt_level: str = "all", mark_all: bool = True,
                    disabled_optimizers: Sequence[str] = (), native: bool = False
                    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """Yield ``(tensors, n_samples)`` per chunk of ``feed`` from ONNX Runtime.

    Args:
        model_or_path: ONNX path or ModelProto.
        feed: ``{input name: array}``, batch on axis 0.
        ep: ``cpu``/``cuda``/``trt`` (:data:`deploykit.runners.ORT_EPS`).
        batch: chunk size (default: the whole feed at once); see :func:`feed_plan` for a model
            with a static batch. Float32 inputs are cast to float16 where the model declares
            float16 inputs.
        opt_level: ORT's optimisation level (``disable``/``basic``/``extended``/``all``), or
            ``reference``: the graph's own numerics on the CPU EP, fast where ORT's optimised
            graph keeps every Q/DQ (:func:`deploykit.quant.reference.qdq_reference_runner`; the
            same float ops, reordered).
        mark_all: expose every intermediate tensor (else only the model's outputs).
        disabled_optimizers: ORT graph optimizers to switch off (e.g. WeightBiasQuantization).
        native: tensors in the dtype ORT returns (float16 stays float16) instead of float32
            (:meth:`deploykit.runners.OrtRunner.infer`): for a caller that converts them once
            itself (saves a pass over every tensor).
    """
    model = model_or_path
    if mark_all:
        model = mark_all_outputs(load_onnx(model_or_path) if isinstance(model_or_path, (str, Path))
                                 else model_or_path)
    with tempfile.TemporaryDirectory(prefix="layerwise-") as tmp:
        runner = _ort_session(model, ep, Path(tmp), opt_level, disabled_optimizers)
        half = {i.name for i in runner.session.get_inputs() if i.type == "tensor(float16)"}
        for chunk in iter_chunks(feed, batch):
            n = len(next(iter(chunk.values())))
            # A candidate with FP16 inputs (e.g. converted without keep_io_types) gets the same
            # samples cast to FP16; every other input is passed as given.
            chunk = {k: (v.astype(np.float16) if k in half and v.dtype == np.float32 else v)
                     for k, v in chunk.items() if k in runner.input_names}
            try:
                yield runner.infer(chunk, native=native), n
            except Exception as e:  # noqa: BLE001 - ORT raises its own types
                raise StageError(
                    f"onnxruntime failed on {model_or_path if isinstance(model_or_path, (str, Path)) else 'model'}: {e}") from e


def trt_available() -> tuple[bool, str | None]:
    """``(True, version)`` if ``import tensorrt`` works, else ``(False, reason)``."""
    try:
        import tensorrt as trt  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, missing libnvinfer (OSError)
        return False, (f"TensorRT is not installed here (import tensorrt: {type(e).__name__}: "
                       f"{e}); run on a CUDA host with tensorrt installed")
    return True, trt.__version__


def trt_activations(onnx_path: Path | str, feed: dict[str, np.ndarray], *,
                    build: dict | None = None, batch: int | None = None,
                    mark_all: bool = True, engine_path: Path | str | None = None
                    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """Yield ``(tensors, n_samples)`` per chunk from TensorRT.

    With ``mark_all`` an engine is built by Polygraphy from ``onnx_path`` with every layer
    output marked (``ModifyNetworkOutputs(outputs=MARK_ALL)``, the same as ``polygraphy run --trt
    --trt-outputs mark all``); tensor names are the ONNX tensor names the parser keeps.
    Without it, ``engine_path`` (a serialized plan) is run as deployed. Either engine runs on
    :class:`deploykit.runners.TrtRunner`, the runner of stage 7.

    Args:
        build: ``{"fp16": bool, "int8": bool, "tf32": bool, "strongly_typed": bool}`` for the
            marked build; mirror the flags of the deployed engine.
    Raises:
        StageError: TensorRT missing (callers check :func:`trt_available` first) or fails.
    """
    ok, info = trt_available()
    if not ok:
        raise StageError(info)
    from polygraphy import constants
    from polygraphy.backend.trt import (CreateConfig, EngineBytesFromNetwork,
                                        ModifyNetworkOutputs, NetworkFromOnnxPath, Profile)

    build = dict(build or {})
    if mark_all or engine_path is None:
        major = int(info.split(".")[0])
        rules = TRT_RULES.get(major, TRT_RULES[max(TRT_RULES)])
        strongly = bool(build.pop("strongly_typed", not rules["weak_flags"]))
        net = NetworkFromOnnxPath(str(onnx_path), strongly_typed=strongly or None)
        if mark_all:
            net = ModifyNetworkOutputs(net, outputs=constants.MARK_ALL)
        # One optimisation profile spanning the chunk shapes (dynamic batch axis).
        prof = Profile()
        first = next(iter_chunks(feed, batch))
        for k, v in first.items():
            prof.add(k, min=(1,) + v.shape[1:], opt=v.shape, max=v.shape)
        flags = {k: v for k, v in build.items() if v is not None} if rules["weak_flags"] else {}
        if strongly:
            flags = {k: v for k, v in flags.items() if k == "tf32"}
        try:
            plan = EngineBytesFromNetwork(net, CreateConfig(profiles=[prof], **flags))()
        except Exception as e:  # noqa: BLE001 - TensorRT/Polygraphy build errors
            raise StageError(f"TensorRT build of the marked network failed: "
                             f"{type(e).__name__}: {e}") from e
    else:
        plan = Path(engine_path)
    # The same runner as stage 7 (deploykit.runners.TrtRunner) runs the engine.
    try:
        with TrtRunner(plan) as runner:
            for chunk in iter_chunks(feed, batch):
                out = runner.infer(chunk)
                yield out, len(next(iter(chunk.values())))
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - TensorRT runtime errors
        raise StageError(f"TensorRT failed: {type(e).__name__}: {e}") from e


def collect_outputs(it: Iterator[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """Concatenate chunked outputs along axis 0."""
    parts: dict[str, list[np.ndarray]] = {}
    for out, _ in it:
        for k, v in out.items():
            parts.setdefault(k, []).append(np.asarray(v))
    return {k: (np.concatenate(v) if len(v) > 1 and v[0].ndim else v[0]) for k, v in parts.items()}
