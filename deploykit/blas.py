"""numpy's OpenBLAS thread pool for a pipeline process: one thread.

numpy's wheels bring their own OpenBLAS (``libscipy_openblas``), which starts one thread per
core and keeps them spinning for a while after each BLAS call. In a stage that spends its time
in ONNX Runtime or PyTorch (each with its own thread pool over every core), those spinning
threads take cores from them; numpy's own BLAS work here is small (metrics, histograms,
ModelOpt's INT4 clip search). Measured on this project's 2-core CPU machine (AMD EPYC with
AVX512-VNNI, 2026-12-06), ``MODEL=efficientnet_lite0 bash run_all.sh`` one run after the other:
175.4 s wall and 237.0 s of user CPU time with OpenBLAS's default, 169.6 s and 225.0 s with one
thread (``benchmarks/README.md``).

:func:`limit_numpy_blas` sets the pool of the OpenBLAS that numpy loaded in this process through
threadpoolctl (so PyTorch's BLAS, MKL or an OpenBLAS of its own on aarch64, keeps its threads)
and ``OPENBLAS_NUM_THREADS`` for the processes it starts (ModelOpt's calibration child). A
user's own ``OPENBLAS_NUM_THREADS`` is kept. ``DEPLOYKIT_BLAS_THREADS=N`` asks for N threads,
``DEPLOYKIT_BLAS_THREADS=default`` leaves OpenBLAS as it is. Every results row records the
setting (:func:`policy`).
"""
from __future__ import annotations

import os

from deploykit.errors import UsageError

ENV = "DEPLOYKIT_BLAS_THREADS"
#: values of :data:`ENV` that leave OpenBLAS's own thread count (case-insensitive)
OPT_OUT_VALUES = ("default", "off", "no", "false")
#: threadpoolctl's name prefix of the OpenBLAS that numpy's wheels bundle
NUMPY_OPENBLAS_PREFIX = "libscipy_openblas"

_APPLIED: int | None = None  # the thread count limit_numpy_blas() set in this process
_CHILDREN_ONLY: int | None = None  # set for the children only (no threadpoolctl here)


def _requested(environ) -> int | None:
    raw = environ.get(ENV, "").strip()
    if raw.lower() in OPT_OUT_VALUES:
        return None
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"{ENV}={raw!r}: give a number of threads (>= 1), or 'default' to "
                         "leave numpy's OpenBLAS as it is")
    return int(raw)


def limit_numpy_blas(environ: dict | None = None) -> int | None:
    """Limit numpy's OpenBLAS to one thread (or ``$DEPLOYKIT_BLAS_THREADS``) in this process, and
    set ``OPENBLAS_NUM_THREADS`` in ``environ`` (default ``os.environ``) for the processes it
    starts, unless the user set it.

    Args:
        environ: the environment to read and to give the children (default ``os.environ``).
    Returns:
        the thread count set, or None when left alone (opted out, or the user's own
        ``OPENBLAS_NUM_THREADS`` other than the count asked for).
    Raises:
        UsageError: ``DEPLOYKIT_BLAS_THREADS`` is neither a positive number nor an opt-out value.
    """
    global _APPLIED, _CHILDREN_ONLY
    env = os.environ if environ is None else environ
    n = _requested(env)
    own = env.get("OPENBLAS_NUM_THREADS")
    if n is None or (own and own != str(n)):  # opted out, or the user's own setting
        return None
    # the children (and stages they run) ask for the same count and read it as this policy's
    env["OPENBLAS_NUM_THREADS"] = env[ENV] = str(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # the children still get the variable; this process keeps its pool
        if environ is None:
            _CHILDREN_ONLY = n
        return None
    threadpool_limits(limits={NUMPY_OPENBLAS_PREFIX: n})
    if environ is None:
        _APPLIED = n
    return n


def policy() -> str:
    """What this process runs numpy's BLAS with, for a row's provenance: ``"numpy OpenBLAS: 1
    thread(s)"``, ``"OPENBLAS_NUM_THREADS=4 (the user's)"``, ``"OpenBLAS default"``, or without
    threadpoolctl ``"OpenBLAS default here (no threadpoolctl), 1 thread(s) in child
    processes"``."""
    if _APPLIED is not None:
        return f"numpy OpenBLAS: {_APPLIED} thread(s)"
    if _CHILDREN_ONLY is not None:
        return (f"OpenBLAS default here (no threadpoolctl), {_CHILDREN_ONLY} thread(s) in "
                "child processes")
    own = os.environ.get("OPENBLAS_NUM_THREADS")
    return f"OPENBLAS_NUM_THREADS={own} (the user's)" if own else "OpenBLAS default"
