"""The backend cross-check: a Q/DQ model on ORT at its default optimisation level versus
unoptimised (and the u8s8 saturation cause on CPUs without VNNI).
"""
from __future__ import annotations

import sys
from pathlib import Path
import numpy as np

from deploykit.compare import BACKEND_TOLERANCE, cosine_rows, parity, topk_accuracy
from deploykit.envinfo import cpu_has_vnni
from deploykit.evaluate import run_outputs
from deploykit.runners import OrtRunner


# --------------------------------------------------------------------------------------------
# Backend cross-check (stage 3): the same Q/DQ file with ORT graph optimisations off
# --------------------------------------------------------------------------------------------
#: ORT session option that makes its x86-64 int8 kernels use u8u8 instead of u8s8, which cannot
#: saturate on CPUs without VNNI (onnxruntime PR #12088, session.x64quantprecision).
X64_QUANT_PRECISION = {"session.x64quantprecision": "1"}


CROSS_CHECK_FIRST = 128  # samples of the adaptive cross-check's first look

#: Samples of an earlier look inside the first one: a classifier whose two runs already
#: disagree there beyond doubt (:func:`first_look_verdict`, a collapse) needs no more. Only a
#: disagreement is decided on it; agreement still needs the first look's samples.
CROSS_CHECK_PEEK = 32


#: per-sample output cosine under which two runs of one graph "differ"
CROSS_CHECK_MIN_COSINE = BACKEND_TOLERANCE["min_cosine"]


#: Standard errors by which a first look must clear the tolerance to be taken as final
#: (:func:`first_look_verdict`); 4 puts the chance of a wrong early verdict below 3.2e-5 per
#: look (one-sided normal tail), below 1e-4 over the two looks (:data:`CROSS_CHECK_PEEK`, then
#: :data:`CROSS_CHECK_FIRST`).
FIRST_LOOK_Z = 4.0


def first_look_verdict(main_right: np.ndarray, ref_right: np.ndarray, tol_points: float,
                       z: float = FIRST_LOOK_Z) -> bool | None:
    """Decide a classifier's backend disagreement on the first samples, when that is beyond doubt.

    The two runs see the same images, so their top-1 difference is a paired difference: with
    ``b`` images right only in the main run and ``c`` right only in the unoptimised one, the
    difference is ``d = (b - c) / n`` and its standard error
    ``se = sqrt(b + c - (b - c)**2 / n) / n`` (the variance of a mean of per-image differences in
    {-1, 0, 1}; McNemar's test uses the same discordant counts). The verdict is final when
    ``|d|`` clears the tolerance by ``z`` standard errors either way.

    Args:
        main_right, ref_right: bool ``[n]``, top-1 correct per image in each run.
        tol_points: tolerance in top-1 points. z: standard errors of margin.
    Returns:
        True (disagreement beyond doubt), False (agreement beyond doubt) or None (inconclusive:
        measure the whole split).
    """
    n = len(main_right)
    if n == 0:
        return None
    b = int((main_right & ~ref_right).sum())
    c = int((ref_right & ~main_right).sum())
    d = 100.0 * abs(b - c) / n
    se = 100.0 * np.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n
    if d - z * se > tol_points:
        return True
    if d + z * se < tol_points and b + c < n:  # b + c = n: every image flipped, not agreement
        return False
    return None


