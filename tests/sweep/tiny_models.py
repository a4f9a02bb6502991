"""Tiny model factories for the sweep tests (``MODEL=tests.sweep.tiny_models:tiny_cnn``).

``tiny_cnn`` is a seeded 3x16x16 -> 10 classifier-shaped CNN that runs every stage of a custom
model in seconds; ``broken`` fails on purpose when the pipeline builds it (stage 1), so a sweep
shows that one pipeline's failure stays its own.
"""
import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean(dim=(2, 3)))


def tiny_cnn():
    torch.manual_seed(0)
    return TinyCNN()


def broken():
    raise RuntimeError("tiny_models.broken: this factory fails on purpose (sweep test)")
