"""TensorRT: version rules, shape profiles, trtexec command lines, plan diagnosis, detection,
log parsers and ONNX preparation for older parsers.
"""
