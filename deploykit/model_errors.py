"""Why a model's ``forward()`` failed on the inputs a stage gave it: the inputs, the exception's
first line, the user's source line and what the model's first layer expects (a shape or dtype
problem is a usage error, anything else the model's own)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from deploykit.errors import StageError, UsageError


def first_layer_expectation(model) -> tuple[str, str, int, int] | None:
    """What the model's first weight layer reads: ``(module name, type, axis, size)`` for a
    Conv (channels on axis 1) or a Linear (features on the last axis, ``axis`` -1); None when
    the first such layer is another kind (or there is none)."""
    import torch

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.conv._ConvNd):
            return name or type(m).__name__, type(m).__name__, 1, int(m.in_channels)
        if isinstance(m, torch.nn.Linear):
            return name or type(m).__name__, type(m).__name__, -1, int(m.in_features)
        if isinstance(m, (torch.nn.Embedding, torch.nn.RNNBase, torch.nn.MultiheadAttention)):
            return None
    return None


def forward_error(model_name: str, model, feed: dict[str, np.ndarray], e: Exception,
                  flag: str = "--input-shape", given: Sequence[str] | None = None
                  ) -> Exception:
    """A one-line error for a ``forward()`` that raised on the stage's inputs: the inputs given
    (``given``: the ``--input-shape`` values as typed; else the feed's name:shape:dtype, at the
    batch the stage ran), the exception's first line, the user's source line, and what the
    model's first layer expects where that can be read (:func:`first_layer_expectation`).

    Returns (to be raised):
        UsageError for a ``TypeError``/``RuntimeError`` (wrong shape, dtype or argument count:
        the inputs given do not fit) or when the first layer contradicts the shape given;
        StageError for any other exception (the model's own code failed: fix it).
    """
    n = len(next(iter(feed.values()))) if feed else 0
    given = (f"{flag} {' '.join(given)} (run at batch {n})" if given else "the inputs " + ", ".join(
        f"{k}:{','.join(str(d) for d in v.shape)}:{v.dtype}" for k, v in feed.items()))
    first, where = exception_origin(e)
    exp, mismatch = "", False
    fl = first_layer_expectation(model)
    if fl is not None and len(feed) == 1:
        name, kind, axis, size = fl
        shape = next(iter(feed.values())).shape
        got = shape[axis] if len(shape) > max(axis, 0) and len(shape) >= 2 else None
        mismatch = got is not None and got != size
        exp = (f"; the first layer {name} ({kind}) expects {size} "
               f"{'channels on axis 1' if axis == 1 else 'features on the last axis'}"
               + (f", the input has {got}" if mismatch else ""))
    shape_error = mismatch or isinstance(e, (TypeError, RuntimeError))
    msg = (f"--model {model_name}: forward() fails on {given} "
           f"({type(e).__name__}: {first}){where}{exp if shape_error else ''}")
    wide = _float_inputs_wider_than_model(model, feed)
    if wide and isinstance(e, (TypeError, RuntimeError)):  # a dtype, not a shape, problem
        return UsageError(f"--model {model_name}: forward() fails on {given} ({type(e).__name__}: "
                          f"{first}): input {', '.join(wide)} is wider than the model's "
                          f"parameters: cast it (x.astype(np.float32)) in {flag}")
    if shape_error:
        return UsageError(f"{msg}; give one {flag} per forward() argument, in order, with the "
                          "model's input shape (the batch first) and dtype")
    return StageError(f"{msg}; the model's own code raised: fix it (the line above), then rerun")


def exception_origin(e: BaseException) -> tuple[str, str]:
    """``(first line of the message (at most 300 characters), " at file.py:LINE")`` of an
    exception raised inside a user's model: the line is the innermost frame of the user's code
    (not torch.nn, site-packages, deploykit or this project's stage scripts), ``""`` when there
    is none."""
    import traceback

    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:300]
    repo = Path(__file__).resolve().parents[1]  # our stage scripts are not the user's code
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f"{Path('torch') / 'nn'}" not in f.filename
              and "site-packages" not in f.filename and "deploykit" not in f.filename
              and Path(f.filename).resolve().parent != repo]
    return first, f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def _float_inputs_wider_than_model(model, feed: dict[str, np.ndarray]) -> list[str]:
    """Names (``name (float64)``) of float inputs of a wider dtype than the model's first float
    parameter (a float64 ``.npz`` fed to a float32 model)."""
    import torch

    p = next((t for t in model.parameters() if t.is_floating_point()), None) if hasattr(
        model, "parameters") else None
    if p is None:
        return []
    width = torch.finfo(p.dtype).bits
    return [f"{k} ({v.dtype})" for k, v in feed.items()
            if np.issubdtype(v.dtype, np.floating) and np.dtype(v.dtype).itemsize * 8 > width]
