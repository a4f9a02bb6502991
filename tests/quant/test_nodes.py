"""deploykit.quant.nodes: depthwise convolutions of a real model."""

from __future__ import annotations

from deploykit.models import build_model
from deploykit.onnx.graph import load_onnx
from deploykit.quant.nodes import list_depthwise


def test_efficientnet_lite0_depthwise_count(tmp_path):
    """Structure only (random init, legacy exporter for speed): one depthwise conv per MBConv
    block, 16 in all."""
    import torch

    model, _ = build_model("efficientnet_lite0", pretrained=False)
    path = tmp_path / "lite0.onnx"
    torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(path), input_names=["input"],
                      output_names=["logits"], opset_version=17, dynamo=False)
    dw = list_depthwise(load_onnx(path, external=False))
    assert len(dw) == 16 and all(d["depthwise"] for d in dw)
