#!/usr/bin/env python3
"""Where a pipeline run spends its time: runs ``run_all.sh`` (the default run, or the smoke run
``--limit N``; the environment settings given after ``--``) in a scratch ARTIFACTS/RESULTS,
then prints the wall time of every stage, of every command run_all.sh ran (its
``logs/<model>/times.tsv``) and, inside them, of every step: each ModelOpt run (the
``wall_time_s`` of each ``quant_<variant>.json``; variants that share one calibration share
one run), and for each results row its inference pass, latency loop and diagnostics
(``timings_s`` of the row).

A run's wall time moves with the host (a shared VM drifted by 15-45 % within an hour here,
benchmarks/README.md), so ``--repeat N`` makes N runs back to back, each in its own scratch
folder, and records every one with their median, minimum and maximum: the figure a speed claim
should quote. Each run records the commit it ran and the files that differed from it, taken
before it starts (``source``; the pipeline's and the benchmarks' own outputs, ``results/`` and
``benchmarks/results/``, are not counted). A temporary scratch folder is removed after a run
that succeeds or is interrupted (about 280 MB for a default run); a failed run's is kept and
named when the run wrote anything there.

Usage (project root, after ``source env.sh``):
    python benchmarks/profile_run.py -- MODEL=efficientnet_lite0            # the default run
    python benchmarks/profile_run.py --repeat 3 -- MODEL=efficientnet_lite0  # 3 runs, median
    python benchmarks/profile_run.py --limit-run -- MODEL=efficientnet_lite0  # + --limit 64
    python benchmarks/profile_run.py --limit-run 32 -- MODEL=mypkg.nets:build PYTHONPATH=$PWD
    # a run made elsewhere: its console output and its results folder
    MODEL=efficientnet_lite0 bash run_all.sh 2>&1 | tee run.log
    python benchmarks/profile_run.py --parse run.log --results results --command "..."
Arguments after ``--`` are VAR=value environment settings for the run (not ARTIFACTS or
RESULTS: the scratch folder sets them; ``--keep`` names it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deploykit.cli import HelpFormatter, env_assignment, int_at_least  # noqa: E402
from deploykit.envinfo import device_info  # noqa: E402
from deploykit.errors import StageError  # noqa: E402
from deploykit.io import check_writable, write_json  # noqa: E402

#: Folders of the checkout that runs write (the pipeline's results, the benchmarks' JSONs):
#: changes there do not make a checkout's ``source`` dirty.
OUTPUT_DIRS = ("results/", "benchmarks/results/")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--limit-run", type=int_at_least(1), nargs="?", const=64, default=None,
                   metavar="N", help="profile the smoke run `run_all.sh --limit N` (N default 64)")
    p.add_argument("--keep", type=Path, default=None,
                   help="scratch folder to use and keep, new or empty (default: a temporary "
                        "one, removed after a run that succeeds or is interrupted); with "
                        "--repeat N, one folder run_I in it per run")
    p.add_argument("--repeat", type=int_at_least(1), default=1, metavar="N",
                   help="N runs back to back; the JSON holds each (runs) and the median, "
                        "minimum and maximum of their totals, stages and commands (summary)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/profile_run.json"),
                   help="JSON output (checked before any run starts)")
    p.add_argument("--parse", type=Path, default=None, metavar="LOG",
                   help="profile a finished run from its console output (run_all.sh's stdout "
                        "and stderr) instead of starting one; needs --results")
    p.add_argument("--results", type=Path, default=None,
                   help="with --parse: the RESULTS folder of that run")
    p.add_argument("--logs", type=Path, default=None,
                   help="with --parse: that run's logs folder (ARTIFACTS/logs, "
                        "ARTIFACTS/smoke/logs): the per-command times.tsv")
    p.add_argument("--command", default=None,
                   help="with --parse: the command that made the run (recorded; default "
                        "run_all.sh)")
    p.add_argument("env", nargs="*", type=env_assignment,
                   help="VAR=value settings for the run (after --)")
    return p


def _cannot_write(folder: Path) -> str | None:
    """None when ``folder`` can be made (if missing) and a file made in it
    (:func:`deploykit.io.check_writable`: a probe file, since permission bits say nothing for
    root or /proc), else the operating system's reason."""
    try:
        check_writable(folder)
        return None
    except StageError as e:
        cause = e.__cause__
        return (getattr(cause, "strerror", None) or str(cause)) if cause else str(e)


def _check_out(p: argparse.ArgumentParser, out: Path) -> None:
    """--out must be a file that can be written: checked before minutes of runs (exit 2)."""
    if out.is_dir():
        p.error(f"--out {out} is a folder: give a file name, e.g. {out / 'profile.json'}")
    if out.exists() and not out.is_file():  # a device, a FIFO: the JSON would replace it
        p.error(f"--out {out} is not a regular file: give a file name")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # write_json creates the missing folders below this one
    why = "not a folder" if not parent.is_dir() else _cannot_write(parent)
    if why:
        p.error(f"--out {out}: cannot write in {parent} ({why}); give another path")


