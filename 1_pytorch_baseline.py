#!/usr/bin/env python3
"""Stage 1: PyTorch FP32 baseline: top-1/top-5 on the eval split, batch-1 latency, and the
reference logits every later stage compares against.

Reads:  ``artifacts/splits.json`` + cache (0_prepare_data.py); model weights.
Writes: ``artifacts/<model>/ref_logits.npz`` (``logits`` float32 [N,1000], ``y``, ``files``),
        or for a custom model ``ref_outputs.npz`` (inputs ``in:<name>``, outputs ``out:<name>``);
        ``results/<model>/pytorch_fp32_<device>.json``.
Rerun:  ``python 1_pytorch_baseline.py --model efficientnet_lite0 [--device cuda]``

Latency: batch 1 (``--latency-batch``), ``--warmup`` untimed runs, then ``--iters`` timed runs;
on CUDA each run is timed with CUDA events (GPU time) and wall-clock with a device sync before
each timestamp; on the CPU wall-clock only. Preprocessing is outside the timed region.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

import common


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__)
    common.add_shared_args(p, "model", "weights", "random_init", "input_shape")
    p.add_argument("--device", default=os.environ.get("TORCH_DEVICE", "cpu"),
                   help="cpu or cuda[:i] (default from $TORCH_DEVICE)")
    common.add_shared_args(p, "batch_size", "limit", "latency_batch", "warmup", "iters",
                           "threads")
    p.add_argument("--no-save-reference", action="store_true",
                   help="do not (over)write the reference logits (e.g. a CUDA latency run)")
    return p


def measure_latency(runner: common.TorchRunner, feed: dict, warmup: int, iters: int,
                    batch: int) -> dict:
    """Batch latency of ``runner`` on ``feed``.

    Returns:
        ``{"wall": latency_stats, "gpu": latency_stats or None, "timer": ...}``; ``gpu`` is the
        CUDA-event time of the forward pass (CUDA only). Units: ms.
    """
    import torch

    model, dev = runner.model, runner.device
    args = [torch.from_numpy(v).to(dev) for v in feed.values()]

    def fwd():
        with torch.inference_mode():
            model(*args)

    wall = common.time_callable(fwd, warmup, iters, runner.sync if dev.type == "cuda" else None)
    out = {"wall": common.latency_stats(wall, batch), "gpu": None,
           "timer": "time.perf_counter" + (" + cuda sync" if dev.type == "cuda" else "")}
    if dev.type == "cuda":
        gpu = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fwd()
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        out["gpu"] = common.latency_stats(gpu, batch)
        out["timer"] += "; gpu: torch.cuda.Event"
    return out


def main(args: argparse.Namespace) -> dict:
    started = time.time()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise common.StageError(f"--device {args.device}: torch {torch.__version__} sees no CUDA "
                                "GPU; use --device cpu")
    model, spec = common.build_model(args.model, args.weights, pretrained=not args.random_init)
    shapes = common.parse_input_shapes(args.input_shape)
    art = common.model_artifacts(args.model)
    inputs = []
    dev_tag = "cuda" if args.device.startswith("cuda") else "cpu"
    record = common.result_record("1_pytorch_baseline", "PyTorch", "FP32", args.model,
                                  f"pytorch_fp32_{dev_tag}", device=args.device,
                                  weights="random-init" if args.random_init else
                                  (args.weights or "default"),
                                  preprocessing=spec.preprocessing() | {"mean": spec.mean,
                                                                         "std": spec.std})
    with common.TorchRunner(model, args.device) as runner:
        if spec.classifier:
            x, y, files = common.load_split("eval", spec, args.limit)
            logits = common.run_batched(runner, x, spec, "input", args.batch_size)
            acc = common.topk_accuracy(logits, y)
            record.update(n_images=len(y), accuracy=acc)
            if not args.no_save_reference:
                ref = art / "ref_logits.npz"
                with common.atomic_path(ref) as tmp:
                    np.savez(tmp, logits=logits, y=y, files=np.array(files))
                record["reference"] = str(ref)
            feed = {"input": common.normalize(x[:args.latency_batch], spec.mean, spec.std)}
            inputs.append(common.splits_path())
            summary = f"top-1 {acc['top1']:.2f}% top-5 {acc['top5']:.2f}% on {len(y)} images"
        else:
            if not shapes:
                raise common.UsageError(f"--model {args.model}: give --input-shape for a custom "
                                        "model (e.g. --input-shape x:1,3,224,224)")
            feed_ref = common.example_inputs(spec, shapes, batch=4, seed=0)
            try:
                outs = runner.infer(feed_ref)
            except (TypeError, RuntimeError) as e:
                raise common.UsageError(
                    f"--model {args.model} does not run on --input-shape "
                    f"{[f'{n}:{s}' for n, s, _ in shapes]}: {str(e).splitlines()[0]}; give one "
                    "--input-shape per forward() argument, in order, with the right shapes") from e
            record.update(accuracy=None, reason_accuracy="not an ImageNet classifier",
                          outputs={k: list(v.shape) for k, v in outs.items()})
            if not args.no_save_reference:
                ref = art / "ref_outputs.npz"
                with common.atomic_path(ref) as tmp:
                    np.savez(tmp, **{f"in:{k}": v for k, v in feed_ref.items()},
                             **{f"out:{k}": v for k, v in outs.items()})
                record["reference"] = str(ref)
            feed = common.example_inputs(spec, shapes, batch=args.latency_batch, seed=1)
            summary = f"outputs {record['outputs']} (accuracy does not apply)"
        lat = measure_latency(runner, feed, args.warmup, args.iters, args.latency_batch)
    record["latency"] = lat["gpu"] or lat["wall"]
    record["latency_wall"] = lat["wall"]
    record["latency_timer"] = lat["timer"]
    record["harness_overhead_ms"] = common.null_backend_ms()
    record["size_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    record["provenance"] = common.provenance(args, inputs, started, args.device)
    path = common.write_result(args.model, record["tag"], record)
    print(f"PyTorch FP32 {args.model} on {args.device}: {summary}; batch-{args.latency_batch} "
          f"p50 {record['latency']['p50_ms']:.3f} ms -> {path}")
    return record


if __name__ == "__main__":
    common.cli(get_args_parser, main)
