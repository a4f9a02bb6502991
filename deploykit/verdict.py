"""What to ship (stage 8): the rows grouped by where they deploy (CPU EP, CUDA EP, TensorRT),
the deployment baseline of each group (its FP32 row), the one function that decides whether a
row may be shipped (:func:`judge_row`: status, staleness, latency, then the accuracy budget of
the cross-model sweep, :func:`deploykit.sweep.report.judge`), and the verdict per group: the
fastest eligible row, and what each faster or smaller row costs.

Budget (:class:`deploykit.sweep.spec.Budget`, the sweep's): top-1 agreement with the PyTorch
FP32 logits >= ``min_agreement`` % and top-1 at most ``max_top1_drop`` points below the
PyTorch FP32 row (rows without labels: mean cosine >= ``min_cosine``).
"""
from __future__ import annotations

import dataclasses

from deploykit.errors import clip_text
from deploykit.models import RANDOM_INIT_NOTE
from deploykit.results import staleness
from deploykit.sweep.report import judge as budget_judge
from deploykit.sweep.report import p50_ms, parity, reference_row, top1
from deploykit.sweep.spec import Budget
from deploykit.timing import BUSY_CORES, busy_machine_note

__all__ = ["Budget", "Judgement", "deploy_group", "deploy_baselines", "judge_row", "verdicts",
           "is_rerun", "GROUP_ORDER"]

#: Verdict order of the groups; other EPs (an ORT TensorRT EP row, ...) follow by name.
GROUP_ORDER = ("CPU EP", "CUDA EP", "TensorRT")

#: In-memory key of a row's p50 (ms) from the interleaved re-timing of the rows a verdict ranks
#: (:mod:`deploykit.ship_timing`, ``8_report.py --retime``); never written to a row's JSON.
INTERLEAVED = "_interleaved_p50_ms"
#: In-memory key: what that re-timing fed the model (the record's ``input``).
INTERLEAVED_INPUT = "_interleaved_input"
#: In-memory key: :func:`deploykit.timing.busy_machine_note` of that re-timing (None: quiet).
INTERLEAVED_BUSY = "_interleaved_busy"


def pair_ms(a: dict, b: dict, interleaved: bool = True) -> tuple[float | None, float | None]:
    """Batch-1 p50s (ms) to compare two rows by: their interleaved re-timing when
    ``interleaved`` (the verdict of their group ranks by it) and both have one (timed on the
    same stretch of the host), else both rows' own p50s; never a mix."""
    if interleaved and isinstance(a.get(INTERLEAVED), float) \
            and isinstance(b.get(INTERLEAVED), float):
        return a[INTERLEAVED], b[INTERLEAVED]
    return p50_ms(a), p50_ms(b)


def is_rerun(r: dict) -> bool:
    """True for a rerun's record kept beside a good row (``<tag>.failed.json``,
    :func:`deploykit.results.write_result`): the report shows it, nothing ships it."""
    return r.get("_file", f"{r['tag']}.json") != f"{r['tag']}.json"


def deploy_group(r: dict) -> str | None:
    """Where a row deploys: ``"TensorRT"`` (engine rows), ``"CPU EP"`` / ``"CUDA EP"`` / ``"<X>
    EP"`` (ORT rows, by the EP that ran them, else their device); None for PyTorch rows (the
    reference, never shipped: a deployment ships the exported model)."""
    if r.get("backend") == "TensorRT":
        return "TensorRT"
    if r.get("backend") != "ORT":
        return None
    ep = r.get("ep_used") or r.get("ep_requested")
    if isinstance(ep, str) and ep:
        return ep.replace("ExecutionProvider", " EP")
    return f"{str(r.get('device') or 'cpu').upper()} EP"


def baseline_name(group: str) -> str:
    """The deployment baseline of a group in words: ``ORT FP32`` or ``TensorRT FP32``."""
    return "TensorRT FP32" if group == "TensorRT" else "ORT FP32"


def deploy_baselines(rows: list[dict]) -> dict[str, dict]:
    """``{group: row}``: per :func:`deploy_group`, the FP32 row that speedups "vs ORT/TRT FP32"
    divide: ok, with a batch-1 p50, not a rerun; ``ort_fp32`` / ``ort_fp32_<device>`` /
    ``trt_fp32`` before variants such as ``ort_fp32_cuda_notf32``."""
    out: dict[str, dict] = {}
    for r in rows:
        g = deploy_group(r)
        if g is None or r.get("precision") != "FP32" or r.get("status") != "ok" \
                or is_rerun(r) or p50_ms(r) is None:
            continue
        plain = {"trt_fp32", "ort_fp32", f"ort_fp32_{r.get('device')}"}
        if g not in out or (r["tag"] in plain and out[g]["tag"] not in plain):
            out[g] = r
    return out


