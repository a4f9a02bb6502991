"""The sweep spec: models x variants x targets, from the command line or a small TOML file.

A TOML spec (every key optional except ``models``; the command line overrides what it gives)::

    models = ["efficientnet_lite0",
              {name = "tests.sweep.tiny_models:tiny_cnn", input_shape = "x:1,3,16,16"}]
    variants = ["fp16", "int8_hp32"]      # the rows to compare (default ["fp32"]); the
                                          # PyTorch FP32 reference and the export always run
    targets = ["cpu", "orin", "h100"]
    limit = 64                            # run_all.sh --limit: smoke runs on N eval images

    [budget]                              # the verdict's accuracy budget
    min_agreement = 99.0                  # top-1 agreement with PyTorch FP32, %
    max_top1_drop = 0.5                   # top-1 points below PyTorch FP32 (labelled models)
    min_cosine = 0.999                    # mean logits cosine (models without labels)

    [target.h100]                         # a GPU model: Ray labels GPU nodes by their model
    resources = {"accelerator_type:H100" = 0.001}
    num_gpus = 1
    trt = true
    rows = "trt"

    [target.orin]                         # a target of your own, or a built-in one redefined
    resources = {orin = 1}                # Ray custom resources a node must offer
    num_gpus = 0
    trt = true                            # build and time TensorRT engines (stages 6-7) there
    rows = "trt"                          # which rows are this target's: "cpu" or "trt"
"""
from __future__ import annotations

import dataclasses
import shlex
import tomllib
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """A sweep spec that cannot run; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a pipeline runs and which of its rows belong to that device.

    Attributes:
        name: target name (``cpu``, ``cuda``, ``orin`` or one of the spec's own).
        num_cpus: CPUs the pipeline's Ray task takes; None: the sweep's ``--cpus-per-pipeline``.
        num_gpus: GPUs the task takes (Ray ``num_gpus``).
        resources: Ray custom resources the task needs, e.g. ``{"orin": 1}``.
        trt: whether the pipeline builds and evaluates TensorRT engines (stages 6-7).
        rows: ``"cpu"`` (PyTorch/ORT rows computed on the CPU) or ``"trt"`` (TensorRT rows).
    """

    name: str
    num_cpus: float | None = None
    num_gpus: float = 0
    resources: tuple[tuple[str, float], ...] = ()
    trt: bool = False
    rows: str = "cpu"

    def as_dict(self) -> dict:
        """JSON-able form (the stamp and the report record it).

        Returns:
            dict with every field; ``resources`` as a dict.
        """
        d = dataclasses.asdict(self)
        d["resources"] = dict(self.resources)
        return d


BUILTIN_TARGETS: dict[str, Target] = {
    # ORT CPU EP and PyTorch CPU rows; stages 6-7 are not run.
    "cpu": Target("cpu"),
    # any NVIDIA GPU node: TensorRT engines built and timed there.
    "cuda": Target("cuda", num_gpus=1, trt=True, rows="trt"),
    # a Jetson Orin node started with --resources='{"orin": 1}' (JetPack's TensorRT).
    "orin": Target("orin", resources=(("orin", 1.0),), trt=True, rows="trt"),
}

