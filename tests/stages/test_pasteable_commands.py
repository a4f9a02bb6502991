"""Printed commands paste back (issue 20): a factory model in a folder whose name has a space and
``$(touch x)``, run from that folder with relative --inputs/--labels; the rerun command a row
records (what the report's "Stale rows" prints) and stage 3's "rerun stage 1" hint run with
bash from another folder, rerun the same thing, and never run the ``$(...)``."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from deploykit.layout import model_tag
from tests.helpers.stages import ROOT

FACTORY = '''import torch
from torch import nn


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 6))
'''


def _env(tmp, weird):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MODEL", "VAL_ROOT")}
    env.update(ARTIFACTS=str(weird / "art"), RESULTS=str(weird / "res"))
    return env


@pytest.mark.slow
def test_printed_commands_paste_back_from_another_folder(tmp_path):
    weird = tmp_path / "my models $(touch x) 'q'"
    weird.mkdir()
    (weird / "f20mods.py").write_text(FACTORY)
    r = np.random.default_rng(0)
    np.savez(weird / "eval data.npz", input=r.standard_normal((6, 3, 8, 8)).astype(np.float32))
    np.save(weird / "labels.npy", r.integers(0, 6, 6))
    other = tmp_path / "elsewhere"
    other.mkdir()
    model = "f20mods:tiny"
    # the user's run: in their folder (the factory is found there), relative file names
    p = subprocess.run([sys.executable, str(ROOT / "1_pytorch_baseline.py"), "--model", model,
                        "--inputs", "eval data.npz", "--labels", "labels.npy",
                        "--iters", "2", "--warmup", "0"],
                       cwd=weird, env=_env(tmp_path, weird), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    row_path = weird / "res" / model_tag(model) / "pytorch_fp32_cpu.json"
    row = json.loads(row_path.read_text())

    from deploykit.results import rerun_command
    cmd = rerun_command(row["provenance"])
    words = shlex.split(cmd)
    assert words[:3] == ["cd", str(ROOT), "&&"] and str(weird / "eval data.npz") in words
    assert f"PYTHONPATH={weird}" in words  # the folder the factory's module was found in
    row_path.unlink()
    # pasted into a plain shell somewhere else, without the run's environment
    bare = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "MODEL", "ARTIFACTS", "RESULTS", "VAL_ROOT")}
    q = subprocess.run(["bash", "-c", cmd], cwd=other, env=bare, capture_output=True,
                       text=True, timeout=600)
    assert q.returncode == 0, cmd + "\n" + q.stdout + q.stderr
    again = json.loads(row_path.read_text())  # the same row, in the same RESULTS
    assert again["n_images"] == 6 and again["accuracy"] == row["accuracy"]
    assert again["provenance"]["args"]["inputs"].endswith("eval data.npz")

    # stage 3 given other inputs than stage 1's: its "rerun stage 1" hint pastes too
    from deploykit.data.user import check_same_inputs  # noqa: F401 (the hint's source)
    from deploykit.evaluate import custom_data
    from deploykit.errors import UsageError
    from deploykit.layout import ref_outputs_path
    np.savez(weird / "other.npz", input=np.zeros((6, 3, 8, 8), np.float32))
    env = _env(tmp_path, weird)
    old = {k: os.environ.get(k) for k in ("ARTIFACTS", "RESULTS", "PYTHONPATH", "MODEL")}
    cwd = os.getcwd()
    try:
        os.environ.update(ARTIFACTS=env["ARTIFACTS"], RESULTS=env["RESULTS"])
        os.environ.pop("PYTHONPATH", None)
        os.environ.pop("MODEL", None)
        os.chdir(weird)
        with pytest.raises(UsageError) as e:
            custom_data(ref_outputs_path(model), None, weird / "other.npz", model)
    finally:
        os.chdir(cwd)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    hint = str(e.value).split("so rerun ", 1)[1]
    q = subprocess.run(["bash", "-c", hint + " --iters 2 --warmup 0"], cwd=other, env=bare,
                       capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, hint + "\n" + q.stdout + q.stderr
    assert json.loads(row_path.read_text())["provenance"]["args"]["inputs"].endswith("other.npz")
    # no word of any command ran as a command substitution
    assert not list(tmp_path.rglob("x")) and not (ROOT / "x").exists()
