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
