"""deploykit.quant.modelopt: the EP that calibrated, read from the child's log."""
from __future__ import annotations

import onnxruntime as ort

from deploykit.quant.modelopt_log import SESSION_MARK, calibration_ep, ep_fallback_warning


def test_calibration_ep_reads_sessions_and_flags_a_fallback(tmp_path):
    log = tmp_path / "x.quant.log"
    log.write_text(f"INFO something\n{SESSION_MARK}CPUExecutionProvider\n"
                   f"{SESSION_MARK}CPUExecutionProvider\n")
    ep = calibration_ep("cuda:0", log)
    assert ep["used"] == ["CPUExecutionProvider"]
    assert ep["requested_provider"] == "CUDAExecutionProvider"
    assert ep["fallback"] is True and ep["available"] == ort.get_available_providers()
    warn = ep_fallback_warning(ep)
    assert warn.startswith("WARNING: EPS=cuda:0 was requested but calibration ran on "
                           "CPUExecutionProvider")
    ok = calibration_ep("cpu", log)
    assert ok["fallback"] is False and ep_fallback_warning(ok) is None


def test_calibration_ep_without_sessions_in_the_log_claims_nothing(tmp_path):
    log = tmp_path / "x.quant.log"
    log.write_text("ModelOpt failed before calibrating\n")
    ep = calibration_ep("cuda:0", log)
    assert ep["used"] == [] and ep["fallback"] is False
