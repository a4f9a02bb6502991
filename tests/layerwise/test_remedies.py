"""deploykit.layerwise.remedies: per-version TensorRT remedies and the FP16 remedy command."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from deploykit.checks.fp16 import convert_fp16
from deploykit.layerwise.diff import run_layer_diff
from deploykit.layerwise.remedies import trt_remedies
from deploykit.variants import variant_of_file

from tests.helpers.stages import ROOT
from tests.helpers.export_models import _legacy


torch = pytest.importorskip("torch")


# ------------------------------------------------------------------------------------------
# Remedies produce files the pipeline picks up
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_trt_fp16_remedy_command_writes_the_fp16_variant_the_pipeline_uses(user_models,
                                                                           tmp_path):

    _, mods = user_models
    m = mods.overflow()
    art = tmp_path / "a" / "mymodel"
    onnx_dir = art / "onnx"
    onnx_dir.mkdir(parents=True)
    x = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    _legacy(m, {"input": x}, onnx_dir / "fp32.onnx", ["output"])
    np.savez(art / "calib.npz", input=x)
    bad = onnx.load(str(onnx_dir / "fp32.onnx"))
    conv = next(n.name for n in bad.graph.node if n.op_type == "Conv")
    onnx.save(convert_fp16(bad)[0], str(onnx_dir / "fp16.onnx"))
    remedies = trt_remedies(conv, onnx_dir / "fp16.onnx", "fp16", "11.0.0")
    line = next(r for r in remedies if "export_checks.py' fp16" in r or "export_checks.py fp16" in r)
    cmd = line[line.index("cd "):line.index("  # then:")]
    assert "autocast" not in line
    p = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))  # pasted in another folder
    assert p.returncode == 0, p.stdout + p.stderr
    out = onnx_dir / "fp16.onnx"
    fixed = onnx.load(str(out))
    assert variant_of_file(out).name == "fp16"
    assert [i.type.tensor_type.elem_type for i in list(fixed.graph.input) +
            list(fixed.graph.output)] == [TensorProto.FLOAT, TensorProto.FLOAT]
    # The next stages take it: the layer-wise diff (ORT) and stage 6's command line.
    res = run_layer_diff(onnx_dir / "fp32.onnx", out, {"input": x})
    assert res["final_outputs"]["output"]["status"] == "pass"
    build = next(r for r in remedies if "6_build_engines.sh" in r).split("# then: ")[1]
    assert build.endswith("6_build_engines.sh --model mymodel fp16"), build
    p = subprocess.run(build.replace("6_build_engines.sh --model",
                                     "6_build_engines.sh --dry-run --trt-version 11.0.0 --model"),
                       shell=True, cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, RESULTS=str(tmp_path / "r")))  # ARTIFACTS: the line's
    assert p.returncode == 0 and str(out) in p.stdout, p.stdout + p.stderr


def test_trt_remedies_follow_version():
    r10 = trt_remedies("/head1/fc3/Gemm", "m.onnx", "fp16", "10.3.0")
    assert any("--layerPrecisions=/head1/fc3/Gemm:fp32" in r and "--precisionConstraints=obey"
               in r for r in r10)
    r11 = trt_remedies("/head1/fc3/Gemm", "m.onnx", "fp16", "11.0.0")
    cmds = [r for r in r11 if r.startswith("trtexec")]
    assert cmds and not any("--layerPrecisions=" in r or "--fp16" in r for r in cmds)
    assert any("strongly typed" in r for r in r11) and any("--noTF32" in r for r in r11)