@dataclasses.dataclass(frozen=True)
class Judgement:
    """Whether a row may be shipped.

    Attributes:
        eligible: it may (status ok/warn, not stale, measured, within the budget).
        measured: it ran and has numbers (False: failed, skipped, stale, invalid, a rerun's
            record, no latency): it is listed as not eligible, not as a cost.
        why: the reason, with the numbers (the budget's wording when ``measured``).
    """

    eligible: bool
    measured: bool
    why: str


def _first_line(text) -> str:
    lines = str(text or "").splitlines()
    return lines[0] if lines else ""


def judge_row(r: dict, ref: dict | None, budget: Budget) -> Judgement:
    """The one eligibility rule of the verdict: a row is shipped only when it is a measured,
    current row (status ``ok`` or ``warn``: a warn row is outside its precision's ok band and
    the budget decides; never ``failed``/``skipped``/``not run``/``invalid``, a rerun's record,
    or a row that :func:`deploykit.results.staleness` calls stale) with
    a batch-1 latency, within ``budget`` against the PyTorch FP32 row ``ref``
    (:func:`deploykit.sweep.report.judge`).

    Returns:
        a :class:`Judgement`.
    """
    if is_rerun(r):
        return Judgement(False, False, f"a rerun's record ({r.get('_file')}), the row it sits "
                                       "beside is judged")
    st = r.get("status")
    if st not in ("ok", "warn"):
        why = _first_line(r.get("status_reason") or r.get("reason"))
        return Judgement(False, False, f"{st}" + (f": {why}" if why else ""))
    reasons = staleness(r)  # the files on disk are no longer what the row measured
    if reasons:  # the commands that remake it are in the report's Stale rows section, whole
        return Judgement(False, False, "stale: " + "; ".join(x.split(": rerun ", 1)[0]
                                                            for x in reasons)
                         + " (the commands that remake it: Stale rows, below)")
    if p50_ms(r) is None:
        return Judgement(False, False, "no batch-1 latency")
    ok, why = budget_judge(r, ref, budget)
    return Judgement(ok, True, why)


def _size(r: dict) -> float | None:
    v = r.get("size_mb")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def verdicts(rows: list[dict], budget: Budget) -> list[dict]:
    """The verdict of every group that has rows, in :data:`GROUP_ORDER`.

    Args:
        rows: the report's run rows (engine-build rows excluded).
        budget: the accuracy budget.

    Returns:
        one dict per group: ``group``, ``ship`` (the fastest eligible row, or None),
        ``baseline`` (:func:`deploy_baselines`, or None), ``reference`` (the PyTorch FP32 row,
        or None), ``judged``: ``[(row, Judgement)]`` of the group in table order,
        ``interleaved``: True when the rows within budget were ranked by their interleaved
        re-timing (:data:`INTERLEAVED`: every one of them and the group's baseline have it),
        else by their own p50s.
    """
    ref = reference_row([r for r in rows if not is_rerun(r)])
    base = deploy_baselines(rows)
    groups: dict[str, list[dict]] = {}
    for r in rows:
        g = deploy_group(r)
        if g is not None:
            groups.setdefault(g, []).append(r)
    order = sorted(groups, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER
                                          else len(GROUP_ORDER), g))
    out = []
    for g in order:
        judged = [(r, judge_row(r, ref, budget)) for r in groups[g]]
        ok = [r for r, j in judged if j.eligible]
        # ranked by the interleaved re-timing when it covers every row within budget and the
        # group's baseline (speedups divide by it): one footing for every figure of the group
        b = base.get(g)
        inter = len(ok) > 1 and all(isinstance(r.get(INTERLEAVED), float)
                                    for r in ok + ([b] if b is not None else []))
        ship = min(ok, key=lambda r: (r[INTERLEAVED] if inter else p50_ms(r),
                                      _size(r) or 0.0)) if ok else None
        out.append({"group": g, "ship": ship, "baseline": b, "reference": ref,
                    "judged": judged, "interleaved": inter})
    return out


