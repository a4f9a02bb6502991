#!/usr/bin/env python3
"""Harness fidelity: does the pipeline's batch-1 latency match an independent plain loop over the
same session/module, and what does the harness itself cost?

For each backend available here (ORT CPU EP on an ONNX file, PyTorch CPU, and PyTorch CUDA / ORT
CUDA EP when a GPU is present) it times the same work two ways, interleaved in rounds so that a
drifting machine affects both alike:

- ours: ``runner.time(feed, warmup, iters)`` (deploykit.runners, what stages 1/3/7 record);
- plain: ``timeit.repeat`` of the bare call (``session.run`` / ``model(x)`` + sync), one timing
  per call, no project code involved.

It prints the median of each, their ratio (ours / plain: should be within a few percent of 1.0)
and the null backend's cost in microseconds, and writes the figures as JSON.

Usage (project root, after ``source env.sh`` and the default run's stage 2):
    python benchmarks/harness_fidelity.py --model efficientnet_lite0 --rounds 5 --iters 100
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploykit.layout import fp32_onnx_path  # noqa: E402
from deploykit.cli import HelpFormatter, add_shared_args, int_at_least  # noqa: E402
from deploykit.envinfo import device_info, versions  # noqa: E402
from deploykit.io import write_json  # noqa: E402
from deploykit.models import build_model  # noqa: E402
from deploykit.runners import OrtRunner, TorchRunner, harness_overhead_ms  # noqa: E402


def plain_loop(fn, warmup: int, iters: int, sync=None) -> list[float]:
    """Per-call ms of ``fn`` with ``timeit`` (independent of deploykit.timing.wall_loop)."""
    def call():
        fn()
        if sync:
            sync()
    for _ in range(warmup):
        call()
    return [t * 1e3 for t in timeit.repeat(call, number=1, repeat=iters)]


def compare(name: str, ours_fn, plain_fn, rounds: int) -> dict:
    ours, plain = [], []
    for _ in range(rounds):  # interleaved: a drifting machine affects both
        ours.append(statistics.median(ours_fn()))
        plain.append(statistics.median(plain_fn()))
    ratios = [a / b for a, b in zip(ours, plain)]
    return {"backend": name, "ours_p50_ms": statistics.median(ours),
            "plain_p50_ms": statistics.median(plain), "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_shared_args(p, "model")
    p.add_argument("--rounds", type=int_at_least(1), default=5,
                   help="interleaved rounds of each loop")
    p.add_argument("--iters", type=int_at_least(1), default=100,
                   help="timed calls per round")
    p.add_argument("--warmup", type=int_at_least(0), default=10,
                   help="untimed calls per round")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/harness_fidelity.json"),
                   help="JSON output")
    args = p.parse_args()
    import torch

    model, spec = build_model(args.model, pretrained=False)
    x = np.random.default_rng(0).standard_normal((1, 3, spec.crop, spec.crop)).astype(np.float32)
    feed = {"input": x}
    rows = []
    onnx_path = fp32_onnx_path(args.model)
    import onnxruntime as ort

    eps = ["cpu"] + (["cuda"] if "CUDAExecutionProvider" in ort.get_available_providers()
                     else [])
    if onnx_path.exists():
        for ep in eps:
            with OrtRunner(onnx_path, ep) as r:
                rows.append(compare(
                    f"ORT {r.used}",
                    lambda: r.time(feed, args.warmup, args.iters).end_to_end_ms,
                    lambda: plain_loop(lambda: r.session.run(None, feed), args.warmup,
                                       args.iters), args.rounds))
    else:
        print(f"{onnx_path} missing: ORT rows skipped (run 2_export_onnx.py)", file=sys.stderr)
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        with TorchRunner(model, dev) as r:
            xt = torch.from_numpy(x).to(dev)
            sync = (lambda: torch.cuda.synchronize()) if dev == "cuda" else None

            def fwd():
                with torch.inference_mode():
                    model(xt)
            rows.append(compare(f"PyTorch {dev}",
                                lambda: r.time(feed, args.warmup, args.iters).end_to_end_ms,
                                lambda: plain_loop(fwd, args.warmup, args.iters, sync),
                                args.rounds))
    null_us = statistics.median(
        [harness_overhead_ms(args.iters) * 1e3 for _ in range(args.rounds)])
    out = {"machine": device_info(), "date_utc": time.strftime("%Y-%m-%d"),
           "model": args.model, "weights": "random init (latency only)", "iters": args.iters,
           "rounds": args.rounds, "null_backend_us": null_us, "rows": rows,
           "versions": versions()}
    write_json(args.out, out)
    print(f"{'backend':32s} {'ours p50 ms':>12s} {'plain p50 ms':>13s} {'ratio':>7s} "
          f"(min-max)")
    for r in rows:
        print(f"{r['backend']:32s} {r['ours_p50_ms']:12.3f} {r['plain_p50_ms']:13.3f} "
              f"{r['ratio_median']:7.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})")
    print(f"null backend (harness cost): {null_us:.2f} us per timed call -> {args.out}")


if __name__ == "__main__":
    main()
