"""Tests for the TensorRT half (trt_tools.py, 6_build_engines.sh, 7_trt_eval.py) without TensorRT.

Parsers run on real captured tool output in tests/data/trt/ (provenance: SOURCES.md there). The
expected numbers below were read off those files by hand. The command builder is checked for
TensorRT 8.6, 10.x and 11.x for every variant. Stages 6 and 7 are run as subprocesses on this
machine (no TensorRT) and must skip with exit 0 and a skipped results row.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import trt_tools as tt  # noqa: E402
from common import StageError, UsageError  # noqa: E402

DATA = ROOT / "tests" / "data" / "trt"


def read(name: str) -> str:
    return (DATA / name).read_text()


def strip_trailing(text: str) -> str:
    """The same log as published by sources that strip trailing whitespace."""
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


# --------------------------------------------------------------------------------------------
# Versions and banners
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,banner,header", [
    ("trtexec_8.6.0_rtx3090_loadengine_cnn_verbose_run.log", (8, 6, 0), (8, 6, 0)),
    ("trtexec_8.6.1_h100pcie_onnx_yolo11s_fp16_build_run.log", (8, 6, 1), (8, 6, 1)),
    ("trtexec_10.14.1_rtx6000ada_onnx_cnn_build_run.log", (10, 14, 1), (10, 14, 1)),
    ("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log", (10, 16, 1), (10, 16, 1)),
    ("trtexec_11.0.0_b200_onnx_cnn_build_run.log", (11, 0, 0), (11, 0, 0)),
    ("trtexec_10.16.2_jetson_orin_device_info_fragment.log", None, (10, 16, 2)),
    ("unverified/trtexec_10.3.0_jetson_resnet50_fp16_perf_summary_only.log", (10, 3, 0), None),
])
def test_trtexec_version(name, banner, header):
    v = tt.parse_trtexec_version(read(name))
    assert v["banner"] == banner
    assert v["header"] == header


def test_decode_version_int_both_encodings():
    assert tt.decode_version_int(8601) == (8, 6, 1)
    assert tt.decode_version_int(8502) == (8, 5, 2)
    assert tt.decode_version_int(100300) == (10, 3, 0)
    assert tt.decode_version_int(101601) == (10, 16, 1)
    assert tt.decode_version_int(110000) == (11, 0, 0)


def test_parse_version():
    assert tt.parse_version("10.3.0.30") == (10, 3, 0, 30)
    assert tt.parse_version("v8.6") == (8, 6)
    with pytest.raises(UsageError):
        tt.parse_version("ten")


# --------------------------------------------------------------------------------------------
# Performance summary
# --------------------------------------------------------------------------------------------
PERF = {
    # file: (throughput, gpu min, gpu median, gpu p99, total gpu s, latency mean, h2d mean)
    "trtexec_8.6.0_rtx3090_loadengine_cnn_verbose_run.log":
        (21009.2, 0.041748, 0.0439453, 0.0521851, 2.84346, 0.0533242, 0.00427174),
    "trtexec_8.6.1_h100pcie_onnx_yolo11s_fp16_build_run.log":
        (484.641, 1.58716, 1.97192, 3.66565, 2.99948, 3.18949, 0.779499),
    "trtexec_10.14.1_rtx6000ada_onnx_cnn_build_run.log":
        (23188.6, 0.0266113, 0.0285645, 0.0368652, 2.00097, 0.0385501, 0.00430425),
    "trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log":
        (15374.3, 0.0331421, 0.0361328, 0.041748, 1.6586, 0.0441053, 0.00395853),
    "trtexec_11.0.0_b200_onnx_cnn_build_run.log":
        (33011.4, 0.0263672, 0.0271912, 0.0285034, 2.72088, 0.0274736, 0.0),
    "unverified/trtexec_10.3.0_jetson_resnet50_fp16_perf_summary_only.log":
        (318.007, 3.12671, 3.14062, 3.15039, 3.00249, 3.14068, 0.0),
}


@pytest.mark.parametrize("name", sorted(PERF))
@pytest.mark.parametrize("trailing", ["as_published", "stripped"])
def test_performance_summary(name, trailing):
    text = read(name) if trailing == "as_published" else strip_trailing(read(name))
    s = tt.parse_performance_summary(text)
    thr, gmin, gmed, gp99, total_gpu, lat_mean, h2d_mean = PERF[name]
    assert s["throughput_qps"] == pytest.approx(thr)
    g = s["gpu_compute_time"]
    assert g["min_ms"] == pytest.approx(gmin)
    assert g["median_ms"] == pytest.approx(gmed)
    assert g["p99_ms"] == pytest.approx(gp99)
    assert set(g) == {"min_ms", "max_ms", "mean_ms", "median_ms", "p90_ms", "p95_ms", "p99_ms"}
    assert s["total_gpu_compute_time_s"] == pytest.approx(total_gpu)
    assert s["latency"]["mean_ms"] == pytest.approx(lat_mean)
    assert s["h2d_latency"]["mean_ms"] == pytest.approx(h2d_mean)
    assert {"enqueue_time", "d2h_latency"} <= set(s)


def test_performance_summary_absent():
    # --skipInference build, then Unknown-option runs: no summary at all.
    assert tt.parse_performance_summary(read(
        "trtexec_11.0.0_b200_stronglytyped_skipinference_then_unknown_option_fp16_int8_best.log")) is None
    assert tt.parse_performance_summary(read("trtexec_10.16.1_h100pcie_dumpLayerInfo_detailed.log")) is None


def test_performance_summary_ignores_explanations_block():
    # The 8.6.0 --verbose log explains each metric after the summary; values must not change.
    s = tt.parse_performance_summary(read("trtexec_8.6.0_rtx3090_loadengine_cnn_verbose_run.log"))
    assert s["gpu_compute_time"]["max_ms"] == pytest.approx(0.609253)
    assert s["total_host_walltime_s"] == pytest.approx(3.00012)


def test_inference_shapes():
    s = tt.parse_inference_shapes(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log"))
    assert s["inputs"] == {"x": [1, 1, 28, 28]}
    assert s["outputs"] == {"y": [1, 10], "z": [1]}
    s = tt.parse_inference_shapes(read("trtexec_8.6.1_h100pcie_onnx_yolo11s_fp16_build_run.log"))
    assert s["inputs"] == {"images": [1, 3, 1280, 1280]}
    s = tt.parse_inference_shapes(read("trtexec_8.6.0_rtx3090_loadengine_cnn_verbose_run.log"))
    assert s["inputs"] == {"tensor-0": [4, 1, 28, 28]}


# --------------------------------------------------------------------------------------------
# Unknown options (11.x rejects the weak-typing flags; 10.x removed --workspace etc.)
# --------------------------------------------------------------------------------------------
def test_unknown_options_11():
    name = "trtexec_11.0.0_b200_stronglytyped_skipinference_then_unknown_option_fp16_int8_best.log"
    for text in (read(name), read(name).replace("\n", " \n")):  # with raw trtexec's trailing space
        assert tt.parse_unknown_options(text) == [
            "--fp16", "--int8", "--best", "--precisionConstraints=obey"]


def test_unknown_options_10_jetson_trailing_space():
    text = read("unverified/trtexec_10.3.0_jetson_unknown_option_workspace_buildOnly_explicitBatch.log")
    assert "--buildOnly \n" in text  # the raw trailing space is really there
    assert tt.parse_unknown_options(text) == ["--workspace=2048", "--buildOnly", "--explicitBatch"]
    assert tt.error_lines(text)[-1].startswith("&&&& FAILED")


# --------------------------------------------------------------------------------------------
# Plan version and mismatch errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kind,expected,got", [
    ("plan_version_mismatch_8.6.1_python_runtime.txt", "library", "8.6.1.6", "8.6.1.4"),
    ("plan_version_mismatch_8.5.3_python_runtime.txt", "library", "8.5.1.7", "8.5.3.1"),
    ("plan_version_mismatch_9.2.0_trtllm_runtime.txt", "library", "9.2.0.5", "9.3.0.1"),
    ("plan_version_mismatch_10.12.0_python_runtime.txt", "library", "10.12.0.36", None),
    ("plan_serialization_version_tag_mismatch_8.2.1_python_runtime.txt", "serialization",
     "213", "205"),
    ("plan_device_mismatch_10.8_runtime.txt", "device", "8.9", "8.6"),
])
def test_version_mismatch(name, kind, expected, got):
    assert tt.parse_version_mismatch(read(name)) == {"kind": kind, "expected": expected, "got": got}


def test_version_mismatch_absent_in_clean_log():
    assert tt.parse_version_mismatch(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log")) is None


def test_plan_version_documented_form():
    # No public capture of --getPlanVersionOnly exists; this is the line trtexec's
    # printPlanVersion() writes through its info logger (format documented in trt_tools).
    line = "[01/01/2025-00:00:00] [I] Plan was created with TensorRT version 10.3.0.30\n"
    assert tt.parse_plan_version(line) == (10, 3, 0, 30)
    assert tt.parse_plan_version(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log")) is None


def test_plan_header_layout(tmp_path):
    # Byte layout from trtexec's printPlanVersion(): tag, serialization word 0, version at 24..27.
    head = (tt.PLAN_FILE_TAG.to_bytes(4, "little") + (0).to_bytes(4, "little") + bytes(16)
            + bytes([10, 3, 0, 30]) + b"rest")
    (tmp_path / "a.plan").write_bytes(head)
    assert tt.read_plan_header_version(tmp_path / "a.plan") == (10, 3, 0, 30)
    (tmp_path / "b.plan").write_bytes(b"\0" * 40)
    assert tt.read_plan_header_version(tmp_path / "b.plan") is None


# --------------------------------------------------------------------------------------------
# Layer information
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,n,reformat,origins,noop,dtypes,spelling", [
    ("layerinfo_8.4_a100_resnet_fp16_detailed.graph.json", 36, 2, {"REFORMAT": 2}, 10,
     {"FP16": 35, "FP32": 1}, ["long"]),
    ("layerinfo_8.4_a100_resnet_qat_int8_detailed.graph.json", 37, 12,
     {"QDQ": 10, "REFORMAT": 2}, 1, {"INT8": 19, "FP16": 14, "FP32": 4}, ["long"]),
    ("layerinfo_8.4_titanrtx_mobilenetv2_qat_int8_detailed.graph.json", 58, 3,
     {"QDQ": 2, "REFORMAT": 1}, 0, {"INT8": 53, "FP16": 3, "FP32": 2}, ["long"]),
    ("layerinfo_10.16.1_h100pcie_cnn_fp32_detailed.json", 9, 0, {}, 0,
     {"FP32": 10, "INT32": 1, "INT64": 1}, ["short"]),
])
def test_layer_info_detailed(name, n, reformat, origins, noop, dtypes, spelling):
    s = tt.parse_layer_info(read(name))
    assert s["detailed"] is True and s["advice"] is None
    assert s["n_layers"] == n
    assert s["reformat_layers"] == reformat
    assert s["reformat_by_origin"] == origins
    assert s["reformat_noop"] == noop
    assert s["output_dtypes"] == dtypes
    assert s["spelling"] == spelling
    table = tt.layer_dtype_table(s)
    assert len(table) == n and all(r["output_dtypes"] for r in table)


def test_layer_info_qdq_reformat_is_int8_output():
    s = tt.parse_layer_info(read("layerinfo_8.4_titanrtx_mobilenetv2_qat_int8_detailed.graph.json"))
    first = s["layers"][0]
    assert (first["name"], first["type"], first["origin"]) == ("QuantizeLinear_2", "Reformat", "QDQ")
    assert first["outputs"][0]["dtype"] == "INT8"


def test_layer_info_10x_bindings_and_myelin():
    s = tt.parse_layer_info(read("layerinfo_10.16.1_h100pcie_cnn_fp32_detailed.json"))
    assert s["io_tensors"] == ["x", "y", "z"]
    assert s["layer_types"] == {"CaskConvolution": 2, "CaskPooling": 2, "gemm": 1, "kgen": 4}


def test_layer_info_names_only():
    s = tt.parse_layer_info(read("layerinfo_8.6.0_rtx3090_cnn_names_only_nondetailed.json"))
    assert s["detailed"] is False
    assert "--profilingVerbosity=detailed" in s["advice"]
    assert s["n_layers"] == 15 and s["reformat_layers"] == 5
    assert s["io_tensors"] == ["tensor-0", "tensor-15"]
    assert s["output_dtypes"] == {}


def test_layer_info_11x_split_fields():
    # 11.x schema per the TensorRT 10.x->11.x IEngineInspector migration guide (no public capture).
    info = {"Layers": [{"Name": "conv", "LayerType": "CaskConvolution",
                        "Outputs": [{"Name": "y", "DataType": "Half",
                                     "Format": "Channel major FP16 format"}]}],
            "I/O Tensors": [{"Name": "x", "IOMode": "Input"}, {"Name": "y", "IOMode": "Output"}]}
    s = tt.parse_layer_info(json.dumps(info))
    assert s["output_dtypes"] == {"FP16": 1} and s["spelling"] == ["split"]
    assert s["io_tensors"] == ["x", "y"]


def test_layer_info_rejects_other_json():
    with pytest.raises(StageError):
        tt.parse_layer_info(read("exportProfile_8.4_a100_resnet_fp16.profile.json"))


@pytest.mark.parametrize("fmt,dtype", [
    ("Row major linear FP32", "FP32"), ("Channel major FP16 format where channel % 8 == 0", "FP16"),
    ("Thirty-two wide channel vectorized row major Int8 format", "INT8"),
    ("Two wide channel vectorized row major BFloat16 format", "BF16"), ("Float", "FP32"),
    ("Half", "FP16"), ("Int64", "INT64"), ("Row major linear FP8 format", "FP8"), ("Int4", "INT4"),
])
def test_dtype_of(fmt, dtype):
    assert tt.dtype_of(fmt) == dtype


@pytest.mark.parametrize("name,count,n,reformats", [
    ("exportProfile_8.4_a100_resnet_fp16.profile.json", 1, 36, 12),
    ("exportProfile_8.4_a100_resnet_qat_int8.profile.json", 1, 37, 3),
    ("exportProfile_8.4_titanrtx_mobilenetv2_qat_int8.profile.json", 8657, 58, 1),
    ("exportProfile_unknownver_detr_resnet50_int8.profile.json", 641, 840, 247),
])
def test_export_profile(name, count, n, reformats):
    s = tt.parse_export_profile(read(name))
    assert (s["count"], s["n_layers"], s["reformat_layers"]) == (count, n, reformats)
    assert 0 < s["reformat_percent"] < 100 and 0 < s["reformat_average_ms"] < s["total_average_ms"]


def test_parse_ldd_real_output():
    out = subprocess.run(["ldd", sys.executable], capture_output=True, text=True).stdout
    libs = tt.parse_ldd(out + "\tlibnvinfer.so.10 => not found\n")
    assert libs["libnvinfer.so.10"] is None
    assert any(k.startswith("libc.so") and v and Path(v).exists() for k, v in libs.items())


# --------------------------------------------------------------------------------------------
# Command lines per TensorRT version
# --------------------------------------------------------------------------------------------
V86, V103, V1016, V110 = (8, 6, 1), (10, 3, 0), (10, 16, 1), (11, 0, 0)
WEAK_FLAGS = {"--fp16", "--int8", "--best"}
REMOVED_IN_10 = ("--workspace", "--explicitBatch", "--buildOnly")


def cmd(variant, version, **kw):
    kw.setdefault("timing_cache", "e/timing.cache")
    kw.setdefault("layer_info", f"e/{variant}.layers.json")
    kw.setdefault("input_name", "input")
    kw.setdefault("input_shape", [None, 3, 224, 224])
    return tt.build_command(f"o/{variant}.onnx", f"e/{variant}.plan", variant, version, **kw)


def flags(c):
    return {a.split("=")[0] for a in c[1:]}


@pytest.mark.parametrize("variant,expected", [
    ("fp32", set()), ("fp16", {"--fp16"}), ("int8", {"--int8", "--fp16"}),
    ("int8_hp32", {"--int8"})])
def test_commands_trt8(variant, expected):
    c = cmd(variant, V86)
    assert flags(c) & WEAK_FLAGS == expected
    assert "--stronglyTyped" not in flags(c)
    assert "--timingCacheFile=e/timing.cache" in c
    assert {"--profilingVerbosity=detailed", f"--exportLayerInfo=e/{variant}.layers.json"} <= set(c)
    assert not any(a.startswith(REMOVED_IN_10) for a in c)


@pytest.mark.parametrize("variant", ["int4", "int4_cli_broken"])
def test_commands_trt8_int4_unsupported(variant):
    with pytest.raises(tt.UnsupportedVariant):
        cmd(variant, V86)


@pytest.mark.parametrize("version", [V103, V1016])
@pytest.mark.parametrize("variant,strong", [
    ("fp32", False), ("fp16", True), ("int8", True), ("int8_hp32", True), ("int4", True),
    ("int4_cli_broken", True)])
def test_commands_trt10(version, variant, strong):
    c = cmd(variant, version)
    assert ("--stronglyTyped" in c) == strong
    assert not flags(c) & WEAK_FLAGS  # precision comes from the ONNX file
    assert not any(a.startswith(REMOVED_IN_10) for a in c)


@pytest.mark.parametrize("variant", list(tt.VARIANTS))
def test_commands_trt11_never_weak_flags(variant):
    c = cmd(variant, V110, mem_pool_mb=2048)
    assert not flags(c) & WEAK_FLAGS
    assert "--stronglyTyped" not in c  # 11.x: a documented no-op
    assert not any(a.startswith(REMOVED_IN_10 + ("--precisionConstraints",)) for a in c)
    # and nothing 11.0 reported as unknown in the captured log
    log = read("trtexec_11.0.0_b200_stronglytyped_skipinference_then_unknown_option_fp16_int8_best.log")
    rejected = {o.split("=")[0] for o in tt.parse_unknown_options(log)}
    assert not flags(c) & rejected
    assert "--memPoolSize=workspace:2048M" in c


def test_commands_source_is_int4_cli_broken():
    c = cmd("int4_cli_broken", V103)
    assert "--onnx=o/int4_cli_broken.onnx" in c  # the path given is used as is
    assert tt.onnx_path("m", "int4_cli_broken").name == "int4_cli_broken.onnx"


def test_commands_dynamic_shapes_and_static():
    c = cmd("fp32", V103, min_batch=1, opt_batch=8, max_batch=32)
    assert "--minShapes=input:1x3x224x224" in c
    assert "--optShapes=input:8x3x224x224" in c
    assert "--maxShapes=input:32x3x224x224" in c
    c = cmd("fp32", V103, input_shape=[1, 3, 224, 224])
    assert not any(a.startswith(("--minShapes", "--optShapes", "--maxShapes")) for a in c)


def test_commands_mem_pool_units():
    assert "--memPoolSize=workspace:1024" in cmd("fp16", V86, mem_pool_mb=1024)
    assert "--memPoolSize=workspace:1024M" in cmd("fp16", V103, mem_pool_mb=1024)
    assert not any(a.startswith("--memPoolSize") for a in cmd("fp16", V103))
    with pytest.raises(UsageError):
        cmd("fp16", V103, mem_pool_mb=0)


def test_commands_dla_rules():
    for version in (V86, V103):
        c = cmd("fp16", version, dla_core=0)
        assert "--useDLACore=0" in c and "--allowGPUFallback" in c  # only together
        assert "--fp16" in c  # DLA path is weakly typed on 8.x/10.x
        assert "--stronglyTyped" not in c
        c = cmd("int8", version, dla_core=1)
        assert {"--useDLACore=1", "--allowGPUFallback", "--int8"} <= set(c)
    assert not any(a.startswith(("--useDLACore", "--allowGPUFallback")) for a in cmd("fp16", V103))
    with pytest.raises(UsageError, match="FP16/INT8"):
        cmd("fp32", V86, dla_core=0)
    with pytest.raises(UsageError, match="FP16/INT8"):
        cmd("int4", V103, dla_core=0)
    with pytest.raises(UsageError, match="DLA"):
        cmd("fp16", V110, dla_core=0)
    with pytest.raises(UsageError):
        cmd("fp16", V86, dla_core=-1)
    c = cmd("fp16", (11, 4, 1), dla_core=0)
    assert {"--useDLACore=0", "--allowGPUFallback"} <= set(c) and not flags(c) & WEAK_FLAGS


def test_commands_bad_input():
    with pytest.raises(UsageError):
        cmd("fp64", V103)
    with pytest.raises(UsageError):
        cmd("fp32", (7, 2, 3))


def test_plan_version_command_per_version():
    assert tt.plan_version_command("p.plan", V86) is None  # 8.6 trtexec has no such flag
    assert tt.plan_version_command("p.plan", V103, "trtexec") == [
        "trtexec", "--loadEngine=p.plan", "--getPlanVersionOnly"]
    assert tt.plan_version_command("p.plan", V110) is not None


def test_version_conflicts():
    base = dict(trtexec="t", banner=(10, 3, 0), header=(10, 3, 0), libnvinfer="/l/libnvinfer.so.10",
                libnvinfer_version=(10, 3, 0), python_runtime=(10, 3, 0, 30), python_detail="",
                env={})
    assert tt.version_conflicts(tt.Detected(**base)) == []
    p = tt.version_conflicts(tt.Detected(**{**base, "libnvinfer_version": (10, 8, 0)}))
    assert any("loads libnvinfer 10.8.0" in m for m in p)
    p = tt.version_conflicts(tt.Detected(**{**base, "python_runtime": (8, 6, 1, 6)}))
    assert any("Python runtime" in m for m in p)
    p = tt.version_conflicts(tt.Detected(**{**base, "libnvinfer": None, "libnvinfer_version": None}))
    assert any("no libnvinfer" in m for m in p)


def test_find_trtexec(tmp_path):
    exe = tmp_path / "trtexec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert tt.find_trtexec({"TRTEXEC": str(exe)}) == (exe, "TRTEXEC")
    assert tt.find_trtexec({"PATH": str(tmp_path)})[0] == exe
    p, why = tt.find_trtexec({"TRTEXEC": str(tmp_path / "nope")})
    assert p is None and "not an executable" in why


# --------------------------------------------------------------------------------------------
# Stages 6 and 7 on this machine (no TensorRT): skip cleanly
# --------------------------------------------------------------------------------------------
def _env(tmp_path) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="mobilenet_v3_small", PATH="/usr/bin:/bin")
    env.pop("TRTEXEC", None)
    return env


def _no_trt():
    import importlib.util
    return importlib.util.find_spec("tensorrt") is None


def test_stage6_skips_without_trtexec(tmp_path):
    if Path(tt.JETPACK_TRTEXEC).exists():
        pytest.skip("trtexec is installed here")
    p = subprocess.run(["bash", "6_build_engines.sh"], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "SKIPPED" in p.stdout and "trtexec not found" in p.stdout
    rows = sorted((tmp_path / "r" / "mobilenet_v3_small").glob("trt_build_*.json"))
    assert [r.stem for r in rows] == sorted(f"trt_build_{v}" for v in tt.DEFAULT_VARIANTS)
    for r in rows:
        rec = json.loads(r.read_text())
        assert rec["status"] == "skipped" and "trtexec not found" in rec["reason"]
        assert rec["backend"] == "TensorRT" and rec["stage"] == "6_build_engines"
        assert not any(k in rec for k in ("trtexec_perf", "latency", "size_mb"))  # no numbers
    assert json.loads((tmp_path / "r/mobilenet_v3_small/trt_build_int4_cli_broken.json").read_text()
                      )["expected_failure"] is True
    assert not (tmp_path / "a" / "mobilenet_v3_small" / "engines").exists()


def test_stage6_bad_trtexec_env_skips_with_reason(tmp_path):
    env = {**_env(tmp_path), "TRTEXEC": str(tmp_path / "missing" / "trtexec")}
    p = subprocess.run(["bash", "6_build_engines.sh", "fp16"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rec = json.loads((tmp_path / "r/mobilenet_v3_small/trt_build_fp16.json").read_text())
    assert rec["status"] == "skipped" and "is not an executable file" in rec["reason"]
    assert not (tmp_path / "r/mobilenet_v3_small/trt_build_fp32.json").exists()


def test_stage6_usage_errors_exit_2(tmp_path):
    for extra in (["bogus"], ["--dry-run"]):
        p = subprocess.run(["bash", "6_build_engines.sh", *extra], cwd=ROOT, env=_env(tmp_path),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "usage:" in p.stderr


@pytest.mark.parametrize("version,present,absent", [
    ("8.6.1", ["--fp16", "--int8"], ["--stronglyTyped", "--getPlanVersionOnly"]),
    ("10.3.0", ["--stronglyTyped", "--getPlanVersionOnly"], ["--fp16", "--int8"]),
    ("11.0.0", ["--getPlanVersionOnly"], ["--fp16", "--int8", "--best", "--stronglyTyped"]),
])
def test_stage6_dry_run(tmp_path, version, present, absent):
    p = subprocess.run(["bash", "6_build_engines.sh", "--dry-run", "--trt-version", version],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("trtexec")]
    words = {w.split("=")[0] for ln in lines for w in ln.split()}
    assert all(f in words for f in present) and not any(f in words for f in absent)
    builds = [ln for ln in lines if "--onnx=" in ln]
    assert len(builds) == (4 if version.startswith("8") else 6)
    assert not (tmp_path / "r").exists()  # a dry run writes nothing


@pytest.mark.skipif(not _no_trt(), reason="TensorRT is importable here")
def test_stage7_skips_without_tensorrt(tmp_path):
    eng = tmp_path / "a" / "mobilenet_v3_small" / "engines" / "int8.plan"
    eng.parent.mkdir(parents=True)
    eng.write_bytes(b"a plan file")  # a missing plan is an error named before this check
    p = subprocess.run([sys.executable, "7_trt_eval.py", "--engine", str(eng), "--tag", "trt_int8"],
                       cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "SKIPPED" in p.stdout
    rec = json.loads((tmp_path / "r/mobilenet_v3_small/trt_int8.json").read_text())
    assert rec["status"] == "skipped" and "tensorrt" in rec["reason"].lower()
    assert rec["backend"] == "TensorRT" and rec["precision"] == "INT8" and rec["variant"] == "int8"
    assert all(rec[k] is None for k in ("latency", "accuracy", "parity"))  # no numbers without a run
    assert rec["provenance"]["args"]["tag"] == "trt_int8"


def test_stage7_usage_error_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "7_trt_eval.py", "--engine", "x.plan", "--tag", "t",
                        "--iters", "0"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "usage:" in p.stderr


def test_trt_tools_imports_no_tensorrt():
    code = "import sys, trt_tools; assert 'tensorrt' not in sys.modules; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.stdout.strip() == "ok", p.stderr


def _onnx_with_opset(path: Path, opset: int) -> Path:
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_opset_warning_only_where_the_parser_is_older(tmp_path):
    new = _onnx_with_opset(tmp_path / "m18.onnx", 18)
    old = _onnx_with_opset(tmp_path / "m17.onnx", 17)
    w = tt.opset_warning(new, (8, 6, 1))
    assert w and "opset 18" in w and "--opset 17" in w
    assert tt.opset_warning(old, (8, 6, 1)) is None
    assert tt.opset_warning(new, (10, 3, 0)) is None


def test_stage6_skip_names_missing_onnx(tmp_path):
    """Without trtexec every row is skipped; a variant whose ONNX was never made says which
    stage makes it, one whose ONNX exists only says trtexec is missing."""
    if Path(tt.JETPACK_TRTEXEC).exists():
        pytest.skip("trtexec is installed here")
    _onnx_with_opset(tmp_path / "a" / "mobilenet_v3_small" / "onnx" / "fp32.onnx", 18)
    p = subprocess.run(["bash", "6_build_engines.sh", "fp32", "int8"], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    res = tmp_path / "r" / "mobilenet_v3_small"
    fp32 = json.loads((res / "trt_build_fp32.json").read_text())["reason"]
    int8 = json.loads((res / "trt_build_int8.json").read_text())["reason"]
    assert "missing" not in fp32 and "trtexec not found" in fp32
    assert "int8.onnx missing" in int8 and "5_quantize.sh" in int8


def test_dry_run_dla_builds_fp32_for_the_gpu(tmp_path):
    p = subprocess.run(["bash", "6_build_engines.sh", "--dry-run", "--trt-version", "10.3.0",
                        "--dla-core", "0", "fp32", "int8"], cwd=ROOT, env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("trtexec --onnx")]
    fp32 = next(ln for ln in lines if "fp32.onnx" in ln)
    int8 = next(ln for ln in lines if "int8.onnx" in ln)
    assert "--useDLACore" not in fp32 and "--useDLACore=0" in int8 and "--allowGPUFallback" in int8
