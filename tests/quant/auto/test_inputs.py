"""deploykit.quant.auto.inputs: the tuning data file is checked like calibration data."""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploykit.errors import StageError
from deploykit.quant.auto.inputs import tuning_data

from tests.helpers.auto_models import _conv_chain, _save


# ------------------------------------------------- faults found by trying it (review_auto)
def test_tuning_npz_is_checked_like_calibration_data(tmp_path):
    """A tuning npz with other keys, another shape or dtype, NaN or no samples is refused with
    the problem named (it used to surface as an ONNX Runtime traceback, or NaN metrics)."""
    fp32 = _save(_conv_chain(), tmp_path / "fp32.onnx")
    rng = np.random.default_rng(0)
    good = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    nan = good.copy()
    nan[1, 0, 0, 0] = np.nan
    cases = {"key": ({"image": good}, r"keys \['image'\].*inputs are \['x'\]"),
             "shape": ({"x": good[:, :, :8, :8]}, r"does not fit"),
             "dtype": ({"x": good.astype(np.float64)}, r"float64 but the model takes float32"),
             "nan": ({"x": nan}, r"holds NaN/Inf in 1 of 4 samples \(first: sample 1\)"),
             "empty": ({"x": good[:0]}, r"array 'x' is empty \(shape \[0, 3, 16, 16\]\)")}
    for name, (arrays, msg) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(StageError, match=f"tuning data {re.escape(str(path))}.*{msg}"):
            tuning_data("mobilenet_v3_small", fp32, path)
    np.savez(tmp_path / "good.npz", x=good)
    data, info = tuning_data("mobilenet_v3_small", fp32, tmp_path / "good.npz")
    assert len(data) == info["n"] == 4
