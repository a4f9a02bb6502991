"""Command lines printed for a user to paste: the rerun commands of result rows and stale rows,
the "next step" and "fix" hints of the stages.

A printed command pastes back from any folder and reruns the same thing:
``cd <repository root> && VAR=value ... <python> <root>/<script> <args>``, where

- the environment is what the run needed (:data:`ENV_KEYS` that were set; ARTIFACTS and
  RESULTS always, absolute; PYTHONPATH with absolute entries and, for a
  ``pkg.module:factory`` model, the folder the run started in, which stage scripts search
  for the factory's module);
- every argument that names a file or folder relative to where the run started is made
  absolute (so ``--inputs my.npz`` still names the same file after the ``cd``);
- every word is shell-quoted (:func:`shlex.quote`): a name with spaces, quotes or ``$(...)``
  pastes back as the same one argument and runs nothing.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from deploykit.layout import ROOT, artifacts_dir, results_dir

# Environment variables the Python stages read (besides ARTIFACTS/RESULTS, always recorded).
ENV_KEYS = ("MODEL", "PYTHONPATH", "PREPROCESS", "LOGITS_OUTPUT", "VAL_ROOT", "WEIGHTS",
            "TORCH_DEVICE", "ORT_EP", "EPS", "ALLOW_CLASS_SUBSET", "CALIB_BATCH",
            "CALIB_STATS_CHECK", "AUTO_ARGS", "TRTEXEC")
_PATH_KEYS = ("ARTIFACTS", "RESULTS", "VAL_ROOT", "WEIGHTS")
_PATH_SUFFIXES = (".onnx", ".npz", ".npy", ".plan", ".engine", ".json", ".csv", ".md", ".pt",
                  ".pth", ".txt", ".log", ".yaml", ".yml", ".toml", ".py")


def _is_factory(model: str | None) -> bool:
    return bool(model) and ":" in str(model)


def _model_of(argv: Sequence[str]) -> str | None:
    """The ``--model`` value of ``argv`` (else ``$MODEL``)."""
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return os.environ.get("MODEL") or None


#: Flags whose value is a name, never a path: a folder of that name where the command ran
#: (``cd results; ... --model mobilenet_v3_small``) must not make it one (review of stop 47).
NAME_FLAGS = ("--model", "--tag")


def absolute_value(value: str, cwd: Path | str | None = None, option_value: bool = False
                   ) -> str:
    """``value`` made absolute against ``cwd`` (default: the current folder) when it names a
    file or folder there, or looks like a file path (has a ``/`` or a known file suffix) whose
    folder exists; any other value (a model name, a tag, a number) is returned unchanged. A word
    that starts with ``-`` is an option, unless ``option_value`` (the value of a
    ``--flag=value`` word, e.g. ``--engine=-x.plan``)."""
    if not value or os.path.isabs(value) or (value.startswith("-") and not option_value):
        return value
    base = Path(cwd) if cwd is not None else Path.cwd()
    p = base / value
    try:
        looks_like_path = ("/" in value or value.endswith(_PATH_SUFFIXES)) and p.parent.is_dir()
        if os.path.lexists(p) or looks_like_path:
            return str(Path(os.path.abspath(p)))
    except OSError:
        pass
    return value


def absolute_args(args: Sequence[str], cwd: Path | str | None = None) -> list[str]:
    """``args`` with every path value made absolute (:func:`absolute_value`), including the
    value of a ``--flag=value`` word; flags themselves stay as given, and so do the values of
    :data:`NAME_FLAGS`."""
    out: list[str] = []
    name_next = False
    for a in args:
        if name_next:
            out.append(a)
            name_next = False
        elif a.startswith("--") and "=" in a:
            flag, val = a.split("=", 1)
            out.append(a if flag in NAME_FLAGS
                       else f"{flag}={absolute_value(val, cwd, option_value=True)}")
        else:
            out.append(absolute_value(a, cwd))
            name_next = a in NAME_FLAGS
    return out


def run_env(model: str | None = None, cwd: Path | str | None = None) -> dict[str, str]:
    """The environment a rerun of this process needs, every path absolute: ARTIFACTS and
    RESULTS (always), the :data:`ENV_KEYS` that are set, and PYTHONPATH for a factory
    ``model`` (with ``cwd``, the folder the run started in, where stages look for the
    factory's module).

    Args:
        model: the run's model name (default: ``--model`` of ``sys.argv``, else ``$MODEL``).
        cwd: the folder the run started in (default: the current folder).
    Returns:
        ``{name: value}`` in a fixed order.
    """
    cwd = Path(cwd) if cwd is not None else Path.cwd()
    model = model if model is not None else _model_of(sys.argv[1:])
    env = {"ARTIFACTS": str(artifacts_dir().resolve()), "RESULTS": str(results_dir().resolve())}
    for k in ENV_KEYS:
        v = os.environ.get(k)
        if not v or k == "PYTHONPATH":
            continue
        env[k] = str(Path(os.path.abspath(cwd / v))) if k in _PATH_KEYS else v
    if model and "MODEL" in env:  # the command's model, not env.sh's default beside it
        env["MODEL"] = str(model)
    pp = [str(Path(os.path.abspath(cwd / e))) for e in
          os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if _is_factory(model) and str(cwd.resolve()) not in pp and str(cwd) not in pp:
        pp.append(str(cwd.resolve()))
    if pp:
        env["PYTHONPATH"] = os.pathsep.join(pp)
    return env


def shell_line(argv: Sequence[str], env: Mapping[str, str] | None = None,
               root: Path | str = ROOT) -> str:
    """One pasteable line: ``cd ROOT && K=V ... argv``, every word :func:`shlex.quote`-d.

    Args:
        argv: the program and its arguments (absolute paths where they name files).
        env: variables to set for it (e.g. :func:`run_env`).
        root: the folder to ``cd`` into first (the repository root).
    """
    words = [f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    return f"cd {shlex.quote(str(root))} && " + " ".join(words + [shlex.quote(str(a))
                                                                   for a in argv])


def script_argv(script: str, args: Sequence[str], cwd: Path | str | None = None) -> list[str]:
    """``[python, <root>/<script>, *args]`` with the path values of ``args`` absolute: how a
    printed command runs a root script (``3_onnx_eval.py``, ``layerwise.py``...)."""
    path = Path(script)
    if not path.is_absolute():
        path = ROOT / path.name if (ROOT / path.name).is_file() else Path(os.path.abspath(path))
    if path.suffix == ".sh":
        return ["bash", str(path), *absolute_args(args, cwd)]
    return [sys.executable or "python", str(path), *absolute_args(args, cwd)]


def script_command(script: str, args: Sequence[str], model: str | None = None) -> str:
    """The pasteable command (:func:`shell_line`) that runs root ``script`` with ``args`` in
    this run's environment (:func:`run_env`): e.g. a stage's "next step" hint."""
    return shell_line(script_argv(script, args),
                      run_env(model if model is not None else _model_of(args)))


def this_command(args: Sequence[str] | None = None) -> str:
    """The pasteable command that reruns this process (``sys.argv``), or runs its script with
    other ``args`` (e.g. this stage's flags plus a fix)."""
    return script_command(sys.argv[0], sys.argv[1:] if args is None else args)


def rerun_record() -> dict:
    """What a results row records to rebuild this process's command later, from anywhere:
    ``{"argv": [python, abs script, *abs args], "env": run_env(), "cwd": ...}``."""
    return {"argv": script_argv(sys.argv[0], sys.argv[1:]), "env": run_env(),
            "cwd": str(Path.cwd())}


def from_record(rec: Any) -> str | None:
    """The pasteable command of a :func:`rerun_record` (None when it is not one)."""
    if not isinstance(rec, dict):
        return None
    argv, env = rec.get("argv"), rec.get("env")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        return None
    env = {k: v for k, v in env.items() if isinstance(v, str)} if isinstance(env, dict) else {}
    return shell_line(argv, env)
