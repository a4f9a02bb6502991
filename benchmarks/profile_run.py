#!/usr/bin/env python3
"""Where a pipeline run spends its time: runs ``run_all.sh`` (any arguments) in a scratch
ARTIFACTS/RESULTS, then prints the wall time of every stage, of every command run_all.sh ran
(its ``logs/<model>/times.tsv``) and, inside them, of every step: each ModelOpt run (the
``wall_time_s`` of each ``quant_<variant>.json``; variants that share one calibration share
one run), and for each results row its inference pass, latency loop and diagnostics
(``timings_s`` of the row).

A run's wall time moves with the host (a shared VM drifted by 15-45 % within an hour here,
benchmarks/README.md), so ``--repeat N`` makes N runs back to back, each in its own scratch
folder, and records every one with their median, minimum and maximum: the figure a speed claim
should quote. Each profile records the commit it ran and the tracked files outside ``results/``
that differed from it (``source``). A temporary scratch folder is removed after its run (about 280 MB
for a default run); a failed run's is kept and named.

Usage (project root, after ``source env.sh``):
    python benchmarks/profile_run.py -- MODEL=efficientnet_lite0            # the default run
    python benchmarks/profile_run.py --repeat 3 -- MODEL=efficientnet_lite0  # 3 runs, median
    python benchmarks/profile_run.py --limit-run -- MODEL=efficientnet_lite0  # + --limit 64
    python benchmarks/profile_run.py --limit-run 32 -- MODEL=mypkg.nets:build PYTHONPATH=$PWD
    # a run made elsewhere: its console output and its results folder
    MODEL=efficientnet_lite0 bash run_all.sh 2>&1 | tee run.log
    python benchmarks/profile_run.py --parse run.log --results results --command "..."
Arguments after ``--`` are VAR=value environment settings for the run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deploykit.cli import HelpFormatter, env_assignment  # noqa: E402
from deploykit.envinfo import device_info  # noqa: E402
from deploykit.io import write_json  # noqa: E402


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {text!r})") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (got {n})")
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--limit-run", type=int, nargs="?", const=64, default=None, metavar="N",
                   help="profile the smoke run `run_all.sh --limit N` (N default 64)")
    p.add_argument("--keep", type=Path, default=None,
                   help="scratch folder to use and keep (default: a temporary one, removed "
                        "after a run that succeeds); with --repeat N, one folder run_I in it "
                        "per run")
    p.add_argument("--repeat", type=_positive, default=1, metavar="N",
                   help="N runs back to back; the JSON holds each (runs) and the median, "
                        "minimum and maximum of their totals and stages (summary)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_run.json"),
                   help="JSON output")
    p.add_argument("--parse", type=Path, default=None, metavar="LOG",
                   help="profile a finished run from its console output (run_all.sh's stdout "
                        "and stderr) instead of starting one; needs --results")
    p.add_argument("--results", type=Path, default=None,
                   help="with --parse: the RESULTS folder of that run")
    p.add_argument("--logs", type=Path, default=None,
                   help="with --parse: that run's logs folder (ARTIFACTS/logs, "
                        "ARTIFACTS/smoke/logs): the per-command times.tsv")
    p.add_argument("--command", default="run_all.sh",
                   help="with --parse: the command that made the run (recorded)")
    p.add_argument("env", nargs="*", type=env_assignment,
                   help="VAR=value settings for the run (after --)")
    args = p.parse_args(argv)
    if args.parse:
        if args.repeat != 1:
            p.error("--repeat is for runs this script starts, not with --parse")
        if args.results is None:
            p.error("--parse needs --results (the RESULTS folder of that run)")
        try:
            log = args.parse.read_text(errors="replace")
        except OSError as e:
            p.error(f"--parse: cannot read {args.parse}: {e.strerror}")
        m = re.search(r"^run_all\.sh: finished \[elapsed=([\d.]+)s\]", log, re.M)
        stages = parse_stages(log)
        total = float(m.group(1)) if m else sum(stages.values())
        write_json(args.out, report(args, [args.command], log, total, args.results, load=None,
                                    times_root=args.logs, source=None))
        print(f"-> {args.out}")
        return
    cmd = ["bash", "run_all.sh"] + (["--limit", str(args.limit_run)] if args.limit_run else [])
    runs = []
    for i in range(1, args.repeat + 1):
        if args.repeat > 1:
            print(f"run {i} of {args.repeat}", flush=True)
        keep = args.keep / f"run_{i}" if args.keep and args.repeat > 1 else args.keep
        try:
            runs.append(profile_once(args, cmd, keep, print_it=args.repeat == 1))
        except RunFailed as e:
            before = ", ".join(f"{r['total_s']:.0f}" for r in runs)
            done = (f" (runs before it: {before} s; nothing written to {args.out})"
                    if runs else "")
            sys.exit(f"{e}{done}")
        if args.repeat > 1:
            print(f"run {i}: {runs[-1]['total_s']:.0f} s", flush=True)
    out = runs[0] if args.repeat == 1 else {**summarize(runs), "runs": runs}
    write_json(args.out, out)
    if args.repeat > 1:
        print_summary(out)
    print(f"-> {args.out}")


class RunFailed(Exception):
    """run_all.sh exited non-zero (the message says where its scratch folder is kept)."""


def profile_once(args, cmd: list[str], keep: Path | None, print_it: bool = True) -> dict:
    """One ``run_all.sh`` run (``cmd``) in the scratch folder ``keep`` (None: a temporary one,
    removed when the run succeeds or is interrupted, kept when it fails) and its profile
    (:func:`report`).

    Raises:
        RunFailed: the run failed (its scratch folder kept and named, its last output shown).
    """
    scratch = keep or Path(tempfile.mkdtemp(prefix="profile-"))
    env = dict(os.environ, ARTIFACTS=str(scratch / "artifacts"), RESULTS=str(scratch / "results"))
    env.update(kv.split("=", 1) for kv in args.env)
    host = {"before": host_probe()}
    ticks0, cpu0 = proc_stat_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    except BaseException:  # Ctrl-C: an unfinished run's temporary folder is of no use
        if keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    total = time.perf_counter() - t0
    ticks1, cpu1 = proc_stat_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
    host["after"] = host_probe()
    hz = os.sysconf("SC_CLK_TCK")
    host["steal_s"] = (round((ticks1["steal"] - ticks0["steal"]) / hz, 1)
                       if ticks0 and ticks1 else None)
    host["cpu_s"] = {"user": round(cpu1.ru_utime - cpu0.ru_utime, 1),
                     "system": round(cpu1.ru_stime - cpu0.ru_stime, 1)}
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RunFailed(f"run_all.sh failed (rc={proc.returncode}); its artifacts and results are "
                 f"kept in {scratch}; its last output:\n{log[-3000:]}")
    art = Path(env["ARTIFACTS"]) / ("smoke" if args.limit_run else "")
    out = report(args, args.env + cmd, log, total, Path(env["RESULTS"]),
                 times_root=art / "logs", host=host, print_it=print_it)
    if keep is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def summarize(runs: list[dict]) -> dict:
    """What several profiles of the same command have in common and their spread: the first
    run's ``machine``/``date_utc``/``command``/``source``, ``total_s`` the median of the runs'
    totals, ``totals_s`` each, and ``summary``: ``{"total_s" | "stage N" | "command NAME":
    {"median", "min", "max"}}`` in seconds, over the runs that have that stage or command."""
    keys = ("machine", "date_utc", "command", "source")
    series: dict[str, list[float]] = {"total_s": [r["total_s"] for r in runs]}
    for r in runs:
        for k, v in r.get("stages_s", {}).items():
            series.setdefault(f"stage {k}", []).append(v)
        for k, v in r.get("commands_s", {}).items():
            series.setdefault(f"command {k}", []).append(v)
    return {**{k: runs[0].get(k) for k in keys},
            "total_s": round(statistics.median(series["total_s"]), 1),
            "totals_s": series["total_s"],
            "summary": {k: {"median": round(statistics.median(v), 1), "min": min(v),
                            "max": max(v)} for k, v in series.items()}}


def print_summary(out: dict) -> None:
    """Print :func:`summarize`'s figures, one line each: median (min-max)."""
    runs = out["runs"]
    print(f"{out['command']}: {len(runs)} runs, median {out['total_s']:.0f} s "
          f"(each: {', '.join(f'{t:.0f}' for t in out['totals_s'])} s)")
    for r in runs:
        h = r.get("host") or {}
        if h:
            print(f"  {r['total_s']:.0f} s: host {h['before']['matmul_per_s']:.0f} -> "
                  f"{h['after']['matmul_per_s']:.0f} matmuls/s, CPU {h['cpu_s']['user']:.0f} s "
                  f"user + {h['cpu_s']['system']:.0f} s system")
    for k, v in out["summary"].items():
        if k != "total_s":
            print(f"  {k}: median {v['median']:.1f} s ({v['min']:.1f}-{v['max']:.1f})")


