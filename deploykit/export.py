"""Stage 2's export procedure: torch.onnx.export of the FP32 file (exporter errors named), the\ninputs its checks run on, the parity summary and the FP16 fix command; the checks themselves live\nin deploykit.checks.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import warnings
from pathlib import Path
import numpy as np
from deploykit.checks.base import check_result, format_result, with_source, worst
from deploykit.checks.export import (
    capture_warnings,
    other_paths,
)
from deploykit.checks.lint import DEFAULT_EXAMPLE_BATCH
from deploykit.io import load_npz
from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.errors import StageError, UsageError
from deploykit.layerwise.torch_vs_onnx import torch_vs_onnx
from deploykit.models import example_inputs
from deploykit.onnx.graph import load_onnx


EXAMPLE_BATCH = DEFAULT_EXAMPLE_BATCH


def check_export_args(args: argparse.Namespace) -> None:
    """Range checks of the numeric flags (UsageError names the flag)."""
    import onnx

    if args.check_images < 2:
        raise UsageError(f"--check-images must be >= 2 (batch-N check), got "
                         f"{args.check_images}")
    for flag in ("min_cosine_fp32", "min_cosine_fp16"):
        v = getattr(args, flag)
        if not 0.0 < v <= 1.0:  # NaN fails too
            raise UsageError(f"--{flag.replace('_', '-')} {v}: a cosine similarity lies "
                             "in [-1, 1] and a threshold that can fail a file in (0, 1] "
                             "(e.g. 0.999); nothing was exported")
    top = onnx.defs.onnx_opset_version()
    low = 18 if args.exporter == "dynamo" else 7
    if args.opset is not None and not low <= args.opset <= top:
        raise UsageError(f"--opset {args.opset}: the {args.exporter} exporter writes "
                         f"opsets {low}..{top} here")
    if args.true_fp16_budget_s < 0:
        raise UsageError("--true-fp16-budget-s must be >= 0")
    if args.no_fp16 and args.fp16_keep_fp32:
        raise UsageError("--fp16-keep-fp32 with --no-fp16: there is no FP16 file")


def _exporter_error(e: Exception, exporter: str, opset: int) -> StageError:
    """A short message for an exporter failure: its first line and the user's source lines."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # drop terminal colour codes
    user = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File \"")
            and f"{os.sep}torch{os.sep}" not in ln]
    first = next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]
    where = f" (at {user[0]})" if user else ""
    hint = (" The model reads a tensor's value into Python (int()/.item()/bool()/a branch): "
            "keep it a tensor (masks, torch.gather/torch.where), or try --exporter legacy, "
            "whose TracerWarning stage 2 then names." if "data-dependent" in text.lower()
            or "GuardOnDataDependent" in text else "")
    return StageError(f"torch.onnx.export ({exporter}, opset {opset}) failed: "
                      f"{type(e).__name__}: {first}{where}.{hint}")


def export_fp32(model, example: dict[str, np.ndarray], path: Path, exporter: str, opset: int,
                output_names: list[str]) -> tuple[list[dict], dict[str, list[int]]]:
    """Export ``model`` with a dynamic batch axis on every input (and, legacy exporter, output).

    Args:
        example: ``{input name: array}`` with the batch axis first (batch >= 2, see
            :data:`EXAMPLE_BATCH`).
    Returns:
        ``(exporter warnings, declared dynamic axes {name: [axes]})``; the warnings are captured
        (never silenced) for :func:`deploykit.checks.export.check_exporter_warnings`.
    Raises:
        StageError: the exporter fails (message: its first line and the user's source line).
    """
    import onnx
    import torch

    args = tuple(torch.from_numpy(v) for v in example.values())
    names = list(example)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if exporter == "dynamo":
                batch = torch.export.Dim("batch", min=1, max=4096)
                prog = torch.onnx.export(
                    model, args, input_names=names, output_names=output_names,
                    opset_version=opset, dynamo=True, external_data=False,
                    dynamic_shapes=tuple({0: batch} for _ in args), verbose=False)
                prog.save(str(path), external_data=False)
                declared = {n: [0] for n in names}
            else:
                declared = {n: [0] for n in names + list(output_names)}
                torch.onnx.export(model, args, str(path), input_names=names,
                                  output_names=output_names, opset_version=opset,
                                  dynamo=False, dynamic_axes={n: {0: "batch"} for n in declared},
                                  do_constant_folding=True)
        except Exception as e:  # noqa: BLE001 - exporter errors have many types
            raise _exporter_error(e, exporter, opset) from e
    onnx.checker.check_model(str(path))
    return [w for w in capture_warnings(caught)
            if not _OWN_CALL_NOTICE.search(w["message"])], declared


# The dynamo exporter's notice that inputs sharing our one Dim("batch") share its name: caused by
# this stage's own dynamic_shapes, not by the model (torch 2.14, torch/onnx/_internal/exporter).
_OWN_CALL_NOTICE = re.compile(r"axis name: \w+ will not be used, since it shares the same shape "
                              r"constraints")


