"""trt_tools.py (deploykit.tools.trt_tools): imports without TensorRT, detect without trtexec."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.stages import ROOT


@pytest.mark.slow
def test_trt_modules_import_no_tensorrt():
    code = ("import sys, trt_tools, deploykit.trt.rules, deploykit.trt.profiles, "
            "deploykit.trt.commands, deploykit.trt.plans, deploykit.trt.detect, "
            "deploykit.trt.parsers, deploykit.trt.onnx_prep; "
            "assert 'tensorrt' not in sys.modules; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr


@pytest.mark.slow
def test_detect_command_runs_without_trtexec(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))
    env.pop("TRTEXEC", None)
    p = subprocess.run([sys.executable, "trt_tools.py", "detect"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert "trtexec" in out and "jetson" in out
