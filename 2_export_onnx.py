#!/usr/bin/env python3
"""Stage 2: export the model to ONNX FP32 and ONNX FP16 (fp16 weights and compute, fp32 inputs
and outputs), dynamic batch axis, and check both against PyTorch on real images.

Reads:  model weights; eval split cache (0_prepare_data.py) for the parity check.
Writes: ``artifacts/<model>/onnx/fp32.onnx``, ``artifacts/<model>/onnx/fp16.onnx``,
        ``results/<model>/export.json`` (parity of each file vs PyTorch FP32).
Rerun:  ``python 2_export_onnx.py --model efficientnet_lite0``

Exporter: ``torch.onnx.export(dynamo=True)`` at opset 18 by default (its node metadata keeps the
PyTorch module path, which the layer-wise tools use). For TensorRT 8.5/8.6 (JetPack 5) use
``--exporter legacy --opset 17``. FP16: onnxconverter-common's ``convert_float_to_float16`` with
``keep_io_types=True`` (Cast nodes at the graph boundary).

The stage fails (exit 1) when a file's parity is below ``--min-cosine-fp32`` / ``--min-cosine-fp16``
(cosine similarity of the logits, minimum over images) or the batch-1 and batch-N outputs of the
ONNX file disagree: a silent export bug is caught here, before any runtime is blamed.
"""
from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np

import common
import runners


def get_args_parser() -> argparse.ArgumentParser:
    p = common.stage_parser(__doc__)
    common.add_shared_args(p, "model", "weights", "random_init", "input_shape")
    p.add_argument("--exporter", choices=("dynamo", "legacy"), default="dynamo",
                   help="torch.onnx.export(dynamo=True) or the legacy TorchScript exporter")
    p.add_argument("--opset", type=int, default=None,
                   help="ONNX opset (default: 18 for dynamo, 17 for legacy)")
    p.add_argument("--check-images", type=int, default=64,
                   help="eval images used for the parity check")
    p.add_argument("--min-cosine-fp32", type=float, default=0.99999,
                   help="lowest per-image cosine similarity of the FP32 file vs PyTorch")
    p.add_argument("--min-cosine-fp16", type=float, default=0.999,
                   help="lowest per-image cosine similarity of the FP16 file vs PyTorch")
    p.add_argument("--no-fp16", action="store_true", help="export FP32 only")
    return p


def export_fp32(model, example: dict[str, np.ndarray], path: Path, exporter: str, opset: int,
                output_names: list[str]) -> None:
    """Export ``model`` with a dynamic batch axis on every input and output.

    Args:
        example: ``{input name: array}`` with the batch axis first (batch >= 2 recommended so the
            exporter cannot specialise on 1).
    Raises:
        StageError: the exporter fails (message carries its error).
    """
    import torch

    args = tuple(torch.from_numpy(v) for v in example.values())
    names = list(example)
    with common.atomic_path(path) as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if exporter == "dynamo":
                    batch = torch.export.Dim("batch", min=1, max=4096)
                    prog = torch.onnx.export(
                        model, args, input_names=names, output_names=output_names,
                        opset_version=opset, dynamo=True, external_data=False,
                        dynamic_shapes=tuple({0: batch} for _ in args), verbose=False)
                    prog.save(str(tmp), external_data=False)
                else:
                    axes = {n: {0: "batch"} for n in names + output_names}
                    torch.onnx.export(model, args, str(tmp), input_names=names,
                                      output_names=output_names, opset_version=opset,
                                      dynamo=False, dynamic_axes=axes, do_constant_folding=True)
            except Exception as e:  # noqa: BLE001 - exporter errors have many types
                raise common.StageError(f"torch.onnx.export ({exporter}, opset {opset}) failed: "
                                        f"{type(e).__name__}: {e}") from e
        import onnx

        onnx.checker.check_model(str(tmp))


def convert_fp16(src: Path, dst: Path) -> None:
    """FP16 copy of ``src``: fp16 initializers and compute, fp32 graph inputs/outputs.

    Uses ``onnxconverter_common.float16.convert_float_to_float16(keep_io_types=True)``.
    """
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m16 = float16.convert_float_to_float16(model, keep_io_types=True)
    with common.atomic_path(dst) as tmp:
        onnx.save(m16, str(tmp))
        onnx.checker.check_model(str(tmp))


