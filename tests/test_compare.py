"""deploykit.compare: top-k accuracy and parity."""

from __future__ import annotations

import numpy as np
import pytest

from deploykit.compare import parity, topk_accuracy
from deploykit.errors import StageError


# ----------------------------------------------------------------------------- metrics
def test_topk_accuracy_by_hand():
    logits = np.array([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0],
                       [0.8, 0.1, 0.05, 0.03, 0.02, 0.0],
                       [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]], np.float32)
    labels = np.array([1, 1, 0])
    acc = topk_accuracy(logits, labels)
    assert acc["top1"] == pytest.approx(100 / 3)
    assert acc["top5"] == pytest.approx(200 / 3)  # row 3: label 0 ranks 6th


def test_parity_detects_disagreement():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 1000)).astype(np.float32)
    same = parity(a, a.copy())
    assert same["cosine_min"] == pytest.approx(1.0) and same["top1_agreement"] == 100.0
    b = a.copy()
    b[3] = -b[3]
    bad = parity(a, b)
    assert bad["cosine_min"] == pytest.approx(-1.0) and bad["top1_agreement"] == 87.5
    with pytest.raises(StageError):
        parity(a, a[:4])