def source_info() -> dict | None:
    """The checkout that ran: ``{"commit", "dirty", "changed"}``: ``changed`` the tracked files
    that differ from the commit (``git status --porcelain --untracked-files=no``) outside
    ``results/``, which every default run rewrites (first 20), ``dirty`` whether there are
    any; None without git."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout
    try:
        commit = git("rev-parse", "HEAD").strip()
        lines = git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    changed = [ln[3:] for ln in lines if len(ln) > 3 and not ln[3:].startswith("results/")]
    return {"commit": commit, "dirty": bool(changed), "changed": changed[:20]}


def host_probe(seconds: float = 0.5) -> dict:
    """How fast this host is right now, so that runs made at different times can be read
    against each other (a shared VM host drifted by 20-45 % within an hour here; stops 41-43):
    float32 256x256 matmuls per second on NumPy's BLAS threads, and the GB/s of copying a 64 MB
    float32 array (one thread), each for ``seconds``.

    Returns:
        ``{"matmul_per_s", "copy_gb_s"}`` (higher is faster).
    """
    import numpy as np

    a = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32)
    src = np.ones(16 * 2 ** 20, np.float32)
    dst = np.empty_like(src)
    out = {}
    for name, work, unit in (("matmul_per_s", lambda: a @ a, 1.0),
                             ("copy_gb_s", lambda: np.copyto(dst, src), src.nbytes / 1e9)):
        work()
        n, t0 = 0, time.perf_counter()
        while (t := time.perf_counter() - t0) < seconds:
            work()
            n += 1
        out[name] = round(n * unit / t, 1)
    return out


def proc_stat_ticks() -> dict[str, int] | None:
    """The machine's CPU ticks so far by kind (``/proc/stat``'s ``cpu`` line: ``user``,
    ``system``, ``idle``, ``steal`` ...), or None off Linux. ``steal`` is the time a virtual
    machine's CPUs were ready to run but the hypervisor ran something else."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    return dict(zip(names, map(int, first[1:1 + len(names)])))