def backend_cross_check(onnx_path: Path | str, data, outputs: dict[str, np.ndarray], *,
                        n: int = -1, batch: int = 64, tol_points: float = 2.0,
                        min_cosine: float = 0.99, opt_level: str = "all",
                        session_config: dict | None = None) -> dict:
    """Rerun a Q/DQ model with every ORT graph optimisation off (DequantizeLinear + float ops:
    the graph's own semantics) on the samples of the main run and compare, for any model.

    ONNX Runtime is not a neutral judge of Q/DQ graphs (``WeightBiasQuantization``, QDQ fusions
    into integer kernels): a result that changes here is the backend's, not the quantization's.
    ``n`` samples; ``n < 0`` is adaptive: the first :data:`CROSS_CHECK_PEEK` for a classifier
    (a disagreement beyond doubt there, a collapse, is final), then the first
    :data:`CROSS_CHECK_FIRST`, extended to all
    when any of them differs between the two runs (top-1, or an output cosine below
    :data:`CROSS_CHECK_MIN_COSINE`) unless the first look already decides: for classifiers
    :func:`first_look_verdict` (the top-1 difference clears the tolerance by
    :data:`FIRST_LOOK_Z` standard errors), for other models an output whose cosine is already
    below ``min_cosine`` (more samples can only lower the minimum). ``decided_on_first_look``
    says which; ``n >= 0`` measures exactly that many samples (the exact figure). A backend effect comes from the weights and scales (an
    overflowing int32 bias, a fused kernel), not from one input, so it shows on the first
    samples, and every flagged disagreement is then measured on all of them. When the two
    disagree on an x86-64 CPU without VNNI, the optimised graph is run once more with
    :data:`X64_QUANT_PRECISION` to tell u8s8 kernel saturation from a graph optimiser effect
    (``cause``).

    Args:
        data: ``deploykit.evaluate.EvalData`` of the main run (classifier images with labels, or a feed).
        outputs: ``{output name: array [N, ...]}`` of the main run (same order of samples).
        batch: samples per run (the model's static batch, if any, wins: deploykit.evaluate.run_outputs).
        tol_points: classifiers: top-1 difference (points) that counts as a disagreement.
        min_cosine: other models: an output whose cosine (min over samples) falls below this
            counts as a disagreement.
        opt_level, session_config: how the main run was made (for the saturation leg).
    Returns:
        ``{"n", "adaptive", "opt_level": "disable", "outputs": {name: parity}, "disagreement",
        "reason", "cause", "cpu_vnni"}`` plus ``top1_main``/``top1_unoptimized``/
        ``top1_agreement``/``tolerance_points`` (and ``top1_x64quantprecision`` on
        ``n_x64quantprecision`` first samples after the saturation leg) for classifiers.
    Raises:
        StageError: ORT cannot load or run the model unoptimised.
    """

    total = len(data)
    adaptive = n < 0
    first = min(CROSS_CHECK_FIRST, total) if adaptive else min(n, total)

    def run(lo: int, hi: int, **kw) -> dict[str, np.ndarray]:
        with OrtRunner(onnx_path, "cpu", **kw) as r:
            return run_outputs(r, data.subset(lo, hi), batch, progress="cross-check")

    def compare(ref: dict, main: dict) -> tuple[dict, tuple | None]:
        pars, worst = {}, None
        for name, m in main.items():
            if name in ref and ref[name].shape == np.shape(m):
                pars[name] = parity(ref[name], m)
                if worst is None or pars[name]["cosine_min"] < worst[1]["cosine_min"]:
                    worst = (name, pars[name])
        return pars, worst

    print(f"backend cross-check: {Path(onnx_path).name} with ORT graph optimisations disabled "
          + (f"on the first {first} of {total} samples (fewer when {CROSS_CHECK_PEEK} already "
             "disagree beyond doubt, all of them only when they differ and do not decide)"
             if adaptive else f"on {first} of {total} samples"), file=sys.stderr, flush=True)
    peek = None
    if adaptive and data.classifier and 2 * CROSS_CHECK_PEEK <= first:
        # a collapse shows on a few dozen images: decided there, beyond doubt, or look on
        k0 = next(iter(outputs))
        p_ref = run(0, CROSS_CHECK_PEEK, opt_level="disable")
        y = data.y[:CROSS_CHECK_PEEK]
        if first_look_verdict(outputs[k0][:CROSS_CHECK_PEEK].argmax(1) == y,
                              p_ref[k0].argmax(1) == y, tol_points) is True:
            first = CROSS_CHECK_PEEK
        peek = p_ref
    head = {k: v[:first] for k, v in outputs.items()}
    if peek is not None and first == CROSS_CHECK_PEEK:
        ref = peek
    elif peek is not None:  # the peek's samples are not run twice
        rest = run(CROSS_CHECK_PEEK, first, opt_level="disable")
        ref = {k: np.concatenate([v, rest[k]]) for k, v in peek.items()}
    else:
        ref = run(0, first, opt_level="disable")
    differs = any(cosine_rows(ref[k], head[k]).min() < CROSS_CHECK_MIN_COSINE
                  for k in head if k in ref and ref[k].shape == head[k].shape)
    if data.classifier:
        k0 = next(iter(head))
        differs = differs or bool((ref[k0].argmax(1) != head[k0].argmax(1)).any())
    early = None
    if adaptive and differs and first < total:
        if data.classifier:
            k0 = next(iter(head))
            y = data.y[:first]
            early = first_look_verdict(head[k0].argmax(1) == y, ref[k0].argmax(1) == y,
                                       tol_points)
        else:
            _, w0 = compare(ref, head)
            early = True if w0 is not None and w0[1]["cosine_min"] < min_cosine else None
    if adaptive and differs and first < total and early is None:
        more = run(first, total, opt_level="disable")
        ref = {k: np.concatenate([v, more[k]]) for k, v in ref.items()}
    k = len(next(iter(ref.values())))
    main = {name: v[:k] for name, v in outputs.items()}
    pars, worst = compare(ref, main)
    rec: dict = {"n": int(k), "adaptive": adaptive, "opt_level": "disable", "outputs": pars,
                 "cause": None, "cpu_vnni": cpu_has_vnni(),
                 "decided_on_first_look": early is not None, "n_total": int(total)}
    first_out = next(iter(main))
    seen = (f"{k} of {total} images, decided on the first look (--cross-check-images {total} "
            "for the exact figure)" if early is not None else f"{k} images")
    if data.classifier:
        t_main = topk_accuracy(main[first_out], data.y[:k], (1,))["top1"]
        t_ref = topk_accuracy(ref[first_out], data.y[:k], (1,))["top1"]
        rec.update(top1_main=t_main, top1_unoptimized=t_ref, tolerance_points=tol_points,
                   top1_agreement=float(100.0 * (ref[first_out].argmax(1)
                                                 == main[first_out].argmax(1)).mean()),
                   disagreement=bool(abs(t_main - t_ref) > tol_points))
        rec["reason"] = (f"top-1 {t_main:.1f}% at opt level {opt_level} vs {t_ref:.1f}% with ORT "
                         f"graph optimisations disabled ({seen})")
    else:
        bad = worst is not None and worst[1]["cosine_min"] < min_cosine
        rec.update(min_cosine=min_cosine, disagreement=bool(bad))
        rec["reason"] = (f"output {worst[0]}: cosine min {worst[1]['cosine_min']:.4f} between the "
                         f"optimised and the unoptimised run ({seen.replace('images', 'samples')})"
                         if worst else
                         "no comparable output")
    if rec["disagreement"] and cpu_has_vnni() is False and not session_config:
        # The cause needs no more samples than the first look: the saturating and the u8u8
        # kernels run the same weights on every input.
        kc = min(k, first)
        fixed = run(0, kc, opt_level=opt_level, session_config=X64_QUANT_PRECISION)
        ref_c = {name: v[:kc] for name, v in ref.items()}
        if data.classifier:
            t_fix = topk_accuracy(fixed[first_out], data.y[:kc], (1,))["top1"]
            t_ref = topk_accuracy(ref_c[first_out], data.y[:kc], (1,))["top1"]
            rec["top1_x64quantprecision"] = t_fix
            rec["n_x64quantprecision"] = kc
            agrees = abs(t_fix - t_ref) <= tol_points
            how = (f"top-1 is {t_fix:.1f}% vs {t_ref:.1f}% unoptimised on the first {kc} "
                   "images")
        else:
            _, w2 = compare(ref_c, fixed)
            agrees = w2 is not None and w2[1]["cosine_min"] >= min_cosine
            how = f"the outputs agree (cosine min {w2[1]['cosine_min']:.4f})" if w2 else ""
        if agrees:
            rec["cause"] = ("u8s8 saturation in ORT's int8 CPU kernels on this CPU without VNNI: "
                            f"with session.x64quantprecision=1 {how} (rerun with "
                            "--x64-quant-precision; ORT PR #12088)")
    return rec
