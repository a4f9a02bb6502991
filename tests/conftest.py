"""Shared fixtures: a prepared artifacts folder on the embedded real images, built once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_stage(args: list[str], env: dict, check: bool = True, timeout: int = 900
              ) -> subprocess.CompletedProcess:
    """Run a stage script as a user would (own process), return the completed process."""
    cmd = [sys.executable] + args if args[0].endswith(".py") else args
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="session")
def stage_env(tmp_path_factory) -> dict:
    """Environment with private ARTIFACTS/RESULTS in which stage 0 has run on the embedded data
    for EfficientNet-Lite0 (real weights, offline)."""
    base = tmp_path_factory.mktemp("pipeline")
    env = dict(os.environ, ARTIFACTS=str(base / "artifacts"), RESULTS=str(base / "results"),
               MODEL="efficientnet_lite0", PYTHONPATH=str(ROOT))
    env.pop("VAL_ROOT", None)
    run_stage(["0_prepare_data.py", "--model", "efficientnet_lite0"], env)
    return env
