"""Stage 6 (6_build_engines.py) without TensorRT: skips, usage errors, --help, dry runs per version
(opset conversion, DLA, INT4), and the build path driven by a stand-in trtexec."""

from __future__ import annotations
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploykit.errors import StageError
from deploykit.trt.detect import Detected, JETPACK_TRTEXEC
from deploykit.trt.parsers import parse_calibration_cache
from deploykit.trt.rules import DEFAULT_VARIANTS

from tests.helpers.stages import ROOT, load_stage
from tests.helpers.trt_captures import read
from tests.helpers.trt_models import _env, conv_net, qdq_net, save, two_input_net


DATA = ROOT / "tests" / "data" / "trt"


def shared_dim_net():
    """Two inputs that share the named dims N and L: tokens [N, L, 16], mask [N, L]."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("ReduceSum", ["tokens"], ["t"], axes=[2], keepdims=0, name="sum"),
             helper.make_node("Add", ["t", "mask"], ["y"], name="add")]
    g = helper.make_graph(nodes, "shared",
                          [helper.make_tensor_value_info("tokens", TensorProto.FLOAT,
                                                         ["N", "L", 16]),
                           helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", "L"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.ir_version = 8
    return m


@pytest.mark.slow
def test_named_dims_need_overlapping_profile_ranges(tmp_path):
    """Inputs with the same ONNX dim name must get overlapping profile intervals (TensorRT
    samples/sampleNamedDimensions README, 8.5.1+): disjoint ones are a usage error naming the dim,
    not a trtexec failure after the build started."""
    model = "mypkg.seq:build"
    save(shared_dim_net(), tmp_path / "a" / "mypkg.seq-build" / "onnx" / "fp32.onnx")
    ok = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
                "--input-shape", "tokens:1,20,16", "--input-shape", "mask:1,20", model=model)
    assert ok.returncode == 0 and len(trtexec_lines(ok.stdout)) == 1, ok.stderr
    p = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
               "--input-shape", "tokens:1,20,16", "--input-shape", "mask:1,30", model=model)
    assert p.returncode == 2 and trtexec_lines(p.stdout) == [], p.stdout
    assert "'L'" in p.stderr and "tokens axis 1" in p.stderr and "mask axis 1" in p.stderr


@pytest.mark.slow
def test_stage6_dry_run_refuses_tensorrt_before_8_5(tmp_path):
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.2.1", "fp32")
    assert p.returncode == 2 and "TensorRT 8.2.1 is not supported" in p.stderr, p.stderr
    assert trtexec_lines(p.stdout) == []


def stage6(tmp_path, *args, model="mobilenet_v3_small", env=None):
    return subprocess.run(["bash", "6_build_engines.sh", *args], cwd=ROOT,
                          env=env or _env(tmp_path, model), capture_output=True, text=True,
                          timeout=300)


def trtexec_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("trtexec --onnx")]


@pytest.mark.slow
def test_stage6_skips_without_trtexec(tmp_path):
    if Path(JETPACK_TRTEXEC).exists():
        pytest.skip("trtexec is installed here")
    p = stage6(tmp_path)
    assert p.returncode == 0, p.stderr
    assert "SKIPPED" in p.stdout and "trtexec not found" in p.stdout
    rows = sorted((tmp_path / "r" / "mobilenet_v3_small").glob("trt_build_*.json"))
    assert [r.stem for r in rows] == sorted(f"trt_build_{v}" for v in DEFAULT_VARIANTS)
    for r in rows:
        rec = json.loads(r.read_text())
        assert rec["status"] == "skipped" and "trtexec not found" in rec["reason"]
        assert rec["backend"] == "TensorRT" and rec["stage"] == "6_build_engines"
        assert not any(k in rec for k in ("trtexec_perf", "latency", "size_mb"))  # no numbers
    assert json.loads((tmp_path / "r/mobilenet_v3_small/trt_build_int4_cli_broken.json").read_text()
                      )["expected_failure"] is True
    assert not (tmp_path / "a" / "mobilenet_v3_small" / "engines").exists()


@pytest.mark.slow
def test_stage6_bad_trtexec_env_skips_with_reason(tmp_path):
    env = {**_env(tmp_path), "TRTEXEC": str(tmp_path / "missing" / "trtexec")}
    p = stage6(tmp_path, "fp16", env=env)
    assert p.returncode == 0, p.stderr
    rec = json.loads((tmp_path / "r/mobilenet_v3_small/trt_build_fp16.json").read_text())
    assert rec["status"] == "skipped" and "is not an executable file" in rec["reason"]
    assert not (tmp_path / "r/mobilenet_v3_small/trt_build_fp32.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["bogus"], ["--dry-run"], ["--dla-min-fraction", "0.5"],
                                   ["--dla-core", "0", "--dla-min-fraction", "2"],
                                   ["--max-batch", "0"]])
def test_stage6_usage_errors_exit_2(tmp_path, extra):
    p = stage6(tmp_path, *extra)
    assert p.returncode == 2 and "usage:" in p.stderr, p.stderr


@pytest.mark.slow
def test_stage6_help_shows_every_flag_with_help():
    p = subprocess.run([sys.executable, "6_build_engines.py", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0
    for f in ("--input-shape", "--min-shapes", "--opt-shapes", "--max-shapes", "--dla-core",
              "--dla-min-fraction", "--int8-path", "--trt-version", "--model"):
        assert f in p.stdout
    assert "Stage 6: build one TensorRT engine per ONNX variant" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("version,present,absent", [
    ("8.6.1", ["--fp16", "--int8"], ["--stronglyTyped", "--getPlanVersionOnly"]),
    ("10.3.0", ["--stronglyTyped", "--getPlanVersionOnly"], ["--fp16", "--int8"]),
    ("11.0.0", ["--getPlanVersionOnly"], ["--fp16", "--int8", "--best", "--stronglyTyped"]),
])
def test_stage6_dry_run(tmp_path, version, present, absent):
    p = stage6(tmp_path, "--dry-run", "--trt-version", version)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("trtexec")]
    words = {w.split("=")[0] for ln in lines for w in ln.split()}
    assert all(f in words for f in present) and not any(f in words for f in absent)
    assert len(trtexec_lines(p.stdout)) == (4 if version.startswith("8") else 6)
    assert not (tmp_path / "r").exists() and not (tmp_path / "a").exists()  # writes nothing


@pytest.mark.slow
def test_stage6_dry_run_custom_model_two_inputs_colon_name_dynamic_hw(tmp_path):
    """The three faults of issue 13 on a custom model: only the first input got shapes, a name
    with ':' was unquoted, dynamic H/W raised TypeError."""
    model = "mypkg.net:build"
    art = tmp_path / "a" / "mypkg.net-build" / "onnx"
    save(two_input_net(), art / "fp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
               "--input-shape", "image:0:1,3,64,64", "--input-shape", "tokens:1,20,16",
               "--max-batch", "8", model=model)
    assert p.returncode == 0, p.stderr
    (line,) = trtexec_lines(p.stdout)
    args = line.split()
    assert "'--minShapes='\"'\"'image:0'\"'\"':1x3x64x64,tokens:1x20x16'" in args
    assert "'--maxShapes='\"'\"'image:0'\"'\"':8x3x64x64,tokens:8x20x16'" in args
    # without sizes for H/W: a usage error naming the input and the flag, not a traceback
    p = stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0", "--model", model, "fp32",
               model=model)
    assert p.returncode == 2 and "'image:0' axis 2 is dynamic" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_stage6_dry_run_dla_static_implicit_and_refusals(tmp_path):
    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(fp16=True), d / "fp16.onnx")
    save(conv_net(opset=17), d / "fp32.onnx")
    save(qdq_net(False), d / "int8.onnx")
    for version in ("8.5.2", "8.6.2", "10.3.0"):
        p = stage6(tmp_path, "--dry-run", "--trt-version", version, "--dla-core", "0",
                   "fp32", "fp16", "int8")
        assert p.returncode == 0, p.stderr
        fp32, fp16, int8 = trtexec_lines(p.stdout)
        assert "--useDLACore" not in fp32 and "--maxShapes=input:64x3x8x8" in fp32
        assert {"--useDLACore=0", "--allowGPUFallback", "--fp16",
                "--maxShapes=input:1x3x8x8"} <= set(fp16.split())
        assert "--onnx=" + str(d / "fp32.onnx") in int8.split()  # implicit: FP32 ONNX + cache
        assert {"--int8", "--fp16", "--useDLACore=0", "--maxShapes=input:1x3x8x8"} <= set(
            int8.split())
        assert any(w.startswith("--calib=") and w.endswith("int8.calib.cache")
                   for w in int8.split())
        assert "DLA takes INT8 from a calibration cache" in p.stdout
        assert "calibration cache: 2 activation scales" in p.stdout
    # a version without DLA: the dry run refuses as the build does (exit 2, the reason), it does
    # not print GPU command lines that the build would never run
    for version, why in (("10.16.1", "10.7 was the last"), ("11.0.0", "no DLA support"),
                         ("11.4.0", "no DLA support")):
        p = stage6(tmp_path, "--dry-run", "--trt-version", version, "--dla-core", "0", "fp16")
        assert p.returncode == 2 and why in p.stderr and "--dla-core" in p.stderr, p.stderr
        assert trtexec_lines(p.stdout) == []


@pytest.mark.slow
def test_stage6_dry_run_trt8_converts_opset19_qdq(tmp_path):
    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(opset=17), d / "fp32.onnx")
    save(qdq_net(True), d / "int8.onnx")
    save(qdq_net(False), d / "int8_hp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "int8", "int8_hp32")
    assert p.returncode == 0, p.stderr
    int8, hp32 = trtexec_lines(p.stdout)
    assert str(tmp_path / "a/mobilenet_v3_small/engines/int8.opset17.onnx") in int8
    assert {"--int8", "--fp16"} <= set(int8.split()) and "--fp16" not in hp32.split()
    assert "opset 19 -> 17" in p.stdout and "widened to float32" in p.stdout
    assert "ModelOpt 0.47.0 writes INT8 Q/DQ at opset >= 19" in p.stdout  # the advice text
    assert "re-export with" not in p.stdout  # the old advice that could not work
    # forcing the implicit path
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "--int8-path", "implicit", "int8")
    (line,) = trtexec_lines(p.stdout)
    assert "fp32.onnx" in line and "--calib=" in line


@pytest.mark.slow
def test_stage6_dry_run_unconvertible_qdq_takes_implicit_path(tmp_path):
    from onnx import helper

    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(opset=17), d / "fp32.onnx")
    m = qdq_net(False)
    m.graph.node.append(helper.make_node("Relu", ["logits"], ["z"], domain="com.microsoft"))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save(m, d / "int8.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "int8")
    assert p.returncode == 0, p.stderr
    assert "no exact opset-17 copy of int8.onnx" in p.stdout and "implicit INT8 instead" in p.stdout
    assert "--calib=" in trtexec_lines(p.stdout)[0]
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.2", "--int8-path", "qdq", "int8")
    assert "not built" in p.stdout and "no exact opset-17 form" in p.stdout


@pytest.mark.slow
def test_stage6_dry_run_trt8_float_files_above_17(tmp_path):
    """TensorRT 8.x gets an exact opset-17 copy of any file it reads; a file without one is
    skipped with the re-export advice, never passed to the 8.x parser as is."""
    from onnx import helper

    d = tmp_path / "a" / "mobilenet_v3_small" / "onnx"
    save(conv_net(opset=18), d / "fp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.1", "fp32")
    assert p.returncode == 0, p.stderr
    assert "fp32.onnx is opset 18" in p.stdout and "fp32.opset17.onnx" in trtexec_lines(p.stdout)[0]
    assert trtexec_lines(stage6(tmp_path, "--dry-run", "--trt-version", "10.3.0",
                                "fp32").stdout)[0].split()[1] == f"--onnx={d / 'fp32.onnx'}"
    m = conv_net(opset=18)
    m.graph.node.append(helper.make_node("Relu", ["l"], ["z"], domain="com.microsoft"))
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save(m, d / "fp32.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.1", "fp32")
    assert p.returncode == 0 and trtexec_lines(p.stdout) == []
    assert "not built" in p.stdout and "--exporter legacy --opset 17" in p.stdout


def int4_net():
    """INT4 weight-only: a blocked DequantizeLinear of INT4 weights into a MatMul, opset 21 (the
    first opset with INT4 and block_size), as ModelOpt's INT4 output."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(3).integers(-8, 8, (16, 8)).astype(np.int8)
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], axis=0, block_size=16,
                              name="w_dq"),
             helper.make_node("MatMul", ["input", "w"], ["logits"], name="mm")]
    g = helper.make_graph(
        nodes, "int4", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor("wq", TensorProto.INT4, [16, 8], w.flatten().tolist()),
         numpy_helper.from_array(np.full((1, 8), 0.1, np.float32), "ws")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    return m


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["int4", "int4_cli_broken"])
def test_stage6_dry_run_int4_on_trt8_says_int4_needs_10(tmp_path, variant):
    """An INT4 file on TensorRT 8.x is skipped because INT4 needs TensorRT 10+, not with advice to
    re-export at opset 17 (an INT4 file has no opset-17 form, and stage 2 does not make it)."""
    save(int4_net(), tmp_path / "a" / "mobilenet_v3_small" / "onnx" / f"{variant}.onnx")
    p = stage6(tmp_path, "--dry-run", "--trt-version", "8.6.1", variant)
    assert p.returncode == 0, p.stderr
    skip = [ln for ln in p.stdout.splitlines() if "not built" in ln]
    assert len(skip) == 1 and "INT4 weight-only Q/DQ graphs need TensorRT 10+" in skip[0], p.stdout
    assert "2_export_onnx.py" not in p.stdout and "opset 17" not in skip[0]


