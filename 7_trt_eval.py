"""Stage 7: evaluate one TensorRT engine: accuracy, GPU compute latency, parity, layer formats.

Reads  artifacts/<model>/engines/<variant>.plan (6_build_engines.sh), its <variant>.build.log
       (trtexec's own GPU Compute Time, for a cross-check), artifacts/<model>/ref_logits.npz
       (reference logits) and the eval split (0_prepare_data.py).
Writes results/<model>/<tag>.json (backend "TensorRT").

Without the TensorRT Python package or without a CUDA GPU it prints why, writes a row with
``status: skipped`` and exits 0.

Rerun alone:
    python 7_trt_eval.py --engine artifacts/mobilenet_v3_small/engines/fp16.plan --tag trt_fp16

Runtime: the tensor-name API (``get_tensor_name``, ``set_input_shape``, ``set_tensor_address``,
``execute_async_v3``; TensorRT 8.5+), device buffers are torch CUDA tensors (no pycuda).
Latency is GPU compute time of ``execute_async_v3`` alone, measured with CUDA events on the
inference stream after a warm-up, inputs already on the device (so it is comparable with
trtexec's "GPU Compute Time"); preprocessing and copies are outside the timed region.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import common
import trt_parsers
import trt_tools
from common import StageError, UsageError

STAGE = "7_trt_eval"
REF_PRODUCER = "1_pytorch_baseline.py"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="7_trt_eval.py", description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, type=Path, help="TensorRT plan file")
    p.add_argument("--tag", required=True, help="results row id (results/<model>/<tag>.json)")
    p.add_argument("--model", default=os.environ.get("MODEL", "mobilenet_v3_small"))
    p.add_argument("--precision", default=None,
                   help="label for the row (default: from the variant of the engine file name)")
    p.add_argument("--batch", type=int, default=64, help="batch for the accuracy pass "
                   "(capped at the engine's max batch)")
    p.add_argument("--latency-batch", type=int, default=1,
                   help="batch for the latency/throughput measurement (default 1)")
    p.add_argument("--warmup", type=int, default=50, help="untimed iterations before timing")
    p.add_argument("--iters", type=int, default=500, help="timed iterations")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N images only")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--layerwise", action="store_true",
                   help="also compare every layer of the engine with ORT CPU FP32 "
                        "(layerwise.py; marking outputs changes TensorRT's fusion)")
    p.add_argument("--layerwise-images", type=int, default=8)
    p.add_argument("--onnx", type=Path, default=None,
                   help="ONNX the engine was built from (default: artifacts/<model>/onnx/"
                        "<variant>.onnx), for --layerwise")
    return p


def _precision(args) -> str:
    if args.precision:
        return args.precision
    v = trt_tools.variant_for_engine(args.engine)
    return v.precision if v else "unknown"


def _base_record(args, status: str, reason: str | None, started: float, **fields) -> dict:
    v = trt_tools.variant_for_engine(args.engine)
    rec = common.result_record(STAGE, "TensorRT", _precision(args), args.model, args.tag,
                               status=status, reason=reason, engine=args.engine,
                               variant=v.name if v else None, device="cuda", **fields)
    return rec


def _skip(args, reason: str, started: float) -> None:
    print(f"{STAGE}: SKIPPED {args.tag}: {reason}")
    rec = _base_record(args, "skipped", reason, started)
    rec["provenance"] = common.provenance(args, [], started)
    print(f"  wrote {common.write_result(args.model, args.tag, rec)}")


class TrtRunner:
    """TensorRT engine runner: ``infer(feed) -> {output name: array}``, context manager.

    Args:
        plan: serialized engine.
        device: CUDA device index.
    Attributes:
        inputs / outputs: I/O tensor names; ``profile``: ``{input: (min, opt, max) shapes}``;
        ``version``: ``tensorrt.__version__``; ``device``: GPU name.
    Raises:
        StageError: the runtime refuses the plan (message names the two versions when the
        runtime logged a version mismatch, and says to rebuild with 6_build_engines.sh).
    """

    def __init__(self, plan: Path, device: int = 0):
        import tensorrt as trt
        import torch

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
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan).read_bytes())
        if self.engine is None:
            log = "\n".join(self.logger.messages)
            mm = trt_parsers.parse_version_mismatch(log)
            hint = (f"version mismatch ({mm['kind']}): expected {mm['expected']}, got "
                    f"{mm['got']}" if mm else log.strip()[-500:])
            raise StageError(f"TensorRT {trt.__version__} cannot load {plan}: {hint}; rebuild it "
                             "with 6_build_engines.sh using the trtexec of this TensorRT version")
        self.context = self.engine.create_execution_context()
        self.version = trt.__version__
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.profile = {n: tuple(tuple(s) for s in self.engine.get_tensor_profile_shape(n, 0))
                        for n in self.inputs}
        self.dtypes = {n: self._torch_dtype(self.engine.get_tensor_dtype(n)) for n in names}
        self.stream = torch.cuda.Stream(self.dev)
        self.device = torch.cuda.get_device_name(self.dev)
        self._bufs: dict[str, object] = {}

    def _torch_dtype(self, dt):
        t = self.torch
        return {np.dtype(np.float32): t.float32, np.dtype(np.float16): t.float16,
                np.dtype(np.int8): t.int8, np.dtype(np.int32): t.int32,
                np.dtype(np.int64): t.int64, np.dtype(np.bool_): t.bool,
                np.dtype(np.uint8): t.uint8}[np.dtype(self.trt.nptype(dt))]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._bufs.clear()
        return False

    def max_batch(self) -> int:
        """Largest batch of the first optimisation profile."""
        return int(self.profile[self.inputs[0]][2][0])

    def bind(self, feed: dict[str, np.ndarray]) -> None:
        """Copy ``feed`` to device buffers, set shapes, allocate outputs, set all addresses."""
        torch = self.torch
        for name in self.inputs:
            x = torch.from_numpy(np.ascontiguousarray(feed[name])).to(self.dev, self.dtypes[name])
            self._bufs[name] = x
            self.context.set_input_shape(name, tuple(x.shape))
            self.context.set_tensor_address(name, x.data_ptr())
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            y = torch.empty(shape, dtype=self.dtypes[name], device=self.dev)
            self._bufs[name] = y
            self.context.set_tensor_address(name, y.data_ptr())

    def execute(self) -> None:
        """Enqueue one inference on the runner's stream (no synchronisation)."""
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise StageError("execute_async_v3 returned False (see the [TRT] messages above)")

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.bind(feed)
        self.execute()
        self.stream.synchronize()
        return {n: self._bufs[n].float().cpu().numpy() if self._bufs[n].is_floating_point()
                else self._bufs[n].cpu().numpy() for n in self.outputs}

    def time_gpu(self, warmup: int, iters: int) -> list[float]:
        """GPU time (ms) of each of ``iters`` executions, CUDA events on the runner's stream,
        after ``warmup`` untimed ones; inputs/outputs bound beforehand (:meth:`bind`)."""
        torch = self.torch
        for _ in range(warmup):
            self.execute()
        self.stream.synchronize()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            start.record(self.stream)
            self.execute()
            end.record(self.stream)
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        return times

    def layer_info(self) -> dict:
        """Engine inspector JSON summarised by :func:`trt_parsers.parse_layer_info`."""
        insp = self.engine.create_engine_inspector()
        insp.execution_context = self.context
        return trt_parsers.parse_layer_info(
            insp.get_engine_information(self.trt.LayerInformationFormat.JSON))


