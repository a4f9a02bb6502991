"""deploykit.export (stage 2's procedure) and deploykit.model_errors.forward_error: the model
features named before anything is exported, and the FP16 candidate's failure messages."""
from __future__ import annotations

import shlex
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from deploykit.checks.base import check_result
from deploykit.errors import StageError, UsageError
from deploykit.layout import ROOT
from deploykit.export import (
    check_batch_statistics,
    fp16_candidate_error,
    fp16_rejected_warning,
    no_fp16_command,
)
from deploykit.model_errors import forward_error

torch = pytest.importorskip("torch")
nn = torch.nn


class _Net(nn.Module):
    def __init__(self, norm=None, cin=3):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(cin, 4, 3)
        self.bn1 = norm if norm is not None else nn.Identity()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn1(self.conv(x))).mean((2, 3))


def test_batch_statistics_bn_named_before_export():
    check_batch_statistics(_Net(nn.BatchNorm2d(4)).eval())  # running statistics: fine
    with pytest.raises(StageError, match=r"^BatchNorm `bn1` \(BatchNorm2d\) uses batch "
                                         r"statistics \(track_running_stats=False\)"):
        check_batch_statistics(_Net(nn.BatchNorm2d(4, track_running_stats=False)).eval())
    bn = nn.BatchNorm2d(4)
    bn.running_mean = bn.running_var = None  # pytorch/pytorch#75252: batch stats in eval()
    with pytest.raises(StageError, match="its running statistics are None.*GroupNorm"):
        check_batch_statistics(_Net(bn).eval())
    with pytest.raises(StageError, match="`bn1` .*it is in training mode"):
        check_batch_statistics(_Net(nn.BatchNorm2d(4)).train())


def test_module_left_in_training_mode_named():
    m = _Net().eval()
    m.drop.train()  # a model that sets .training itself
    with pytest.raises(StageError, match=r"module `drop` \(Dropout\) is in training mode"):
        check_batch_statistics(m)


def test_modules_whose_training_mode_changes_nothing_are_no_reason_to_refuse():
    """A Conv left in training mode (a frozen encoder whose train() is a no-op) or a Dropout
    with p 0 compute the same in either mode: no refusal; the Dropout with p 0.5 is named."""
    m = _Net().eval()
    m.conv.train()
    check_batch_statistics(m)
    m.drop = nn.Dropout(0.0).train()
    check_batch_statistics(m)
    m.drop = nn.Dropout(0.5).train()
    with pytest.raises(StageError, match=r"module `drop` \(Dropout\) is in training mode"):
        check_batch_statistics(m)


def _raise(model, x):
    try:
        model(torch.from_numpy(x))
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("forward() did not raise")


def test_forward_error_names_the_shape_given_and_the_first_layer():
    m = _Net().eval()
    x = np.zeros((2, 4, 8, 8), np.float32)
    err = forward_error("pkg:net", m, {"x": x}, _raise(m, x), given=["x:1,4,8,8"])
    assert isinstance(err, UsageError)
    msg = str(err)
    assert "--input-shape x:1,4,8,8 (run at batch 2)" in msg and "\n" not in msg
    assert "the first layer conv (Conv2d) expects 3 channels on axis 1, the input has 4" in msg
    assert "RuntimeError: " in msg


def test_forward_error_of_the_models_own_code_is_a_stage_error():
    class Boom(_Net):
        def forward(self, x):
            raise ValueError("no such head")

    m = Boom().eval()
    x = np.zeros((2, 3, 8, 8), np.float32)
    err = forward_error("pkg:boom", m, {"x": x}, _raise(m, x))
    assert isinstance(err, StageError) and not isinstance(err, UsageError)
    assert "ValueError: no such head" in str(err) and "test_export.py:" in str(err)
    assert "x:2,3,8,8:float32" in str(err) and "expects" not in str(err)


def test_fp16_candidate_error_names_the_node_and_the_mixed_input_types(tmp_path):
    """A file ORT refuses with a type error: the row names the node, its op and which input is
    float32 (a graph output) next to float16."""
    import onnxruntime as ort

    g = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["h"], name="c16", to=TensorProto.FLOAT16),
         helper.make_node("Add", ["h", "x"], ["y"], name="add")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 2])])
    path = tmp_path / "fp16.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    with pytest.raises(Exception) as ei:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    row = fp16_candidate_error(ei.value, path)
    assert row["status"] == "fail" and row["check"] == "fp16_convert" and row["node"] == "add"
    assert "node add (Add) reads h (float16), x (float, a graph input)" in row["detail"]
    assert "FP16 candidate fp16.onnx" in row["detail"] and "--no-fp16" in row["fix"]


