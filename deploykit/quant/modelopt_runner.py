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

Several runs of one stage share one child, a worker (:class:`ModelOptWorker`, entry point
``python qdq_tools.py modelopt-worker``): it imports ModelOpt once (5.0-6.9 s measured on this
project's 2-core CPU machine, an AMD EPYC with AVX512-VNNI, 2026-12-06, against 0.02 s for a bare
interpreter) and starts doing so while the stage still reads its calibration data. Each run is
the ``qdq_tools.py modelopt`` command it stands for, run by the same code in that process, its
output in its own log; a run that kills the worker fails as any failed run does, and the next
run starts a fresh one (stage 5 itself stops at a failed variant, as before). ModelOpt's
patches are in place only while a run lasts (:mod:`deploykit.quant.modelopt`), and the worker
hands its free memory back after each run. The worker ignores Ctrl-C: the stage kills it on its
own interrupt.

Example::

    run = run_modelopt(work / "fp32.onnx", work / "int8.onnx", flags, onnx_dir / "int8.quant.log",
                       calib_batch=100, replace={work / "fp32.onnx": src,
                                                 work / "int8.onnx": onnx_dir / "int8.onnx"})
    if not run.ok:
        print("\\n".join(run.tail(20)))
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Mapping, Sequence

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


#: The worker's entry point (script relative to ROOT, subcommand): one job per line on its stdin.
WORKER_ENTRY: tuple[str, ...] = ("qdq_tools.py", "modelopt-worker")

#: The ``qdq_tools.py`` subcommands a worker runs (INT8 runs; stage 5b's INT4 run).
WORKER_COMMANDS: tuple[str, ...] = ("modelopt", "modelopt-int4")


class ModelOptWorker:
    """One child process that runs several ModelOpt commands in turn (see the module docstring):
    the interpreter start and ModelOpt's imports are paid once per stage, not once per run.

    Use as a context manager; :func:`run_modelopt` takes it as ``worker``. Leaving the block
    normally closes the worker's stdin and waits for it; leaving on an exception (Ctrl-C,
    SIGTERM raised as SystemExit) kills it at once.

    Args:
        python: the interpreter (default: ``sys.executable``).
        cwd: where the worker runs (default: :data:`ROOT`, where the entry point is).
        argv: the worker's whole command line instead (a program that speaks :func:`serve`'s
            protocol).
    """

    def __init__(self, python: str | None = None, cwd: Path | str | None = None,
                 argv: Sequence[str] | None = None) -> None:
        self.argv = list(argv) if argv else [python or sys.executable, *WORKER_ENTRY]
        self.cwd = cwd or ROOT
        self.started = 0  # worker processes started (a run that kills one costs a restart)
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "ModelOptWorker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(kill=exc_type is not None)

    def start(self) -> None:
        """Start the worker process unless one is running (it imports ModelOpt meanwhile; a
        :meth:`run` starts it when needed)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        # the worker's own output outside any run (none is expected) goes to this stderr
        # Ctrl-C reaches the whole process group: the worker ignores it (no traceback from
        # whatever it is importing), and the stage kills it on its own KeyboardInterrupt
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      cwd=self.cwd, text=True, bufsize=1,
                                      preexec_fn=_ignore_sigint)
        self.started += 1

    def run(self, argv: Sequence[str], log: Path | str) -> int:
        """Run one command in the worker, its stdout and stderr written to ``log``.

        Args:
            argv: the command after the interpreter, a ``qdq_tools.py`` ``modelopt`` or
                ``modelopt-int4`` command (``["qdq_tools.py", "modelopt", ...]``).
            log: an existing file the run's output replaces.
        Returns:
            the run's exit status, as the command's would be (0 ok; 1 a failure; 2 a usage
            error); a run that killed the worker gives the worker's (negative: the signal).
        Raises:
            ValueError: ``argv`` is not a ``qdq_tools.py modelopt`` command.
            OSError: the worker cannot be started.
        """
        if list(argv[:1]) != [CHILD_ENTRY[0]] or argv[1] not in WORKER_COMMANDS:
            raise ValueError(f"ModelOptWorker.run: not a {CHILD_ENTRY[0]} "
                             f"{'/'.join(WORKER_COMMANDS)} command: {list(argv)[:3]}")
        self.start()
        proc = self._proc
        try:
            proc.stdin.write(json.dumps({"argv": list(argv[1:]),
                                         "log": os.path.abspath(log)}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if line:
            return int(json.loads(line)["returncode"])
        rc = proc.wait()  # the worker died during the run: that run failed, the next restarts
        self._proc = None
        return rc if rc != 0 else 1

    def close(self, kill: bool = False) -> None:
        """End the worker: at once (``kill``), else after the run in progress (stdin closed).
        Never raises."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if kill:
                proc.kill()
            else:
                proc.stdin.close()
            proc.wait(timeout=None if kill else 60)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        finally:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


