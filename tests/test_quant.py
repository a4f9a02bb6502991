"""Stages 4, 5, 5b and qdq_tools.py: INT4 axis detection/repair on models ModelOpt really
produced, block-size choice, calibration keyed to the model's input name, calibration/eval
disjointness, depthwise listing on MobileNetV3-Small (random init: structure only)."""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deploykit.compare import parity
from deploykit.data.images import list_images, load_image_rgb, normalize, preprocess_image
from deploykit.errors import StageError, UsageError
from deploykit.io import sha256_file, write_json
from deploykit.layout import DEFAULT_DATA, model_artifacts, splits_path
from deploykit.models import build_model, model_spec
from deploykit.onnx.graph import attr, load_onnx
from deploykit.quant.inspect import activation_stats, inspect_model
from deploykit.quant.int4 import check_blocked_dq, fix_int4_axis
from deploykit.quant.nodes import list_depthwise, list_stem

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402

make_calib = importlib.import_module("4_make_calib")
int4 = importlib.import_module("5b_quantize_int4")


# --------------------------------------------------------------------------------------------
# Small models
# --------------------------------------------------------------------------------------------
def _save(model, path: Path) -> Path:
    import onnx

    onnx.save(model, str(path))
    return path


def gemm_model(k: int = 576, n: int = 64, trans_b: bool = True, seed: int = 0):
    """x [batch, k] -> Gemm (weight [n, k] with transB=1, as torch Linear exports) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k) if trans_b else (k, n)) * 0.05).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"], name="fc", transB=int(trans_b))], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.zeros(n, np.float32), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def matmul_model(k: int = 256, n: int = 64, seed: int = 1):
    """x [batch, k] -> MatMul (weight [k, n]) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def conv_model(input_name: str = "input", size: int = 224):
    """[batch,3,size,size] -> Conv 3x3 (stem) -> depthwise Conv -> grouped (2) Conv -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), nm) for nm, s in
             (("w0", (8, 3, 3, 3)), ("w1", (8, 1, 3, 3)), ("w2", (8, 4, 1, 1)))]
    nodes = [helper.make_node("Conv", [input_name, "w0"], ["a"], name="stem", pads=[1] * 4),
             helper.make_node("Conv", ["a", "w1"], ["b"], name="dw", group=8, pads=[1] * 4),
             helper.make_node("Conv", ["b", "w2"], ["y"], name="grouped", group=2)]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT,
                                                         ["batch", 3, size, size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m


def _ort_run(path_or_model, feed):
    import onnxruntime as ort

    src = path_or_model if isinstance(path_or_model, (str, Path)) else \
        path_or_model.SerializeToString()
    sess = ort.InferenceSession(str(src) if isinstance(src, Path) else src,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _modelopt_int4(src: Path, dst: Path, block: int, method: str = "awq_clip", k: int = 576):
    from modelopt.onnx.quantization import quantize

    calib = {"x": np.random.default_rng(0).standard_normal((16, k)).astype(np.float32)}
    quantize(onnx_path=str(src), quantize_mode="int4", calibration_method=method,
             calibration_data=calib if method == "awq_clip" else None,
             calibration_eps=["cpu"], block_size=block, output_path=str(dst), log_level="ERROR")
    return dst


@pytest.fixture(scope="module")
def modelopt_int4_models(tmp_path_factory):
    """Models ModelOpt 0.47.0 really produced: a Gemm (transB=1, K=576) quantized with block
    128 (awq_clip, the default: wrong axis) and a MatMul (K=256, correct axis)."""
    pytest.importorskip("modelopt.onnx.quantization")
    d = tmp_path_factory.mktemp("int4")
    gemm = _save(gemm_model(), d / "gemm.onnx")
    mm = _save(matmul_model(), d / "mm.onnx")
    return {"gemm_src": gemm, "gemm_q": _modelopt_int4(gemm, d / "gemm_int4.onnx", 128),
            "mm_src": mm, "mm_q": _modelopt_int4(mm, d / "mm_int4.onnx", 64, k=256), "dir": d}


# --------------------------------------------------------------------------------------------
# INT4 axis detection and repair
# --------------------------------------------------------------------------------------------
def test_int4_axis_detected_repaired_and_ort_then_runs(modelopt_int4_models):
    import onnx

    m = modelopt_int4_models
    x = np.random.default_rng(3).standard_normal((4, 576)).astype(np.float32)
    q = onnx.load(str(m["gemm_q"]))
    report = check_blocked_dq(q)
    assert len(report) == 1
    (r,) = report
    # What ModelOpt wrote: axis 0 for a scale blocked along axis 1 ([N, ceil(K/128)]).
    assert r["status"] == "mismatch" and r["axis"] == 0 and r["valid_axes"] == [1]
    assert r["scale_shape"] == [64, 5] and r["x_shape"] == [64, 576]
    with pytest.raises(Exception, match="block"):
        _ort_run(m["gemm_q"], {"x": x})  # ORT rejects the model as ModelOpt wrote it
    fixed_model, fixed = fix_int4_axis(q)
    assert [f["name"] for f in fixed] == [r["name"]] and fixed[0]["new_axis"] == 1
    assert check_blocked_dq(fixed_model)[0]["status"] == "ok"
    y = _ort_run(fixed_model, {"x": x})
    ref = _ort_run(m["gemm_src"], {"x": x})
    assert parity(ref, y)["cosine_min"] > 0.98  # INT4 weights, but the right function
    # Only the axis attribute changed: the same nodes, initializers and other attributes.
    q2 = onnx.load(str(m["gemm_q"]))
    assert [n.op_type for n in q2.graph.node] == [n.op_type for n in fixed_model.graph.node]
    assert {i.name for i in q2.graph.initializer} == {i.name for i in fixed_model.graph.initializer}


def test_int4_correct_model_left_untouched(modelopt_int4_models):
    import onnx

    q = onnx.load(str(modelopt_int4_models["mm_q"]))
    before = q.SerializeToString()
    report = check_blocked_dq(q)
    assert report and all(r["status"] == "ok" for r in report)
    q, fixed = fix_int4_axis(q)
    assert fixed == [] and q.SerializeToString() == before
    _ort_run(q, {"x": np.ones((2, 256), np.float32)})


def test_fix_int4_axis_cli_check_and_repair(modelopt_int4_models, tmp_path):
    src = modelopt_int4_models["gemm_q"]
    chk = subprocess.run([sys.executable, "qdq_tools.py", "fix-int4-axis", "--check", str(src)],
                         cwd=ROOT, capture_output=True, text=True)
    assert chk.returncode == 1 and "mismatch" in chk.stdout
    out = tmp_path / "fixed.onnx"
    fix = subprocess.run([sys.executable, "qdq_tools.py", "fix-int4-axis", str(src), "-o",
                          str(out)], cwd=ROOT, capture_output=True, text=True)
    assert fix.returncode == 0 and "repaired 1 node" in fix.stdout, fix.stderr
    ok = subprocess.run([sys.executable, "qdq_tools.py", "fix-int4-axis", "--check", str(out)],
                        cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0


def test_unrepairable_scale_raises():
    from onnx import TensorProto, helper, numpy_helper

    q = numpy_helper.from_array(np.zeros((64, 576), np.int8), "q")
    q.data_type = TensorProto.INT4
    s = numpy_helper.from_array(np.ones((7, 7), np.float32), "s")  # fits no axis
    dq = helper.make_node("DequantizeLinear", ["q", "s"], ["w"], name="dq", axis=0, block_size=128)
    g = helper.make_graph([dq], "g", [], [helper.make_tensor_value_info("w", 1, None)], [q, s])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    assert check_blocked_dq(model)[0]["status"] == "unrepairable"
    with pytest.raises(StageError, match="fits no single axis"):
        fix_int4_axis(model)


# --------------------------------------------------------------------------------------------
# Block size choice
# --------------------------------------------------------------------------------------------
def test_k_dims_follow_trans_b_and_matmul_layout():
    assert [d["k"] for d in int4.quantized_k_dims(gemm_model(576, 1024))] == [576]
    assert [d["k"] for d in int4.quantized_k_dims(gemm_model(576, 1024, trans_b=False))] == [576]
    assert [d["k"] for d in int4.quantized_k_dims(matmul_model(256, 64))] == [256]


def test_block_size_divides_every_k_override_and_error():
    assert int4.choose_block_size([576, 1024]) == 64  # MobileNetV3-Small classifier
    assert int4.choose_block_size([1280]) == 128  # EfficientNet-Lite0 classifier
    assert int4.choose_block_size([576, 1024], override=32) == 32
    assert int4.choose_block_size([576], candidates=(96, 64)) == 96
    with pytest.raises(UsageError, match=r"does not divide K = \[576\]"):
        int4.choose_block_size([576, 1024], override=128)
    with pytest.raises(StageError, match="no block size"):
        int4.choose_block_size([7 * 13, 1024])
    with pytest.raises(StageError, match="nothing to quantize"):
        int4.choose_block_size([])


def test_stage5b_end_to_end_block_override_repair_and_record(tmp_path, monkeypatch):
    pytest.importorskip("modelopt.onnx.quantization")
    import onnx

    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    src = _save(gemm_model(576, 64), tmp_path / "fp32.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal(
        (8, 576)).astype(np.float32))
    out = tmp_path / "int4.onnx"
    src_mtime = src.stat().st_mtime_ns
    args = int4.get_args_parser().parse_args(
        ["--model", "tiny", "--onnx", str(src), "--output", str(out), "--calib",
         str(tmp_path / "calib.npz"), "--block-size", "32", "--no-eval"])
    rec = int4.main(args)
    assert rec["block_size"] == 32 and rec["block_size_source"] == "override"
    q = onnx.load(str(out))
    dq = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    assert [attr(n, "block_size") for n in dq] == [32]
    # The Gemm weight went to ModelOpt as [K, N] (transB=0): blocks along K, nothing to repair.
    assert [r["node"] for r in rec["layout_kn"]] == ["fc"] and rec["repaired"] == []
    assert [attr(n, "axis") for n in dq] == [0]
    assert rec["weights_verified"][0]["status"] == "ok"
    assert all(r["status"] == "ok" for r in rec["blocked_dq_after"])
    saved = json.loads((tmp_path / "results" / "tiny" / "quant_int4.json").read_text())
    assert saved["block_size"] == 32 and saved["provenance"]["command"]
    _ort_run(out, {"x": np.ones((2, 576), np.float32)})
    assert src.stat().st_mtime_ns == src_mtime  # ModelOpt got a copy, not the source


# --------------------------------------------------------------------------------------------
# Calibration data (stage 4)
# --------------------------------------------------------------------------------------------
@pytest.fixture()
def tiny_split(tmp_path, monkeypatch):
    """Private ARTIFACTS/RESULTS with a 4 eval / 3 calib split of the embedded real images."""
    items, _ = list_images(DEFAULT_DATA)
    split = {"data_root": str(DEFAULT_DATA.resolve()), "eval": [list(i) for i in items[:4]],
             "calib": [list(i) for i in items[500:503]]}
    art = tmp_path / "artifacts"
    monkeypatch.setenv("ARTIFACTS", str(art))
    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    write_json(art / "splits.json", split)
    return split


def _calib_args(model="efficientnet_lite0", **kw):
    argv = ["--model", model] + [x for k, v in kw.items() for x in (f"--{k}", str(v))]
    return make_calib.get_args_parser().parse_args(argv)


def test_calibration_keyed_to_renamed_input_and_preprocessed_as_eval(tiny_split):
    onnx_dir = model_artifacts("efficientnet_lite0") / "onnx"
    onnx_dir.mkdir(parents=True)
    path = _save(conv_model("input"), onnx_dir / "fp32.onnx")
    make_calib.main(_calib_args())
    with np.load(model_artifacts("efficientnet_lite0") / "calib.npz") as z:
        assert z.files == ["input"]
    _save(conv_model("pixel_values"), path)  # the same graph with its input renamed
    rec = make_calib.main(_calib_args())
    assert rec["input_name"] == "pixel_values"
    with np.load(model_artifacts("efficientnet_lite0") / "calib.npz") as z:
        assert z.files == ["pixel_values"]
        x = z["pixel_values"]
    # Exactly eval's preprocessing, recomputed here from the image files, in the recorded
    # (seeded) order.
    spec = model_spec("efficientnet_lite0")
    assert sorted(rec["files"]) == [p for p, _ in tiny_split["calib"]] and rec["order_seed"] == 0
    ref = np.stack([preprocess_image(load_image_rgb(DEFAULT_DATA / p),
                                            **spec.preprocessing()) for p in rec["files"]])
    np.testing.assert_array_equal(x, normalize(ref, spec.mean, spec.std))
    assert x.dtype == np.float32 and x.shape == (3, 3, 224, 224)
    _ort_run(path, {"pixel_values": x[:1]})  # the npz feeds the model as is


def test_calibration_files_never_in_eval_split(tiny_split):
    onnx_dir = model_artifacts("efficientnet_lite0") / "onnx"
    onnx_dir.mkdir(parents=True)
    _save(conv_model(), onnx_dir / "fp32.onnx")
    rec = make_calib.main(_calib_args())
    ev = {p for p, _ in tiny_split["eval"]}
    assert sorted(rec["files"]) == [p for p, _ in tiny_split["calib"]]
    assert not ev & set(rec["files"])
    # An overlapping split is refused before anything is written.
    bad = dict(tiny_split, calib=tiny_split["calib"] + [tiny_split["eval"][0]])
    write_json(splits_path(), bad)
    (model_artifacts("efficientnet_lite0") / "calib.npz").unlink()
    with pytest.raises(StageError, match="also evaluation images"):
        make_calib.main(_calib_args())
    assert not (model_artifacts("efficientnet_lite0") / "calib.npz").exists()


def test_pipeline_split_and_calibration_are_disjoint(stage_env):
    """Stages 0 (run by the fixture on the embedded images), 2 and 4 as a user runs them:
    no calibration image of calib.json is in the eval split, by path or by content."""
    from tests.conftest import run_stage

    env = stage_env
    art = Path(env["ARTIFACTS"]) / "efficientnet_lite0"
    if not (art / "onnx" / "fp32.onnx").exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    run_stage(["4_make_calib.py"], env)
    split = json.loads((Path(env["ARTIFACTS"]) / "splits.json").read_text())
    rec = json.loads((Path(env["RESULTS"]) / "efficientnet_lite0" / "calib.json").read_text())
    ev = {p for p, _ in split["eval"]}
    assert len(rec["files"]) == 100 and not ev & set(rec["files"])
    root = Path(split["data_root"])
    digests = {sha256_file(root / p) for p in rec["files"]}
    assert not digests & {sha256_file(root / p) for p in ev}
    with np.load(art / "calib.npz") as z:
        assert list(z.files) == ["input"] and z["input"].shape == (100, 3, 224, 224)


def test_calibration_missing_split_names_producer(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    (tmp_path / "a" / "efficientnet_lite0" / "onnx").mkdir(parents=True)
    _save(conv_model(), tmp_path / "a" / "efficientnet_lite0" / "onnx" / "fp32.onnx")
    with pytest.raises(StageError, match="0_prepare_data.py"):
        make_calib.main(_calib_args())


# --------------------------------------------------------------------------------------------
# list-depthwise / list-stem
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mnv3_random_onnx(tmp_path_factory):
    """MobileNetV3-Small, random init (structure only), legacy exporter (fast)."""
    import torch

    model, _ = build_model("mobilenet_v3_small", pretrained=False)
    n_grouped = sum(1 for m in model.modules()
                    if isinstance(m, torch.nn.Conv2d) and m.groups > 1)
    path = tmp_path_factory.mktemp("mnv3") / "fp32.onnx"
    torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(path), input_names=["input"],
                      output_names=["logits"], opset_version=17, dynamo=False)
    return path, n_grouped


def test_list_depthwise_finds_the_11_of_mobilenet_v3_small(mnv3_random_onnx):
    path, n_grouped = mnv3_random_onnx
    assert n_grouped == 11  # torchvision's module tree: the reference count
    model = load_onnx(path)
    dw = list_depthwise(model)
    assert len(dw) == 11 and all(d["depthwise"] for d in dw)
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert {d["name"] for d in dw} == {n.name for n in convs if attr(n, "group", 1) > 1}
    out = subprocess.run([sys.executable, "qdq_tools.py", "list-depthwise", "--names-only",
                          "--expect", "11", str(path)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == [d["name"] for d in dw]
    stem = list_stem(model)
    assert len(stem) == 1 and stem[0]["name"] == convs[0].name and stem[0]["group"] == 1


def test_list_depthwise_expect_mismatch_fails(mnv3_random_onnx):
    out = subprocess.run([sys.executable, "qdq_tools.py", "list-depthwise", "--expect", "12",
                          str(mnv3_random_onnx[0])], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and "found 11, expected 12" in out.stderr


def test_list_depthwise_grouped_vs_depthwise_and_anchored_names(tmp_path):
    path = _save(conv_model(), tmp_path / "m.onnx")
    dw = list_depthwise(load_onnx(path))
    assert [(d["name"], d["depthwise"]) for d in dw] == [("dw", True), ("grouped", False)]
    out = subprocess.run([sys.executable, "qdq_tools.py", "list-depthwise", "--names-only",
                          "--anchored", str(path)], cwd=ROOT, capture_output=True, text=True)
    pats = out.stdout.split()
    assert pats == ["^dw$", "^grouped$"]
    # ModelOpt matches --nodes_to_exclude with re.match: anchoring stops prefix hits.
    assert re.match("node_Conv_77", "node_Conv_775") and not re.match("^node_Conv_77$",
                                                                       "node_Conv_775")


def test_efficientnet_lite0_depthwise_count(tmp_path):
    """Structure only (random init, legacy exporter for speed): one depthwise conv per MBConv
    block, 16 in all."""
    import torch

    model, _ = build_model("efficientnet_lite0", pretrained=False)
    path = tmp_path / "lite0.onnx"
    torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(path), input_names=["input"],
                      output_names=["logits"], opset_version=17, dynamo=False)
    dw = list_depthwise(load_onnx(path, external=False))
    assert len(dw) == 16 and all(d["depthwise"] for d in dw)


# --------------------------------------------------------------------------------------------
# inspect, act-stats, stage 5 usage
# --------------------------------------------------------------------------------------------
def test_inspect_reports_fp16_underflow_and_bias_products():
    from onnx import TensorProto, helper, numpy_helper

    def init(name, arr):
        return numpy_helper.from_array(arr, name)

    a_s = np.array(1e-3, np.float16)
    w_s = np.array([1e-2, 1e-5, 6e-08], np.float16)  # the last is ModelOpt's replacement
    inits = [init("xs", a_s), init("xz", np.array(0, np.int8)), init("wq", np.ones((3, 3, 1, 1), np.int8)),
             init("ws", w_s), init("wz", np.zeros(3, np.int8)), init("b", np.ones(3, np.float32))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dqx"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="dqw", axis=0),
             helper.make_node("Conv", ["xd", "wd", "b"], ["y"], name="conv"),
             helper.make_node("Relu", ["y"], ["z"], name="relu"),
             # ORT's WeightBiasQuantization only rewrites a Conv whose output reaches a Q.
             helper.make_node("QuantizeLinear", ["z", "xs", "xz"], ["zq"], name="qz")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16,
                                                                     [1, 3, 4, 4])],
                          [helper.make_tensor_value_info("zq", TensorProto.INT8, None)], inits)
    rep = inspect_model(helper.make_model(g))
    assert rep["n_quantize"] == 2 and rep["n_dequantize"] == 2
    assert rep["granularity"] == {"per-tensor": 1, "per-channel": 1}
    assert rep["scale_dtypes"] == {"float16": 2}
    assert rep["n_scales_at_6e-08"] == 1 and rep["smallest_scales"][0]["node"] == "dqw"
    assert rep["quantized_nodes_by_op"] == {"Conv": 1} and rep["float_nodes_by_op"] == {"Relu": 1}
    b = rep["bias"]
    # 1e-3 * 1e-5 and 1e-3 * 6e-8 underflow to 0 in fp16; 1e-3 * 1e-2 does not.
    assert b["float_bias_wbq_candidates"] == 1 and b["n_products_zero_in_fp16"] == 2


def test_act_stats_exact_max_p999_and_outlier_ranking(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    lo, hi = numpy_helper.from_array(np.array(-1, np.float32), "lo"), \
        numpy_helper.from_array(np.array(1, np.float32), "hi")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip"),
             helper.make_node("Add", ["r", "c"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["n", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [lo, hi])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    path = _save(m, tmp_path / "m.onnx")
    x = np.random.default_rng(0).standard_normal((20, 3, 8, 8)).astype(np.float32)
    x[0, 0, 0, 0] = 500.0  # one outlier: huge max/p99.9 after Relu, clipped away by Clip
    np.savez(tmp_path / "c.npz", x=x)
    rows = {r["tensor"]: r for r in activation_stats(path, tmp_path / "c.npz", batch=5)}
    assert set(rows) == {"r", "c", "y"}
    assert rows["r"]["max"] == 500.0 and rows["c"]["max"] == 1.0
    np.testing.assert_allclose(rows["r"]["p99.9"], np.percentile(np.maximum(x, 0), 99.9),
                               rtol=1e-6)
    order = [r["tensor"] for r in activation_stats(path, tmp_path / "c.npz")]
    assert order[-1] == "c" and rows["r"]["ratio"] > 50 and rows["c"]["ratio"] < 1.01
    assert rows["r"]["channel_spread"] > 50  # only channel 0 holds the outlier


def test_quantize_sh_usage_errors_exit_2_with_variant_list():
    for argv in ([], ["no_such_variant"], ["--bogus"]):
        p = subprocess.run(["bash", "5_quantize.sh", *argv], cwd=ROOT, capture_output=True,
                           text=True)
        assert p.returncode == 2, argv
        assert "int8_hp32" in p.stderr and "int4_cli_broken" in p.stderr
    p = subprocess.run(["bash", "5_quantize.sh", "--list"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and {"baseline", "int8", "int8_hp32", "excl_dw",
                                  "conv_gemm"} <= set(p.stdout.split())


def test_quantize_sh_missing_calib_names_stage4(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path), MODEL="efficientnet_lite0",
               PYTHON=sys.executable)
    (tmp_path / "efficientnet_lite0" / "onnx").mkdir(parents=True)
    _save(conv_model(), tmp_path / "efficientnet_lite0" / "onnx" / "fp32.onnx")
    p = subprocess.run(["bash", "5_quantize.sh", "int8"], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert p.returncode == 1 and "4_make_calib.py" in p.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_quantize_sh_is_shellcheck_clean():
    p = subprocess.run(["shellcheck", "5_quantize.sh"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


@pytest.mark.slow
def test_stage5_int8_on_tiny_conv_model(tmp_path):
    """5_quantize.sh end to end on a small conv model: output, log and results JSON."""
    pytest.importorskip("modelopt.onnx.quantization")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="tiny", PYTHON=sys.executable, EPS="cpu")
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(conv_model(size=32), d / "onnx" / "fp32.onnx")
    np.savez(d / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (8, 3, 32, 32)).astype(np.float32))
    src_mtime = (d / "onnx" / "fp32.onnx").stat().st_mtime_ns
    p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32"], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    # ModelOpt rewrites its --onnx_path: the stage hands it a copy, fp32.onnx stays untouched.
    assert (d / "onnx" / "fp32.onnx").stat().st_mtime_ns == src_mtime
    rec = json.loads((tmp_path / "r" / "tiny" / "quant_int8_hp32.json").read_text())
    assert rec["status"] == "ok" and rec["wall_time_s"] > 0
    assert "--nodes_to_exclude" in rec["command"] and "^dw" in rec["command"].replace("\\", "")
    assert rec["inspect"]["scale_dtypes"] == {"float32": rec["inspect"]["n_dequantize"]}
    assert not list((d / "onnx").glob(".tmp-*"))
