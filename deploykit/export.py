"""Stage 2's export procedure: torch.onnx.export of the FP32 file (exporter errors named), the\ninputs its checks run on, the parity summary and the FP16 fix command; the checks themselves live\nin deploykit.checks.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Iterator, Sequence
import numpy as np
from deploykit.checks.batch_stats import batch_statistics_problem
from deploykit.checks.base import check_result, format_result, with_source, worst
from deploykit.checks.export import (
    capture_warnings,
    other_paths,
)
from deploykit.checks.lint import DEFAULT_EXAMPLE_BATCH
from deploykit.commands import this_command
from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.data.user import input_names, load_inputs, reference_inputs
from deploykit.layout import ref_outputs_path
from deploykit.errors import StageError, UsageError
from deploykit.install import rejected_path
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
    if getattr(args, "true_fp16_samples", 1) < 1:
        raise UsageError("--true-fp16-samples must be >= 1 (--true-fp16-budget-s 0 skips the "
                         "run)")
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


def check_batch_statistics(model, consequence: str = "nothing exported") -> None:
    """Refuse, before anything is exported (stage 2) or used as the reference (stage 1), a
    model whose outputs depend on the rest of the batch or on chance
    (:func:`deploykit.checks.batch_stats.batch_dependent_modules`): its samples interact, so every batch size deploys
    another model and no export can match it.

    Raises:
        StageError: :func:`batch_statistics_problem`'s message.
    """
    problem = batch_statistics_problem(model, consequence)
    if problem:
        raise StageError(problem)


#: Where the classes come from whose ``inplace`` flag only chooses where a result is stored:
#: torch.nn's activations and dropout (``nn.ReLU``, ``nn.ReLU6``, ``nn.Hardswish``,
#: ``nn.Dropout``, ...) and timm's layers (its activations, ``LayerScale``, ``DropBlock2d``).
OUT_OF_PLACE_SAFE_MODULES = ("torch.nn.modules.", "timm.layers.")


def inplace_modules(model) -> list:
    """The submodules of ``model`` set to compute in place (``inplace`` is ``True``) whose class
    comes from :data:`OUT_OF_PLACE_SAFE_MODULES`; a user's own classes, subclasses of torch.nn's
    included, are never touched."""
    return [m for m in model.modules()
            if getattr(m, "inplace", None) is True
            and type(m).__module__.startswith(OUT_OF_PLACE_SAFE_MODULES)]


def _detached_copy(out):
    """``out`` (any pytree) with every tensor copied: later calls cannot change it."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def _same_outputs(a, b) -> bool:
    import torch
    from torch.utils._pytree import tree_flatten

    fa, sa = tree_flatten(a)
    fb, sb = tree_flatten(b)
    if sa != sb or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and torch.equal(x, y)):  # NaN: not equal, keep
                return False
        elif x != y:
            return False
    return True


