"""A root script run in a child process beside the stage (stage 5: 5b_quantize_int4.py while
the ModelOpt INT8 variants are made), its output kept and printed when it is collected.

Why: stage 5 makes its files one after the other, and much of that time one of the two CPUs of
a small machine waits (ModelOpt's graph passes, NumPy's single-threaded AWQ-clip search of the
INT4 run, the health checks between ModelOpt runs). INT4 needs only ``fp32.onnx`` and
``calib.npz``, which no INT8 variant writes, and nothing in the quantization phase is timed, so
INT4 can run meanwhile. A child process, not a thread: a stage's code reads ``sys.argv`` and
the environment for its provenance, which a thread would share.

The child is an ordinary run of the script (``python -u 5b_quantize_int4.py ARGS``: its own
interpreter, imports, provenance and rerun command), in the stage's process group (a kill of the
run's group reaches it too) but with SIGINT ignored, as the stage's ModelOpt worker has it: a
Ctrl-C at the terminal reaches the stage, which then stops the child itself (a KeyboardInterrupt
landing inside the child's imports read as a broken onnxruntime install; review of stop 46). Its
stdin is closed, its stdout and stderr (unbuffered, so in the order written) go to one unnamed
temporary file, and its temporary files (``tempfile``: ModelOpt's) to a private folder removed
when it ends. :meth:`ScriptBeside.collect` waits for it and prints that output to this
process's stdout (its warnings included: the stage's log gets them where the script would
have printed them had it run in turn). :meth:`ScriptBeside.stop` ends it when the stage fails
first: SIGKILL, then the temporary names it left in the folders it writes (``.tmp-*``, new
since it started) are removed.

Whether it pays: :func:`beside_ok` (two CPUs and room for a second ModelOpt process). It
does not where the INT4 run is short (a few calibration samples): the child's own imports of
ModelOpt and onnxruntime, about 5 s of one CPU here, then outweigh it.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from deploykit.io import LEFTOVER_PATTERNS
from deploykit.layout import ROOT
from deploykit.zygote import die_with_parent

#: Memory available for a second ModelOpt process beside the stage's own, in GiB:
#: EfficientNet-Lite0's INT4 run peaked at about 2 GiB here (AWQ-clip temporaries of 512 MB
#: each, ModelOpt, ORT), and a ModelOpt INT8 run that makes entropy histograms at 7.1 GiB
#: (README, stage 5; one calibration batch computed as max calibration: about 1.1 GB).
MIN_AVAILABLE_GIB = 12.0

#: Lines of the child's output a failure message quotes (its error is among its last lines).
TAIL_LINES = 6


def _available_gib() -> float | None:
    """``MemAvailable`` of /proc/meminfo in GiB, or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


