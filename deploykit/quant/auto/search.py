"""The search: the accuracy budget, output metrics against the FP32 reference, the cached runs
and the greedy choice of nodes to keep in float.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence
import numpy as np

from deploykit.compare import compare, parity, topk_accuracy
from deploykit.errors import StageError
from deploykit.evaluate import run_outputs
from deploykit.io import atomic_path, load_npz, write_json
from deploykit.quant.auto.space import QdqSpace
from deploykit.runners import OrtRunner


VARIANT = "int8_auto"


DEFAULT_BUDGET = {"min_agreement": 99.5, "min_cosine": 0.999, "max_top1_drop": None}


#: What every measurement of the search runs on (written into every output).
SEMANTICS = ("ONNX Runtime CPU EP, all graph optimisations disabled: the Q/DQ graph's own "
             "semantics (DequantizeLinear + float ops), never ORT's fused int8 kernels (u8s8, "
             "which saturate on x86-64 CPUs without VNNI, onnxruntime PR #12088); reference: "
             "the FP32 ONNX model run the same way")


MODE = "ort-cpu-opt-disable"


CACHE_VERSION = 2  # 2: every output measured, NaN/Inf counted (metrics)


# --------------------------------------------------------------------------------------------
# Budget and metrics
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Budget:
    """The accuracy a configuration must keep, against the FP32 model on the same images.

    Attributes:
        min_agreement: top-1 agreement with FP32, % of images (None: not checked).
        min_cosine: mean cosine similarity of the logits (None: not checked).
        max_top1_drop: top-1 (vs labels) may be at most this many points below FP32's (None:
            not checked).
    """

    min_agreement: float | None = DEFAULT_BUDGET["min_agreement"]
    min_cosine: float | None = DEFAULT_BUDGET["min_cosine"]
    max_top1_drop: float | None = DEFAULT_BUDGET["max_top1_drop"]

    def misses(self, m: dict) -> list[str]:
        """What ``m`` (:func:`metrics`) misses, one phrase each (empty: the budget is met)."""
        out = []
        if self.min_agreement is not None:
            a = m.get("agreement")
            if a is None:
                out.append("top-1 agreement: not defined for this output (not 2-D)")
            elif a < self.min_agreement:
                out.append(f"top-1 agreement {a:.2f}% < {self.min_agreement}%")
        if m.get("nonfinite"):  # whatever the bounds: a model that returns NaN/Inf fails
            out.append(f"{m['nonfinite']} of {m['n']} samples give NaN/Inf outputs")
        c = m.get("cosine_mean")
        if self.min_cosine is not None:
            if c is None or not np.isfinite(c):
                if not m.get("nonfinite"):
                    out.append("cosine undefined (NaN/Inf outputs)")
            elif c < self.min_cosine:
                out.append(f"cosine {c:.5f} < {self.min_cosine}")
        if self.max_top1_drop is not None:
            d = m.get("delta_top1")
            if d is None:
                out.append("delta top-1: no labels")
            elif -d > self.max_top1_drop:
                out.append(f"top-1 {d:+.2f} points vs FP32 (allowed -{self.max_top1_drop})")
        return out

    def met(self, m: dict) -> bool:
        return not self.misses(m)

    def describe(self) -> str:
        bits = []
        if self.min_agreement is not None:
            bits.append(f"top-1 agreement >= {self.min_agreement}%")
        if self.min_cosine is not None:
            bits.append(f"logits cosine (mean) >= {self.min_cosine}")
        if self.max_top1_drop is not None:
            bits.append(f"top-1 drop <= {self.max_top1_drop} points")
        return ", ".join(bits) or "none"

    def margins(self, m: dict) -> dict:
        """Signed distance of ``m`` to each bound (>= 0 = met), in the bound's unit."""
        out = {}
        if self.min_agreement is not None and m.get("agreement") is not None:
            out["agreement_points"] = m["agreement"] - self.min_agreement
        if self.min_cosine is not None and m.get("cosine_mean") is not None:
            out["cosine"] = m["cosine_mean"] - self.min_cosine
        if self.max_top1_drop is not None and m.get("delta_top1") is not None:
            out["top1_points"] = m["delta_top1"] + self.max_top1_drop
        return out


