"""Helpers for the export/FP16 tests: hand-built ONNX graphs and user model sources."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, TensorProto


torch = pytest.importorskip("torch")


# Models a user would write, as a module the stages import (package.module:factory).
MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class SqueezeHead(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3), keepdim=True).squeeze())


    class Shuffle(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)

        def forward(self, x):
            x = self.conv(x)
            b, c, h, w = x.shape
            b = int(b)
            x = x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)
            return self.fc(x.mean((2, 3)))


    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.head = nn.Linear(16, 2)

        def forward(self, x, m):
            return self.head(x[m])


    class PyIntIndex(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.head = nn.Linear(16, 2)

        def forward(self, x, m):
            i = int(m[0].nonzero()[0])
            return self.head(x[:, i])


    class Overflow(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(20)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)
            with torch.no_grad():
                self.conv.weight.mul_(40000.0)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x) * 1e-3).mean((2, 3)))


    class DecomposedLN(nn.Module):
        def __init__(self):
            super().__init__()
            off = torch.zeros(64)
            off[7] = 300.0
            self.register_buffer("off", off)

        def forward(self, x):
            x = x + self.off
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + 1e-5)


    class BigClamp(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(5)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.clamp(x, max=1e5))


    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


    def squeeze_head(): return SqueezeHead().eval()
    def shuffle(): return Shuffle().eval()
    def masked(): return Masked().eval()
    def pyint(): return PyIntIndex().eval()
    def overflow(): return Overflow().eval()
    def decomposed_ln(): return DecomposedLN().eval()
    def big_clamp(): return BigClamp().eval()
    def plain(): return Plain().eval()
''')


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name, shape, dt=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dt, shape)


def _by(results, check, status=None):
    return [r for r in results if r["check"] == check and (status is None
                                                           or r["status"] == status)]


# ------------------------------------------------------------------------------------------
# Export checks against PyTorch (hand-made exports)
# ------------------------------------------------------------------------------------------
def _legacy(model, example, path, names, dynamic=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(torch.from_numpy(v) for v in example.values()),
                          str(path), input_names=list(example), output_names=names,
                          opset_version=17, dynamo=False,
                          dynamic_axes={n: {0: "N"} for n in list(example) + names}
                          if dynamic else None)
    return path


# ------------------------------------------------------------------------------------------
# Feeding: static batch, --input-shape batch, FP16 inputs
# ------------------------------------------------------------------------------------------
def _static_b1(path: Path, batch=1) -> Path:
    rng = np.random.default_rng(26)
    w = numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32),
                                "w")
    big = numpy_helper.from_array(np.array(2e4, np.float32), "big")
    m = _model([helper.make_node("Conv", ["input", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
                helper.make_node("Mul", ["c", "big"], ["y"], name="amplify")],
               [_vi("input", [batch, 3, 8, 8])], [_vi("y", [batch, 8, 8, 8])], [w, big])
    onnx.save(m, str(path))
    return path
