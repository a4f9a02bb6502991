"""deploykit.data.user: a model's own data (--inputs, --labels, stage 1's reference inputs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from deploykit.data.user import (check_same_inputs, forward_arg_names, input_names,
                                 load_inputs, load_labels, reference_inputs, SYNTHETIC_KEY)
from deploykit.errors import StageError, UsageError


class ImageDepth(nn.Module):
    def forward(self, image, depth, scale=1.0):
        return image.mean((1, 2, 3)) * scale + depth.mean((1, 2, 3))


def test_input_names_follow_forward_order_whatever_the_file_order():
    m = ImageDepth()
    assert forward_arg_names(m) == ["image", "depth", "scale"]
    assert input_names(m, [], ["depth", "image"]) == ["image", "depth"]
    with pytest.raises(UsageError, match=r"forward\(\) needs \['image', 'depth'\].*add \['depth'\]"):
        input_names(m, [], ["image"])
    with pytest.raises(UsageError, match=r"not the names of forward\(\)'s arguments"):
        input_names(m, [], ["rgb", "d"])
    # one array for a one-argument model: any key, named after forward()'s argument (the ONNX
    # input's name), so the reference and the exported file agree
    assert input_names(nn.Linear(2, 2), [], ["whatever"]) == ["input"]


def test_load_inputs_refuses_what_cannot_be_samples(tmp_path):
    ok = tmp_path / "ok.npz"
    np.savez(ok, image=np.zeros((5, 3, 4, 4), np.float32), depth=np.ones((5, 1, 4, 4)))
    assert [len(v) for v in load_inputs(ok, ["image", "depth"], limit=3).values()] == [3, 3]
    bad = tmp_path / "counts.npz"
    np.savez(bad, image=np.zeros((5, 3)), depth=np.zeros((4, 1)))
    with pytest.raises(StageError, match="disagree on the number of samples"):
        load_inputs(bad)
    scalar = tmp_path / "scalar.npz"
    np.savez(scalar, x=np.float32(3))
    with pytest.raises(StageError, match="'x'.*axis 0"):
        load_inputs(scalar)
    text = tmp_path / "text.npz"
    np.savez(text, x=np.array(["a", "b"]))
    with pytest.raises(StageError, match="'x'"):
        load_inputs(text)
    with pytest.raises(UsageError, match=r"lack the model inputs \['tokens'\]"):
        load_inputs(ok, ["image", "tokens"])


def test_load_labels_npy_and_text_with_bom_and_crlf(tmp_path):
    np.save(tmp_path / "y.npy", np.array([3, 1, 2]))
    assert load_labels(tmp_path / "y.npy", 2).tolist() == [3, 1]
    (tmp_path / "y.txt").write_bytes(b"\xef\xbb\xbf4\r\n# a comment\r\n0\r\n\r\n7\r\n")
    assert load_labels(tmp_path / "y.txt", 3).tolist() == [4, 0, 7]
    with pytest.raises(UsageError, match="3 labels for 5 samples"):
        load_labels(tmp_path / "y.txt", 5)
    (tmp_path / "f.txt").write_text("1\n2.5\n")
    with pytest.raises(UsageError, match="not a list of integer class ids"):
        load_labels(tmp_path / "f.txt", 2)
    np.save(tmp_path / "neg.npy", np.array([1, -1]))
    with pytest.raises(UsageError, match="integers >= 0"):
        load_labels(tmp_path / "neg.npy", 2)


def test_reference_inputs_synthetic_flag_and_same_inputs_check(tmp_path):
    ref = tmp_path / "ref_outputs.npz"
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.savez(ref, **{"in:x": x, "out:y": x.sum(1), SYNTHETIC_KEY: np.array(False)},
             labels=np.array([0, 1, 0, 1]))
    feed, synthetic, labels = reference_inputs(ref)
    assert not synthetic and labels.tolist() == [0, 1, 0, 1] and list(feed) == ["x"]
    same = tmp_path / "same.npz"
    np.savez(same, x=np.concatenate([x, x]))  # more samples: the first 4 are the reference's
    check_same_inputs(same, feed, "--inputs", "stage 1")
    other = tmp_path / "other.npz"
    np.savez(other, x=x + 1)
    with pytest.raises(UsageError, match="not what stage 1's reference was computed on"):
        check_same_inputs(other, feed, "--inputs", "python 1_pytorch_baseline.py ...")
    old = tmp_path / "old.npz"  # written before the flag existed, without labels
    np.savez(old, **{"in:x": x, "out:y": x})
    assert reference_inputs(old)[1] is True


def test_shared_samples_finds_eval_samples_in_any_order():
    from deploykit.data.user import shared_samples

    rng = np.random.default_rng(0)
    ev = {"image": rng.standard_normal((10, 3, 4, 4)).astype(np.float32),
          "depth": rng.uniform(0, 9, (10, 1, 4, 4)).astype(np.float32)}
    other = {k: v + 1 for k, v in ev.items()}
    leak = {k: np.concatenate([other[k][:6], v[[7, 2]]]) for k, v in ev.items()}
    assert shared_samples(leak, ev) == 2
    assert shared_samples(other, ev) == 0
    # the same image with another depth is another sample
    mixed = {"image": ev["image"][:3], "depth": other["depth"][:3]}
    assert shared_samples(mixed, ev) == 0
