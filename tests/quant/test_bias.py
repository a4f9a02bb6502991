"""deploykit.quant.bias: the simulated bias requantization matches what ORT computes."""

from __future__ import annotations

import numpy as np

from deploykit.quant.bias import simulate_bias_requant


def test_simulated_bias_is_what_ort_computes():
    b = np.array([5.0, -3.0, 0.25], np.float16)
    eff, q = simulate_bias_requant(b, np.array(0.01, np.float16),
                                             np.array([6e-8, 0.01, 0.02], np.float16))
    # fp16 product underflows to 0: 5/0 = inf -> int32 min (x86: the "integer indefinite"
    # value, for inf, NaN and out-of-range alike); the others are divided in float16 (-3 / 1e-4
    # is not -29995 as in float32 but a float16 neighbour) and dequantized back.
    assert q[0] == -2 ** 31 and q[1] != -29995 and abs(q[1] + 29995) <= 16
    assert abs(eff[1] + 3.0) < 0.01 and abs(eff[2] - 0.25) < 0.01
    assert abs(eff[2] - 0.25) < 0.01
