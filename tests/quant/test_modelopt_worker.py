"""deploykit.quant.modelopt_runner.ModelOptWorker: stage 5's one ModelOpt process."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from deploykit.quant import modelopt_runner
from deploykit.quant.modelopt_runner import ModelOptWorker, run_modelopt

# A worker that speaks serve()'s protocol with a command of its own instead of qdq_tools.py and
# preloads nothing (the real one imports ModelOpt first): each job prints to stdout and stderr,
# from Python and from a child process, then does what --do says.
FAKE_WORKER = textwrap.dedent("""
    import argparse, os, signal, sys
    from deploykit.errors import StageError
    from deploykit.quant.modelopt_runner import serve

    class Parser(argparse.ArgumentParser):  # ModelOpt's flags pass through
        def parse_args(self, args=None, namespace=None):
            return self.parse_known_args(args, namespace)[0]

    def parser():
        p = Parser(prog="qdq_tools.py")
        p.add_argument("cmd")
        p.add_argument("--do", default="ok")
        return p

    def main(a):
        if "--" in sys.argv and "--do" in sys.argv:  # after --: ModelOpt's flags
            a.do = sys.argv[sys.argv.index("--do") + 1]
        print("stdout of pid", os.getpid())
        print("stderr line", file=sys.stderr)
        os.system("echo from a grandchild")
        if a.do == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if a.do == "fail":
            raise StageError("broken on purpose")
        if a.do == "bug":
            raise RuntimeError("an uncaught bug")
        if "--output_path" in sys.argv:
            open(sys.argv[sys.argv.index("--output_path") + 1], "w").write("q")

    sys.exit(serve((parser, main), preload=()))
