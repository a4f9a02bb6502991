"""deploykit.quant.beside: a root script in a child process beside the stage, its output kept
and printed in order when collected; stopped with SIGINT (its cleanup runs) when the stage
fails first; started only where two CPUs and the memory are there."""
from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deploykit.quant import beside


def _script(tmp_path, body: str):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_collect_prints_stdout_and_stderr_in_order_and_returns_the_status(tmp_path, capsys):
    """No flush in the child: it runs unbuffered, so a warning on stderr stays after the stdout
    lines printed before it (they came first, block-buffered: review of stop 46)."""
    path = _script(tmp_path, """
        import sys
        print("first")
        print("WARNING: second", file=sys.stderr)
        print("third", sys.argv[1:])
        print("ERROR: the reason")
        sys.exit(3)
    """)
    child = beside.ScriptBeside(str(path), ["--model", "m x"]).start()
    assert capsys.readouterr().out == ""  # nothing before it is collected
    assert child.collect() == 3
    assert capsys.readouterr().out == ("first\nWARNING: second\nthird ['--model', 'm x']\n"
                                       "ERROR: the reason\n")
    assert child.tail(2) == "third ['--model', 'm x']\nERROR: the reason"
    assert child.collect() == 3 and capsys.readouterr().out == ""  # printed once


def test_stop_kills_the_child_and_removes_what_it_left_in_its_folders(tmp_path, capsys):
    """SIGINT does not reach it (a Ctrl-C is the stage's to handle); stop() kills it at once and
    removes the temporary names it made in the folders it writes, not the ones there before,
    and its private TMPDIR; its output is printed under a line saying it was stopped."""
    out_dir = tmp_path / "onnx"
    out_dir.mkdir()
    (out_dir / ".tmp-older").mkdir()  # someone else's, from before: kept
    started = tmp_path / "started"
    path = _script(tmp_path, f"""
        import os, pathlib, signal, tempfile, time
        d = pathlib.Path({str(out_dir)!r})
        (d / ".tmp-5b_int4.x").mkdir()
        (d / ".tmp-int4.onnx.y").write_text("half")
        (d / "int4.onnx").write_text("not a temporary name")
        tmp = tempfile.mkdtemp()
        print("tmp", tmp, signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
        pathlib.Path({str(started)!r}).write_text(tmp)
        time.sleep(60)
    """)
    child = beside.ScriptBeside(str(path), [], writes_in=[out_dir]).start()
    (out_dir / f".tmp-5_quantize.pid{os.getpid()}.abc").mkdir()  # the stage's own: kept
    for _ in range(200):
        if started.exists():
            break
        time.sleep(0.05)
    child._proc.send_signal(beside.signal.SIGINT)  # ignored
    time.sleep(0.2)
    assert child._proc.poll() is None
    t0 = time.time()
    child.stop()
    assert time.time() - t0 < 5 and child.returncode == -beside.signal.SIGKILL
    assert sorted(p.name for p in out_dir.iterdir()) == [
        f".tmp-5_quantize.pid{os.getpid()}.abc", ".tmp-older", "int4.onnx"]
    private = started.read_text()
    assert not Path(private).exists() and Path(private).name.startswith("tmp")
    out = capsys.readouterr().out
    assert out.startswith(f"{path} stopped (the stage failed first); what it printed:\ntmp ")
    assert f"tmp {private} True" in out
    child.stop()  # a second stop: nothing
    assert capsys.readouterr().out == ""


def test_a_failure_message_quotes_the_reason_before_a_log_tail(tmp_path, capsys):
    """The child's FAILED line, then its last lines: a 15-line log tail after the reason must not
    push it out (re-review of stop 46); and one that had ended when stopped is said so."""
    path = _script(tmp_path, """
        import sys
        print("int4: ModelOpt awq_clip on 100 calibration samples")
        print("child.py: FAILED: ModelOpt INT4 failed: RuntimeError: the reason", file=sys.stderr)
        for i in range(15):
            print(f"2026-12-07 - [modelopt][onnx] - INFO - log line {i}")
        sys.exit(1)
    """)
    child = beside.ScriptBeside(str(path), []).start()
    assert child.collect() == 1
    lines = child.tail(3).splitlines()
    assert lines[0] == "child.py: FAILED: ModelOpt INT4 failed: RuntimeError: the reason"
    assert lines[1:] == ["...", *[f"2026-12-07 - [modelopt][onnx] - INFO - log line {i}"
                                  for i in (12, 13, 14)]]
    capsys.readouterr()
    done = beside.ScriptBeside(str(_script(tmp_path, "print('made it')")), []).start()
    done._proc.wait()
    done.stop()
    assert capsys.readouterr().out == (f"{tmp_path / 'child.py'} had already ended (exit 0; what "
                                       "it made is kept); what it printed:\nmade it\n")


def test_the_child_runs_with_this_interpreter_in_this_folder(tmp_path, monkeypatch, capsys):
    path = _script(tmp_path, """
        import os, sys
        print(sys.executable, os.getcwd(), sys.stdin.read() == "")
    """)
    monkeypatch.chdir(tmp_path)
    assert beside.ScriptBeside(str(path), []).start().collect() == 0
    assert capsys.readouterr().out.split() == [sys.executable, str(tmp_path), "True"]


@pytest.mark.parametrize("cpus,meminfo,ok,why", [
    ({0, 1}, "MemAvailable:   20000000 kB\n", True, "2 CPU(s), 19.1 GiB available"),
    ({0}, "MemAvailable:   20000000 kB\n", False, "nothing to run it beside on"),
    ({0, 1, 2}, "MemAvailable:    9000000 kB\n", False, "under 12 GiB"),
    ({0, 1}, None, True, "available memory unknown"),
])
def test_beside_ok_needs_two_cpus_and_the_memory(tmp_path, monkeypatch, cpus, meminfo, ok, why):
    monkeypatch.setattr(beside.os, "sched_getaffinity", lambda pid: cpus)
    info = tmp_path / "meminfo"
    if meminfo is not None:
        info.write_text("MemTotal:       24000000 kB\n" + meminfo)
    real_path = beside.Path
    monkeypatch.setattr(beside, "Path", lambda p: info if p == "/proc/meminfo" else real_path(p))
    got, text = beside.beside_ok()
    assert got is ok and why in text