def _as_outputs(x) -> dict[str, np.ndarray]:
    """``{name: array}`` of a model's outputs (a bare array is one output named ``output``)."""
    return dict(x) if isinstance(x, dict) else {"output": np.asarray(x)}


def output_metrics(ref, out, labels: np.ndarray | None = None) -> dict:
    """Accuracy of ``out`` against the FP32 reference ``ref`` on the same samples.

    Every output counts: the cosine figures are the worst over the model's outputs (a node that
    only feeds a second output is judged too); top-1 agreement, flips and top-1 come from the
    first output (the logits of a classifier). A sample whose output holds NaN/Inf where the
    reference is finite is counted in ``nonfinite``, disagrees, and leaves the cosine undefined
    (None): :meth:`Budget.misses` counts that as a miss, never as a pass.

    Args:
        ref, out: ``{output name: [N, ...] float}`` in graph order (or one array, the only
            output; logits ``[N, classes]`` for a classifier). labels: int ``[N]`` or None.
    Returns:
        ``{"n", "agreement" (%, None unless the first output is 2-D), "cosine_mean",
        "cosine_min" (None when an output is non-finite), "nonfinite" (samples), "top1",
        "top1_fp32", "delta_top1" (points; None without labels), "flips" (samples whose top-1
        differs), "outputs" (per output ``{"cosine_mean", "cosine_min", "nonfinite"}``, only
        with several outputs)}``.
    Raises:
        StageError: the outputs' names or shapes differ from the reference's.
    """
    ref, out = _as_outputs(ref), _as_outputs(out)
    if list(ref) != list(out):
        raise StageError(f"outputs {list(out)} differ from the FP32 model's {list(ref)}")
    per = {}
    bad_rows = None
    for d in compare(ref, out):
        k, r, o = d.ref_name, ref[d.ref_name], out[d.ref_name]
        if d.status == "shape":
            raise StageError(f"output {k!r}: shape {o.shape} != FP32 {r.shape}")
        n = len(o) if o.ndim else 1
        # a sample counts as non-finite when its output row is and its reference row is not
        bad = ~np.isfinite(np.asarray(o, np.float64).reshape(n, -1)).all(1) & \
            np.isfinite(np.asarray(r, np.float64).reshape(n, -1)).all(1)
        bad_rows = bad if bad_rows is None else bad_rows | bad
        par = d.parity if d.parity is not None else parity(r, o)
        ok = bool(np.isfinite([par["cosine_mean"], par["cosine_min"]]).all())
        per[k] = {"cosine_mean": par["cosine_mean"] if ok else None,
                  "cosine_min": par["cosine_min"] if ok else None, "nonfinite": int(bad.sum())}
    first = next(iter(ref))
    r0, o0 = ref[first], out[first]
    undefined = any(v["cosine_mean"] is None for v in per.values())
    m = {"n": int(len(o0)), "agreement": None,
         "cosine_mean": None if undefined else min(v["cosine_mean"] for v in per.values()),
         "cosine_min": None if undefined else min(v["cosine_min"] for v in per.values()),
         "nonfinite": int(bad_rows.sum()) if bad_rows is not None else 0,
         "top1": None, "top1_fp32": None, "delta_top1": None, "flips": None}
    if r0.ndim == 2:
        rows_ok = np.isfinite(o0).all(1)
        same = (r0.argmax(-1) == o0.argmax(-1)) & rows_ok
        m["agreement"] = float(100.0 * same.mean())
        m["flips"] = int((~same).sum())
        if labels is not None:
            hit = (o0.argmax(-1) == labels) & rows_ok
            m["top1"] = float(100.0 * hit.mean())
            m["top1_fp32"] = topk_accuracy(r0, labels, (1,))["top1"]
            m["delta_top1"] = m["top1"] - m["top1_fp32"]
    if len(per) > 1:
        m["outputs"] = per
    return m


