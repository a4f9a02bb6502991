"""The two error kinds every stage maps to exit codes: :class:`StageError` (runtime, exit 1)
and :class:`UsageError` (bad arguments, exit 2 with the usage line); and the backends' errors
(out of memory, ONNX Runtime failing to load a model) as one line with the fix.
"""
from __future__ import annotations

import re
from typing import Callable


# --------------------------------------------------------------------------------------------
# Errors and CLI wiring
# --------------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A runtime failure of a stage (missing artifact, backend failure). Exit status 1."""


class UsageError(ValueError):
    """Bad command-line input. Exit status 2, with the usage line and the message."""


def clip_text(text: str, n: int) -> str:
    """``text`` on one line (every run of whitespace, newlines included, becomes one space: a
    multi-line ORT or torch message would break a markdown table row), cut to at most ``n``
    characters plus an ellipsis (`` ...``) at a clause or word boundary in its second half, else
    at ``n``; a text of ``n`` characters or fewer after that is returned whole. The caller keeps
    the whole text elsewhere (the row's JSON, REPORT.csv)."""
    text = " ".join(str(text).split())
    if len(text) <= n:
        return text
    cut = text[:n]
    for sep in ("; ", ", ", " "):
        i = cut.rfind(sep)
        if i > n // 2:
            return cut[:i] + " ..."
    return cut + " ..."


# --------------------------------------------------------------------------------------------
# Out-of-memory errors of the backends, translated into one line with the fix
# --------------------------------------------------------------------------------------------
# The messages the backends raise (matched as text: ORT and PyTorch raise generic types):
# - ONNX Runtime's arena (onnxruntime/core/framework/bfc_arena.cc, AllocateRawInternal):
#   "Failed to allocate memory for requested buffer of size 17592186044416"
# - ONNX Runtime's CUDA EP (core/providers/cuda/cuda_call.cc): "CUDA failure 2: out of memory"
# - PyTorch's CPU allocator (c10/core/impl/alloc_cpu.cpp): "DefaultCPUAllocator: can't allocate
#   memory: you tried to allocate 1125899906842624 bytes. Error code 12 ..."
# - PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, OutOfMemoryError):
#   "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ..."
_OOM_BYTES = re.compile(r"(?:requested buffer of size|you tried to allocate) (\d+)")
_OOM_HUMAN = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_OOM_ANY = re.compile(r"out of memory|Failed to allocate memory|can't allocate memory|"
                      r"not enough memory|bad_alloc|std::bad_alloc|OutOfMemory", re.I)


def _human(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def out_of_memory_message(e: BaseException | str, batch: int | None, what: str) -> str | None:
    """One line for a backend's out-of-memory error (ONNX Runtime's arena or CUDA EP, PyTorch's
    CPU or CUDA allocator), or None when ``e`` is no out-of-memory error.

    Args:
        e: the backend's exception (or its text). batch: the batch size (samples per call)
            that ran out of memory (None: unknown). what: the backend and model, for the message
            (e.g. ``onnxruntime running fp32.onnx``).
    Returns:
        ``"<what> ran out of memory at batch B (it asked for N GiB): rerun with a smaller
        batch (--batch-size B/2) ..."``; the memory asked for when the error says it.
    """
    text = " ".join(str(e).split())
    if type(e).__name__ not in ("OutOfMemoryError", "MemoryError") and not _OOM_ANY.search(text):
        return None
    m, h = _OOM_BYTES.search(text), _OOM_HUMAN.search(text)
    asked = f" (it asked for {_human(int(m[1]))})" if m else (f" (it asked for {h[1]})" if h
                                                               else "")
    at = f" at batch {batch}" if batch else ""
    smaller = f"--batch-size {max(1, batch // 2)}" if batch and batch > 1 else "--batch-size 1"
    return (f"{what} ran out of memory{at}{asked}: rerun with a smaller batch ({smaller}; "
            "--latency-batch too when it is the latency run), or free memory (other jobs on "
            "this machine / GPU)")


# --------------------------------------------------------------------------------------------
# ONNX Runtime's model-loading errors, translated into one line with the fix
# --------------------------------------------------------------------------------------------
def ort_load_error(label: str, version: str, msg: str,
                   nodes_of: Callable[[str, str], list[str]]) -> str:
    """One line for an ``InferenceSession`` that failed to load ``label``: the opset, IR
    version, custom op or unknown operator named with the node and the fix; else ORT's message.

    Args:
        label: the model as the user knows it (a path). version: ``onnxruntime.__version__``.
        msg: ORT's message. nodes_of: ``(domain, op) -> node names`` of the model (for a custom
            op ORT does not implement).
    """
    head = f"onnxruntime {version} cannot load {label}"
    m = re.search(r"Opset (\d+) is under development.*?domain ([\w.]+) is till opset (\d+)",
                  msg, re.S)
    if m:
        return (f"{head}: it is stamped opset {m[1]} of {m[2]}, this onnxruntime runs up to "
                f"opset {m[3]}: re-export with an opset <= {m[3]} (2_export_onnx.py "
                "--opset), or upgrade onnxruntime")
    m = re.search(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)", msg)
    if m:
        return (f"{head}: ONNX IR version {m[1]}, this onnxruntime reads up to {m[2]}: save it "
                f"with ir_version = {m[2]} (an older onnx package), or upgrade onnxruntime")
    m = re.search(r"Fatal error: ([\w.]*):(\w+)\(", msg)
    if m:
        nodes = nodes_of(m[1], m[2])
        return (f"{head}: node{'s' if len(nodes) > 1 else ''} "
                f"{', '.join(map(repr, nodes[:5])) or '?'} use{'' if len(nodes) > 1 else 's'} "
                f"{m[1]}:{m[2]}, a custom op this onnxruntime does not implement: register "
                "its kernel library (SessionOptions.register_custom_ops_library) or export "
                "the model without it")
    m = re.search(r'In Node, \("([^"]*)", (\w+), "([^"]*)".*?No Op registered for \w+ with '
                  r"domain_version of (\d+)", msg, re.S)
    if m:
        return (f"{head}: node {m[1]!r} has op {m[2]}, which opset {m[4]} of "
                f"{m[3] or 'ai.onnx'} does not define: fix the op type, or export with an "
                "opset that has it")
    return f"{head}: {msg}"