@pytest.mark.slow
def test_stage6_skip_names_missing_onnx(tmp_path):
    """Without trtexec every row is skipped; a variant whose ONNX was never made says which
    stage makes it, one whose ONNX exists only says trtexec is missing."""
    if Path(JETPACK_TRTEXEC).exists():
        pytest.skip("trtexec is installed here")
    save(conv_net(opset=18), tmp_path / "a" / "mobilenet_v3_small" / "onnx" / "fp32.onnx")
    p = stage6(tmp_path, "fp32", "int8")
    assert p.returncode == 0, p.stderr
    res = tmp_path / "r" / "mobilenet_v3_small"
    fp32 = json.loads((res / "trt_build_fp32.json").read_text())["reason"]
    int8 = json.loads((res / "trt_build_int8.json").read_text())["reason"]
    assert "missing" not in fp32 and "trtexec not found" in fp32
    assert "int8.onnx missing" in int8 and "5_quantize.sh" in int8


# --------------------------------------------------------------------------------------------
# Stage 6 build path, driven by a stand-in trtexec (placeholder plan; replays a real DLA block)
# --------------------------------------------------------------------------------------------
FAKE_TRTEXEC = """#!/bin/sh
# Test double for trtexec: writes placeholder files named by --saveEngine/--exportLayerInfo,
# prints the build-log text in $FAKE_TRTEXEC_LOG, then trtexec's PASSED line.
for a in "$@"; do
  case "$a" in
    --saveEngine=*) printf 'ftrt' > "${a#--saveEngine=}" ;;
    --exportLayerInfo=*) printf '{"Layers": ["x"], "Bindings": []}' > "${a#--exportLayerInfo=}" ;;
  esac
done
echo "args: $*"
[ -n "$FAKE_TRTEXEC_LOG" ] && cat "$FAKE_TRTEXEC_LOG"
echo "&&&& PASSED TensorRT.trtexec [TensorRT v8602] # trtexec"
"""


