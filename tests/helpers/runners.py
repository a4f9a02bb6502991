"""Tiny torch/ONNX models and data for the runner tests."""

from __future__ import annotations

from pathlib import Path


def _tiny_torch():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(4, 10)).eval()


def _export(model, path: Path, batch: int | None = None) -> Path:
    """ONNX of ``model``; ``batch`` None = dynamic batch axis, else static."""
    import torch

    x = torch.zeros(batch or 2, 3, 8, 8)
    axes = None if batch else {"input": {0: "b"}, "logits": {0: "b"}}
    torch.onnx.export(model, (x,), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes=axes, dynamo=False, opset_version=17)
    return path
