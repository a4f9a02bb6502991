"""deploykit.quant.macs: MACs counted from the graph, INT8 only with both inputs quantized."""

from __future__ import annotations

import numpy as np

from deploykit.quant.macs import mac_summary, mac_table

from tests.helpers.auto_models import _conv_chain, _qdq


def test_macs_counted_from_the_graph_and_int8_only_with_both_inputs_quantized():
    m = _conv_chain()
    rows = {r["name"]: r for r in mac_table(m)}
    assert rows["a"]["macs"] == 8 * 16 * 16 * 3 * 3 * 3
    assert rows["dw"]["macs"] == 8 * 16 * 16 * 1 * 3 * 3
    assert rows["fc"]["macs"] == 10 * 8 and rows["mm"]["macs"] == 4 * 10
    assert not any(r["int8"] for r in rows.values())
    _qdq(m, "x", 0.05)                       # a: input and weight 8-bit -> INT8
    _qdq(m, "wa", np.full(8, 0.01), axis=0)
    _qdq(m, "wfc", np.full(10, 0.01), axis=0)  # fc: weight only -> not INT8 compute
    rows = {r["name"]: r for r in mac_table(m)}
    assert rows["a"]["int8"] and not rows["fc"]["int8"] and not rows["dw"]["int8"]
    s = mac_summary(m)
    total = 8 * 16 * 16 * 27 + 8 * 16 * 16 * 9 + 80 + 40
    assert s["total_macs"] == total and s["int8_macs"] == 8 * 16 * 16 * 27
    assert abs(s["int8_fraction"] - 8 * 16 * 16 * 27 / total) < 1e-12
