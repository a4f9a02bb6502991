"""One evaluation path for every backend (stages 1, 3 and 7): batched inference on the evaluation
data, top-1/top-5, parity with the PyTorch reference, latency, and one results-row schema.

A stage builds a runner (:mod:`deploykit.runners`) and the data it is judged on (:func:`classifier_data`
or :func:`custom_data`), then calls :func:`evaluate`, which writes the row. Diagnostics
(backend cross-checks, layer-wise comparisons) run after the row is written, through
:func:`diagnose`, and can never turn a good row into a failed one.

Row schema (``results/<model>/<tag>.json``; every field present, None when it does not apply)::

    stage, backend, precision, model, tag, variant, status ("ok"/"warn"/"failed"/"skipped"),
    reason, status_reason, next_step, tolerance,
    device ("cpu"/"cuda"), device_name, device_index, ep_requested, ep_used, cpu_fallback,
    runtime (runner.describe(): versions, TF32 state, provider options, engine profile),
    n_images, batch_size, preprocessing {resize, crop, interpolation, mean, std},
    accuracy {top1, top5} (%), reason_accuracy, parity {cosine_mean, cosine_min,
    top1_agreement (%), max_abs_err, mean_abs_err}, parity_outputs {output: parity},
    nonfinite_outputs {output: NaN/Inf values where the reference is finite} or None,
    outputs [every output name], output_used (the output compared with the reference logits,
    or {reference output: output} for other models: matched by name, else by index),
    latency {batch, warmup (calls made), warmup_requested, iters, other_cpu (deploykit.timing.
    OtherCpu), end_to_end_ms {p50_ms, p90_ms, p99_ms, mean_ms, min_ms, max_ms, fps},
    end_to_end_timer, gpu_compute_ms {...} or None, gpu_compute_timer},
    latency_batch (same block at --latency-batch when it is not 1), harness_overhead_ms,
    size_mb, diagnostics {name: result}, timings_s {inference, latency, diagnostic:<name>},
    measured_against {role: {path, sha256}} (the reference compared with, the file evaluated,
    and the fp32.onnx / calibration data / ONNX a derived file was made from:
    deploykit.results.measured_against), source {record, made_by} of a derived file (None:
    not derived, or unknown), stale_source (why the derived file's recorded source is not the
    current fp32.onnx, or None), first_look {n, n_total, decided ("failed" or None), seed,
    and when decided alpha (per look), look (the first look's size), peek (the earlier look's
    inside it; n is one of the two), reasons} when the accuracy pass began with a first look
    (:mod:`deploykit.sequential`; None otherwise: ``n_images`` is then every sample),
    provenance (with artifacts_root).

Status of a measured row (:func:`judge`): its parity with the PyTorch reference under the
precision's band of :data:`deploykit.compare.ROW_TOLERANCES`: ``failed`` (non-finite outputs, or
a metric below the band's ``failed`` bound), ``warn`` (below the ``ok`` bound) or ``ok``;
``status_reason`` names the metric, its value and the bound, ``next_step`` the first diagnostic
to run (a shell-quoted command). The row is written whatever its status (it is a measurement)
and the stage exits 0: ``run_all.sh`` measures the known INT8 collapses on purpose. A row that
could not be measured at all (no session, a run that raised) is ``failed`` with ``reason``.

"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable
import numpy as np

from deploykit.cli import progress_bar
from deploykit.commands import script_command
from deploykit.checks.input_probe import probe_input_convention
from deploykit.compare import (match_outputs, parity, row_parities, row_tolerance, row_verdict,
                               topk_accuracy)
from deploykit.data.images import normalize
from deploykit.data.splits import align_reference, load_split
from deploykit.errors import StageError, UsageError
from deploykit.data.user import LABELS_KEY, SYNTHETIC_KEY, SYNTHETIC_NOTE, check_same_inputs
from deploykit.io import load_npz
from deploykit.models import ModelSpec
from deploykit.results import (measured_against, provenance, result_record, row_source,
                               write_result)
from deploykit.runners import Runner, harness_overhead_ms
from deploykit.timing import MIN_ITERS, MIN_WARMUP, WARMUP_SECONDS, busy_machine_note
from deploykit.sequential import (ALPHA, FIRST_LOOK_SEED, LOOK_ALPHA, decided_indices,
                                  failed_beyond_doubt, look_schedule)


@dataclasses.dataclass
class EvalData:
    """The inputs a row is judged on and the reference to compare with.

    Classifier data (``x_u8`` set): uint8 images ``[N, 3, H, W]``, int64 labels ``y`` ``[N]``,
    their ``files``, normalisation ``mean``/``std``, fed as ``input_name``; ``ref`` holds the
    reference logits float32 ``[N, C]`` (None for the reference run itself); ``preprocessing``
    the resize/crop/interpolation/mean/std recorded in the row.
    Feed data (``feed`` set, models with their own inputs): ``{input name: array}`` with the
    batch on axis 0; ``ref`` is ``{output name: array}`` or None; ``y`` the ``--labels`` (int64
    ``[N]``) or None; ``synthetic`` True for seeded N(0,1) samples (no ``--inputs``).
    ``logits_output`` (``--logits-output``): the output that holds the logits (accuracy,
    top-1 agreement, the headline parity), a name or a graph-order index; None: the first.
    """

    x_u8: np.ndarray | None = None
    y: np.ndarray | None = None
    files: list[str] | None = None
    mean: tuple = ()
    std: tuple = ()
    input_name: str = "input"
    feed: dict[str, np.ndarray] | None = None
    ref: Any = None
    preprocessing: dict | None = None
    synthetic: bool = False
    logits_output: str | int | None = None  # --logits-output: name or graph index (None: first)

    @property
    def classifier(self) -> bool:
        return self.x_u8 is not None

    def __len__(self) -> int:
        return len(self.x_u8) if self.classifier else len(next(iter(self.feed.values())))

    def subset(self, lo: int, hi: int) -> "EvalData":
        """Samples ``lo:hi`` (their reference too)."""
        if self.classifier:
            return dataclasses.replace(self, x_u8=self.x_u8[lo:hi], y=self.y[lo:hi],
                                       files=self.files[lo:hi],
                                       ref=None if self.ref is None else self.ref[lo:hi])
        return dataclasses.replace(
            self, feed={k: v[lo:hi] for k, v in self.feed.items()},
            y=None if self.y is None else self.y[lo:hi],
            ref=None if self.ref is None else {k: v[lo:hi] for k, v in self.ref.items()})

    def take(self, idx: np.ndarray) -> "EvalData":
        """The samples at indices ``idx`` (int ``[k]``), in that order, with their reference
        and labels."""
        idx = np.asarray(idx, np.int64)
        if self.classifier:
            return dataclasses.replace(self, x_u8=self.x_u8[idx], y=self.y[idx],
                                       files=[self.files[i] for i in idx],
                                       ref=None if self.ref is None else self.ref[idx])
        return dataclasses.replace(
            self, feed={k: v[idx] for k, v in self.feed.items()},
            y=None if self.y is None else self.y[idx],
            ref=None if self.ref is None else {k: v[idx] for k, v in self.ref.items()})

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The feed for sample indices ``idx`` (normalised here, outside any timed region)."""
        if self.classifier:
            return {self.input_name: normalize(self.x_u8[idx], self.mean, self.std)}
        return {k: v[idx] for k, v in self.feed.items()}


