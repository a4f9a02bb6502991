"""Targets -> Ray resources, and which targets the cluster can run at all.

A target's task asks Ray for ``num_cpus`` (the sweep's ``--cpus-per-pipeline`` unless the
target says), ``num_gpus`` and custom resources (``{"orin": 1}``, a GPU model label). A target
that no node offers would wait in Ray's queue forever, so the driver checks the cluster's total
resources first and reports such a target's pipelines as ``unavailable`` instead of submitting
them.
"""
from __future__ import annotations

import json
import shlex

from deploykit.sweep.spec import Target


def ray_options(target: Target, cpus_per_pipeline: float) -> dict:
    """The ``.options(...)`` of a target's Ray task.

    Args:
        target: the target.
        cpus_per_pipeline: CPUs per pipeline when the target does not say (``--cpus-per-pipeline``).

    Returns:
        ``{"num_cpus": float, "num_gpus": float, "resources": {name: amount}}``.
    """
    cpus = target.num_cpus if target.num_cpus is not None else cpus_per_pipeline
    return {"num_cpus": float(cpus), "num_gpus": float(target.num_gpus),
            "resources": dict(target.resources)}


def required(options: dict) -> dict[str, float]:
    """The resources of :func:`ray_options` in ``ray.cluster_resources()`` names.

    Args:
        options: from :func:`ray_options`.

    Returns:
        e.g. ``{"CPU": 2.0, "GPU": 1.0, "orin": 1.0}`` (zero amounts left out).
    """
    need = {"CPU": options.get("num_cpus", 0), "GPU": options.get("num_gpus", 0),
            **options.get("resources", {})}
    return {k: float(v) for k, v in need.items() if v}


def missing(need: dict[str, float], nodes: list[dict[str, float]]) -> dict[str, float] | None:
    """Whether some node offers everything a task needs at once.

    Ray places a task on one node: a cluster with 2 CPUs on one node and a GPU on another
    cannot run a task that needs both.

    Args:
        need: :func:`required`.
        nodes: each alive node's total resources (``ray.nodes()[i]["Resources"]``).

    Returns:
        None when a node fits; else the shortfall on the best node, ``{name: amount lacking}``
        (for the message).
    """
    best = None
    for res in nodes or [{}]:
        short = {k: v - res.get(k, 0.0) for k, v in need.items() if res.get(k, 0.0) < v}
        if not short:
            return None
        if best is None or len(short) < len(best):
            best = short
    return best


def unavailable_reason(target: Target, need: dict[str, float], short: dict[str, float],
                       nodes: list[dict[str, float]]) -> str:
    """The message of an unavailable target: what it needs, what the cluster has, the fix.

    Args:
        target: the target. need: :func:`required`. short: :func:`missing`.
        nodes: each node's total resources.

    Returns:
        one line naming the resources and the ``ray start`` command (HEAD_IP: the head node's
        address) that joins a fitting node.
    """
    custom = {k: v for k, v in need.items() if k not in ("CPU", "GPU")}
    have = "; ".join(", ".join(f"{k}: {v:g}" for k, v in sorted(n.items())
                               if not k.startswith(("node:", "memory", "object_store")))
                     for n in nodes) or "no nodes"
    start = ["ray", "start", "--address=HEAD_IP:6379"]
    if need.get("GPU"):
        start.append(f"--num-gpus={need['GPU']:g}")
    if custom:
        start.append("--resources=" + json.dumps({k: int(v) if v == int(v) else v
                                                  for k, v in custom.items()}))
    return (f"target {target.name} needs {json.dumps(need)} on one node; no node offers it "
            f"(short: {json.dumps(short)}; nodes: {have}); join a node that does to a cluster "
            f"and pass --address: "
            f"{shlex.join(start)}")