ROW_KINDS = ("cpu", "trt")


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model of the sweep, in any of the three ways the pipeline accepts one.

    Attributes:
        name: ``mobilenet_v3_small``, ``efficientnet_lite0``, a torchvision classifier name or
            ``package.module:factory``.
        input_shape: run_all.sh ``INPUT_SHAPE`` (custom models only), e.g. ``"x:1,3,16,16"``.
        weights: run_all.sh ``WEIGHTS`` (a local state dict), or None.
    """

    name: str
    input_shape: str | None = None
    weights: str | None = None

    @property
    def custom(self) -> bool:
        """True for a ``package.module:factory`` model (stages 0 and 4-7 do not apply)."""
        return ":" in self.name


@dataclasses.dataclass(frozen=True)
class Budget:
    """The accuracy budget of the verdict (against the model's PyTorch FP32 row).

    Attributes:
        min_agreement: top-1 agreement with PyTorch FP32, % (every row).
        max_top1_drop: allowed top-1 drop, percentage points (rows with accuracy).
        min_cosine: mean logits cosine similarity (rows without accuracy).
    """

    min_agreement: float = 99.0
    max_top1_drop: float = 0.5
    min_cosine: float = 0.999


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    """A whole sweep.

    Attributes:
        models: the models, in order.
        variants: variant names of ``variants.py`` (fp32 always runs: it is the export).
        targets: the targets, in order.
        limit: run_all.sh ``--limit`` (images), or None for full runs.
        budget: the verdict's budget.
    """

    models: tuple[ModelEntry, ...]
    variants: tuple[str, ...]
    targets: tuple[Target, ...]
    limit: int | None = None
    budget: Budget = Budget()


def _target_from_table(name: str, table: Any, base: Target | None) -> Target:
    if not isinstance(table, dict):
        raise SpecError(f"[target.{name}] must be a table (e.g. resources = {{orin = 1}})")
    known = {"num_cpus", "num_gpus", "resources", "trt", "rows"}
    extra = sorted(set(table) - known)
    if extra:
        raise SpecError(f"[target.{name}]: unknown key(s) {', '.join(extra)}; "
                        f"known: {', '.join(sorted(known))}")
    t = base or Target(name)
    res = table.get("resources", dict(t.resources))
    if not isinstance(res, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in res.items()):
        raise SpecError(f"[target.{name}] resources must map names to positive numbers, "
                        f"e.g. resources = {{orin = 1}}; got {res!r}")
    for key in ("CPU", "GPU"):
        if key in res:
            raise SpecError(f"[target.{name}] resources: use num_cpus / num_gpus, not {key}")
    rows = table.get("rows", t.rows)
    if rows not in ROW_KINDS:
        raise SpecError(f"[target.{name}] rows = {rows!r}: use one of {', '.join(ROW_KINDS)}")
    num_cpus = table.get("num_cpus", t.num_cpus)
    num_gpus = table.get("num_gpus", t.num_gpus)
    for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
            raise SpecError(f"[target.{name}] {k} must be a number >= 0, got {v!r}")
    trt = table.get("trt", t.trt)
    if not isinstance(trt, bool):
        raise SpecError(f"[target.{name}] trt must be true or false, got {trt!r}")
    return Target(name, num_cpus=num_cpus, num_gpus=num_gpus,
                  resources=tuple(sorted((k, float(v)) for k, v in res.items())), trt=trt,
                  rows=rows)


def _model_entry(item: Any) -> ModelEntry:
    if isinstance(item, str):
        m = ModelEntry(item)
    elif isinstance(item, dict):
        extra = sorted(set(item) - {"name", "input_shape", "weights"})
        if extra or not isinstance(item.get("name"), str):
            raise SpecError(f"models: {item!r}: a model is a name or a table "
                            "{name = ..., input_shape = ..., weights = ...}")
        m = ModelEntry(item["name"], item.get("input_shape"), item.get("weights"))
    else:
        raise SpecError(f"models: {item!r} is neither a model name nor a table")
    if not m.name.strip():
        raise SpecError("models: an empty model name; give a model name (README, Models)")
    if m.custom and not m.input_shape:
        raise SpecError(f"model {m.name} is a custom model: give its input shape "
                        f"(--input-shape {shlex.quote(m.name + '=x:1,3,224,224')} or "
                        "input_shape in the TOML)")
    if not m.custom and m.input_shape:
        raise SpecError(f"model {m.name}: an input shape is for custom models "
                        "(package.module:factory) only; leave it out")
    return m


def load_toml(path: Path) -> dict:
    """Read a TOML sweep spec.

    Args:
        path: the file.

    Returns:
        the parsed table.

    Raises:
        SpecError: the file is missing or not valid TOML (the message names the line).
    """
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SpecError(f"--spec {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"--spec {path}: not valid TOML: {e}") from None


def build_spec(table: dict | None = None, *, models: list[str] | None = None,
               variants: list[str] | None = None, targets: list[str] | None = None,
               input_shapes: list[str] | None = None, weights: list[str] | None = None,
               limit: int | None = None, budget: dict | None = None) -> SweepSpec:
    """Merge a TOML table and command-line values (the command line wins) into a spec.

    Args:
        table: the parsed TOML spec, or None.
        models: ``--models`` names.
        variants: ``--variants`` names (not checked against variants.py here).
        targets: ``--targets`` names (built-in or defined in the table's ``[target.X]``).
        input_shapes: ``--input-shape MODEL=SHAPES`` items.
        weights: ``--weights MODEL=PATH`` items.
        limit: ``--limit`` images, or None.
        budget: budget fields given on the command line (None values are ignored).

    Returns:
        the validated :class:`SweepSpec`.

    Raises:
        SpecError: an unknown key or target, an empty list, a custom model without its input
            shape, a bad budget or limit.
    """
    table = dict(table or {})
    known = {"models", "variants", "targets", "limit", "budget", "target"}
    extra = sorted(set(table) - known)
    if extra:
        raise SpecError(f"spec: unknown key(s) {', '.join(extra)}; known: "
                        f"{', '.join(sorted(known))}")
    raw_models = list(models) if models else list(table.get("models") or [])
    if not raw_models:
        raise SpecError("no models: give --models NAME ... or models = [...] in the spec")
    overrides: dict[str, dict] = {}
    for flag, items, key in (("--input-shape", input_shapes, "input_shape"),
                             ("--weights", weights, "weights")):
        for item in items or []:
            name, sep, value = item.rpartition("=")
            if not sep or not name or not value:
                raise SpecError(f"{flag} {item!r}: write MODEL=VALUE, e.g. "
                                f"{flag} 'pkg.mod:factory=x:1,3,224,224'")
            overrides.setdefault(name, {})[key] = value
    entries = []
    for item in raw_models:
        m = item if isinstance(item, dict) else {"name": item}
        m = {**m, **overrides.get(m.get("name"), {})}
        entries.append(_model_entry(m))
    names = [e.name for e in entries]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError(f"models: {', '.join(dup)} given twice; list each model once")
    unused = sorted(set(overrides) - set(names))
    if unused:
        raise SpecError(f"--input-shape/--weights for {', '.join(unused)}, which is not in the "
                        "models; spell it as in --models")
    raw_variants = list(variants) if variants else list(table.get("variants") or ["fp32"])
    if not all(isinstance(v, str) and v for v in raw_variants):
        raise SpecError(f"variants: {raw_variants!r}: give variant names (python variants.py list)")
    raw_variants = list(dict.fromkeys(raw_variants))
    defs = table.get("target") or {}
    if not isinstance(defs, dict):
        raise SpecError("target: write one [target.NAME] table per target of your own")
    raw_targets = list(targets) if targets else list(table.get("targets") or ["cpu"])
    tlist = []
    for name in dict.fromkeys(raw_targets):
        if not isinstance(name, str) or not name:
            raise SpecError(f"targets: {name!r} is not a target name")
        if name in defs:
            tlist.append(_target_from_table(name, defs[name], BUILTIN_TARGETS.get(name)))
        elif name in BUILTIN_TARGETS:
            tlist.append(BUILTIN_TARGETS[name])
        else:
            raise SpecError(f"target {name!r} is not known: use one of "
                            f"{', '.join(sorted(set(BUILTIN_TARGETS) | set(defs)))} or define "
                            f"it in the TOML spec ([target.{name}] resources = {{{name} = 1}})")
    lim = limit if limit is not None else table.get("limit")
    if lim is not None and (not isinstance(lim, int) or isinstance(lim, bool) or lim < 1):
        raise SpecError(f"limit: {lim!r}: give a positive number of images")
    b = dict(table.get("budget") or {})
    b.update({k: v for k, v in (budget or {}).items() if v is not None})
    extra = sorted(set(b) - {f.name for f in dataclasses.fields(Budget)})
    if extra:
        raise SpecError(f"budget: unknown key(s) {', '.join(extra)}; known: min_agreement, "
                        "max_top1_drop, min_cosine")
    for k, v in b.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise SpecError(f"budget {k} = {v!r}: give a number >= 0")
    return SweepSpec(tuple(entries), tuple(raw_variants), tuple(tlist), lim, Budget(**b))
