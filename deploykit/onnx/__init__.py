"""ONNX graph utilities: queries (:mod:`.graph`) and capture of intermediate tensors (:mod:`.activations`).
"""
