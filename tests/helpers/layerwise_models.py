"""Small torch models (and their ONNX exports) for the layer-wise tests."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import pytest


torch = pytest.importorskip("torch")
nn = torch.nn


# ------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------
class Head(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.fc1, self.act1 = nn.Linear(d, d), nn.ReLU()
        self.fc2, self.act2 = nn.Linear(d, d), nn.ReLU()
        self.fc3 = nn.Linear(d, 2)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


class TokenHeads(nn.Module):
    """``[B, T, 256]`` -> three ``[B, 2]`` outputs, head i reading token row ``ROWS[i]``."""

    ROWS = (0, 3, 5)

    def __init__(self):
        super().__init__()
        self.head0, self.head1, self.head2 = Head(), Head(), Head()

    def forward(self, x):
        return tuple(h(x[:, r]) for h, r in zip((self.head0, self.head1, self.head2), self.ROWS))


class SE(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.act = nn.Conv2d(c, c // 4, 1), nn.ReLU()
        self.fc2, self.gate = nn.Conv2d(c // 4, c, 1), nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.fc2(self.act(self.fc1(self.pool(x)))))


class SECNN(nn.Module):
    def __init__(self, flatten_bug: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.se1 = SE(16)
        self.conv2 = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), nn.BatchNorm2d(32), nn.ReLU())
        self.se2 = SE(32)
        self.head = nn.Linear(32, 10)
        self.flatten_bug = flatten_bug

    def forward(self, x):
        x = self.se2(self.conv2(self.se1(self.stem(x))))
        if self.flatten_bug:  # the classic: int(x.shape[0]) freezes the export batch into a Reshape
            x = x.reshape(int(x.shape[0]), x.shape[1], -1).mean(2)
        else:
            x = x.mean((2, 3))
        return self.head(x)


def _init_bn(model):
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def export(model, example, path: Path, input_name: str, output_names):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=17,
                          input_names=[input_name], output_names=list(output_names),
                          dynamic_axes={input_name: {0: "batch"},
                                        **{o: {0: "batch"} for o in output_names}})
    return path


def _copy_with(path: Path, dst: Path, edit) -> Path:
    m = onnx.load(str(path))
    edit(m)
    onnx.save(m, str(dst))
    return dst
