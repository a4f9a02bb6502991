"""The backend cross-check: a Q/DQ model on ORT at its default optimisation level versus the
graph's own numerics (:mod:`deploykit.quant.reference`), and the u8s8 saturation cause on CPUs
without VNNI.
"""
from __future__ import annotations

import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

from deploykit.compare import parity, topk_accuracy
from deploykit.envinfo import cpu_has_vnni
from deploykit.evaluate import run_outputs
from deploykit.quant.reference import qdq_reference_runner
from deploykit.runners import OrtRunner
from deploykit.sequential import (ALPHA, FIRST_LOOK, FIRST_LOOK_SEED, FIRST_PEEK, look_schedule,
                                  seeded_sample)


# --------------------------------------------------------------------------------------------
# Backend cross-check (stage 3): the same Q/DQ file with ORT graph optimisations off
# --------------------------------------------------------------------------------------------
#: ORT session option that makes its x86-64 int8 kernels use u8u8 instead of u8s8, which cannot
#: saturate on CPUs without VNNI (onnxruntime PR #12088, session.x64quantprecision).
X64_QUANT_PRECISION = {"session.x64quantprecision": "1"}


CROSS_CHECK_FIRST = FIRST_LOOK  # samples of the adaptive cross-check's first look

#: Samples of an earlier look inside the first one (a random part of it): a classifier whose two
#: runs already disagree there beyond doubt (:func:`disagreement_beyond_doubt`, a collapse)
#: needs no more.
CROSS_CHECK_PEEK = FIRST_PEEK


#: Samples of the first look after the rows' first look; each further look is
#: :data:`CROSS_CHECK_GROWTH` times larger, while it is smaller than the split. These are the
#: looks that can prove agreement (a classifier, when so few images are right in one run only
#: that the whole split cannot differ by more than the tolerance: with none, 2 points need some
#: 390 of 900 images; :func:`agreement_beyond_doubt`).
CROSS_CHECK_AGREE_LOOK = 512

#: Growth of the looks after :data:`CROSS_CHECK_AGREE_LOOK` (a 50,000-image split: 512, 2048,
#: 8192, 32768).
CROSS_CHECK_GROWTH = 4

#: Chance, at most, of a wrong verdict decided on a look, over all the looks (each look gets an
#: equal share; Bonferroni) - the bound the rows' first look keeps (deploykit.sequential.ALPHA).
CROSS_CHECK_ALPHA = ALPHA


def _exceeds(images: int, n: int, tol_points: float) -> bool:
    """Whether ``images`` of ``n`` are more than ``tol_points`` percent, in exact arithmetic on
    the tolerance as written (1.14 is 114/100, not the nearest double)."""
    return 100 * images > Fraction(repr(float(tol_points))) * n


def _parity_finite(ref: np.ndarray, out: np.ndarray) -> dict:
    """:func:`deploykit.compare.parity` of one output of the two runs, where NaN/Inf are judged
    as such: when both runs have the same non-finite values at the same places (the graph's
    own), the cosine is of the finite values (the others set to 0 in both) and
    ``nonfinite_same`` counts them; when they differ, ``nonfinite_differs`` counts the elements
    that are NaN/Inf in one run only or another NaN/Inf in the other (+inf against -inf) and
    the cosine stays NaN (:func:`_cos`: the lowest)."""
    if not (np.issubdtype(ref.dtype, np.floating) or np.issubdtype(out.dtype, np.floating)):
        return parity(ref, out)
    fr, fo = np.isfinite(ref), np.isfinite(out)
    if fr.all() and fo.all():
        return parity(ref, out)
    with np.errstate(invalid="ignore"):
        same = (ref == out) | (np.isnan(ref) & np.isnan(out))  # NaN, +inf, -inf alike
    differs = (fr != fo) | (~fr & ~fo & ~same)
    if not differs.any():
        par = parity(np.where(fr, ref, 0), np.where(fo, out, 0))
        par["nonfinite_same"] = int((~fr).sum())
        return par
    with np.errstate(invalid="ignore"):
        par = parity(ref, out)
    par["nonfinite_differs"] = int(differs.sum())
    return par


