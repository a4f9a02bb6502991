"""benchmarks/: impossible flag values are usage errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.stages import ROOT


# ----------------------------------------------------------------- benchmarks and --help
@pytest.mark.slow
@pytest.mark.parametrize("cmd,flag", [
    (["benchmarks/data_path.py", "--n", "0"], "--n: must be an integer >= 1 (got 0)"),
    (["benchmarks/data_path.py", "--rounds", "0"], "--rounds: must be an integer >= 1 (got 0)"),
    (["benchmarks/data_path.py", "--workers", "-1"], "--workers: must be an integer >= 0"),
    (["benchmarks/harness_fidelity.py", "--iters", "0"], "--iters: must be an integer >= 1"),
    (["benchmarks/harness_fidelity.py", "--rounds", "0"], "--rounds: must be an integer >= 1"),
    (["benchmarks/harness_fidelity.py", "--warmup", "-2"], "--warmup: must be an integer >= 0"),
    (["benchmarks/profile_run.py", "--", "NOTANASSIGNMENT"], "'NOTANASSIGNMENT' is not VAR=value"),
])
def test_benchmark_flags_with_impossible_values_are_usage_errors(tmp_path, cmd, flag):
    """These ended in tracebacks (an empty median, ImageFolder finding no class folder,
    DataLoader's ValueError, a dict update error) after seconds of work."""
    p = subprocess.run([sys.executable, *cmd, *(["--out", str(tmp_path / "o.json")]
                                                if "profile_run" not in cmd[0] else [])],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert flag in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o.json").exists()


def test_the_smoke_benchmarks_user_factory_is_one_seeded_resnet18(monkeypatch):
    """benchmarks/smoke_models.py:resnet18 loads as a user's ``module:factory`` spec, takes the
    preprocessing it is given, and builds the same weights every time (each stage builds it)."""
    import torch

    from deploykit.models import build_model, custom_spec

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    pre = "mean=0.485,0.456,0.406,std=0.229,0.224,0.225,resize=256,crop=224,interpolation=bilinear"
    spec = custom_spec("smoke_models:resnet18", pre)
    assert spec.classifier and spec.crop == 224 and spec.std == (0.229, 0.224, 0.225)
    (a, _), (b, _) = build_model("smoke_models:resnet18"), build_model("smoke_models:resnet18")
    assert sum(p.numel() for p in a.parameters()) == 11_689_512
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        assert torch.equal(a(x), b(x)) and a(x).shape == (2, 1000)


def test_profile_runs_record_how_fast_the_host_was(monkeypatch):
    """profile_run.py's host probe: two figures that grow with the host's speed (positive and
    finite), and the machine's CPU ticks by kind, steal among them, which only grow."""
    import math

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_run

    probe = profile_run.host_probe(seconds=0.05)
    assert set(probe) == {"matmul_per_s", "copy_gb_s"}
    assert all(math.isfinite(v) and v > 0 for v in probe.values())
    a = profile_run.proc_stat_ticks()
    if a is None:
        pytest.skip("no /proc/stat here")
    sum(i * i for i in range(200_000))  # a little CPU time between the two readings
    b = profile_run.proc_stat_ticks()
    assert {"user", "system", "idle", "steal"} <= set(a)
    assert all(b[k] >= a[k] for k in a) and sum(b.values()) >= sum(a.values())


# ----------------------------------------------------------------- profile_run.py --repeat
def _fake_run_all(monkeypatch, fail_on: int | None = None, write: bool = True,
                  stage5_on: int | None = None):
    """profile_run.py with run_all.sh replaced by a fake (``_run_group``) that writes one row and
    a times.tsv (unless ``write`` is False) and prints stage lines (stage 5 only in run
    ``stage5_on``); the Nth run fails with ``fail_on``; an instant host probe. Returns the
    module and the list of (ARTIFACTS, RESULTS) folders the runs were given."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_run

    seen: list[tuple[Path, Path]] = []

    def run_group(cmd, env):
        assert cmd[:2] == ["bash", "run_all.sh"]
        art, res = Path(env["ARTIFACTS"]), Path(env["RESULTS"])
        seen.append((art, res))
        if write:
            (res / "m").mkdir(parents=True)
            (art / "logs" / "m").mkdir(parents=True)
            (art / "logs" / "m" / "times.tsv").write_text(f"1_pytorch_baseline\t{len(seen)}.5\n")
            (res / "m" / "ort_fp32.json").write_text(json.dumps(
                {"tag": "ort_fp32", "timings_s": {"inference": 1.0 * len(seen)}}))
        rc = 1 if len(seen) == fail_on else 0
        out = f"Stage 0: finished [elapsed={len(seen)}s]\nStage 1: finished [elapsed=2s]\n"
        if len(seen) == stage5_on:
            out += "Stage 5: finished [elapsed=100s]\n"
        return rc, out + ("boom\n" if rc else "")

    monkeypatch.setattr(profile_run, "_run_group", run_group)
    monkeypatch.setattr(profile_run, "host_probe",
                        lambda seconds=0.5: {"matmul_per_s": 1.0, "copy_gb_s": 1.0})
    return profile_run, seen


def test_profile_run_repeat_records_every_run_and_their_median(monkeypatch, tmp_path, capsys):
    """--repeat 3: three runs, each in its own temporary scratch folder, removed afterwards;
    the JSON holds every run, the median and spread of the totals and of each stage and
    command (with the number of runs that have it), and the checkout that ran."""
    import json

    profile_run, seen = _fake_run_all(monkeypatch, stage5_on=3)
    out = tmp_path / "p.json"
    profile_run.main(["--repeat", "3", "--out", str(out), "--", "MODEL=m"])
    d = json.loads(out.read_text())
    assert len(d["runs"]) == 3 and len(d["totals_s"]) == 3
    assert d["total_s"] == sorted(d["totals_s"])[1]
    assert d["summary"]["stage 0"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert d["summary"]["stage 5"]["n"] == 1
    assert d["summary"]["command 1_pytorch_baseline"]["max"] == 3.5
    assert [r["rows_s"]["ort_fp32"]["inference"] for r in d["runs"]] == [1.0, 2.0, 3.0]
    assert len({a for a, _ in seen}) == 3
    assert not any(a.parent.exists() for a, _ in seen), "temporary scratch folders left"
    assert d["sources_differ"] is False and d["source"] == d["runs"][0]["source"]
    if (ROOT / ".git").exists():  # a checkout: its commit, taken before each run
        assert len(d["source"]["commit"]) == 40
    other = [dict(r) for r in d["runs"][:2]]
    other[1]["source"] = {"commit": "0" * 40, "dirty": True, "changed": ["x.py"]}
    assert profile_run.summarize(other)["sources_differ"] is True
    text = capsys.readouterr().out
    assert "3 runs, median" in text and "stage 0: median 2.0 s (1.0-3.0)\n" in text
    assert "stage 5: median 100.0 s (100.0-100.0, in 1 of 3 runs)" in text
    assert "source: " in text


def test_profile_run_keeps_a_failed_runs_folder_and_writes_nothing(monkeypatch, tmp_path):
    """The second of three runs fails: the command exits naming its kept scratch folder and
    the first run's total; no JSON is written under --out; the first run's folder is gone. A
    run that fails before writing anything leaves no folder and says so."""
    import shutil

    profile_run, seen = _fake_run_all(monkeypatch, fail_on=2)
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as e:
        profile_run.main(["--repeat", "3", "--out", str(out), "--", "MODEL=m"])
    msg = str(e.value.code)
    kept = seen[1][0].parent
    try:
        assert "rc=1" in msg and f"kept in {kept}" in msg and "boom" in msg
        assert f"run 2 of 3; runs before it: 0 s; nothing written to {out}" in msg
        assert kept.is_dir() and not seen[0][0].parent.exists()
        assert len(seen) == 2 and not out.exists()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    profile_run, seen = _fake_run_all(monkeypatch, fail_on=1, write=False)
    with pytest.raises(SystemExit) as e:
        profile_run.main(["--out", str(out), "--", "MODEL=m"])
    assert "it wrote nothing;" in str(e.value.code) and not seen[0][0].parent.exists()
    assert f"run 1 of 1; nothing written to {out}" in str(e.value.code)


def test_profile_run_keep_with_repeat_gives_each_run_a_folder(monkeypatch, tmp_path):
    """--keep DIR --repeat 2: DIR/run_1 and DIR/run_2, both kept; a single run uses DIR; a
    relative --keep is taken from the current folder (run_all.sh runs in the project root)."""
    profile_run, seen = _fake_run_all(monkeypatch)
    keep = tmp_path / "k"
    profile_run.main(["--repeat", "2", "--keep", str(keep), "--out", str(tmp_path / "a.json"),
                      "--", "MODEL=m"])
    assert [a.parent for a, _ in seen] == [keep / "run_1", keep / "run_2"]
    assert all((a.parent / "results" / "m" / "ort_fp32.json").is_file() for a, _ in seen)
    monkeypatch.chdir(tmp_path)
    profile_run.main(["--keep", "one", "--out", "b.json", "--", "MODEL=m"])
    assert seen[-1][0] == tmp_path / "one" / "artifacts" and seen[-1][0].is_dir()
    assert (tmp_path / "b.json").is_file()


@pytest.mark.parametrize("argv,says", [
    (["--limit-run", "0"], "--limit-run: must be an integer >= 1 (got 0)"),
    (["--limit-run", "-3"], "--limit-run"),
    (["--out", "{tmp}"], "is a folder: give a file name"),
    (["--out", "{tmp}/afile/x.json"], "(not a folder); give another path"),
    (["--out", "/proc/x.json"], "cannot write in /proc"),
    (["--out", "/dev/null"], "--out /dev/null is not a regular file"),
    (["--keep", "{tmp}/k", "--out", "{tmp}/k/run_1/o.json"], "is inside --keep"),
    (["--keep", "{tmp}/k", "--out", "{tmp}/k"], "is inside --keep"),
    (["--keep", "/proc/k"], "--keep /proc/k: cannot make it"),
    (["--keep", "{tmp}/afile"], "is a file: give a new or empty folder"),
    (["--keep", "{tmp}/full"], "is not empty"),
    (["--", "MODEL=m", "RESULTS=/x"], "RESULTS after --: each run gets its own scratch folder"),
    (["--results", "{tmp}"], "--results: only with --parse"),
    (["--parse", "{tmp}/afile", "--results", "{tmp}", "--keep", "{tmp}/k"],
     "--keep: for runs this script starts, not with --parse"),
    (["--parse", "{tmp}/afile", "--results", "{tmp}/nope"], "--results"),
])
def test_profile_run_refuses_what_would_fail_after_the_runs(monkeypatch, tmp_path, capsys,
                                                           argv, says):
    """Flags that used to fail only after minutes of runs (an --out that cannot be written),
    to start a different run than asked (--limit-run 0 ran the full run), or to mix another
    run's rows into the profile (a non-empty --keep): usage errors (exit 2) before any run."""
    profile_run, seen = _fake_run_all(monkeypatch)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.json").write_text("{}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--out" not in argv:
        argv = ["--out", str(tmp_path / "o.json")] + argv
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as e:
        profile_run.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not seen and sorted(tmp_path.rglob("*")) == before, "something was made"


def test_profile_run_interrupted_removes_its_temporary_folder(monkeypatch, tmp_path, capsys):
    """Ctrl-C (or SIGTERM) during a run: exit 130 with one line naming the run; the temporary
    scratch folder goes; nothing is written."""
    profile_run, seen = _fake_run_all(monkeypatch)
    fake = profile_run._run_group

    def interrupted(cmd, env):
        fake(cmd, env)  # the fake writes its folders first
        raise KeyboardInterrupt

    monkeypatch.setattr(profile_run, "_run_group", interrupted)
    with pytest.raises(SystemExit) as e:
        profile_run.main(["--out", str(tmp_path / "p.json"), "--", "MODEL=m"])
    assert e.value.code == 130 and "interrupted in run 1 of 1" in capsys.readouterr().err
    assert seen and not seen[0][0].parent.exists() and not (tmp_path / "p.json").exists()


def _interrupting_popen(profile_run, ready: "Path", seen: dict):
    """A Popen whose first communicate() waits for ``ready`` and raises KeyboardInterrupt (a
    Ctrl-C while profile_run waits for run_all.sh); its wait() records the handlers of the stop
    signals at that moment in ``seen``."""
    import signal
    import time

    real = profile_run.subprocess.Popen

    class Interrupting(real):
        calls = 0

        def communicate(self, *a, **kw):
            Interrupting.calls += 1
            seen["pgid"] = self.pid
            if Interrupting.calls == 1:
                deadline = time.time() + 10
                while not ready.exists() and time.time() < deadline:
                    time.sleep(0.05)  # the script's traps are set before it writes this
                raise KeyboardInterrupt
            return super().communicate(*a, **kw)

        def wait(self, *a, **kw):
            seen.setdefault("handlers", {s: signal.getsignal(s) for s in
                                         profile_run.STOP_SIGNALS})
            return super().wait(*a, **kw)

    return Interrupting


def _group_gone(pgid: int) -> bool:
    import os
    import time

    for _ in range(100):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_profile_run_stops_the_whole_process_group_on_ctrl_c(monkeypatch, tmp_path):
    """run_all.sh runs in a process group of its own; a KeyboardInterrupt while waiting sends
    the group SIGINT (run_all.sh's trap runs), then SIGTERM to what is left (a background
    child, which non-interactive bash starts with SIGINT ignored: its TERM trap runs), and the
    interrupt goes on. A second Ctrl-C/SIGTERM/SIGHUP meanwhile is ignored; the handlers are
    back afterwards."""
    import os
    import signal
    import time

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_run

    got_int, got_term, ready = tmp_path / "int", tmp_path / "term", tmp_path / "ready"
    seen: dict = {}
    monkeypatch.setattr(profile_run.subprocess, "Popen",
                        _interrupting_popen(profile_run, ready, seen))
    script = (f"trap 'touch {got_int}; exit 130' INT; "
              f"( trap 'touch {got_term}; exit 143' TERM; sleep 30 & wait ) & "
              f"sleep 0.3; touch {ready}; wait")
    before = {s: signal.getsignal(s) for s in profile_run.STOP_SIGNALS}
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        profile_run._run_group(["bash", "-c", script], dict(os.environ))
    assert got_int.exists() and got_term.exists() and time.time() - t0 < 20
    assert _group_gone(seen["pgid"])
    assert all(h == signal.SIG_IGN for h in seen["handlers"].values()), seen["handlers"]
    assert {s: signal.getsignal(s) for s in profile_run.STOP_SIGNALS} == before


def test_profile_run_kills_what_ignores_sigint_and_sigterm(monkeypatch, tmp_path):
    """A group member that ignores SIGINT and SIGTERM is killed (SIGKILL) after the grace."""
    import os
    import time

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_run

    ready, seen = tmp_path / "ready", {}
    monkeypatch.setattr(profile_run.subprocess, "Popen",
                        _interrupting_popen(profile_run, ready, seen))
    monkeypatch.setattr(profile_run, "STOP_WAIT_S", 0.5)
    monkeypatch.setattr(profile_run, "TERM_GRACE_S", 0.5)
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        profile_run._run_group(["bash", "-c", f"trap '' INT TERM; touch {ready}; sleep 30"],
                               dict(os.environ))
    assert _group_gone(seen["pgid"]) and time.time() - t0 < 10


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_profile_run_sigterm_and_sighup_stop_it_as_ctrl_c_does(monkeypatch, tmp_path, capsys,
                                                               sig):
    """SIGTERM, and SIGHUP (a closed terminal no longer reaches run_all.sh in its own session),
    end the profile as Ctrl-C does: exit 128 + the signal's number, one line naming it,
    nothing written, the temporary folder removed, the handlers back."""
    import os
    import signal

    profile_run, seen = _fake_run_all(monkeypatch)
    fake, num = profile_run._run_group, getattr(signal, sig)

    def signalled(cmd, env):
        fake(cmd, env)
        os.kill(os.getpid(), num)
        return 0, ""  # not reached: the handler raises

    monkeypatch.setattr(profile_run, "_run_group", signalled)
    before = signal.getsignal(num)
    with pytest.raises(SystemExit) as e:
        profile_run.main(["--out", str(tmp_path / "p.json"), "--", "MODEL=m"])
    assert e.value.code == 128 + num
    assert f"stopped by {sig} in run 1 of 1" in capsys.readouterr().err
    assert not seen[0][0].parent.exists() and not (tmp_path / "p.json").exists()
    assert signal.getsignal(num) == before


def test_profile_run_source_names_the_checkout_and_its_changes(monkeypatch, tmp_path):
    """source_info: the commit and the changed or new files (a rename under its new name, a
    name with a space), not the outputs under results/ or benchmarks/results/; None for a
    folder that is not the top of a git checkout (a copy inside another repository)."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("no git here")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_run

    repo = tmp_path / "r"
    (repo / "results").mkdir(parents=True)
    (repo / "sub").mkdir()

    def git(*a):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo,
                       check=True, capture_output=True)

    (repo / "a.py").write_text("a\n")
    (repo / "results" / "r.json").write_text("{}\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "x")
    monkeypatch.setattr(profile_run, "ROOT", repo)
    clean = profile_run.source_info()
    assert len(clean["commit"]) == 40 and clean == {**clean, "dirty": False, "changed": []}
    git("mv", "a.py", "b c.py")
    (repo / "results" / "r.json").write_text("{1}\n")
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "p.json").write_text("{}\n")
    (repo / "kk" / "run_1").mkdir(parents=True)  # the tool's own --keep folder
    (repo / "kk" / "run_1" / "x.json").write_text("{}\n")
    (repo / "new.py").write_text("n\n")
    src = profile_run.source_info([repo / "kk"])
    assert src["dirty"] and sorted(src["changed"]) == ["b c.py", "new.py"]
    assert "kk/run_1/x.json" in profile_run.source_info()["changed"]
    git("add", "-A")
    git("commit", "-qm", "y")
    (repo / "b c.py").rename(repo / "d.py")  # renamed in the work tree only (" R")
    git("add", "-N", "d.py")
    assert profile_run.source_info([repo / "kk"])["changed"] == ["d.py"]
    monkeypatch.setattr(profile_run, "ROOT", repo / "sub")
    assert profile_run.source_info() is None