def classifier_data(spec: ModelSpec, limit: int | None = None,
                    ref_path: Path | None = None, input_name: str = "input") -> EvalData:
    """Evaluation split of ``spec``'s preprocessing, with the reference logits aligned by file.

    Args:
        ref_path: ``ref_logits.npz`` (None: no reference, e.g. stage 1).
    Raises:
        StageError: missing split/cache, or the reference does not cover every evaluated image
            (the message says which rerun fixes it).
    """
    x, y, files = load_split("eval", spec, limit)
    ref = aligned_reference(ref_path, files, limit) if ref_path is not None else None
    return EvalData(x_u8=x, y=y, files=files, mean=spec.mean, std=spec.std,
                    input_name=input_name, ref=ref,
                    preprocessing=spec.preprocessing() | {"mean": spec.mean, "std": spec.std})


def custom_data(ref_path: Path, limit: int | None = None, inputs: Path | None = None,
                model: str = "MODEL") -> EvalData:
    """Inputs and reference outputs of a model with its own inputs from ``ref_outputs.npz``
    (stage 1; :mod:`deploykit.data.user`): keys ``in:<input name>``, ``out:<output name>``,
    ``labels`` and ``meta:synthetic``. A row is judged on these samples; synthetic ones are said
    on stderr.

    Args:
        limit: the first ``limit`` samples only.
        inputs: a stage's ``--inputs``: must hold the reference's samples
            (:func:`deploykit.data.user.check_same_inputs`). model: named in the rerun command.
    Raises:
        StageError: missing or unreadable reference (names stage 1).
        UsageError: ``inputs`` are not the samples the reference was computed on.
    """
    z = load_npz(ref_path, None, "1_pytorch_baseline.py (--inputs NPZ or --input-shape ...)")
    feed = {k[3:]: v[:limit] for k, v in z.items() if k.startswith("in:")}
    ref = {k[4:]: v[:limit] for k, v in z.items() if k.startswith("out:")}
    y = z.get(LABELS_KEY)
    data = EvalData(feed=feed, ref=ref, y=None if y is None else y[:limit],
                    synthetic=bool(z[SYNTHETIC_KEY]) if SYNTHETIC_KEY in z else y is None)
    if inputs:
        check_same_inputs(inputs, data.feed, "--inputs",
                          script_command("1_pytorch_baseline.py",
                                         ["--model", model, "--inputs", str(inputs)], model))
    elif data.synthetic:
        print(f"WARNING: {SYNTHETIC_NOTE}: this row's parity is measured on them",
              file=sys.stderr)
    return data


