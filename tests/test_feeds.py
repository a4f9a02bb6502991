"""Every npz a user gives (layer-wise / export ``--inputs``, ``--calib``) goes through the one
checked loader (deploykit.io.load_npz): object arrays, wrong dtypes, empty arrays, ranks and
sample counts that disagree, FIFOs, each a one-line error naming the file and the fix."""

from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from deploykit.errors import StageError, UsageError
from deploykit.feeds import load_feed


def _relu(path, dims=("N", 3, 4, 4)):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims))])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_load_feed_checks_rank_keys_and_contents(tmp_path):
    m = _relu(tmp_path / "m.onnx")
    np.savez(tmp_path / "ok.npz", whatever=np.zeros((2, 3, 4, 4), np.float32))
    assert load_feed(tmp_path / "ok.npz", None, 0, m)["x"].shape == (2, 3, 4, 4)
    np.savez(tmp_path / "rank.npz", x=np.zeros((3, 4, 4), np.float32))
    with pytest.raises(StageError, match=r"--inputs .*rank\.npz: array 'x' has rank 3 \(shape "
                                         r"\[3, 4, 4\]\); the model's input x has rank 4"):
        load_feed(tmp_path / "rank.npz", None, 0, m)
    np.savez(tmp_path / "obj.npz", x=np.array([None, 1], dtype=object))
    with pytest.raises(StageError, match=r"--calib .*obj\.npz: array 'x' is an object array"):
        load_feed(tmp_path / "obj.npz", None, 0, m, flag="--calib")
    np.savez(tmp_path / "two.npz", a=np.zeros((1, 3, 4, 4)), b=np.zeros((1, 3, 4, 4)))
    with pytest.raises(UsageError, match=r"--inputs .*two\.npz: keys \['a', 'b'\] lack model "
                                         r"inputs \['x'\]: name each array by its model input"):
        load_feed(tmp_path / "two.npz", None, 0, m)
    os.mkfifo(tmp_path / "fifo.npz")
    with pytest.raises(StageError, match=r"fifo\.npz is a FIFO \(named pipe\), not a regular"):
        load_feed(tmp_path / "fifo.npz", None, 0, m)


def test_export_inputs_uses_the_checked_loader(tmp_path):
    from deploykit.export import export_inputs

    np.savez(tmp_path / "s.npz", x=np.array(["a", "b"]))
    args = argparse.Namespace(inputs=tmp_path / "s.npz", check_images=4)
    with pytest.raises(StageError, match=r"--inputs .*s\.npz: array 'x' has dtype <U1 \(not "
                                         r"numeric\)"):
        export_inputs(args, None, [])
    os.mkfifo(tmp_path / "f.npz")
    with pytest.raises(StageError, match="is a FIFO"):
        export_inputs(argparse.Namespace(inputs=tmp_path / "f.npz", check_images=4), None, [])


def test_calibration_npz_of_stage5_is_checked(tmp_path):
    from deploykit.quant.quantize import read_calibration

    np.savez(tmp_path / "c.npz", x=np.zeros((0, 3), np.float32))
    with pytest.raises(StageError, match=r"--calib .*c\.npz: array 'x' is empty"):
        read_calibration(tmp_path / "c.npz")
    np.savez(tmp_path / "ok.npz", x=np.ones((2, 3), np.float32))
    data, raw, sha = read_calibration(tmp_path / "ok.npz")
    assert data["x"].shape == (2, 3) and raw == (tmp_path / "ok.npz").read_bytes() and len(sha) == 64