def main(args) -> None:
    started = time.time()
    if args.iters < 1 or args.warmup < 0 or args.batch < 1 or args.latency_batch < 1:
        raise UsageError("--iters, --batch and --latency-batch must be >= 1, --warmup >= 0")
    try:
        import tensorrt as trt  # noqa: F401 - availability check
    except ImportError as e:
        _skip(args, f"TensorRT Python package not importable ({e}); TensorRT is not installed "
              "on this machine", started)
        return
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        _skip(args, "no CUDA GPU visible to torch (TensorRT needs one)", started)
        return

    spec = common.model_spec(args.model)
    variant = trt_tools.variant_for_engine(args.engine)
    build_row = common.model_results(args.model) / f"trt_build_{variant.name}.json" if variant \
        else None
    if not Path(args.engine).exists() and build_row is not None and build_row.exists():
        # Stage 6 ran and did not produce this engine on purpose (e.g. INT4 on TensorRT 8.x,
        # the int4_cli_broken reproduction): report that instead of failing the pipeline.
        row = json.loads(build_row.read_text())
        if row.get("status") != "ok":
            _skip(args, f"engine not built by 6_build_engines.sh ({row.get('status')}: "
                  f"{row.get('reason')})", started)
            return
    common.require(args.engine, "6_build_engines.sh")
    ref_path = common.model_artifacts(args.model) / "ref_logits.npz"
    common.require(ref_path, REF_PRODUCER)
    x_u8, y, files = common.load_split("eval", spec, args.limit)

    with TrtRunner(args.engine, args.device) as r:
        in_name = r.inputs[0]
        bmin, bmax = r.profile[in_name][0][0], r.max_batch()
        batch = max(bmin, min(args.batch, bmax))
        if not (bmin <= args.latency_batch <= bmax):
            raise UsageError(f"--latency-batch {args.latency_batch}: engine accepts batch "
                             f"{bmin}..{bmax} (rebuild with 6_build_engines.sh --max-batch N)")
        # Accuracy pass (normalisation per batch, outside any timed region).
        logits = common.run_batched(r, x_u8, spec, in_name, batch)
        acc = common.topk_accuracy(logits, y) if spec.classifier else None
        ref, mask = common.align_reference(ref_path, files)
        par = common.parity(ref, logits[mask]) if ref is not None else None
        par_n = int(mask.sum())

        # Latency: batch 1 always (compared with trtexec), plus --latency-batch if different.
        lat = {}
        for b in dict.fromkeys((1, args.latency_batch)):
            if not (bmin <= b <= bmax):
                continue
            idx = np.arange(b) % len(x_u8)
            r.bind({in_name: common.normalize(x_u8[idx], spec.mean, spec.std)})
            lat[f"batch{b}"] = common.latency_stats(r.time_gpu(args.warmup, args.iters), batch=b)
        layers = r.layer_info()
        runtime = {"tensorrt": r.version, "device": r.device, "inputs": r.inputs,
                   "outputs": r.outputs, "profile": {k: [list(s) for s in v]
                                                     for k, v in r.profile.items()}}

    # trtexec's own GPU Compute Time from the build log (same engine, trtexec's timing loop).
    cross = None
    if variant is not None:
        log = trt_tools.engine_paths(args.model, variant.name)["log"]
        if log.exists():
            text = log.read_text(errors="replace")
            perf = trt_parsers.parse_performance_summary(text)
            shapes = trt_parsers.parse_inference_shapes(text)["inputs"]
            gct = perf.get("gpu_compute_time") if perf else None
            tb = shapes.get(in_name, [None])[0]
            ours = lat.get(f"batch{tb}") if tb else None
            cross = {"build_log": log, "trtexec_batch": tb, "trtexec_gpu_compute_time": gct,
                     "trtexec_throughput_qps": perf.get("throughput_qps") if perf else None,
                     "ratio_p50_to_trtexec_median": (ours["p50_ms"] / gct["median_ms"]
                                                     if ours and gct and gct.get("median_ms")
                                                     else None)}
    rec = _base_record(
        args, "ok", None, started, n_images=int(len(y)), batch=batch,
        input_size=spec.crop, resize=spec.resize, interpolation=spec.interpolation,
        accuracy=acc, latency=lat.get("batch1"),
        latency_batch=lat.get(f"batch{args.latency_batch}"),
        latency_kind="GPU compute time (CUDA events around execute_async_v3, warm-up "
                     f"{args.warmup}, {args.iters} iterations)",
        parity=par, parity_n=par_n, parity_reference=ref_path,
        size_mb=common.file_size_mb(args.engine), ep_requested="TensorRT",
        ep_used=f"TensorRT {runtime['tensorrt']} on {runtime['device']}", runtime=runtime,
        layer_info=trt_parsers.layer_summary(layers),
        layer_dtypes=trt_parsers.layer_dtype_table(layers),
        trtexec_cross_check=cross, null_backend_ms=common.null_backend_ms())
    rec["provenance"] = common.provenance(args, [args.engine, ref_path], started,
                                          torch_device=f"cuda:{args.device}")
    path = common.write_result(args.model, args.tag, rec)
    top1 = f"top1 {acc['top1']:.2f}%" if acc else "no accuracy (not a classifier)"
    p50 = lat.get("batch1", {}).get("p50_ms")
    print(f"{STAGE}: {args.tag}: {top1}, p50 {p50} ms (batch 1), reformat layers "
          f"{layers['reformat_layers']} -> {path}")
    if args.layerwise:
        layerwise_engine(args, variant)