def cosine_error(m: dict) -> float:
    """``1 - cosine_mean`` of metrics ``m``; 2.0 (the largest possible) when the cosine is
    undefined (NaN/Inf outputs), so a node that breaks the model ranks as the most sensitive."""
    c = m.get("cosine_mean")
    return 2.0 if c is None or not np.isfinite(c) else 1.0 - c


# --------------------------------------------------------------------------------------------
# Running configurations, and the cache
# --------------------------------------------------------------------------------------------
def run_model(model_or_path, data, batch: int = 64, desc: str = "auto-precision"
              ) -> dict[str, np.ndarray]:
    """Every output of ``model_or_path`` (``ModelProto``, bytes or path) over ``data``
    (``deploykit.evaluate.EvalData``) on ORT's CPU EP with graph optimisations disabled.

    Returns:
        ``{output name: float32 [N, ...]}`` in the graph's output order.
    Raises:
        StageError: ORT cannot load or run the model.
    """

    src = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") \
        else model_or_path
    with OrtRunner(src, "cpu", opt_level="disable") as r:
        outs = run_outputs(r, data, batch, progress=desc)
        return {k: np.asarray(outs[k], np.float32) for k in r.output_names}


def data_digest(data) -> str:
    """SHA-256 of the samples of an ``deploykit.evaluate.EvalData`` (images, labels and normalisation,
    or the feed arrays)."""
    h = hashlib.sha256()
    if data.classifier:
        for a in (data.x_u8, data.y):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(json.dumps([list(data.mean), list(data.std), data.input_name]).encode())
    else:
        for k in sorted(data.feed):
            h.update(k.encode())
            h.update(np.ascontiguousarray(data.feed[k]).tobytes())
    return h.hexdigest()


class Cache:
    """Metrics of configurations, keyed by the set of candidates kept in float, in one JSON
    file per measurement key (:func:`cache_key`); written after every new measurement (an
    interrupted search resumes), atomically.

    Args:
        folder: cache folder. key_fields: what the measurements depend on (hashed).
    """

    def __init__(self, folder: Path | str, key_fields: dict):
        self.folder = Path(folder)
        self.key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
        self.path = self.folder / f"{self.key}.json"
        self.data = {"version": CACHE_VERSION, "key_fields": key_fields, "configs": {}}
        if self.path.exists():
            try:
                d = json.loads(self.path.read_text())
                if d.get("version") == CACHE_VERSION and d.get("key_fields") == key_fields:
                    self.data = d
            except (OSError, json.JSONDecodeError):
                print(f"WARNING: unreadable cache {self.path}: starting a new one",
                      file=sys.stderr)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def config_id(float_nodes: Iterable[str]) -> str:
        return hashlib.sha256("\n".join(sorted(float_nodes)).encode()).hexdigest()[:20]

    def get(self, float_nodes: Iterable[str]) -> dict | None:
        rec = self.data["configs"].get(self.config_id(float_nodes))
        if rec is not None:
            self.hits += 1
            return rec["metrics"]
        return None

    def put(self, float_nodes: Iterable[str], m: dict) -> None:
        self.misses += 1
        self.data["configs"][self.config_id(float_nodes)] = {"float": sorted(float_nodes),
                                                             "metrics": m}
        write_json(self.path, self.data)

    def array_path(self, what: str) -> Path:
        return self.folder / f"{self.key}.{what}.npy"


