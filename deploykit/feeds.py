"""Inputs for the layer-wise and export tools: a feed from an ``.npz``, the model's evaluation
split or ``--input-shape``, and the chunk plan for static-batch models.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence
import numpy as np

from deploykit.data.images import normalize
from deploykit.data.splits import load_split
from deploykit.errors import StageError, UsageError
from deploykit.io import load_npz
from deploykit.evaluate import batch_plan
from deploykit.models import ModelSpec, example_inputs, model_spec, parse_input_shapes
from deploykit.onnx.graph import graph_inputs, load_onnx, static_batch


# --------------------------------------------------------------------------------------------
# Inputs for the CLI
# --------------------------------------------------------------------------------------------
#: key prefix of the inputs in stage 1's reference file of a model with its own data
#: (``ref_outputs.npz``: ``in:<input>``, ``out:<output>``, ``meta:*``)
REF_INPUT_PREFIX = "in:"


def _reference_input_keys(npz: Path | str) -> list[str] | None:
    """The ``in:*`` keys when ``npz`` is stage 1's reference file (so its outputs and metadata
    are not read as inputs), else None (every key). An unreadable file is left to
    :func:`deploykit.io.load_npz`, which names the problem."""
    if not Path(npz).is_file():  # a FIFO or device would block np.load: load_npz refuses it
        return None
    try:
        with np.load(npz) as z:
            keys = [k for k in z.files if k.startswith(REF_INPUT_PREFIX)]
    except Exception:  # noqa: BLE001 - load_npz gives the one-line error
        return None
    return keys or None


def load_feed(npz: Path | str | None, model: str | None, n: int, onnx_path: Path | str,
              input_shapes: Sequence[str] | None = None, seed: int = 0, flag: str = "--inputs"
              ) -> dict[str, np.ndarray]:
    """Inputs for a comparison: ``n`` samples (batch on axis 0), whatever batch the model runs
    at (see :func:`feed_plan` for how they are fed).

    Args:
        npz: ``.npz`` whose keys are the model's input names (arrays with batch on axis 0);
            all its samples are used (``n`` is ignored).
        model: ``--model`` name: for an image classifier the first ``n`` eval images,
            preprocessed and normalised as every stage does (:func:`deploykit.data.splits.load_split`,
            :func:`deploykit.data.images.normalize`); a custom model gets random inputs.
        onnx_path: the reference model (input names, and random inputs when neither is given).
        input_shapes: ``--input-shape`` values for random inputs (:func:`deploykit.models.parse_input_shapes`);
            their first dimension is the batch per run (:func:`input_shape_batch`), not the
            number of samples.
        flag: the option that named ``npz`` (in messages).
    Raises:
        StageError: ``npz`` is not a regular file, unreadable, holds object / non-numeric /
            empty arrays, sample counts that disagree (:func:`deploykit.io.load_npz`) or an
            array whose rank is not its model input's.
        UsageError: the npz keys do not match the model's inputs, or an image classifier's
            ONNX has several inputs.
    """
    m = load_onnx(onnx_path)
    ins = graph_inputs(m)
    names = [name for name, _, _ in ins]
    if npz:
        feed = load_npz(npz, _reference_input_keys(npz), "np.savez(path, <input name>=array, "
                        "...)", flag=flag, feed=True)
        # stage 1's reference of a model with its own data (ref_outputs.npz): its inputs
        feed = {k.removeprefix(REF_INPUT_PREFIX): v for k, v in feed.items()}
        missing = [k for k in names if k not in feed]
        if missing and not (len(names) == 1 and len(feed) == 1):
            raise UsageError(f"{flag} {npz}: keys {sorted(feed)} lack model inputs {missing}: "
                             "name each array by its model input, np.savez(path, "
                             f"{names[0]}=array, ...)")
        feed = ({names[0]: next(iter(feed.values()))} if missing else
                {k: feed[k] for k in names})
        for name, dims, _ in ins:
            if dims is not None and feed[name].ndim != len(dims):
                raise StageError(f"{flag} {npz}: array {name!r} has rank {feed[name].ndim} "
                                 f"(shape {list(feed[name].shape)}); the model's input {name} "
                                 f"has rank {len(dims)} {dims}: save it as [N, ...] with the "
                                 "model's dimensions")
        return feed
    spec = model_spec(model) if model else None
    if spec is not None and spec.classifier:  # a custom model gets random inputs (below)
        if len(names) != 1:
            raise UsageError(f"--model {model} feeds eval images to an image classifier with one "
                             f"input; this model has inputs {names}: use --inputs feed.npz or "
                             "--input-shape")
        x, _, _ = load_split("eval", spec, limit=n)
        return {names[0]: normalize(x, spec.mean, spec.std)}
    shapes = parse_input_shapes(input_shapes)
    if not shapes:
        for name, dims, dt in ins:
            dims = [d if d is not None else (1 if k == 0 else None) for k, d in enumerate(dims)]
            if any(d is None for d in dims):
                raise UsageError(f"input {name} has dynamic non-batch axes: pass --input-shape "
                                 "or --inputs")
            shapes.append((name, tuple(dims), str(dt)))
    spec = ModelSpec("custom", "custom", classifier=False)
    return example_inputs(spec, shapes, batch=n, seed=seed)


def input_shape_batch(input_shapes: Sequence[str] | None) -> int | None:
    """The batch written in ``--input-shape`` values (their first dimension; None without any).

    Raises:
        UsageError: the values disagree on the batch.
    """
    batches = {shape[0] for _, shape, _ in parse_input_shapes(input_shapes) if shape}
    if len(batches) > 1:
        raise UsageError(f"--input-shape values disagree on the batch (first dimension): "
                         f"{sorted(batches)}")
    return batches.pop() if batches else None


def feed_plan(feed: dict[str, np.ndarray], models: Sequence[Any], requested: int | None
              ) -> tuple[dict[str, np.ndarray], int | None]:
    """How to feed ``feed`` to every model of ``models`` (ONNX paths or ModelProtos): the batch
    rule of the evaluation path (:func:`deploykit.evaluate.batch_plan`: a model whose inputs have a static
    batch is fed exactly that many samples per run, one at a time for a batch-1 export; a dynamic
    batch takes ``requested``, None = all at once). Unlike evaluation, which pads a last short
    run, a layer-wise comparison leaves those samples out (said on stderr): padded copies would
    count as samples.

    Returns:
        ``(feed, batch per run or None for all at once)``.
    Raises:
        UsageError: the models have different static batches, or fewer samples than one run.
    """

    statics = {static_batch(load_onnx(m) if isinstance(m, (str, Path)) else m)
               for m in models} - {None}
    if len(statics) > 1:
        raise UsageError(f"the models have different static batch sizes {sorted(statics)}: no "
                         "batch fits both; re-export one of them with a dynamic batch axis")
    n = len(next(iter(feed.values()))) if feed else 0
    if not statics:
        return feed, requested
    static = statics.pop()
    batch, _ = batch_plan(n, requested or n, (static, static))
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
    a_names = [n for n, _, _ in graph_inputs(load_onnx(a_onnx, external=False))]
    b_names = [n for n, _, _ in graph_inputs(load_onnx(b_onnx, external=False))]
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
