"""Checks of an exported file against PyTorch: dynamic axes, exporter warnings, data-dependent
ops, batch parity and independence, every input path, unused inputs, and their composition
(:func:`check_export`).
"""
from __future__ import annotations

import linecache
import warnings
from pathlib import Path
from typing import Callable, Iterable, Sequence
import numpy as np

from deploykit.checks.base import check_result, node_label, output_problems, suspects
from deploykit.checks.batch_stats import batch_statistics_problem
from deploykit.checks.lint import DATA_DEPENDENT_OPS, lint
from deploykit.compare import OUTPUT_MIN_COSINE, parity
from deploykit.errors import StageError
from deploykit.onnx.graph import graph_inputs, load_onnx, static_batch
from deploykit.runners import OrtRunner, TorchRunner


# --------------------------------------------------------------------------------------------
# Export checks (graph + exporter)
# --------------------------------------------------------------------------------------------
def check_dynamic_axes(model, declared: dict[str, Sequence[int]] | None = None,
                       example_batch: int | None = None,
                       model_inputs: Sequence[str] | None = None) -> list[dict]:
    """Every axis declared dynamic at export is symbolic in the file, and no output's axis 0 is
    frozen to the example batch.

    Args:
        declared: ``{input or output name: [axes]}`` declared dynamic (None: a file of unknown
            origin; a static batch is then a warning: the file runs at that batch only).
        example_batch: the export's example batch (outputs with that fixed axis 0 fail).
        model_inputs: the PyTorch model's input names; a declared one the exporter dropped
            (the graph never reads it) is left to :func:`check_unused_inputs`.
    """
    dims = {vi.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                      for d in vi.type.tensor_type.shape.dim]
            for vi in list(model.graph.input) + list(model.graph.output)}
    out = []
    fix = ("keep the batch symbolic: no int()/.item() on sizes, x.reshape(-1, ...) instead of "
           "x.view(b, ...) with a Python b; check the dynamic_axes/dynamic_shapes names match "
           "input_names")
    if declared is None:
        static = static_batch(model)
        if static is not None:
            return [check_result("dynamic_axes", "warn",
                                 f"every input has the fixed batch {static}: the file runs at batch "
                                 f"{static} only (if a dynamic batch was declared at export, the "
                                 "declaration did not reach the exporter)",
                                 fix="re-export with a dynamic batch axis if other batches are "
                                 "deployed; dynamic_axes keys must be the input_names",
                                 static_batch=static)]
        declared = {n: [0] for n, _, _ in graph_inputs(model)}
    outputs = {o.name for o in model.graph.output}
    for name, axes in declared.items():
        if name not in dims:
            if name not in outputs and name in (model_inputs or ()):
                continue  # an input the exporter dropped: unused_inputs reports it
            out.append(check_result("dynamic_axes", "fail",
                                    f"{name!r} was declared dynamic but is not an input or output of "
                                    "the file (misspelt name in dynamic_axes?)", fix=fix))
            continue
        for ax in axes:
            d = dims[name][ax] if ax < len(dims[name]) else None
            if isinstance(d, int) and d > 0:
                why = (" (the example batch)" if example_batch and d == example_batch else "")
                out.append(check_result(
                    "dynamic_axes", "fail",
                    f"axis {ax} of {name} was declared dynamic but exported as the fixed size "
                    f"{d}{why}: the model read it as a Python number, or the exporter "
                    "specialised it", node=name, fix=fix))
    ins_dynamic = any(isinstance(v[0], str) for n, v in dims.items()
                      if v and n in {i for i, _, _ in graph_inputs(model)})
    for o in model.graph.output:
        d = dims[o.name][0] if dims.get(o.name) else None
        if (ins_dynamic and example_batch and isinstance(d, int) and d == example_batch
                and o.name not in declared):
            out.append(check_result("dynamic_axes", "fail",
                                    f"output {o.name} has the fixed axis 0 = {d}, the example batch, "
                                    "while the inputs are dynamic", node=o.name, fix=fix))
    return out or [check_result("dynamic_axes", "pass",
                                f"declared dynamic axes are symbolic ({dict(declared)})")]


