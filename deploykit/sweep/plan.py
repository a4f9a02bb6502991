"""The commands of one (model, target) pipeline: the existing stages, nothing else.

A pipeline runs in its own folder ``<out>/pipelines/<id>/`` (``artifacts/``, ``results/``) with:

1. ``bash run_all.sh --stop-stage 3`` (``4`` when quantized variants follow): data, PyTorch FP32
   baseline, ONNX export, ORT eval of fp32/fp16, calibration data; ``--limit N`` and
   ``--auto-precision`` (for ``int8_auto``) passed through.
2. for each quantized variant, the stage commands run_all.sh's stage 5 runs for it
   (``bash 5_quantize.sh --model M V``, or ``python 5b_quantize_int4.py --model M --no-eval`` for
   int4), then on a CPU target ``python 3_onnx_eval.py ... --tag ort_V``;
3. on a TensorRT target: ``bash 6_build_engines.sh --model M V...`` and
   ``python 7_trt_eval.py ... --tag trt_V`` per variant;
4. ``bash run_all.sh --stage 8 --stop-stage 8``: the pipeline's own REPORT.md.

Steps 2-3 call the stage scripts directly only because run_all.sh runs a fixed variant list;
their flags are run_all.sh's (the same ``--limit``/timing flags of a smoke run), and like
run_all.sh they take paths from ``python -m deploykit.layout`` and row tags and ONNX file names
from the variant registry (``python variants.py list --with ...``): the sweep holds no copy of
either. A custom model (``package.module:factory``) gets steps 1 and 4 (run_all.sh says stages
0, 4-7 do not apply).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Callable

from deploykit.sweep.spec import ModelEntry, SpecError, SweepSpec, Target

# Which variants exist, which come straight from the export and which get engines is read from
# variants.py (load_registry), never written here.
REPRODUCTIONS = ("int4_cli_broken",)  # failure reproductions: never a candidate to ship


def safe_name(name: str) -> str:
    """A name made safe as one folder-name component (the sweep's own pipeline folders).

    Args:
        name: a model spec or target name.

    Returns:
        ``name`` with every run of other characters than ``A-Za-z0-9_.-`` replaced by ``-``.
    """
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


def pipeline_id(model: str, target: str) -> str:
    """Folder name of one (model, target) pipeline.

    Args:
        model: the model spec. target: the target name.

    Returns:
        ``<model>@<target>``, each made safe by :func:`safe_name`.
    """
    return f"{safe_name(model)}@{safe_name(target)}"


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of a pipeline.

    Attributes:
        label: short name (log file name), e.g. ``run_all_0-3``, ``5_quantize_int8``.
        argv: the command, run in the repository root.
        env: environment variables set for it (on top of the task's environment).
    """

    label: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]

    def shell(self) -> str:
        """The command as a user pastes it (shell-quoted, environment first).

        Returns:
            e.g. ``MODEL=m ARTIFACTS=/p/artifacts bash run_all.sh --stop-stage 3``.
        """
        return shlex.join([f"{k}={v}" for k, v in self.env] + list(self.argv))


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One (model, target) pipeline: its folder, its steps and what does not apply.

    Attributes:
        id: :func:`pipeline_id`. model: the model. target: the target.
        variants: the variants whose rows this pipeline makes for its target.
        not_applicable: ``{variant: reason}`` for requested variants it cannot make.
        folder: ``<out>/pipelines/<id>``. results_dir: where its rows appear.
        steps: the commands, in order.
    """

    id: str
    model: ModelEntry
    target: Target
    variants: tuple[str, ...]
    not_applicable: tuple[tuple[str, str], ...]
    folder: Path
    results_dir: Path
    steps: tuple[Step, ...]

    def as_dict(self) -> dict:
        """JSON-able form (sent to the Ray task, recorded in sweep.json).

        Returns:
            dict of every field; paths as strings, steps as {label, argv, env, shell}.
        """
        return {"id": self.id, "model": dataclasses.asdict(self.model),
                "target": self.target.as_dict(), "variants": list(self.variants),
                "not_applicable": dict(self.not_applicable), "folder": str(self.folder),
                "results_dir": str(self.results_dir),
                "steps": [{"label": s.label, "argv": list(s.argv), "env": dict(s.env),
                           "shell": s.shell()} for s in self.steps]}


def check_variants(variants: tuple[str, ...], registry: dict[str, list[str]]) -> None:
    """Refuse variant names the registry (``variants.py``) does not know.

    Args:
        variants: the spec's variants.
        registry: :func:`load_registry`.

    Raises:
        SpecError: an unknown variant (the known ones listed) or a failure reproduction.
    """
    for v in variants:
        if v in REPRODUCTIONS:
            raise SpecError(f"variant {v} is a failure reproduction, not a candidate to ship: "
                            "leave it out (bash run_all.sh --all-variants runs it)")
        if v not in registry["all"]:
            raise SpecError(f"variant {v!r} is not known: use one of "
                            f"{', '.join(x for x in registry['all'] if x not in REPRODUCTIONS)}"
                            " (python variants.py list)")


def layout_path(kind: str, model: str, env: dict[str, str], root: Path,
                python: str = "python") -> str:
    """A path the stages use, from their owner: ``python -m deploykit.layout KIND MODEL``.

    Args:
        kind: ``results``, ``onnx-dir``, ``engines`` (see ``python -m deploykit.layout -h``).
        model: the model spec. env: ARTIFACTS / RESULTS of the pipeline.
        root: the repository root. python: the interpreter.

    Returns:
        the path, as the stages compute it.

    Raises:
        RuntimeError: the command failed (its error output in the message).
    """
    import os
    import subprocess
    cmd = [python, "-m", "deploykit.layout", kind, model]
    p = subprocess.run(cmd, cwd=root, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120)
    if p.returncode != 0 or not p.stdout.strip():
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return p.stdout.strip()


def build_pipeline(spec: SweepSpec, model: ModelEntry, target: Target, out: Path,
                   registry: dict, root: Path, python: str = "python",
                   layout: Callable[[str, str, dict[str, str]], str] | None = None) -> Pipeline:
    """The steps of one (model, target) pipeline (module docstring: which and why).

    Args:
        spec: the sweep (variants, limit).
        model: the model. target: the target.
        out: the sweep's output folder (absolute).
        registry: :func:`load_registry`.
        root: the repository root (``deploykit.layout`` runs there). python: the interpreter.
        layout: ``(kind, model, env) -> path``; default :func:`layout_path` (the command).

    Returns:
        the :class:`Pipeline`.

    Raises:
        RuntimeError: ``deploykit.layout`` did not run.
    """
    pid = pipeline_id(model.name, target.name)
    folder = out / "pipelines" / pid
    art_root, res_root = folder / "artifacts", folder / "results"
    smoke = spec.limit is not None
    # run_all.sh puts a smoke run (--limit) in $ARTIFACTS/smoke and $RESULTS/smoke; the direct
    # stage commands must use the same folders.
    art = art_root / "smoke" if smoke else art_root
    res = res_root / "smoke" if smoke else res_root
    env = [("MODEL", model.name)]
    if model.input_shape:
        env.append(("INPUT_SHAPE", model.input_shape))
    if model.weights:
        env.append(("WEIGHTS", model.weights))
    run_env = tuple(env + [("ARTIFACTS", str(art_root)), ("RESULTS", str(res_root))])
    stage_env = tuple(env + [("ARTIFACTS", str(art)), ("RESULTS", str(res))])
    if layout is None:
        def layout(kind: str, name: str, env_: dict[str, str]) -> str:
            return layout_path(kind, name, env_, root, python)
    paths = {k: Path(layout(k, model.name, dict(stage_env)))
             for k in ("results", "onnx-dir", "engines")}
    fields = registry["fields"]
    lim = ["--limit", str(spec.limit)] if smoke else []
    timing = ["--warmup", "2", "--iters", "20"] if smoke else []  # as run_all.sh --limit

    not_applicable: dict[str, str] = {}
    variants: list[str] = []
    for v in spec.variants:
        if model.custom and v not in registry["export"]:
            not_applicable[v] = "custom model: stages 4-7 do not apply (run_all.sh)"
        elif target.trt and model.custom:
            not_applicable[v] = "custom model: no TensorRT stages (run_all.sh)"
        elif target.trt and v not in registry["trt"]:
            not_applicable[v] = "no TensorRT engine for this variant (variants.py list --stage 6)"
        else:
            variants.append(v)
    quant = [v for v in variants if v not in registry["export"]]
    auto = ["--auto-precision"] if "int8_auto" in quant else []

    steps = []
    first_stop = "4" if quant else "3"
    steps.append(Step(f"run_all_0-{first_stop}",
                      ("bash", "run_all.sh", "--stop-stage", first_stop, *lim, *auto), run_env))
    for v in quant:
        if v == "int4":
            steps.append(Step("5b_quantize_int4", ("python", "5b_quantize_int4.py", "--model",
                                                   model.name, "--no-eval"), stage_env))
        else:
            steps.append(Step(f"5_quantize_{v}", ("bash", "5_quantize.sh", "--model", model.name,
                                                  v), stage_env))
        if not target.trt:
            steps.append(Step(f"3_onnx_eval_{v}", (
                "python", "3_onnx_eval.py", "--model", model.name, "--onnx",
                str(paths["onnx-dir"] / fields[v]["onnx_file"]), "--tag", fields[v]["ort_tag"],
                *lim, *timing),
                stage_env))
    if target.trt and variants:
        steps.append(Step("6_build_engines", ("bash", "6_build_engines.sh", "--model",
                                              model.name, *variants), stage_env))
        for v in variants:
            steps.append(Step(f"7_trt_eval_{v}", (
                "python", "7_trt_eval.py", "--model", model.name, "--engine",
                str(paths["engines"] / f"{v}.plan"), "--tag", fields[v]["trt_tag"], *lim,
                *timing),
                stage_env))
    steps.append(Step("run_all_8", ("bash", "run_all.sh", "--stage", "8", "--stop-stage", "8",
                                    *lim, *auto), run_env))
    return Pipeline(pid, model, target, tuple(variants), tuple(not_applicable.items()), folder,
                    paths["results"], tuple(steps))


def load_registry(root: Path, python: str = "python") -> dict:
    """The variant lists of ``variants.py`` (its command line: the one registry of variants).

    Args:
        root: the repository root. python: the interpreter that runs the stages.

    Returns:
        ``{"all": [...], "export": [...], "trt": [...], "fields": {variant: {"onnx_file",
        "ort_tag", "trt_tag"}}}``: every variant, those stage 3 evaluates straight from the
        export, those stage 6 builds engines for, and each one's file name and row tags.

    Raises:
        RuntimeError: ``variants.py`` did not run (the message holds its error output).
    """
    import subprocess

    def listed(*flags: str) -> list[str]:
        """The variant names ``variants.py list FLAGS`` prints, one a line."""
        p = subprocess.run([python, "variants.py", "list", *flags], cwd=root,
                           capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{shlex.join([python, 'variants.py', 'list', *flags])} exited "
                               f"{p.returncode}: {p.stderr.strip()[-500:]}")
        return [line.strip() for line in p.stdout.splitlines() if line.strip()]

    fields = {}
    for line in listed("--with", "onnx_file", "--with", "ort_tag", "--with", "trt_tag"):
        name, onnx_file, ort_tag, trt_tag = line.split("\t")
        fields[name] = {"onnx_file": onnx_file, "ort_tag": ort_tag, "trt_tag": trt_tag}
    return {"all": list(fields), "export": listed("--stage", "3"),
            "trt": listed("--stage", "6", "--all", "--auto-precision"), "fields": fields}