def test_fp16_rejected_warning_first_line_and_commands(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["2_export_onnx.py", "--model", "a b:c",
                                      "--fp16-keep-fp32", "n1", "--min-cosine-fp16", "0.99"])
    for var in ("ARTIFACTS", "RESULTS", "PREPROCESS", "PYTHONPATH", "MODEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    skip = no_fp16_command()
    # pasteable from any folder: cd into the root, absolute script, every word quoted
    words = shlex.split(skip)
    assert words[:3] == ["cd", str(ROOT), "&&"]
    assert words[-4:] == [str(ROOT / "2_export_onnx.py"), "--model", "a b:c", "--no-fp16"]
    assert f"PYTHONPATH={tmp_path}" in words  # where the factory's module was found
    # where the stage ran (a smoke run's folders) and the factory's import path travel with it
    monkeypatch.setenv("ARTIFACTS", "/x/my art/smoke")
    monkeypatch.setenv("PYTHONPATH", "/u/mods")
    words = shlex.split(no_fp16_command())
    assert "ARTIFACTS=/x/my art/smoke" in words and f"PYTHONPATH=/u/mods:{tmp_path}" in words
    monkeypatch.delenv("ARTIFACTS")
    monkeypatch.delenv("PYTHONPATH")
    rows = [check_result("batch_parity", "fail", "ORT CPU EP (...blind to FP16 overflow): bad"),
            check_result("fp16_range", "fail", "tensor t > 65504", node="conv")]
    text = fp16_rejected_warning(rows, tmp_path / "fp16.onnx", tmp_path / "export.json",
                                 "python 2_export_onnx.py --fp16-keep-fp32 conv", skip)
    first = text.splitlines()[0]
    assert first.startswith("WARNING: FP16 candidate rejected, fp16.onnx not installed "
                            "(fp16_range at conv: tensor t > 65504)")
    assert "fp32.onnx passed and is installed" in first and "--no-fp16 skips FP16" in first
    assert "fix (keep those nodes in FP32): python 2_export_onnx.py --fp16-keep-fp32 conv" in text
    assert text.splitlines()[-1] == f"or skip FP16 (FP32 only): {skip}"


# --------------------------------------------------------------------------------------------
# out_of_place: in-place modules traced out of place when that changes no output
# --------------------------------------------------------------------------------------------
def _seeded(cls, *a):
    with torch.random.fork_rng():  # the global RNG stays as it was
        torch.manual_seed(0)
        return cls(*a).eval()


class _InplaceNet(nn.Module):
    """Conv -> ReLU6(inplace) -> Conv -> ReLU(inplace); it never reads an overwritten tensor."""

    def __init__(self):
        super().__init__()
        self.c1, self.a1 = nn.Conv2d(3, 4, 3), nn.ReLU6(inplace=True)
        self.c2, self.a2 = nn.Conv2d(4, 4, 1), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.a2(self.c2(self.a1(self.c1(x)))).mean((2, 3))


class _AliasNet(nn.Module):
    """Reads the activation's input again: in place 2 * relu(y), out of place y + relu(y)."""

    def __init__(self):
        super().__init__()
        self.c, self.act = nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.c(x)
        z = self.act(y)
        return (y + z).mean((2, 3))


class _InputAlias(nn.Module):
    """Overwrites the caller's input in place, then reads it again."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return (self.act(x) + x).mean((2, 3))


class _BufferOut(nn.Module):
    """Returns a buffer it overwrites at each call (a later call changes an earlier output)."""

    def __init__(self):
        super().__init__()
        self.lin, self.act = nn.Linear(8, 4), nn.ReLU(inplace=True)
        self.register_buffer("out", torch.zeros(3, 4))

    def forward(self, x):
        y = self.lin(x.mean((1, 2)))
        z = self.act(y)
        self.out.copy_(y + z)
        return self.out


class _OwnAct(nn.Module):
    """A user's class with an ``inplace`` attribute: never switched."""

    def __init__(self):
        super().__init__()
        self.inplace = True

    def forward(self, x):
        return x.clamp_(min=0) if self.inplace else x.clamp(min=0)


def _x(seed=1, low=None):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(3, 3, 8, 8, generator=g) if low == 0
             else torch.randn(3, 3, 8, 8, generator=g)),)


def test_out_of_place_switches_torch_activations_and_restores_them():
    from deploykit.export import out_of_place

    m = _seeded(_InplaceNet)
    ref = m(*_x())
    with out_of_place(m, _x()) as n:
        assert n == 2
        assert not m.a1.inplace and not m.a2.inplace
        assert torch.equal(m(*_x()), ref)
    assert m.a1.inplace and m.a2.inplace


@pytest.mark.parametrize("cls", [_AliasNet, _InputAlias])
def test_out_of_place_keeps_flags_when_the_model_reads_an_overwritten_tensor(cls):
    """Out of place would change what the model computes: an intermediate tensor, or the
    caller's own input (each forward pass of the check gets its own copy of the inputs)."""
    from deploykit.export import out_of_place

    m = _seeded(cls)
    x = _x()
    x0 = x[0].clone()
    with out_of_place(m, x) as n:
        assert n == 0
        assert m.act.inplace
    assert m.act.inplace
    assert torch.equal(x[0], x0)  # the check never ran the model on the caller's tensors


