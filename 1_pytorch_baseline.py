#!/usr/bin/env python3
"""Stage 1: PyTorch FP32 baseline: top-1/top-5 on the eval split, batch-1 latency, and the
reference logits every later stage compares against.

Reads:  ``artifacts/splits.json`` + cache (0_prepare_data.py); model weights. A model with its
        own data: ``--inputs NPZ`` (one array per forward() argument; ``--labels`` for top-1),
        else synthetic N(0,1) samples of ``--input-shape`` (said, and recorded: later
        data-dependent checks then warn instead of judging).
Writes: ``artifacts/<model>/ref_logits.npz`` (``logits`` float32 [N,1000], ``y``, ``files``),
        or for a model with its own data ``ref_outputs.npz`` (inputs ``in:<name>``, outputs
        ``out:<name>``, ``labels``, ``meta:synthetic``); ``results/<model>/pytorch_fp32_<device>.json``.
Rerun:  ``python 1_pytorch_baseline.py --model efficientnet_lite0 [--device cuda]``
GPU:    ``python 1_pytorch_baseline.py --device cuda --latency-batch 64 --compile`` (FP32 eager,
        CUDA-graph replay and torch.compile at batch 1, batch-64 throughput), then
        ``--precision fp16 --device cuda`` for the FP16 row.

Latency: batch 1 (and ``--latency-batch`` N), ``--warmup`` untimed runs, then ``--iters`` timed
runs of ``forward()`` on device-resident inputs: wall-clock with a device sync before each
timestamp (``end_to_end_ms``), and on CUDA also CUDA events (``gpu_compute_ms``) and the replay of
a CUDA graph (``cuda_graph_ms``: eager PyTorch at batch 1 is bound by kernel-launch overhead, the
graph shows what the GPU itself needs). Preprocessing is outside the timed region. The evaluation itself is the shared path of stages 1, 3 and 7
(``deploykit.evaluate``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from deploykit.layout import ref_outputs_path
from deploykit.layout import ref_logits_path
from deploykit.cli import add_shared_args, check_positive, cli, stage_parser
from deploykit.io import require
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import EvalData, classifier_data, custom_data, evaluate, summary_line
from deploykit.io import atomic_path, check_writable
from deploykit.lock import lock_folders
from deploykit.layout import check_row_tag, model_artifacts, model_results, splits_path
from deploykit.data.user import (LABELS_KEY, SYNTHETIC_KEY, SYNTHETIC_NOTE, input_names,
                                 load_inputs, load_labels)
from deploykit.model_errors import forward_error
from deploykit.models import (RANDOM_INIT_NOTE, build_model, example_inputs, model_spec,
                              parse_input_shapes)
from deploykit.export import check_batch_statistics
from deploykit.results import measured_against, weights_sha256, write_result
from deploykit.runners import TorchRunner



def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    add_shared_args(p, "model", "weights", "random_init", "input_shape", "inputs",
                    "labels", "logits_output")
    p.add_argument("--device", default=os.environ.get("TORCH_DEVICE", "cpu"),
                   help="cpu or cuda[:i] (default from $TORCH_DEVICE)")
    add_shared_args(p, "batch_size", "limit", "latency_batch", "warmup", "iters",
                    "max_seconds",
                    "threads")
    p.add_argument("--no-save-reference", action="store_true",
                   help="do not (over)write the reference logits (e.g. a CUDA latency run)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="fp16: model.half() on CUDA, a pytorch_fp16_cuda row judged against the "
                        "FP32 reference (never written as the reference)")
    p.add_argument("--tag", default=None,
                   help="results row id (default: pytorch_<precision>_<cpu|cuda>), e.g. "
                        "pytorch_fp32_cuda_notf32 for a strict-FP32 pass")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile(model) (latency extra 'compile')")
    p.add_argument("--no-tf32", action="store_true",
                   help="CUDA: strict FP32 (torch.backends.cuda.matmul/cudnn.allow_tf32 = False) "
                        "for a parity pass without TF32; the row records the TF32 state")
    return p


def own_data(args: argparse.Namespace, model, shapes) -> tuple[EvalData, list[str]]:
    """The evaluation samples of a model with its own inputs: ``--inputs`` (and ``--labels``),
    else seeded N(0,1) samples of ``--input-shape`` (synthetic: said on stderr and in the
    reference, so every later data-dependent check warns instead of judging).

    Returns:
        ``(data, input names in forward() order)``.
    Raises:
        UsageError: neither --inputs nor --input-shape, --labels without --inputs, keys that
            are not forward()'s arguments, labels that do not fit.
    """
    if args.precision == "fp16":
        data = custom_data(ref_outputs_path(args.model), args.limit)
        return data, list(data.feed)
    if args.inputs:
        feed = load_inputs(args.inputs, limit=args.limit)
        names = input_names(model, shapes, list(feed))
        feed = {n: feed[n] for n in names} if set(names) <= set(feed) else \
            {names[0]: next(iter(feed.values()))}
        n = len(next(iter(feed.values())))
        y = load_labels(args.labels, n) if args.labels else None
        return EvalData(feed=feed, y=y), names
    if args.labels:
        raise UsageError("--labels needs --inputs: the labels of which samples?")
    if not shapes:
        raise UsageError(f"--model {args.model} is not an ImageNet classifier "
                         f"({model_spec(args.model).preprocessing_from}): give your evaluation "
                         "samples with --inputs NPZ (one array per forward() argument), state "
                         "the preprocessing with --preprocess if it is an ImageNet classifier, "
                         "or give --input-shape NAME:DIMS for synthetic samples (structure and "
                         "latency only)")
    print(f"WARNING: {SYNTHETIC_NOTE}: parity and every data-dependent check downstream are "
          "measured on them and only warn; give --inputs NPZ for a verdict on real data",
          file=sys.stderr)
    feed = example_inputs(model_spec(args.model), shapes, batch=4, seed=0)
    return EvalData(feed=feed, synthetic=True), [n for n, _, _ in shapes]


def main(args: argparse.Namespace) -> dict:
    """Evaluate PyTorch FP32, then write the reference and the row together.

    Returns:
        the results row (:mod:`deploykit.evaluate` schema).
    Raises:
        UsageError: bad flags, or a custom model without (or with wrong) --input-shape.
        StageError: no CUDA for --device cuda, missing split, weights that cannot be had.
    """
    started = time.time()
    import torch

    check_positive(args, "batch_size", "latency_batch", "iters", "limit")
    check_writable(model_artifacts(args.model), model_results(args.model))
    lock_folders(model_artifacts(args.model), model_results(args.model))  # one writer per folder
    check_positive(args, "warmup", "threads", allow_zero=("warmup", "threads"))
    if args.tag is not None:  # checked now, not after the evaluation
        check_row_tag(args.model, args.tag, stage="1_pytorch_baseline")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, spec = build_model(args.model, args.weights, pretrained=not args.random_init)
    # a model whose samples interact (batch statistics, a module left in training mode) has no
    # reference: each batch size would give another one (stage 2 refuses it alike)
    check_batch_statistics(model, "no reference written (an earlier one is kept)")
    shapes = parse_input_shapes(args.input_shape)
    inputs: list = []
    fp16 = args.precision == "fp16"
    save_ref = not (args.no_save_reference or fp16)
    opts = dict(dtype=args.precision, compile=args.compile,
                tf32=False if args.no_tf32 else None)
    if spec.classifier:
        if args.inputs or args.labels:
            raise UsageError(f"--model {args.model} is an ImageNet classifier: its data is the "
                             "eval split of 0_prepare_data.py (--data-root / $VAL_ROOT for your "
                             "own images); --inputs/--labels are for models with their own data")
        ref = ref_logits_path(args.model)
        if fp16:
            require(ref, "1_pytorch_baseline.py (FP32) first; FP16 is judged against it")
        data = classifier_data(spec, args.limit, ref if fp16 else None)
        inputs.append(splits_path())
        runner = TorchRunner(model, args.device, **opts)
    else:
        data, names = own_data(args, model, shapes)
        runner = TorchRunner(model, args.device, input_names=names, **opts)
        if args.inputs:
            inputs.append(args.inputs)
        try:
            runner.infer(data.subset(0, min(len(data), 2)).feed)
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's forward() may raise anything
            raise forward_error(args.model, model, data.feed, e,
                                flag="--inputs" if args.inputs else "--input-shape",
                                given=None if (fp16 or args.inputs) else args.input_shape
                                ) from e
    dev_tag = "cuda" if args.device.startswith("cuda") else "cpu"
    with runner:
        rec, outputs = evaluate(
            runner, data, stage="1_pytorch_baseline", precision=args.precision.upper(),
            model=args.model, tag=args.tag or f"pytorch_{args.precision}_{dev_tag}", args=args,
            started=started, inputs=inputs,
            batch_size=args.batch_size, latency_batch=args.latency_batch, warmup=args.warmup,
            iters=args.iters, write=False, variant=None,
            weights="random-init" if args.random_init else (
                str(Path(args.weights).resolve()) if args.weights else "default"),
            size_mb=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6)
    if not spec.classifier:
        rec["outputs"] = {k: list(v.shape) for k, v in outputs.items()}
    rec["weights_sha256"] = weights_sha256(model)  # stage 3 checks fp32.onnx came from them
    if args.random_init:  # a score of random weights is no accuracy claim
        rec["accuracy"] = None
        rec["reason_accuracy"] = RANDOM_INIT_NOTE
    # A reference holding NaN/Inf makes every later parity meaningless: refused, and the earlier
    # reference and row stay as they were.
    bad = {k: int(np.count_nonzero(~np.isfinite(v))) for k, v in outputs.items()
           if np.issubdtype(v.dtype, np.floating)}
    bad = {k: n for k, n in bad.items() if n}
    if bad:
        listed = ", ".join(f"{k}: {n} of {outputs[k].size}" for k, n in bad.items())
        raise StageError(f"--model {args.model}: PyTorch's outputs hold NaN/Inf ({listed}) on "
                         f"{len(data)} samples: no reference written (an earlier one is kept); "
                         "check the model's weights and the inputs' preprocessing")
    # The reference and the row that describes it are written together, at the very end, so an
    # interrupted run never leaves a reference that disagrees with its row.
    if save_ref:
        if spec.classifier:
            with atomic_path(ref) as tmp:
                np.savez(tmp, logits=next(iter(outputs.values())), y=data.y,
                         files=np.array(data.files))
        else:
            ref = ref_outputs_path(args.model)
            extra = {} if data.y is None else {LABELS_KEY: data.y}
            with atomic_path(ref) as tmp:
                np.savez(tmp, **{f"in:{k}": v for k, v in data.feed.items()},
                         **{f"out:{k}": v for k, v in outputs.items()},
                         **{SYNTHETIC_KEY: np.array(data.synthetic)}, **extra)
        rec["reference"] = str(ref)
    # What the row was measured against: the reference it wrote (FP32) or was judged by (FP16).
    # A later rerun that rewrites the reference makes every row measured against it stale.
    ref_file = ref_logits_path(args.model) if spec.classifier else ref_outputs_path(args.model)
    rec["measured_against"] = measured_against(reference=ref_file if (save_ref or fp16) else None)
    path = write_result(args.model, rec["tag"], rec)
    print(f"{summary_line(rec)} -> {path}")
    return rec


if __name__ == "__main__":
    cli(get_args_parser, main)