def _check_keep(p: argparse.ArgumentParser, keep: Path) -> Path:
    """--keep: a new or empty folder that can be made and written (exit 2 otherwise); returns
    its absolute path (run_all.sh runs in the project root)."""
    keep = keep.resolve()
    if keep.exists() and not keep.is_dir():
        p.error(f"--keep {keep} is a file: give a new or empty folder")
    if keep.is_dir() and any(keep.iterdir()):
        p.error(f"--keep {keep} is not empty (an earlier run's rows would be read as this "
                "one's): give a new or empty folder")
    why = _cannot_write(keep)  # makes it when missing
    if why:
        p.error(f"--keep {keep}: cannot {'write there' if keep.is_dir() else 'make it'} ({why}); "
                "give another folder")
    return keep


#: Signals that stop a profile as Ctrl-C does (the run's process group is stopped first); the
#: command then exits 128 + the signal's number.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (``signum``); Ctrl-C is a plain KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> None:
    p = get_args_parser()
    args = p.parse_args(argv)
    _check_out(p, args.out)
    if args.parse:
        ignored = [f for f, v in (("--repeat", args.repeat != 1), ("--keep", args.keep),
                                  ("--limit-run", args.limit_run), ("VAR=value", args.env)) if v]
        if ignored:
            p.error(f"{', '.join(ignored)}: for runs this script starts, not with --parse")
        if args.results is None:
            p.error("--parse needs --results (the RESULTS folder of that run)")
        if not args.results.is_dir():
            p.error(f"--results {args.results}: no such folder (the RESULTS folder of the run)")
        try:
            log = args.parse.read_text(errors="replace")
        except OSError as e:
            p.error(f"--parse: cannot read {args.parse}: {e.strerror}")
        m = re.search(r"^run_all\.sh: finished \[elapsed=([\d.]+)s\]", log, re.M)
        stages = parse_stages(log)
        total = float(m.group(1)) if m else sum(stages.values())
        write_json(args.out, report(args, [args.command or "run_all.sh"], log, total,
                                    args.results, load=None, times_root=args.logs, source=None))
        print(f"-> {args.out}")
        return
    given = [f for f, v in (("--results", args.results), ("--logs", args.logs),
                            ("--command", args.command)) if v is not None]
    if given:
        p.error(f"{', '.join(given)}: only with --parse (a run made elsewhere)")
    fixed = sorted({kv.split("=", 1)[0] for kv in args.env} & {"ARTIFACTS", "RESULTS"})
    if fixed:
        p.error(f"{' and '.join(fixed)} after --: each run gets its own scratch folder; "
                "--keep DIR names it")
    if args.keep and (args.keep.resolve() == args.out.resolve()
                      or args.keep.resolve() in args.out.resolve().parents):
        p.error(f"--out {args.out} is inside --keep {args.keep}, which the runs fill: give a "
                "path outside it")
    keep = _check_keep(p, args.keep) if args.keep else None
    cmd = ["bash", "run_all.sh"] + (["--limit", str(args.limit_run)] if args.limit_run else [])
    runs: list[dict] = []
    # SIGTERM and SIGHUP (a closed terminal: run_all.sh, in a session of its own, no longer
    # gets it from the kernel) end the runs as Ctrl-C does
    old = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS[1:]}
    exclude = [keep, args.out.resolve()] if keep else [args.out.resolve()]

    def so_far() -> str:
        return (f"; runs before it: {', '.join(format(r['total_s'], '.0f') for r in runs)} s"
                if runs else "")

    try:
        for i in range(1, args.repeat + 1):
            if args.repeat > 1:
                print(f"run {i} of {args.repeat}", flush=True)
            k = keep / f"run_{i}" if keep and args.repeat > 1 else keep
            try:
                runs.append(profile_once(args, cmd, k, print_it=args.repeat == 1,
                                         exclude=exclude))
            except RunFailed as e:
                sys.exit(f"{e}\n(run {i} of {args.repeat}{so_far()}; nothing written to "
                         f"{args.out})")
            except KeyboardInterrupt as e:
                signum = getattr(e, "signum", signal.SIGINT)
                what = "interrupted" if signum == signal.SIGINT else \
                    f"stopped by {signal.Signals(signum).name}"
                print(f"profile_run.py: {what} in run {i} of {args.repeat}{so_far()}; "
                      f"nothing written to {args.out}", file=sys.stderr, flush=True)
                sys.exit(128 + signum)
            if args.repeat > 1:
                print(f"run {i}: {runs[-1]['total_s']:.0f} s", flush=True)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    out = runs[0] if args.repeat == 1 else {**summarize(runs), "runs": runs}
    write_json(args.out, out)
    if args.repeat > 1:
        print_summary(out)
    print(f"-> {args.out}")


