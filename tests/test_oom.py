"""Out-of-memory errors (issue 20): a real allocation failure of ONNX Runtime and of PyTorch
at a batch becomes one line naming the batch, the memory asked for and the fix."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from deploykit.errors import StageError, out_of_memory_message
from deploykit.runners import OrtRunner, TorchRunner


def _expand_model(tmp_path):
    """y = Expand(x [N, 1], [1, 2**36]): N * 256 GiB of float32, refused by the allocator at
    once (nothing is touched)."""
    g = helper.make_graph([helper.make_node("Expand", ["x", "s"], ["y"], name="expand")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [helper.make_tensor("s", TensorProto.INT64, [2], [1, 2**36])])
    path = tmp_path / "huge.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                       ir_version=8).SerializeToString())
    return path


def test_ort_allocation_failure_names_batch_memory_and_fix(tmp_path):
    with OrtRunner(_expand_model(tmp_path)) as r:
        with pytest.raises(StageError) as e:
            r.infer({"x": np.zeros((64, 1), np.float32)})
    msg = str(e.value)
    assert "\n" not in msg and "huge.onnx ran out of memory at batch 64" in msg
    assert "(it asked for 16.0 TiB)" in msg  # 64 * 2**36 * 4 bytes
    assert "rerun with a smaller batch (--batch-size 32" in msg


def test_torch_allocation_failure_names_batch_memory_and_fix():
    torch = pytest.importorskip("torch")

    class Huge(torch.nn.Module):
        def forward(self, x):
            return x.new_empty((x.shape[0], 2**44))  # 64 TiB per sample: refused at once

    r = TorchRunner(Huge().eval(), "cpu", ("y",))
    with pytest.raises(StageError) as e:
        r.infer({"x": np.zeros((8, 1), np.float32)})
    msg = str(e.value)
    assert "\n" not in msg and "ran out of memory at batch 8 (it asked for" in msg
    assert "TiB)" in msg and "--batch-size 4" in msg


def test_other_errors_are_not_called_out_of_memory():
    assert out_of_memory_message(RuntimeError("shape mismatch"), 8, "x") is None
    # PyTorch's CUDA allocator (c10/cuda/CUDACachingAllocator.cpp), as torch 2.x words it
    cuda = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.2 GiB is free.")
    assert "at batch 256 (it asked for 2.00 GiB)" in out_of_memory_message(cuda, 256, "PyTorch")
