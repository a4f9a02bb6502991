"""run_all.sh's preload server (deploykit.zygote): a command run through it behaves as the plain
``python <script>.py`` would (argv, folder, environment, output, exit status, signals), and
every command it cannot take safely runs as a plain process. The servers here preload only
``json`` (seconds cheaper than the real list); the whole pipeline through it runs in the README
test and in benchmarks/profile_run.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from deploykit import zygote

ROOT = Path(__file__).resolve().parents[1]

#: Reports where and how it ran, then ends as argv[1] says.
SCRIPT = textwrap.dedent("""\
    import json, os, sys, time
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                      "ppid": os.getppid(), "pid": os.getpid(), "flag": os.environ.get("FLAG"),
                      "main": __name__, "file": __file__,
                      "cmdline": open("/proc/self/cmdline", "rb").read().decode()}), flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    mode = sys.argv[1]
    if mode == "raise":
        raise ValueError("boom")
    if mode == "kbd":
        raise KeyboardInterrupt
    if mode == "sleep":
        print("sleeping", flush=True)
        time.sleep(30)
    if mode == "nap":  # a short command, for a server killed while it runs
        print("sleeping", flush=True)
        time.sleep(2)
        sys.exit(5)
    if mode == "random":
        import numpy, torch
        print(json.dumps([float(numpy.random.rand()), float(torch.rand(1))]), flush=True)
        sys.exit(0)
    sys.exit(int(mode))
