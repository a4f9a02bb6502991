"""export_checks.py (deploykit.tools.export_checks) run as a command: fp16 on a static batch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.helpers.verdict_models import _ort_model, _tool, static_batch_model


@pytest.mark.slow
def test_fp16_command_feeds_a_static_batch(tmp_path):
    """``export_checks.py fp16`` (the printed FP16 remedy) on a file with a static batch of 4:
    it fed all 16 samples at once and died with ORT's raw traceback ("Got: 16 Expected: 4")."""
    src = tmp_path / "static4.onnx"
    onnx.save(static_batch_model(4), str(src))
    out = tmp_path / "static4_fp16.onnx"
    p = _tool("export_checks.py", "fp16", src, "-o", out, "--n", 10)
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0, p.stdout + p.stderr
    assert out.exists() and "static batch 4" in p.stderr
    feed = {"x": np.ones((4, 6), np.float32)}
    np.testing.assert_allclose(_ort_model(onnx.load(str(out)), feed), _ort_model(onnx.load(str(src)), feed),
                               atol=1e-2)