BN_NODE_NAMES = ["Conv_0", "Relu_1", "Conv_2", "Relu_3", "Conv_4", "Relu_5", "Conv_6", "Relu_7",
                 "GlobalAveragePool_8", "Reshape_14", "Gemm_15"]


@pytest.fixture()
def fake_build(tmp_path, monkeypatch):
    """Run 6_build_engines.main in-process with a stand-in trtexec and TensorRT 8.6.2 on a
    Jetson as what detection finds."""
    exe = tmp_path / "bin" / "trtexec"
    exe.parent.mkdir()
    exe.write_text(FAKE_TRTEXEC)
    exe.chmod(0o755)
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    stage = load_stage("6_build_engines")
    det = Detected(str(exe), (8, 6, 2), (8, 6, 2), "/usr/lib/libnvinfer.so.8", (8, 6, 2),
                      None, "no tensorrt here", dict(os.environ))
    monkeypatch.setattr(stage, "find_trtexec", lambda env=None: (exe, "TRTEXEC"))
    monkeypatch.setattr(stage, "detect_with_loader_fix", lambda t, env=None: (det, []))
    monkeypatch.setattr(stage, "jetson_info", lambda: {"l4t": "R36 (release)", "l4t_major": 36,
                                                    "model": "test", "dla_cores": 2})

    def run(*argv, log=None):
        det.env["FAKE_TRTEXEC_LOG"] = str(DATA / log) if log else ""
        args = stage.get_args_parser().parse_args(list(argv))
        return stage.main(args)
    return run, tmp_path / "r" / "mobilenet_v3_small", tmp_path / "a" / "mobilenet_v3_small"


