"""deploykit.trt.parsers: every parser on real captured TensorRT tool output.

The captures are in tests/data/trt/ (provenance and trimming in SOURCES.md there); the expected
values below were read off those files by hand. Synthetic inputs are used only where they say so
(an 11.x layer-info schema taken from the migration guide, a DLA log mapped to a constructed list
of ONNX node names). Plan-file errors are in tests/trt/test_plans.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploykit.errors import StageError
from deploykit.trt.parsers import (
    decode_version_int, dla_fraction, dtype_of, error_lines, layer_dtype_table,
    parse_calibration_cache, parse_dla_placement, parse_export_profile, parse_inference_shapes,
    parse_layer_info, parse_ldd, parse_performance_summary, parse_plan_version,
    parse_trtexec_version, parse_unknown_options, parse_version_mismatch, PLAN_HEADER_BYTES,
    plan_header_info,
)

from tests.helpers.trt_captures import _header, read


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
    v = parse_trtexec_version(read(name))
    assert v["banner"] == banner
    assert v["header"] == header


def test_decode_version_int_both_encodings():
    assert decode_version_int(8601) == (8, 6, 1)
    assert decode_version_int(8502) == (8, 5, 2)
    assert decode_version_int(100300) == (10, 3, 0)
    assert decode_version_int(101601) == (10, 16, 1)
    assert decode_version_int(110000) == (11, 0, 0)


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
    s = parse_performance_summary(text)
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
    assert parse_performance_summary(read(
        "trtexec_11.0.0_b200_stronglytyped_skipinference_then_unknown_option_fp16_int8_best.log")) is None
    assert parse_performance_summary(read("trtexec_10.16.1_h100pcie_dumpLayerInfo_detailed.log")) is None


def test_performance_summary_ignores_explanations_block():
    # The 8.6.0 --verbose log explains each metric after the summary; values must not change.
    s = parse_performance_summary(read("trtexec_8.6.0_rtx3090_loadengine_cnn_verbose_run.log"))
    assert s["gpu_compute_time"]["max_ms"] == pytest.approx(0.609253)
    assert s["total_host_walltime_s"] == pytest.approx(3.00012)


def test_inference_shapes():
    s = parse_inference_shapes(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log"))
    assert s["inputs"] == {"x": [1, 1, 28, 28]}
    assert s["outputs"] == {"y": [1, 10], "z": [1]}
    s = parse_inference_shapes(read("trtexec_8.6.1_h100pcie_onnx_yolo11s_fp16_build_run.log"))
    assert s["inputs"] == {"images": [1, 3, 1280, 1280]}
    s = parse_inference_shapes(read("trtexec_8.6.0_rtx3090_loadengine_cnn_verbose_run.log"))
    assert s["inputs"] == {"tensor-0": [4, 1, 28, 28]}


def test_inference_shapes_names_with_spaces_and_colons():
    """trtexec prints the tensor name as it is (sampleInference.cpp: `<< " binding for " << name
    << " with dimensions "`); the captured lines with their name replaced (derived text)."""
    text = read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log")
    text = text.replace("binding for x ", "binding for in put:0 ").replace(
        "binding for y ", "binding for out, 1 ")
    s = parse_inference_shapes(text)
    assert s["inputs"] == {"in put:0": [1, 1, 28, 28]}
    assert s["outputs"] == {"out, 1": [1, 10], "z": [1]}


# --------------------------------------------------------------------------------------------
# Unknown options (11.x rejects the weak-typing flags; 10.x removed --workspace etc.)
# --------------------------------------------------------------------------------------------
def test_unknown_options_11():
    name = "trtexec_11.0.0_b200_stronglytyped_skipinference_then_unknown_option_fp16_int8_best.log"
    for text in (read(name), read(name).replace("\n", " \n")):  # with raw trtexec's trailing space
        assert parse_unknown_options(text) == [
            "--fp16", "--int8", "--best", "--precisionConstraints=obey"]


def test_unknown_options_10_jetson_trailing_space():
    text = read("unverified/trtexec_10.3.0_jetson_unknown_option_workspace_buildOnly_explicitBatch.log")
    assert "--buildOnly \n" in text  # the raw trailing space is really there
    assert parse_unknown_options(text) == ["--workspace=2048", "--buildOnly", "--explicitBatch"]
    assert error_lines(text)[-1].startswith("&&&& FAILED")


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
    assert parse_version_mismatch(read(name)) == {"kind": kind, "expected": expected, "got": got}


def test_version_mismatch_absent_in_clean_log():
    assert parse_version_mismatch(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log")) is None


def test_plan_version_documented_form():
    # No public capture of --getPlanVersionOnly exists; this is the line trtexec's
    # printPlanVersion() writes through its info logger (format documented in trt_tools).
    line = "[01/01/2025-00:00:00] [I] Plan was created with TensorRT version 10.3.0.30\n"
    assert parse_plan_version(line) == (10, 3, 0, 30)
    assert parse_plan_version(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log")) is None


def test_plan_header_info_layout():
    h = plan_header_info(_header())
    assert h["is_plan"] and h["version"] == (10, 3, 0, 30) and h["serialization"] == 0
    assert plan_header_info(_header(ser=7))["version"] is None  # other layouts: no claim
    assert plan_header_info(b"")["looks_like"] == "empty file"
    # An ONNX file: protobuf field 1 (ir_version) varint -> first byte 0x08.
    onnx_head = bytes([0x08, 0x08, 0x12, 0x07]) + b"pytorch" + bytes(20)
    assert plan_header_info(onnx_head) == {"n_bytes": len(onnx_head), "is_plan": False,
                                              "serialization": None, "version": None,
                                              "looks_like": "ONNX model (protobuf)"}
    assert plan_header_info(b'{"Layers": []}')["looks_like"] == "JSON"


def test_plan_header_of_a_real_onnx_file(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(g), str(tmp_path / "m.onnx"))
    head = (tmp_path / "m.onnx").read_bytes()[:PLAN_HEADER_BYTES]
    assert plan_header_info(head)["looks_like"] == "ONNX model (protobuf)"


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
    s = parse_layer_info(read(name))
    assert s["detailed"] is True and s["advice"] is None
    assert s["n_layers"] == n
    assert s["reformat_layers"] == reformat
    assert s["reformat_by_origin"] == origins
    assert s["reformat_noop"] == noop
    assert s["output_dtypes"] == dtypes
    assert s["spelling"] == spelling
    table = layer_dtype_table(s)
    assert len(table) == n and all(r["output_dtypes"] for r in table)


def test_layer_info_qdq_reformat_is_int8_output():
    s = parse_layer_info(read("layerinfo_8.4_titanrtx_mobilenetv2_qat_int8_detailed.graph.json"))
    first = s["layers"][0]
    assert (first["name"], first["type"], first["origin"]) == ("QuantizeLinear_2", "Reformat", "QDQ")
    assert first["outputs"][0]["dtype"] == "INT8"


def test_layer_info_10x_bindings_and_myelin():
    s = parse_layer_info(read("layerinfo_10.16.1_h100pcie_cnn_fp32_detailed.json"))
    assert s["io_tensors"] == ["x", "y", "z"]
    assert s["layer_types"] == {"CaskConvolution": 2, "CaskPooling": 2, "gemm": 1, "kgen": 4}


def test_layer_info_names_only():
    s = parse_layer_info(read("layerinfo_8.6.0_rtx3090_cnn_names_only_nondetailed.json"))
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
    s = parse_layer_info(json.dumps(info))
    assert s["output_dtypes"] == {"FP16": 1} and s["spelling"] == ["split"]
    assert s["io_tensors"] == ["x", "y"]


def test_layer_info_rejects_other_json():
    with pytest.raises(StageError):
        parse_layer_info(read("exportProfile_8.4_a100_resnet_fp16.profile.json"))


@pytest.mark.parametrize("fmt,dtype", [
    ("Row major linear FP32", "FP32"), ("Channel major FP16 format where channel % 8 == 0", "FP16"),
    ("Thirty-two wide channel vectorized row major Int8 format", "INT8"),
    ("Two wide channel vectorized row major BFloat16 format", "BF16"), ("Float", "FP32"),
    ("Half", "FP16"), ("Int64", "INT64"), ("Row major linear FP8 format", "FP8"), ("Int4", "INT4"),
])
def test_dtype_of(fmt, dtype):
    assert dtype_of(fmt) == dtype


@pytest.mark.parametrize("name,count,n,reformats", [
    ("exportProfile_8.4_a100_resnet_fp16.profile.json", 1, 36, 12),
    ("exportProfile_8.4_a100_resnet_qat_int8.profile.json", 1, 37, 3),
    ("exportProfile_8.4_titanrtx_mobilenetv2_qat_int8.profile.json", 8657, 58, 1),
    ("exportProfile_unknownver_detr_resnet50_int8.profile.json", 641, 840, 247),
])
def test_export_profile(name, count, n, reformats):
    s = parse_export_profile(read(name))
    assert (s["count"], s["n_layers"], s["reformat_layers"]) == (count, n, reformats)
    assert 0 < s["reformat_percent"] < 100 and 0 < s["reformat_average_ms"] < s["total_average_ms"]


@pytest.mark.slow
def test_parse_ldd_real_output():
    out = subprocess.run(["ldd", sys.executable], capture_output=True, text=True).stdout
    libs = parse_ldd(out + "\tlibnvinfer.so.10 => not found\n")
    assert libs["libnvinfer.so.10"] is None
    assert any(k.startswith("libc.so") and v and Path(v).exists() for k, v in libs.items())


# --------------------------------------------------------------------------------------------
# DLA placement (captures: NVIDIA-AI-IOT/jetson_dla_tutorial README, TensorRT 8.4 on Orin)
# --------------------------------------------------------------------------------------------
def test_dla_placement_gn_model():
    p = parse_dla_placement(read("dla_placement_8.4_orin_model_gn_int8.log"))
    assert p["block_found"] and not p["no_dla_layer"]
    assert [(e["first"], e["last"]) for e in p["dla"]] == [
        ("Conv_0", "Conv_0"), ("Relu_10", "Conv_11"), ("Relu_21", "Conv_22"),
        ("Relu_32", "Conv_33"), ("Relu_43", "Relu_43")]
    assert [e["type"] for e in p["gpu"]] == ["SHUFFLE", "PLUGIN_V2", "SHUFFLE", "SCALE", "SCALE",
                                            "SHUFFLE"]
    assert p["gpu"][1]["text"] == "PLUGIN_V2: InstanceNormalization_5"


def test_dla_fraction_on_onnx_node_order():
    # The capture's node names; the nodes between them are constructed (legacy exporter
    # numbering of the tutorial's ModelBN: 4 Conv+ReLU, GAP, the view() shape ops, Gemm).
    p = parse_dla_placement(read("dla_placement_8.4_orin_model_bn_int8.log"))
    nodes = [("Conv_0", "Conv"), ("Relu_1", "Relu"), ("Conv_2", "Conv"), ("Relu_3", "Relu"),
             ("Conv_4", "Conv"), ("Relu_5", "Relu"), ("Conv_6", "Conv"), ("Relu_7", "Relu"),
             ("GlobalAveragePool_8", "GlobalAveragePool"), ("Shape_9", "Shape"),
             ("Constant_10", "Constant"), ("Gather_11", "Gather"), ("Unsqueeze_12", "Unsqueeze"),
             ("Concat_13", "Concat"), ("Reshape_14", "Reshape"), ("Gemm_15", "Gemm")]
    f = dla_fraction(p, nodes)
    assert f["dla_nodes"] == [n for n, _ in nodes[:8]] + ["Gemm_15"]
    assert f["gpu_nodes"] == ["GlobalAveragePool_8"]
    assert f["fraction"] == pytest.approx(9 / 10)
    assert f["n_dla_subgraphs"] == 2 and f["n_gpu_layers"] == 2
    assert f["unmatched"] == ["SHUFFLE: copied_squeeze_after_(Unnamed Layer* 20) [ElementWise]"]
    assert f["unplaced"] == ["Gather_11", "Unsqueeze_12", "Concat_13", "Reshape_14"]
    # After the tutorial replaced GlobalAveragePool: one DLA subgraph Conv_0...Gemm_15.
    p2 = parse_dla_placement(read("dla_placement_8.4_orin_model_bn_avgpool.log"))
    nodes2 = [(n, "AveragePool" if n.startswith("Global") else t) for n, t in nodes]
    assert dla_fraction(p2, nodes2)["fraction"] == 1.0
    assert dla_fraction(p, None)["fraction"] is None  # no ONNX order, no fraction


def test_dla_fallback_warnings_and_no_dla_layer():
    p = parse_dla_placement(read("dla_fallback_warnings_yolo_jetson_dla_tutorial_issue3.log"))
    assert not p["block_found"] and len(p["fallback"]) == 9
    assert p["fallback"][0] == {"name": "/model.24/Constant_1_output_0", "type": "CONSTANT"}
    assert p["fallback"][1] == {"name": "(Unnamed Layer* 277) [Shuffle]", "type": "SHUFFLE"}
    p = parse_dla_placement(read("dla_no_layer_on_dla_samplenmt_issue2318.log"))
    assert p["no_dla_layer"] and len(p["fallback"]) == 10
    assert p["fallback"][0]["name"] == "Embedding matrix"
    assert dla_fraction(p, [("a", "Conv")])["fraction"] == 0.0
    assert parse_dla_placement(read("trtexec_10.16.1_h100pcie_onnx_cnn_build_run.log")) is None


# --------------------------------------------------------------------------------------------
# Calibration caches (real files)
# --------------------------------------------------------------------------------------------
def test_calibration_cache_written_by_tensorrt_8_2_4():
    c = parse_calibration_cache(read("calib_cache_8.2.4_cookbook_plugin_int8.cache"))
    assert c["version"] == (8, 2, 4) and c["algorithm"] == "EntropyCalibration2"
    assert list(c["scales"]) == ["inputT0", "(Unnamed Layer* 0) [PluginV2DynamicExt]_output_0",
                                 "(Unnamed Layer* 1) [Identity]_output"]
    # 0x3f4014c9: exponent 126 (2^-1), mantissa 1 + 0x4014c9 / 2^23
    assert c["scales"]["inputT0"] == pytest.approx(2 ** -1 * (1 + 0x4014C9 / 2 ** 23))


def test_calibration_cache_from_nvidia_qdq_translator():
    text = read("calib_cache_qdq_translator_8600_yolov5_cudla_samples.cache")
    c = parse_calibration_cache(text)
    assert c["version"] == (8, 6, 0) and len(c["scales"]) == len(text.splitlines()) - 1
    # 0x3c00f9f4: exponent 120 (2^-7), mantissa 1 + 0x00f9f4 / 2^23
    assert c["scales"]["images"] == pytest.approx(2 ** -7 * (1 + 0x00F9F4 / 2 ** 23))
    with pytest.raises(StageError):
        parse_calibration_cache("TRT-8600-EntropyCalibration2\nnot a line\n")
