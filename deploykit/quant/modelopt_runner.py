"""Run ModelOpt's ONNX PTQ in a child process: the one place that starts it.

ModelOpt patches ONNX Runtime's calibrators when it is imported, so it never runs inside a
stage's own process: the child is ``python qdq_tools.py modelopt --calib-batch B -- FLAGS``
(:func:`deploykit.quant.modelopt.modelopt_quantize`: ModelOpt's own CLI parser and ``quantize()``, with the
calibration batch set apart from the shapes its GEMV rule reads). Callers: stage 5
(``5_quantize.py``, one run per variant) and the mixed-precision search's base quantization
(``deploykit.quant.auto.inputs.base_qdq``).

What a run gives back (:class:`ModelOptRun`): the status (``ok`` only when the child exited 0
*and* wrote its output), the exit status, the wall time, the argv that ran, and the command
as it is shown in records: shell-quoted (:func:`shlex.join`) with the caller's private work
paths replaced by the final ones. The child's stdout and stderr go to a fresh temporary file
beside the log, renamed to the log when the child ends (success or failure), so a log is
never half-written under its final name; an interrupted run (Ctrl-C, SIGTERM raised as an
exception) kills the child and leaves no temporary behind.

Example::

    run = run_modelopt(work / "fp32.onnx", work / "int8.onnx", flags, onnx_dir / "int8.quant.log",
                       calib_batch=100, replace={work / "fp32.onnx": src,
                                                 work / "int8.onnx": onnx_dir / "int8.onnx"})
    if not run.ok:
        print("\\n".join(run.tail(20)))
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

from deploykit.alloc import release_freed_memory
from deploykit.layout import ROOT
from deploykit.quant.modelopt import FP16_MARK

# The child runs at the repository root (deploykit.layout.ROOT), so the entry point below is a
# relative path (the displayed command can be pasted into a shell at the repository root).

# The child's entry point (script relative to ROOT, subcommand).
CHILD_ENTRY: tuple[str, ...] = ("qdq_tools.py", "modelopt")


@dataclasses.dataclass(frozen=True)
class ModelOptRun:
    """The outcome of one ModelOpt child process.

    Attributes:
        status: ``"ok"`` when the child exited 0 and ``output`` exists, else ``"failed"``.
        returncode: the child's exit status (negative: killed by that signal).
        wall_s: seconds from the child's start to its end (not rounded).
        argv: the command that ran.
        shown: ``argv`` shell-quoted, with the ``replace`` paths substituted (for records).
        log: the file holding the child's stdout and stderr.
        output: the ``--output_path`` given to ModelOpt.
        fp16_output: the ``--fp16-output`` file asked for, or None.
    """

    status: str
    returncode: int
    wall_s: float
    argv: tuple[str, ...]
    shown: str
    log: Path
    output: Path
    fp16_output: Path | None = None

    @property
    def ok(self) -> bool:
        """True when :attr:`status` is ``"ok"``."""
        return self.status == "ok"

    @property
    def fp16_status(self) -> str | None:
        """The FP16 file's status (``"ok"`` when the child exited 0 and wrote it), None when
        none was asked for."""
        if self.fp16_output is None:
            return None
        return "ok" if self.returncode == 0 and self.fp16_output.exists() else "failed"

    def split_log(self) -> tuple[str, str]:
        """The log's text up to the FP16 conversion (the fp32 file's part) and all of it (the
        FP16 file's: it was made by the same calibration, then converted);
        ``(whole, whole)`` when the log has no conversion mark."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "", ""
        i = text.find(FP16_MARK)
        return (text if i < 0 else text[:i]), text

    def tail(self, n: int = 20) -> list[str]:
        """The last ``n`` lines of the log (``[]`` when it cannot be read).

        Args:
            n: number of lines.
        Returns:
            the lines, without their line ends.
        """
        try:
            return self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            return []


def modelopt_argv(onnx_path: Path | str, output_path: Path | str, flags: Sequence[str],
                  calib_batch: str | int = "all", python: str | None = None,
                  fp16_output: Path | str | None = None,
                  histogram_cache: Path | str | None = None) -> list[str]:
    """The child's command line.

    Args:
        onnx_path: ``--onnx_path`` (ModelOpt rewrites this file: give it a private copy).
        output_path: ``--output_path`` (ModelOpt also writes its intermediate files beside it).
        flags: the other ModelOpt CLI flags (``deploykit.variants.modelopt_args``).
        calib_batch: the calibration batch (``deploykit.quant.calibration.calibration_plan``'s ``batch_size``,
            or ``"all"``).
        python: the interpreter (default: ``sys.executable``, the one running the caller).
        fp16_output: also write the ``--high_precision_dtype fp16`` file of the same
            calibration there (``flags`` say ``--high_precision_dtype fp32``;
            :func:`deploykit.quant.modelopt.modelopt_quantize`).
        histogram_cache: the folder of calibration histograms shared between the runs of one
            stage (``--histogram-cache``; the files are the same without it).
    Returns:
        ``[python, "qdq_tools.py", "modelopt", "--calib-batch", B, ["--fp16-output", F,]
        ["--histogram-cache", D,] "--",
        "--onnx_path", ..., *flags, "--output_path", ...]``, to be run in :data:`ROOT`.
    """
    extra = [] if fp16_output is None else ["--fp16-output", str(fp16_output)]
    if histogram_cache is not None:
        extra += ["--histogram-cache", str(histogram_cache)]
    return [python or sys.executable, *CHILD_ENTRY, "--calib-batch", str(calib_batch), *extra,
            "--", "--onnx_path", str(onnx_path), *map(str, flags), "--output_path",
            str(output_path)]


def shown_command(argv: Sequence[str], replace: Mapping[Path | str, Path | str] | None = None
                  ) -> str:
    """``argv`` as a shell command line, each ``replace`` key (a work path) replaced by its
    value (the final path) inside every argument, then quoted with :func:`shlex.join` (so a
    path with spaces stays one word).

    Args:
        argv: the command. replace: ``{work path: final path}``; longer keys are replaced
            first (a work folder and a file inside it may both be given).
    Returns:
        the command line.
    """
    pairs = sorted(((str(k), str(v)) for k, v in (replace or {}).items()),
                   key=lambda kv: -len(kv[0]))
    out = []
    for a in argv:
        for k, v in pairs:
            a = a.replace(k, v)
        out.append(a)
    return shlex.join(out)


def _umask() -> int:
    """This process's file-creation mask."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run_modelopt(onnx_path: Path | str, output_path: Path | str, flags: Sequence[str],
                 log: Path | str, *, calib_batch: str | int = "all",
                 replace: Mapping[Path | str, Path | str] | None = None,
                 python: str | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None,
                 fp16_output: Path | str | None = None,
                 histogram_cache: Path | str | None = None) -> ModelOptRun:
    """Run ModelOpt's ONNX PTQ in a child process and capture its log.

    The child's stdout and stderr are written to a fresh temporary file beside ``log``
    (``tempfile.mkstemp``), renamed to ``log`` when the child has ended, whatever its status.
    A failure of the child is not an exception: look at :attr:`ModelOptRun.status`.

    Args:
        onnx_path, output_path, flags, calib_batch, python, fp16_output, histogram_cache: see
            :func:`modelopt_argv` (the FP16 file's outcome: :attr:`ModelOptRun.fp16_status`;
            :attr:`ModelOptRun.shown` leaves the histogram cache out: a work folder that is
            gone after the stage, and the same file without it).
        log: where the child's output ends up (its folder must exist and be writable).
        replace: ``{work path: final path}`` for :attr:`ModelOptRun.shown`.
        env: the child's environment (default: this process's).
        cwd: where the child runs (default: :data:`ROOT`, where the entry point is).
    Returns:
        the :class:`ModelOptRun`.
    Raises:
        OSError: the log's temporary file cannot be created or renamed, or the interpreter
            cannot be started.
        KeyboardInterrupt, SystemExit: passed on after the child was killed and the
            temporary log removed.
    """
    argv = modelopt_argv(onnx_path, output_path, flags, calib_batch, python, fp16_output,
                         histogram_cache)
    shown = shown_command(modelopt_argv(onnx_path, output_path, flags, calib_batch, python,
                                        fp16_output), replace)
    log = Path(log)
    output = Path(output_path)
    fd, tmp = tempfile.mkstemp(dir=log.parent, prefix=f".tmp-{log.name}.")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: the log gets the usual mode
        start = time.monotonic()
        release_freed_memory()  # the child calibrates in GBs: this process waits, smaller
        with os.fdopen(fd, "w") as f:
            # subprocess.run kills the child if this process is interrupted while waiting.
            p = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd or ROOT,
                               env=None if env is None else dict(env))
        wall = time.monotonic() - start
        os.replace(tmp, log)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    status = "ok" if p.returncode == 0 and output.exists() else "failed"
    return ModelOptRun(status=status, returncode=p.returncode, wall_s=wall, argv=tuple(argv),
                       shown=shown, log=log, output=output,
                       fp16_output=None if fp16_output is None else Path(fp16_output))