def cached_outputs(path: Path, make: Callable[[], dict]) -> dict[str, np.ndarray]:
    """The ``{name: array}`` saved in ``path`` (an ``.npz``) if it exists and is readable, else
    ``make()`` saved there atomically."""
    if path.exists():
        try:
            z = load_npz(path, None, "auto_precision.py search (its cache)")
            names = json.loads(str(z["__names__"]))
            return {k: z[f"o{i}"] for i, k in enumerate(names)}
        except (StageError, ValueError, KeyError):
            print(f"WARNING: unreadable {path}: recomputing", file=sys.stderr)
    outs = make()
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:  # keys o0, o1...: output names need not be valid npz keys
            np.savez(f, __names__=np.array(json.dumps(list(outs))),
                     **{f"o{i}": v for i, v in enumerate(outs.values())})
    return outs


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------
def search(space: QdqSpace, data, ref: np.ndarray, budget: Budget, cache: Cache,
           batch: int = 64, prune: bool = True, log: Callable[[str], None] | None = None
           ) -> dict:
    """Measure every candidate's sensitivity and the ranking path, and choose the nodes to keep
    in float (module docstring, step 4).

    Args:
        space: the configurations (:class:`QdqSpace`). data: ``deploykit.evaluate.EvalData`` of the tuning
            split; ref: FP32 outputs on it (``{name: [N, ...]}``, :func:`run_model`); budget:
            what must hold there.
        cache: measured configurations (read and extended).
        prune: try each chosen node back in INT8 (measured); False = the path's prefix only.
    Returns:
        ``{"candidates": [per-node rows in graph order], "full_int8", "all_float", "path"
        ([{"n_float", "node", "int8_mac_fraction", "metrics", "met"}] for 0..n nodes in
        float), "excluded" (names, graph order), "predicted" (metrics of the chosen
        configuration), "budget_met", "budget_misses", "budget_margins", "int8_mac_fraction"
        (of all MACs of the model), "order" (ranking), "steps" (pruning trials),
        "evaluations": {"run", "cached"}, "fixed_qdq"}``.
    Raises:
        StageError: the budget cannot be met even with every candidate in float (the message
            names what still misses it and the Q/DQ outside the candidates).
    """
    log = log or (lambda s: print(s, file=sys.stderr))
    labels = data.y if data.classifier else None
    names = space.names
    everything = frozenset(names)
    counter = {"n": 0}

    def measure(float_nodes: Iterable[str]) -> dict:
        float_nodes = frozenset(float_nodes)
        m = cache.get(float_nodes)
        if m is None:
            counter["n"] += 1
            out = run_model(space.model(float_nodes), data, batch,
                            desc=f"config {counter['n']} ({len(float_nodes)} float)")
            m = output_metrics(ref, out, labels)
            cache.put(float_nodes, m)
        return m

    t0 = time.time()
    full = measure(())
    none = measure(everything)
    log(f"auto-precision: {len(names)} candidates; all INT8: {fmt_metrics(full)}; all float: "
        f"{fmt_metrics(none)}")
    rows = []
    for i, c in enumerate(space.candidates):
        q_alone = measure(everything - {c.name})
        f_alone = measure({c.name})
        added = max(0.0, cosine_error(q_alone))
        removed = max(0.0, cosine_error(full) - cosine_error(f_alone))
        rows.append({
            "name": c.name, "op_type": c.op_type, "index": c.index, "macs": c.macs,
            "mac_share": c.macs / space.total_macs if space.total_macs else None,
            "int8_alone": q_alone, "float_alone": f_alone,
            "cosine_error_added": added, "cosine_error_removed": removed,
            "flips_added": q_alone.get("flips"),
            "flips_removed": (full["flips"] - f_alone["flips"])
            if full.get("flips") is not None else None,
            "score": max(added, removed)})
        if (i + 1) % 10 == 0 or i + 1 == len(names):
            log(f"auto-precision: sensitivity measured for {i + 1}/{len(names)} nodes "
                f"({time.time() - t0:.0f} s)")
    # error per MAC, highest first; ties (and zero-MAC nodes) by graph order
    order = sorted(rows, key=lambda r: (-(r["score"] / max(r["macs"], 1)), r["index"]))
    order_names = [r["name"] for r in order]
    macs = {c.name: c.macs for c in space.candidates}

    def int8_fraction(float_nodes) -> float | None:
        if not space.total_macs:
            return None
        return (sum(macs.values()) - sum(macs[n] for n in float_nodes)) / space.total_macs

    path = []
    t1 = time.time()
    for p in range(len(order_names) + 1):
        m = full if p == 0 else none if p == len(order_names) else measure(order_names[:p])
        path.append({"n_float": p, "node": order_names[p - 1] if p else None,
                     "int8_mac_fraction": int8_fraction(order_names[:p]), "metrics": m,
                     "met": budget.met(m)})
        if p and p % 10 == 0:
            log(f"auto-precision: path measured up to {p}/{len(order_names)} nodes in float "
                f"({time.time() - t1:.0f} s)")
    if not budget.met(none):
        raise StageError(
            f"the budget ({budget.describe()}) is not met even with every candidate in float "
            f"({'; '.join(budget.misses(none))}); Q/DQ outside the candidates stay quantized: "
            f"{space.fixed[:8] or 'none'}. Loosen the budget (--min-agreement, --min-cosine, "
            "--max-top1-drop) or quantize fewer op types")
    first = next(r["n_float"] for r in path if r["met"])
    excluded = order_names[:first]
    steps = []
    if prune:
        for name in sorted(excluded, key=lambda n: (-macs[n], names.index(n))):
            trial = [n for n in excluded if n != name]
            m = measure(trial)
            steps.append({"why": f"prune: {name} back in INT8", "float": sorted(trial),
                          "metrics": m, "met": budget.met(m)})
            if budget.met(m):
                excluded = trial
    excluded = sorted(excluded, key=names.index)
    chosen = measure(excluded)
    rank = {n: i + 1 for i, n in enumerate(order_names)}
    for r in rows:
        r["rank"] = rank[r["name"]]
        r["kept_float"] = r["name"] in excluded
    return {"candidates": rows, "full_int8": full, "all_float": none, "path": path,
            "path_choice": first, "pruned": prune, "excluded": excluded,
            "predicted": chosen, "budget_met": budget.met(chosen),
            "budget_misses": budget.misses(chosen), "budget_margins": budget.margins(chosen),
            "int8_mac_fraction": int8_fraction(excluded), "order": order_names,
            "steps": steps, "evaluations": {"run": cache.misses, "cached": cache.hits},
            "fixed_qdq": space.fixed}