def test_out_of_place_copies_outputs_that_a_later_call_overwrites():
    from deploykit.export import out_of_place

    m = _seeded(_BufferOut)
    with out_of_place(m, _x()) as n:
        assert n == 0 and m.act.inplace


def test_out_of_place_checks_every_input_set():
    """Non-negative example inputs hide the aliasing; the check samples show it."""
    from deploykit.export import out_of_place

    m = _seeded(_InputAlias)
    with out_of_place(m, _x(low=0)) as n:
        assert n == 1  # on these inputs the two ways agree
    with out_of_place(m, _x(low=0), [_x(seed=2)]) as n:
        assert n == 0 and m.act.inplace


def test_out_of_place_leaves_training_mode_models_and_own_classes_alone():
    from deploykit.export import inplace_modules, out_of_place

    m = _seeded(_InplaceNet).train()
    with out_of_place(m, _x()) as n:
        assert n == 0 and m.a1.inplace
    own = nn.Sequential(nn.Conv2d(3, 4, 3), _OwnAct()).eval()

    class MyReLU(nn.ReLU):  # a user's subclass of a torch.nn activation: the user's class
        pass

    sub = nn.Sequential(nn.Conv2d(3, 4, 3), MyReLU(inplace=True)).eval()
    assert inplace_modules(own) == [] and inplace_modules(sub) == []
    with out_of_place(own, _x()) as n:
        assert n == 0 and own[1].inplace


def test_out_of_place_restores_flags_when_the_block_or_the_check_is_interrupted(monkeypatch):
    from deploykit.export import out_of_place

    m = _seeded(_InplaceNet)
    with pytest.raises(RuntimeError):
        with out_of_place(m, _x()):
            raise RuntimeError("exporter failed")
    assert m.a1.inplace and m.a2.inplace
    calls = []
    real = _InplaceNet.forward

    def interrupted(self, x):
        calls.append(1)
        if len(calls) == 2:  # the check's out-of-place pass
            raise KeyboardInterrupt
        return real(self, x)

    monkeypatch.setattr(_InplaceNet, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with out_of_place(m, _x()):
            pass
    assert m.a1.inplace and m.a2.inplace


def test_export_fp32_out_of_place_gives_the_same_graph(tmp_path, monkeypatch):
    """The dynamo export of a model with in-place activations: the same ops and initializers
    as the export of the model as it is, and the model left as it was; the legacy exporter
    and allow_out_of_place=False switch nothing."""
    import deploykit.export as dx

    m = _seeded(_InplaceNet)
    ex = {"input": _x()[0].numpy()}
    _, _, n = dx.export_fp32(m, ex, tmp_path / "a.onnx", "dynamo", 18, ["out"])
    assert n == 2 and m.a1.inplace and m.a2.inplace
    _, _, n0 = dx.export_fp32(m, ex, tmp_path / "b.onnx", "dynamo", 18, ["out"],
                              allow_out_of_place=False)
    assert n0 == 0
    a, b = onnx.load(tmp_path / "a.onnx").graph, onnx.load(tmp_path / "b.onnx").graph
    assert [n.op_type for n in a.node] == [n.op_type for n in b.node]
    assert ({i.name: i.SerializeToString() for i in a.initializer}
            == {i.name: i.SerializeToString() for i in b.initializer})
    monkeypatch.setattr(dx, "out_of_place", None)  # never entered by the legacy exporter
    _, _, n1 = dx.export_fp32(m, ex, tmp_path / "c.onnx", "legacy", 17, ["out"])
    assert n1 == 0


def test_the_models_line_is_its_own_not_the_standard_librarys(tmp_path, monkeypatch):
    """exception_origin named json/decoder.py (the standard library) or <frozen importlib>
    as the model's line, a user's userpkg/common.py as common.py (the repository's own
    name), and crashed on an exception whose __str__ raises."""
    import importlib

    from deploykit.model_errors import exception_origin

    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "common.py").write_text(
        "import importlib, json\n\n"
        "def bad_json():\n    json.loads('{bad')\n\n"
        "def bad_import():\n    importlib.import_module('no_such_module_here')\n\n"
        "class Unprintable(Exception):\n"
        "    def __str__(self):\n        raise RuntimeError('no')\n\n"
        "def unprintable():\n    raise Unprintable()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("userpkg.common")
    for fn, line, text in ((mod.bad_json, 4, "Expecting property name"),
                           (mod.bad_import, 7, "No module named 'no_such_module_here'"),
                           (mod.unprintable, 14, "")):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            got = exception_origin(e)
        assert got == (got[0], f" at userpkg/common.py:{line}") and got[0].startswith(text), got
