"""deploykit.layerwise.torch_vs_onnx: the first divergent module between PyTorch and ONNX."""

from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from deploykit.export import first_divergent_module
from deploykit.layerwise.torch_vs_onnx import torch_vs_onnx

from tests.helpers.layerwise_models import _copy_with
from tests.helpers.stages import load_stage


torch = pytest.importorskip("torch")
nn = torch.nn


# ------------------------------------------------------------------------------------------
# torch-vs-onnx: in-place activations after a folded BatchNorm (timm's BatchNormAct2d)
# ------------------------------------------------------------------------------------------
class _BNAct(nn.BatchNorm2d):
    """timm-style BatchNormAct2d: batch_norm -> drop (Identity) -> ReLU6(inplace=True)."""

    def __init__(self, c):
        super().__init__(c)
        self.drop, self.act = nn.Identity(), nn.ReLU6(inplace=True)

    def forward(self, x):
        x = nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight,
                                     self.bias, False, 0.0, self.eps)
        return self.act(self.drop(x))


class _ConvBNAct(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), _BNAct(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, groups=8), _BNAct(8)
        for bn in (self.bn1, self.bn2):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.bn2(self.conv2(self.bn1(self.conv1(x)))).mean((2, 3))


def test_torch_vs_onnx_no_false_divergence_with_inplace_activation(tmp_path):
    m = _ConvBNAct().eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    prog = torch.onnx.export(m, (torch.from_numpy(x),), input_names=["input"], dynamo=True,
                             opset_version=18, verbose=False)
    prog.save(str(tmp_path / "m.onnx"))
    res = torch_vs_onnx(m, tmp_path / "m.onnx", {"input": x})
    assert res["first_divergent"] is None, [(r["module"], r["compared_as"], r["cosine_min"])
                                            for r in res["modules"] if r["status"] == "fail"]
    assert any(r["module"] == "bn1.act" for r in res["modules"])


# ------------------------------------------------------------------------------------------
# PyTorch vs ONNX
# ------------------------------------------------------------------------------------------
def test_torch_vs_onnx_clean_and_faulty(cnn_model, tmp_path):
    m, path, feed = cnn_model
    res = torch_vs_onnx(m, path, feed)
    mods = {r["module"] for r in res["modules"]}
    assert {"stem.0", "se1.fc1", "se1.gate", "se2", "head"} <= mods
    assert res["first_divergent"] is None
    # stem.0 is compared after its folded BatchNorm.
    assert next(r for r in res["modules"] if r["module"] == "stem.0")["compared_as"] == "stem.1"

    def edit(mm):
        for t in mm.graph.initializer:
            if t.name == "se1.fc2.weight":
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * -1.0, t.name))

    bad = _copy_with(path, tmp_path / "bad.onnx", edit)
    res = torch_vs_onnx(m, bad, feed)
    assert res["first_divergent"]["module"] == "se1.fc2"
    assert next(r for r in res["modules"] if r["module"] == "se1.act")["status"] == "pass"


# --------------------------------------------------------------------------------------------
# torch-vs-onnx: a module whose input already differs is not the culprit
# --------------------------------------------------------------------------------------------
def test_first_divergent_module_whose_input_already_differs(tmp_path):
    """The error sits in the parent's forward between two modules (here a Mul constant of the
    export changed from 2 to 3): the first module whose output differs is ``fc``, but its input
    already differs. The verdict blamed ``fc`` ("look at how this module is exported")."""
    import warnings


    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)) * 2.0)

    model = Net().eval()
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 6, 6)).astype(np.float32)}
    path = tmp_path / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(feed["x"]),), str(path), input_names=["x"],
                          output_names=["y"], opset_version=17, dynamo=False)
    m = onnx.load(str(path))
    consts = {n.output[0]: n for n in m.graph.node if n.op_type == "Constant"}
    mul = next(n for n in m.graph.node if n.op_type == "Mul")
    c = next(i for i in mul.input if i in consts)
    consts[c].attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(3.0, np.float32)))
    onnx.save(m, str(path))

    res = torch_vs_onnx(model, path, feed)
    fd = res["first_divergent"]
    assert fd["module"] == "fc" and fd["inputs_agree"] is False, fd
    assert fd["input_node"] == mul.name, fd
    (r,) = first_divergent_module(model, path, feed)
    assert r["node"] == mul.name and "input already differs" in r["detail"], r
    assert "look at how this module is exported" not in (r["fix"] or ""), r
