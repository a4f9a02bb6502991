"""Reading the captured TensorRT outputs in tests/data/trt/."""

from __future__ import annotations

import struct

from deploykit.trt.parsers import PLAN_FILE_TAG

from tests.helpers.stages import ROOT


DATA = ROOT / "tests" / "data" / "trt"


def read(name: str) -> str:
    return (DATA / name).read_text()


def _header(version=(10, 3, 0, 30), tag=PLAN_FILE_TAG, ser=0, extra=b"rest") -> bytes:
    """Synthetic plan header in the layout trtexec's printPlanVersion reads (sampleEngines.cpp):
    tag, serialization word, 16 bytes, 4 version bytes."""
    return struct.pack("<II", tag, ser) + bytes(16) + bytes(version) + extra