def parse_stages(log: str) -> dict[int, float]:
    """Seconds per stage from run_all.sh's ``Stage N: finished [elapsed=Xs]`` lines."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^Stage (\d): finished \[elapsed=([\d.]+)s\]", log, re.M)}


def command_times(root: Path | None) -> dict[str, float]:
    """``{command name: seconds}`` from every ``times.tsv`` under ``root`` (run_all.sh writes
    one line per command it ran); empty when there is none."""
    out: dict[str, float] = {}
    for f in sorted(root.rglob("times.tsv")) if root and root.exists() else []:
        for line in f.read_text().splitlines():
            name, _, sec = line.partition("\t")
            try:
                out[name] = float(sec)
            except ValueError:
                continue
    return out


def report(args, cmd: list[str], log: str, total: float, res_root: Path,
           load: tuple | None | str = "now", times_root: Path | None = None,
           host: dict | None = None, print_it: bool = True,
           source: dict | None | str = "here") -> dict:
    """Write and print the profile: stage times, command times (``times_root``'s
    ``times.tsv``), ModelOpt times (the quant records'; the console's ``finished`` lines when
    there are none), each row's ``timings_s``; ``load``: the load average to record ("now":
    this machine's, None: unknown, e.g. a run profiled afterwards with --parse); ``host``:
    :func:`host_probe` before and after the run, the run's ``steal_s`` and ``cpu_s`` (user and
    system seconds of the processes it waited for), None with --parse; ``source``: the
    checkout that ran ("here": this one's, :func:`source_info`; None: unknown, --parse).

    Returns:
        the profile (``--parse``: also written to ``args.out``; a started run's caller
        writes it); printed unless ``print_it`` is False.
    """
    load = os.getloadavg() if load == "now" else load
    stages = parse_stages(log)
    quant = {m.group(1): float(m.group(2))
             for m in re.finditer(r"finished (\S+) \[elapsed=([\d.]+)s\]", log)}
    rows = {}
    for f in sorted(res_root.rglob("*.json")):
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and r.get("timings_s"):
            rows[r["tag"]] = r["timings_s"]
        if isinstance(r, dict) and r.get("stage") == "5_quantize" and r.get("wall_time_s"):
            shared = r.get("shared_calibration") or {}
            quant.pop(r["variant"], None)  # the record's figure, not the console's
            if shared.get("fp16") == r["variant"]:
                continue  # made by its fp32 twin's run: counted there, once
            name = r["variant"] + (f" (+ {shared['fp16']}, one calibration)" if shared else "")
            quant[name] = float(r["wall_time_s"])
    commands = command_times(times_root)
    out = {"machine": device_info(), "date_utc": time.strftime("%Y-%m-%d"),
           "command": " ".join(cmd), "total_s": round(total, 1), "stages_s": stages,
           "commands_s": commands, "modelopt_s": quant, "rows_s": rows, "load_average": load,
           "host": host,
           "source": source_info() if source == "here" else source}
    if not print_it:
        return out
    print(f"{' '.join(cmd)}: {total:.0f} s in all"
          + (f" (load average {load[0]:.1f} at the end)" if load else ""))
    if host:
        b, a = host["before"], host["after"]
        print(f"  host: {b['matmul_per_s']:.0f} -> {a['matmul_per_s']:.0f} matmuls/s, "
              f"{b['copy_gb_s']:.1f} -> {a['copy_gb_s']:.1f} GB/s copy (before -> after); "
              f"CPU {host['cpu_s']['user']:.0f} s user + {host['cpu_s']['system']:.0f} s "
              f"system; steal {host['steal_s']} s")
    for k, v in sorted(stages.items()):
        print(f"  stage {k}: {v:6.0f} s")
    for k, v in commands.items():
        print(f"    command {k}: {v:.1f} s")
    for k, v in quant.items():
        print(f"    ModelOpt {k}: {v:.1f} s")
    for tag, t in rows.items():
        print(f"    {tag}: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()))
    return out


if __name__ == "__main__":
    main()