def _cos(par: dict) -> float:
    """An output's ``cosine_min`` for ranking and judging: NaN from non-finite values in one run
    where the other has other values (:func:`_parity_finite`) counts as the lowest, ``-inf``, so
    such an output is the worst and a disagreement; NaN from the cosine's own overflow
    (finite float64 values near 1e160) counts as ``+inf``."""
    c = par["cosine_min"]
    if np.isfinite(c):
        return c
    # NaN from finite outputs (float64 values so large that the norms overflow) is no finding
    # about the backend: it ranks last and passes, as it always did
    return -math.inf if par.get("nonfinite_differs") else math.inf


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def hypergeom_tail(x: int, n_total: int, marked: int, k: int, upper: bool) -> float:
    """``P(X >= x)`` (``upper``) or ``P(X <= x)`` for ``X`` the marked samples among ``k`` drawn
    without replacement from ``n_total`` of which ``marked`` are marked (the hypergeometric
    distribution), summed exactly in log space.

    Args:
        x: observed count. n_total, marked, k: population, marked in it, drawn (ints >= 0,
            ``marked, k <= n_total``).
    Returns:
        the probability, in [0, 1].
    """
    lo, hi = max(0, k - (n_total - marked)), min(k, marked)
    js = range(max(x, lo), hi + 1) if upper else range(lo, min(x, hi) + 1)
    den = _log_choose(n_total, k)
    return min(1.0, sum(math.exp(_log_choose(marked, j) + _log_choose(n_total - marked, k - j)
                                 - den) for j in js))


def marked_bounds(x: int, k: int, n_total: int, alpha: float) -> tuple[int, int]:
    """Exact one-sided confidence bounds on how many of ``n_total`` samples are marked, from
    ``x`` marked among a uniformly random ``k`` of them drawn without replacement: the smallest
    count ``lo`` whose chance to show ``x`` or more exceeds ``alpha``, and the largest ``hi``
    whose chance to show ``x`` or fewer does (the hypergeometric analogue of Clopper-Pearson's
    bounds; C. J. Clopper and E. S. Pearson, Biometrika 26, 1934). Each bound is wrong with
    probability at most ``alpha``.

    Args:
        x: marked samples seen (``0 <= x <= k``). k: samples drawn. n_total: samples in all.
        alpha: in (0, 1).
    Returns:
        ``(lo, hi)`` counts in ``[x, n_total - (k - x)]``.
    Raises:
        ValueError: counts out of range or ``alpha`` outside (0, 1).
    """
    if not (0 <= x <= k <= n_total) or not 0 < alpha < 1:
        raise ValueError(f"marked_bounds: need 0 <= x={x} <= k={k} <= n_total={n_total} and "
                         f"alpha={alpha} in (0, 1)")
    # P(X >= x | m) grows with m and P(X <= x | m) falls with m: bisect each.
    a, b = x, n_total - (k - x)  # lo: the smallest m with P(X >= x | m) > alpha
    while a < b:
        m = (a + b) // 2
        if hypergeom_tail(x, n_total, m, k, upper=True) > alpha:
            b = m
        else:
            a = m + 1
    lo = a
    a, b = x, n_total - (k - x)  # hi: the largest m with P(X <= x | m) > alpha
    while a < b:
        m = (a + b + 1) // 2
        if hypergeom_tail(x, n_total, m, k, upper=False) > alpha:
            a = m
        else:
            b = m - 1
    return lo, a


def disagreement_beyond_doubt(main_right: np.ndarray, ref_right: np.ndarray, tol_points: float,
                              n_total: int, alpha: float = CROSS_CHECK_ALPHA / 3) -> bool:
    """Whether a classifier's two runs, seen on a uniformly random sample of ``n`` of the split's
    ``n_total`` images, differ in top-1 by more than ``tol_points`` on the whole split beyond
    doubt.

    On the whole split the top-1 difference is ``(B - C) / n_total``, ``B`` the images right only
    in the main run, ``C`` those right only in the unoptimised one. From the ``b`` and ``c`` seen
    in the sample, :func:`marked_bounds` gives exact bounds on ``B`` and ``C`` at ``alpha / 4``
    each; the verdict is disagreement when ``B_lo - C_hi`` or ``C_lo - B_hi`` exceeds the
    tolerance, so a wrong verdict needs one of four bounds wrong (chance at most ``alpha``,
    Bonferroni).

    Args:
        main_right, ref_right: bool ``[n]``, top-1 correct per sampled image in each run.
        tol_points: tolerance in top-1 points. n_total: images in the split (``>= n``).
        alpha: chance of a wrong verdict (default: a third of :data:`CROSS_CHECK_ALPHA`, one
            look's share).
    Returns:
        True when the disagreement is beyond doubt, else False (measure every image).
    """
    n = len(main_right)
    if n == 0:
        return False
    b = int((main_right & ~ref_right).sum())
    c = int((ref_right & ~main_right).sum())
    b_lo, b_hi = marked_bounds(b, n, n_total, alpha / 4)
    c_lo, c_hi = marked_bounds(c, n, n_total, alpha / 4)
    return _exceeds(max(b_lo - c_hi, c_lo - b_hi), n_total, tol_points)


