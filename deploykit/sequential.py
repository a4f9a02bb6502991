"""Deciding a row on a first look: a failure beyond doubt needs no more samples.

A row whose outputs have collapsed (ORT's ``WeightBiasQuantization`` on fp16 scales: top-1
agreement 0.1 % with PyTorch) is ``failed`` after a few dozen images; running the other 800 only
sharpens a figure nobody ships. :func:`first_look_indices` draws a seeded random sample of the
evaluation split (the split is ordered by class, so its first images are not a sample of it),
and :func:`failed_beyond_doubt` says whether that sample already proves the row ``failed``
under :data:`deploykit.compare.ROW_TOLERANCES`:

- NaN/Inf outputs where the reference is finite: failed, whatever the other samples hold;
- ``cosine_min`` below its failed bound: the minimum over more samples can only be lower;
- ``top1_agreement`` and ``cosine_mean`` (means of per-sample values in [0, 1] and [-1, 1]):
  failed when the observed mean plus Hoeffding's deviation ``range * sqrt(ln(1/alpha) / (2n))``
  is still below the failed bound. Hoeffding's inequality holds for any distribution of the
  per-sample values and for a sample drawn without replacement from the finite split
  (W. Hoeffding, "Probability inequalities for sums of bounded random variables", JASA 58,
  1963, Theorem 1 and Section 6), so the chance that the whole split would not have failed is
  below ``alpha``.

Stage 3 looks twice before the rest: :data:`FIRST_PEEK` samples (a collapse shows there),
then the :data:`FIRST_LOOK` samples they are part of, each look at ``ALPHA / 2``, so that the
chance of a wrong early ``failed`` over both looks stays below :data:`ALPHA` (1e-4; Bonferroni:
the chance of either of two events is at most the sum of theirs).

Nothing here ever decides ``ok`` or ``warn`` early: a row that may pass is measured on every
sample. Stage 3 uses it (``--full-eval`` measures every sample whatever the first look shows).
"""
from __future__ import annotations

import math

import numpy as np

from deploykit.compare import row_tolerance

#: Samples of the first look (the backend cross-check's first look has the same size).
FIRST_LOOK = 128

#: Samples of the earlier look inside the first one (a random part of it).
FIRST_PEEK = 32

#: Chance, at most, that a row decided ``failed`` on the first look would not have failed on
#: the whole split (Hoeffding's bound; see the module docstring), over both looks.
ALPHA = 1e-4

#: The chance each of the two looks (:data:`FIRST_PEEK`, :data:`FIRST_LOOK`) is judged at.
LOOK_ALPHA = ALPHA / 2

#: Seed of the first look's sample (the same images every run, every backend).
FIRST_LOOK_SEED = 0


def seeded_sample(n_total: int, n: int, seed: int = FIRST_LOOK_SEED) -> np.ndarray:
    """``n`` of ``range(n_total)`` drawn without replacement by a generator seeded with ``seed``
    (int64 ``[n]``, in draw order): the draw behind every seeded sample of a split."""
    return np.random.default_rng(seed).choice(n_total, size=n, replace=False).astype(np.int64)


def first_look_indices(n_total: int, n: int = FIRST_LOOK, seed: int = FIRST_LOOK_SEED,
                       peek: int = 0) -> np.ndarray | None:
    """The sample indices of the first look: ``n`` of ``range(n_total)`` drawn without
    replacement by a seeded generator, in increasing order; with ``peek``, the first ``peek``
    of that draw (a random part of the same look), in increasing order.

    Args:
        n_total: samples in the split. n: samples to look at first. seed: generator seed.
        peek: 0 for the whole look, else the size of the earlier look inside it (``<= n``).
    Returns:
        int64 ``[n]`` (or ``[peek]``) sorted indices, or None when a first look would save
        nothing (``n_total <= 2 * n``: the split is at most two looks long) or ``n <= 0``.
    """
    if n <= 0 or n_total <= 2 * n:
        return None
    draw = seeded_sample(n_total, n, seed)
    return np.sort(draw[:peek] if peek > 0 else draw)