@pytest.mark.slow
def test_stage6_dla_fraction_fails_the_row_below_the_minimum(fake_build):
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    run("--dla-core", "0", "fp16", log="dla_placement_8.4_orin_model_bn_int8.log")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok" and rec["dla"]["fraction"] == pytest.approx(0.9)
    assert rec["dla"]["gpu_layers"] == ["GlobalAveragePool_8"] and rec["dla"]["warning"] is None
    assert rec["profile"][0]["max"] == [1, 3, 8, 8]  # static profile, recorded for stage 7
    with pytest.raises(StageError, match="engine build failed for fp16"):
        run("--dla-core", "0", "--dla-min-fraction", "0.95", "fp16",
            log="dla_placement_8.4_orin_model_bn_int8.log")
    # The failed rebuild kept no plan, so the earlier good row (and plan) stay; the failure is
    # written beside it.
    assert json.loads((res / "trt_build_fp16.json").read_text())["status"] == "ok"
    rec = json.loads((res / "trt_build_fp16.failed.json").read_text())
    assert rec["status"] == "failed" and "below --dla-min-fraction 95%" in rec["reason"]
    assert "9 layer(s) on DLA, 1 on the GPU (90% on DLA)" in rec["reason"]


@pytest.mark.slow
def test_stage6_failed_dla_check_keeps_no_plan_and_the_earlier_one(fake_build):
    """A build whose row fails (DLA share below --dla-min-fraction) leaves no plan of its own under
    the final name, where stage 7 would evaluate it as built, and does not replace the plan of an
    earlier good build."""
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    plan = art / "engines" / "fp16.plan"
    with pytest.raises(StageError):  # first build ever, below the minimum
        run("--dla-core", "0", "--dla-min-fraction", "0.95", "fp16",
            log="dla_placement_8.4_orin_model_bn_int8.log")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "failed" and not plan.exists() and rec.get("plan") is None
    run("--dla-core", "0", "fp16", log="dla_placement_8.4_orin_model_bn_int8.log")  # a good one
    plan.write_bytes(b"ftrt-earlier-good-plan")
    with pytest.raises(StageError):
        run("--dla-core", "0", "--dla-min-fraction", "0.95", "fp16",
            log="dla_placement_8.4_orin_model_bn_int8.log")
    assert plan.read_bytes() == b"ftrt-earlier-good-plan"
    assert not [f.name for f in plan.parent.iterdir() if f.name.startswith(".tmp-")]