def agreement_beyond_doubt(main_pred: np.ndarray, ref_pred: np.ndarray, y: np.ndarray,
                           tol_points: float, n_total: int,
                           alpha: float = CROSS_CHECK_ALPHA / 3) -> bool:
    """Whether a classifier's two runs, seen on a uniformly random sample of ``n`` of the split's
    ``n_total`` images, agree within ``tol_points`` of top-1 on the whole split beyond doubt.

    On the whole split the top-1 difference is ``(B - C) / n_total``, ``B`` the images right only
    in the main run, ``C`` those right only in the unoptimised one (the figure the whole split is
    judged on). The sample is part of the split, so ``B >= b`` and ``C >= c`` for the ``b`` and
    ``c`` seen in it; :func:`marked_bounds` bounds ``B`` and ``C`` from above at ``alpha / 2``
    each. Agreement when both ``B_hi - c`` and ``C_hi - b`` are within the tolerance: a wrong
    verdict needs one of the two bounds wrong (chance at most ``alpha``, Bonferroni).

    Bounding ``B`` and ``C`` apart is sharper than bounding the images whose class flips (which
    also counts flips between two wrong classes): 6 flips among 512 of 900 images, 2 right only
    in each run, prove 2 points (``B_hi = C_hi = 19``, so at most 17 images either way) where the
    flips alone cannot (up to 29 of 900 may flip).

    Runs that change the top-1 class of more than twice the tolerance of the sample's images
    compute different functions even where their accuracy matches (two runs wrong everywhere
    in different ways): no early agreement then; the whole split is measured.

    Args:
        main_pred, ref_pred: int ``[n]``, the top-1 class per sampled image in each run.
        y: int ``[n]``, the labels of those images.
        tol_points: tolerance in top-1 points. n_total: images in the split (``>= n``).
        alpha: chance of a wrong verdict.
    Returns:
        True when the agreement is beyond doubt, else False (look at more images).
    """
    main_pred, ref_pred, y = np.asarray(main_pred), np.asarray(ref_pred), np.asarray(y)
    n = len(main_pred)
    if n == 0 or _exceeds(int((main_pred != ref_pred).sum()), n, 2 * tol_points):
        return False
    mr, rr = main_pred == y, ref_pred == y
    b, c = int((mr & ~rr).sum()), int((rr & ~mr).sum())
    _, b_hi = marked_bounds(b, n, n_total, alpha / 2)
    _, c_hi = marked_bounds(c, n, n_total, alpha / 2)
    return not _exceeds(max(b_hi - c, c_hi - b), n_total, tol_points)


def cross_check_looks(n_total: int) -> list[np.ndarray]:
    """The nested looks of the adaptive cross-check, each a uniformly random sample of the
    split containing the one before, as sorted int64 indices: the rows' first look
    (:func:`deploykit.sequential.look_schedule`, :data:`CROSS_CHECK_PEEK` then
    :data:`CROSS_CHECK_FIRST` images, when the split is over twice that), then
    :data:`CROSS_CHECK_AGREE_LOOK` images and :data:`CROSS_CHECK_GROWTH` times more at each
    further look, while a look is smaller than the split (each the look before plus a seeded
    draw from the rest).

    Args:
        n_total: samples in the split.
    Returns:
        index arrays, each a superset of the one before (none for a split of 256 or fewer).
    """
    looks = look_schedule(n_total, CROSS_CHECK_FIRST)
    size, step = CROSS_CHECK_AGREE_LOOK, 1
    while size < n_total:
        base = looks[-1] if looks else np.zeros(0, np.int64)
        rest = np.setdiff1d(np.arange(n_total, dtype=np.int64), base)
        extra = np.random.default_rng(FIRST_LOOK_SEED + step).choice(
            rest, size=size - len(base), replace=False)
        looks.append(np.sort(np.concatenate([base, extra])).astype(np.int64))
        size, step = size * CROSS_CHECK_GROWTH, step + 1
    return looks