@contextlib.contextmanager
def out_of_place(model, args: tuple, check_args: Sequence[tuple] = ()) -> Iterator[int]:
    """While the block runs, the :func:`inplace_modules` of ``model`` compute out of place,
    provided that leaves the model's outputs bit-identical on ``args`` and on each of
    ``check_args``; yields how many modules were switched (0: none to switch, a model in
    training mode, outputs that differ, or a forward pass that raised; the flags then stay as
    they are). Every flag is restored on exit, also when the check itself is interrupted.

    Outputs differ when the model reads a tensor again after an in-place module overwrote it
    (``act(x) + x``, an input the caller passed in, a buffer it returns): each forward pass of
    the check gets its own copy of the inputs, and the first pass's outputs are copied before
    the second runs, so neither can hide that. The check is evidence on these inputs, not a
    proof for every input: stage 2 exports again as the model is when FP32 parity then fails
    (``2_export_onnx.py``).

    Why: the dynamo exporter (``torch.export``) functionalises each in-place op under the
    symbolic batch size, which costs seconds on the mobile networks this toolkit is for.
    Measured on this project's 2-core CPU machine (AMD EPYC with AVX512-VNNI, torch 2.14.1,
    2026-12-06), one ``torch.onnx.export(dynamo=True)`` with a dynamic batch axis, in place
    against out of place: EfficientNet-Lite0 (33 modules) 9.5 against 6.2 s,
    ``mobilenetv3_large_100`` (40) 9.1 against 6.3 s, torchvision ``resnet18`` (9) 2.8 against
    2.2 s. Lite0's ONNX file has the same nodes, initializers and node order either way; only
    the FX numbering of some tensor names differs (``add_208`` against ``add_130``).

    Args:
        model: ``torch.nn.Module`` (called as ``model(*inputs)`` without gradients for the
            check, twice per input set).
        args: the example inputs of the export (tensors).
        check_args: more input sets to check on (e.g. the real samples of stage 2's checks).
    """
    import torch

    mods = inplace_modules(model) if not model.training else []
    confirmed = False
    try:
        if mods:
            try:
                with torch.no_grad():
                    before = []
                    for inputs in (args, *check_args):
                        before.append(_detached_copy(model(*(a.clone() for a in inputs))))
                    for m in mods:
                        m.inplace = False
                    confirmed = all(
                        _same_outputs(ref, model(*(a.clone() for a in inputs)))
                        for ref, inputs in zip(before, (args, *check_args)))
            except Exception:  # noqa: BLE001 - any failure here: the model is exported as it
                confirmed = False  # is (and the exporter names the error)
        if not confirmed:
            for m in mods:
                m.inplace = True
            mods = []
        yield len(mods)
    finally:
        for m in mods:
            m.inplace = True


def export_fp32(model, example: dict[str, np.ndarray], path: Path, exporter: str, opset: int,
                output_names: list[str], check: dict[str, np.ndarray] | None = None,
                allow_out_of_place: bool = True
                ) -> tuple[list[dict], dict[str, list[int]], int]:
    """Export ``model`` with a dynamic batch axis on every input (and, legacy exporter, output).

    The dynamo exporter traces the model's torch.nn/timm in-place modules out of place when
    that changes none of its outputs on ``example`` and ``check`` (:func:`out_of_place`; the
    model is left as it was).

    Args:
        example: ``{input name: array}`` with the batch axis first (batch >= 2, see
            :data:`EXAMPLE_BATCH`).
        check: more samples, same keys, for :func:`out_of_place`'s check (stage 2: its check
            feed).
        allow_out_of_place: False exports the model exactly as it is.
    Returns:
        ``(exporter warnings, declared dynamic axes {name: [axes]}, modules traced out of
        place)``; the warnings are captured (never silenced) for
        :func:`deploykit.checks.export.check_exporter_warnings`.
    Raises:
        StageError: the exporter fails (message: its first line and the user's source line).
    """
    import onnx
    import torch

    args = tuple(torch.from_numpy(v) for v in example.values())
    checks = [tuple(torch.from_numpy(np.ascontiguousarray(check[k])) for k in example)] \
        if check else []
    names = list(example)
    print(f"export: torch.onnx.export ({exporter}, opset {opset}, example batch "
          f"{len(args[0]) if args else 0}, dynamic batch axis) -> {path.name}", file=sys.stderr,
          flush=True)
    with contextlib.ExitStack() as stack:
        # the check's own forward passes run before warnings are recorded: they are the
        # model's, not the exporter's
        switched = (stack.enter_context(out_of_place(model, args, checks))
                    if exporter == "dynamo" and allow_out_of_place else 0)
        if switched:
            print(f"export: {switched} in-place torch.nn/timm module(s) (activations, dropout) "
                  "traced out of place: the model's outputs on the example batch and the "
                  f"{len(next(iter(check.values()))) if check else 0} check samples are "
                  "bit-identical either way, and torch.export is slower on in-place ops",
                  file=sys.stderr, flush=True)
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
                                      dynamo=False,
                                      dynamic_axes={n: {0: "batch"} for n in declared},
                                      do_constant_folding=True)
            except Exception as e:  # noqa: BLE001 - exporter errors have many types
                raise _exporter_error(e, exporter, opset) from e
    onnx.checker.check_model(str(path))
    return [w for w in capture_warnings(caught)
            if not _OWN_CALL_NOTICE.search(w["message"])], declared, switched


