"""A preloaded Python for run_all.sh's stage commands (a fork server, or zygote).

Each stage is ``python <stage>.py ...``, and each such process spends seconds importing the same
libraries before it does any work (measured with ``python -X importtime`` on a 2-core AMD EPYC:
stage 0 3.5 s, torchvision; stage 1 5.2 s, torch and timm; stage 2 7.0 s, with onnx and the
exporter). run_all.sh starts one server (``python -m deploykit.zygote serve SOCKET``) that
imports them once, in the background while the first stage runs (only beside stages that time
nothing: :data:`IMPORT_BESIDE`), and runs each stage command
as a forked child of itself (``python -m deploykit.zygote run <stage>.py ARGS``, the client):

- The client hands the server its command line, working folder, environment and its standard
  input, output and error (the file descriptors themselves, ``SCM_RIGHTS``). The child takes
  them, and runs the script as ``python <stage>.py ARGS`` would (``runpy``, ``__main__``,
  ``sys.argv``, ``sys.path[0]`` the script's folder); it imports what the server has not yet.
- The client exits with the child's exit status, or dies by its signal. SIGTERM and SIGHUP to
  the client are passed on to the child; so is SIGINT, unless the child is in the client's
  process group (then a Ctrl-C at the terminal reached it already). A signal the client ignores
  (``nohup``, a background job) stays ignored in the child, as a plain process inherits it.
- The child starts with fresh numpy and torch random states (Python's ``random`` reseeds itself
  at fork), as a new process would; only the string hash seed is the server's.
- When the server dies, the client waits for the child to end before it reports (exit 1, the
  status unknown); on SIGTERM the server stops taking commands, waits for the running one and
  reports its status, and removes its socket.
- The server only imports third-party libraries (:data:`PRELOAD`), never the pipeline's own
  modules, so no module state of the pipeline is shared between stages. A library may read the
  environment when it is imported, so a command whose environment differs from the server's
  in any variable outside :data:`FREE_ENV` (or whose command line is not ``<script>.py ARGS``)
  is run as a plain ``python`` process instead. So is every command when the server cannot be
  reached: the server changes how long a stage takes to start, never what it does.
- The child shows the stage's command line as its process title (``setproctitle``: ``ps``,
  ``/proc/<pid>/cmdline``), so a lock message or ``ps`` names the stage, not the server.
- The server ignores Ctrl-C (run_all.sh stops it on every exit, and the kernel sends it SIGTERM
  when run_all.sh dies: ``PR_SET_PDEATHSIG``). Switched off by ``PIPELINE_PRELOAD=0``.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import time

#: Environment variable that names the server's socket (run_all.sh sets it).
SOCKET_ENV = "PIPELINE_PRELOAD_SOCKET"

#: Libraries the server imports, in this order (the first stages' first: stage 0 needs
#: torchvision, stage 1 timm, stage 2 onnx and the exporter, stage 8 matplotlib). One that
#: fails to import is left to the stage, which then reports it as it always would. The
#: exporter's modules and onnxscript's torchlib (what ``torch.onnx.export(dynamo=True)``
#: imports first) are 0.4 s of stage 2 otherwise (torch 2.11, measured).
PRELOAD = ("numpy", "PIL.Image", "torch", "torchvision", "timm", "onnx", "onnxscript",
           "onnxscript.function_libs.torch_lib.ops", "torch.onnx._internal.exporter._core",
           "tqdm", "matplotlib", "matplotlib.pyplot")

#: Libraries whose import leaves a forked child unable to exit: onnxruntime 1.32's import
#: starts a thread that a child's exit then waits for forever (measured here: a child forked
#: after ``import onnxruntime`` hangs in a futex after ``sys.exit(0)``; one forked before it
#: that imports onnxruntime itself exits). The server never imports them, and forks no child
#: while one of them is loaded (every command then runs as a plain process).
FORK_UNSAFE = ("onnxruntime",)

#: Variables that may differ between the server and a command without a plain run: the shell's
#: own, and those only the pipeline reads, at run time (no preloaded library reads them).
FREE_ENV = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", "RUN_TAIL",
                      "PREPROCESS", "MODEL", "ARTIFACTS", "RESULTS", "VAL_ROOT", "INPUTS",
                      "PIPELINE_PROGRESS", "PIPELINE_MODEL_SPEC",
                      "PIPELINE_PRELOAD_DEBUG"})

#: The stage scripts that time nothing: the server imports :data:`PRELOAD` beside these only.
#: Beside any other command it waits, for a timed loop needs the CPUs alone (a review saw an
#: own-data model's stage 1 p50 at 6.3-6.9 ms beside the server's imports, 2.2-2.5 ms without).
IMPORT_BESIDE = frozenset({"0_prepare_data.py", "2_export_onnx.py", "4_make_calib.py"})


def may_import_beside(running: list[list[str]]) -> bool:
    """Whether the server may import now, beside the commands ``running`` (each an argv,
    ``[script.py, ARGS...]``): when none runs, or each is a stage of :data:`IMPORT_BESIDE`."""
    return all(argv and os.path.basename(argv[0]) in IMPORT_BESIDE for argv in running)


#: A file ``hold.<pid>`` or ``hold.run_all`` in the socket's folder: a command the server did
#: not fork runs (a plain fallback, which writes ``hold.<its pid>`` before it starts; run_all.sh
#: around ``bash 5_quantize.sh`` and every other command it runs itself). The server imports
#: nothing while one is there (a ``hold.<pid>`` only while that process lives).
HOLD_PREFIX = "hold."


def held(folder: str) -> bool:
    """Whether a command the server did not fork holds its imports (:data:`HOLD_PREFIX`); the
    file of a process that has ended is removed."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(HOLD_PREFIX)]
    except OSError:
        return False
    for name in names:
        who = name[len(HOLD_PREFIX):]
        if not who.isdigit() or _alive(int(who)):
            return True
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
    return False


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: Signals the client passes on to the command (and whose ignored state it keeps).
_FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_HEADER = 8  # bytes of the request's length prefix