@pytest.mark.slow
def test_stage6_dla_fraction_counts_unnamed_onnx_nodes(fake_build, tmp_path):
    """TensorRT's ONNX parser names the layer of an unnamed node ``node_of_<first output>``
    (onnx-tensorrt getNodeName, release/8.5-GA to main), and the DLA block uses those names. The
    log here is the real captured block with its layer names mapped to the names TensorRT gives
    this test's unnamed nodes (a derived text, not a capture)."""
    run, res, art = fake_build
    m = conv_net(fp16=True)
    for n in m.graph.node:
        n.name = ""
    save(m, art / "onnx" / "fp16.onnx")
    log = read("dla_placement_8.4_orin_model_bn_int8.log")
    for captured, trt_name in (("Conv_0", "node_of_c0"), ("Relu_7", "node_of_r3"),
                               ("Gemm_15", "node_of_l"), ("GlobalAveragePool_8", "node_of_g")):
        log = log.replace(captured, trt_name)
    (tmp_path / "unnamed.log").write_text(log)
    run("--dla-core", "0", "--dla-min-fraction", "0.8", "fp16", log=str(tmp_path / "unnamed.log"))
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok", rec["reason"]
    assert rec["dla"]["fraction"] == pytest.approx(0.9)  # as for the named nodes above
    assert rec["dla"]["gpu_layers"] == ["node_of_g"] and "node_of_c0" in rec["dla"]["dla_layers"]


@pytest.mark.slow
def test_stage6_dla_default_warns_below_half(fake_build, capsys):
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    run("--dla-core", "0", "fp16", log="dla_no_layer_on_dla_samplenmt_issue2318.log")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok" and rec["dla"]["fraction"] == 0.0
    assert "no layer in the network can run on DLA" in rec["dla"]["warning"]
    assert "DLA:" in capsys.readouterr().err


