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
def _fake_run_all(monkeypatch, fail_on: int | None = None):
    """profile_run.py with run_all.sh replaced by a fake that writes one row and prints two
    stage lines (the Nth call fails with ``fail_on``), and an instant host probe. Returns the
    list of (ARTIFACTS, RESULTS) folders the runs were given."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_run

    real = profile_run.subprocess.run
    seen: list[tuple[Path, Path]] = []

    def run(cmd, *a, **kw):
        if cmd[:2] != ["bash", "run_all.sh"]:
            return real(cmd, *a, **kw)  # git, for the source record
        art, res = Path(kw["env"]["ARTIFACTS"]), Path(kw["env"]["RESULTS"])
        seen.append((art, res))
        (res / "m").mkdir(parents=True)
        (art / "logs" / "m").mkdir(parents=True)
        (art / "logs" / "m" / "times.tsv").write_text(f"1_pytorch_baseline\t{len(seen)}.5\n")
        (res / "m" / "ort_fp32.json").write_text(json.dumps(
            {"tag": "ort_fp32", "timings_s": {"inference": 1.0 * len(seen)}}))
        rc = 1 if len(seen) == fail_on else 0
        out = f"Stage 0: finished [elapsed={len(seen)}s]\nStage 1: finished [elapsed=2s]\n"
        return subprocess.CompletedProcess(cmd, rc, out, "boom\n" if rc else "")

    monkeypatch.setattr(profile_run.subprocess, "run", run)
    monkeypatch.setattr(profile_run, "host_probe",
                        lambda seconds=0.5: {"matmul_per_s": 1.0, "copy_gb_s": 1.0})
    return profile_run, seen


def test_profile_run_repeat_records_every_run_and_their_median(monkeypatch, tmp_path, capsys):
    """--repeat 3: three runs, each in its own temporary scratch folder, removed afterwards;
    the JSON holds every run, the median and spread of the totals and of each stage and
    command, and the commit that ran."""
    import json

    profile_run, seen = _fake_run_all(monkeypatch)
    out = tmp_path / "p.json"
    profile_run.main(["--repeat", "3", "--out", str(out), "--", "MODEL=m"])
    d = json.loads(out.read_text())
    assert len(d["runs"]) == 3 and len(d["totals_s"]) == 3
    assert d["total_s"] == sorted(d["totals_s"])[1]
    assert d["summary"]["stage 0"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert d["summary"]["command 1_pytorch_baseline"]["max"] == 3.5
    assert [r["rows_s"]["ort_fp32"]["inference"] for r in d["runs"]] == [1.0, 2.0, 3.0]
    assert len({a for a, _ in seen}) == 3
    assert not any(a.parent.exists() for a, _ in seen), "temporary scratch folders left"
    src = d["source"]
    if src is not None:  # a git checkout
        assert len(src["commit"]) == 40 and src["dirty"] == bool(src["changed"])
        assert not any(c.startswith("results/") for c in src["changed"])
    text = capsys.readouterr().out
    assert "3 runs, median" in text and "stage 0: median 2.0 s (1.0-3.0)" in text


def test_profile_run_keeps_a_failed_runs_folder_and_writes_nothing(monkeypatch, tmp_path):
    """The second of three runs fails: the command exits naming its kept scratch folder and
    the first run's total; no JSON is written under --out; the first run's folder is gone."""
    profile_run, seen = _fake_run_all(monkeypatch, fail_on=2)
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as e:
        profile_run.main(["--repeat", "3", "--out", str(out), "--", "MODEL=m"])
    msg = str(e.value.code)
    kept = seen[1][0].parent
    assert "rc=1" in msg and str(kept) in msg and "boom" in msg
    assert f"runs before it: 0 s; nothing written to {out}" in msg
    assert kept.is_dir() and not seen[0][0].parent.exists()
    assert len(seen) == 2 and not out.exists()


def test_profile_run_keep_with_repeat_gives_each_run_a_folder(monkeypatch, tmp_path):
    """--keep DIR --repeat 2: DIR/run_1 and DIR/run_2, both kept; a single run uses DIR."""
    profile_run, seen = _fake_run_all(monkeypatch)
    keep = tmp_path / "k"
    profile_run.main(["--repeat", "2", "--keep", str(keep), "--out", str(tmp_path / "a.json"),
                      "--", "MODEL=m"])
    assert [a.parent for a, _ in seen] == [keep / "run_1", keep / "run_2"]
    assert all((a.parent / "results" / "m" / "ort_fp32.json").is_file() for a, _ in seen)
    profile_run.main(["--keep", str(tmp_path / "one"), "--out", str(tmp_path / "b.json"),
                      "--", "MODEL=m"])
    assert seen[-1][0] == tmp_path / "one" / "artifacts" and seen[-1][0].is_dir()


def test_profile_run_interrupted_removes_its_temporary_folder(monkeypatch, tmp_path):
    """Ctrl-C during a run: KeyboardInterrupt goes on, the temporary scratch folder goes."""
    profile_run, seen = _fake_run_all(monkeypatch)
    real = profile_run.subprocess.run

    def interrupted(cmd, *a, **kw):
        if cmd[:2] == ["bash", "run_all.sh"]:
            real(cmd, *a, **kw)  # the fake writes its folders first
            raise KeyboardInterrupt
        return real(cmd, *a, **kw)

    monkeypatch.setattr(profile_run.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        profile_run.main(["--out", str(tmp_path / "p.json"), "--", "MODEL=m"])
    assert seen and not seen[0][0].parent.exists() and not (tmp_path / "p.json").exists()
