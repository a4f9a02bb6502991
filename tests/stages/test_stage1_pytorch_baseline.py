"""Stage 1 (1_pytorch_baseline.py): bad model inputs, interruption during latency, custom models."""

from __future__ import annotations
import os
from pathlib import Path

import pytest

from deploykit.io import write_json
from deploykit.runners import TorchRunner

from tests.helpers.stages import ROOT, load_stage, run_stage
from tests.helpers.artifacts import _no_temporaries
from tests.helpers.images import _env


@pytest.mark.slow
def test_custom_model_wrong_inputs_is_usage_error(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    p = run_stage(["1_pytorch_baseline.py", "--model", "tests.custom_models:two_head",
                   "--input-shape", "image:1,3,16,16", "--iters", "1", "--warmup", "0"], env,
                  check=False)
    assert p.returncode == 2 and "--input-shape per forward() argument" in p.stderr
    assert "tokens" in p.stderr  # the missing argument is named


MODEL = "efficientnet_lite0"


# ------------------------------------------------------------------------------- stage 1
@pytest.mark.slow
def test_stage1_interrupted_during_latency_leaves_reference_and_row_as_they_were(
        env, monkeypatch):
    """Ctrl-C in the latency loop (after the accuracy pass): the earlier reference and the row
    that describes it stay untouched, and no temporary is left."""

    for k in ("ARTIFACTS", "RESULTS"):
        monkeypatch.setenv(k, env[k])
    ref = Path(env["ARTIFACTS"]) / MODEL / "ref_logits.npz"
    row = Path(env["RESULTS"]) / MODEL / "pytorch_fp32_cpu.json"
    write_json(row, {"status": "ok", "note": "the earlier run"})
    before = ref.read_bytes(), row.read_bytes()

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(TorchRunner, "time", interrupted)
    stage1 = load_stage("1_pytorch_baseline")
    args = stage1.get_args_parser().parse_args(["--model", MODEL, "--iters", "3",
                                                 "--warmup", "0"])
    with pytest.raises(KeyboardInterrupt):
        stage1.main(args)
    assert (ref.read_bytes(), row.read_bytes()) == before
    _no_temporaries(env["RESULTS"], env["ARTIFACTS"])


@pytest.mark.slow
def test_stage1_cli_messages_for_bad_model_inputs(tmp_path):
    """The same faults through a stage's command line: exit status and no traceback."""
    env = _env(tmp_path)
    base = ["1_pytorch_baseline.py", "--iters", "1", "--warmup", "0"]
    cases = [
        (["--model", "tests.custom_models:raising_factory", "--input-shape", "x:1,3"],
         1, "raised RuntimeError"),
        (["--model", "tests.custom_models:tiny_net", "--input-shape", "x:1,-3,8,8"],
         2, "every dimension must be >= 1"),
        (["--model", "tests.custom_models:tiny_net", "--input-shape", "x:1,3,8,8",
          "--weights", str(tmp_path)], 2, "is a folder"),
    ]
    for extra, rc, msg in cases:
        p = run_stage(base + extra, env, check=False)
        assert p.returncode == rc and msg in p.stderr, (extra, p.stderr[-2000:])
        assert "Traceback" not in p.stderr


def test_stage1_refuses_a_model_whose_samples_interact(tmp_path, monkeypatch):
    """A BatchNorm that normalises with the batch's statistics even in eval()
    (track_running_stats=False): no reference exists (each batch size gives another one), so
    stage 1 refuses it as stage 2 does, naming the module and the fix; an earlier reference
    stays. The export check's batch-independence warning names the same module and fix."""
    import numpy as np
    import torch

    from deploykit.errors import StageError

    (tmp_path / "bnstats.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(\n"
        "        4, track_running_stats=False), torch.nn.Flatten(), torch.nn.LazyLinear(2)\n"
        "    ).eval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for k, v in (("ARTIFACTS", tmp_path / "a"), ("RESULTS", tmp_path / "r")):
        monkeypatch.setenv(k, str(v))
    ref = tmp_path / "a" / "bnstats-build" / "ref_outputs.npz"
    ref.parent.mkdir(parents=True)
    ref.write_bytes(b"the earlier reference")
    stage1 = load_stage("1_pytorch_baseline")
    args = stage1.get_args_parser().parse_args(
        ["--model", "bnstats:build", "--input-shape", "x:1,3,8,8", "--iters", "1",
         "--warmup", "0"])
    with pytest.raises(StageError, match=r"BatchNorm `1` \(BatchNorm2d\) uses batch statistics "
                                         r"\(track_running_stats=False\).*no reference written"):
        stage1.main(args)
    assert ref.read_bytes() == b"the earlier reference"

    import bnstats

    from deploykit.checks.export import check_batch_independence
    from deploykit.checks.batch_stats import batch_statistics_problem

    model = bnstats.build()
    x = np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        refs = {b: {"y": model(torch.from_numpy(x[:b])).numpy()} for b in (1, 4)}
    cause = batch_statistics_problem(model, "a file exported from it matches one batch only")
    (ind,) = check_batch_independence(refs, cause)
    assert ind["status"] == "warn" and "BatchNorm `1`" in ind["detail"]
    assert "track_running_stats=True" in ind["fix"] and "model.eval() before" not in ind["fix"]
    (plain,) = check_batch_independence(refs)  # no model to name: no misleading eval() advice
    assert plain["status"] == "warn" and "model.eval()" not in plain["fix"]