def aligned_reference(ref_path: Path, files: list[str], limit: int | None) -> np.ndarray:
    """Reference logits ``[N, C]`` for the eval ``files`` (:func:`deploykit.data.splits.align_reference`).

    Raises:
        StageError: the reference does not cover every file (stage 1 ran with a smaller
            ``--limit`` or on another split); the message says which rerun fixes it.
    """
    logits, mask = align_reference(ref_path, files)
    if not mask.all():
        n_ref = len(load_npz(ref_path, ("files",), "1_pytorch_baseline.py")["files"])
        hint = (f"pass --limit {n_ref} (or less), or rerun 1_pytorch_baseline.py "
                "without --limit" if n_ref < len(files) else
                "rerun 1_pytorch_baseline.py after 0_prepare_data.py")
        raise StageError(
            f"{ref_path} covers {n_ref} eval images but {int((~mask).sum())} of the "
            f"{len(files)} asked for (--limit {limit}) are not among them: {hint}")
    return logits


def batch_plan(n: int, batch: int, batch_range: tuple[int, int | None]) -> tuple[int, int]:
    """Batch size to run ``n`` samples with, given the largest wanted ``batch`` and the model's
    accepted ``(min, max)`` batch range.

    Returns:
        ``(batch, fixed)``: the chunk size, and ``fixed`` = the static batch (min == max) the
        last chunk must be padded to, or 0 when chunks may be smaller.
    """
    lo, hi = batch_range
    b = min(batch, hi) if hi else batch
    b = max(b, lo)
    return b, (b if hi is not None and lo == hi else 0)


def require_batch_axis(outputs: dict[str, np.ndarray], n: int) -> None:
    """Check that no output is a scalar: parity, top-k and the cross-checks compare outputs
    sample by sample, along axis 0. (An axis 0 of another length is allowed: a boolean mask
    over the batch, ``x[m]``, gives as many rows as ``m`` selects.)

    Raises:
        StageError: an output is 0-dimensional, naming the output, the batch and the fix.
    """
    for name, v in outputs.items():
        if np.ndim(v) == 0:
            raise StageError(
                f"output {name!r} has shape () for a batch of {n} input samples: it has no "
                "batch axis (axis 0 must hold the samples' rows), so it cannot be compared "
                "sample by sample. Fix: return a [N, ...] tensor from the model's forward "
                "(e.g. x.mean(dim=(1, 2, 3)) instead of x.mean()), or wrap the model so that "
                "it does")


def run_outputs(runner: Runner, data: EvalData, batch: int,
                progress: str | None = None) -> dict[str, np.ndarray]:
    """Every output of ``runner`` over all samples of ``data``, in batches that respect the
    model's accepted batch range (a static batch is padded by repeating the last sample and the
    padding dropped from the outputs).

    Returns:
        ``{output name: array [N, ...]}``.

    Raises:
        StageError: an output has no batch axis (:func:`require_batch_axis`).
    """
    n = len(data)
    b, fixed = batch_plan(n, batch, runner.batch_range)
    parts: dict[str, list[np.ndarray]] = {}
    for i in progress_bar(range(0, n, b), desc=progress or "infer", unit="batch"):
        idx = np.arange(i, min(i + b, n))
        real = len(idx)
        if fixed and real < fixed:
            idx = np.concatenate([idx, np.full(fixed - real, idx[-1])])
        out = runner.infer(data.batch(idx))
        require_batch_axis(out, len(idx))
        for k, v in out.items():
            parts.setdefault(k, []).append(np.asarray(v)[:real])
    return {k: np.concatenate(v) for k, v in parts.items()}


def latency(runner: Runner, data: EvalData, batch: int, warmup: int, iters: int
            ) -> dict:
    """The ``latency`` block (:meth:`deploykit.timing.Timing.stats`) at ``batch``, on the first
    ``batch`` samples of ``data`` (repeated when there are fewer).

    Raises:
        UsageError: ``batch`` is outside the batch sizes the model accepts.
    """
    lo, hi = runner.batch_range
    if batch < lo or (hi is not None and batch > hi):
        raise UsageError(f"--latency-batch {batch}: the model accepts batch {lo}.."
                         f"{hi if hi is not None else 'any'}")
    feed = data.batch(np.arange(batch) % len(data))
    block = runner.time(feed, warmup, iters).stats(batch, warmup)
    block["max_seconds"] = budget if (budget := runner.max_seconds) < float("inf") else None
    if block["iters"] < iters:  # the time budget stopped the loop: say so, never silently
        print(f"note: latency at batch {batch}: {block['iters']} of --iters {iters} timed runs "
              f"(the loop stops after --max-seconds {budget:g}; --max-seconds 0 runs all)",
              file=sys.stderr)
    if busy_machine_note(block.get("other_cpu")):  # real figures, not a quiet machine's
        print(f"WARNING: latency at batch {batch} timed on a busy machine: "
              f"{busy_machine_note(block['other_cpu'])}; rerun this stage on a quiet machine "
              "before comparing its latency with other rows'", file=sys.stderr)
    return block


#: The name of a classifier's reference output (``ref_logits.npz``, stage 1).
LOGITS = "logits"


def output_pairs(data: EvalData, outputs: dict[str, np.ndarray]
                 ) -> list[tuple[str, str | None, str | None]]:
    """Which output of a run is compared with which reference output
    (:func:`deploykit.compare.match_outputs`: by name, then by index).

    Returns:
        ``[(reference name, output name or None, "name" | "index" | None)]``; a classifier's
        one reference is :data:`LOGITS`.
    """
    ref_names = [LOGITS] if data.classifier else list(data.ref or {})
    pairs = match_outputs(ref_names, list(outputs))
    sel = select_logits_output(data, outputs)
    if sel is not None and sel[1] is not None:  # the chosen output takes its reference's pair
        pairs = [(rn, sel[0], sel[2]) if rn == sel[1] else (rn, on, how)
                 for rn, on, how in pairs]
    return pairs


