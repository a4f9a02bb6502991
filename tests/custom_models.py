"""A user's own model for the ``--model package.module:factory`` path: not a classifier, two
inputs (an image-like tensor and a token tensor) and two outputs."""
import torch
from torch import nn


class TwoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.proj = nn.Linear(16, 8)
        self.head_a = nn.Linear(8, 4)
        self.head_b = nn.Linear(8, 2)

    def forward(self, image, tokens):
        f = self.conv(image).mean(dim=(2, 3))          # [B, 8]
        t = self.proj(tokens).relu().mean(dim=1)       # [B, 8]
        return self.head_a(f + t), self.head_b(f * t)


def two_head():
    torch.manual_seed(0)
    return TwoHead()


class NoBatchAxis(nn.Module):
    """A model whose output is a scalar: the mean over the whole batch (no batch axis)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x).mean()


def no_batch_axis():
    torch.manual_seed(0)
    return NoBatchAxis()


def raising_factory():
    """A factory that fails, for the message that names it."""
    raise RuntimeError("the factory broke on purpose")


def tiny_net():
    import torch

    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())


class ImageDepth(nn.Module):
    """Two inputs of different units: a normalised RGB image and a depth map in metres."""

    def __init__(self):
        super().__init__()
        self.rgb = nn.Conv2d(3, 8, 3, padding=1)
        self.depth = nn.Conv2d(1, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, image, depth):
        f = torch.relu(self.rgb(image) + self.depth(depth / 10.0))
        return self.head(f.mean((2, 3)))


def image_depth():
    torch.manual_seed(0)
    return ImageDepth()


class RawCounts(nn.Module):
    """Takes raw sensor counts (0..20000) and normalises them itself: x / 20000."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x / 20000.0)).mean((2, 3)))


def raw_counts():
    torch.manual_seed(0)
    return RawCounts()


class LogNet(nn.Module):
    """log of its input: finite outputs on positive samples, NaN on negative ones."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.log(x).mean((2, 3)))


def log_net():
    torch.manual_seed(0)
    return LogNet()


class LateAlias(nn.Module):
    """Reads a tensor again after an in-place ReLU overwrote it: in place it computes
    ``2 relu(x)``, out of place ``x + relu(x)``; the two agree on non-negative inputs only."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Conv2d(3, 4, 1)

    def forward(self, x):
        y = x + 0.0  # a tensor of its own, which the ReLU overwrites
        return self.head(y + self.act(y)).mean((2, 3))


def late_alias():
    torch.manual_seed(0)
    return LateAlias()