@pytest.mark.slow
def test_stage6_builds_8x_int8_from_an_exact_opset17_copy(fake_build):
    run, res, art = fake_build
    save(conv_net(opset=17), art / "onnx" / "fp32.onnx")
    save(qdq_net(True), art / "onnx" / "int8.onnx")
    run("int8")
    rec = json.loads((res / "trt_build_int8.json").read_text())
    assert rec["status"] == "ok" and rec["int8_path"] == "qdq_opset17"
    assert rec["opset17_parity"]["exact"] is True
    assert Path(rec["onnx_built"]).name == "int8.opset17.onnx" and Path(rec["onnx_built"]).exists()
    assert "--onnx=" + rec["onnx_built"] in rec["command"]


@pytest.mark.slow
def test_stage6_dla_int8_writes_the_calibration_cache(fake_build):
    run, res, art = fake_build
    save(conv_net(opset=17), art / "onnx" / "fp32.onnx")
    save(qdq_net(False), art / "onnx" / "int8.onnx")
    run("--dla-core", "0", "int8", log="dla_placement_8.4_orin_model_gn_int8.log")
    rec = json.loads((res / "trt_build_int8.json").read_text())
    assert rec["int8_path"] == "implicit" and rec["calibration_scales"] == 2
    cache = parse_calibration_cache(Path(rec["calib_cache"]).read_text())
    assert cache["version"] == (8, 6, 2) and set(cache["scales"]) == {"input", "r0"}
    assert rec["dla"]["placement_found"] and rec["dla"]["warning"]  # GN capture: names differ


@pytest.mark.slow
def test_stage6_plan_never_written_through_a_link_at_the_old_temporary_name(fake_build, tmp_path):
    """trtexec wrote the plan to ``.tmp-<pid>-<variant>.plan`` (predictable): a link planted
    there made the build overwrite what it pointed to. Now a fresh private folder."""
    run, res, art = fake_build
    save(conv_net(fp16=True, names=BN_NODE_NAMES), art / "onnx" / "fp16.onnx")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    engines = art / "engines"
    engines.mkdir(parents=True)
    for name in ("fp16.plan", "fp16.layers.json", "fp16.build.log"):
        (engines / f".tmp-{os.getpid()}-{name}").symlink_to(victim)
    run("fp16")
    assert victim.read_bytes() == b"precious"
    assert (engines / "fp16.plan").read_bytes() == b"ftrt"
    assert not [f for f in engines.iterdir() if f.is_dir()]


@pytest.mark.slow
def test_stage6_refuses_an_onnx_made_from_another_fp32_unless_allowed(fake_build, capsys):
    """fp16.onnx whose export.json names another fp32.onnx than the one now on disk: refused
    (exit 1, naming the file, the remaking command and the override); --allow-stale-source
    builds it and the row records stale_source; the row's source links plan, ONNX and fp32."""
    from deploykit.io import sha256_file, write_json
    from deploykit.results import source_of

    run, res, art = fake_build
    fp32 = save(conv_net(), art / "onnx" / "fp32.onnx")
    fp16 = save(conv_net(fp16=True), art / "onnx" / "fp16.onnx")
    write_json(res / "export.json", {"files": {
        "fp32": {"path": str(fp32), "sha256": "0" * 64},  # an earlier export
        "fp16": {"path": str(fp16), "sha256": sha256_file(fp16)}},
        "provenance": {"command": "2_export_onnx.py --model mobilenet_v3_small"}})
    with pytest.raises(StageError, match=r"refusing to build engines from stale ONNX files: "
                                         r"fp16 .*--allow-stale-source"):
        run("fp16")
    assert "is stale: it was made from an fp32.onnx with sha256 000000000000" in \
        capsys.readouterr().err
    assert not (res / "trt_build_fp16.json").exists()
    run("--allow-stale-source", "fp16")
    rec = json.loads((res / "trt_build_fp16.json").read_text())
    assert rec["status"] == "ok" and "re-exported since" in rec["stale_source"]
    plan = Path(rec["plan"])
    assert rec["source"]["output"]["sha256"] == sha256_file(plan)
    assert rec["source"]["onnx"]["sha256"] == sha256_file(fp16)
    assert rec["source"]["fp32"]["sha256"] == "0" * 64
    assert "2_export_onnx.py" in rec["source"]["made_by"][0]
    assert source_of("mobilenet_v3_small", plan)["record"] == "trt_build_fp16.json"
    # the FP32 engine: its source is the fp32.onnx itself, nothing stale
    run("fp32")
    rec = json.loads((res / "trt_build_fp32.json").read_text())
    assert rec["stale_source"] is None and rec["source"]["fp32"]["sha256"] == sha256_file(fp32)
