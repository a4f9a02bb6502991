"""A user's own model for the smoke-run benchmark (issue 21's "user's resnet18-sized factory"):
torchvision's ResNet-18 architecture behind a ``package.module:factory`` spec, seeded random
weights (latency and parity only; no accuracy claim).

    python benchmarks/profile_run.py --limit-run 64 -- MODEL=smoke_models:resnet18 \\
        PYTHONPATH="$PWD/benchmarks" \\
        PREPROCESS=mean=0.485,0.456,0.406,std=0.229,0.224,0.225,resize=256,crop=224,interpolation=bilinear
"""
from __future__ import annotations


def resnet18():
    """ResNet-18 (11.7 M parameters, input float32 ``[N, 3, 224, 224]``, logits ``[N, 1000]``),
    weights drawn from ``torch.manual_seed(0)``: the same model in every stage and run."""
    import torch
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None).eval()
