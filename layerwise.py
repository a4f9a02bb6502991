"""Layer-wise parity: which layer of a deployed model first disagrees with the reference?

Four tools, one module (library + CLI):

- ``diff``: run two versions of an ONNX graph with every intermediate tensor exposed as an output
  (Polygraphy's "mark all", :class:`polygraphy.backend.onnx.ModifyOutputs` with
  ``constants.MARK_ALL``), match tensors by name across the graphs (Q/DQ and Cast nodes looked
  through), compare them in the reference graph's topological order (cosine similarity, max abs
  and relative error, tolerances that depend on the precision) and name the first divergent
  layer, together with whether its inputs still agreed ("this layer is wrong") or not ("the
  error arrived from upstream"). Side A is the reference (ORT CPU FP32); side B is ORT on any EP,
  the FP16 ONNX, a Q/DQ ONNX or a TensorRT engine.
- ``quant-backend``: for a Q/DQ model, per layer, the quantization error (float graph vs Q/DQ
  graph, both with ORT optimisations off) beside the backend error (the same Q/DQ graph,
  optimised vs not), in cosine and in quantization steps (:func:`quant_backend_table`).
- ``torch-vs-onnx``: PyTorch module outputs (forward hooks) against the ONNX tensors of the same
  module path, to catch export bugs before any runtime is blamed.
- ``export-check``: the silent export bugs (batch-dependent outputs, batch frozen into the
  graph, data-dependent paths, HardSigmoid attributes); a thin front end of
  ``python export_checks.py check``, where the checks live.

Reads: ONNX files (and optionally a TensorRT plan), an ``.npz`` of inputs or ``--model M --n N``
eval images (``artifacts/splits.json`` via :func:`common.load_split`).
Writes (``--out-dir``): ``layerwise.json``, ``layerwise.md`` (table), ``layerwise.png`` (cosine
along the graph), all atomically.

Rerun alone, e.g.::

    python layerwise.py diff artifacts/M/onnx/fp32.onnx artifacts/M/onnx/int8.onnx \\
        --model M --n 8 --out-dir results/M/layerwise_int8

Exit status: 0 ok (also when the comparison finds a divergence, and when TensorRT is skipped),
1 runtime failure, 2 usage error. ``--fail-on-divergence`` makes a divergence exit 1 (CI).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

import common
import runners
import onnx_graph
from common import StageError, UsageError

# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------
#: Default per-precision tolerances. A tensor passes when
#: ``cosine_min >= min_cosine`` AND ``max_abs_err <= atol + rtol * max|ref|``.
#:
#: Why these numbers (1 - cos ~= e^2 / 2 for a relative RMS error e):
#:
#: - ``fp32``: two FP32 runs differ only by summation order (~1e-7 relative per op, growing
#:   slowly with depth), so cosine >= 0.9999 (e ~ 1.4 %) and rtol 1e-3 of the tensor's range
#:   leave two orders of magnitude of margin and still flag a single wrong weight or op.
#: - ``tf32``: TF32 (TensorRT's default for FP32 on Ampere+, ORT CUDA) rounds matmul/conv inputs
#:   to a 10-bit mantissa (unit roundoff 4.9e-4); cosine >= 0.9995, rtol 5e-3.
#: - ``fp16``: same 10-bit mantissa for every tensor plus FP16 accumulation in some kernels;
#:   typical layer errors are 1e-3..1e-2 relative, so cosine >= 0.999 (e ~ 4.5 %) avoids false
#:   alarms on deep CNNs while a wrong layer (cosine < 0.9 in practice) still fails. rtol 0.1:
#:   measured on EfficientNet-Lite0 (fp16.onnx vs fp32.onnx, 8 real images), the ReLU6 (Clip)
#:   outputs of a healthy FP16 model reach max abs errors of 4-7 % of max|ref| (single elements
#:   near the clip point) at cosine 0.99998; 2e-2 flagged ten of them as divergent.
#: - ``int8``: per-tensor INT8 steps are range/255 (0.4 %) per quantised tensor and accumulate
#:   through the graph; healthy PTQ models keep per-layer cosine at 0.99..0.9999 (ORT's own
#:   ``qdq_loss_debug`` reports the same statistic), so 0.98 is the alarm line. Max abs error is
#:   dominated by single elements that cross a ReLU6/Clip threshold (an error of the whole
#:   range on efficientnet_lite0 while cosine stays > 0.99), hence rtol 1.0: cosine decides,
#:   max abs only catches errors larger than the tensor's range.
#: - ``int4``: weight-only INT4 blocks (AWQ/RTN) have 16 levels; cosine >= 0.95, rtol 2.0.
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"min_cosine": 0.9999, "atol": 1e-5, "rtol": 1e-3},
    "tf32": {"min_cosine": 0.9995, "atol": 1e-4, "rtol": 5e-3},
    "fp16": {"min_cosine": 0.999, "atol": 1e-3, "rtol": 0.1},
    "int8": {"min_cosine": 0.98, "atol": 1e-2, "rtol": 1.0},
    "int4": {"min_cosine": 0.95, "atol": 1e-2, "rtol": 2.0},
}

# Ops whose output is the same tensor value as their (first) input in another precision or
# representation: a tensor produced by one of them is matched to the tensor it came from.
LOOK_THROUGH_OPS = {"QuantizeLinear", "DequantizeLinear", "Cast", "Identity"}

# --------------------------------------------------------------------------------------------
# TensorRT version rules for remedies (checked against NVIDIA's docs):
# - trtexec --layerPrecisions/--layerOutputTypes/--precisionConstraints=obey exist in 8.6 and
#   10.x (used together in NVIDIA/TensorRT issue #3941 for 8.6 and 10.0.1); they apply to weakly
#   typed builds only (not with --stronglyTyped, not to explicitly quantised Q/DQ layers).
# - --stronglyTyped exists in 10.x.
# - TensorRT 11.x: "all networks are strongly typed"; --fp16/--int8/--best and the
#   OBEY/PREFER_PRECISION_CONSTRAINTS builder flags are removed ("Migrating trtexec Usage from
#   TensorRT 10.x to 11.x", "Removed Python APIs" pages, docs.nvidia.com/deeplearning/tensorrt/
#   11.x/api/migration/). The remedy there is to change the ONNX: keep the layer in FP32
#   (``python export_checks.py fp16 ... --keep-fp32 LAYER``, which writes ``fp16.onnx`` with FP32
#   I/O for stage 6) or drop its Q/DQ pair.
# - --noTF32 (BuilderFlag.TF32 cleared) exists in 8.x, 10.x and 11.x (TF32 is not in the 11.x
#   removed-API lists).
# --------------------------------------------------------------------------------------------
TRT_RULES: dict[int, dict[str, bool]] = {
    # major: {flag: available}
    8: {"layer_precisions": True, "strongly_typed": False, "no_tf32": True, "weak_flags": True},
    10: {"layer_precisions": True, "strongly_typed": True, "no_tf32": True, "weak_flags": True},
    11: {"layer_precisions": False, "strongly_typed": True, "no_tf32": True, "weak_flags": False},
}

MARKING_NOTE = ("Marking every tensor as an output prevents the fusions that would have "
                "consumed it (TensorRT layer fusion, ORT QDQ->QLinear* and Conv+Act fusion), so "
                "the marked run is not bit-identical to the deployed one; the unmarked model's "
                "final outputs are compared separately under 'final_outputs'.")


def tolerances_for(precision: str, overrides: dict[str, float] | None = None) -> dict[str, float]:
    """Tolerances for ``precision`` (a key of :data:`TOLERANCES`) with ``overrides`` applied.

    Raises:
        UsageError: unknown precision.
    """
    if precision not in TOLERANCES:
        raise UsageError(f"precision {precision!r}: choose one of {sorted(TOLERANCES)}")
    tol = dict(TOLERANCES[precision])
    for k, v in (overrides or {}).items():
        if v is not None:
            if k not in tol:
                raise UsageError(f"tolerance {k!r}: choose from {sorted(tol)}")
            tol[k] = float(v)
    return tol


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
    producer = onnx_graph.producers(model)
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


def _iter_chunks(feed: dict[str, np.ndarray], batch: int | None) -> Iterator[dict[str, np.ndarray]]:
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
        m = onnx_graph.load(m, external=False) if isinstance(m, (str, Path)) else m
        static |= {d[0] for _, d, _ in onnx_graph.inputs(m) if d and d[0]}
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
    return runners.OrtRunner(path, ep=ep, opt_level=opt_level,
                             disabled_optimizers=disabled_optimizers)


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TensorStat:
    """Running comparison of one tensor over chunks of samples (float64 arithmetic).

    ``cosines`` holds one cosine per sample (axis 0 = batch) or one per chunk when the tensor
    has no batch axis; ``max_abs_err`` and ``ref_abs_max`` are maxima over all elements.
    """

    shape_a: tuple = ()
    shape_b: tuple = ()
    dtype_b: str = ""
    cosines: list = dataclasses.field(default_factory=list)
    max_abs_err: float = 0.0
    sum_abs_err: float = 0.0
    count: int = 0
    ref_abs_max: float = 0.0
    nonfinite_b: int = 0
    mismatch: str | None = None
    exact: bool | None = None

    def update(self, a: np.ndarray, b: np.ndarray, n_batch: int) -> None:
        a, b = np.asarray(a), np.asarray(b)
        self.shape_a, self.shape_b, self.dtype_b = tuple(a.shape), tuple(b.shape), str(b.dtype)
        if a.shape != b.shape:
            if a.size == b.size:
                b = b.reshape(a.shape)  # e.g. TensorRT's [N, C] vs [N, C, 1, 1]
            else:
                self.mismatch = f"shape {tuple(b.shape)} vs reference {tuple(a.shape)}"
                return
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(b.dtype, np.floating)):
            # Integer tensors (shapes, indices, quantised values): exact, except that 8-bit
            # quantised values may differ by one step (round-half-even vs away from zero).
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64)) if a.size else np.zeros(1)
            step_ok = a.dtype.itemsize == 1 and diff.max() <= 1
            eq = bool(diff.max() == 0 or step_ok)
            self.exact = eq if self.exact is None else (self.exact and eq)
            return
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        self.nonfinite_b += int((~np.isfinite(b64) & np.isfinite(a64)).sum())
        per_sample = a64.ndim >= 2 and a64.shape[0] == n_batch
        cos = common.cosine_rows(a64, b64) if per_sample else common.cosine_rows(
            a64.reshape(1, -1), b64.reshape(1, -1))
        self.cosines.extend(cos.tolist())
        err = np.abs(a64 - b64)
        if err.size:
            self.max_abs_err = max(self.max_abs_err, float(np.max(err)))
            self.sum_abs_err += float(np.sum(err))
            self.ref_abs_max = max(self.ref_abs_max, float(np.max(np.abs(a64))))
        self.count += err.size

    def result(self, tol: dict[str, float]) -> dict:
        """Summary dict with ``status`` ``pass``/``fail`` under ``tol``."""
        out: dict[str, Any] = {"shape": list(self.shape_a), "dtype_b": self.dtype_b}
        if self.mismatch:
            return {**out, "status": "fail", "note": self.mismatch}
        if self.exact is not None:
            return {**out, "status": "pass" if self.exact else "fail", "exact_match": self.exact,
                    "cosine_min": 1.0 if self.exact else 0.0}
        cos = np.asarray(self.cosines, np.float64)
        cmin = float(np.min(cos)) if cos.size else float("nan")
        rel = self.max_abs_err / self.ref_abs_max if self.ref_abs_max > 0 else (
            0.0 if self.max_abs_err == 0 else float("inf"))
        ok = (np.isfinite(cmin) and cmin >= tol["min_cosine"] and self.nonfinite_b == 0
              and np.isfinite(self.max_abs_err)
              and self.max_abs_err <= tol["atol"] + tol["rtol"] * self.ref_abs_max)
        res = {**out, "status": "pass" if ok else "fail", "cosine_min": cmin,
               "cosine_mean": float(np.mean(cos)) if cos.size else float("nan"),
               "max_abs_err": self.max_abs_err,
               "mean_abs_err": self.sum_abs_err / self.count if self.count else float("nan"),
               "rel_err": rel, "ref_abs_max": self.ref_abs_max}
        if self.nonfinite_b:
            res["note"] = f"{self.nonfinite_b} NaN/Inf values where the reference is finite"
        return res


def compare_outputs(ref: dict[str, np.ndarray], out: dict[str, np.ndarray],
                    tol: dict[str, float]) -> dict[str, dict]:
    """Compare final outputs by name (``out`` may lack some) with :class:`TensorStat`."""
    res = {}
    for name, a in ref.items():
        if name not in out:
            res[name] = {"status": "missing"}
            continue
        st = TensorStat()
        st.update(a, out[name], len(a) if np.ndim(a) else 1)
        res[name] = st.result(tol)
    return res


# --------------------------------------------------------------------------------------------
# Collecting activations
# --------------------------------------------------------------------------------------------
def ort_activations(model_or_path, feed: dict[str, np.ndarray], *, ep: str = "cpu",
                    batch: int | None = None, opt_level: str = "all", mark_all: bool = True,
                    disabled_optimizers: Sequence[str] = ()
                    ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """Yield ``(tensors, n_samples)`` per chunk of ``feed`` from ONNX Runtime.

    Args:
        model_or_path: ONNX path or ModelProto.
        feed: ``{input name: array}``, batch on axis 0.
        ep: ``cpu``/``cuda``/``trt`` (:data:`runners.ORT_EPS`).
        batch: chunk size (default: the whole feed at once); see :func:`feed_plan` for a model
            with a static batch. Float32 inputs are cast to float16 where the model declares
            float16 inputs.
        mark_all: expose every intermediate tensor (else only the model's outputs).
        disabled_optimizers: ORT graph optimizers to switch off (e.g. WeightBiasQuantization).
    """
    model = model_or_path
    if mark_all:
        model = onnx_graph.mark_all_outputs(onnx_graph.load(model_or_path) if isinstance(model_or_path, (str, Path))
                                 else model_or_path)
    with tempfile.TemporaryDirectory(prefix="layerwise-") as tmp:
        runner = _ort_session(model, ep, Path(tmp), opt_level, disabled_optimizers)
        half = {i.name for i in runner.session.get_inputs() if i.type == "tensor(float16)"}
        for chunk in _iter_chunks(feed, batch):
            n = len(next(iter(chunk.values())))
            # A candidate with FP16 inputs (e.g. converted without keep_io_types) gets the same
            # samples cast to FP16; every other input is passed as given.
            chunk = {k: (v.astype(np.float16) if k in half and v.dtype == np.float32 else v)
                     for k, v in chunk.items() if k in runner.input_names}
            try:
                yield runner.infer(chunk), n
            except Exception as e:  # noqa: BLE001 - ORT raises its own types
                raise StageError(f"onnxruntime failed on {model_or_path if isinstance(model_or_path, (str, Path)) else 'model'}: {e}") from e


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
    :class:`runners.TrtRunner`, the runner of stage 7.

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
        first = next(_iter_chunks(feed, batch))
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
    # The same runner as stage 7 (runners.TrtRunner) runs the engine.
    try:
        with runners.TrtRunner(plan) as runner:
            for chunk in _iter_chunks(feed, batch):
                out = runner.infer(chunk)
                yield out, len(next(iter(chunk.values())))
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - TensorRT runtime errors
        raise StageError(f"TensorRT failed: {type(e).__name__}: {e}") from e


def fp16_remedy_command(layer: str, onnx_path: Path | str) -> list[str]:
    """Commands that keep ``layer`` in FP32 in the FP16 ONNX and rebuild its engine.

    The FP16 file is remade from its FP32 source by ``export_checks.py fp16`` (the converter of
    stage 2: FP32 inputs/outputs, ``--keep-fp32`` nodes computed in FP32, checked before it is
    installed) under the pipeline's name ``fp16.onnx`` (variant ``fp16`` of ``variants.py``), so
    stage 6 rebuilds it and stages 3/7 evaluate it as before.

    The layer's consumers are kept in FP32 too (when the FP32 file is there to read them):
    onnxconverter-common casts a kept node's output back to FP16 for every other consumer.

    Args:
        layer: ONNX node name (TensorRT's ONNX parser names layers after nodes).
        onnx_path: the ONNX the engine was built from (``artifacts/<model>/onnx/fp16.onnx``, or
            the FP32 file built with ``--fp16`` on TensorRT 8.x/10.x).
    Returns:
        the command lines (the first writes the file, the second rebuilds the engine).
    """
    import variants

    onnx_path = Path(onnx_path)
    fp16 = variants.get("fp16").onnx_file
    fp32 = variants.get("fp32").onnx_file
    src = onnx_path if onnx_path.name == fp32 else onnx_path.with_name(fp32)
    dst = onnx_path.with_name(fp16)
    art = onnx_path.parent.parent
    calib = art / "calib.npz"
    inputs = f" --inputs {calib}" if calib.exists() else ""
    keep = [layer]
    if src.exists():  # the layer's consumers too, or its output is cast back to FP16 for them
        import export_checks

        m = onnx_graph.load(src, external=False)
        node = next((n for n in m.graph.node if n.name == layer), None)
        if node is not None:
            keep = export_checks.keep_fp32_nodes(m, [o for o in node.output if o]) or keep
    return [f"python export_checks.py fp16 {src} -o {dst} --keep-fp32 {','.join(keep)}{inputs}",
            f"bash 6_build_engines.sh --model {art.name} fp16"]


def trt_remedies(layer: str, onnx_path: Path | str, precision: str,
                 trt_version: str | None, engine_path: Path | str | None = None) -> list[str]:
    """Rebuild commands that may fix a wrong layer, limited to flags of ``trt_version``.

    Args:
        layer: the ONNX node name of the first divergent layer; TensorRT's ONNX parser names
            layers after ONNX nodes, which is what ``--layerPrecisions`` matches.
        precision: precision of the build (``fp32``/``fp16``/``int8``/...).
        trt_version: installed TensorRT version (default: list the 10.x forms and say so).
    Returns:
        Human-readable suggestions, most specific first. For FP16 they include the ONNX-level
        fix (:func:`fp16_remedy_command`), which writes a file the pipeline picks up.
    """
    major = int(trt_version.split(".")[0]) if trt_version else 10
    rules = TRT_RULES.get(major, TRT_RULES[11] if major > 11 else TRT_RULES[8])
    save = f" --saveEngine={engine_path}" if engine_path else ""
    base = f"trtexec --onnx={onnx_path}{save}"
    out = []
    if rules["layer_precisions"] and precision in ("fp16", "tf32", "fp32"):
        prec = " --fp16" if precision == "fp16" else ""
        out.append(f"{base}{prec} --layerPrecisions={layer}:fp32 --layerOutputTypes={layer}:fp32 "
                   "--precisionConstraints=obey  # keep the layer in FP32 (weakly typed build)")
    if precision in ("int8", "int4"):
        out.append(f"remove the Q/DQ pairs feeding {layer} in the ONNX (or re-quantise with "
                   f"ModelOpt, nodes_to_exclude=['{layer}']) and rebuild: {base}"
                   + (" --stronglyTyped" if rules["strongly_typed"] else ""))
    if precision == "fp16":
        why = (f"TensorRT {trt_version} is strongly typed only (no --layerPrecisions/"
               "--precisionConstraints): " if not rules["layer_precisions"] else "")
        cmds = fp16_remedy_command(layer, onnx_path)
        out.append(f"{why}keep {layer} in FP32 in the ONNX (FP32 inputs/outputs, same file "
                   f"name, variant fp16): {cmds[0]}  # then: {cmds[1]}")
    elif not rules["layer_precisions"]:
        out.append(f"TensorRT {trt_version} is strongly typed only (no --layerPrecisions/"
                   f"--precisionConstraints): keep {layer} in FP32 in the ONNX, then rebuild")
    if rules["no_tf32"] and precision in ("fp32", "tf32", "fp16"):
        out.append(f"{base}{' --fp16' if precision == 'fp16' and rules['weak_flags'] else ''} "
                   "--noTF32  # FP32 layers in true FP32 instead of TF32")
    out.append(f"polygraphy run {onnx_path} --trt --onnxrt --trt-outputs mark all "
               "--onnx-outputs mark all  # Polygraphy's own layer-wise cross-check")
    if trt_version is None:
        out.append("(TensorRT not installed here: commands use the 10.x flag set)")
    return out


# --------------------------------------------------------------------------------------------
# Layer-wise diff
# --------------------------------------------------------------------------------------------
def _b_name_for(ref_name: str, b_names: set[str], b_alias_inv: dict[str, list[str]]) -> str | None:
    """Tensor of B that represents reference tensor ``ref_name`` (exact name first, then the
    look-through aliases: the float tensor a Q/DQ or Cast chain was built from or leads to)."""
    if ref_name in b_names:
        return ref_name
    for cand in b_alias_inv.get(ref_name, []):
        if cand in b_names:
            return cand
    return None


def _node_detail(a_model, b_model, node_name: str) -> dict:
    """What differs between the node named ``node_name`` in A and B: op type, attributes and
    (same-name or positional) weights. Empty fields mean "no difference found"."""
    def find(m):
        return next((n for n in m.graph.node if n.name == node_name), None)

    na, nb = find(a_model), find(b_model)
    if na is None or nb is None:
        return {"node_in_b": nb is not None}
    det: dict[str, Any] = {"node_in_b": True, "op_type_a": na.op_type, "op_type_b": nb.op_type}
    aa, ab = onnx_graph.attrs(na), onnx_graph.attrs(nb)
    det["attributes_differ"] = {k: [repr(aa.get(k)), repr(ab.get(k))]
                                for k in set(aa) | set(ab) if repr(aa.get(k)) != repr(ab.get(k))}
    ia, ib = onnx_graph.constants(a_model), onnx_graph.constants(b_model)
    b_alias = lookthrough_aliases(b_model)
    wd = {}
    for pos, name in enumerate(na.input):
        if name not in ia or pos >= len(nb.input):
            continue
        bn = b_alias.get(nb.input[pos], nb.input[pos])
        if bn not in ib:
            continue
        wa, wb = ia[name].astype(np.float64), ib[bn].astype(np.float64)
        if wa.shape != wb.shape:
            wd[name] = f"shape {wb.shape} vs {wa.shape}"
        elif not np.allclose(wa, wb, rtol=1e-2, atol=1e-3 * max(np.abs(wa).max(), 1e-12)):
            wd[name] = f"max abs diff {np.abs(wa - wb).max():.4g} (|w|max {np.abs(wa).max():.4g})"
    det["weights_differ"] = wd
    return det


def run_layer_diff(a_onnx: Path | str, b_onnx: Path | str, feed: dict[str, np.ndarray], *,
                   ep_a: str = "cpu", ep_b: str = "cpu", b_engine: Path | str | None = None,
                   b_trt: bool = False, trt_build: dict | None = None,
                   tolerances: dict[str, float] | None = None, precision: str | None = None,
                   batch: int | None = None, opt_level: str = "all",
                   out_dir: Path | str | None = None, title: str | None = None) -> dict:
    """Compare every intermediate tensor of two runs of an ONNX graph and name the first
    divergent layer.

    Args:
        a_onnx: reference ONNX (run with ORT on ``ep_a``; normally the FP32 model on CPU).
        b_onnx: candidate ONNX: the same file on another EP, the FP16 or Q/DQ model, or the
            ONNX a TensorRT engine was built from.
        feed: ``{input name: array}`` with the batch on axis 0; any dtypes/ranks (non-image
            inputs are fine). Keys not in a model are ignored by it.
        ep_a, ep_b: ORT execution providers (``cpu``/``cuda``/``trt``).
        b_engine: serialized TensorRT plan of ``b_onnx``; implies ``b_trt``. Its unmarked
            final outputs are compared as deployed.
        b_trt: run side B through TensorRT (a marked-all engine built from ``b_onnx``).
            Without ``tensorrt`` the result has ``status: "skipped"`` and a reason.
        trt_build: builder flags for the marked engine, see :func:`trt_activations`.
        tolerances: overrides of ``min_cosine``/``atol``/``rtol``.
        precision: tolerance class (default: :func:`detect_precision` of B, ``tf32`` for FP32
            on a GPU EP or TensorRT).
        batch: run in chunks of this many samples (memory; None = all at once); a model with a
            static batch is fed exactly that many (:func:`feed_plan`).
        opt_level: ORT graph optimisation level for both sides.
        out_dir: if given, write ``layerwise.json``/``.md``/``.png`` there.
    Returns:
        dict with ``status`` (``ok``/``skipped``), ``tolerances``, ``layers`` (one row per
        reference node in topological order: ``index``, ``node``, ``op_type``, ``tensor``,
        ``b_tensor``, ``status`` pass/fail/unmatched, metrics, ``inputs_agreed``),
        ``first_divergent`` (row + ``inputs_agreed`` + ``verdict`` + node ``detail``) or None,
        ``origins`` (failing nodes whose inputs all agreed), ``final_outputs`` (unmarked runs),
        ``note`` and, for TensorRT, ``remedies``.
    Raises:
        StageError: a model cannot be loaded or run. UsageError: bad tolerance/precision.
    """
    t0 = time.time()
    a_onnx, b_onnx = Path(a_onnx), Path(b_onnx)
    a_model, b_model = onnx_graph.load(a_onnx), onnx_graph.load(b_onnx)
    feed, batch = feed_plan(feed, [a_model, b_model], batch)  # a static batch decides
    b_trt = b_trt or b_engine is not None
    if precision is None:
        precision = onnx_graph.detect_precision(b_model).lower()
        if precision == "fp32" and (b_trt or ep_b in ("cuda", "trt", "tensorrt")):
            precision = "tf32"
    tol = tolerances_for(precision, tolerances)
    batch = chunk_size([a_model, b_model], batch)
    backend_b = "TensorRT" if b_trt else f"ORT {runners.ORT_EPS.get(ep_b, ep_b)}"
    result: dict[str, Any] = {
        "a": {"onnx": str(a_onnx), "backend": f"ORT {runners.ORT_EPS.get(ep_a, ep_a)}"},
        "b": {"onnx": str(b_onnx), "backend": backend_b,
              "engine": str(b_engine) if b_engine else None},
        "precision": precision, "tolerances": tol, "note": MARKING_NOTE,
        "n_samples": int(len(next(iter(feed.values())))) if feed else 0,
        "inputs": {k: [list(v.shape), str(v.dtype)] for k, v in feed.items()},
    }
    if b_trt:
        ok, info = trt_available()
        result["b"]["tensorrt"] = info if ok else None
        if not ok:
            result.update(status="skipped", reason=info, first_divergent=None, layers=[])
            if out_dir:
                write_reports(result, out_dir, title)
            return result

    # Unmarked final outputs: what the deployed model returns (fusions intact).
    a_final = _collect(ort_activations(a_onnx, feed, ep=ep_a, batch=batch, opt_level=opt_level,
                                       mark_all=False))
    if b_trt:
        b_final_iter = trt_activations(b_onnx, feed, build=trt_build, batch=batch,
                                       mark_all=False, engine_path=b_engine)
    else:
        b_final_iter = ort_activations(b_onnx, feed, ep=ep_b, batch=batch, opt_level=opt_level,
                                       mark_all=False)
    result["final_outputs"] = compare_outputs(a_final, _collect(b_final_iter), tol)

    # Marked runs, compared chunk by chunk so memory stays at one chunk of activations.
    a_iter = ort_activations(a_model, feed, ep=ep_a, batch=batch, opt_level=opt_level)
    b_iter = (trt_activations(b_onnx, feed, build=trt_build, batch=batch) if b_trt else
              ort_activations(b_model, feed, ep=ep_b, batch=batch, opt_level=opt_level))
    b_alias = lookthrough_aliases(b_model)
    b_alias_inv: dict[str, list[str]] = {}
    for t, r in b_alias.items():
        b_alias_inv.setdefault(r, []).append(t)
    stats: dict[str, TensorStat] = {}
    b_of: dict[str, str | None] = {}
    for (a_out, n), (b_out, _) in zip(a_iter, b_iter):
        b_names = set(b_out)
        for name, a_val in a_out.items():
            if name not in b_of:
                b_of[name] = _b_name_for(name, b_names, b_alias_inv)
            bn = b_of[name]
            if bn is None or bn not in b_out:
                continue
            stats.setdefault(name, TensorStat()).update(a_val, b_out[bn], n)

    rows = _rows_from_stats(a_model, stats, b_of, tol)
    result["layers"] = rows
    _attach_verdict(result, a_model, b_model, rows)
    fd = result["first_divergent"]
    if fd and not b_trt and precision in ("int8", "int4") and opt_level != "disable":
        _backend_check(result, a_onnx, b_onnx, feed, ep_a=ep_a, ep_b=ep_b, tolerances=tolerances,
                       precision=precision, batch=batch)
    if b_trt and result["first_divergent"]:
        result["remedies"] = trt_remedies(result["first_divergent"]["node"], b_onnx, precision,
                                          result["b"].get("tensorrt"), b_engine)
    result["status"] = "ok"
    result["wall_time_s"] = round(time.time() - t0, 3)
    if out_dir:
        write_reports(result, out_dir, title)
    return result


def _backend_check(result: dict, a_onnx: Path, b_onnx: Path, feed: dict[str, np.ndarray],
                   **kw) -> None:
    """Rule out the backend before blaming quantisation: repeat a Q/DQ comparison with all ORT
    graph optimisations disabled (the graph's reference semantics). If the divergence goes
    away or moves later, ORT's optimiser, not the quantised graph, caused it (seen with ModelOpt
    fp16 scales and ORT's ``WeightBiasQuantization``), and the verdict says so."""
    ref = run_layer_diff(a_onnx, b_onnx, feed, opt_level="disable", **kw)
    fd, fd_ref = result["first_divergent"], ref["first_divergent"]
    check = {"opt_level": "disable",
             "first_divergent": fd_ref["node"] if fd_ref else None,
             "final_outputs": ref.get("final_outputs")}
    result["backend_check"] = check
    if fd_ref is None or fd_ref["index"] > fd["index"]:
        where = (f"the first divergent layer becomes {fd_ref['node']}" if fd_ref else
                 "no layer diverges")
        fd["verdict"] = (f"ORT graph optimisations cause this divergence, not the quantised "
                         f"graph: with them disabled {where} (compare 3_onnx_eval.py "
                         f"--disable-optimizer WeightBiasQuantization). " + fd["verdict"])
        result["verdict"] = fd["verdict"]
        check["backend_caused"] = True
    else:
        check["backend_caused"] = False


def _collect(it: Iterator[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    """Concatenate chunked outputs along axis 0."""
    parts: dict[str, list[np.ndarray]] = {}
    for out, _ in it:
        for k, v in out.items():
            parts.setdefault(k, []).append(np.asarray(v))
    return {k: (np.concatenate(v) if len(v) > 1 and v[0].ndim else v[0]) for k, v in parts.items()}


def _rows_from_stats(a_model, stats: dict[str, TensorStat], b_of: dict, tol: dict) -> list[dict]:
    """One row per reference node output (topological order of the reference graph)."""
    producer = onnx_graph.producers(a_model)
    inits = {t.name for t in a_model.graph.initializer}
    graph_inputs = {name for name, _, _ in onnx_graph.inputs(a_model)}
    rows = []
    tensor_status: dict[str, str] = {}
    # Tensors computed only from Shape/Size and constants (dynamic padding, reshape targets):
    # compared like the others but left out of the table and plot, where they are noise.
    const = {o for n in a_model.graph.node if n.op_type == "Constant" for o in n.output} | inits
    shape_derived: set[str] = set()
    for node in a_model.graph.node:
        ins = [t for t in node.input if t and t not in const]
        if node.op_type in ("Shape", "Size") or (
                ins and all(t in shape_derived for t in ins)):
            shape_derived.update(o for o in node.output if o)
    for i, node in enumerate(a_model.graph.node):
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if not out:
                continue
            if out in stats:
                row = stats[out].result(tol)
            else:
                row = {"status": "unmatched", "note": "no counterpart in B (renamed, fused away "
                       "or not exposed)"}
            tensor_status[out] = row["status"]
            inputs = [t for t in node.input if t and t not in inits]
            agreed = []
            for t in inputs:
                if t in graph_inputs or (t in shape_derived and tensor_status.get(t) != "fail"):
                    # shape arithmetic depends only on the (identical) input shapes
                    agreed.append(True)
                elif tensor_status.get(t) == "pass":
                    agreed.append(True)
                elif tensor_status.get(t) == "fail":
                    agreed.append(False)
                elif t in producer and producer[t].op_type == "Constant":
                    agreed.append(True)
                else:
                    agreed.append(None)
            inputs_agreed = (False if False in agreed else None if None in agreed else True)
            rows.append({"index": len(rows), "node_index": i, "node": node.name or f"node_{i}",
                         "op_type": node.op_type, "tensor": out, "b_tensor": b_of.get(out),
                         "inputs": inputs, "inputs_agreed": inputs_agreed,
                         "shape_only": out in shape_derived, **row})
    return rows


def _attach_verdict(result: dict, a_model, b_model, rows: list[dict]) -> None:
    """Fill ``first_divergent``, ``origins`` and summary counts from the rows."""
    fails = [r for r in rows if r["status"] == "fail"]
    result["summary"] = {k: sum(r["status"] == k for r in rows if not r["shape_only"])
                         for k in ("pass", "fail", "unmatched")}
    result["summary"]["shape_rows"] = sum(r["shape_only"] for r in rows)
    result["origins"] = [r["node"] for r in fails if r["inputs_agreed"] is True]
    if not fails:
        result["first_divergent"] = None
        result["verdict"] = "all compared tensors agree within tolerance"
        return
    first = dict(fails[0])
    cos = first.get("cosine_min")
    nonfinite = cos is None or (isinstance(cos, float) and not np.isfinite(cos))
    if nonfinite:
        verdict = (f"{first['node']} ({first['op_type']}) returns non-finite values (NaN/Inf)"
                   + (" although its inputs agree with the reference" if first["inputs_agreed"]
                      is True else ""))
    elif first["inputs_agreed"] is True and result.get("precision") in ("int8", "int4"):
        verdict = (f"quantisation error first exceeds the {result['precision']} tolerance at "
                   f"{first['node']} ({first['op_type']}): its inputs were within tolerance")
    elif first["inputs_agreed"] is True:
        verdict = (f"{first['node']} ({first['op_type']}) is wrong: its inputs agree with the "
                   "reference, its output does not")
    elif first["inputs_agreed"] is False:
        verdict = f"{first['node']}: error arrived from upstream (its inputs already differ)"
    else:
        verdict = (f"{first['node']}: output differs; some inputs are not observable in B, so "
                   "the error may have arrived from upstream")
    first["verdict"] = verdict
    first["detail"] = _node_detail(a_model, b_model, first["node"])
    result["first_divergent"] = first
    result["verdict"] = verdict


# --------------------------------------------------------------------------------------------
# Quantization error vs backend error (Q/DQ models)
# --------------------------------------------------------------------------------------------
#: A backend reproduces a Q/DQ graph when every tensor stays, on average, well within one
#: quantization step of the graph's own semantics (DequantizeLinear + float ops, ORT
#: optimisations off): an integer kernel may round a requantized value the other way (ties, fused
#: scale products) and such one-step flips propagate to later layers as sparse larger errors, so
#: the test is on the mean error and the cosine, not on the largest element: mean |error| <= 0.5
#: step (<= 2 % of the tensor's range where the graph does not quantize it; cosine alone cannot
#: see a wrong magnitude, e.g. a one-value output that saturates) and cosine >= 0.999 (the FP16
#: line: fp16 scales make ORT CPU compute through inserted casts in either run).
BACKEND_TOL = {"max_mean_steps": 0.5, "min_cosine": 0.999, "max_mean_rel_err": 0.02}


def quantization_steps(model) -> dict[str, float]:
    """``{tensor: scale}`` for every tensor of a Q/DQ ``model`` that a QuantizeLinear with a
    constant per-tensor scale quantizes (under its own name and its DequantizeLinear output's,
    so both sides of a Q/DQ pair map to the same step)."""
    consts = onnx_graph.constants(model)
    out: dict[str, float] = {}
    cons = onnx_graph.consumers(model)
    for n in model.graph.node:
        if n.op_type != "QuantizeLinear" or len(n.input) < 2:
            continue
        s = consts.get(n.input[1])
        if s is None or s.size != 1:
            continue
        v = float(np.asarray(s, np.float64).ravel()[0])
        out.setdefault(n.input[0], v)
        for dq in cons.get(n.output[0], []):
            if dq.op_type == "DequantizeLinear":
                out.setdefault(dq.output[0], v)
    return out


def _pair_result(st: TensorStat, tol: dict, step: float | None, backend: bool) -> dict:
    """:meth:`TensorStat.result` plus the error in quantization steps (``steps_max``,
    ``steps_mean``) when the tensor has a step; backend rows judged by :data:`BACKEND_TOL`."""
    r = st.result(tol)
    if step and "max_abs_err" in r:
        r["steps_max"] = r["max_abs_err"] / step
        r["steps_mean"] = r["mean_abs_err"] / step
    if backend and "max_abs_err" in r:
        mean_ok = (r["steps_mean"] <= BACKEND_TOL["max_mean_steps"] if step else
                   r["mean_abs_err"] <= 1e-6 + BACKEND_TOL["max_mean_rel_err"] * r["ref_abs_max"])
        ok = (st.nonfinite_b == 0 and np.isfinite(r["cosine_min"])
              and r["cosine_min"] >= BACKEND_TOL["min_cosine"] and mean_ok)
        r["status"] = "pass" if ok else "fail"
    return r


def _severity(r: dict) -> float:
    """Sort key of a comparison (lower = worse): non-finite first, then by cosine."""
    c = r.get("cosine_min")
    return -np.inf if (r.get("note") and "NaN" in r["note"]) or c is None or not np.isfinite(c) \
        else float(c)


def _describe(r: dict) -> str:
    """``cosine 0.61`` or ``NaN/Inf`` for a verdict."""
    if _severity(r) == -np.inf:
        return "NaN/Inf"
    text = f"cosine {r['cosine_min']:.4g}"
    if r.get("top1_agreement") is not None:
        text += f", top-1 agreement {r['top1_agreement']:.1f} %"
    return text


def _channel_cosines(acc: np.ndarray) -> dict:
    """Per-channel cosine from accumulated ``[sum a*b, sum a*a, sum b*b]`` (axis 1 of the
    tensor): ``channel_cosine_min`` over channels the reference does not leave at zero, and
    ``channels_lost`` (cosine < 0.5: the channel is gone or another signal; a per-tensor cosine
    hides them when they are small, e.g. per-tensor weights of a depthwise convolution)."""
    dot, na, nb = acc
    live = na > 1e-24 * max(float(na.max()), 1e-300)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(nb > 0, dot / np.sqrt(na * nb), 0.0)
    cos = cos[live]
    lost = np.flatnonzero(live)[cos < 0.5]
    return {"channel_cosine_min": float(cos.min()) if cos.size else None,
            "channels_lost": lost[:50].tolist(), "n_channels_lost": int(lost.size)}


def quant_backend_table(fp32_onnx: Path | str, qdq_onnx: Path | str, feed: dict[str, np.ndarray],
                        *, ep: str = "cpu", opt_level: str = "all",
                        disabled_optimizers: Sequence[str] = (), batch: int | None = None,
                        precision: str | None = None, out_dir: Path | str | None = None) -> dict:
    """Per layer, how much error the quantization itself adds and how much the backend adds.

    Three runs of the same inputs, every tensor exposed (see :data:`MARKING_NOTE`):

    - **F**: the float graph, ORT CPU, optimisations off (reference);
    - **Q0**: the Q/DQ graph, ORT CPU, optimisations off: the graph's own semantics
      (DequantizeLinear + float ops);
    - **Q1**: the Q/DQ graph as the backend runs it (``ep``, ``opt_level``).

    quantization error = F vs Q0 (the precision's tolerance, :data:`TOLERANCES`); backend error
    = Q0 vs Q1 (:data:`BACKEND_TOL`). Both in cosine (min over samples) and, for tensors that
    the graph quantizes, in quantization steps of that tensor (max and mean |error| / scale).
    The final outputs are compared on unmarked models too (fusions intact).

    Args:
        fp32_onnx: float model. qdq_onnx: the Q/DQ model made from it.
        feed: ``{input name: array}``, batch on axis 0 (:func:`load_feed`).
        ep, opt_level, disabled_optimizers: how the backend run Q1 is made.
        batch: chunk size (memory); None = all samples at once.
        precision: tolerance class of the quantization error (default: detected from the file).
        out_dir: write ``quant_backend.json`` / ``quant_backend.md`` there.
    Returns:
        ``{"layers": [{"index", "node", "op_type", "tensor", "step", "quant": {...},
        "backend": {...}, "verdict"}], "final_outputs": {name: {"quant", "backend"}},
        "first_quant", "first_backend", "verdict", "tolerances", ...}``; ``verdict`` per layer is
        ``ok``, ``quantization``, ``backend`` or ``both``.
    Raises:
        StageError: a model cannot be loaded or run.
    """
    t0 = time.time()
    a_model, q_model = onnx_graph.load(fp32_onnx), onnx_graph.load(qdq_onnx)
    precision = precision or onnx_graph.detect_precision(q_model).lower()
    tol = tolerances_for(precision if precision in TOLERANCES else "int8")
    batch = chunk_size([a_model, q_model], batch)
    steps = quantization_steps(q_model)
    alias = lookthrough_aliases(q_model)
    alias_inv: dict[str, list[str]] = {}
    for t, r in alias.items():
        alias_inv.setdefault(r, []).append(t)

    def run(model, backend: bool, mark_all: bool = True):
        return ort_activations(model, feed, ep=ep if backend else "cpu", batch=batch,
                               opt_level=opt_level if backend else "disable", mark_all=mark_all,
                               disabled_optimizers=disabled_optimizers if backend else ())

    f_it, q0_it, q1_it = run(a_model, False), run(q_model, False), run(q_model, True)
    quant: dict[str, TensorStat] = {}
    backend: dict[str, TensorStat] = {}
    chan: dict[str, np.ndarray] = {}  # per channel (axis 1): [sum a*b, sum a*a, sum b*b]
    b_of: dict[str, str | None] = {}
    for (f, n), (q0, _), (q1, _) in zip(f_it, q0_it, q1_it):
        names = set(q0)
        for name, a in f.items():
            if name not in b_of:
                b_of[name] = _b_name_for(name, names, alias_inv)
            b = b_of[name]
            if b is None or b not in q0 or b not in q1:
                continue
            quant.setdefault(name, TensorStat()).update(a, q0[b], n)
            backend.setdefault(name, TensorStat()).update(q0[b], q1[b], n)
            a64, b64 = np.asarray(a, np.float64), np.asarray(q0[b], np.float64)
            if a64.ndim >= 2 and a64.shape == b64.shape and a64.shape[0] == n \
                    and np.issubdtype(np.asarray(a).dtype, np.floating):
                fa = np.moveaxis(a64, 1, 0).reshape(a64.shape[1], -1)
                fb = np.moveaxis(b64, 1, 0).reshape(b64.shape[1], -1)
                acc = np.stack([(fa * fb).sum(1), (fa * fa).sum(1), (fb * fb).sum(1)])
                chan[name] = chan[name] + acc if name in chan else acc
    inits = {t.name for t in a_model.graph.initializer}
    rows = []
    for i, node in enumerate(a_model.graph.node):
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if not out or out not in quant:
                continue
            b = b_of.get(out)
            step = steps.get(b) or steps.get(alias.get(b, b)) or steps.get(out)
            qr = _pair_result(quant[out], tol, step, backend=False)
            if out in chan:
                qr.update(_channel_cosines(chan[out]))
            br = _pair_result(backend[out], tol, step, backend=True)
            qf, bf = qr["status"] == "fail", br["status"] == "fail"
            rows.append({"index": len(rows), "node": node.name or f"node_{i}",
                         "op_type": node.op_type, "tensor": out, "b_tensor": b, "step": step,
                         "inputs": [t for t in node.input if t and t not in inits],
                         "quant": qr, "backend": br,
                         "verdict": "both" if qf and bf else "quantization" if qf else
                         "backend" if bf else "ok"})
    # Unmarked final outputs: what the deployed models return.
    f_fin = _collect(run(fp32_onnx, False, mark_all=False))
    q0_fin = _collect(run(qdq_onnx, False, mark_all=False))
    q1_fin = _collect(run(qdq_onnx, True, mark_all=False))
    finals = {}
    for name, a in f_fin.items():
        if name in q0_fin and name in q1_fin:
            sq, sb = TensorStat(), TensorStat()
            nb = len(a) if np.ndim(a) else 1
            sq.update(a, q0_fin[name], nb)
            sb.update(q0_fin[name], q1_fin[name], nb)
            step = steps.get(name) or steps.get(alias.get(name, name))
            finals[name] = {"quant": _pair_result(sq, tol, step, False),
                            "backend": _pair_result(sb, tol, step, True)}
            if np.ndim(a) == 2 and len(a):
                finals[name]["quant"]["top1_agreement"] = float(
                    100 * (a.argmax(1) == q0_fin[name].argmax(1)).mean())
                finals[name]["backend"]["top1_agreement"] = float(
                    100 * (q0_fin[name].argmax(1) == q1_fin[name].argmax(1)).mean())
    first_q = next((r for r in rows if r["verdict"] in ("quantization", "both")), None)
    first_b = next((r for r in rows if r["verdict"] in ("backend", "both")), None)
    fin_b = [k for k, v in finals.items() if v["backend"]["status"] == "fail"]
    fin_q = [k for k, v in finals.items() if v["quant"]["status"] == "fail"]
    lost_rows = [r for r in rows if r["quant"].get("n_channels_lost")]
    backend_name = f"ORT {runners.ORT_EPS.get(ep, ep)} at optimisation level {opt_level}" + (
        f" without {', '.join(disabled_optimizers)}" if disabled_optimizers else "")
    parts = []
    if first_b or fin_b:
        where = f"first at {first_b['node']} ({first_b['op_type']})" if first_b else \
            "in the final outputs only (a fused kernel)"
        bad = [r for r in rows if r["verdict"] in ("backend", "both")]
        worst = min(bad, key=lambda r: _severity(r["backend"]), default=None)
        if worst is not None and worst is not first_b:
            where += (f", worst at {worst['node']} ({worst['op_type']}, "
                      f"{_describe(worst['backend'])})")
        if fin_b:
            where += "; final output " + ", ".join(
                f"{k} {_describe(finals[k]['backend'])}" for k in fin_b)
        parts.append(f"backend error: {backend_name} does not reproduce the Q/DQ graph, {where}")
    if first_q or fin_q:
        where = f"first at {first_q['node']} ({first_q['op_type']})" if first_q else \
            "in the final outputs only"
        parts.append(f"quantization error beyond the {precision} tolerance, {where}")
    if lost_rows:
        r0 = lost_rows[0]
        parts.append(f"quantization loses {r0['quant']['n_channels_lost']} channel(s) of "
                     f"{r0['node']} ({r0['op_type']}) (per-channel cosine < 0.5: small channels "
                     "a shared scale leaves at zero; the tensor's cosine hides them)")
    result = {"a": str(fp32_onnx), "b": str(qdq_onnx), "backend": backend_name,
              "precision": precision, "tolerances": {"quantization": tol, "backend": BACKEND_TOL},
              "n_samples": int(len(next(iter(feed.values())))) if feed else 0,
              "layers": rows, "final_outputs": finals,
              "first_quant": first_q and {k: first_q[k] for k in ("index", "node", "op_type")},
              "first_backend": first_b and {k: first_b[k] for k in ("index", "node", "op_type")},
              "channels_lost": [{"node": r["node"], "channels": r["quant"]["channels_lost"]}
                                for r in lost_rows],
              "verdict": "; ".join(parts) or ("the backend reproduces the Q/DQ graph and the "
                                               "quantization error stays within tolerance"),
              "note": MARKING_NOTE, "wall_time_s": round(time.time() - t0, 3), "status": "ok"}
    if out_dir:
        out_dir = Path(out_dir)
        md = out_dir / "quant_backend.md"
        with common.atomic_path(md) as tmp:
            tmp.write_text(render_quant_backend(result))
        common.write_json(out_dir / "quant_backend.json", result)
        result["files"] = {"json": str(out_dir / "quant_backend.json"), "md": str(md)}
    return result


def render_quant_backend(result: dict, max_rows: int | None = None) -> str:
    """Markdown of :func:`quant_backend_table`: verdict, final outputs, then one row per layer
    with the quantization error (F vs Q0) beside the backend error (Q0 vs Q1)."""
    def lost(r):
        return f"; {r['n_channels_lost']} channel(s) lost" if r.get("n_channels_lost") else ""

    def steps(r):
        if r.get("steps_max") is not None:
            return f"{_fmt(r['steps_max'], '.3g')} / {_fmt(r.get('steps_mean'), '.2g')} steps"
        if r.get("rel_err") is not None:
            mean = (100 * r["mean_abs_err"] / r["ref_abs_max"]) if r.get("ref_abs_max") else None
            return (f"{_fmt(100 * r['rel_err'], '.3g')} / {_fmt(mean, '.2g')} % of range")
        return "-"

    tq = result["tolerances"]["quantization"]
    lines = [f"# Quantization error vs backend error: `{Path(result['b']).name}`", "",
             f"- quantization error: Q/DQ graph vs float graph, both ORT CPU with optimisations "
             f"off (fail if cosine_min < {tq['min_cosine']})",
             f"- backend error: {result['backend']} vs the same Q/DQ graph with optimisations off "
             f"(fail if cosine_min < {BACKEND_TOL['min_cosine']} or the mean error exceeds "
             f"{BACKEND_TOL['max_mean_steps']:g} quantization step, or "
             f"{100 * BACKEND_TOL['max_mean_rel_err']:g} % of the range of a tensor the graph "
             "does not quantize)",
             "- error: max / mean |error| in steps of the tensor's quantization scale; for a "
             "tensor the graph does not quantize, in % of the tensor's range",
             f"- samples: {result['n_samples']}", "", f"**Verdict:** {result['verdict']}.", "",
             "| final output | quant cosine_min | quant error | quant top-1 agree % | backend "
             "cosine_min | backend error | backend top-1 agree % |", "|---|---|---|---|---|---|---|"]
    for k, v in result["final_outputs"].items():
        lines.append(f"| `{k}` | {_fmt(v['quant'].get('cosine_min'))} | {steps(v['quant'])} | "
                     f"{_fmt(v['quant'].get('top1_agreement'), '.1f')} | "
                     f"{_fmt(v['backend'].get('cosine_min'))} | {steps(v['backend'])} | "
                     f"{_fmt(v['backend'].get('top1_agreement'), '.1f')} |")
    lines += ["", "| # | node | op | quant cosine_min | quant error | backend cosine_min "
              "| backend error | verdict |", "|---|---|---|---|---|---|---|---|"]
    rows = result["layers"] if max_rows is None else result["layers"][:max_rows]
    for r in rows:
        lines.append(f"| {r['index']} | `{r['node']}` | {r['op_type']} | "
                     f"{_fmt(r['quant'].get('cosine_min'))} | {steps(r['quant'])}{lost(r['quant'])}"
                     f" | {_fmt(r['backend'].get('cosine_min'))} | {steps(r['backend'])} | "
                     f"{r['verdict']} |")
    if len(rows) < len(result["layers"]):
        lines.append(f"| ... | {len(result['layers']) - len(rows)} more rows in quant_backend.json"
                     " | | | | | | |")
    return "\n".join(lines + ["", f"_{result['note']}_"]) + "\n"


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".6f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if not np.isfinite(v) else format(v, spec)
    return str(v)


def render_table(result: dict, max_rows: int | None = None) -> str:
    """Markdown: summary, first divergent layer, final outputs and the per-layer table."""
    tol = result.get("tolerances", {})
    lines = [f"# Layer-wise parity: {result['b'].get('backend')} {result.get('precision')} vs "
             f"{result['a'].get('backend')} (reference)",
             "", f"- A (reference): `{result['a']['onnx']}`", f"- B: `{result['b']['onnx']}`"
             + (f" (engine `{result['b']['engine']}`)" if result["b"].get("engine") else ""),
             f"- precision class: {result.get('precision')}; pass if cosine_min >= "
             f"{tol.get('min_cosine')} and max_abs_err <= {tol.get('atol')} + {tol.get('rtol')}"
             " * max|ref|", f"- samples: {result.get('n_samples')}"]
    if result.get("status") == "skipped":
        return "\n".join(lines + ["", f"**Skipped:** {result.get('reason')}", ""])
    fd = result.get("first_divergent")
    lines.append("")
    if fd:
        lines.append(f"**First divergent layer:** `{fd['node']}` ({fd['op_type']}, tensor "
                     f"`{fd['tensor']}`), cosine_min {_fmt(fd.get('cosine_min'))}, inputs agreed: "
                     f"{fd['inputs_agreed']}. {fd['verdict']}.")
        det = fd.get("detail") or {}
        if det.get("op_type_a") and det.get("op_type_a") != det.get("op_type_b"):
            lines.append(f"- op type differs: {det['op_type_a']} (A) vs {det['op_type_b']} (B)")
        for k, v in (det.get("weights_differ") or {}).items():
            lines.append(f"- weight `{k}` differs: {v}")
        for k, v in (det.get("attributes_differ") or {}).items():
            lines.append(f"- attribute `{k}`: {v[0]} (A) vs {v[1]} (B)")
        if result.get("origins") and len(result["origins"]) > 1:
            lines.append(f"- other layers whose inputs agreed but output failed: "
                         f"{', '.join('`%s`' % o for o in result['origins'][1:6])}"
                         + (" ..." if len(result["origins"]) > 6 else ""))
    else:
        lines.append("**No divergent layer:** every compared tensor is within tolerance.")
    for r in result.get("remedies", []):
        lines.append(f"- try: `{r}`")
    lines += ["", f"_{result.get('note', '')}_", "", "Final outputs (unmarked models):", "",
              "| output | cosine_min | max_abs_err | status |", "|---|---|---|---|"]
    for k, v in (result.get("final_outputs") or {}).items():
        lines.append(f"| `{k}` | {_fmt(v.get('cosine_min'))} | {_fmt(v.get('max_abs_err'), '.4g')}"
                     f" | {v.get('status')} |")
    lines += ["", "| # | node | op | cosine_min | max_abs_err | rel_err | inputs agreed | status |",
              "|---|---|---|---|---|---|---|---|"]
    rows = [r for r in result.get("layers", []) if not r.get("shape_only")]
    shown = rows if max_rows is None else rows[:max_rows]
    first_idx = fd["index"] if fd else None
    for r in shown:
        mark = " **<- first**" if r["index"] == first_idx else ""
        lines.append(f"| {r['index']} | `{r['node']}` | {r['op_type']} | {_fmt(r.get('cosine_min'))}"
                     f" | {_fmt(r.get('max_abs_err'), '.4g')} | {_fmt(r.get('rel_err'), '.3g')} | "
                     f"{r.get('inputs_agreed')} | {r['status']}{mark} |")
    if len(shown) < len(rows):
        lines.append(f"| ... | {len(rows) - len(shown)} more rows in layerwise.json | | | | | | |")
    n_shape = len(result.get("layers", [])) - len(rows)
    if n_shape:
        lines.append(f"\n{n_shape} shape-computation rows (Shape/Gather/Concat on shapes) are "
                     "left out here; they are in layerwise.json.")
    return "\n".join(lines) + "\n"


def plot_rows(result: dict) -> list[dict]:
    """The layer rows the plot draws: every compared layer (a NaN/Inf cosine included), shape
    arithmetic left out."""
    return [r for r in result.get("layers", []) if "cosine_min" in r and not r.get("shape_only")]


def plot_similarity(result: dict, path: Path | str, title: str | None = None) -> Path:
    """PNG of cosine similarity (top) and 1 - cosine (log, bottom) along the reference graph's
    topological order, with the tolerance line and the first divergent layer marked; layers
    whose output is NaN/Inf get a black cross at the bottom of both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plot_rows(result)
    x = np.arange(len(rows))  # compact: shape-arithmetic rows are not plotted
    cos = np.array([r["cosine_min"] if r["cosine_min"] is not None else np.nan for r in rows],
                   np.float64)
    bad = np.array([r["status"] == "fail" for r in rows], bool)
    # A layer whose output is NaN/Inf has no finite cosine; it is drawn as its own marker at
    # the bottom of each panel, so the first divergent layer always has a point.
    nonfin = ~np.isfinite(cos)
    tol = result["tolerances"]["min_cosine"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    finite = cos[~nonfin]
    lo1 = min(float(finite.min()) if finite.size else tol, tol)
    floor1 = lo1 - 0.05 * max(1.0 - lo1, 1e-6)
    gap = np.clip(1.0 - finite, 1e-12, None)
    floor2 = 10.0 ** np.ceil(np.log10(max(float(gap.max()) if gap.size else 1.0, 1 - tol)) + 1)
    for ax, y, floor in ((ax1, cos, floor1), (ax2, np.clip(1.0 - cos, 1e-12, None), floor2)):
        ax.plot(x[~nonfin], y[~nonfin], "-", color="0.6", lw=0.8)
        ok = ~bad & ~nonfin
        ax.scatter(x[ok], y[ok], s=10, color="tab:blue", label="pass")
        ax.scatter(x[bad & ~nonfin], y[bad & ~nonfin], s=14, color="tab:red", label="fail")
        if nonfin.any():
            ax.scatter(x[nonfin], np.full(int(nonfin.sum()), floor), s=40, marker="X",
                       color="black", label="NaN/Inf output", zorder=5)
        ax.grid(alpha=0.3)
    ax1.axhline(tol, color="tab:orange", ls="--", lw=1, label=f"min cosine {tol}")
    ax2.axhline(1 - tol, color="tab:orange", ls="--", lw=1)
    ax1.set_ylabel("cosine (min over samples)")
    ax2.set_ylabel("1 - cosine")
    ax2.set_yscale("log")
    ax2.set_xlabel("layer (reference graph, topological order; shape arithmetic omitted)")
    fd = result.get("first_divergent")
    pos = next((k for k, r in enumerate(rows) if fd and r["index"] == fd["index"]), None)
    if pos is not None:
        for ax in (ax1, ax2):
            ax.axvline(pos, color="tab:red", ls=":", lw=1)
        ax1.annotate(f"first divergent: {fd['node']}", (pos, 1.0), fontsize=8,
                     color="tab:red", xytext=(4, -12), textcoords="offset points")
    ax1.legend(fontsize=8, loc="lower left")
    ax1.set_title(title or f"{result['b']['backend']} ({Path(result['b']['onnx']).name}) vs "
                  f"{result['a']['backend']} ({Path(result['a']['onnx']).name})", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    with common.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def write_reports(result: dict, out_dir: Path | str, title: str | None = None) -> dict[str, Path]:
    """Write ``layerwise.json``, ``layerwise.md`` and (if there are rows) ``layerwise.png``
    atomically into ``out_dir``; the paths are also stored in ``result["files"]``."""
    out_dir = Path(out_dir)
    files = {"json": out_dir / "layerwise.json", "md": out_dir / "layerwise.md"}
    if result.get("layers"):
        files["png"] = plot_similarity(result, out_dir / "layerwise.png", title)
    result["files"] = {k: str(v) for k, v in files.items()}
    with common.atomic_path(files["md"]) as tmp:
        tmp.write_text(render_table(result))
    common.write_json(files["json"], result)
    return files


# --------------------------------------------------------------------------------------------
# PyTorch module vs ONNX node
# --------------------------------------------------------------------------------------------
def _unqualified(q: str) -> str:
    """The scope atom the legacy TorchScript exporter uses for module ``q`` (``layer1.0`` stays
    ``layer1.0``, ``layer1.0.conv1`` becomes ``conv1``), as in torch.onnx's
    ``_unqualified_variable_name``."""
    atoms = q.split(".")
    for i in range(len(atoms) - 1, -1, -1):
        if not atoms[i].isnumeric():
            return ".".join(atoms[i:])
    return q


def node_module_paths(node, scope_to_module: dict[str, str]) -> list[str]:
    """Module paths (outermost first) an exported node belongs to.

    Dynamo exporter: node metadata ``pkg.torch.onnx.name_scopes`` (``['', 'se1', 'se1.fc1',
    'conv2d_1']``). Legacy TorchScript exporter: the node name ``/se1/fc1/Conv`` (scope atoms,
    see :func:`_unqualified`), resolved through ``scope_to_module``.
    """
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                break
            return [s for s in scopes[1:-1] if s]
    name = node.name or ""
    if not name.startswith("/"):
        return []
    parts = name.split("/")[1:-1]
    paths = []
    for k in range(1, len(parts) + 1):
        q = scope_to_module.get("/" + "/".join(parts[:k]))
        if q is not None:
            paths.append(q)
    return paths


def torch_vs_onnx(model, onnx_path: Path | str, feed: dict[str, np.ndarray], *,
                  tolerances: dict[str, float] | None = None, ep: str = "cpu",
                  out_dir: Path | str | None = None) -> dict:
    """Compare each PyTorch module's output with the ONNX tensor of the same module path.

    The module of an ONNX node comes from the exporter (see :func:`node_module_paths`); the
    module's ONNX output is the one tensor its nodes hand to nodes outside the module. Modules
    without nodes of their own (BatchNorm folded into Conv, Dropout, Identity) pass their
    output to the module they follow, so ``conv`` is compared after its folded BN.

    Args:
        model: ``torch.nn.Module`` in eval mode (CPU), the one exported to ``onnx_path``.
        feed: ``{ONNX input name: array}``; passed positionally to ``model`` in this order.
        tolerances: FP32 overrides (defaults: :data:`TOLERANCES` ``fp32``).
    Returns:
        dict with ``modules`` (rows in topological order of the ONNX tensor: ``module``,
        ``tensor``, ``node``, metrics, ``status``; where the module's data input maps to one
        ONNX tensor also ``input_tensor``, ``input_node`` (its producer), ``inputs_agree`` and
        ``input_cosine_min``), ``first_divergent`` (row or None),
        ``unmapped`` (modules with an output but no single ONNX tensor), ``final_outputs``.
    """
    import torch

    tol = tolerances_for("fp32", tolerances)
    onnx_model = onnx_graph.load(onnx_path)
    feed, batch = feed_plan(feed, [onnx_model], None)  # a static batch is fed as it is
    named = dict(model.named_modules())
    scope_to_module = _legacy_scopes(model)

    nodes = list(onnx_model.graph.node)
    node_mods = [node_module_paths(n, scope_to_module) for n in nodes]
    owned: dict[str, list[int]] = {}
    for i, mods in enumerate(node_mods):
        for q in mods:
            owned.setdefault(q, []).append(i)

    # Forward hooks: outputs (cloned: in-place ReLU would overwrite them) and input identities.
    outs: dict[str, Any] = {}
    ins: dict[str, Any] = {}
    keep: list[Any] = []
    first_in: dict[str, int] = {}
    out_id: dict[str, int] = {}

    done: dict[str, int] = {}  # hook order: a successor must finish after its predecessor

    def hook(name):
        def fn(mod, inp, out):
            done.setdefault(name, len(done))
            if isinstance(out, torch.Tensor):
                keep.append(out)
                out_id[name] = id(out)
                outs[name] = out.detach().clone().float().numpy()
            if inp and isinstance(inp[0], torch.Tensor):
                keep.append(inp[0])  # keep it alive so its id() is not reused
                first_in[name] = id(inp[0])
                if inp[0].is_floating_point():
                    ins.setdefault(name, inp[0].detach().clone().float().numpy())
        return fn

    handles = [m.register_forward_hook(hook(q)) for q, m in named.items() if q]
    try:
        with torch.inference_mode():
            final = model(*[torch.from_numpy(np.ascontiguousarray(v)) for v in feed.values()])
    finally:
        for h in handles:
            h.remove()
    finals = final if isinstance(final, (tuple, list)) else [final]
    ort_out = _collect(ort_activations(onnx_model, feed, ep=ep, batch=batch))
    avail = {**feed, **ort_out}  # graph inputs too: a first module reads one

    consumers: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.input:
            consumers.setdefault(t, set()).add(i)
    graph_outputs = {o.name for o in onnx_model.graph.output}
    topo = {o: i for i, n in enumerate(nodes) for o in n.output}

    rows, unmapped = [], []
    for q in named:
        if not q or q not in outs or q not in owned:
            continue
        idx = set(owned[q])
        boundary = [o for i in sorted(idx) for o in nodes[i].output if o and (
            o in graph_outputs or consumers.get(o, set()) - idx)]
        # Follow node-less successors that an exporter folds into this module's nodes (a
        # BatchNorm folded into the Conv before it, Dropout, Identity). Other node-less
        # successors are not followed: dynamo attributes a Conv to the BatchNorm after it, so
        # the next block's conv_dw has no node of its own and is not part of this module.
        val, cur, seen = outs[q], q, 0
        while seen < 8:
            nxt = [m for m, src in first_in.items() if src == out_id.get(cur) and m not in owned
                   and m in outs and not list(named[m].children()) and m != cur
                   and _FOLDED_SUCCESSOR.search(type(named[m]).__name__)
                   # an in-place op (ReLU6(inplace=True)) returns the tensor object its
                   # predecessor read earlier: only modules that ran later follow it
                   and done.get(m, -1) > done.get(cur, -1)]
            if not nxt:
                break
            cur, val, seen = nxt[0], outs[nxt[0]], seen + 1
        cands = [o for o in boundary if o in ort_out and ort_out[o].shape == val.shape]
        if len(cands) != 1:
            unmapped.append({"module": q, "boundary": boundary[:4],
                             "reason": "no single ONNX tensor of the module's output shape"})
            continue
        st = TensorStat()
        st.update(val, ort_out[cands[0]], len(val) if val.ndim else 1)
        r = st.result(tol)
        row = {"module": q, "compared_as": cur, "type": type(named[q]).__name__,
               "tensor": cands[0], "node": nodes[topo[cands[0]]].name,
               "depth": q.count(".") + 1, "_topo": topo[cands[0]], **r}
        # The module's data input: the one tensor its nodes read from outside the module
        # (not a constant) with the shape PyTorch handed the module. If it already differs,
        # the error came from upstream (code between modules), not from this module.
        if q in ins:
            srcs = {t for i in idx for t in nodes[i].input if t and t in avail
                    and topo.get(t) not in idx and np.shape(avail[t]) == ins[q].shape}
            if len(srcs) == 1:
                t_in = srcs.pop()
                si = TensorStat()
                si.update(ins[q], avail[t_in], len(ins[q]) if ins[q].ndim else 1)
                ri = si.result(tol)
                row.update(input_tensor=t_in, inputs_agree=ri["status"] == "pass",
                           input_cosine_min=ri.get("cosine_min"),
                           input_node=nodes[topo[t_in]].name if t_in in topo else None)
        rows.append(row)
    rows.sort(key=lambda r: (r["_topo"], -r["depth"]))
    for i, r in enumerate(rows):
        r["index"] = i
        r.pop("_topo")
    out_names = [o.name for o in onnx_model.graph.output]
    t_final = {n: f.detach().float().numpy() for n, f in zip(out_names, finals)
               if isinstance(f, torch.Tensor)}
    fails = [r for r in rows if r["status"] == "fail"]
    result = {"onnx": str(onnx_path), "tolerances": tol, "modules": rows, "unmapped": unmapped,
              "first_divergent": fails[0] if fails else None,
              "final_outputs": compare_outputs(t_final, {k: v for k, v in ort_out.items()
                                                         if k in t_final}, tol),
              "status": "ok"}
    if out_dir:
        common.write_json(Path(out_dir) / "torch_vs_onnx.json", result)
    return result


_FOLDED_SUCCESSOR = re.compile(r"BatchNorm|Dropout|^Identity$")


def _legacy_scopes(model) -> dict[str, str]:
    """``{legacy scope string: module path}`` built from the module tree (ancestors only)."""
    out = {}

    def walk(mod, prefix: str, scope: str):
        for name, child in mod.named_children():
            q = f"{prefix}.{name}" if prefix else name
            s = f"{scope}/{_unqualified(q)}"
            out[s] = q
            walk(child, q, s)

    walk(model, "", "")
    return out


# --------------------------------------------------------------------------------------------
# Inputs for the CLI
# --------------------------------------------------------------------------------------------
def load_feed(npz: Path | str | None, model: str | None, n: int, onnx_path: Path | str,
              input_shapes: Sequence[str] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for a comparison: ``n`` samples (batch on axis 0), whatever batch the model runs
    at (see :func:`feed_plan` for how they are fed).

    Args:
        npz: ``.npz`` whose keys are the model's input names (arrays with batch on axis 0);
            all its samples are used (``n`` is ignored).
        model: ``--model`` name: for an image classifier the first ``n`` eval images,
            preprocessed and normalised as every stage does (:func:`common.load_split`,
            :func:`common.normalize`); a custom model gets random inputs.
        onnx_path: the reference model (input names, and random inputs when neither is given).
        input_shapes: ``--input-shape`` values for random inputs (:func:`common.parse_input_shapes`);
            their first dimension is the batch per run (:func:`input_shape_batch`), not the
            number of samples.
    Raises:
        UsageError: the npz keys do not match the model's inputs, or an image classifier's
            ONNX has several inputs.
    """
    m = onnx_graph.load(onnx_path)
    ins = onnx_graph.inputs(m)
    names = [name for name, _, _ in ins]
    if npz:
        path = common.require(Path(npz), "a previous stage (or np.savez) writing the inputs")
        with np.load(path) as z:
            feed = {k: z[k] for k in z.files}
        missing = [k for k in names if k not in feed]
        if missing:
            if len(names) == 1 and len(feed) == 1:
                return {names[0]: next(iter(feed.values()))}
            raise UsageError(f"--inputs {npz}: keys {sorted(feed)} lack model inputs {missing}")
        return {k: feed[k] for k in names}
    spec = common.model_spec(model) if model else None
    if spec is not None and spec.classifier:  # a custom model gets random inputs (below)
        if len(names) != 1:
            raise UsageError(f"--model {model} feeds eval images to an image classifier with one "
                             f"input; this model has inputs {names}: use --inputs feed.npz or "
                             "--input-shape")
        x, _, _ = common.load_split("eval", spec, limit=n)
        return {names[0]: common.normalize(x, spec.mean, spec.std)}
    shapes = common.parse_input_shapes(input_shapes)
    if not shapes:
        for name, dims, dt in ins:
            dims = [d if d is not None else (1 if k == 0 else None) for k, d in enumerate(dims)]
            if any(d is None for d in dims):
                raise UsageError(f"input {name} has dynamic non-batch axes: pass --input-shape "
                                 "or --inputs")
            shapes.append((name, tuple(dims), str(dt)))
    spec = common.ModelSpec("custom", "custom", classifier=False)
    return common.example_inputs(spec, shapes, batch=n, seed=seed)


def input_shape_batch(input_shapes: Sequence[str] | None) -> int | None:
    """The batch written in ``--input-shape`` values (their first dimension; None without any).

    Raises:
        UsageError: the values disagree on the batch.
    """
    batches = {shape[0] for _, shape, _ in common.parse_input_shapes(input_shapes) if shape}
    if len(batches) > 1:
        raise UsageError(f"--input-shape values disagree on the batch (first dimension): "
                         f"{sorted(batches)}")
    return batches.pop() if batches else None


def feed_plan(feed: dict[str, np.ndarray], models: Sequence[Any], requested: int | None
              ) -> tuple[dict[str, np.ndarray], int | None]:
    """How to feed ``feed`` to every model of ``models`` (ONNX paths or ModelProtos): the batch
    rule of the evaluation path (:func:`evaluate.batch_plan`: a model whose inputs have a static
    batch is fed exactly that many samples per run, one at a time for a batch-1 export; a dynamic
    batch takes ``requested``, None = all at once). Unlike evaluation, which pads a last short
    run, a layer-wise comparison leaves those samples out (said on stderr): padded copies would
    count as samples.

    Returns:
        ``(feed, batch per run or None for all at once)``.
    Raises:
        UsageError: the models have different static batches, or fewer samples than one run.
    """
    import evaluate

    statics = {onnx_graph.static_batch(onnx_graph.load(m) if isinstance(m, (str, Path)) else m)
               for m in models} - {None}
    if len(statics) > 1:
        raise UsageError(f"the models have different static batch sizes {sorted(statics)}: no "
                         "batch fits both; re-export one of them with a dynamic batch axis")
    n = len(next(iter(feed.values()))) if feed else 0
    if not statics:
        return feed, requested
    static = statics.pop()
    batch, _ = evaluate.batch_plan(n, requested or n, (static, static))
    keep = n - n % batch
    if keep == 0:
        raise UsageError(f"the model takes exactly {batch} samples per run; only {n} given")
    if keep < n:
        print(f"note: static batch {batch}: the last {n - keep} of {n} samples are not fed",
              file=sys.stderr)
    return {k: v[:keep] for k, v in feed.items()}, batch


def match_inputs(a_onnx: Path | str, b_onnx: Path | str, feed: dict[str, np.ndarray],
                 mapping: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Make one ``feed`` (keyed by A's input names) usable by B when B names its inputs
    differently.

    Args:
        mapping: ``B_NAME=A_NAME`` strings (``diff --map-input``); B's input ``B_NAME`` gets the
            array fed to A's ``A_NAME``.
    Returns:
        ``feed`` plus one entry per mapped B input (the same arrays).
    Raises:
        UsageError: a B input is neither in ``feed`` nor mapped (the message lists both
            models' input names and the ``--map-input`` that maps them), or a bad mapping.
    """
    a_names = [n for n, _, _ in onnx_graph.inputs(onnx_graph.load(a_onnx, external=False))]
    b_names = [n for n, _, _ in onnx_graph.inputs(onnx_graph.load(b_onnx, external=False))]
    out = dict(feed)
    for m in mapping or []:
        b, sep, a = m.partition("=")
        if not sep or b not in b_names or a not in feed:
            raise UsageError(f"--map-input {m!r}: expected B_NAME=A_NAME with B_NAME one of "
                             f"{b_names} ({b_onnx}) and A_NAME one of {sorted(feed)}")
        out[b] = feed[a]
    unmatched = [n for n in b_names if n not in out]
    if unmatched:
        left = [n for n in a_names if n not in b_names]
        hint = " ".join(f"--map-input {b}={a}" for b, a in zip(unmatched, left)) or \
            "--map-input B_NAME=A_NAME"
        raise UsageError(f"the two files name their inputs differently: {a_onnx} has {a_names}, "
                         f"{b_onnx} has {b_names}; say which A input feeds each B input: {hint}")
    return out


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="layerwise.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_inputs(sp):
        sp.add_argument("--inputs", type=Path, help=".npz of inputs (keys = input names)")
        sp.add_argument("--model", help="take --n eval images of this model (splits.json)")
        sp.add_argument("--n", type=int, default=8, help="samples (default 8)")
        sp.add_argument("--input-shape", action="append", help="name:d0,d1,...[:dtype] for "
                        "random inputs (non-image models)")
        sp.add_argument("--out-dir", type=Path, help="write JSON/Markdown/PNG here")

    d = sub.add_parser("diff", help="layer-wise comparison of two ONNX runs (or TensorRT)")
    d.add_argument("a", type=Path, help="reference ONNX (FP32, ORT)")
    d.add_argument("b", type=Path, help="candidate ONNX (FP16, Q/DQ, same file on another EP, "
                   "or the ONNX of --engine-b)")
    d.add_argument("--ep-a", default="cpu", choices=sorted(set(runners.ORT_EPS)))
    d.add_argument("--ep-b", default="cpu", choices=sorted(set(runners.ORT_EPS)))
    d.add_argument("--engine-b", type=Path, help="TensorRT plan built from B: compare through "
                   "TensorRT (skipped cleanly without tensorrt)")
    d.add_argument("--trt", action="store_true", help="side B through TensorRT (marked build)")
    d.add_argument("--trt-fp16", action="store_true", help="build flag for the marked engine")
    d.add_argument("--trt-int8", action="store_true", help="build flag for the marked engine")
    d.add_argument("--precision", choices=sorted(TOLERANCES), help="tolerance class (default: "
                   "detected from B)")
    d.add_argument("--atol", type=float)
    d.add_argument("--rtol", type=float)
    d.add_argument("--min-cosine", type=float)
    d.add_argument("--batch", type=int, default=None,
                   help="samples per run (memory; default 8, or the batch of --input-shape; "
                        "0 = all); a model with a static batch is fed exactly that many")
    d.add_argument("--opt-level", default="all", choices=["disable", "basic", "extended", "all"])
    d.add_argument("--max-rows", type=int, default=60, help="rows printed (all are in the JSON)")
    d.add_argument("--fail-on-divergence", action="store_true", help="exit 1 on a divergence")
    d.add_argument("--map-input", action="append", metavar="B_NAME=A_NAME",
                   help="B's input B_NAME takes A's input A_NAME (files whose input names "
                        "differ; repeatable)")
    add_inputs(d)

    qb = sub.add_parser("quant-backend", help="per layer: quantization error (float vs Q/DQ "
                        "graph, both unoptimised) beside backend error (Q/DQ graph optimised vs "
                        "not)")
    qb.add_argument("a", type=Path, help="float ONNX the Q/DQ model was made from")
    qb.add_argument("b", type=Path, help="Q/DQ ONNX")
    qb.add_argument("--ep", default="cpu", choices=sorted(set(runners.ORT_EPS)),
                    help="EP of the backend run (default cpu)")
    qb.add_argument("--opt-level", default="all", choices=["basic", "extended", "all"],
                    help="ORT optimisation level of the backend run (default all)")
    qb.add_argument("--disable-optimizer", action="append", default=[],
                    help="ORT optimizer to disable in the backend run (repeatable)")
    qb.add_argument("--batch", type=int, default=8, help="samples per run (memory); 0 = all")
    qb.add_argument("--max-rows", type=int, default=60, help="rows printed (all are in the JSON)")
    add_inputs(qb)

    t = sub.add_parser("torch-vs-onnx", help="PyTorch modules vs the exported ONNX nodes")
    t.add_argument("--onnx", type=Path, required=True)
    t.add_argument("--weights", type=Path, help="state dict (default: the model's weights)")
    add_inputs(t)
    t.set_defaults(n=2)

    e = sub.add_parser("export-check", help="export checks of an exported ONNX against its "
                       "PyTorch model (same as: python export_checks.py check)")
    e.add_argument("--onnx", type=Path, required=True)
    e.add_argument("--weights", type=Path)
    e.add_argument("--batches", default=None, help="batch sizes to compare (default: 1 and "
                   "--n; a static batch is used as it is)")
    e.add_argument("--min-cosine", type=float, default=0.99999,
                   help="lowest cosine similarity per sample against PyTorch (default 0.99999)")
    add_inputs(e)
    e.set_defaults(n=4)
    return p


def main(args) -> dict:
    if args.cmd == "diff":
        if args.inputs and args.model:
            raise UsageError("give --inputs or --model, not both")
        feed = load_feed(args.inputs, args.model, args.n, args.a, args.input_shape)
        feed = match_inputs(args.a, args.b, feed, args.map_input)
        batch = args.batch if args.batch is not None else (input_shape_batch(args.input_shape)
                                                           or 8)
        feed, batch = feed_plan(feed, [args.a, args.b], batch or None)
        res = run_layer_diff(
            args.a, args.b, feed, ep_a=args.ep_a, ep_b=args.ep_b, b_engine=args.engine_b,
            b_trt=args.trt, trt_build={"fp16": args.trt_fp16 or None, "int8": args.trt_int8 or None},
            tolerances={"atol": args.atol, "rtol": args.rtol, "min_cosine": args.min_cosine},
            precision=args.precision, batch=batch, opt_level=args.opt_level,
            out_dir=args.out_dir)
        print(render_table(res, max_rows=args.max_rows))
        if res.get("status") == "skipped":
            print(f"SKIPPED: {res['reason']}", file=sys.stderr)
        if args.out_dir:
            print(f"wrote {', '.join(res.get('files', {}).values())}")
        if args.fail_on_divergence and res.get("first_divergent"):
            raise StageError(res["verdict"])
        return res
    if args.cmd == "export-check":  # the checks live in export_checks.py
        import export_checks

        if args.out_dir:
            args.json = args.out_dir / "export_check.json"
        else:
            args.json = None
        args.cmd = "check"
        return export_checks.main(args)
    if args.cmd == "quant-backend":
        if args.inputs and args.model:
            raise UsageError("give --inputs or --model, not both")
        feed = load_feed(args.inputs, args.model, args.n, args.a, args.input_shape)
        res = quant_backend_table(args.a, args.b, feed, ep=args.ep, opt_level=args.opt_level,
                                  disabled_optimizers=args.disable_optimizer,
                                  batch=args.batch or None, out_dir=args.out_dir)
        print(render_quant_backend(res, max_rows=args.max_rows))
        return res
    if not args.model:
        raise UsageError(f"{args.cmd} needs --model NAME (the PyTorch model that was exported)")
    model, spec = common.build_model(args.model, args.weights)
    if args.inputs or args.input_shape or not spec.classifier:
        feed = load_feed(args.inputs, None, args.n, args.onnx, args.input_shape)
    else:
        feed = {onnx_graph.load(args.onnx).graph.input[0].name: common.example_inputs(
            spec, None, batch=args.n)["input"]}
    res = torch_vs_onnx(model, args.onnx, feed, out_dir=args.out_dir)
    for r in res["modules"]:
        print(f"{r['index']:4d} {r['module']:40s} {r['node']:40s} "
              f"cos {r.get('cosine_min', float('nan')):.6f} {r['status']}")
    fd = res["first_divergent"]
    if fd and fd.get("inputs_agree") is False:
        print(f"first divergent module: {fd['module']} ({fd['node']}), but its input "
              f"{fd['input_tensor']} (from node {fd['input_node']}) already differs: the error "
              "is upstream, in code between modules")
    else:
        print(f"first divergent module: {fd['module']} ({fd['node']})" if fd else
              "every mapped module matches its ONNX tensor")
    return res


if __name__ == "__main__":
    common.cli(get_args_parser, main)
