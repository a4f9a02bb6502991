"""Stage 7 support: plan-load diagnosis, fitting a batch into a profile, batch invariance.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence
import numpy as np

from deploykit.errors import UsageError
from deploykit.trt.parsers import PLAN_HEADER_BYTES, classify_plan_load_error
from deploykit.trt.profiles import fmt_dims


# --------------------------------------------------------------------------------------------
# Stage 7: plan-load diagnosis, profile fit, batch invariance
# --------------------------------------------------------------------------------------------
def diagnose_plan_load(plan: Path | str, log: str, runtime_version: Sequence[int] | None) -> dict:
    """:func:`deploykit.trt.parsers.classify_plan_load_error` for a plan file: reads its first bytes and
    size, then classifies ``log`` (what the runtime logged). Returns the classification with a
    one-line ``text`` ("<message>. Fix: <fix>")."""
    plan = Path(plan)
    head, size = None, None
    try:
        size = plan.stat().st_size
        with open(plan, "rb") as f:
            head = f.read(PLAN_HEADER_BYTES)
    except OSError:
        pass
    res = classify_plan_load_error(log, head, runtime_version=runtime_version, file_size=size,
                                   plan=str(plan))
    res["text"] = f"{res['message']}. Fix: {res['fix']}"
    return res


def fit_batch(profile: Sequence[Sequence[int]], want: int, sample_shape: Sequence[int],
              what: str = "engine") -> int:
    """The batch to run an input at: ``want`` clipped to the profile's batch range, after checking
    that one sample's shape (``[C, H, W]`` ...) fits the profile's other axes.

    Args:
        profile: ``(min, opt, max)`` shapes of the input (engine or build record).
        want: requested batch (e.g. ``--batch-size``).
        sample_shape: shape of one preprocessed sample, without the batch axis.
    Raises:
        UsageError: the sample does not fit (names the profile and the stage-6 flags to rebuild).
    """
    lo, _opt, hi = (tuple(int(d) for d in s) for s in profile)
    rest = tuple(int(d) for d in sample_shape)
    if len(lo) != len(rest) + 1 or any(not (a <= s <= b) for a, s, b in
                                       zip(lo[1:], rest, hi[1:])):
        raise UsageError(f"the {what} takes {fmt_dims(lo)} .. {fmt_dims(hi)}, a sample is "
                         f"N x {fmt_dims(rest)}: rebuild with 6_build_engines.sh --input-shape / "
                         "--min-shapes/--opt-shapes/--max-shapes covering it")
    return max(lo[0], min(int(want), hi[0]))


# Heuristic, not from a source: a batch-1 result may differ from the batch-N one by kernel choice
# (accumulation order); 1 % of the largest |logit| passes FP16 accumulation-order noise (~1e-3
# relative) and flags real divergence. Top-1 must agree on every image.
BATCH_INVARIANCE_REL_TOL = 1e-2


# Known-issue note for a flagged row. No TensorRT release note documenting batch-dependent GEMV
# results at batch 1 was found in the 8.6-11.x release notes searched for this toolkit; related
# public reports: NVIDIA/TensorRT#4796 (10.x: identical samples in one batch give different
# outputs, open), NVIDIA/TensorRT#4813 (11.1, open), NVIDIA/TensorRT-LLM#1879 (NVIDIA: "different
# batch sizes may lead to different kernels. So, the results can be different. This is a known
# issue.").
BATCH_INVARIANCE_NOTE = (
    "TensorRT may choose different kernels per batch size (e.g. a GEMV path at batch 1), so "
    "batch-1 and batch-N outputs can differ; no TensorRT release note documenting this was found "
    "(searched 8.6-11.x release notes); related reports: NVIDIA/TensorRT#4796, #4813, "
    "NVIDIA/TensorRT-LLM#1879. Score with the batch you deploy, or rebuild with "
    "--opt-batch 1 / a static batch-1 profile for batch-1 deployment.")


def batch_invariance(infer: Callable[[dict], Mapping[str, np.ndarray]],
                     feed: Mapping[str, np.ndarray], batch: int, output_name: str | None = None,
                     rel_tol: float = BATCH_INVARIANCE_REL_TOL) -> dict:
    """Run the same samples at batch 1 and at batch ``batch`` and compare the outputs.

    Every batch-N call has exactly ``batch`` rows (the last one is padded with the first samples
    and the padding discarded), so the engine really runs at that batch.

    Args:
        infer: a runner's ``infer(feed) -> {output name: array}``.
        feed: ``{input name: array [M, ...]}`` (M >= 1 samples, batch on axis 0), preprocessed.
        batch: N (>= 2).
        output_name: output to compare (default: the first one returned).
        rel_tol: allowed max |difference| as a fraction of max |output at batch 1|.
    Returns:
        ``{"batch": N, "n": M, "max_abs_diff": float, "max_abs_ref": float,
        "rel_max_diff": float, "rel_tol": float, "top1_agreement": float (0..1 over the M
        samples; None for outputs with one value per sample), "ok": bool,
        "note": str | None (the known-issue note when not ok)}``.
    Raises:
        UsageError: ``batch < 2`` or no samples.
    """
    n = len(next(iter(feed.values()))) if feed else 0
    if batch < 2 or n < 1:
        raise UsageError(f"batch invariance needs batch >= 2 and samples (got {batch}, {n})")

    def out_of(idx):
        res = infer({k: v[idx] for k, v in feed.items()})
        return np.asarray(res[output_name] if output_name else next(iter(res.values())),
                          dtype=np.float64)

    one = np.concatenate([out_of(np.array([i])) for i in range(n)])
    many = []
    for i in range(0, n, batch):
        idx = np.arange(i, min(i + batch, n))
        real = len(idx)
        if real < batch:
            idx = np.concatenate([idx, np.arange(batch - real) % n])
        many.append(out_of(idx)[:real])
    many = np.concatenate(many)
    diff = float(np.max(np.abs(one - many))) if one.size else 0.0
    ref = float(np.max(np.abs(one))) if one.size else 0.0
    rel = diff / ref if ref > 0 else (0.0 if diff == 0 else float("inf"))
    flat1, flatn = one.reshape(len(one), -1), many.reshape(len(many), -1)
    top1 = (float(np.mean(flat1.argmax(1) == flatn.argmax(1)))
            if flat1.shape[1] > 1 else None)
    ok = rel <= rel_tol and (top1 is None or top1 == 1.0)
    return {"batch": int(batch), "n": int(n), "max_abs_diff": diff, "max_abs_ref": ref,
            "rel_max_diff": rel, "rel_tol": rel_tol, "top1_agreement": top1, "ok": bool(ok),
            "note": None if ok else BATCH_INVARIANCE_NOTE}
