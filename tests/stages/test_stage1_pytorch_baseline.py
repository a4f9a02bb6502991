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