def check_exporter_warnings(records: Sequence[dict], allow_tracer: bool = False) -> list[dict]:
    """Warnings the exporter raised, shown; a ``TracerWarning`` means a value (a size, an index,
    a branch) was read into Python and frozen at trace time, and is an error.

    Args:
        records: ``[{"category", "message", "filename", "lineno"}]`` (see
            :func:`capture_warnings`).
        allow_tracer: accept TracerWarnings (the user checked each named line).
    """
    out, quiet = [], 0
    for w in records:
        cat = w["category"]
        if cat in ("DeprecationWarning", "FutureWarning", "PendingDeprecationWarning"):
            quiet += 1
            continue
        where = f"{Path(w['filename']).name}:{w['lineno']}"
        code = linecache.getline(w["filename"], int(w["lineno"] or 0)).strip()
        msg = w["message"].strip().splitlines()[0][:220]
        if cat == "TracerWarning":
            out.append(check_result(
                "exporter_warnings", "warn" if allow_tracer else "fail",
                f"value frozen at trace time at {where}" + (f" ({code})" if code else "")
                + f": {msg}", node=where,
                fix=None if allow_tracer else
                "keep the value a tensor (index with the tensor, torch.where/gather instead of "
                "int()/.item()/bool()), or export with --exporter dynamo; after checking the "
                "line, --allow-tracer-warnings accepts it"))
        else:
            out.append(check_result("exporter_warnings", "warn", f"{cat} at {where}: {msg}",
                                    node=where))
    if out:
        return out
    return [check_result("exporter_warnings", "pass",
                         "no exporter warnings" + (f" ({quiet} deprecation notices recorded)"
                                                   if quiet else ""))]


def capture_warnings(caught: Sequence[warnings.WarningMessage]) -> list[dict]:
    """``warnings.catch_warnings(record=True)`` output as plain dicts (deduplicated)."""
    seen, out = set(), []
    for w in caught:
        rec = {"category": w.category.__name__, "message": str(w.message),
               "filename": str(w.filename), "lineno": int(w.lineno or 0)}
        key = (rec["category"], rec["message"], rec["filename"], rec["lineno"])
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def check_data_dependent_ops(model) -> list[dict]:
    """Ops whose output shape depends on the data (NonZero, ...) or control flow: accepted when
    parity holds, flagged for TensorRT (data-dependent output shapes need an ``IOutputAllocator``
    with ``enqueueV3``, TensorRT >= 8.5 C++/Python API)."""
    nodes = [n for n in model.graph.node if n.op_type in DATA_DEPENDENT_OPS]
    if not nodes:
        return [check_result("data_dependent_ops", "pass", "no data-dependent output shapes")]
    names = ", ".join(f"{node_label(n)} ({n.op_type})" for n in nodes[:6])
    return [check_result(
        "data_dependent_ops", "warn",
        f"{len(nodes)} node(s) with data-dependent output shapes or control flow: {names}; "
        "accepted when parity holds; for TensorRT: outputs of data-dependent size need an "
        "IOutputAllocator (TensorRT >= 8.5), check stage 6/7 on this model",
        node=node_label(nodes[0]), ops=sorted({n.op_type for n in nodes}),
        tensorrt_note="data-dependent output shapes")]