""")


def _start_server(tmp_path, *modules):
    """A server preloading ``modules``: (socket path, its Popen, environment)."""
    sock = tmp_path / "s"
    env = dict(os.environ, PIPELINE_PRELOAD_SOCKET=str(sock),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    env.pop("PIPELINE_PRELOAD_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "serve", str(sock),
                          *modules], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    end = time.time() + 30
    while not sock.exists() and time.time() < end:
        time.sleep(0.02)
    want = len(modules)
    while want and time.time() < end:  # its preload done
        want -= "imported" in p.stdout.readline()
    return sock, p, env


@pytest.fixture
def server(tmp_path):
    """A server preloading ``json``; yields (socket path, server pid, environment)."""
    sock, p, env = _start_server(tmp_path, "json")
    yield sock, p.pid, env
    p.terminate()
    p.wait(10)


def _client(env, tmp_path, *args, cwd=None, **kw):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "deploykit.zygote", "run", str(script), *args],
                          env=env, cwd=cwd or tmp_path, capture_output=True, text=True,
                          timeout=60, **kw)


def _report(out: str) -> dict:
    return json.loads(out.splitlines()[0])


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("rc", [0, 3])
def test_a_command_runs_in_the_server_as_its_plain_run_would(server, tmp_path, rc):
    sock, server_pid, env = server
    sub = tmp_path / "sub"
    sub.mkdir()
    p = _client(env, tmp_path, str(rc), "x y", cwd=sub)
    assert p.returncode == rc
    rep = _report(p.stdout)
    assert rep["ppid"] == server_pid  # forked by the server
    assert rep["argv"] == [str(tmp_path / "job.py"), str(rc), "x y"] and rep["main"] == "__main__"
    assert rep["cwd"] == str(sub) and rep["path0"] == str(tmp_path)
    # ps and the lock messages name the stage, not the server (setproctitle)
    assert rep["cmdline"].rstrip("\0") == f"python {tmp_path / 'job.py'} {rc} 'x y'"
    assert p.stderr.strip() == "on stderr"  # the client's own descriptors


@pytest.mark.slow  # starts processes
def test_an_uncaught_exception_and_ctrl_c_end_as_in_python(server, tmp_path):
    _, _, env = server
    p = _client(env, tmp_path, "raise")
    assert p.returncode == 1 and "ValueError: boom" in p.stderr
    p = _client(env, tmp_path, "kbd")
    assert p.returncode == -signal.SIGINT and "KeyboardInterrupt" in p.stderr  # as plain python


@pytest.mark.slow  # starts processes
def test_another_environment_or_no_server_means_a_plain_process(server, tmp_path):
    _, server_pid, env = server
    p = _client(dict(env, FLAG="1", PIPELINE_PRELOAD_DEBUG="1"), tmp_path, "0")
    rep = _report(p.stdout)
    assert p.returncode == 0 and rep["flag"] == "1" and rep["ppid"] != server_pid
    assert "preload: plain python (environment differs: FLAG)" in p.stderr
    # variables only the pipeline reads may differ
    p = _client(dict(env, RESULTS=str(tmp_path / "r")), tmp_path, "0")
    assert _report(p.stdout)["ppid"] == server_pid
    p = _client(dict(env, PIPELINE_PRELOAD_SOCKET=str(tmp_path / "none")), tmp_path, "4")
    assert p.returncode == 4 and _report(p.stdout)["ppid"] != server_pid


@pytest.mark.slow  # starts processes
def test_sigterm_to_the_client_reaches_the_command(server, tmp_path):
    _, server_pid, env = server
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "run", str(script), "sleep"],
                         env=env, stdout=subprocess.PIPE, text=True)
    child = _report(p.stdout.readline())["pid"]
    assert p.stdout.readline().strip() == "sleeping"
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == -signal.SIGTERM  # the client dies of the command's signal
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.slow  # starts processes
def test_a_server_with_onnxruntime_loaded_forks_nothing(tmp_path):
    """onnxruntime's import leaves a forked child unable to exit (it hangs in a futex after
    sys.exit): a server that has it loaded, through any module, runs every command plain."""
    (tmp_path / "uses_ort.py").write_text("import onnxruntime\n")
    sock = tmp_path / "s"
    env = dict(os.environ, PIPELINE_PRELOAD_SOCKET=str(sock), PIPELINE_PRELOAD_DEBUG="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    srv = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "serve", str(sock),
                            "uses_ort"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert "imported uses_ort" in "".join(srv.stdout.readline() for _ in range(2))
        p = _client(env, tmp_path, "0")
        assert p.returncode == 0 and _report(p.stdout)["ppid"] != srv.pid
        assert "onnxruntime loaded in the server" in p.stderr
    finally:
        srv.terminate()
        srv.wait(10)


def test_onnxruntime_is_never_preloaded_and_the_rules_read_right():
    assert "onnxruntime" in zygote.FORK_UNSAFE
    assert not any(m.split(".")[0] in zygote.FORK_UNSAFE for m in zygote.PRELOAD)
    assert zygote.runnable(["3_onnx_eval.py", "--model", "m"]) is None
    assert "option" in zygote.runnable(["-u", "x.py"])
    assert "not a .py" in zygote.runnable(["prog"])
    assert zygote.env_difference({"A": "1", "PWD": "/a"}, {"A": "1", "PWD": "/b"}) == []
    assert zygote.env_difference({"A": "1"}, {"A": "2", "B": "3"}) == ["A", "B"]


@pytest.mark.slow  # starts processes
def test_usage_is_exit_2():
    p = subprocess.run([sys.executable, "-m", "deploykit.zygote", "bogus"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "usage:" in p.stderr


@pytest.mark.slow  # starts processes
def test_the_server_ends_when_run_all_dies(tmp_path):
    """kill -9 of run_all.sh: the kernel sends its server SIGTERM (PR_SET_PDEATHSIG)."""
    sock = tmp_path / "s"
    parent = subprocess.Popen(["bash", "-c", f"{sys.executable} -m deploykit.zygote serve "
                               f"{sock} json & echo $!; wait"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    server_pid = int(parent.stdout.readline())
    end = time.time() + 20
    while not sock.exists() and time.time() < end:
        time.sleep(0.02)
    assert os.kill(server_pid, 0) is None  # serving
    parent.kill()
    parent.wait()
    end = time.time() + 20
    while zygote._alive(server_pid) and time.time() < end:
        time.sleep(0.05)
    if zygote._alive(server_pid):
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail("the server outlived its parent")


@pytest.mark.slow  # starts processes
def test_each_command_starts_from_fresh_random_states(tmp_path):
    """Review finding: forked children inherited the server's numpy and torch generators, so
    every stage drew the same numbers (an unseeded factory then built the same weights in
    stages 1 and 2, hiding the mismatch a plain run reports)."""
    sock, srv, env = _start_server(tmp_path, "numpy", "torch")
    try:
        draws = [json.loads(_client(env, tmp_path, "random").stdout.splitlines()[-1])
                 for _ in range(2)]
        assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]
    finally:
        srv.terminate()
        srv.wait(10)


@pytest.mark.slow  # starts processes
def test_an_ignored_signal_stays_ignored_and_file_is_absolute(server, tmp_path):
    """Review finding: under nohup (SIGHUP ignored) a forked stage died of SIGHUP where the
    plain one ignores it."""
    _, _, env = server
    (tmp_path / "job.py").write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "run", "job.py", "sleep"],
                         env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    rep = _report(p.stdout.readline())
    assert rep["file"] == str(tmp_path / "job.py")  # absolute, as Python sets it
    assert p.stdout.readline().strip() == "sleeping"
    os.kill(p.pid, signal.SIGHUP)
    os.kill(rep["pid"], signal.SIGHUP)
    time.sleep(0.5)
    assert p.poll() is None and zygote._alive(rep["pid"])  # both still there
    p.send_signal(signal.SIGTERM)
    assert p.wait(20) == -signal.SIGTERM


@pytest.mark.slow  # starts processes
def test_a_killed_server_leaves_the_client_waiting_for_its_command(tmp_path):
    """Review finding: the client reported a failure at once while the orphaned command ran
    on; it now waits for the command to end first."""
    sock, srv, env = _start_server(tmp_path, "json")
    (tmp_path / "job.py").write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "run", "job.py", "nap"],
                         env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    child = _report(p.stdout.readline())["pid"]
    assert p.stdout.readline().strip() == "sleeping"
    srv.kill()
    srv.wait()
    _, err = p.communicate(timeout=30)
    assert not zygote._alive(child)  # it ended before the client reported
    assert p.returncode == 1 and "exit status is unknown" in err


@pytest.mark.slow  # starts processes
def test_sigterm_to_the_server_waits_for_the_running_command_and_removes_the_socket(tmp_path):
    sock, srv, env = _start_server(tmp_path, "json")
    (tmp_path / "job.py").write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "run", "job.py", "nap"],
                         env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() and p.stdout.readline().strip() == "sleeping"
    srv.terminate()
    assert p.wait(30) == 5  # its status, reported before the server left
    assert srv.wait(30) == 0 and not sock.exists()


def test_the_server_imports_beside_untimed_stages_only():
    assert zygote.may_import_beside([])
    assert zygote.may_import_beside([["/r/0_prepare_data.py", "--model", "m"],
                                     ["2_export_onnx.py"]])
    assert not zygote.may_import_beside([["/r/1_pytorch_baseline.py", "--model", "m"]])
    assert not zygote.may_import_beside([["0_prepare_data.py"], ["3_onnx_eval.py"]])
    assert not zygote.may_import_beside([[]])  # an unknown command: it may time something


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("script,beside", [("1_pytorch_baseline.py", False),
                                           ("0_prepare_data.py", True)])
def test_no_import_runs_beside_a_stage_that_times(tmp_path, script, beside):
    """A review saw an own-data model's stage 1 p50 at 6.3-6.9 ms while the server went on
    importing beside it, 2.2-2.5 ms without: the server waits while a timed stage runs."""
    (tmp_path / "gate.py").write_text(textwrap.dedent(f"""\
        import os, time
        end = time.time() + 30
        while not os.path.exists({str(tmp_path / 'go')!r}) and time.time() < end:
            time.sleep(0.02)
        """))
    (tmp_path / "after.py").write_text(
        f"import time\nopen({str(tmp_path / 'after.t')!r}, 'w').write(repr(time.time()))\n")
    (tmp_path / script).write_text(textwrap.dedent(f"""\
        import time
        t0 = time.time()
        time.sleep(1.5)
        open({str(tmp_path / 'job.t')!r}, 'w').write(repr((t0, time.time())))
        """))
    sock = tmp_path / "s"
    env = dict(os.environ, PIPELINE_PRELOAD_SOCKET=str(sock),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    env.pop("PIPELINE_PRELOAD_DEBUG", None)
    srv = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "serve", str(sock), "gate",
                            "after"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        end = time.time() + 30
        while not sock.exists() and time.time() < end:
            time.sleep(0.02)
        client = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "run",
                                   str(tmp_path / script)], env=env, cwd=tmp_path)
        time.sleep(0.3)  # connected, queued behind the gate's import
        (tmp_path / "go").write_text("")
        assert client.wait(60) == 0
        end = time.time() + 30
        while not (tmp_path / "after.t").exists() and time.time() < end:
            time.sleep(0.02)
        t0, t1 = eval((tmp_path / "job.t").read_text())
        imported = float((tmp_path / "after.t").read_text())
        # beside an untimed stage the server imports while it runs; beside a timed one, after
        assert (imported < t1) if beside else (imported >= t1), (t0, imported, t1)
    finally:
        srv.terminate()
        srv.wait(10)


def test_commands_the_server_did_not_fork_hold_its_imports(tmp_path):
    """A plain fallback (and run_all.sh's `bash 5_quantize.sh`) ran beside the server's imports
    unseen: each leaves hold.<pid> (hold.run_all) in the socket's folder while it runs."""
    assert not zygote.held(str(tmp_path))
    (tmp_path / "hold.run_all").write_text("")
    assert zygote.held(str(tmp_path))
    (tmp_path / "hold.run_all").unlink()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"hold.{dead.pid}").write_text("")
    assert not zygote.held(str(tmp_path)) and not (tmp_path / f"hold.{dead.pid}").exists()
    (tmp_path / f"hold.{os.getpid()}").write_text("")
    assert zygote.held(str(tmp_path))
    (tmp_path / f"hold.{os.getpid()}").unlink()
    # a client that finds no server runs plain, and holds the imports while it runs
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint(os.path.exists(os.path.join(sys.argv[1], "
                      "f'hold.{os.getpid()}')))\n")
    env = dict(os.environ, PIPELINE_PRELOAD_SOCKET=str(tmp_path / "no_server"),
               PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "deploykit.zygote", "run", str(script),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stdout + p.stderr


@pytest.mark.slow  # starts processes
def test_sigterm_mid_import_ends_an_idle_server_at_once_and_cleans_its_folder(tmp_path):
    """A refused run_all.sh waited for the import under way (torch, seconds); the first cut ended
    the server from its SIGTERM handler with sys.exit, which a module's bare except swallowed
    (then a traceback, exit 1) and which a thread started by an import outlived (a hang).
    Hold files must not keep the folder either."""
    (tmp_path / "swallow.py").write_text(textwrap.dedent(f"""\
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon
        open({str(tmp_path / 'started')!r}, 'w').close()
        try:
            time.sleep(30)
        except BaseException:
            pass
        """))
    folder = tmp_path / "deploykit-preload.t"
    folder.mkdir()
    sock = folder / "socket"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    srv = subprocess.Popen([sys.executable, "-m", "deploykit.zygote", "serve", str(sock),
                            "swallow"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        end = time.time() + 30
        while not (tmp_path / "started").exists() and time.time() < end:
            time.sleep(0.02)
        (folder / "hold.run_all").write_text("")  # left by a killed command
        t0 = time.time()
        srv.send_signal(signal.SIGTERM)
        assert srv.wait(10) == 0, srv.stdout.read()
        assert time.time() - t0 < 5
        assert "Traceback" not in srv.stdout.read()
        assert not folder.exists()
    finally:
        if srv.poll() is None:
            srv.kill()