def die_with_parent(sig: int) -> None:
    """Ask the kernel for ``sig`` when this process's parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere nothing): the preload server, stage 5's INT4 child (deploykit.quant.beside)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        pass


def env_difference(server_env: dict, env: dict) -> list[str]:
    """Names of the variables, outside :data:`FREE_ENV`, set differently in ``env`` than in
    ``server_env`` (sorted); empty when the command may run in the server."""
    keys = (set(server_env) | set(env)) - FREE_ENV
    return sorted(k for k in keys if server_env.get(k) != env.get(k))


def runnable(argv: list[str]) -> str | None:
    """Why ``python ARGV`` cannot run in the server (None when it can): only ``<script>.py
    ARGS``, no interpreter flags, no ``-m`` or ``-c``."""
    if not argv:
        return "no script"
    if argv[0].startswith("-"):
        return f"interpreter option {argv[0]}"
    if not argv[0].endswith(".py"):
        return f"{argv[0]} is not a .py script"
    return None


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------
def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's JSON request and its three file descriptors."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if len(data) < _HEADER:
        raise ValueError("short request")
    size = int.from_bytes(data[:_HEADER], "little")
    body = bytearray(data[_HEADER:])
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ValueError("request cut short")
        body += more
    return json.loads(body.decode()), list(fds)


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.sendall(json.dumps(obj).encode() + b"\n")
    except OSError:
        pass  # the client is gone: nothing to tell


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> dict | None:
    """Serve requests on the Unix socket ``path`` until SIGTERM; import ``preload`` meanwhile,
    one module at a time when no request waits, :func:`may_import_beside` the commands
    running and no other command :func:`held` the imports.

    Returns:
        in a forked child only: its job (``argv``, ``cwd``, ``env``), with its standard
        streams already in place; the server itself never returns (it exits on SIGTERM).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the stages
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    die_with_parent(signal.SIGTERM)
    server_env = dict(os.environ)
    try:  # now, before any child changes the environment: its first call claims the argv +
        # environ memory it writes titles into (later, a cleared environ leaves it none)
        import setproctitle

        setproctitle.setproctitle(setproctitle.getproctitle())
    except ImportError:
        pass
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(16)
    todo = list(preload)
    jobs: dict[int, socket.socket] = {}  # child pid -> its client's connection
    job_argv: dict[int, list[str]] = {}  # child pid -> its command line

    server_pid = os.getpid()

    def on_sigterm(*_):
        # no command to wait for: end now, also in the middle of an import (a refused run_all.sh
        # waited seconds for torch's); a child forked a moment ago only notes it
        stopping.append(1)  # first: whatever happens to the exit below, the loop stops
        if not jobs and os.getpid() == server_pid:
            _stop(lsock, path, jobs)
    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"preload server {os.getpid()}: {path}; importing {' '.join(todo)}", flush=True)
    while True:
        if stopping:  # SIGTERM: no new command; the running ones report their status first
            _stop(lsock, path, jobs)
        importing = (bool(todo) and may_import_beside(list(job_argv.values()))
                     and not held(os.path.dirname(path)))
        ready, _, _ = select.select([lsock], [], [], 0 if importing else 0.05)
        for pid, conn in list(jobs.items()):  # finished children: their status to the client
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
                del jobs[pid]
                job_argv.pop(pid, None)
        if ready:
            conn, _ = lsock.accept()
            try:
                req, fds = _recv_request(conn)
            except (OSError, ValueError) as e:
                _send(conn, {"fallback": f"bad request: {e}"})
                conn.close()
                continue
            unsafe = [m for m in FORK_UNSAFE if m in sys.modules]
            why = (f"{' '.join(unsafe)} loaded in the server: a forked child could not exit"
                   if unsafe else None) or runnable(req.get("argv", [])) or (
                "environment differs: " + " ".join(diff)
                if (diff := env_difference(server_env, req.get("env", {}))) else None)
            if why:
                for fd in fds:
                    os.close(fd)
                _send(conn, {"fallback": why})
                conn.close()
                continue
            # no SIGTERM between the fork and the client's answer: ended there, the server
            # would leave the child running and its client running the command again, plain
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            pid = os.fork()
            if pid == 0:  # the child: becomes the stage
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                lsock.close()
                for c in jobs.values():
                    c.close()
                conn.close()
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                    os.close(fd)
                return req
            for fd in fds:
                os.close(fd)
            jobs[pid] = conn
            job_argv[pid] = list(req.get("argv", []))
            try:
                _send(conn, {"pid": pid})
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            print(f"{time.strftime('%H:%M:%S')} pid {pid}: {' '.join(req['argv'])}", flush=True)
        elif importing:
            name = todo.pop(0)
            t0 = time.time()
            try:
                if name.split(".")[0] in FORK_UNSAFE:
                    raise ImportError("not preloaded: see FORK_UNSAFE")
                __import__(name)
                print(f"  imported {name} ({time.time() - t0:.2f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - a library the stage may not need
                print(f"  {name} not imported ({type(e).__name__}: {e})", flush=True)


def _stop(lsock: socket.socket, path: str, jobs: dict[int, socket.socket]) -> None:
    """End the server: no new connection (the socket file removed, and its folder when it is
    run_all.sh's ``deploykit-preload.*``), each running command waited for and its status sent
    to its client, then exit 0 (``os._exit``)."""
    lsock.close()
    folder = os.path.dirname(path)
    with contextlib.suppress(OSError):
        os.unlink(path)
    if os.path.basename(folder).startswith("deploykit-preload."):
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):  # holds left by commands (HOLD_PREFIX)
                if name.startswith(HOLD_PREFIX):
                    os.unlink(os.path.join(folder, name))
            os.rmdir(folder)
    for pid, conn in jobs.items():
        try:
            _, status = os.waitpid(pid, 0)  # retried on EINTR by Python itself (PEP 475)
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
        except ChildProcessError:
            pass  # already reaped: its status is lost
        conn.close()
    # os._exit, not sys.exit: called from the SIGTERM handler, a SystemExit could be swallowed
    # by the module being imported (a bare except), and a thread an import started would keep
    # the process alive (a review saw both)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def _become(req: dict) -> None:
    """In the forked child: the state ``python ARGV`` would start with, then the script."""
    import io
    import runpy

    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    # the client's signal dispositions, as a plain process would inherit them: one the client
    # ignores (nohup, a background job) stays ignored, else Python's defaults
    ignored = set(req.get("ignored", ()))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGINT):
        if int(sig) in ignored:
            signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
    # fresh random states, as a new process has (Python's random reseeds itself at fork;
    # numpy's and torch's global generators would otherwise be the server's, the same in every
    # stage). The string hash seed stays the server's.
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    # fresh text streams over descriptors 0-2, buffered as Python buffers them at start
    # (stdout by line on a terminal, stderr by line, neither with PYTHONUNBUFFERED)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    enc = sys.stdout.encoding

    def writer(fd: int, errors: str, by_line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "wb", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=enc,
                                errors=errors, line_buffering=by_line and not unbuffered,
                                write_through=unbuffered)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "rb", closefd=False)), encoding=sys.stdin.encoding,
        errors=sys.stdin.errors)
    sys.stdout = sys.__stdout__ = writer(1, sys.stdout.errors, os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    _set_title(["python", *sys.argv])
    try:
        runpy.run_path(os.path.abspath(script), run_name="__main__")  # __file__ absolute
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        # as Python does: the traceback, then death by SIGINT (the caller sees the signal)
        sys.excepthook(*sys.exc_info())
        fast_exit(None, signal.SIGINT)
    except BaseException:  # noqa: BLE001 - reported as Python reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    fast_exit(code)


def _set_title(argv: list[str]) -> None:
    """Show the stage's own command line for this process (``ps``, ``/proc/<pid>/cmdline``,
    read by run_all.sh and :mod:`deploykit.lock` to name a running stage) instead of the
    server's: ``setproctitle``; without it the server's stays."""
    try:
        import shlex

        import setproctitle

        setproctitle.setproctitle(shlex.join(argv))
    except ImportError:
        pass


def _exit_code(code) -> int:
    """The exit status of ``SystemExit(code)``, as Python computes it (a non-int is printed to
    stderr and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def fast_exit(code: int | None, sig: int | None = None) -> None:
    """End this process as Python ends a program, less the teardown of every module: wait for
    its non-daemon threads, run its ``atexit`` functions, flush Python's and C's output
    buffers, then ``os._exit`` (a preloaded stage's child; stage 5's ModelOpt worker). The
    teardown of the thousands of modules the server preloaded (torch's among them) takes
    0.7-1.7 s per process here, measured; a plain ``python`` process that imports torch or
    ModelOpt pays it too. An object that only the teardown would finalize (an open file in a
    module global, flushed by its ``__del__``) is not: the stages close their files
    (``deploykit.io``'s atomic writes).

    Args:
        code: the exit status (None: 1). sig: end by this signal instead (its default action),
            as a process killed by it would.
    Never returns."""
    import atexit
    import threading

    try:
        threading._shutdown()  # what Python's finalization does first
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C stdio buffers of native libraries
    except (OSError, AttributeError):
        pass
    if sig is not None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(code if code is not None else 1)


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------
def _plain(argv: list[str], why: str | None = None) -> None:
    """``python ARGV`` in place of this process (the same pid), holding the server's imports
    while it runs (:data:`HOLD_PREFIX`) when a server's socket folder is named."""
    if why and os.environ.get("PIPELINE_PRELOAD_DEBUG"):
        print(f"preload: plain python ({why})", file=sys.stderr, flush=True)
    sock = os.environ.get(SOCKET_ENV)
    if sock:
        with contextlib.suppress(OSError):
            open(os.path.join(os.path.dirname(sock), f"{HOLD_PREFIX}{os.getpid()}"), "w").close()
    import shutil

    found = shutil.which("python")  # run_all.sh's "python", as it would have run the command
    same = found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)
    os.execv(sys.executable, ["python" if same else sys.executable, *argv])


def run(argv: list[str]) -> int:
    """The client: ``python ARGV`` in the server named by :data:`SOCKET_ENV` (else a plain
    one); returns (exits with) that command's exit status."""
    path = os.environ.get(SOCKET_ENV)
    why = runnable(argv)
    if not path or why:
        _plain(argv, why or "no server")
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        ignored = [int(g) for g in _FORWARDED if signal.getsignal(g) == signal.SIG_IGN]
        body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                           "ignored": ignored}).encode()
        socket.send_fds(sock, [len(body).to_bytes(_HEADER, "little") + body], [0, 1, 2])
        f = sock.makefile("rb")
        reply = json.loads(f.readline() or b"{}")
    except (OSError, ValueError) as e:
        _plain(argv, f"server unreachable: {e}")
    if "pid" not in reply:
        _plain(argv, reply.get("fallback", "no answer"))
    pid = reply["pid"]
    received: list[int] = []

    def forward(sig, _frame):
        received.append(sig)
        try:
            if sig != signal.SIGINT or os.getpgid(pid) != os.getpgrp():
                os.kill(pid, sig)
        except ProcessLookupError:
            pass
    for sig in _FORWARDED:
        if sig not in ignored:  # an ignored signal stays ignored, here and in the command
            signal.signal(sig, forward)
    while True:
        try:
            line = f.readline()
            break
        except InterruptedError:
            continue
    status = json.loads(line).get("exit") if line else None
    if status is None:
        # The server is gone (killed): the command, its child, lives on. Wait for it to end,
        # so that nothing runs on after this reports; its exit status is lost.
        while _alive(pid):
            time.sleep(0.2)
        if received:  # ended with a signal sent to this client too: end as it would
            status = -received[-1]
        else:
            print(f"preload: the preload server ended before {argv[0]} (pid {pid}) did; its "
                  "exit status is unknown", file=sys.stderr)
            return 1
    if status < 0:  # killed by a signal: so is this process, as a plain run would be
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(1)
        return 128 - status
    return status


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def main(argv: list[str] | None = None) -> int:
    """``serve SOCKET [MODULE ...]`` (the modules to preload, default :data:`PRELOAD`) or
    ``run SCRIPT.py ARGS...``; exit status 2 on anything else."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "serve":
        job = serve(argv[1], tuple(argv[2:]) or PRELOAD)
        if job is not None:  # the forked child: the stage, as the main program
            _become(job)
        return 0
    if len(argv) >= 2 and argv[0] == "run":
        return run(argv[1:])
    print("usage: python -m deploykit.zygote serve SOCKET [MODULE ...] | run SCRIPT.py [ARGS...]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
