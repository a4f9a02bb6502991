"""One writer per folder: the lock every stage that writes into a model's artifacts or results
folder takes for its whole run (:func:`lock_folders`).

The lock is an ``fcntl.flock`` on ``<folder>/.deploykit.lock`` (opened with ``O_NOFOLLOW``, so
a symlink planted under that name is refused, never followed), taken without waiting: a second
writer is refused at once, naming the holder. The kernel drops the lock whatever ends the
holder (Ctrl-C, kill -9), so a stale lock file never blocks a later run; the file itself stays
(removing it would let two writers lock two different files).

run_all.sh holds its own lock on ``$ARTIFACTS/.run_all.flock`` (fd 9, inherited by its
stages): that is another file, so a stage started by run_all.sh takes this lock as any other
writer and never waits for its parent. A hand-run stage beside a running run_all.sh on the same
model is refused when the run is inside a stage that holds this lock.
"""
from __future__ import annotations

import fcntl
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

from deploykit.errors import StageError
from deploykit.io import check_writable

LOCK_NAME = ".deploykit.lock"

# Open lock files of this process: held until it exits (the kernel releases them).
_HELD: dict[str, int] = {}


def _cmdline(pid: int) -> str:
    """The command line of ``pid`` from /proc, shell-quoted ('' when it cannot be read, or when
    it is run_all.sh's preload server's: a stage it forked shows that command line there, and
    its own is the one recorded in the lock file)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if len(args) == 1 and " " in args[0]:  # a process title (setproctitle): the command line
        return args[0]
    return "" if "deploykit.zygote" in args else shlex.join(args)


def _own_command() -> str:
    """This process's command line as ``python`` ran it (``sys.argv``, shell-quoted)."""
    return shlex.join([Path(sys.executable).name, *sys.argv])


def _holder(fd: int) -> str:
    """What the holder wrote into its lock file: ``pid P, started T, command: C``."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        text = ""
    info = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    pid = info.get("pid", "")
    if not pid.isdigit():
        return "a process that is still starting (its details are not written yet)"
    cmd = _cmdline(int(pid)) or info.get("command", "?")
    return f"pid {pid}, started {info.get('started', '?')}, command: {cmd}"


def _holder_pid(fd: int) -> int | None:
    """The pid the holder wrote into its lock file (None when not written yet)."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        return None
    pid = dict(ln.split("=", 1) for ln in text.splitlines() if "=" in ln).get("pid", "")
    return int(pid) if pid.isdigit() else None


def _ancestors() -> set[int]:
    """The pids of this process's parent, its parent, ... (from /proc; empty when unreadable)."""
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _open_lock(folder: Path) -> int:
    """Open (create) ``folder/LOCK_NAME`` without following a symlink."""
    path = folder / LOCK_NAME
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StageError(f"cannot open the lock file {path} ({e.strerror}): "
                         + ("it is a symlink: remove it" if os.path.islink(path)
                            else "make the folder writable, or point ARTIFACTS / RESULTS at "
                                 "a writable folder") + " (nothing was changed)") from e


def lock_folders(*folders: Path | str, argv: Sequence[str] | None = None) -> list[Path]:
    """Take this process's writer lock on each folder, held until the process exits.

    A folder already locked by this process is skipped (a stage may call this twice), and so
    is one locked by an ancestor of this process (a stage that runs another stage as a child
    process: the parent's lock already keeps every other writer out). A lock of a process that
    is gone is no lock: the kernel released it when that process ended.
    Takes them in the order given, without waiting; when one is held by another process the
    locks taken by this call are released and the stage is refused.

    Args:
        folders: the folders the stage writes into (created when missing).
        argv: this run's command line for the message (default ``sys.argv``).
    Returns:
        the lock files now held.
    Raises:
        StageError (exit 1): a folder cannot be created or written (:func:`deploykit.io.check_writable`),
            or is locked by another writer; the message names it, the
            holder (pid, start time, command line from /proc) and the fix.
    """
    taken: list[str] = []
    for folder in folders:
        folder = Path(folder).resolve()
        key = str(folder)
        if key in _HELD:
            continue
        check_writable(folder)  # created when missing; a one-line error when it cannot be
        fd = _open_lock(folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if _holder_pid(fd) in _ancestors():
                # a stage started by the writer that holds the folder (stage 5b runs stage 3,
                # stage 5 runs auto_precision.py): the parent already keeps others out
                os.close(fd)
                continue
            holder = _holder(fd)
            os.close(fd)
            for k in taken:
                os.close(_HELD.pop(k))
            cmd = shlex.join([Path(sys.executable).name if a == sys.executable else a
                              for a in (argv if argv is not None else sys.argv)])
            raise StageError(
                f"{folder} is being written by another run: {holder}. Wait for it to finish, "
                "or give this run folders of its own: ARTIFACTS=/other/artifacts "
                f"RESULTS=/other/results python {cmd} (nothing was changed)") from None
        info = (f"pid={os.getpid()}\nstarted={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
                f"\ncommand={_cmdline(os.getpid()) or _own_command()}\n")
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        _HELD[key] = fd
        taken.append(key)
    return [Path(k) / LOCK_NAME for k in _HELD]


def release_all() -> None:
    """Release every lock this process holds (tests; a stage simply exits)."""
    while _HELD:
        _, fd = _HELD.popitem()
        os.close(fd)