def check_batch_parity(ref_by_batch: dict[int, dict[str, np.ndarray]],
                       feed_by_batch: dict[int, dict[str, np.ndarray]],
                       run: Callable[[dict], dict], min_cosine: float,
                       lint_results: Sequence[dict] = ()) -> list[dict]:
    """The file against PyTorch at each batch size: same output shapes and values; PyTorch's own
    output ranks must not depend on the batch (a ``.squeeze()`` head).

    Args:
        ref_by_batch: ``{batch: PyTorch outputs}``; feed_by_batch: ``{batch: feed}`` (same keys).
        run: runs the file on a feed, returns ``{output: array}`` (raises on a runtime error).
        min_cosine: lowest cosine similarity per sample (FP32: 0.99999).
        lint_results: lint (and dynamic-axes, exporter-warning) findings; the ones that explain
            a failure are named in it.
    Returns:
        one ``batch_parity`` row with ``parity`` (:func:`deploykit.compare.parity` per output at the
        largest batch, outputs named by PyTorch) and ``output_shapes``.
    """
    problems, node, fix = [], None, None
    ranks = {b: [np.ndim(v) for v in r.values()] for b, r in ref_by_batch.items()}
    if len({tuple(v) for v in ranks.values()}) > 1:
        sq = suspects(lint_results, ("squeeze_axes",))
        problems.append(f"the model's own output rank depends on the batch (PyTorch ranks by "
                        f"batch: {ranks})")
        node = sq[0]["node"] if sq else None
        fix = sq[0]["fix"] if sq and sq[0].get("fix") else (
            "squeeze only the axes you mean in the model: x.flatten(1) or x.squeeze((2, 3)) "
            "instead of x.squeeze()")
    shapes, par = {}, {}
    for b, feed in feed_by_batch.items():
        try:
            out = run(feed)
        except Exception as e:  # noqa: BLE001 - ORT/TensorRT raise their own types
            first = " ".join(str(e).split())[:240]
            problems.append(f"batch {b}: the file fails to run ({first})")
            sus = suspects(lint_results, ("dynamic_axes", "shape_constants", "squeeze_axes"))
            if sus and node is None:
                node, fix = sus[0]["node"], sus[0]["fix"]
            continue
        shapes[b] = {k: list(np.shape(v)) for k, v in out.items()}
        problems += [f"batch {b}: {p}" for p in output_problems(ref_by_batch[b], out, min_cosine)]
        if b == max(feed_by_batch):
            try:
                par = {name: parity(r, o) for (name, r), o in
                       zip(ref_by_batch[b].items(), out.values())}
            except StageError:
                par = {}
    if problems and node is None:
        sus = suspects(lint_results, ("hardsigmoid", "softmax_axis", "shape_constants",
                                      "squeeze_axes", "fp16_initializers", "exporter_warnings"))
        if sus:
            node = sus[0]["node"]
            fix = sus[0]["fix"] or ("the exporter warned about this construct: rewrite it as "
                                    "the warning says, or try the other exporter (--exporter "
                                    "dynamo / legacy)")
            problems.append(f"likely cause: {sus[0]['check']} at {sus[0]['node']} "
                            f"({sus[0]['detail'][:160]})")
        else:
            fix = ("python layerwise.py torch-vs-onnx --model M --onnx F names the first module "
                   "whose ONNX output differs")
    return [check_result("batch_parity", "fail" if problems else "pass",
                         "; ".join(
                             problems) or f"matches PyTorch at batch sizes {sorted(feed_by_batch)}"
                         f" (cosine >= {min_cosine})", node=node, fix=fix if problems else None,
                         batches=sorted(feed_by_batch), output_shapes=shapes, parity=par)]


def check_batch_independence(ref_by_batch: dict[int, dict[str, np.ndarray]],
                             cause: str | None = None) -> list[dict]:
    """Sample 0 alone and sample 0 inside a batch give the same PyTorch outputs (rows 0 of
    outputs whose axis 0 is the batch). A model whose samples interact (BatchNorm in training
    mode, a reduction over the batch) is reported: every batch size deploys a different model.

    Args:
        cause: the module that makes them interact, when the model says
            (:func:`deploykit.checks.batch_stats.batch_statistics_problem`): named with its
            fix."""
    if 1 not in ref_by_batch or len(ref_by_batch) < 2:
        return [check_result("batch_independence", "skip", "needs batch 1 and a larger batch")]
    big = max(ref_by_batch)
    diffs = []
    for (n1, a), (_, b) in zip(ref_by_batch[1].items(), ref_by_batch[big].items()):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim and b.ndim and a.shape[0] == 1 and b.shape[0] == big and \
                a.shape[1:] == b.shape[1:] and np.issubdtype(a.dtype, np.floating):
            d = float(np.abs(a[0].astype(np.float64) - b[0]).max()) if a.size else 0.0
            scale = float(np.abs(b[0]).max()) if b[0].size else 0.0
            if d > 1e-4 * max(scale, 1.0):
                diffs.append(f"output {n1}: max abs diff {d:.3g}")
    if diffs:
        msg = (f"in PyTorch, sample 0 alone differs from sample 0 inside a batch of {big} "
               f"({'; '.join(diffs)}): the samples interact")
        if cause:
            head, _, fix = cause.partition(" Fix: ")
            return [check_result("batch_independence", "warn", f"{msg}: {head}",
                                 fix=fix or None)]
        return [check_result("batch_independence", "warn", msg,
                             fix="find what mixes the samples (a BatchNorm using batch statistics, "
                                 "a reduction or an index over axis 0) and compute each sample "
                                 "on its own")]
    return [check_result("batch_independence", "pass", "samples do not interact (PyTorch)")]


