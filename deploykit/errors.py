"""The two error kinds every stage maps to exit codes: :class:`StageError` (runtime, exit 1)
and :class:`UsageError` (bad arguments, exit 2 with the usage line).
"""
from __future__ import annotations

import re




# --------------------------------------------------------------------------------------------
# Errors and CLI wiring
# --------------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A runtime failure of a stage (missing artifact, backend failure). Exit status 1."""


class UsageError(ValueError):
    """Bad command-line input. Exit status 2, with the usage line and the message."""


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