def _ignore_sigint() -> None:
    """In the worker, before Python starts: SIGINT ignored (Python then installs no
    KeyboardInterrupt handler)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


_ACTIVE: list[ModelOptWorker] = []  # the worker of the stage running in this process


def active_worker() -> ModelOptWorker | None:
    """The worker :func:`shared_worker` opened in this process, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def shared_worker():
    """The stage's :class:`ModelOptWorker` while the block runs: the one an outer
    ``shared_worker()`` opened (left running), else a new one, closed at the end (killed on an
    exception). Callers deep inside a stage (``deploykit.quant.int4.run_modelopt``) find it
    with :func:`active_worker`."""
    if _ACTIVE:
        yield _ACTIVE[-1]
        return
    with ModelOptWorker() as worker:
        _ACTIVE.append(worker)
        try:
            yield worker
        finally:
            _ACTIVE.remove(worker)


def serve(command: tuple, jobs: IO[str] | None = None, *,
          preload: Sequence[str] = ("modelopt.onnx.quantization",)) -> int:
    """The worker's loop (``python qdq_tools.py modelopt-worker``): for each job line on
    ``jobs`` (default stdin), ``{"argv": [...], "log": path}``, run ``qdq_tools.py ARGV`` here
    (:func:`deploykit.cli.cli`: the same exit statuses as the command) with file descriptors 1
    and 2 on ``log``, then answer ``{"returncode": N}`` on the stdout it was started with.
    Outside a run, stdout is this process's stderr (nothing can mix into the answers).

    Args:
        command: ``(get_args_parser, main)`` of the command a job runs (``qdq_tools.py``'s).
        jobs: where the job lines come from (default stdin).
        preload: modules imported before the first job (ModelOpt: what a worker is there to
            import once).
    Returns:
        0 when ``jobs`` ends; a Ctrl-C in a run ends the worker (130) without an answer.
    """
    from deploykit.alloc import release_freed_memory
    from deploykit.cli import cli

    jobs = jobs or sys.stdin
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        for name in preload:
            importlib.import_module(name)
        for line in jobs:
            if not line.strip():
                continue
            job = json.loads(line)
            rc = _run_job(cli, *command, job["argv"], job["log"])
            if rc == 130:
                return 130
            release_freed_memory()
            answers.write(json.dumps({"returncode": rc}) + "\n")
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the stage says it
        return 130
    return 0


def _run_job(cli, get_args_parser, main, argv: list[str], log: str) -> int:
    """One job of :func:`serve`: ``cli(get_args_parser, main)`` with ``sys.argv`` set to the
    command and fds 1 and 2 on ``log``; its exit status."""
    saved_argv = sys.argv
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        fd = os.open(log, os.O_WRONLY | os.O_TRUNC | os.O_APPEND)
    except OSError as e:  # the run fails, the worker stays
        print(f"modelopt-worker: cannot write the run's log {log}: {e}", file=sys.stderr)
        return 1
    out_fd, err_fd = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [CHILD_ENTRY[0], *argv]
    try:
        cli(get_args_parser, main)
        rc = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:  # sys.exit("message"): Python prints it and exits 1
            print(e.code, file=sys.stderr)
            rc = 1
    except KeyboardInterrupt:
        rc = 130
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback, exit status 1
        traceback.print_exc()
        rc = 1
    finally:
        sys.argv = saved_argv
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
    return rc


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
                 histogram_cache: Path | str | None = None,
                 worker: ModelOptWorker | None = None) -> ModelOptRun:
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
        worker: run the command in this :class:`ModelOptWorker` instead of a child of its own
            (``python``, ``env`` and ``cwd`` are then the worker's; :attr:`ModelOptRun.argv` is
            the command the run stands for).
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
        if worker is not None:
            os.close(fd)
            try:
                returncode = worker.run(argv[1:], tmp)
            except BaseException:  # Ctrl-C, SIGTERM: the run stops now, as a child's would
                worker.close(kill=True)
                raise
        else:
            with os.fdopen(fd, "w") as f:
                # subprocess.run kills the child if this process is interrupted while waiting.
                returncode = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                                            cwd=cwd or ROOT,
                                            env=None if env is None else dict(env)).returncode
        wall = time.monotonic() - start
        os.replace(tmp, log)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    status = "ok" if returncode == 0 and output.exists() else "failed"
    return ModelOptRun(status=status, returncode=returncode, wall_s=wall, argv=tuple(argv),
                       shown=shown, log=log, output=output,
                       fp16_output=None if fp16_output is None else Path(fp16_output))
