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