def check_file(path: Path, feed: dict, ref: dict, min_cosine: float) -> dict:
    """Run ``path`` on ORT CPU with ``feed``; parity of every output against PyTorch ``ref``,
    plus a batch-1 vs batch-N consistency check (catches batch-dependent export bugs).

    Returns:
        ``{output name: parity dict, "batch_consistency": max abs diff, "ok": bool}``.
    """
    with runners.OrtRunner(path, "cpu") as r:
        out = r.infer(feed)
        first = r.infer({k: v[:1] for k, v in feed.items()})
    res: dict = {"ok": True, "outputs": {}}
    for (name, o), (_, ref_o) in zip(out.items(), ref.items()):
        par = common.parity(ref_o, o)
        res["outputs"][name] = par
        if par["cosine_min"] < min_cosine:
            res["ok"] = False
    diffs = []
    for name, o in out.items():
        if first[name].shape[1:] != o.shape[1:] or first[name].shape[0] != 1:
            res["ok"] = False
            diffs.append(float("inf"))
        else:
            diffs.append(float(np.abs(first[name][0].astype(np.float64) - o[0]).max()))
            if common.parity(o[:1], first[name])["cosine_min"] < min_cosine:
                res["ok"] = False  # sample 0 alone differs from sample 0 within a batch
    res["batch1_vs_batchN_max_abs"] = max(diffs)
    res["min_cosine_required"] = min_cosine
    return res


def main(args: argparse.Namespace) -> dict:
    started = time.time()
    # Checked before anything is exported: an impossible threshold would fail every file.
    for flag in ("min_cosine_fp32", "min_cosine_fp16"):
        v = getattr(args, flag)
        if not -1.0 <= v <= 1.0:
            raise common.UsageError(f"--{flag.replace('_', '-')} {v}: a cosine similarity lies "
                                    "in [-1, 1] (e.g. 0.999); nothing was exported")
    common.check_writable(common.model_artifacts(args.model), common.model_results(args.model))
    model, spec = common.build_model(args.model, args.weights, pretrained=not args.random_init)
    opset = args.opset or (18 if args.exporter == "dynamo" else 17)
    shapes = common.parse_input_shapes(args.input_shape)
    if spec.classifier:
        x, _, _ = common.load_split("eval", spec, args.check_images)
        if len(x) < 2:
            raise common.UsageError("--check-images must be >= 2 (batch-N check)")
        feed = {"input": common.normalize(x, spec.mean, spec.std)}
        output_names = ["logits"]
    else:
        if not shapes:
            raise common.UsageError(f"--model {args.model}: give --input-shape for a custom model")
        feed = common.example_inputs(spec, shapes, batch=max(2, min(args.check_images, 8)), seed=0)
        output_names = None
    with runners.TorchRunner(model, "cpu") as tr:
        ref = tr.infer(feed)
    if output_names is None:
        output_names = list(ref) if len(ref) > 1 else ["output"]
        ref = dict(zip(output_names, ref.values()))
    onnx_dir = common.model_artifacts(args.model) / "onnx"
    fp32, fp16 = onnx_dir / "fp32.onnx", onnx_dir / "fp16.onnx"
    export_fp32(model, {k: v[:2] for k, v in feed.items()}, fp32, args.exporter, opset,
                output_names)
    record = {"stage": "2_export_onnx", "model": args.model, "exporter": args.exporter,
              "opset": opset, "files": {}}
    checks = [("fp32", fp32, args.min_cosine_fp32)]
    if not args.no_fp16:
        convert_fp16(fp32, fp16)
        checks.append(("fp16", fp16, args.min_cosine_fp16))
    failed = []
    for name, path, min_cos in checks:
        res = check_file(path, feed, ref, min_cos)
        res["size_mb"] = common.file_size_mb(path)
        res["sha256"] = common.sha256_file(path)
        record["files"][name] = {"path": str(path), **res}
        par = next(iter(res["outputs"].values()))
        print(f"ONNX {name}: {path} {res['size_mb']:.2f} MB, cosine min {par['cosine_min']:.6f}"
              + (f", top-1 agreement {par['top1_agreement']:.1f}%" if "top1_agreement" in par
                 else "") + f", batch-1 vs batch-N max abs {res['batch1_vs_batchN_max_abs']:.2e}")
        if not res["ok"]:
            failed.append(name)
    record["n_check"] = len(next(iter(feed.values())))
    record["provenance"] = common.provenance(args, [fp32], started)
    common.write_json(common.model_results(args.model) / "export.json", record)
    if failed:
        for name in failed:  # never leave a file that failed its check for the next stage
            Path(record["files"][name]["path"]).unlink(missing_ok=True)
        raise common.StageError(f"export parity check failed for {failed} (see "
                                f"{common.model_results(args.model) / 'export.json'}); run "
                                "python layerwise.py torch-vs-onnx to find the layer")
    return record


if __name__ == "__main__":
    common.cli(get_args_parser, main)