# The dynamo exporter's notice that inputs sharing our one Dim("batch") share its name: caused by
# this stage's own dynamic_shapes, not by the model (torch 2.14, torch/onnx/_internal/exporter).
_OWN_CALL_NOTICE = re.compile(r"axis name: \w+ will not be used, since it shares the same shape "
                              r"constraints")


def repeat_rows(feed: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    """The first ``n`` samples of ``feed`` (samples repeated cyclically when it has fewer)."""
    return {k: v[np.arange(n) % len(v)] for k, v in feed.items()}


def export_inputs(args, spec, shapes, model=None
                  ) -> tuple[dict[str, np.ndarray], dict | None, bool]:
    """``(feed, second feed or None, real)`` for the checks.

    The samples are ``--inputs``, else for an ImageNet classifier the first eval images, else
    the inputs stage 1's reference ran on (``ref_outputs.npz``: real when stage 1 had
    ``--inputs``), else seeded N(0,1) samples of ``--input-shape`` (``real`` False: every
    data-dependent check then warns instead of judging).

    Raises:
        UsageError: keys that are not the model's inputs, too few samples, or a model with its
            own inputs and neither ``--inputs``, a reference nor ``--input-shape``.
    """
    if args.inputs is not None:
        feed = load_inputs(args.inputs)
        names = input_names(model, shapes, list(feed)) if model is not None else list(feed)
        feed = load_inputs(args.inputs, names)
        return {k: v[:args.check_images] for k, v in feed.items()}, None, True
    if spec.classifier:
        x, _, _ = load_split("eval", spec, args.check_images)
        if len(x) < 2:
            raise UsageError("--check-images must be >= 2 (batch-N check)")
        return {"input": normalize(x, spec.mean, spec.std)}, None, True
    ref = ref_outputs_path(args.model)
    if ref.exists():
        feed, synthetic, _ = reference_inputs(ref)
        if not synthetic:
            if shapes and [n for n, _, _ in shapes] != list(feed):
                raise UsageError(f"--input-shape names {[n for n, _, _ in shapes]} are not the "
                                 f"inputs of stage 1's reference {list(feed)} ({ref}): give "
                                 "the same names, or rerun stage 1")
            if len(next(iter(feed.values()))) >= 2:
                return {k: v[:args.check_images] for k, v in feed.items()}, None, True
    if not shapes:
        raise UsageError(f"--model {args.model}: give --inputs NPZ (your samples; stage 1's "
                         "reference inputs are used when it had them) or --input-shape for a "
                         "model with its own inputs")
    n = max(EXAMPLE_BATCH, min(args.check_images, 8))
    feed = example_inputs(spec, shapes, batch=n, seed=0)
    return feed, other_paths(feed, seed=1), False


def fp16_fix_command(keep: list[str]) -> str:
    """This stage's command line with ``--fp16-keep-fp32`` set to ``keep``, pasteable from any
    folder (:func:`deploykit.commands.this_command`)."""
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
    return this_command([*argv, "--fp16-keep-fp32", ",".join(keep)])


_ORT_NODE = re.compile(r"(?:in|of) node \(([^)]*)\)")


def fp16_candidate_error(e: Exception, path: Path, what: str = "FP16") -> dict:
    """A ``fail`` row (check ``fp16_convert``) for an FP16 candidate that could not be made or
    that ONNX Runtime refuses to load/run, instead of the raw error: the node ORT names, its op
    and the dtype of each input (graph inputs and outputs said as such), and the fix.

    Args:
        e: the converter's or ONNX Runtime's exception. path: the candidate file (may not exist).
        what: the candidate's name in the message.
    """
    text = " ".join(str(e).split())
    detail = text.split("failed:")[-1].strip() if "failed:" in text else text
    m = _ORT_NODE.search(text)
    where = ""
    if m and Path(path).exists():
        try:
            where = "; " + _node_io_types(Path(path), m.group(1))
        except Exception:  # noqa: BLE001 - the description is best effort
            where = ""
    return check_result(
        "fp16_convert", "fail",
        f"the {what} candidate {Path(path).name} is not a valid model for ONNX Runtime "
        f"({type(e).__name__}: {detail[:300]}){where}", node=m.group(1) if m else None,
        fix=("keep the node named above in FP32 (--fp16-keep-fp32 NODE), or export FP32 only "
             "(--no-fp16); please report the model feature (output read inside the graph, "
             "integer input, dict output) with the node" if m else
             "export FP32 only (--no-fp16) and report the error"))


def _node_io_types(path: Path, node_name: str) -> str:
    """``node N (Op) reads a (float16), b (float32, a graph output)`` from the inferred file."""
    import onnx
    from onnx import TensorProto

    m = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    g = m.graph
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    ins, outs = {i.name for i in g.input}, {o.name for o in g.output}
    node = next(n for n in g.node if n.name == node_name)

    def desc(t):
        kind = ", a graph input" if t in ins else (", a graph output" if t in outs else "")
        name = TensorProto.DataType.Name(types[t]).lower() if t in types else "unknown type"
        return f"{t} ({name}{kind})"
    return (f"node {node_name} ({node.op_type}) reads {', '.join(desc(t) for t in node.input if t)}"
            f" and writes {', '.join(desc(t) for t in node.output if t)}")


def no_fp16_command() -> str:
    """This stage's command line with ``--no-fp16`` (FP32 only) instead of any FP16 flag,
    pasteable from any folder (:func:`deploykit.commands.this_command`)."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--fp16-keep-fp32" or (a.startswith("--min-cosine-fp16") and "=" not in a):
            skip = True
            continue
        if a.startswith(("--fp16-keep-fp32=", "--min-cosine-fp16=")) or a == "--no-fp16":
            continue
        argv.append(a)
    return this_command([*argv, "--no-fp16"])


def fp16_rejected_warning(results: list[dict], final: Path, results_json: Path,
                          fix: str | None, skip: str) -> str:
    """The message of an FP16 candidate that failed its checks while FP32 was installed: a
    ``WARNING:`` line (the first failure, where the file is kept, the fix), then every failure
    and the commands on lines of their own (the fix as ``fix (keep those nodes in FP32): ...``).
    """
    fails = [r for r in results if r["status"] == "fail" and not r.get("summary")] or \
        [r for r in results if r["status"] == "fail"]
    # the FP16-specific finding first (batch_parity on ORT CPU only echoes it)
    fails.sort(key=lambda r: r["check"] == "batch_parity")
    if fails:
        r = fails[0]
        text = " ".join(r["detail"].split()).split("blind to FP16 overflow): ")[-1]
        first = f"{r['check']}" + (f" at {r['node']}" if r.get("node") else "") + f": {text}"
    else:
        first = "a check failed"
    rej = rejected_path(final)
    head = (f"WARNING: FP16 candidate rejected, {final.name} not installed ({first[:200]}); "
            f"{final.with_name('fp32.onnx').name} passed and is installed; kept as {rej.name} "
            f"(reason in {rej.with_suffix('.json').name} and {results_json}); "
            + ("fix: --fp16-keep-fp32 (command below)" if fix else "no node list fixes it")
            + "; --no-fp16 skips FP16")
    lines = [head] + ["  " + format_result(r).replace("\n", "\n  ") for r in fails]
    if fix:
        lines.append(f"fix (keep those nodes in FP32): {fix}")
    lines.append(f"or skip FP16 (FP32 only): {skip}")
    return "\n".join(lines)


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
