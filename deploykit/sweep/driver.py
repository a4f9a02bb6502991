"""The Ray driver: plan the pipelines, skip the up-to-date ones, run the rest as Ray tasks.

Local by default: ``ray.init(num_cpus=N)`` starts Ray on this machine with N CPUs (default: the
machine's), each pipeline takes ``cpus_per_pipeline`` (default 2), so a 2-core machine runs one
pipeline at a time. With an address (``--address`` or ``RAY_ADDRESS``) the same sweep goes to a
cluster; every node then needs the checkout at the driver's path and Ray started from a shell
that ran ``source env.sh``.

Failures stay per task: a failing command, an exception in the task and a Ray error (a node
lost) each become that pipeline's ``failed`` record; a target no node offers is ``unavailable``
(checked before submission, never queued). Layout of ``out``::

    pipelines/<id>/{artifacts,results,logs}   each pipeline's own stage folders and step logs
    rows/<id>/*.json                          the rows it returned (what the report reads)
    stamps/<id>.json                          the up-to-date stamp (deploykit.sweep.stamp)
    tasks/<id>.json                           the task's result (status, steps, error)
    sweep.json, REPORT.md, report.json, pareto_<target>.png
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from deploykit.sweep import plan as plan_mod
from deploykit.sweep import report as report_mod
from deploykit.sweep import resources, stamp
from deploykit.sweep.spec import SpecError, SweepSpec
from deploykit.sweep.task import execute_pipeline

OBJECT_STORE_BYTES = 100 * 1024 * 1024  # rows are small; keep Ray light on a shared machine


class RayMissing(SpecError):
    """Ray is not installed: the sweep cannot run (the message says how to install it)."""


def _write_json(path: Path, obj) -> None:
    stamp.write_atomic(path, json.dumps(obj, indent=1, default=str))


def _store_rows(rows_dir: Path, rows: dict[str, str]) -> dict[str, str]:
    """Replace ``rows_dir`` by the task's rows; return ``{file: sha256}``."""
    rows_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=rows_dir.parent, prefix=f".tmp-{rows_dir.name}."))
    os.chmod(tmp, 0o755)
    hashes = {}
    for name, text in rows.items():
        (tmp / name).write_text(text)
        hashes[name] = stamp.sha256_bytes(text.encode())
    shutil.rmtree(rows_dir, ignore_errors=True)
    os.replace(tmp, rows_dir)
    return hashes


def _load_rows(rows_dir: Path) -> dict[str, dict]:
    rows = {}
    for p in sorted(rows_dir.glob("*.json")) if rows_dir.is_dir() else []:
        try:
            rows[p.name] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return rows