def budget_warnings(budget: Budget, n: int) -> list[str]:
    """What the tuning split's size ``n`` cannot resolve in ``budget`` (empty: nothing).

    On ``n`` samples top-1 agreement moves in steps of 100 / n points: below
    ``100 / (100 - min_agreement)`` samples a single flip already misses the bound, so the
    budget means "no flip at all" and says little about the evaluation split (with 1-3
    samples it is met by chance).
    """
    out = []
    if budget.min_agreement is not None and budget.min_agreement < 100 and n > 0:
        need = int(np.ceil(100.0 / (100.0 - budget.min_agreement) - 1e-9))
        if n < need:
            out.append(f"the tuning split has {n} sample(s): one flip moves top-1 agreement by "
                       f"{100.0 / n:.2f} points, so --min-agreement {budget.min_agreement} "
                       f"allows no flip at all and the choice rests on very few samples; use "
                       f">= {need} samples (0_prepare_data.py --tune-fraction, --tune-npz) or "
                       f"a lower --min-agreement")
    return out


def fmt_metrics(m: dict) -> str:
    bits = []
    if m.get("agreement") is not None:
        bits.append(f"agreement {m['agreement']:.2f}%")
    if m.get("cosine_mean") is None:
        bits.append("cosine undefined")
    else:
        bits.append(f"cosine {m['cosine_mean']:.5f} (min {m['cosine_min']:.4f})")
    if m.get("nonfinite"):
        bits.append(f"{m['nonfinite']} sample(s) NaN/Inf")
    if m.get("delta_top1") is not None:
        bits.append(f"top-1 {m['top1']:.2f}% ({m['delta_top1']:+.2f})")
    return ", ".join(bits)


def anchored(names: Sequence[str]) -> list[str]:
    """``^name$`` regexes (ModelOpt matches ``--nodes_to_exclude`` with ``re.match``)."""
    return [f"^{re.escape(n)}$" for n in names]