def check_input_paths(ref_feeds: Sequence[tuple[dict, dict]], run: Callable[[dict], dict],
                      min_cosine: float, unused: Sequence[str] = ()) -> list[dict]:
    """Parity on inputs that take different data-dependent paths (another mask, index, argmax
    row): a file that matches PyTorch on the first and not on another froze a value at export.

    Args:
        ref_feeds: ``[(feed, PyTorch outputs)]``, at least two with different values.
        unused: model inputs the file does not read (their value is baked in).
    """
    if len(ref_feeds) < 2:
        return [check_result("input_paths", "skip", "one input only")]
    verdicts = []
    for feed, ref in ref_feeds:
        try:
            verdicts.append(output_problems(ref, run(feed), min_cosine))
        except Exception as e:  # noqa: BLE001
            verdicts.append([f"fails to run ({' '.join(str(e).split())[:160]})"])
    fix = ("keep data-dependent values tensors (boolean masks, torch.gather/index_select with a "
           "tensor index, torch.where) instead of int()/.item()/Python branches, then re-export")
    why = (f"; inputs {list(unused)} are not read by the file: their value was frozen at export"
           if unused else "")
    if not verdicts[0] and any(verdicts[1:]):
        bad = next(v for v in verdicts[1:] if v)
        return [check_result("input_paths", "fail",
                             f"matches PyTorch on the first input but not on another ({bad[0]}): a "
                             f"data-dependent value was frozen at export{why}",
                             node=(list(unused) or [None])[0], fix=fix)]
    if all(verdicts):
        if unused:
            return [check_result("input_paths", "fail",
                                 f"differs from PyTorch on every input ({verdicts[0][0]}){why}",
                                 node=list(unused)[0], fix=fix)]
        return [check_result("input_paths", "skip",
                             "the file differs from PyTorch on every input: see batch_parity")]
    return [check_result("input_paths", "pass",
                         f"matches PyTorch on {len(ref_feeds)} inputs with different values")]


def check_unused_inputs(model, names: Sequence[str]) -> list[dict]:
    """Model inputs (``names``) the file does not take: the exporter dropped them because the
    traced graph never read them (a value read into Python and frozen, or a truly unused
    argument)."""
    have = {n for n, _, _ in graph_inputs(model)}
    missing = [n for n in names if n not in have]
    if missing:
        return [check_result("unused_inputs", "warn",
                             f"inputs {missing} are not inputs of the file: the exported graph does not "
                             "depend on them", node=missing[0], unused=missing,
                             fix="if the output should depend on them, keep their use tensor-valued "
                             "(no int()/.item()/Python branch on them)")]
    return [check_result("unused_inputs", "pass", "every model input is a graph input")]


#: FP16 checks whose verdict depends on the weights' value ranges.
# Checks whose verdict depends on the trained weights' value ranges: with random weights a
# real-FP16 backend underflows ~1e-9 logits as surely as onnx.reference does (seen on the H200's
# CUDA EP with a random-init MobileNetV3-Small), so they warn instead of failing.
RANGE_CHECKS = ("fp16_range", "fp16_constants", "fp16_true_arithmetic", "fp16_backends")


