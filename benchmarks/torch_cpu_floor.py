#!/usr/bin/env python3
"""Stage 1's PyTorch reference pass on this CPU: what the pipeline runs
(:class:`deploykit.runners.TorchRunner`: ``torch.inference_mode()``, channels-last, chunks of
:data:`deploykit.torch_cpu.CPU_CHUNK`) against the other ways to run the same FP32 model, each on
the same images: plain NCHW at batch 64, other thread counts, ``torch.jit.trace`` +
``torch.jit.freeze`` (oneDNN fusion of conv + batch norm + activation), and ``torch.compile``
(its compile time counted separately). Every candidate's logits are compared with the
pipeline's (max |difference|, top-1 agreement): a faster candidate only counts when its logits
are those of the same model within FP32 rounding.

Usage (project root, after ``source env.sh``):
    python benchmarks/torch_cpu_floor.py --model efficientnet_lite0 --n 128
    python benchmarks/torch_cpu_floor.py --model resnet18 --random-init --n 128
Writes ``benchmarks/results/torch_cpu_floor_<model>.json`` (with the machine and the date).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deploykit.cli import HelpFormatter  # noqa: E402
from deploykit.data.images import normalize  # noqa: E402
from deploykit.data.splits import load_split  # noqa: E402
from deploykit.envinfo import device_info  # noqa: E402
from deploykit.io import write_json  # noqa: E402
from deploykit.layout import model_tag  # noqa: E402
from deploykit.models import build_model, model_spec  # noqa: E402
from deploykit.runners import TorchRunner  # noqa: E402


def _batches(x: np.ndarray, b: int):
    return [x[i:i + b] for i in range(0, len(x), b)]


def timed(fn, x: np.ndarray, batch: int, rounds: int) -> tuple[float, np.ndarray]:
    """Median seconds over ``rounds`` passes of ``fn`` over ``x`` in batches, and the logits."""
    out = np.concatenate([fn(c) for c in _batches(x, batch)])  # warm-up, and the logits
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for c in _batches(x, batch):
            fn(c)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="efficientnet_lite0")
    p.add_argument("--random-init", action="store_true",
                   help="seeded random weights (time and agreement only)")
    p.add_argument("--n", type=int, default=128, help="eval images")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    spec = model_spec(args.model)
    x_u8, _, _ = load_split("eval", spec, args.n)
    x = normalize(x_u8, spec.mean, spec.std)
    model, _ = build_model(args.model, None, pretrained=not args.random_init)
    model.eval()
    threads = torch.get_num_threads()
    rows = {}
    with TorchRunner(model, "cpu") as r:
        name = r.input_names[0] if r.input_names else "input"
        t, ref = timed(lambda c: next(iter(r.infer({name: c}).values())), x, 64, args.rounds)
        rows["pipeline (inference_mode, channels-last, chunks of 16)"] = {"s": t}
    # TorchRunner.close gives the module back NCHW

    def plain(m, fmt=torch.contiguous_format):
        def f(c):
            with torch.inference_mode():
                return m(torch.from_numpy(c).contiguous(memory_format=fmt)).numpy()
        return f

    cands = {"eager NCHW, batch 64": (plain(model), 64),
             "eager NCHW, batch 16": (plain(model), 16)}
    for nt in sorted({1, threads} - {threads}) + [threads]:
        cands[f"eager NCHW, batch 16, {nt} thread(s)"] = (plain(model), 16, nt)
    try:
        with torch.no_grad():
            tr = torch.jit.freeze(torch.jit.trace(model, torch.from_numpy(x[:16])).eval())
        cands["torch.jit.trace + freeze (oneDNN fusion), batch 16"] = (plain(tr), 16)
    except Exception as e:  # noqa: BLE001 - a model that cannot be traced: recorded
        rows["torch.jit.trace + freeze"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    if not args.no_compile:
        try:
            t0 = time.perf_counter()
            comp = torch.compile(model)
            plain(comp)(x[:16])
            rows["torch.compile: compile time"] = {"s": time.perf_counter() - t0}
            cands["torch.compile (inductor), batch 16"] = (plain(comp), 16)
        except Exception as e:  # noqa: BLE001
            rows["torch.compile"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    for label, c in cands.items():
        fn, b = c[0], c[1]
        if len(c) > 2:
            torch.set_num_threads(c[2])
        t, out = timed(fn, x, b, args.rounds)
        torch.set_num_threads(threads)
        rows[label] = {"s": t, "max_abs_diff": float(np.abs(out - ref).max()),
                       "top1_agreement": float(100 * (out.argmax(1) == ref.argmax(1)).mean())}
    res = {"machine": device_info(), "date_utc": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "model": args.model, "random_init": args.random_init,
           "n_images": len(x), "threads": threads, "rows": rows}
    out = args.out or ROOT / "benchmarks" / "results" / f"torch_cpu_floor_{model_tag(args.model)}.json"
    write_json(out, res)
    for k, v in rows.items():
        print(f"{k}: " + ", ".join(f"{a} {b:.4g}" if isinstance(b, float) else f"{a} {b}"
                                   for a, b in v.items()))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