def select_logits_output(data: EvalData, outputs: dict[str, np.ndarray]
                         ) -> tuple[str, str | None, str, str | None] | None:
    """The output ``data.logits_output`` (``--logits-output NAME|INDEX``) chooses, and the
    reference output it is compared with: matched by name first, then by index.

    A NAME that is an output of the run is taken (compared with the reference output of that
    name, else the one at its index); a NAME only the reference has (e.g. stage 1 stored
    ``logits``, stage 2 exported ``output``) takes the run's output at that reference's index,
    with a warning naming both. An INDEX takes the run's output at that graph-order position.
    A classifier's reference is always its ``logits``.

    Returns:
        ``(output name, reference name or None, "name" | "index", warning or None)``; None
        when no ``--logits-output`` was given.
    Raises:
        UsageError: the name is neither an output nor a reference output, or the index is
            out of range (the message lists the outputs).
    """
    sel = data.logits_output
    if sel is None:
        return None
    names = list(outputs)
    refs = [LOGITS] if data.classifier else list(data.ref or {})
    listed = ", ".join(f"{i}: {n}" for i, n in enumerate(names))

    def ref_of(on: str, i: int) -> tuple[str | None, str]:
        if data.classifier:
            return LOGITS, "name" if on == LOGITS else "index"
        if on in refs:
            return on, "name"
        return (refs[i], "index") if i < len(refs) else (None, "index")

    if isinstance(sel, int):
        if not 0 <= sel < len(names):
            raise UsageError(f"--logits-output {sel}: the model has {len(names)} output(s) "
                             f"({listed}): give an index 0..{len(names) - 1} or a name")
        on = names[sel]
        rn, how = ref_of(on, sel)
        warn = None if how == "name" or rn is None else (
            f"WARNING: --logits-output {sel}: output {on!r} (index {sel}) is compared with the "
            f"reference's {rn!r} (index {sel}: no reference output is named {on!r})")
        return on, rn, how, warn
    if sel in names:
        rn, how = ref_of(sel, names.index(sel))
        warn = None if how == "name" or rn is None else (
            f"WARNING: --logits-output {sel!r}: the reference has no output of that name; "
            f"output {sel!r} is compared with the reference's {rn!r} (same index "
            f"{names.index(sel)})")
        return sel, rn, how, warn
    if sel in refs and refs.index(sel) < len(names):
        i = refs.index(sel)
        return names[i], sel, "index", (
            f"WARNING: --logits-output {sel!r}: the model has no output of that name (its "
            f"outputs: {listed}); output {names[i]!r} (index {i}) is taken, the one at the "
            f"index of the reference's {sel!r}")
    raise UsageError(f"--logits-output {sel!r}: no output of the model"
                     + (" or of the reference" if refs and not data.classifier else "")
                     + f" has that name (outputs: {listed}"
                     + (f"; reference: {', '.join(refs)}" if refs and not data.classifier
                        else "") + "): give one of these names or an index")


def output_warning(data: EvalData, outputs: dict[str, np.ndarray]) -> str | None:
    """The ``WARNING:`` line for a model with several outputs whose compared output was taken
    by index (no name matches the reference's), naming both; None otherwise."""
    if len(outputs) < 2:
        return None
    taken = [(rn, on) for rn, on, how in output_pairs(data, outputs) if how == "index"]
    if not taken:
        return None
    return ("WARNING: the model has " f"{len(outputs)} outputs ({', '.join(outputs)}) and none "
            "is named like the reference's: " + ", ".join(
                f"output {on!r} (index {list(outputs).index(on)}) is compared with the "
                f"reference's {rn!r}" for rn, on in taken)
            + "; name the output in the export (output_names) if that is not the one")


