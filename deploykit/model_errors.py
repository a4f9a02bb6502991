"""Why a model's ``forward()`` failed on the inputs a stage gave it: the inputs, the exception's
first line, the user's source line and what the model's first layer expects (a shape or dtype
problem is a usage error, anything else the model's own)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from deploykit.errors import StageError, UsageError, clip_text


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
    raised = type(e).__name__ + (f": {first}" if first else "")
    msg = (f"--model {model_name}: forward() fails on {given} "
           f"({raised}){where}{exp if shape_error else ''}")
    wide = _float_inputs_wider_than_model(model, feed)
    if wide and isinstance(e, (TypeError, RuntimeError)):  # a dtype, not a shape, problem
        return UsageError(f"--model {model_name}: forward() fails on {given} ({raised}): input "
                          f"{', '.join(wide)} is wider than the model's parameters: cast it "
                          f"(x.astype(np.float32)) in {flag}")
    if shape_error:
        return UsageError(f"{msg}; give one {flag} per forward() argument, in order, with the "
                          "model's input shape (the batch first) and dtype")
    return StageError(f"{msg}; the model's own code raised: fix it"
                      + (f" (the line{where})" if where else "") + ", then rerun")


def _not_the_models_code(filename: str) -> bool:
    """Whether a traceback frame's file is not the model's code: a pseudo-file (``<frozen
    importlib._bootstrap>``, ``<string>``), Python's standard library (``json/decoder.py``, but
    not the site-packages inside it), torch (its module machinery, ``torch._assert``), this
    package, or a pipeline script at the repository root."""
    import sysconfig

    import torch

    if not filename or filename.startswith("<"):
        return True
    try:
        f = Path(filename).resolve()
    except (OSError, RuntimeError):  # a relative name whose folder is gone: not judged
        return False
    repo = Path(__file__).resolve().parents[1]
    own = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parent)
    if any(f.is_relative_to(d) for d in own):
        return True
    library = "site-packages" in f.parts or "dist-packages" in f.parts
    paths = sysconfig.get_paths()
    if not library and any(f.is_relative_to(Path(paths[k]).resolve())
                           for k in ("stdlib", "platstdlib") if paths.get(k)):
        return True
    return f.parent == repo and (re.match(r"\d+b?_\w+\.py$", f.name) is not None
                                 or f.name in ("common.py", "qdq_tools.py", "layerwise.py"))


def _shown_path(filename: str) -> str:
    """A frame's file as the user imports it: its path below the ``sys.path`` entry that holds
    it (``userpkg/common.py``, ``timm/layers/patch_embed.py``, ``mymodel.py``), else its name."""
    import sys

    f = Path(filename).resolve()
    rels = []
    for entry in sys.path:
        try:
            base = Path(entry or os.getcwd()).resolve()
        except (OSError, RuntimeError):
            continue
        if f.is_relative_to(base):
            rels.append(f.relative_to(base))
    return min(rels, key=lambda r: len(r.parts)).as_posix() if rels else f.name


def exception_origin(e: BaseException) -> tuple[str, str]:
    """``(message, " at path.py:LINE")`` of an exception raised inside a model: the message's
    lines joined with spaces (:func:`deploykit.errors.clip_text` at 300 characters; ``""`` for
    none, or for a ``__str__`` that raises), and the innermost frame of the model's code (see
    :func:`_not_the_models_code`: a user's module anywhere and a pip-installed library such as
    timm count; named by :func:`_shown_path`), or ``""`` when there is none."""
    import traceback

    try:
        text = clip_text(str(e), 300)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the exception's type
        text = ""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not _not_the_models_code(f.filename)]
    if not frames:
        return text, ""
    return text, f" at {_shown_path(frames[-1].filename)}:{frames[-1].lineno}"


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
