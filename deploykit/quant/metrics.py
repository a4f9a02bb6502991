"""Agreement metrics of a model's logits against reference (PyTorch FP32) logits, with the
statistical resolution of the split they are measured on."""
from __future__ import annotations

import math

import numpy as np

from deploykit.compare import cosine_rows


def compare(logits: np.ndarray, ref: np.ndarray, labels: np.ndarray | None = None) -> dict:
    """Top-1 agreement, cosine and top-1 accuracy of ``logits`` vs ``ref``.

    Args:
        logits, ref: float ``[N, C]``; labels: int ``[N]`` or None.
    Returns:
        ``{"n", "agree_pct", "flips", "cos_mean", "cos_min", "top1_pct" (with labels),
        "finite"}``; NaN/Inf logits give ``finite`` False and cosine -1 for those rows.
    """
    logits = np.asarray(logits, np.float64)
    ref = np.asarray(ref, np.float64)
    finite = np.isfinite(logits).all(axis=1)
    a = np.where(finite[:, None], logits, 0.0)
    cos = np.where(finite, cosine_rows(a, ref), -1.0)  # deploykit.compare's cosine
    agree = (a.argmax(1) == ref.argmax(1)) & finite
    out = {"n": int(len(ref)), "agree_pct": float(100 * agree.mean()),
           "flips": int((~agree).sum()), "cos_mean": float(cos.mean()),
           "cos_min": float(cos.min()), "finite": bool(finite.all())}
    if labels is not None:
        out["top1_pct"] = float(100 * ((a.argmax(1) == labels) & finite).mean())
    return out


def disagreement_upper_bound(flips: int, n: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound (in %) on the disagreement rate after ``flips``
    disagreements in ``n`` images (bisection on the binomial CDF).

    Returns:
        percent in [0, 100].
    """
    if flips >= n:
        return 100.0
    alpha = 1 - confidence

    def cdf(p):  # P[X <= flips] for X ~ Bin(n, p)
        return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(flips + 1))

    lo, hi = flips / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if cdf(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return 100 * hi