def layerwise_engine(args, variant) -> dict:
    """Layer-wise comparison of the engine's ONNX through TensorRT against ORT CPU FP32.

    Writes ``results/<model>/layerwise_<tag>/layerwise.{json,md,png}`` and prints the first
    divergent layer with the rebuild commands that exist in the installed TensorRT.
    """
    import layerwise

    art = common.model_artifacts(args.model)
    ref_onnx = common.require(art / "onnx" / "fp32.onnx", "2_export_onnx.py")
    onnx_b = args.onnx or (art / "onnx" / f"{variant.name}.onnx" if variant else None)
    if onnx_b is None:
        raise UsageError("--layerwise: give --onnx (cannot tell the engine's ONNX from its name)")
    common.require(onnx_b, "the stage that wrote the engine's ONNX")
    feed = layerwise.load_feed(None, args.model, args.layerwise_images, ref_onnx)
    prec = _precision(args).lower()
    res = layerwise.run_layer_diff(
        ref_onnx, onnx_b, feed, b_engine=args.engine, precision=prec,
        trt_build={"fp16": prec == "fp16", "int8": prec.startswith("int8")},
        out_dir=common.model_results(args.model) / f"layerwise_{args.tag}")
    print(layerwise.render_table(res, max_rows=40))
    return res


if __name__ == "__main__":
    common.cli(get_args_parser, main)
