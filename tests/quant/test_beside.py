"""deploykit.quant.beside: a root script in a child process beside the stage, its output kept
and printed in order when collected; stopped with SIGINT (its cleanup runs) when the stage
fails first; started only where two CPUs and the memory are there."""
from __future__ import annotations

import sys
import textwrap
import time

import pytest

from deploykit.quant import beside


def _script(tmp_path, body: str):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_collect_prints_stdout_and_stderr_in_order_and_returns_the_status(tmp_path, capsys):
    path = _script(tmp_path, """
        import sys
        print("first", flush=True)
        print("WARNING: second", file=sys.stderr, flush=True)
        print("third", sys.argv[1:], flush=True)
        sys.exit(3)
    """)
    child = beside.ScriptBeside(str(path), ["--model", "m x"]).start()
    assert capsys.readouterr().out == ""  # nothing before it is collected
    assert child.collect() == 3
    assert capsys.readouterr().out == "first\nWARNING: second\nthird ['--model', 'm x']\n"
    assert child.collect() == 3 and capsys.readouterr().out == ""  # printed once


def test_stop_interrupts_a_running_child_whose_cleanup_runs(tmp_path, capsys):
    marker = tmp_path / "cleaned"
    path = _script(tmp_path, f"""
        import time
        print("started", flush=True)
        try:
            time.sleep(60)
        finally:
            open({str(marker)!r}, "w").write("yes")
            print("cleaned up", flush=True)
    """)
    child = beside.ScriptBeside(str(path), []).start()
    for _ in range(100):  # until it is inside its try block
        time.sleep(0.05)
        if child._out is not None and child._out.tell() > 0:
            break
    t0 = time.time()
    child.stop()
    assert time.time() - t0 < beside.STOP_GRACE_S
    assert marker.read_text() == "yes"
    assert child.returncode not in (0, None)
    out = capsys.readouterr().out
    assert "started" in out and "cleaned up" in out
    child.stop()  # a second stop: nothing


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
    ({0, 1, 2}, "MemAvailable:    4000000 kB\n", False, "under 8 GiB"),
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
