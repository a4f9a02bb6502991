"""The check result shape (``{check, status, detail, node, fix}``) and the helpers every check
shares: node labels with their source line, inferred shapes, and output comparison.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Sequence
import numpy as np

from deploykit.compare import compare
from deploykit.onnx.graph import constants, graph_inputs


STATUS_ORDER = {"fail": 3, "warn": 2, "pass": 1, "skip": 0}


# --------------------------------------------------------------------------------------------
# Result shape and small helpers
# --------------------------------------------------------------------------------------------
def check_result(check: str, status: str, detail: str, node: str | None = None,
                 fix: str | None = None, **extra) -> dict:
    """One check result (the shape every check returns, in a list).

    Raises:
        ValueError: unknown status (a programming error).
    """
    if status not in STATUS_ORDER:
        raise ValueError(f"status {status!r}")
    return {"check": check, "status": status, "detail": detail, "node": node, "fix": fix,
            **extra}


def worst(results: Iterable[dict]) -> str:
    """Overall status of ``results``: ``fail`` > ``warn`` > ``pass`` > ``skip``."""
    return max((r["status"] for r in results), key=STATUS_ORDER.__getitem__, default="skip")


def format_result(r: dict) -> str:
    """One or two printable lines: ``[status] check node: detail`` and ``fix: ...``."""
    node = f" {r['node']}" if r.get("node") else ""
    line = f"[{r['status']}] {r['check']}{node}: {r['detail']}"
    return line + (f"\n       fix: {r['fix']}" if r.get("fix") else "")


def node_label(node, index: int | None = None) -> str:
    """A node's name, or ``<op>(<first output>)`` for unnamed nodes."""
    return node.name or f"{node.op_type}({node.output[0] if node.output else index})"


def source_line(node) -> str | None:
    """The user's source line that made an exported node (``file.py:16: x = x.squeeze()``), from
    the dynamo exporter's ``pkg.torch.onnx.stack_trace`` metadata; None without it. Frames inside
    torch itself are skipped."""
    for p in node.metadata_props:
        if p.key != "pkg.torch.onnx.stack_trace":
            continue
        for m in re.finditer(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', p.value):
            path, line, code = m.groups()
            if f"{os.sep}torch{os.sep}" in path:
                continue
            code = code.split("  #")[0].strip()  # drop a trailing comment
            return f"{Path(path).name}:{line}: {code}"
    return None


def with_source(node) -> str:
    src = source_line(node)
    return node_label(node) + (f" ({src})" if src else "")


def inferred_model(model):
    """``model`` with inferred shapes (the original on failure, e.g. > 2 GB or unknown ops)."""
    import onnx

    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - shape inference is best effort here
        return model


def value_shapes(model) -> dict[str, list]:
    """``{tensor: dims}`` for every tensor with known rank (after shape inference); a dim is an
    int, a symbol (str) or None."""
    m = inferred_model(model)
    out = {}
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        out[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                        for d in t.shape.dim]
    for name, arr in constants(model).items():
        out[name] = list(arr.shape)
    return out


def depends_on_inputs(model) -> set[str]:
    """Tensors computed (directly or not) from a real graph input."""
    live = {n for n, _, _ in graph_inputs(model)}
    for node in model.graph.node:  # ONNX node lists are topologically sorted
        if any(i in live for i in node.input if i):
            live.update(o for o in node.output if o)
    return live


def const_leading(model, name: str, consts: dict, prod: dict) -> tuple[np.ndarray | None, str]:
    """``(constant value of name, how to print it)``; for a Concat of pieces, the constant
    leading piece (the legacy exporter builds shapes as ``Concat(Constant[b], ...)``)."""
    if name in consts:
        arr = np.asarray(consts[name])
        return arr, str(arr.reshape(-1).tolist())
    node = prod.get(name)
    if node is not None and node.op_type == "Concat" and node.input:
        arr, text = const_leading(model, node.input[0], consts, prod)
        return arr, (f"Concat({text}, ...)" if arr is not None else text)
    return None, ""


# --------------------------------------------------------------------------------------------
# Checks against PyTorch (runtime)
# --------------------------------------------------------------------------------------------
def _nan_safe_below(value: float, threshold: float) -> bool:
    return not (value >= threshold)  # NaN counts as below


def output_problems(ref: dict[str, np.ndarray], out: dict[str, np.ndarray], min_cosine: float
                    ) -> list[str]:
    """Problems of ``out`` against ``ref`` (outputs matched by :func:`compare.match_outputs`):
    shapes, integer differences, non-finite values, cosine similarity below ``min_cosine``."""
    problems = []
    for d in compare(ref, out):
        on = d.out_name
        if d.status == "missing":
            continue
        if d.status == "shape":
            problems.append(f"output {on} shape {list(d.shape_out)} vs PyTorch {list(d.shape_ref)}")
        elif d.status == "integer_differs":
            problems.append(f"output {on} (integer) differs from PyTorch")
        elif d.status == "nonfinite":
            problems.append(f"output {on} has {d.nonfinite} NaN/inf values where PyTorch is "
                            "finite")
        elif d.parity is not None and _nan_safe_below(d.parity["cosine_min"], min_cosine):
            problems.append(f"output {on} differs from PyTorch (cosine min "
                            f"{d.parity['cosine_min']:.6f} < {min_cosine}, max abs err "
                            f"{d.parity['max_abs_err']:.3g})")
    if len(out) < len(ref):
        problems.append(f"the file has {len(out)} outputs, PyTorch {len(ref)}")
    return problems


def suspects(lint_results: Sequence[dict], checks: Sequence[str]) -> list[dict]:
    return [r for r in lint_results if r["check"] in checks and r["status"] in ("fail", "warn")]