def look_schedule(n_total: int, n: int = FIRST_LOOK, seed: int = FIRST_LOOK_SEED
                  ) -> list[np.ndarray]:
    """The nested looks of a first look of ``n`` samples: ``[peek, look]`` (a random
    :data:`FIRST_PEEK` of the look, then the whole look) when the look holds at least two
    peeks, else ``[look]``; each sorted int64 (:func:`first_look_indices`). Empty when a first
    look would save nothing.

    Args:
        n_total: samples in the split. n: samples of the first look. seed: generator seed.
    """
    look = first_look_indices(n_total, n, seed)
    if look is None:
        return []
    if n < 2 * FIRST_PEEK:
        return [look]
    return [first_look_indices(n_total, n, seed, peek=FIRST_PEEK), look]


def decided_indices(block: dict | None) -> np.ndarray | None:
    """The sample indices a row decided on its first look was measured on, from its
    ``first_look`` block (``n``, ``n_total``, ``seed``, and ``look`` when it began with a
    smaller look: ``n`` then names the deciding one); None when no look decided the row.
    Blocks written before the two-look schedule (no ``look``) name one look of ``n``."""
    if not (block or {}).get("decided"):
        return None
    seed, look = block.get("seed", FIRST_LOOK_SEED), block.get("look") or block["n"]
    return first_look_indices(block["n_total"], look, seed,
                              peek=block["n"] if block["n"] != look else 0)


def hoeffding_margin(n: int, value_range: float, alpha: float = ALPHA) -> float:
    """Hoeffding's one-sided deviation of a mean of ``n`` values spread over ``value_range``:
    ``value_range * sqrt(ln(1/alpha) / (2n))`` (the true mean exceeds the observed one by more
    than this with probability below ``alpha``; Hoeffding 1963, Theorem 1).

    Args:
        n: samples (> 0). value_range: max - min of one sample's value. alpha: in (0, 1).
    Returns:
        the margin, in the unit of the values.
    Raises:
        ValueError: ``n <= 0`` or ``alpha`` outside (0, 1).
    """
    if n <= 0 or not 0 < alpha < 1:
        raise ValueError(f"hoeffding_margin: n={n} must be > 0 and alpha={alpha} in (0, 1)")
    return value_range * math.sqrt(math.log(1.0 / alpha) / (2.0 * n))


def failed_beyond_doubt(precision: str, parities: dict[str, dict] | None,
                        nonfinite: dict[str, int] | None, n: int, alpha: float = ALPHA
                        ) -> list[str]:
    """Why a row measured on a random sample of ``n`` samples is ``failed`` on the whole split
    beyond doubt (see the module docstring for the rules and their source).

    Args:
        precision: the row's precision label (``deploykit.compare.row_tolerance``).
        parities: ``{output name: parity}`` on the sample (``deploykit.compare.parity``:
            ``cosine_mean``, ``cosine_min``, ``top1_agreement`` in %).
        nonfinite: ``{output name: NaN/Inf count where the reference is finite}`` or None.
        n: samples in the first look. alpha: the chance bound.
    Returns:
        one reason per decisive metric (e.g. ``"logits top1_agreement 0.8 % + 19.2 (Hoeffding,
        128 samples) < 90.0 % (INT8 failed bound)"``); empty when the sample does not decide
        (measure every sample).
    """
    reasons = [f"{name}: {cnt} NaN/Inf values where the reference is finite"
               for name, cnt in (nonfinite or {}).items() if cnt]
    if n <= 0:
        return reasons
    band, bounds = row_tolerance(precision)
    for out, par in (parities or {}).items():
        for metric, b in bounds.items():
            v, bound = (par or {}).get(metric), b.get("failed")
            if v is None or bound is None:
                continue
            if not np.isfinite(v):
                reasons.append(f"{out} {metric} not finite")
            elif metric == "cosine_min":
                if v < bound:
                    reasons.append(f"{out} cosine_min {v:.4f} < {bound} ({band.upper()} failed "
                                   "bound; more samples can only lower a minimum)")
            elif metric == "top1_agreement":
                m = 100.0 * hoeffding_margin(n, 1.0, alpha)
                if v + m < bound:
                    reasons.append(f"{out} top1_agreement {v:.1f} % + {m:.1f} (Hoeffding, {n} "
                                   f"samples, alpha {alpha:g}) < {bound} % ({band.upper()} "
                                   "failed bound)")
            elif metric == "cosine_mean":
                m = hoeffding_margin(n, 2.0, alpha)
                if v + m < bound:
                    reasons.append(f"{out} cosine_mean {v:.4f} + {m:.4f} (Hoeffding, {n} "
                                   f"samples, alpha {alpha:g}) < {bound} ({band.upper()} "
                                   "failed bound)")
    return reasons
