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


def test_output_change_by_samples_equals_the_whole_batch_bit_for_bit():
    """check_bias_requant simulates a few samples at a time, from a float32 array or the list
    of ORT's per-run arrays: every figure equals the whole float64 batch's exactly."""
    from deploykit.quant.bias import _output_change, _output_change_by_samples

    rng = np.random.default_rng(4)
    y32 = (rng.standard_normal((11, 10, 5, 5)) * 3).astype(np.float32)
    d = np.zeros(10)
    d[[1, 4, 7]] = [0.9, -2.5, 0.3]
    args = (d, 1, [(0.0, 6.0)], np.array(0.0), np.array(255 * 0.02), 0.02, 1.0)
    whole = _output_change(y32.astype(np.float64), *args)
    for y in (y32, [y32[:8], y32[8:]]):
        ch, frac, cos, n, nonfinite = _output_change_by_samples(y, *args, chunk=3)
        assert np.array_equal(ch, whole[0]) and frac == whole[1] and n == 11
        assert np.array_equal(cos, whole[2]) and nonfinite == whole[3]
    assert whole[1] > 0 and (whole[2] < 1).any()  # the case moves some outputs
    # a NaN already in one sample's pre-activation and a NaN bias change: the batch's flag
    # (new NaN where there was none anywhere) is False either way, not the later chunks' True
    y32[0, 2, 0, 0] = np.nan
    d[1] = np.nan
    whole = _output_change(y32.astype(np.float64), *args)
    chunked = _output_change_by_samples(y32, *args, chunk=4)
    assert whole[3] is False and chunked[4] is False
    y32[0, 2, 0, 0] = 0.0  # without the earlier NaN both say True
    assert _output_change(y32.astype(np.float64), *args)[3] is True
    assert _output_change_by_samples(y32, *args, chunk=4)[4] is True


def test_output_change_on_the_changed_channels_alone_equals_the_whole_tensor_simulation():
    """check_bias_requant simulates only the channels whose bias changes and assembles the
    output cosine from the rest: every figure equals the simulation of the whole tensor
    (channels with d == 0 unchanged, a NaN bias, a ReLU6 chain and the output clamp)."""
    from deploykit.compare import cosine_rows
    from deploykit.quant.bias import _apply_chain, _output_change
    from deploykit.quant.qdq import channel_rows

    rng = np.random.default_rng(3)
    y = rng.standard_normal((6, 10, 5, 5)) * 3
    d = np.zeros(10)
    d[[1, 4, 7]] = [0.9, -2.5, np.nan]
    bounds, lo, hi, s = [(0.0, 6.0)], np.array(0.0), np.array(255 * 0.02), 0.02
    ch, frac, cos, nonfinite = _output_change(y, d, 1, bounds, lo, hi, s, 1.0)
    f0 = _apply_chain(y, bounds, lo.reshape(()), hi.reshape(()))
    with np.errstate(invalid="ignore"):
        f1 = _apply_chain(y + d.reshape(1, -1, 1, 1), bounds, lo.reshape(()), hi.reshape(()))
        steps = np.abs(np.rint(f1 / s) - np.rint(f0 / s))
    steps = np.where(np.isnan(steps), np.inf, steps)
    assert np.array_equal(ch, channel_rows(steps, 1).max(1))
    assert ch[[0, 2, 3]].max() == 0 and ch[4] > 1 and np.isinf(ch[7])
    assert frac == float((steps > 1.0).mean())
    assert np.allclose(cos, cosine_rows(f0, np.nan_to_num(f1, nan=0.0)), rtol=0, atol=1e-12)
    assert nonfinite is True
    none = _output_change(y, np.zeros(10), 1, bounds, lo, hi, s, 1.0)
    assert not none[0].any() and none[1] == 0.0 and (none[2] == 1).all() and none[3] is False