def keep_list(results: Iterable[dict], already: Sequence[str] = ()) -> list[str]:
    """Nodes the failing FP16 results ask to keep in FP32, added to ``already``, in order."""
    keep = list(already)
    for r in results:
        if r["status"] == "fail":
            keep += [k for k in r.get("keep_fp32", []) if k not in keep]
    return keep


# --------------------------------------------------------------------------------------------
# Composition: every export check of one file against PyTorch
# --------------------------------------------------------------------------------------------
def random_feed(template: dict[str, np.ndarray], batch: int, seed: int) -> dict[str, np.ndarray]:
    """Random feed like ``template`` with the batch axis set to ``batch`` (every row distinct):
    floats ~ N(mean, std) of the template, integers in its range, booleans uniform."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in template.items():
        shape = (batch,) + tuple(v.shape[1:])
        if np.issubdtype(v.dtype, np.floating):
            mu, sd = float(v.mean()), float(v.std()) or 1.0
            out[k] = (rng.standard_normal(shape) * sd + mu).astype(v.dtype)
        elif v.dtype == np.bool_:
            out[k] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            lo, hi = int(v.min()), int(v.max()) + 1
            out[k] = rng.integers(lo, max(hi, lo + 1), size=shape).astype(v.dtype)
    return out


def other_paths(feed: dict[str, np.ndarray], seed: int = 1) -> dict[str, np.ndarray]:
    """An input like ``feed`` that takes other data-dependent paths: booleans inverted (another
    mask selects other rows), integers shifted by one inside their range (another index),
    floats drawn anew (another argmax row, another branch).

    Returns:
        ``{name: array}`` with the shapes and dtypes of ``feed``.
    """
    rnd = random_feed(feed, len(next(iter(feed.values()))), seed)
    out = {}
    for k, v in feed.items():
        if v.dtype == np.bool_:
            out[k] = ~v
        elif np.issubdtype(v.dtype, np.integer) and v.size:
            lo, hi = int(v.min()), int(v.max())
            span = max(hi - lo + 1, 2)
            out[k] = (lo + (v.astype(np.int64) - lo + 1) % span).astype(v.dtype)
        else:
            out[k] = rnd[k]
    return out


def torch_runner(model) -> Callable[[dict], dict]:
    """``feed -> {output_i: array}`` running the PyTorch ``model`` (CPU, inference mode,
    :class:`deploykit.runners.TorchRunner`); the inputs are passed positionally in the feed's order."""
    def run(feed):
        return TorchRunner(model, "cpu", output_names=(),
                           input_names=list(feed)).infer(feed)
    return run


def ort_runner(path: Path | str, ep: str = "cpu") -> Callable[[dict], dict]:
    """``feed -> outputs`` of the file on ONNX Runtime; inputs the file lacks are left out and
    float inputs are cast to the dtype the file declares."""
    import onnxruntime as ort

    r = OrtRunner(path, ep=ep)
    types = {i.name: i.type for i in r.session.get_inputs()}
    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a failing run is reported by the check, not ORT's logger

    def run(feed):
        f = {}
        for k, v in feed.items():
            if k in types:
                f[k] = v.astype(np.float16) if types[k] == "tensor(float16)" and \
                    v.dtype == np.float32 else v
        return dict(zip(r.output_names, r.session.run(None, f, quiet)))
    return run


