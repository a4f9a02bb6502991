"""layerwise.py (deploykit.tools.layerwise): the CLI, export-check delegation, input names."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit.tools import layerwise as layerwise_cli

from tests.helpers.stages import ROOT
from tests.helpers.export_models import _model, _vi


torch = pytest.importorskip("torch")
nn = torch.nn


@pytest.mark.slow
def test_layerwise_export_check_delegates(tmp_path, user_models):
    m = _model([helper.make_node("HardSigmoid", ["x"], ["y"], name="hsig_noattr")],
               [_vi("x", ["N", 64])], [_vi("y", ["N", 64])])
    onnx.save(m, str(tmp_path / "hs.onnx"))
    mod = tmp_path / "hsmod.py"
    mod.write_text("import torch\ndef build():\n    return torch.nn.Sequential("
                   "torch.nn.Hardsigmoid()).eval()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    p = subprocess.run([sys.executable, "layerwise.py", "export-check", "--model", "hsmod:build",
                        "--onnx", str(tmp_path / "hs.onnx"), "--input-shape", "x:1,64"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 1 and "hsig_noattr" in p.stdout and "alpha=1/6" in p.stdout


def test_tolerance_override_and_cli(token_model, tmp_path):
    _, path, feed = token_model
    np.savez(tmp_path / "feed.npz", **feed)
    args = layerwise_cli.get_args_parser().parse_args(
        ["diff", str(path), str(path), "--inputs", str(tmp_path / "feed.npz"),
         "--out-dir", str(tmp_path / "out"), "--min-cosine", "0.5", "--batch", "2"])
    res = layerwise_cli.main(args)
    assert res["tolerances"]["min_cosine"] == 0.5 and res["first_divergent"] is None
    assert (tmp_path / "out" / "layerwise.json").exists()


# ------------------------------------------------------------------------------- layerwise
def _relu_onnx(path: Path, name: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", [name], ["y"])], "r",
                          [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


@pytest.mark.slow
def test_layerwise_diff_with_different_input_names_says_how_to_map(tmp_path):
    a, b = _relu_onnx(tmp_path / "a.onnx", "x"), _relu_onnx(tmp_path / "b.onnx", "inp")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    base = [sys.executable, "layerwise.py", "diff", str(a), str(b), "--input-shape", "x:2,4"]
    import subprocess

    p = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "name their inputs differently" in p.stderr and "--map-input inp=x" in p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run(base + ["--map-input", "inp=x"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(base + ["--map-input", "nope=x"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "--map-input 'nope=x'" in p.stderr


def _scaled_relu(path, k: float):
    """x [N, 4] -> Mul(k) -> Relu -> y."""
    g = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["m"], name="scale"),
                           helper.make_node("Relu", ["m"], ["y"], name="relu")], "s",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                          [numpy_helper.from_array(np.array(k, np.float32), "k")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


def test_diff_exits_1_when_a_layer_diverges_like_diff1(tmp_path, capsys):
    """``layerwise.py diff`` exited 0 when it named a divergent layer: now 1 (after the table),
    0 when none diverges, 0 with --exit-zero; the --help says so."""
    from deploykit.tools.layerwise import cli_main, get_args_parser

    a = _scaled_relu(tmp_path / "a.onnx", 1.0)
    same = _scaled_relu(tmp_path / "same.onnx", 1.0)
    wrong = _scaled_relu(tmp_path / "wrong.onnx", -1.0)
    argv = ["--input-shape", "x:2,4"]
    parse = get_args_parser().parse_args
    res = cli_main(parse(["diff", str(a), str(same), *argv]))
    assert res["first_divergent"] is None
    with pytest.raises(SystemExit) as e:
        cli_main(parse(["diff", str(a), str(wrong), *argv]))
    assert e.value.code == 1
    err = capsys.readouterr()
    assert "DIVERGENT: " in err.err and "scale" in err.out  # the table came first
    assert cli_main(parse(["diff", str(a), str(wrong), *argv, "--exit-zero"]))["first_divergent"]
    sub = get_args_parser()._subparsers._group_actions[0].choices["diff"]
    assert "1 a divergent layer was found" in " ".join(sub.format_help().split())
