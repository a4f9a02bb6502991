"""What one Ray task runs: a pipeline's stage commands, in order, and the rows they wrote.

Plain Python (no ray import): the driver wraps :func:`execute_pipeline` in ``ray.remote``.
Every exception and every failing command is turned into the task's result, so one pipeline
failing never fails the sweep; the result names the failing step, the stage run_all.sh was in,
the command to rerun it (shell-quoted) and the tail of its log.
"""
from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import time
import traceback
from pathlib import Path

LOG_TAIL_LINES = 20


def _stage_of(log_text: str) -> str | None:
    """The last ``Stage N: what`` run_all.sh started in a log (the failing stage).

    A run that failed before its first stage (run_all.sh's own checks: arguments, the model's
    kind, which builds the model once) is ``"setup (before stage 0)"``; a log with neither is None.
    """
    started = None
    for line in log_text.splitlines():
        m = re.match(r"^Stage (\d+): (?!finished)(.*)$", line)
        if m:
            started = f"stage {m.group(1)} ({m.group(2).split(':')[0]})"
    if started is None and re.search(r"^run_all\.sh: ", log_text, re.M):
        return "setup (before stage 0)"
    return started


def _cause(log_text: str) -> str | None:
    """The first error line a stage printed (run_all.sh quotes its log tail with ``| ``)."""
    for line in log_text.splitlines():
        body = line.strip().lstrip("|").strip()
        if re.search(r"FAILED: |Error\b|error:", body) and not body.startswith("FAILED: python") \
                and not body.startswith("FAILED: bash"):
            return body[:400]
    return None


def _tail(text: str, n: int = LOG_TAIL_LINES) -> list[str]:
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-n:]


def collect_rows(results_dir: Path, model: str) -> dict[str, str]:
    """The result rows a pipeline wrote, as the exact file texts.

    Args:
        results_dir: ``<pipeline>/results[/smoke]/<model_tag>``.
        model: the model spec (a row names its model; files of other models are ignored).

    Returns:
        ``{file name: JSON text}`` of every ``*.json`` there that is a results row (has
        ``tag`` and ``status``), ``<tag>.failed.json`` / ``.skipped.json`` sidecars included.
    """
    rows: dict[str, str] = {}
    if not results_dir.is_dir():
        return rows
    for p in sorted(results_dir.glob("*.json")):
        try:
            text = p.read_text()
            row = json.loads(text)
        except (OSError, ValueError):
            continue
        if isinstance(row, dict) and "tag" in row and "status" in row and \
                row.get("model") in (model, None):
            rows[p.name] = text
    return rows


def _run_step(step: dict, root: Path, log: Path, deadline: float | None) -> tuple[int | None, float]:
    env = dict(os.environ, **step["env"])
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if log.is_symlink():  # a link planted at the log's name is replaced, never written through
        log.unlink()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
    with os.fdopen(fd, "w") as f:
        f.write(f"# {step['shell']}\n")
        f.flush()
        # own session: a timeout ends the whole process group (run_all.sh and its stage)
        proc = subprocess.Popen(step["argv"], cwd=root, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _terminate(proc)
            rc = None
        except BaseException:  # ray.cancel (KeyboardInterrupt in this task): no orphans
            _terminate(proc)
            raise
    return rc, time.monotonic() - t0


def _terminate(proc: subprocess.Popen) -> None:
    """End a step's whole process group: TERM (run_all.sh releases its lock), then KILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def execute_pipeline(plan: dict, root: str, timeout_s: float | None = None) -> dict:
    """Run one pipeline's steps (stop at the first failure) and collect its rows.

    Args:
        plan: :meth:`deploykit.sweep.plan.Pipeline.as_dict`.
        root: the repository root on this node (the same path as on the driver).
        timeout_s: wall-clock limit for the whole pipeline (s), or None.

    Returns:
        ``{"id", "status": "ok"|"failed", "error", "failed_step", "failed_stage",
        "rerun_command", "log", "log_tail", "steps": [{label, rc, wall_s, log}], "rows":
        {file: text}, "node", "wall_s"}``.
    """
    t0 = time.monotonic()
    deadline = None if timeout_s is None else t0 + timeout_s
    folder = Path(plan["folder"])
    result = {"id": plan["id"], "status": "ok", "error": None, "failed_step": None,
              "failed_stage": None, "rerun_command": None, "log": None, "log_tail": [],
              "steps": [], "rows": {}, "node": platform.node(), "wall_s": None}
    try:
        rootp = Path(root)
        if not (rootp / "run_all.sh").is_file():
            raise RuntimeError(f"{root} on node {platform.node()} holds no checkout (run_all.sh "
                               "missing): every node needs the repository at the driver's path")
        if not os.environ.get("PIPELINE_ROOT"):
            raise RuntimeError(f"the Ray worker on {platform.node()} has no pipeline environment: "
                               "start Ray (ray start / the sweep) from a shell that ran "
                               "'source env.sh'")
        # rows of an earlier run of this pipeline (other variants, other code) must not mix
        # into this one's: moved aside, as run_all.sh moves a full run's earlier results
        res_root = folder / "results"
        if res_root.is_dir() and any(res_root.iterdir()):
            prev = folder / "previous_results" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            prev.parent.mkdir(parents=True, exist_ok=True)
            os.replace(res_root, prev)
        for i, step in enumerate(plan["steps"]):
            log = folder / "logs" / f"{i:02d}_{step['label']}.log"
            rc, wall = _run_step(step, rootp, log, deadline)
            result["steps"].append({"label": step["label"], "rc": rc, "wall_s": round(wall, 2),
                                    "log": str(log)})
            if rc != 0:
                text = log.read_text(errors="replace")
                stage = _stage_of(text)
                cause = _cause(text)
                result.update(
                    status="failed", failed_step=step["label"], failed_stage=stage,
                    rerun_command=step["shell"], log=str(log), log_tail=_tail(text),
                    error=(f"timed out after {timeout_s:g} s" if rc is None else
                           f"{step['label']} exited {rc}") + (f" in {stage}" if stage else "")
                    + (f": {cause}" if cause else ""))
                break
    except Exception as e:  # noqa: BLE001  (any error is this pipeline's, not the sweep's)
        result.update(status="failed", error=f"{type(e).__name__}: {e}",
                      log_tail=_tail(traceback.format_exc()))
    result["rows"] = collect_rows(Path(plan["results_dir"]), plan["model"]["name"])
    result["wall_s"] = round(time.monotonic() - t0, 2)
    return result