class RunFailed(Exception):
    """run_all.sh exited non-zero (the message says whether its scratch folder is kept)."""


#: Seconds :func:`_stop_group` waits for the run to end after SIGINT, then for what is left of
#: its process group after SIGTERM and after SIGKILL.
STOP_WAIT_S, TERM_GRACE_S = 30.0, 5.0


def _run_group(cmd: list[str], env: dict) -> tuple[int, str]:
    """``cmd`` in the project root in a process group of its own; ``(exit status, stdout +
    stderr)``. On KeyboardInterrupt (Ctrl-C, or SIGTERM/SIGHUP through main) the group is
    stopped (:func:`_stop_group`) and the interrupt goes on."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate()
    except KeyboardInterrupt:
        _stop_group(proc)
        raise
    return proc.returncode, out + err


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop ``proc``'s process group: SIGINT, as a terminal's Ctrl-C would give it (run_all.sh's
    trap then stops its stage and its preload server); once ``proc`` has ended, or after
    :data:`STOP_WAIT_S`, SIGTERM to what is left (a background child ignores SIGINT), and
    SIGKILL after :data:`TERM_GRACE_S`; then its pipes are read to the end. A second Ctrl-C,
    SIGTERM or SIGHUP meanwhile is ignored, so that the group is always stopped."""
    def signal_group(sig: int) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except ProcessLookupError:
            return False  # nothing left of the group
        except PermissionError:
            return True

    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        if signal_group(signal.SIGINT):
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if not signal_group(sig):
                    break
                deadline = time.monotonic() + TERM_GRACE_S
                while time.monotonic() < deadline and (proc.poll() is None or signal_group(0)):
                    time.sleep(0.05)
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def profile_once(args, cmd: list[str], keep: Path | None, print_it: bool = True,
                 exclude: list[Path] = ()) -> dict:
    """One ``run_all.sh`` run (``cmd``) in the scratch folder ``keep`` (None: a temporary one,
    removed when the run succeeds or is interrupted, kept when it fails and wrote something)
    and its profile (:func:`report`), with the checkout's ``source`` taken before it starts
    (``exclude``: the tool's own output paths, not counted as changes).

    Raises:
        RunFailed: the run failed (its last output shown, its scratch folder named if kept).
        KeyboardInterrupt: Ctrl-C, or :class:`Stopped` for SIGTERM/SIGHUP (the run's process
            group stopped).
    """
    scratch = keep or Path(tempfile.mkdtemp(prefix="profile-"))
    env = dict(os.environ, ARTIFACTS=str(scratch / "artifacts"), RESULTS=str(scratch / "results"))
    env.update(kv.split("=", 1) for kv in args.env)
    try:
        source = source_info(exclude)
        host = {"before": host_probe()}
        ticks0, cpu0 = proc_stat_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        rc, log = _run_group(cmd, env)
        total = time.perf_counter() - t0
        ticks1, cpu1 = proc_stat_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
        host["after"] = host_probe()
    except BaseException:  # interrupted: an unfinished run's temporary folder is of no use
        if keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    hz = os.sysconf("SC_CLK_TCK")
    host["steal_s"] = (round((ticks1["steal"] - ticks0["steal"]) / hz, 1)
                       if ticks0 and ticks1 else None)
    host["cpu_s"] = {"user": round(cpu1.ru_utime - cpu0.ru_utime, 1),
                     "system": round(cpu1.ru_stime - cpu0.ru_stime, 1)}
    if rc:
        wrote = scratch.is_dir() and any(scratch.iterdir())
        if keep is None and not wrote:
            shutil.rmtree(scratch, ignore_errors=True)
        where = (f"its artifacts and results are kept in {scratch}" if wrote else
                 "it wrote nothing" + (f" in {scratch}" if keep else ""))
        raise RunFailed(f"run_all.sh failed (rc={rc}); {where}; its last output:\n"
                        f"{log[-3000:]}")
    art = Path(env["ARTIFACTS"]) / ("smoke" if args.limit_run else "")
    out = report(args, args.env + cmd, log, total, Path(env["RESULTS"]),
                 times_root=art / "logs", host=host, print_it=print_it, source=source)
    if keep is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def summarize(runs: list[dict]) -> dict:
    """What several profiles of the same command have in common and their spread: the first
    run's ``machine``/``date_utc``/``command``, ``source`` (the first run's; ``sources_differ``
    says whether another run's differs), ``total_s`` the median of the runs' totals,
    ``totals_s`` each, and ``summary``: ``{"total_s" | "stage N" | "command NAME": {"median",
    "min", "max", "n"}}`` in seconds, over the ``n`` runs that have that stage or command."""
    keys = ("machine", "date_utc", "command", "source")
    series: dict[str, list[float]] = {"total_s": [r["total_s"] for r in runs]}
    for r in runs:
        for k, v in r.get("stages_s", {}).items():
            series.setdefault(f"stage {k}", []).append(v)
        for k, v in r.get("commands_s", {}).items():
            series.setdefault(f"command {k}", []).append(v)
    return {**{k: runs[0].get(k) for k in keys},
            "sources_differ": any(r.get("source") != runs[0].get("source") for r in runs),
            "total_s": round(statistics.median(series["total_s"]), 1),
            "totals_s": series["total_s"],
            "summary": {k: {"median": round(statistics.median(v), 1), "min": min(v),
                            "max": max(v), "n": len(v)} for k, v in series.items()}}


