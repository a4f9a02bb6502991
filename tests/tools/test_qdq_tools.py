"""qdq_tools.py (deploykit.tools.qdq_tools) run as a command: fix-int4-axis, list-depthwise, act-stats."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from deploykit.models import build_model
from deploykit.onnx.graph import attr, load_onnx
from deploykit.quant.inspect import activation_stats
from deploykit.quant.nodes import list_depthwise, list_stem

from tests.helpers.stages import ROOT, load_stage
from tests.helpers.auto_models import _save
from tests.helpers.export_models import _static_b1
from tests.helpers.quant_models import conv_model


@pytest.mark.slow
def test_act_stats_feeds_a_static_batch_one_sample_at_a_time_and_flags_fp16(tmp_path):
    path = _static_b1(tmp_path / "b1.onnx")
    np.savez(tmp_path / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (12, 3, 8, 8)).astype(np.float32))
    rows = {r["tensor"]: r for r in activation_stats(path, tmp_path / "calib.npz",
                                                                batch=10)}
    assert rows["y"]["fp16"] == "overflow" and rows["c"]["fp16"] is None
    p = subprocess.run([sys.executable, "qdq_tools.py", "act-stats", str(path), "--calib",
                        str(tmp_path / "calib.npz")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "OVERFLOW" in p.stdout, p.stderr


int4 = load_stage("5b_quantize_int4")


@pytest.mark.slow
def test_fix_int4_axis_cli_check_and_repair(modelopt_int4_models, tmp_path):
    src = modelopt_int4_models["gemm_q"]
    chk = subprocess.run([sys.executable, "qdq_tools.py", "fix-int4-axis", "--check", str(src)],
                         cwd=ROOT, capture_output=True, text=True)
    assert chk.returncode == 1 and "mismatch" in chk.stdout
    out = tmp_path / "fixed.onnx"
    fix = subprocess.run([sys.executable, "qdq_tools.py", "fix-int4-axis", str(src), "-o",
                          str(out)], cwd=ROOT, capture_output=True, text=True)
    assert fix.returncode == 0 and "repaired 1 node" in fix.stdout, fix.stderr
    ok = subprocess.run([sys.executable, "qdq_tools.py", "fix-int4-axis", "--check", str(out)],
                        cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0


# --------------------------------------------------------------------------------------------
# list-depthwise / list-stem
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mnv3_random_onnx(tmp_path_factory):
    """MobileNetV3-Small, random init (structure only), legacy exporter (fast)."""
    import torch

    model, _ = build_model("mobilenet_v3_small", pretrained=False)
    n_grouped = sum(1 for m in model.modules()
                    if isinstance(m, torch.nn.Conv2d) and m.groups > 1)
    path = tmp_path_factory.mktemp("mnv3") / "fp32.onnx"
    torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(path), input_names=["input"],
                      output_names=["logits"], opset_version=17, dynamo=False)
    return path, n_grouped


@pytest.mark.slow
def test_list_depthwise_finds_the_11_of_mobilenet_v3_small(mnv3_random_onnx):
    path, n_grouped = mnv3_random_onnx
    assert n_grouped == 11  # torchvision's module tree: the reference count
    model = load_onnx(path)
    dw = list_depthwise(model)
    assert len(dw) == 11 and all(d["depthwise"] for d in dw)
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert {d["name"] for d in dw} == {n.name for n in convs if attr(n, "group", 1) > 1}
    out = subprocess.run([sys.executable, "qdq_tools.py", "list-depthwise", "--names-only",
                          "--expect", "11", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == [d["name"] for d in dw]
    stem = list_stem(model)
    assert len(stem) == 1 and stem[0]["name"] == convs[0].name and stem[0]["group"] == 1


@pytest.mark.slow
def test_list_depthwise_expect_mismatch_fails(mnv3_random_onnx):
    out = subprocess.run([sys.executable, "qdq_tools.py", "list-depthwise", "--expect", "12",
                          str(mnv3_random_onnx[0])], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "found 11, expected 12" in out.stderr


@pytest.mark.slow
def test_list_depthwise_grouped_vs_depthwise_and_anchored_names(tmp_path):
    path = _save(conv_model(), tmp_path / "m.onnx")
    dw = list_depthwise(load_onnx(path))
    assert [(d["name"], d["depthwise"]) for d in dw] == [("dw", True), ("grouped", False)]
    out = subprocess.run([sys.executable, "qdq_tools.py", "list-depthwise", "--names-only",
                          "--anchored", str(path)], cwd=ROOT, capture_output=True, text=True)
    pats = out.stdout.split()
    assert pats == ["^dw$", "^grouped$"]
    # ModelOpt matches --nodes_to_exclude with re.match: anchoring stops prefix hits.
    assert re.match("node_Conv_77", "node_Conv_775") and not re.match("^node_Conv_77$",
                                                                       "node_Conv_775")
