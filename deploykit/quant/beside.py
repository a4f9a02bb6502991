"""A root script run in a child process beside the stage (stage 5: 5b_quantize_int4.py while
the ModelOpt INT8 variants are made), its output kept and printed when it is collected.

Why: stage 5 makes its files one after the other, and much of that time one of the two CPUs of
a small machine waits (ModelOpt's graph passes, NumPy's single-threaded AWQ-clip search of the
INT4 run, the health checks between ModelOpt runs). INT4 needs only ``fp32.onnx`` and
``calib.npz``, which no INT8 variant writes, and nothing in the quantization phase is timed, so
INT4 can run meanwhile. A child process, not a thread: a stage's code reads ``sys.argv`` and
the environment for its provenance, which a thread would share.

The child is an ordinary run of the script (``python 5b_quantize_int4.py ARGS``: its own
interpreter, imports, provenance and rerun command), in the stage's process group (a Ctrl-C at
the terminal, or a kill of the run's group, reaches it too), with stdin closed and stdout and
stderr in one unnamed temporary file (nothing is left on disk). :meth:`ScriptBeside.collect`
waits for it and prints that output, in order, to this process's stdout (its warnings
included: the stage's log gets them where the script would have printed them had it run in
turn). :meth:`ScriptBeside.stop` ends it when the stage fails first: SIGINT (the script's
KeyboardInterrupt path removes its temporary files), SIGKILL after :data:`STOP_GRACE_S`.

Whether it pays: :func:`beside_ok` (two CPUs and room for a second ModelOpt process).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from deploykit.layout import ROOT

#: Seconds a stopped child gets to clean up after SIGINT before it is killed.
STOP_GRACE_S = 10.0

#: Memory a second ModelOpt process may need beside the stage's own, in GiB: EfficientNet-Lite0's
#: INT4 run peaked at about 2 GiB here (AWQ-clip temporaries of 512 MB each, ModelOpt, ORT),
#: the stage's INT8 calibration at about 1.1 GB; twice that leaves room for larger models.
MIN_AVAILABLE_GIB = 8.0


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
        script: the root script's file name, e.g. ``5b_quantize_int4.py``.
        argv: its arguments (paths as the stage got them: the child runs in this process's
            working directory).
    """

    def __init__(self, script: str, argv: Sequence[str]):
        self.script, self.argv = script, list(argv)
        self.command = [sys.executable, str(ROOT / script), *self.argv]
        self._out = None
        self._proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def start(self) -> "ScriptBeside":
        """Start the child. Returns self.

        Raises:
            OSError: it cannot be started (the caller runs the script in turn instead).
        """
        sys.stdout.flush()
        sys.stderr.flush()
        self._out = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL,
                                          stdout=self._out, stderr=subprocess.STDOUT)
        except OSError:
            self._out.close()
            self._out = None
            raise
        return self

    def collect(self) -> int:
        """Wait for the child, print its output to stdout, return its exit status (negative:
        the signal that ended it). A second call prints nothing and returns the same status."""
        if self._proc is None:
            return self.returncode if self.returncode is not None else -1
        self.returncode = self._proc.wait()
        self._proc = None
        self._print_output()
        return self.returncode

    def stop(self) -> None:
        """End a child still running (SIGINT, then SIGKILL after :data:`STOP_GRACE_S`) and print
        what it wrote; nothing when it was collected. Never raises."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self.returncode = proc.wait()
        except OSError:
            pass
        self._proc = None
        try:
            self._print_output()
        except OSError:
            pass

    def _print_output(self) -> None:
        out, self._out = self._out, None
        if out is None:
            return
        try:
            out.seek(0)
            text = out.read().decode(errors="replace")
        finally:
            out.close()
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