def beside_ok() -> tuple[bool, str]:
    """Whether a second quantization process should run beside the stage's: at least two CPUs
    this process may use and :data:`MIN_AVAILABLE_GIB` of available memory.

    Returns:
        ``(ok, why)``: ``why`` says what was found, for the stage's log line.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    gib = _available_gib()
    found = f"{cpus} CPU(s), " + (f"{gib:.1f} GiB available" if gib is not None
                                  else "available memory unknown")
    if cpus < 2:
        return False, f"{found}: nothing to run it beside on"
    if gib is not None and gib < MIN_AVAILABLE_GIB:
        return False, f"{found}, under {MIN_AVAILABLE_GIB:g} GiB for a second ModelOpt process"
    return True, found


class ScriptBeside:
    """``python <ROOT>/<script> ARGV`` in a child process (see the module docstring).

    Args:
        script: the root script's file name, e.g. ``5b_quantize_int4.py`` (or a path).
        argv: its arguments (paths as the stage got them: the child runs in this process's
            working directory).
        writes_in: the folders it writes into (the stage holds their writer locks): where
            :meth:`stop` removes the temporary names it left.
    """

    def __init__(self, script: str, argv: Sequence[str], writes_in: Sequence[Path] = ()):
        self.script, self.argv = script, list(argv)
        self.command = [sys.executable, "-u", str(ROOT / script), *self.argv]
        self.writes_in = [Path(d) for d in writes_in]
        self._out = None
        self._tmp: str | None = None
        self._before: set[Path] = set()
        self._proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.output = ""  # what it printed, once collected or stopped

    def start(self) -> "ScriptBeside":
        """Start the child. Returns self.

        Raises:
            OSError: it cannot be started (the caller runs the script in turn instead).
        """
        sys.stdout.flush()
        sys.stderr.flush()
        self._before = set(self._leftover_names())
        self._out = tempfile.TemporaryFile()
        self._tmp = tempfile.mkdtemp(prefix="deploykit-beside-")
        try:
            self._proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=self._out,
                stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=self._tmp),
                preexec_fn=_child_setup)
        except OSError:
            self._end()
            raise
        return self

    def collect(self) -> int:
        """Wait for the child, print its output to stdout, return its exit status (negative:
        the signal that ended it, and then the temporary names it left in ``writes_in`` are
        removed). A second call prints nothing and returns the same status."""
        if self._proc is None:
            return self.returncode if self.returncode is not None else -1
        self.returncode = self._proc.wait()
        self._proc = None
        if self.returncode < 0:  # killed by a signal (the OOM killer, a kill of the group)
            self._remove_leftovers()
        self._end()
        self._print(self.output)
        return self.returncode

    def stop(self, why: str = "the stage failed first") -> None:
        """End a child still running (SIGKILL), remove the temporary names it left in
        ``writes_in`` and print what it wrote under a line saying so (or that it had already
        ended); nothing when it was collected. Never raises (a closed stdout included)."""
        proc = self._proc
        if proc is None:
            return
        try:
            running = proc.poll() is None
            if running:
                proc.kill()
            self.returncode = proc.wait()
        except OSError:
            running = True
        self._proc = None
        if running:
            self._remove_leftovers()
        self._end()
        head = (f"{self.script} stopped ({why})" if running else
                f"{self.script} had already ended (exit {self.returncode}; what it made is kept)")
        with contextlib.suppress(OSError):  # a closed stdout (| head): the stage's error wins
            self._print(f"{head}; what it printed:\n{self.output}")

    def tail(self, n: int = TAIL_LINES) -> str:
        """What a failure message quotes of the child's output (after :meth:`collect`): its last
        line that states a failure (:data:`_REASON`), if any, then its last ``n`` non-empty
        lines (a log tail after the reason must not hide it: review of stop 46)."""
        lines = [x for x in self.output.replace("\r", "\n").splitlines() if x.strip()]
        last = lines[-n:]
        reason = next((x for x in reversed(lines) if _REASON.search(x)), None)
        if reason is None or reason in last:
            return "\n".join(last)
        return "\n".join([reason, "...", *last])

    def _remove_leftovers(self) -> None:
        """Remove the temporary names that appeared in ``writes_in`` since the child started
        (:data:`deploykit.io.LEFTOVER_PATTERNS`, the names :func:`deploykit.io.remove_leftovers`
        clears after a killed run): a killed child's (the stage holds those folders' writer
        locks, so no other writer made them)."""
        own = f"pid{os.getpid()}."  # this process's own work folder (5_quantize.py's)
        for p in set(self._leftover_names()) - self._before:
            if own in p.name:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()

    def _leftover_names(self) -> list[Path]:
        out = []
        for d in self.writes_in:
            with contextlib.suppress(OSError):
                out += [p for pattern in LEFTOVER_PATTERNS for p in d.glob(pattern)]
        return out

    def _end(self) -> None:
        """Read and close the output file; remove the private temporary folder."""
        out, self._out = self._out, None
        if out is not None:
            try:
                out.seek(0)
                self.output = out.read().decode(errors="replace")
            except OSError:
                pass
            finally:
                out.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    @staticmethod
    def _print(text: str) -> None:
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()


def _child_setup() -> None:
    """In the child, before Python starts: SIGINT ignored (Python then installs no
    KeyboardInterrupt handler; the stage stops it), and SIGKILL when the stage's process dies
    first (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


#: A line of the child's output that states its failure (``5b_quantize_int4.py: FAILED: ...``,
#: ``... error: ...``, an exception's last line).
_REASON = re.compile(r"(^|: )(FAILED|ERROR|error)\b|^[A-Za-z_.]*(Error|Exception): ")