def logits_first(data: EvalData, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``outputs`` with the one compared with a classifier's reference logits first (the
    accuracy, the parity and the cross-checks read the first output)."""
    if not data.classifier or len(outputs) < 2:
        return outputs
    (_, on, _), = output_pairs(data, outputs)
    return {on: outputs[on], **{k: v for k, v in outputs.items() if k != on}}


def nonfinite_outputs(data: EvalData, outputs: dict[str, np.ndarray]) -> dict[str, int] | None:
    """``{output name: number of NaN/Inf values where the reference is finite}`` for the outputs
    that have any (all of them counted where there is no reference), or None when every output
    is finite: a row whose outputs are NaN is no result, whatever else it measured."""
    refs: dict[str, Any] = {}
    if data.ref is not None:
        for rn, on, _ in output_pairs(data, outputs):
            if on is not None:
                refs[on] = data.ref if data.classifier else data.ref[rn]
    bad = {}
    for name, o in outputs.items():
        o = np.asarray(o)
        if not np.issubdtype(o.dtype, np.floating):
            continue
        mask = ~np.isfinite(o)
        r = refs.get(name)
        if r is not None and np.shape(r) == o.shape:
            mask &= np.isfinite(np.asarray(r, np.float64))
        if mask.any():
            bad[name] = int(mask.sum())
    return bad or None


def score(data: EvalData, outputs: dict[str, np.ndarray]) -> dict:
    """Accuracy and parity fields of a row (pure function of saved outputs).

    The compared outputs are matched to the reference by name, else by index
    (:func:`output_pairs`): a classifier's logits are its output named ``logits``, else its
    first output.

    Returns:
        ``{"n_images", "accuracy", "reason_accuracy", "parity", "parity_outputs",
        "nonfinite_outputs", "synthetic_inputs", "outputs", "output_used"}``: ``outputs`` every output name in
        graph order, ``output_used`` the one compared with the reference logits (a
        classifier) or ``{reference name: output name}`` (other models);
        ``nonfinite_outputs``: :func:`nonfinite_outputs`.
    Raises:
        StageError: a reference output has no output to compare with.
    """
    pairs = output_pairs(data, outputs) if data.classifier or data.ref is not None else []
    missing = [rn for rn, on, _ in pairs if on is None]
    if missing:
        raise StageError(f"the model's outputs {list(outputs)} have no match (by name or "
                         f"index) for the reference's {missing}: export them, or rerun stage 1")
    sel = select_logits_output(data, outputs)
    first = (outputs[pairs[0][1]] if data.classifier else
             outputs[sel[0]] if sel else next(iter(outputs.values())))
    out: dict[str, Any] = {"n_images": len(data), "accuracy": None, "reason_accuracy": None,
                           "parity": None, "parity_outputs": None,
                           "nonfinite_outputs": nonfinite_outputs(data, outputs),
                           "synthetic_inputs": bool(data.synthetic),
                           "outputs": list(outputs),
                           "output_used": pairs[0][1] if data.classifier else
                           ({rn: on for rn, on, _ in pairs} or None)}
    if sel or (not data.classifier and len(outputs) > 1):  # which output holds the logits
        out["logits_output"] = {"output": sel[0] if sel else next(iter(outputs)),
                                "reference": sel[1] if sel else (
                                    pairs[0][0] if pairs else None),
                                "selected_by": (f"--logits-output {data.logits_output}"
                                                if sel else "default (the first output)"),
                                "matched_by": sel[2] if sel else (
                                    pairs[0][2] if pairs else None)}
    if data.classifier:
        out["accuracy"] = topk_accuracy(first, data.y)
        if data.ref is not None:
            out["parity"] = parity(data.ref, first)
    else:
        if data.y is not None:
            width = first.shape[1] if first.ndim == 2 else 0
            if not width or int(data.y.max()) >= width:
                raise UsageError(
                    f"--labels: class ids up to {int(data.y.max())} for a model whose first "
                    f"output {list(first.shape)} has "
                    + (f"{width} classes (ids 0..{width - 1})" if width else "no class axis")
                    + ": give the labels of these samples, one id per sample in 0..classes-1")
            # top-5 only where it says something (more than 5 classes)
            out["accuracy"] = topk_accuracy(first, data.y, ks=(1, 5) if width > 5 else (1,))
        else:
            out["reason_accuracy"] = ("synthetic inputs, no labels" if data.synthetic else
                                      "no --labels for these inputs")
        if data.ref is not None:
            out["parity_outputs"] = {rn: parity(data.ref[rn], outputs[on])
                                     for rn, on, _ in pairs}
            out["parity"] = (out["parity_outputs"][sel[1]] if sel and sel[1] is not None
                             and sel[1] in out["parity_outputs"] else
                             next(iter(out["parity_outputs"].values())))
    return out


def judge(rec: dict, next_step: str | None = None) -> dict:
    """Set ``status``, ``status_reason``, ``reason``, ``next_step`` and ``tolerance`` of a
    measured row from its parity (:func:`deploykit.compare.row_verdict`); a row without
    parity and with finite outputs (a reference run) stays as it is.

    Args:
        rec: a row with ``precision``, ``parity``, ``parity_outputs``, ``nonfinite_outputs`` and
            ``output_used`` (the output compared with the reference logits).
        next_step: the first diagnostic to run when the row is not ok (a shell-quoted command).
    Returns:
        ``rec``, updated in place.
    """
    pars = row_parities(rec)
    if not pars and not rec.get("nonfinite_outputs"):
        return rec
    v = row_verdict(rec["precision"], pars, rec.get("nonfinite_outputs"))
    rec.update(status=v["status"], status_reason=v["status_reason"], reason=v["status_reason"],
               tolerance=v["tolerance"],
               next_step=next_step if v["status"] != "ok" else None)
    return rec


def input_convention_hint(rec: dict, runner: Runner, data: EvalData) -> dict | None:
    """When an FP32/FP16 row of an image classifier is not ok, probe a few of its images
    (:mod:`deploykit.checks.input_probe`: RGB<->BGR, unnormalised 0..1 and 0..255) and, when one
    convention restores parity, append ``likely cause: ...; fix: ...`` to ``status_reason``
    (and ``reason``); the probe is stored under ``rec["diagnostics"]["input_convention"]``.
    The row's status never changes; an error in the probe is recorded, never raised.

    Returns:
        the probe's result, or None when it did not run (row ok, not FP32/FP16, no reference,
        not a classifier) or failed.
    """
    if (rec.get("status") == "ok" or not data.classifier or data.ref is None
            or row_tolerance(rec.get("precision"))[0] not in ("fp32", "fp16")
            or not isinstance(rec.get("output_used"), str)):
        return None
    on = rec["output_used"]

    def run(x: np.ndarray) -> np.ndarray:
        d = EvalData(feed={data.input_name: x}, ref=None)
        return run_outputs(runner, d, len(x))[on]

    try:
        res = probe_input_convention(run, data.x_u8, data.ref, data.mean, data.std,
                                     rec["precision"])
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a hint must never fail the row
        rec.setdefault("diagnostics", {})["input_convention"] = {
            "status": "error", "error": f"{type(e).__name__}: {e}"}
        return None
    rec.setdefault("diagnostics", {})["input_convention"] = res
    if res["cause"]:
        rec["status_reason"] = (f"{rec['status_reason']}; likely cause: {res['cause']}; "
                                f"fix: {res['fix']}")
        rec["reason"] = rec["status_reason"]
    return res


def verdict_warning(rec: dict) -> str | None:
    """The ``WARNING:`` line a stage prints for a row that is not ok (None when it is)."""
    if rec.get("status") not in ("warn", "failed") or not rec.get("status_reason"):
        return None
    what = ("does not reproduce the reference" if rec["status"] == "failed"
            else "is outside the ok band")
    line = (f"WARNING: row {rec['tag']} is {rec['status'].upper()}: {rec['precision']} "
            f"{what}: {rec['status_reason']}")
    if rec.get("next_step"):
        line += f". First diagnostic: {rec['next_step']}"
    return line


def base_record(stage: str, precision: str, model: str, tag: str, runner_desc: dict | None = None,
                backend: str | None = None, status: str = "ok", reason: str | None = None,
                **fields) -> dict:
    """A row with every schema field (see the module docstring), filled from ``runner_desc``
    (:meth:`deploykit.runners.Runner.describe`) and ``fields``."""
    d = dict(runner_desc or {})
    rec = result_record(stage, backend or d.get("backend", "?"), precision, model, tag,
                        status=status, reason=reason)
    rec.update({"variant": None, "device": d.get("device"), "device_name": d.get("device_name"),
                "device_index": d.get("device_index"), "ep_requested": d.get("ep_requested"),
                "ep_used": d.get("ep_used"), "cpu_fallback": d.get("cpu_fallback"),
                "runtime": d or None, "n_images": None, "batch_size": None,
                "preprocessing": None, "accuracy": None, "reason_accuracy": None,
                "parity": None, "parity_outputs": None, "nonfinite_outputs": None,
                "outputs": None, "output_used": None, "latency": None, "latency_batch": None,
                "harness_overhead_ms": None, "size_mb": None, "status_reason": None,
                "next_step": None, "tolerance": None, "diagnostics": {},
                "timings_s": {}, "measured_against": {}, "source": None,
                "stale_source": None, "first_look": None})
    rec.update(fields)
    return rec


#: Latency budget (s) of a row failed on its first look (no deployment candidate): at least
#: :data:`deploykit.timing.MIN_ITERS` timed runs, then at most this long (the row's
#: ``latency.max_seconds`` says so).
FAILED_LATENCY_S = 1.0


def evaluate(runner: Runner, data: EvalData, *, stage: str, precision: str, model: str,
             tag: str, args: Any, started: float, inputs: list = (), batch_size: int = 64,
             latency_batch: int = 1, warmup: int = 20, iters: int = 200,
             write: bool = True, next_step: str | None = None,
             reference: Path | None = None, evaluated: Path | None = None,
             source: dict | None = None, first_look: int = 0,
             **fields) -> tuple[dict, dict[str, np.ndarray]]:
    """Run ``data`` through ``runner``, score it, time it, and write the row.

    Args:
        stage: script name (``3_onnx_eval``). precision: row label. tag: row id.
        args / started / inputs: for the row's provenance (parsed arguments, start time,
            input files to hash).
        batch_size: largest batch of the accuracy pass. latency_batch: batch of the second
            latency measurement (batch 1 is always measured).
        write: write ``results/<model>/<tag>.json`` (False: the caller writes it, with
            ``keep_good=rec["status"] == "ok"``: a measured row replaces an earlier ok row).
        next_step: the first diagnostic to run, recorded when the row is not ok (:func:`judge`).
        reference / evaluated: the reference file compared with and the file evaluated,
            hashed into ``measured_against`` (:func:`deploykit.results.measured_against`).
        source: the derived file's :func:`deploykit.results.source_of` (its recorded fp32.onnx,
            calibration data, ONNX), or None.
        first_look: samples of a first look (:mod:`deploykit.sequential`; 0: none): a row they
            prove ``failed`` beyond doubt is measured on them only, ``first_look`` in the row
            says so (``decided: "failed"``, the reasons) and its latency loop gets
            :data:`FAILED_LATENCY_S`; any other row runs every sample. Only with a reference to
            compare with.
        fields: extra row fields (``variant``, ``size_mb``, ``preprocessing``, ...).
    Returns:
        ``(record, outputs)`` with ``outputs`` every model output over all samples (a
        classifier's compared output first, :func:`logits_first`); over the first look's
        samples only when it decided the row (``rec["first_look"]["decided"]``;
        :func:`evaluated_data` gives those samples).
    """
    if getattr(args, "max_seconds", None) is not None:  # the stage's --max-seconds (0: none)
        runner.max_seconds = args.max_seconds or float("inf")
    if getattr(args, "logits_output", None) is not None and data.logits_output is None:
        data.logits_output = args.logits_output  # the caller's data: its later checks agree
    t0 = time.perf_counter()
    looks = look_schedule(len(data), first_look) if data.ref is not None else []
    look = looks[-1] if looks else None
    early = None
    if look is None:
        print(f"{tag}: accuracy pass on {len(data)} samples, batch {batch_size}", file=sys.stderr,
              flush=True)
        raw = run_outputs(runner, data, batch_size, progress=f"{tag}")
    else:
        raw, data, early = _first_look_pass(runner, data, looks, batch_size, precision, tag)
    t1 = time.perf_counter()
    sel = select_logits_output(data, raw)
    if sel and sel[3]:
        print(sel[3], file=sys.stderr)
    elif output_warning(data, raw):
        print(output_warning(data, raw), file=sys.stderr)
    outputs = logits_first(data, raw)
    b, _ = batch_plan(len(data), batch_size, runner.batch_range)
    desc = runner.describe()  # after the pass: how it ran (e.g. ``cpu_chunk``, memory layout)
    rec = base_record(stage, precision, model, tag, desc, batch_size=b,
                      preprocessing=data.preprocessing, **score(data, outputs))
    rec["outputs"] = list(raw)  # graph order
    lat1 = 1 if runner.batch_range[0] <= 1 else runner.batch_range[0]
    if early:  # not a deployment candidate: its latency on a shorter budget (>= MIN_ITERS runs)
        runner.max_seconds = min(runner.max_seconds, FAILED_LATENCY_S)
        early["latency_budget_s"] = FAILED_LATENCY_S
    print(f"{tag}: latency at batch {lat1}: "
          + (f"up to {warmup} warm-up (at most {WARMUP_SECONDS:g} s after {MIN_WARMUP})"
             if warmup > MIN_WARMUP else f"{warmup} warm-up")
          + f" + up to {iters} timed runs (at "
          f"most {runner.max_seconds:g} s, at least {min(iters, MIN_ITERS)} runs)",
          file=sys.stderr, flush=True)
    rec["latency"] = latency(runner, data, lat1, warmup, iters)
    # latency_batch 1 (the default) is the batch-1 block above, measured at the smallest batch
    # the model takes (its static batch); any other batch is a second measurement.
    if latency_batch not in (1, lat1):
        rec["latency_batch"] = latency(runner, data, latency_batch, warmup, iters)
    rec["harness_overhead_ms"] = harness_overhead_ms()
    if look is not None:
        rec["first_look"] = early or {"n": len(look), "n_total": len(data), "decided": None,
                                      "seed": FIRST_LOOK_SEED}
    # Where the stage's time went (s), for benchmarks/profile_run.py.
    rec["timings_s"] = {"inference": round(t1 - t0, 3),
                        "latency": round(time.perf_counter() - t1, 3)}
    rec.update(fields)
    judge(rec, next_step)
    if early:
        rec["status_reason"] = rec["reason"] = (
            f"{rec['status_reason']} (decided on a first look at {early['n']} of "
            f"{early['n_total']} samples, seeded random: failed beyond doubt at alpha "
            f"{early['alpha']:g} per look, {ALPHA:g} over both, first_look in the row; "
            "--full-eval measures every sample)")
    rec["measured_against"] = measured_against(reference, evaluated, source)
    rec["source"] = row_source(source)
    input_convention_hint(rec, runner, data)
    rec["provenance"] = provenance(args, inputs, started,
                                   f"cuda:{desc.get('device_index') or 0}"
                                   if desc.get("device") == "cuda" else None)
    if write:
        # A measured row describes the file on disk: a warn/failed verdict replaces an earlier
        # ok row (which measured another file, or was judged by no verdict).
        write_result(model, tag, rec, keep_good=rec["status"] == "ok")
    return rec, outputs


def _first_look_pass(runner: Runner, data: EvalData, looks: list[np.ndarray], batch_size: int,
                     precision: str, tag: str
                     ) -> tuple[dict[str, np.ndarray], EvalData, dict | None]:
    """The accuracy pass with a first look (:mod:`deploykit.sequential`): the nested ``looks``
    of :func:`deploykit.sequential.look_schedule` (a random
    :data:`~deploykit.sequential.FIRST_PEEK` of the first look, then all of it), each judged at
    :data:`~deploykit.sequential.LOOK_ALPHA`; when one proves the row ``failed`` beyond doubt the
    pass stops there, else the other samples run. Each sample is computed once.

    Returns:
        ``(outputs, data, early)``: the outputs of ``data`` (the deciding look's samples, in
        increasing index order, when one decided; else the whole split, in its order), and the
        row's ``first_look`` block when a look decided (None otherwise).
    """
    n_total, look = len(data), looks[-1]
    print(f"{tag}: first look on {len(look)} of {n_total} samples (seeded random"
          + (f", {len(looks[0])} of them first" if len(looks) > 1 else "")
          + "); the rest run unless they prove the row failed beyond doubt", file=sys.stderr)
    done, raw = np.empty(0, np.int64), {}
    for idx in [*looks, np.arange(n_total)]:
        new = np.setdiff1d(idx, done)
        got = run_outputs(runner, data.take(new), batch_size,
                          progress=f"{tag}" + (" first look" if len(idx) < n_total else ""))
        order = np.argsort(np.concatenate([done, new]), kind="stable")
        raw = {k: np.concatenate([raw[k], v] if raw else [v])[order] for k, v in got.items()}
        done = np.sort(np.concatenate([done, new]))
        if len(done) == n_total:
            return raw, data, None
        part = data.take(done)
        sc = score(part, logits_first(part, raw))
        reasons = failed_beyond_doubt(precision, row_parities(sc), sc.get("nonfinite_outputs"),
                                      len(done), LOOK_ALPHA)
        if reasons:
            print(f"{tag}: failed beyond doubt on {len(done)} samples of the first look "
                  f"({'; '.join(reasons)}): the other {n_total - len(done)} samples are not run "
                  "(--full-eval runs them)", file=sys.stderr)
            return raw, part, {"n": len(done), "n_total": n_total, "decided": "failed",
                               "seed": FIRST_LOOK_SEED, "alpha": LOOK_ALPHA, "look": len(look),
                               "peek": len(looks[0]) if len(looks) > 1 else None,
                               "reasons": reasons}
    raise AssertionError("unreachable: the last pass covers every sample")


def evaluated_data(data: EvalData, rec: dict) -> EvalData:
    """The samples of ``data`` that the row ``rec`` was measured on: the deciding look's
    (:func:`deploykit.sequential.decided_indices`, in the order :func:`evaluate` returned their
    outputs) when a first look decided the row, else ``data`` itself. Diagnostics that compare a
    row's outputs with another run (the backend cross-check) take these samples."""
    idx = decided_indices(rec.get("first_look"))
    return data if idx is None else data.take(idx)


def diagnose(rec: dict, name: str, fn: Callable[[], dict]) -> dict | None:
    """Run the diagnostic ``fn`` after the row was written, store its result under
    ``rec["diagnostics"][name]`` and rewrite the row; the row's status never changes. An error
    in the diagnostic is recorded there (and printed), never raised.

    Returns:
        the diagnostic's result, or None when it failed.
    """
    t0 = time.perf_counter()
    try:
        res = fn()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a diagnostic must never fail the row
        msg = f"{type(e).__name__}: {e}"
        print(f"WARNING: diagnostic {name} of {rec['tag']} failed (the row stays "
              f"{rec['status']}): {msg}", file=sys.stderr)
        rec.setdefault("diagnostics", {})[name] = {"status": "error", "error": msg}
        res = None
    else:
        rec.setdefault("diagnostics", {})[name] = res
    rec.setdefault("timings_s", {})[f"diagnostic:{name}"] = round(time.perf_counter() - t0, 3)
    write_result(rec["model"], rec["tag"], rec)
    return res


def primary_latency(rec: dict) -> dict:
    """The batch-1 end-to-end latency stats of a row (``{}`` when it has none)."""
    lat = rec.get("latency") or {}
    return lat.get("end_to_end_ms") or {}


def summary_line(rec: dict) -> str:
    """One console line: backend, precision, EP, accuracy/parity and batch-1 p50."""
    acc, par = rec.get("accuracy"), rec.get("parity") or {}
    bits = [f"{rec['backend']} {rec['precision']} ({rec.get('ep_used') or rec.get('device')})"]
    if acc:
        bits.append(f"top-1 {acc['top1']:.2f}%"
                    + (f" top-5 {acc['top5']:.2f}%" if acc.get("top5") is not None else "")
                    + f" on {rec['n_images']} images"
                    + (f" (first look of {rec['first_look']['n_total']})"
                       if (rec.get("first_look") or {}).get("decided") else ""))
    if len(rec.get("outputs") or ()) > 1 and isinstance(rec.get("output_used"), str):
        bits.append(f"output {rec['output_used']!r} of {len(rec['outputs'])}")
    if par:
        bits.append(f"cosine {par['cosine_mean']:.5f}" + (
            f" top-1 agreement {par['top1_agreement']:.1f}%" if "top1_agreement" in par else ""))
    if rec.get("nonfinite_outputs"):
        bits.append("NON-FINITE OUTPUTS: " + ", ".join(
            f"{n} NaN/Inf values in {k}" for k, n in rec["nonfinite_outputs"].items()))
    p50 = primary_latency(rec).get("p50_ms")
    if p50 is not None:
        bits.append(f"batch-{primary_latency(rec).get('batch') or 1} p50 {p50:.3f} ms")
    gpu = ((rec.get("latency") or {}).get("gpu_compute_ms") or {}).get("p50_ms")
    if gpu is not None:
        bits.append(f"GPU compute p50 {gpu:.3f} ms")
    return ", ".join(bits)
