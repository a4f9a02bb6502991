"""deploykit.compat: the Python names the root tools held before the package layout stay
importable under the root names (``import layerwise; layerwise.trt_remedies(...)``)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from deploykit.compat import FORMER_NAMES

from tests.helpers.stages import ROOT


@pytest.mark.parametrize("root", sorted(FORMER_NAMES))
def test_every_former_name_resolves_to_the_object_of_its_module(root):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    mod = importlib.import_module(root)
    n = 0
    for where, names in FORMER_NAMES[root].items():
        for name in names:
            assert getattr(mod, name) is getattr(importlib.import_module(where), name)
            n += 1
    assert n >= 20
    with pytest.raises(AttributeError, match="deploykit.compat.FORMER_NAMES"):
        getattr(mod, "no_such_name")


def test_a_script_written_against_the_root_module_runs():
    """The call a user's script (and a public fault case) makes: the root module's function,
    from the repository root, in a fresh interpreter."""
    code = ("import layerwise, qdq_tools; "
            "print(*layerwise.trt_remedies('conv1', '/x/fp16.onnx', 'fp16', '11.0.0'), sep='\\n'); "
            "print(qdq_tools.calibration_plan.__module__)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "conv1" in p.stdout and "deploykit.quant.calibration" in p.stdout


def test_dir_lists_the_former_names():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    layerwise = importlib.import_module("layerwise")
    names = dir(layerwise)
    assert "trt_remedies" in names and "run_layer_diff" in names and "cli_main" in names