def _store(res: dict, p: plan_mod.Pipeline, keys: dict, out: Path) -> None:
    """Keep a finished pipeline: its rows, its stamp and its task record."""
    hashes = _store_rows(out / "rows" / p.id, res.get("rows") or {})
    key, parts = keys[p.id]
    stamp.write_stamp(out / "stamps" / f"{p.id}.json", key, parts, res["status"], hashes,
                      {"time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    _write_json(out / "tasks" / f"{p.id}.json", {k: v for k, v in res.items() if k != "rows"})


def _finish(ray, p: plan_mod.Pipeline, ref, records: dict, keys: dict, out: Path,
            log: Callable[[str], None]) -> None:
    """Collect one finished task (a Ray error becomes its failure), store it, log it."""
    try:
        res = ray.get(ref)
    except Exception as e:  # noqa: BLE001  (a lost node, a killed worker: this task's failure)
        res = {"id": p.id, "status": "failed", "rows": {},
               "error": f"Ray task error: {type(e).__name__}: {str(e)[-800:]}"}
    records[p.id] = res
    _store(res, p, keys, out)
    msg = f"sweep: {p.id}: {res['status']}"
    if res.get("wall_s") is not None:
        msg += f" in {res['wall_s']:.1f} s"
    if res["status"] != "ok":
        msg += f": {res.get('error')}"
        if res.get("log"):
            msg += f"; log: {res['log']}"
        if res.get("rerun_command"):
            msg += f"; rerun: {res['rerun_command']}"
    log(msg)


#: Seconds to reach a cluster address before Ray is asked to connect (Ray itself retries for
#: minutes against an address where nothing listens).
ADDRESS_PROBE_S = 5.0


def probe_address(address: str, timeout_s: float = ADDRESS_PROBE_S) -> None:
    """Refuse a cluster address where nothing answers, before Ray retries it for minutes.

    Args:
        address: ``host:port`` or ``ray://host:port``; ``auto`` (Ray finds the local head) and
            addresses without a port are left to Ray.

    Raises:
        RuntimeError: nothing accepts a TCP connection there within ``timeout_s`` (names the
            address and the fix).
    """
    import socket

    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RuntimeError(f"no Ray cluster answers at {address} ({e}): start one there "
                           "(ray start --head on that host) or leave --address / RAY_ADDRESS "
                           "out to run on this machine") from None


def start_ray(address: str | None, num_cpus: int | None):
    """Connect to a cluster, or start Ray on this machine with a bounded number of CPUs.

    Args:
        address: a cluster address (``ray://host:10001``, ``host:6379``, ``auto``), or None.
        num_cpus: CPUs of the local Ray (ignored with an address); None: ``os.cpu_count()``.

    Returns:
        ``(ray module, started_locally)``.

    Raises:
        RayMissing: ray is not importable.
        RuntimeError: nothing answers at ``address`` (:func:`probe_address`).
    """
    try:
        import ray
    except ImportError:
        raise RayMissing("ray is not installed: pip install ray (an optional dependency of the "
                         "sweep alone; see requirements.txt)") from None
    root = str(Path(__file__).resolve().parents[2])
    env_vars = {"PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    if address:
        probe_address(address)
        ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=False)
        return ray, False
    os.environ.pop("RAY_ADDRESS", None)  # local: never attach to another user's cluster
    ray.init(num_cpus=num_cpus or os.cpu_count() or 1, include_dashboard=False,
             object_store_memory=OBJECT_STORE_BYTES, log_to_driver=False,
             runtime_env={"env_vars": env_vars})
    return ray, True


def run_sweep(spec: SweepSpec, out: Path, root: Path, *, address: str | None = None,
              num_cpus: int | None = None, cpus_per_pipeline: float = 2,
              force: bool = False, timeout_s: float | None = None,
              log: Callable[[str], None] = print) -> dict:
    """Run a sweep: plan, skip up-to-date pipelines, run the rest on Ray, write the report.

    Args:
        spec: the sweep. out: its output folder (created). root: the repository root.
        address: a Ray cluster address, or None for a local Ray.
        num_cpus: CPUs of a local Ray (None: the machine's).
        cpus_per_pipeline: CPUs each pipeline's task takes (a target may say otherwise);
            locally capped to ``num_cpus``.
        force: rerun every pipeline whatever its stamp says.
        timeout_s: wall-clock limit per pipeline (s), or None.
        log: where progress lines go.

    Returns:
        ``{"out", "pipelines": [record], "report": report dict, "files": {name: path},
        "counts": {status: n}}``; a record's ``status`` is ``ok``, ``up_to_date``,
        ``failed``, ``unavailable`` or ``not_applicable`` (no requested variant applies to
        the model on that target: nothing is run).

    Raises:
        SpecError: a variant unknown to ``variants.py`` (usage error).
        RayMissing: pipelines need running and ray is not installed.
    """
    out = out.resolve()
    registry = plan_mod.load_registry(root, sys.executable)
    plan_mod.check_variants(spec.variants, registry)
    pipelines = [plan_mod.build_pipeline(spec, m, t, out, registry, root, sys.executable)
                 for m in spec.models for t in spec.targets]
    git = stamp.git_state(root)
    records: dict[str, dict] = {}
    to_run = []
    keys = {}
    for p in pipelines:
        if not p.variants:
            why = "; ".join(f"{v}: {r}" for v, r in p.not_applicable)
            log(f"sweep: {p.id}: not applicable, nothing to run ({why})")
            records[p.id] = {"id": p.id, "status": "not_applicable", "reason": why}
            continue
        key, parts = stamp.pipeline_key(p, git, stamp.model_inputs(p, root))
        keys[p.id] = (key, parts)
        skip, why = stamp.up_to_date(stamp.read_stamp(out / "stamps" / f"{p.id}.json"), key,
                                     parts, out / "rows" / p.id, git["rows_git_sha"])
        if skip and not force:
            log(f"sweep: {p.id}: skipped, {why}")
            prev = {}
            try:
                prev = json.loads((out / "tasks" / f"{p.id}.json").read_text())
            except (OSError, ValueError):
                pass
            records[p.id] = {**prev, "id": p.id, "status": "up_to_date", "reason": why}
        else:
            log(f"sweep: {p.id}: to run ({'--force' if skip else why})")
            to_run.append(p)

    if to_run:
        ray, local = start_ray(address, num_cpus)
        try:
            nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
            remote = ray.remote(max_retries=0)(execute_pipeline)
            refs = {}
            for p in to_run:
                cpp = min(cpus_per_pipeline, num_cpus or os.cpu_count() or 1) if local \
                    else cpus_per_pipeline
                opts = resources.ray_options(p.target, cpp)
                need = resources.required(opts)
                short = resources.missing(need, nodes)
                if short is not None:
                    why = resources.unavailable_reason(p.target, need, short, nodes)
                    log(f"sweep: {p.id}: unavailable: {why}")
                    records[p.id] = {"id": p.id, "status": "unavailable", "error": why,
                                     "rows": {}}
                    continue
                log(f"sweep: {p.id}: submitted ({json.dumps(need)})")
                refs[remote.options(**opts).remote(p.as_dict(), str(root), timeout_s)] = p
            pending = list(refs)
            try:
                while pending:
                    done, pending = ray.wait(pending, num_returns=1)
                    _finish(ray, refs[done[0]], done[0], records, keys, out, log)
            except KeyboardInterrupt:
                # Ctrl-C: cancel the running tasks (each ends its step's process group), keep
                # what finished (its stamp is written), and let the caller say how to resume
                log(f"sweep: interrupted: cancelling {len(pending)} pipeline(s)")
                for ref in pending:
                    ray.cancel(ref)
                ray.wait(pending, num_returns=len(pending), timeout=60)
                raise
        finally:
            if local:
                ray.shutdown()

    full = []
    for p in pipelines:
        rec = records[p.id]
        full.append({**p.as_dict(), "requested": list(spec.variants),
                     "status": rec["status"], "error": rec.get("error"),
                     "reason": rec.get("reason"), "failed_stage": rec.get("failed_stage"),
                     "rerun_command": rec.get("rerun_command"), "log": rec.get("log"),
                     "wall_s": rec.get("wall_s"),
                     # an unavailable pipeline did not run: earlier rows are not this sweep's
                     "rows": {} if rec["status"] == "unavailable" else
                     _load_rows(out / "rows" / p.id)})
    rep = report_mod.build_report(full, spec.budget)
    files = report_mod.write_report(rep, out)
    counts: dict[str, int] = {}
    for r in full:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = [{k: r[k] for k in ("id", "status", "error", "failed_stage", "rerun_command",
                                  "log", "wall_s", "reason")} | {"rows": sorted(r["rows"])}
               for r in full]
    _write_json(out / "sweep.json", {"spec": {"models": [m.name for m in spec.models],
                                              "variants": list(spec.variants),
                                              "targets": [t.as_dict() for t in spec.targets],
                                              "limit": spec.limit},
                                     "git": git, "counts": counts, "pipelines": summary})
    files["sweep"] = out / "sweep.json"
    return {"out": out, "pipelines": full, "report": rep, "files": files, "counts": counts}