def backend_cross_check(onnx_path: Path | str, data, outputs: dict[str, np.ndarray], *,
                        n: int = -1, batch: int = 64, tol_points: float = 2.0,
                        min_cosine: float = 0.99, opt_level: str = "all",
                        session_config: dict | None = None,
                        population: int | None = None) -> dict:
    """Rerun a Q/DQ model in the graph's own numerics (each DequantizeLinear/QuantizeLinear as
    written + float ops: :func:`deploykit.quant.reference.qdq_reference_runner`, ORT's default
    level with its Q/DQ rewrites off where its optimised graph passes the node check, else every
    optimisation off; ``reference`` / ``reference_why`` in the record) on the samples of the
    main run and compare, for any model.

    ONNX Runtime is not a neutral judge of Q/DQ graphs (``WeightBiasQuantization``, QDQ fusions
    into integer kernels): a result that changes here is the backend's, not the quantization's.

    ``n < 0`` is adaptive: nested seeded random looks (:func:`cross_check_looks`: 32, 128, 512
    samples, then 4 times more per look on a larger split; the split is ordered by class, so its
    first images are no sample of it), then every sample. A look ends the check when it decides beyond doubt: for classifiers
    :func:`disagreement_beyond_doubt` or :func:`agreement_beyond_doubt` (exact bounds; the
    chance of any wrong early verdict is below :data:`CROSS_CHECK_ALPHA` over all looks), for
    other models only a disagreement, an output whose cosine is already below ``min_cosine``
    (more samples can only lower a minimum). ``decided_on_first_look`` says whether a look
    decided, ``decided`` what ("disagreement", "agreement" or None).
    ``n >= 0`` measures exactly ``n`` samples (a seeded random sample when ``n`` is below the
    split's size). ``population``: the split's size when ``data`` is already a seeded random
    sample of it (the samples of a row decided on its first look, deploykit.evaluate.
    evaluated_data): every sample of ``data`` runs, whatever ``n``, and the verdict is one
    beyond doubt about
    the whole split (the same exact bounds, at :data:`CROSS_CHECK_ALPHA`), else ``None``
    (undecided: ``--full-eval`` measures every sample). When the two disagree on an x86-64 CPU without VNNI, the optimised graph is
    run once more with :data:`X64_QUANT_PRECISION` to tell u8s8 kernel saturation from a graph
    optimiser effect (``cause``).

    Args:
        data: ``deploykit.evaluate.EvalData`` of the main run (classifier images with labels, or a feed).
        outputs: ``{output name: array [N, ...]}`` of the main run (same order of samples).
        n: samples to measure (``< 0``: adaptive, see above).
        batch: samples per run (the model's static batch, if any, wins: deploykit.evaluate.run_outputs).
        tol_points: classifiers: top-1 difference (points) that counts as a disagreement.
        min_cosine: other models: an output whose cosine (min over samples) falls below this
            counts as a disagreement.
        opt_level, session_config: how the main run was made (for the saturation leg).
        population: see above (None or at most ``len(data)``: ``data`` is the split).
    Returns:
        ``{"n", "n_total", "adaptive", "sample", "decided_on_first_look", "decided", "opt_level"
        (the reference's: "all" or "disable"), "reference" ("qdq_rewrites_off" or "unoptimised"),
        "reference_why", "outputs": {name: parity}, "disagreement", "reason", "cause",
        "cpu_vnni"}``
        plus ``top1_main``/``top1_unoptimized`` (the reference's top-1; the name is kept from
        when it always ran unoptimised)/``top1_agreement``/``tolerance_points`` (and
        ``top1_x64quantprecision`` on ``n_x64quantprecision`` samples after the saturation leg)
        for classifiers. ``sample`` is ``"all"``, or ``{"seed", "n"}`` of the seeded random
        sample the figures are on; ``n_total`` the split's size. ``disagreement`` is None when
        a sample of a ``population`` decides nothing beyond doubt.
    Raises:
        StageError: ORT cannot load or run the model unoptimised.
    """
    total = len(data)
    if population is not None and population > total:
        n = -1  # the row's first-look samples are all there is to compare: every one of them
    adaptive = n < 0
    looks = cross_check_looks(total) if adaptive else []
    if not adaptive and n < total:
        looks = [np.sort(seeded_sample(total, n))]
    k0 = next(iter(outputs))
    y = data.y if data.classifier else None

    def run(idx: np.ndarray, **kw) -> dict[str, np.ndarray]:
        with OrtRunner(onnx_path, "cpu", **kw) as r:
            return run_outputs(r, data.take(idx), batch, progress="cross-check")

    reference: list = []  # [runner, how]: made at the first look, closed at the end

    def run_reference(idx: np.ndarray) -> dict[str, np.ndarray]:
        if not reference:
            reference.extend(qdq_reference_runner(onnx_path))
            if reference[1]["why"]:
                print(f"  reference: ORT with every graph optimisation off "
                      f"({reference[1]['why']})", file=sys.stderr, flush=True)
        return run_outputs(reference[0], data.take(idx), batch, progress="cross-check")

    def compare(ref: dict, main: dict) -> tuple[dict, tuple | None]:
        pars, worst = {}, None
        for name, m in main.items():
            if name in ref and ref[name].shape == np.shape(m):
                pars[name] = _parity_finite(ref[name], np.asarray(m))
                if worst is None or _cos(pars[name]) < _cos(worst[1]):
                    worst = (name, pars[name])
        return pars, worst

    def decide(idx: np.ndarray, ref: dict, pop: int, a: float) -> str | None:
        if data.classifier:
            mp, rp = outputs[k0][idx].argmax(1), ref[k0].argmax(1)
            if disagreement_beyond_doubt(mp == y[idx], rp == y[idx], tol_points, pop, a):
                return "disagreement"
            return "agreement" if agreement_beyond_doubt(mp, rp, y[idx], tol_points, pop, a) \
                else None
        _, w = compare(ref, {name: v[idx] for name, v in outputs.items()})
        return "disagreement" if w is not None and _cos(w[1]) < min_cosine else None

    sample_of = (f" (the row's first look, of {population})"
                 if population is not None and population > total else "")
    print(f"backend cross-check: {Path(onnx_path).name} against the graph's own numerics (ORT "
          "with its Q/DQ rewrites off, checked node by node: deploykit.quant.reference) "
          + (f"on a seeded random {' then '.join(str(len(i)) for i in looks)} of {total} "
             "samples, then all of them unless a look decides beyond doubt"
             if adaptive and looks else
             f"on a seeded random {n} of {total} samples" if looks else
             f"on all {total} samples{sample_of}"), file=sys.stderr, flush=True)
    def extend(idx: np.ndarray, ref: dict, want: np.ndarray) -> tuple[np.ndarray, dict]:
        """Run the samples of ``want`` not run yet; indices and outputs in sample order."""
        new = np.setdiff1d(want, idx)
        if not len(new):
            return idx, ref
        more = run_reference(new)
        idx = np.concatenate([idx, new])
        ref = {k: np.concatenate([ref[k], v]) if k in ref else v for k, v in more.items()}
        order = np.argsort(idx, kind="stable")
        return idx[order], {k: v[order] for k, v in ref.items()}

    idx, ref, decided = np.zeros(0, np.int64), {}, None
    try:
        for want in looks if adaptive else []:  # nested looks: each adds the samples it lacks
            idx, ref = extend(idx, ref, want)
            decided = decide(idx, ref, total, CROSS_CHECK_ALPHA / len(looks))
            if decided:
                break
        early = decided is not None
        if not early:
            idx, ref = extend(idx, ref, looks[0] if looks and not adaptive
                              else np.arange(total, dtype=np.int64))
    finally:
        if reference:
            reference[0].close()
    k = len(idx)
    sampled = population is not None and population > total and k == total
    if sampled:  # a sample of the split: only a verdict beyond doubt about all of it
        decided = decide(idx, ref, int(population), CROSS_CHECK_ALPHA)
        early = decided is not None
        total = int(population)
    main = {name: v[idx] for name, v in outputs.items()}
    pars, worst = compare(ref, main)
    sample = "all" if k == total else {"seed": FIRST_LOOK_SEED, "n": int(k)}
    how = reference[1] if reference else {"reference": None, "why": None}
    rec: dict = {"n": int(k), "adaptive": adaptive, "outputs": pars,
                 "opt_level": "all" if how["reference"] == "qdq_rewrites_off" else "disable",
                 "reference": how["reference"], "reference_why": how["why"],
                 "cause": None, "cpu_vnni": cpu_has_vnni(), "decided_on_first_look": early,
                 "decided": decided,
                 "n_total": int(total), "sample": sample}
    seen = (f"{k} of {total} images, " + ("the row's first look" if sampled
                                          else "a seeded random sample") if k < total
            else f"{k} images")
    if early:
        seen += (f", {'a disagreement' if decided == 'disagreement' else 'agreement'} beyond "
                 f"doubt there (exact bounds: a wrong verdict has a chance below "
                 f"{CROSS_CHECK_ALPHA:g}); "
                 + ("3_onnx_eval.py --full-eval for every image" if sampled
                    else f"--cross-check-images {total} for the exact figure"))
    elif sampled:
        seen += ": no verdict beyond doubt about the whole split; 3_onnx_eval.py --full-eval measures every image"
    if data.classifier:
        t_main = topk_accuracy(main[k0], y[idx], (1,))["top1"]
        t_ref = topk_accuracy(ref[k0], y[idx], (1,))["top1"]
        mr, rr = main[k0].argmax(1) == y[idx], ref[k0].argmax(1) == y[idx]
        net = abs(int((mr & ~rr).sum()) - int((rr & ~mr).sum()))  # images: exact at the bound
        rec.update(top1_main=t_main, top1_unoptimized=t_ref, tolerance_points=tol_points,
                   top1_agreement=float(100.0 * (ref[k0].argmax(1) == main[k0].argmax(1)).mean()),
                   disagreement=(decided == "disagreement" if early
                                 else None if sampled else _exceeds(net, k, tol_points)))
        rec["reason"] = (f"top-1 {t_main:.1f}% at opt level {opt_level} vs {t_ref:.1f}% in the "
                         f"graph's own numerics ({seen})")
    else:
        bad = worst is not None and _cos(worst[1]) < min_cosine
        rec.update(min_cosine=min_cosine, disagreement=True if bad else None if sampled else False)
        odd = (f", {worst[1]['nonfinite_differs']} value(s) NaN/Inf in one run only or "
               "another NaN/Inf in the other" if worst and worst[1].get("nonfinite_differs") else
               f", {worst[1]['nonfinite_same']} value(s) NaN/Inf at the same places in both "
               "(the graph's own; the cosine is of the finite values)"
               if worst and worst[1].get("nonfinite_same") else "")
        rec["reason"] = (f"output {worst[0]}: cosine min {worst[1]['cosine_min']:.4f} between the "
                         f"optimised run and the graph's own numerics{odd} "
                         f"({seen.replace('images', 'samples')})"
                         if worst else
                         "no comparable output")
    nonfinite = not data.classifier and worst is not None and worst[1].get("nonfinite_differs")
    if rec["disagreement"] and cpu_has_vnni() is False and not session_config and not nonfinite:
        # (u8s8 saturation clamps integers: it cannot make a NaN/Inf)
        # The cause needs no more samples than the first look: the saturating and the u8u8
        # kernels run the same weights on every input.
        pick = np.isin(idx, looks[-1]) if looks and k > len(looks[-1]) else np.ones(k, bool)
        sub = idx[pick]
        fixed = run(sub, opt_level=opt_level, session_config=X64_QUANT_PRECISION)
        ref_c = {name: v[pick] for name, v in ref.items()}
        kc = len(sub)
        if data.classifier:
            t_fix = topk_accuracy(fixed[k0], y[sub], (1,))["top1"]
            t_ref = topk_accuracy(ref_c[k0], y[sub], (1,))["top1"]
            rec["top1_x64quantprecision"] = t_fix
            rec["n_x64quantprecision"] = kc
            agrees = abs(t_fix - t_ref) <= tol_points
            how = (f"top-1 is {t_fix:.1f}% vs {t_ref:.1f}% in the graph's own numerics on {kc} "
                   f"of the {k} images")
        else:
            _, w2 = compare(ref_c, fixed)
            agrees = w2 is not None and _cos(w2[1]) >= min_cosine
            how = f"the outputs agree (cosine min {w2[1]['cosine_min']:.4f})" if w2 else ""
        if agrees:
            rec["cause"] = ("u8s8 saturation in ORT's int8 CPU kernels on this CPU without VNNI: "
                            f"with session.x64quantprecision=1 {how} (rerun with "
                            "--x64-quant-precision; ORT PR #12088)")
    return rec