def check_export(model, onnx_path: Path | str, feed: dict[str, np.ndarray], *,
                 min_cosine: float = OUTPUT_MIN_COSINE["fp32"], batches: Sequence[int] | None = None,
                 declared: dict[str, Sequence[int]] | None = None,
                 example_batch: int | None = None, exporter_warnings: Sequence[dict] | None = None,
                 allow_tracer: bool = False, second_feed: dict[str, np.ndarray] | None = None,
                 input_paths: bool = True, seed: int = 0, ref_cache: dict | None = None
                 ) -> list[dict]:
    """Every export check of ``onnx_path`` against the PyTorch ``model``.

    Args:
        model: the exported ``torch.nn.Module`` (eval, CPU).
        feed: ``{model input name: array}`` in ``forward`` order, batch on axis 0 (>= 2 rows
            for the batch checks); real data where there is some.
        batches: batch sizes to compare (default: 1 and ``len(feed)``; a file with a static
            batch and no ``declared`` axes is compared at that batch only).
        declared: dynamic axes declared at export (None: a file of unknown origin).
        example_batch: the export's example batch (stage 2: 3).
        exporter_warnings: captured exporter warnings (stage 2), see :func:`capture_warnings`.
        second_feed: another input for ``input_paths`` (default: :func:`other_paths`).
        input_paths: False skips ``input_paths`` (stage 2 on real images: they already take
            whatever data-dependent paths the model has).
        ref_cache: dict reused across calls for the PyTorch outputs (stage 2 checks two files).
    Returns:
        the results of every check (lint included).
    Raises:
        StageError: the file cannot be loaded.
    """
    onnx_model = load_onnx(onnx_path)
    # A file of unknown origin with a static batch runs at that batch only; a file whose batch
    # was declared dynamic (stage 2) is run at batch 1 and N whatever the graph says.
    static = static_batch(onnx_model) if declared is None else None
    n = len(next(iter(feed.values())))
    if static is not None:
        sizes = [static]
    else:
        sizes = sorted(set(batches or (1, max(n, 2))))
    torch_run = torch_runner(model)
    ref_cache = {} if ref_cache is None else ref_cache

    def feed_for(b: int, s: int = 0) -> dict:
        if s == 0 and b <= n:
            return {k: v[:b] for k, v in feed.items()}
        return random_feed(feed, b, seed + 1000 * s + b)

    def ref_for(key, f):
        if key not in ref_cache:
            ref_cache[key] = torch_run(f)
        return ref_cache[key]

    lint_res = lint(onnx_model, example_batch=example_batch, against_torch=True)
    out = [r for r in lint_res if r["status"] != "skip"]
    dyn = check_dynamic_axes(onnx_model, declared, example_batch, list(feed))
    out += dyn
    lint_res = lint_res + dyn  # a frozen input axis explains a run that fails at other batches
    if exporter_warnings is not None:
        ew = check_exporter_warnings(exporter_warnings, allow_tracer)
        out += ew
        lint_res = lint_res + ew  # an exporter warning can explain a parity failure
    out += check_data_dependent_ops(onnx_model)
    unused = check_unused_inputs(onnx_model, list(feed))
    out += unused
    try:
        run = ort_runner(onnx_path)
    except StageError as e:
        return out + [check_result("batch_parity", "fail", f"onnxruntime cannot load the file: {e}")]
    feeds, refs = {}, {}
    for b in sizes:
        feeds[b] = feed_for(b)
        try:
            refs[b] = ref_for(("b", b), feeds[b])
        except Exception as e:  # noqa: BLE001 - the model itself rejects this batch
            out.append(check_result("batch_parity", "warn", f"PyTorch itself fails at batch {b} "
                                    f"({str(e).splitlines()[0][:160]}); not compared"))
            feeds.pop(b)
    out += check_batch_parity(refs, feeds, run, min_cosine, lint_res)
    out += check_batch_independence(refs, batch_statistics_problem(
        model, "a file exported from it matches one batch size only"))
    if not input_paths:
        return out + [check_result("input_paths", "skip", f"{n} real samples exercise the model's "
                                   "data-dependent paths (batch_parity)")]
    b = max(feeds) if feeds else sizes[-1]
    second = second_feed if second_feed is not None else other_paths(
        feeds.get(b) or feed_for(b), seed + 1)
    second = {k: v[:b] for k, v in second.items()}
    try:
        pairs = [(feeds[b], refs[b]), (second, ref_for(("s", b), second))] if feeds else []
    except Exception:  # noqa: BLE001
        pairs = []
    out += check_input_paths(pairs, run, min_cosine, unused[0].get("unused", []))
    return out