def repeat_rows(feed: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """The first ``n`` samples of ``feed`` (samples repeated cyclically when it has fewer)."""
    return {k: v[np.arange(n) % len(v)] for k, v in feed.items()}


def export_inputs(args, spec, shapes) -> tuple[dict[str, np.ndarray], dict | None, bool]:
    """``(feed, second feed or None, real)`` for the checks."""
    if args.inputs is not None:
        feed = load_npz(args.inputs, None, "np.savez of your samples", flag="--inputs", feed=True)
        if shapes:
            names = [n for n, _, _ in shapes]
            missing = [n for n in names if n not in feed]
            if missing:
                raise UsageError(f"--inputs {args.inputs}: keys {sorted(feed)} lack "
                                 f"{missing} (names of --input-shape)")
            feed = {n: feed[n] for n in names}
        if not feed or len({len(v) for v in feed.values()}) != 1:
            raise UsageError(f"--inputs {args.inputs}: every array needs the same number "
                             "of samples on axis 0")
        return {k: v[:args.check_images] for k, v in feed.items()}, None, True
    if spec.classifier:
        x, _, _ = load_split("eval", spec, args.check_images)
        if len(x) < 2:
            raise UsageError("--check-images must be >= 2 (batch-N check)")
        return {"input": normalize(x, spec.mean, spec.std)}, None, True
    if not shapes:
        raise UsageError(f"--model {args.model}: give --input-shape for a custom model "
                         "(and --inputs with real samples for the FP16 audit)")
    n = max(EXAMPLE_BATCH, min(args.check_images, 8))
    feed = example_inputs(spec, shapes, batch=n, seed=0)
    return feed, other_paths(feed, seed=1), False


def fp16_fix_command(keep: list[str]) -> str:
    """This stage's command line with ``--fp16-keep-fp32`` set to ``keep``."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--fp16-keep-fp32":
            skip = True
            continue
        if a.startswith("--fp16-keep-fp32="):
            continue
        argv.append(a)
    return shlex.join(["python", Path(sys.argv[0]).name, *argv, "--fp16-keep-fp32",
                       ",".join(keep)])


def print_export_summary(name: str, path: Path, par: dict | None, results: list[dict]) -> None:
    line = f"ONNX {name}: {path.name}"
    if any(r.get("computed_in") for r in results):
        line += " (ORT CPU EP computes it in FP32; FP16 judged by the range audit and onnx.reference)"
    if par:
        line += f", cosine min {par['cosine_min']:.6f}" + (
            f", top-1 agreement {par['top1_agreement']:.1f}%" if "top1_agreement" in par else "")
    line += f" -> {worst(results)}"
    print(line)
    for r in results:  # failures are listed in the stage's error message
        if r["status"] == "warn":
            print("  " + format_result(r).replace("\n", "\n  "))


def export_parity(results: list[dict]) -> dict | None:
    """``{output: deploykit.compare.parity}`` at the largest batch, from the ``batch_parity`` row (None when
    the file did not run)."""
    row = next((r for r in results if r["check"] == "batch_parity" and "parity" in r), None)
    return (row or {}).get("parity") or None


def first_divergent_module(model, onnx_path: Path, feed: dict) -> list[dict]:
    """Name the first PyTorch module whose ONNX output differs (deploykit.layerwise.torch_vs_onnx.torch_vs_onnx), for a
    parity failure that no graph check explains. Best effort: errors give a ``skip`` row."""

    try:
        res = torch_vs_onnx(model, onnx_path, {k: v[:2] for k, v in feed.items()})
    except Exception as e:  # noqa: BLE001 - diagnostics never hide the real failure
        return [check_result("first_divergent_module", "skip",
                             f"torch-vs-onnx could not run: {' '.join(str(e).split())[:160]}")]
    fd = res.get("first_divergent")
    if not fd:
        return [check_result("first_divergent_module", "skip",
                             "every mapped module matches its ONNX tensor: the difference is in "
                             "unmapped nodes")]
    head = (f"module {fd['module']} ({fd['type']}) is the first whose ONNX output differs "
            f"(cosine min {fd.get('cosine_min', float('nan')):.4f})")
    if fd.get("inputs_agree") is False and fd.get("input_node"):
        src = next((n for n in load_onnx(onnx_path).graph.node
                    if n.name == fd["input_node"]), None)
        where = with_source(src) if src is not None else fd["input_node"]
        return [check_result(
            "first_divergent_module", "fail",
            f"{head}, but its input already differs (tensor {fd['input_tensor']} made by "
            f"{where}, cosine min {fd.get('input_cosine_min', float('nan')):.4f}): the error is "
            f"upstream of {fd['module']}, in code between modules (the parent's forward), at or "
            f"before node {fd['input_node']}", node=fd["input_node"],
            fix=f"look at the ops that compute {fd['module']}'s input (the source line above) "
                "and how they are exported; python layerwise.py torch-vs-onnx shows all rows")]
    return [check_result("first_divergent_module", "fail", head, node=fd["node"],
                         fix="look at how this module is exported (op, attributes, indexing); "
                         "python layerwise.py torch-vs-onnx shows all rows")]