def budget_text(budget: Budget, ref: dict | None) -> str:
    """One sentence: the budget with its numbers and the flags that set it."""
    t = (ref or {}).get("accuracy") or {}
    ref_s = (f"`{ref['tag']}`" + (f", top-1 {t['top1']:.2f} %" if t.get("top1") is not None
                                  else "")) if ref else "no PyTorch FP32 row: nothing is"
    return (f"Budget: top-1 agreement with the PyTorch FP32 logits >= {budget.min_agreement:g} "
            f"% and delta top-1 >= -{budget.max_top1_drop:g} points vs PyTorch FP32 ({ref_s}); "
            f"rows without labels: mean cosine >= {budget.min_cosine:g}. Set with "
            "`8_report.py --min-agreement PCT --max-top1-drop POINTS`. Ship = the fastest row "
            "within budget (batch-1 end-to-end p50); failed, skipped, not-run, invalid or stale "
            "rows and reruns' records are never chosen; PyTorch rows are the reference. With "
            "`8_report.py --retime` (run_all.sh passes it in a full run) the CPU EP rows "
            "within budget are first timed again in one process, interleaved, and ranked by "
            "that."
            + (f" The reference has {RANDOM_INIT_NOTE}: no row's top-1 is an accuracy claim."
               if (ref or {}).get("weights") == "random-init" else ""))


def _speedup(r: dict, base: dict | None, inter: bool = False) -> float | None:
    p, p0 = pair_ms(r, base, inter) if base is not None else (p50_ms(r), None)
    return p0 / p if p and p0 else None


def _speed_words(r: dict, base: dict | None, group: str, with_ms: bool = False,
                 inter: bool = False) -> str:
    """``1.26x vs ORT FP32 (faster)``: the table's "speedup vs ORT/TRT FP32" column in words
    (from the interleaved re-timing when ``inter``, the group ranked by it, and the row and the
    baseline both have one)."""
    p, s, name = p50_ms(r), _speedup(r, base, inter), baseline_name(group)
    ms = f"p50 {p:.3f} ms, " if with_ms and p is not None else ""
    shown = pair_ms(r, base, inter)[0] if base is not None else p
    if s is not None and shown != p:
        ms += f"interleaved p50 {shown:.3f} ms, "
    if s is None:
        return f"{ms}no {name} row on this {group}: speedup n/a"
    if r is base:
        return f"{ms}1.00x: it is the {name} baseline"
    how = (f"{s:.2f}x faster" if s >= 1.005 else f"{1 / s:.2f}x slower" if s <= 0.995
           else "as fast")
    return f"{ms}{s:.2f}x vs {name} = {how}"


def _size_words(r: dict, ship: dict | None) -> str:
    s = _size(r)
    if s is None:
        return ""
    s0 = _size(ship) if ship is not None else None
    if s0 and ship is not r:
        return f", {s / s0:.2f}x the size ({s:.2f} MB)"
    return f", {s:.2f} MB"


def _acc_words(r: dict, ref: dict | None) -> str:
    bits = []
    t, t0 = top1(r), top1(ref) if ref else None
    if t is not None:
        bits.append(f"top-1 {t:.2f} %" + (f" ({t - t0:+.2f})" if t0 is not None else ""))
    a = parity(r)["top1_agreement"]
    if a is not None:
        bits.append(f"agreement {a:.1f} %")
    return ", ".join(bits)


