"""deploykit.trt.plans: plan loading errors (one class per cause, on captured messages), batch
invariance and fitting the batch."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from deploykit.errors import UsageError
from deploykit.trt.parsers import classify_plan_load_error, PLAN_FILE_TAG
from deploykit.trt.plans import batch_invariance, diagnose_plan_load, fit_batch

from tests.helpers.trt_captures import _header, read
from tests.helpers.trt_models import _linear_infer, conv_net, save


# --------------------------------------------------------------------------------------------
# Plan loading errors: one class per cause, each with its fix
# --------------------------------------------------------------------------------------------
ONNX_HEAD = bytes([0x08, 0x08, 0x12, 0x07]) + b"pytorch" + bytes(20)  # what an .onnx starts with


def classify(name=None, header=None, runtime=None, size=None, log=None):
    return classify_plan_load_error(read(name) if name else (log or ""), header,
                                       runtime_version=runtime, file_size=size, plan="m.plan")


def test_magic_tag_on_an_onnx_file_is_not_a_plan():
    # lix19937/tensorrt-insight#65: the author had loaded the ONNX file instead of the plan.
    r = classify("plan_magic_tag_8.x_onnx_read_as_plan.txt", ONNX_HEAD, (8, 6, 1, 6))
    assert r["kind"] == "not_a_plan" and "ONNX model" in r["message"]
    assert ".plan written by 6_build_engines.sh" in r["fix"]


@pytest.mark.parametrize("name", ["plan_magic_tag_8.x_onnx_read_as_plan.txt",
                                  "plan_magic_tag_8.6.0_parse_plan.txt"])
def test_magic_tag_on_a_plan_of_another_version_names_both(name):
    r = classify(name, _header((8, 5, 2, 2)), (8, 6, 1, 6))
    assert r["kind"] == "other_version"
    assert "TensorRT 8.5.2.2" in r["message"] and "8.6.1.6" in r["message"]
    assert "rebuild" in r["fix"]


def test_magic_tag_on_a_plan_of_the_same_release_is_the_library_path():
    # NVIDIA/TensorRT#1596 (NVIDIA): "2 different TRT are installed ... loading different trt lib"
    r = classify("plan_magic_tag_8.6.0_parse_plan.txt", _header((8, 6, 1, 6)), (8, 6, 1, 6))
    assert r["kind"] == "library_path" and "do not rebuild" in r["fix"]
    assert "LD_LIBRARY_PATH" in r["fix"]


def test_header_size_mismatch_is_truncated():
    r = classify("plan_size_mismatch_8.x_header_vs_archive.txt", _header((8, 2, 1, 8)), (8, 2, 1, 8))
    assert r["kind"] == "truncated" and "rebuild" in r["fix"]
    assert classify(log="", header=struct.pack("<I", PLAN_FILE_TAG) + bytes(6))["kind"] == \
        "truncated"  # a plan cut inside its header


def test_empty_file():
    assert classify(log="", header=b"", size=0)["kind"] == "not_a_plan"


@pytest.mark.parametrize("runtime,kind", [((8, 5, 3, 1), "library_path"),
                                          ((8, 5, 1, 7), "other_version")])
def test_8_5_3_capture_library_path_or_version(runtime, kind):
    # The library said "expecting 8.5.1.7 got 8.5.3.1". With the Python package at 8.5.3.1 (the
    # reporter's), the loaded libnvinfer (8.5.1.7) is not the package's: fix the loader path.
    r = classify("plan_version_mismatch_8.5.3_python_runtime.txt", None, runtime)
    assert r["kind"] == kind
    if kind == "library_path":
        assert "tensorrt 8.5.3.1" in r["message"] and "8.5.1.7" in r["message"]
        assert "do not rebuild" in r["fix"]
    else:
        assert r["plan_version"] == "8.5.3.1" and "8.5.1.7" in r["message"]


def test_library_mismatch_names_both_versions():
    r = classify("plan_version_mismatch_8.6.1_python_runtime.txt", None, (8, 6, 1, 6))
    assert r["kind"] == "other_version"
    assert "TensorRT 8.6.1.4" in r["message"] and "TensorRT 8.6.1.6" in r["message"]
    # 10.x prints an empty "got": the plan's version then comes from its header.
    r = classify("plan_version_mismatch_10.12.0_python_runtime.txt", _header((10, 8, 0, 43)),
                 (10, 12, 0, 36))
    assert r["kind"] == "other_version" and "10.8.0.43" in r["message"] and "10.12.0.36" in \
        r["message"]


@pytest.mark.parametrize("name", ["plan_serialization_version_tag_mismatch_8.2.1_python_runtime.txt",
                                  "plan_serialization_version_tag_213_vs_232_runtime.txt",
                                  "plan_safe_version_tag_8.4_python_runtime.txt"])
def test_serialization_tag_is_another_version(name):
    r = classify(name, None, (8, 4, 2, 4))
    assert r["kind"] == "other_version" and "another TensorRT version" in r["message"]
    assert "8.4.2.4" in r["message"]


def test_device_mismatch_is_another_gpu():
    r = classify("plan_device_mismatch_10.8_runtime.txt", _header((10, 8, 0, 43)), (10, 8, 0, 43))
    assert r["kind"] == "other_gpu"
    assert "compute capability 8.6" in r["message"] and "this GPU is 8.9" in r["message"]
    assert "--hardwareCompatibilityLevel=ampere+" in r["fix"]


def test_unrecognised_log_is_unknown_not_guessed():
    r = classify("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log", _header((10, 16, 1, 11)),
                 (10, 16, 1, 11))
    assert r["kind"] == "unknown"


def test_batch_invariance_passes_and_pads_to_batch_n():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 3, 2, 2)).astype(np.float32), rng.standard_normal((12, 10))
    calls = []
    r = batch_invariance(_linear_infer(w, calls=calls), {"input": x}, 4)
    assert r["ok"] and r["top1_agreement"] == 1.0 and r["max_abs_diff"] < 1e-5
    assert r["note"] is None
    assert calls == [1] * 5 + [4, 4]  # every batch-N call really has N rows


def test_batch_invariance_flags_batch_dependent_outputs():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 3, 2, 2)).astype(np.float32), rng.standard_normal((12, 10))
    r = batch_invariance(_linear_infer(w, batch_dependent=0.5), {"input": x}, 3)
    assert not r["ok"] and r["max_abs_diff"] == pytest.approx(0.5, rel=1e-5)
    assert "no TensorRT release note" in r["note"] and "NVIDIA/TensorRT#4796" in r["note"]
    with pytest.raises(UsageError):
        batch_invariance(_linear_infer(w), {"input": x}, 1)


def test_fit_batch():
    prof = ((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))
    assert fit_batch(prof, 64, (3, 224, 224)) == 32
    assert fit_batch(((4, 3, 8, 8),) * 3, 64, (3, 8, 8)) == 4  # static DLA profile
    with pytest.raises(UsageError, match="rebuild with 6_build_engines.sh"):
        fit_batch(prof, 8, (3, 256, 256))


def test_diagnose_plan_load_reads_the_file(tmp_path):
    onnx_file = save(conv_net(), tmp_path / "m.onnx")
    r = diagnose_plan_load(onnx_file, read("plan_magic_tag_8.x_onnx_read_as_plan.txt"),
                              (8, 6, 1, 6))
    assert r["kind"] == "not_a_plan" and "Fix:" in r["text"]
    (tmp_path / "empty.plan").write_bytes(b"")
    assert diagnose_plan_load(tmp_path / "empty.plan", "", None)["kind"] == "not_a_plan"


def test_batch_invariance_with_two_inputs():
    rng = np.random.default_rng(1)
    feed = {"a": rng.standard_normal((5, 4)), "b": rng.standard_normal((5, 4))}
    r = batch_invariance(lambda f: {"y": f["a"] * 2 + f["b"]}, feed, 2)
    assert r["ok"] and r["n"] == 5 and r["max_abs_diff"] == 0.0
