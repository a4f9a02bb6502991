"""What a ModelOpt run ran on and said: the EPs of the ORT sessions it created (printed in the
ModelOpt child, read back from its log), the warnings worth keeping from that log, and an ORT
smoke run of the file it wrote.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from deploykit.runners import ORT_DTYPES, ort_session_options


# --------------------------------------------------------------------------------------------
# The EPs calibration really ran on
# --------------------------------------------------------------------------------------------
# printed by the child for every ONNX Runtime session created in it (ModelOpt's calibration
# sessions among them), read back from the log by :func:`calibration_ep`
SESSION_MARK = "deploykit: ORT session providers: "
# ModelOpt's --calibration_eps names -> ONNX Runtime's provider names
EP_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                "trt": "TensorrtExecutionProvider", "dml": "DmlExecutionProvider"}


def report_sessions() -> None:
    """In the ModelOpt child: print :data:`SESSION_MARK` and the providers of every
    ``onnxruntime.InferenceSession`` created from now on (``session.get_providers()``, what
    ONNX Runtime really assigned: a requested EP it does not have is dropped there)."""
    import onnxruntime as ort

    cls = ort.InferenceSession
    if getattr(cls.__init__, "_deploykit_reports", False):
        return
    orig = cls.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        try:
            print(SESSION_MARK + ",".join(self.get_providers()), flush=True)
        except Exception:  # noqa: BLE001 - reporting never breaks a session
            pass

    init._deploykit_reports = True
    cls.__init__ = init


def calibration_ep(requested: str, log: Path | str) -> dict:
    """What calibrated: the EP asked for and the providers of the ORT sessions ModelOpt
    created (from the child's log, :func:`report_sessions`).

    Args:
        requested: the ``--calibration_eps`` value (``cpu``, ``cuda:0``, ``trt``, ``dml``).
        log: the ModelOpt child's log.
    Returns:
        ``{"requested", "requested_provider", "used" (providers in order of first use, []
        when the log names no session), "available" (onnxruntime.get_available_providers()),
        "fallback" (True when the requested provider ran in no session although sessions
        ran)}``.
    """
    import onnxruntime as ort

    want = EP_PROVIDERS.get(requested.split(":")[0], requested)
    used: list[str] = []
    try:
        text = Path(log).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(SESSION_MARK):
            for p in line[len(SESSION_MARK):].strip().split(","):
                if p and p not in used:
                    used.append(p)
    return {"requested": requested, "requested_provider": want, "used": used,
            "available": list(ort.get_available_providers()),
            "fallback": bool(used) and want not in used}


def ep_fallback_warning(ep: dict) -> str | None:
    """The WARNING line for :func:`calibration_ep`'s record when the requested EP did not
    calibrate (None when it did, or when no session was seen)."""
    if not ep["fallback"]:
        return None
    why = ("this onnxruntime has no " + ep["requested_provider"]
           if ep["requested_provider"] not in ep["available"]
           else "ONNX Runtime did not assign it")
    return (f"WARNING: EPS={ep['requested']} was requested but calibration ran on "
            f"{', '.join(ep['used'])} ({why}; available: {', '.join(ep['available'])}): the "
            "scales are those of that EP; install onnxruntime-gpu for the CUDA EP, or set "
            "EPS=cpu to say so")


# --------------------------------------------------------------------------------------------
# record-quant (5_quantize.sh)
# --------------------------------------------------------------------------------------------
KEEP_WARNINGS = re.compile(r"WARNING|replaced with|smaller than smallest|Error|error:", re.I)


def log_warnings(log: Path, limit: int = 40) -> list[str]:
    """ModelOpt warning lines worth keeping (deduplicated, timestamps stripped)."""
    out: list[str] = []
    for line in Path(log).read_text(errors="replace").splitlines():
        if KEEP_WARNINGS.search(line):
            msg = re.sub(r"^\S+ \S+ - \[modelopt\]\[onnx\] - ", "", line).strip()
            if msg not in out:
                out.append(msg)
    return out[:limit]


def ort_smoke(path: Path) -> dict:
    """Load ``path`` in ORT CPU and run one all-zero batch-1 input (symbolic dims -> 1), at the
    default optimisation level: ``{"ok": bool, "error": str | None}``. A model ORT accepts at
    load time can still fail at the first run (blocked DequantizeLinear shape checks)."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(str(path), ort_session_options("all"),
                                    providers=["CPUExecutionProvider"])
        feed = {}
        for i in sess.get_inputs():
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
            # the input's own dtype: a uint8 image or an int64 mask is fed as such
            dtype = ORT_DTYPES.get(i.type, np.float32)
            feed[i.name] = np.zeros(shape, dtype)
        sess.run(None, feed)
        return {"ok": True, "error": None}
    except Exception as e:  # noqa: BLE001 - ORT raises Fail/InvalidGraph/RuntimeException
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
