"""The C allocator's policy for a pipeline process: keep freed memory instead of handing it
back to the kernel.

Every stage is a short batch process that allocates and frees the same large arrays over and
over (PyTorch activations of each chunk, the tensors ORT hands back during calibration, numpy
temporaries of the metrics and histograms). glibc's ``malloc`` serves large blocks with
``mmap`` and trims the top of its heap as soon as a few hundred KB lie free there, so each such
array is faulted in page by page again, every time. Measured on this project's 2-core CPU
machine (AMD EPYC with AVX512-VNNI, 2026-12-06), ``1_pytorch_baseline.py`` on EfficientNet-Lite0,
two runs each: 21.7-22.1 s wall, 11.6 s of system time, 5.8-6.2 M minor page faults and a peak
RSS of 1.23-1.25 GB by default; 15.0-15.4 s, 1.1-1.2 s, 0.22 M and 1.42-1.44 GB with
:func:`keep_freed_memory` (the same logits). A default run's peak (ModelOpt's calibration,
6.5 GB) is the same either way. PyTorch's CPU performance tuning guide makes the same point and
recommends jemalloc or TCMalloc; glibc's own settings need no extra library.

Off with ``DEPLOYKIT_MALLOC=default`` (or ``off``, ``0``, ``no``, ``false``) in the environment;
a user's own ``GLIBC_TUNABLES`` malloc settings are also left as they are. A process that starts
a heavy child (ModelOpt's calibration) hands its free memory back first
(:func:`release_freed_memory`), so that the two do not hold more together than before; every
results row records the policy in its provenance (:func:`policy`).
"""
from __future__ import annotations

import ctypes
import functools
import os

OPT_OUT_ENV = "DEPLOYKIT_MALLOC"
#: values of :data:`OPT_OUT_ENV` that leave glibc's defaults (case-insensitive)
OPT_OUT_VALUES = ("default", "off", "0", "no", "false")
# mallopt(3) parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# the largest value mallopt's int parameter takes: the heap keeps up to 2 GiB free at its top
_TRIM_THRESHOLD = 2**31 - 1
# the same policy as glibc tunables, so that child processes (ModelOpt's, ORT's quantizer's)
# start with it: the glibc manual, "Memory Allocation Tunables"
_TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={_TRIM_THRESHOLD}"


_APPLIED = False  # keep_freed_memory() set this process's allocator


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc as this process already has it loaded (``ctypes.CDLL(None)``: no library search),
    or None off glibc."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, ValueError, OSError):  # no confstr / name unknown here: not glibc
        return None


def keep_freed_memory(environ: dict | None = None) -> bool:
    """Make glibc's ``malloc`` in this process keep freed memory for reuse: no ``mmap`` for
    large blocks (``M_MMAP_MAX`` 0, so they come from the heap) and no trimming of the heap's top
    below 2 GiB free (``M_TRIM_THRESHOLD``), per mallopt(3). The same settings go into
    ``GLIBC_TUNABLES`` of ``environ`` (default ``os.environ``), so that processes started
    afterwards get them from their first allocation.

    Freed blocks are reused, not returned to the kernel until the process exits or calls
    :func:`release_freed_memory`, so a process's peak can be somewhat higher (stage 1: 1.43
    against 1.24 GB, see the module docstring).

    Args:
        environ: the environment to read the opt-out from and to put the tunables into.

    Returns:
        True when the settings were applied; False on a C library other than glibc (musl,
        macOS, Windows), with an opt-out value (:data:`OPT_OUT_VALUES`), or when the user's
        ``GLIBC_TUNABLES`` already sets a ``glibc.malloc`` tunable (theirs are kept). True
        without a call when this process's ``GLIBC_TUNABLES`` already hold the policy's own
        (a child of a pipeline process: glibc applied them at its start). Never raises.
    """
    global _APPLIED
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT_ENV, "").strip().lower() in OPT_OUT_VALUES:
        return False
    tunables = env.get("GLIBC_TUNABLES", "")
    if _TUNABLES in tunables and environ is None:
        # started by a pipeline process that applied the policy (stage 5's INT4 child, its
        # ModelOpt worker): glibc read these tunables when this process started
        _APPLIED = True
        return True
    if "glibc.malloc." in tunables:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on an invalid value
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        return False
    env["GLIBC_TUNABLES"] = f"{tunables}:{_TUNABLES}" if tunables else _TUNABLES
    _APPLIED = True
    return True


def release_freed_memory() -> bool:
    """Hand this process's free heap memory back to the kernel now (glibc ``malloc_trim(0)``,
    which also releases whole free pages inside the heap), e.g. before starting a child that
    needs a lot of memory while this process waits. A no-op returning False off glibc or when
    :func:`keep_freed_memory` was not applied here (glibc's default trims by itself); never
    raises.

    Measured (this project's 2-core CPU machine, 2026-12-06, by a reviewer): with the policy and
    no release, ``5_quantize.py --default --eval`` held 1.03 GB in the parent while ModelOpt's
    child calibrated (0.75 GB without the policy), 1.94 GB at most together (1.65 GB).
    """
    libc = _libc() if _APPLIED else None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True


def policy() -> str:
    """This process's allocator policy, for a results row's provenance: ``"keep freed memory
    (deploykit.alloc)"`` or ``"C library default"`` (opted out, or not glibc)."""
    return "keep freed memory (deploykit.alloc)" if _APPLIED else "C library default"
