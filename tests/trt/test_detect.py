"""deploykit.trt.detect: finding trtexec, version conflicts, ldd output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploykit.trt.detect import Detected, find_trtexec, version_conflicts
from deploykit.trt.parsers import parse_ldd


# --------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------
def test_version_conflicts():
    base = dict(trtexec="t", banner=(10, 3, 0), header=(10, 3, 0), libnvinfer="/l/libnvinfer.so.10",
                libnvinfer_version=(10, 3, 0), python_runtime=(10, 3, 0, 30), python_detail="",
                env={})
    assert version_conflicts(Detected(**base)) == []
    p = version_conflicts(Detected(**{**base, "libnvinfer_version": (10, 8, 0)}))
    assert any("loads libnvinfer 10.8.0" in m for m in p)
    p = version_conflicts(Detected(**{**base, "python_runtime": (8, 6, 1, 6)}))
    assert any("Python runtime" in m for m in p)
    p = version_conflicts(Detected(**{**base, "libnvinfer": None, "libnvinfer_version": None}))
    assert any("no libnvinfer" in m for m in p)


def test_find_trtexec(tmp_path):
    exe = tmp_path / "trtexec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_trtexec({"TRTEXEC": str(exe)}) == (exe, "TRTEXEC")
    assert find_trtexec({"PATH": str(tmp_path)})[0] == exe
    p, why = find_trtexec({"TRTEXEC": str(tmp_path / "nope")})
    assert p is None and "not an executable" in why


@pytest.mark.slow
def test_parse_ldd_real_output():
    out = subprocess.run(["ldd", sys.executable], capture_output=True, text=True).stdout
    libs = parse_ldd(out + "\tlibnvinfer.so.10 => not found\n")
    assert libs["libnvinfer.so.10"] is None
    assert any(k.startswith("libc.so") and v and Path(v).exists() for k, v in libs.items())