def render_verdicts(vs: list[dict], budget: Budget) -> str:
    """The markdown of :func:`verdicts`: the budget sentence, then per group one bold line
    (ship which row and why, or why none) and one indented line per faster or smaller measured
    row saying what it costs; rows that are neither are named on one line, and rows not
    eligible at all are grouped by reason."""
    if not vs:
        return ""
    lines = ["## Verdict", "", budget_text(budget, vs[0]["reference"]), ""]
    for v in vs:
        g, ship, base, ref = v["group"], v["ship"], v["baseline"], v["reference"]
        inter = bool(v.get("interleaved"))  # every comparison of the group on one footing
        measured = [(r, j) for r, j in v["judged"] if j.measured]
        within = sum(j.eligible for _, j in measured)
        if ship is not None:
            lines.append(f"- **{g}: ship `{ship['tag']}`** ({ship['backend']} "
                         f"{ship['precision']}; "
                         f"{_speed_words(ship, base, g, with_ms=True, inter=inter)}; "
                         f"{_acc_words(ship, ref)}{_size_words(ship, None)}): the fastest of "
                         f"{within} row{'s' * (within != 1)} within budget"
                         + (_interleaved_words(v) if inter else "") + ".")
        elif measured:
            lines.append(f"- **{g}: no row to ship**: none of its {len(measured)} measured "
                         "rows is within budget (below).")
        else:
            lines.append(f"- **{g}: no row to ship**: no row of it is eligible (failed, "
                         "skipped, not run or stale: below).")
        caution = _busy_caution(v, measured, inter)
        if caution:
            lines.append(caution)
        s_ship = _size(ship) if ship is not None else None
        rest = []
        for r, j in measured:
            if r is ship:
                continue
            p_r, p_ship = pair_ms(r, ship, inter) if ship is not None else (p50_ms(r), None)
            faster = p_ship is None or (p_r is not None and p_r < p_ship)
            smaller = s_ship is not None and _size(r) is not None and _size(r) < 0.95 * s_ship
            if not (faster or smaller):
                s = _speedup(r, base, inter)
                rest.append(f"`{r['tag']}` (" + (f"{s:.2f}x, " if s else "")
                            + ("within budget" if j.eligible else "out of budget") + ")")
                continue
            if j.eligible:
                cost = "within budget but slower: an option when size matters more"
            elif faster and ship is not None:
                cost = f"out of budget ({j.why}): not shippable at this budget"
            elif ship is None:
                cost = f"out of budget ({j.why})"
            else:
                cost = f"out of budget ({j.why}) and slower: not worth it"
            lines.append(f"  - `{r['tag']}` ({r['precision']}): "
                         f"{_speed_words(r, base, g, inter=inter)}"
                         f"{_size_words(r, ship)}; {_acc_words(r, ref)}: {cost}.")
        if rest:
            lines.append(f"  - slower and no smaller than `{ship['tag']}`, nothing to gain: "
                         + ", ".join(rest) + ".")
        by_why: dict[str, list[str]] = {}
        for r, j in v["judged"]:
            if not j.measured:
                by_why.setdefault(j.why, []).append(r["tag"])
        for why, tags in by_why.items():
            lines.append(f"  - not eligible ({len(tags)}): " + ", ".join(f"`{t}`" for t in tags)
                         + f": {clip_text(why, 450)}")
    return "\n".join(lines) + "\n\n"


def _busy_caution(v: dict, measured: list, inter: bool) -> str | None:
    """An indented caution line when the figures that rank a group by speed were timed on a busy
    machine (:func:`deploykit.timing.busy_machine_note`): the interleaved re-timing's own loop
    when it ranks the group, else each measured row's and the baseline's timed loop."""
    if inter:
        note = next((r.get(INTERLEAVED_BUSY) for r, _ in measured if r.get(INTERLEAVED_BUSY)),
                    None)
        return (f"  - caution: the interleaved re-timing ran on a busy machine ({note}): rerun "
                "`8_report.py --retime` on a quiet machine before trusting its speed figures."
                if note else None)
    rows = [r for r, _ in measured] + ([v["baseline"]] if v.get("baseline") else [])
    busy = sorted({r["tag"] for r in rows
                   if busy_machine_note((r.get("latency") or {}).get("other_cpu"))})
    if not busy:
        return None
    return ("  - caution: " + ", ".join(f"`{t}`" for t in busy) + " timed on a busy machine "
            f"(other processes used {BUSY_CORES:g} of a core or more while it was timed): "
            "speed figures and speedups against them may not hold; rerun their stages on a "
            "quiet machine.")


def _interleaved_words(v: dict) -> str:
    """`` in an interleaved re-timing (...)``: the ranking's figures, and whether the rows' own
    p50s (separate processes) ranked them the same."""
    ok = sorted((r for r, j in v["judged"] if j.eligible), key=lambda r: r[INTERLEAVED])
    figs = ", ".join(f"`{r['tag']}` {r[INTERLEAVED]:.3f} ms" for r in ok)
    own = min(ok, key=lambda r: (p50_ms(r), _size(r) or 0.0))
    same = ("the rows' own p50s, timed in separate processes, rank them the same"
            if own is v["ship"] else
            f"the rows' own p50s, timed in separate processes, put `{own['tag']}` first: "
            "the host's speed drifted between them")
    synthetic = any(str(r.get(INTERLEAVED_INPUT, "")).startswith("seeded random") for r in ok)
    return (f" in an interleaved re-timing in one process on this machine ({figs} p50"
            + (", on seeded random inputs (synthetic)" if synthetic else "")
            + f"; `ship_timing.json`); {same}")