""")


def _worker(tmp_path: Path) -> ModelOptWorker:
    script = tmp_path / "fake_worker.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(modelopt_runner.ROOT)!r})\n"
                      + FAKE_WORKER)
    return ModelOptWorker(argv=[sys.executable, str(script)],
                          cwd=modelopt_runner.ROOT)


def _job(tmp_path: Path, worker: ModelOptWorker, name: str, *args: str) -> tuple[int, str]:
    log = tmp_path / f"{name}.log"
    log.write_text("an earlier log that the run replaces\n")
    rc = worker.run(["qdq_tools.py", "modelopt", *args], log)
    return rc, log.read_text()


def test_jobs_run_in_one_process_each_with_its_own_log(tmp_path):
    """Two runs in one worker: the same process, each run's stdout, stderr and a child
    process's output in its own log (the earlier log replaced), nothing of the other run's, and
    nothing of either in the answers."""
    with _worker(tmp_path) as w:
        rc1, log1 = _job(tmp_path, w, "a")
        rc2, log2 = _job(tmp_path, w, "b")
    assert (rc1, rc2) == (0, 0) and w.started == 1
    for log in (log1, log2):
        assert "stderr line" in log and "from a grandchild" in log
        assert "earlier log" not in log and log.count("stdout of pid") == 1
    assert log1.split("stdout of pid")[1].split()[0] == log2.split("stdout of pid")[1].split()[0]


def test_exit_statuses_are_the_commands_and_a_dead_worker_fails_one_run_only(tmp_path):
    """A StageError exits 1 with its FAILED line, an uncaught exception 1 with its traceback,
    a usage error 2 (as the command would); a run that kills the worker fails with the signal,
    and the next run starts a fresh worker."""
    with _worker(tmp_path) as w:
        rc, log = _job(tmp_path, w, "fail", "--do", "fail")
        assert rc == 1 and "qdq_tools.py: FAILED: broken on purpose" in log
        rc, log = _job(tmp_path, w, "bug", "--do", "bug")
        assert rc == 1 and "RuntimeError: an uncaught bug" in log
        rc, log = _job(tmp_path, w, "usage", "--do")
        assert rc == 2 and "expected one argument" in log
        rc, log = _job(tmp_path, w, "die", "--do", "die")
        assert rc == -signal.SIGKILL and "stdout of pid" in log and w.started == 1
        rc, _ = _job(tmp_path, w, "after")
        assert rc == 0 and w.started == 2


def test_only_modelopt_commands_are_sent(tmp_path):
    w = _worker(tmp_path)
    with pytest.raises(ValueError, match="not a qdq_tools.py"):
        w.run(["qdq_tools.py", "check", "x.onnx"], tmp_path / "l.log")
    assert w.started == 0


def test_leaving_on_an_exception_kills_the_worker(tmp_path):
    """Ctrl-C in the stage (or SIGTERM raised as SystemExit) leaves no worker behind."""
    w = _worker(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        with w:
            w.start()
            proc = w._proc
            raise KeyboardInterrupt
    assert proc.poll() is not None and w._proc is None


def test_run_modelopt_in_a_worker_keeps_the_runs_record(tmp_path):
    """run_modelopt(worker=...): the log installed under its name (no temporary left), the
    status from the exit status and the output, the command the run stands for as argv and
    shown, as with a child of its own."""
    work, final = tmp_path / "work", tmp_path / "final"
    work.mkdir()
    final.mkdir()
    log = final / "v.quant.log"
    with _worker(tmp_path) as w:
        run = run_modelopt(work / "fp32.onnx", work / "v.onnx", ["--op_types_to_quantize",
                                                                  "Conv"], log, calib_batch=16,
                           replace={work / "v.onnx": final / "v.onnx"}, worker=w)
        failed = run_modelopt(work / "fp32.onnx", work / "w.onnx", ["--do", "fail"],
                              final / "w.quant.log", worker=w)
    assert run.ok and run.returncode == 0 and (work / "v.onnx").read_text() == "q"
    assert "stderr line" in log.read_text()
    assert not [f for f in final.iterdir() if f.name.startswith(".tmp")]
    words = shlex.split(run.shown)
    assert words[1:6] == ["qdq_tools.py", "modelopt", "--calib-batch", "16", "--"]
    assert words[words.index("--output_path") + 1] == str(final / "v.onnx")
    assert run.argv[0] == sys.executable and run.argv[1:3] == ("qdq_tools.py", "modelopt")
    assert failed.status == "failed" and failed.returncode == 1


def test_shared_worker_is_one_per_stage():
    """shared_worker() inside shared_worker() is the same worker; active_worker() sees it only
    while the outer block runs."""
    assert modelopt_runner.active_worker() is None
    with modelopt_runner.shared_worker() as outer:
        with modelopt_runner.shared_worker() as inner:
            assert inner is outer is modelopt_runner.active_worker()
    assert modelopt_runner.active_worker() is None and outer.started == 0


@pytest.mark.slow
def test_modelopt_runs_in_one_worker_write_the_files_of_runs_in_processes_of_their_own(
        tmp_path):
    """The real worker (qdq_tools.py modelopt-worker, ModelOpt imported once): two INT8 runs
    and an INT4 run (stage 5b's, through deploykit.quant.int4.run_modelopt) write byte for
    byte the files that runs in processes of their own write, in one worker process."""
    pytest.importorskip("modelopt.onnx.quantization")
    import shutil

    import torch

    from deploykit.quant import int4

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU6(),
                              torch.nn.Conv2d(16, 32, 1), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(32, 64)).eval()
    src = tmp_path / "src.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 8, 8),), str(src), input_names=["x"],
                      output_names=["y"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    calib = tmp_path / "c.npz"
    np.savez(calib, x=np.random.default_rng(0).standard_normal((16, 3, 8, 8))
             .astype(np.float32))
    recipes = {"ops": ["--op_types_to_quantize", "Conv", "Gemm"], "default": []}

    def int8(name, worker):
        work = tmp_path / f"{name}.in.onnx"
        shutil.copyfile(src, work)  # ModelOpt rewrites its input
        flags = ["--quantize_mode", "int8", *recipes[name.split("_")[0]],
                 "--calibration_data_path", str(calib), "--calibration_eps", "cpu",
                 "--log_level", "ERROR"]
        run = run_modelopt(work, tmp_path / f"{name}.onnx", flags, tmp_path / f"{name}.log",
                           calib_batch="all", worker=worker)
        assert run.ok, run.tail()
        return (tmp_path / f"{name}.onnx").read_bytes()

    def int4_file(name):
        int4.run_modelopt(src, tmp_path / f"{name}.onnx", tmp_path / f"{name}.log", calib,
                          "awq_clip", 32, "cpu")
        return (tmp_path / f"{name}.onnx").read_bytes()

    alone = [int8("ops_alone", None), int8("default_alone", None)]
    in_process = int4_file("int4_here")  # ModelOpt in this process: the worker is not active
    with modelopt_runner.shared_worker() as w:
        shared = [int8("ops_w", w), int8("default_w", w), int4_file("int4_w")]
    assert w.started == 1
    assert shared == [*alone, in_process] and alone[0] != alone[1]
    assert os.path.getsize(tmp_path / "int4_w.log") > 0


def test_ctrl_c_is_left_to_the_stage(tmp_path, capfd):
    """Ctrl-C reaches the whole process group: the worker ignores it (no traceback from what it
    is importing or running) and goes on; the stage kills it on its own KeyboardInterrupt."""
    w = _worker(tmp_path)
    assert _job(tmp_path, w, "a")[0] == 0
    proc = w._proc
    proc.send_signal(signal.SIGINT)
    assert _job(tmp_path, w, "b")[0] == 0 and w.started == 1
    w.close(kill=True)
    assert proc.poll() is not None and "Traceback" not in capfd.readouterr().err


def test_relative_and_unwritable_logs(tmp_path, monkeypatch):
    """Review finding: a log named relative to the stage's folder is written there (the worker
    runs elsewhere); a log the worker cannot open fails that run only, and the worker goes on."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    w = _worker(tmp_path)
    Path("rel.log").write_text("")
    assert w.run(["qdq_tools.py", "modelopt"], "rel.log") == 0
    assert "stderr line" in (here / "rel.log").read_text()
    assert w.run(["qdq_tools.py", "modelopt"], tmp_path / "no" / "such.log") == 1
    assert w.run(["qdq_tools.py", "modelopt"], "rel.log") == 0 and w.started == 1
    w.close()