def _source_line(src: dict | None) -> str:
    if src is None:
        return "source: unknown (not a git checkout)"
    return (f"source: {src['commit'][:12]}" + (f", changed: {' '.join(src['changed'])}"
                                              if src["dirty"] else ", no changes"))


def print_summary(out: dict) -> None:
    """Print :func:`summarize`'s figures, one line each: median (min-max), and in how many
    of the runs when not all."""
    runs = out["runs"]
    print(f"{out['command']}: {len(runs)} runs, median {out['total_s']:.0f} s "
          f"(each: {', '.join(f'{t:.0f}' for t in out['totals_s'])} s)")
    print(f"  {_source_line(out['source'])}"
          + ("; WARNING: the runs' sources differ (each run's in runs[].source)"
             if out["sources_differ"] else ""))
    for r in runs:
        h = r.get("host") or {}
        if h:
            print(f"  {r['total_s']:.0f} s: host {h['before']['matmul_per_s']:.0f} -> "
                  f"{h['after']['matmul_per_s']:.0f} matmuls/s, CPU {h['cpu_s']['user']:.0f} s "
                  f"user + {h['cpu_s']['system']:.0f} s system")
    for k, v in out["summary"].items():
        if k != "total_s":
            part = f", in {v['n']} of {len(runs)} runs" if v["n"] != len(runs) else ""
            print(f"  {k}: median {v['median']:.1f} s ({v['min']:.1f}-{v['max']:.1f}{part})")


def source_info(exclude: list[Path] = ()) -> dict | None:
    """The checkout that runs: ``{"commit", "dirty", "changed"}``, or None when the project
    root is no git checkout's top folder (no git, a copy without ``.git``, a copy inside
    another repository).

    ``changed``: the files that differ from the commit or are new and not ignored (``git
    status --porcelain -z --untracked-files=all``), outside :data:`OUTPUT_DIRS` and the paths of ``exclude`` (the
    tool's own output: ``--keep``, ``--out``) (first 20); ``dirty``: whether there are any.
    """
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout
    try:
        if Path(git("rev-parse", "--show-toplevel").strip()).resolve() != ROOT.resolve():
            return None
        commit = git("rev-parse", "HEAD").strip()
        entries = git("status", "--porcelain", "-z", "--untracked-files=all").split("\0")
    except (OSError, subprocess.SubprocessError):
        return None
    own = []
    for e in exclude:
        try:
            own.append(Path(e).resolve().relative_to(ROOT.resolve()).as_posix())
        except ValueError:
            continue  # outside the checkout
    changed, skip = [], False
    for e in entries:
        if skip:  # the old name of a rename or copy (-z: its own field)
            skip = False
            continue
        if len(e) < 4:
            continue
        skip = any(c in "RC" for c in e[:2])  # in the index (X) or the work tree (Y)
        path = e[3:]
        if path.startswith(OUTPUT_DIRS) or any(path == o or path.startswith(o + "/")
                                               for o in own):
            continue
        changed.append(path)
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
           source: dict | None = None) -> dict:
    """The profile, printed unless ``print_it`` is False: stage times, command times (``times_root``'s
    ``times.tsv``), ModelOpt times (the quant records'; the console's ``finished`` lines when
    there are none), each row's ``timings_s``; ``load``: the load average to record ("now":
    this machine's, None: unknown, e.g. a run profiled afterwards with --parse); ``host``:
    :func:`host_probe` before and after the run, the run's ``steal_s`` and ``cpu_s`` (user and
    system seconds of the processes it waited for), None with --parse; ``source``: the
    checkout that ran (:func:`source_info`; None: unknown, e.g. --parse). The caller writes it.
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
           "host": host, "source": source}
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
        print(f"  {_source_line(source)}")
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
