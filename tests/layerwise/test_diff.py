"""deploykit.layerwise.diff: fault injection into small ONNX models built here.

Models (tests/helpers/layerwise_models.py, exported with the legacy TorchScript exporter,
``dynamo=False``, whose node names ``/head1/fc3/Gemm`` carry the module path):
- ``TokenHeads``: input ``[batch, 8, 256]``, three heads Linear-ReLU-Linear-ReLU-Linear(256->2)
  over selected token rows (the model of the issue report).
- ``SECNN``: Conv-BN-ReLU stem, SE blocks (GlobalAvgPool-Conv-ReLU-Conv-HardSigmoid-Mul).

Faults are injected into a copy of the ONNX file (one initializer changed, one op swapped); the
tool must name exactly that node as the first divergent one, with its inputs agreeing. Also:
static-batch feeds and a candidate with FP16 inputs."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import deploykit.layerwise.diff as layerwise_diff
from deploykit.errors import UsageError
from deploykit.feeds import feed_plan, input_shape_batch, load_feed
from deploykit.layerwise.diff import run_layer_diff
from deploykit.onnx.activations import lookthrough_aliases, ort_activations

from tests.helpers.stages import ROOT
from tests.helpers.export_models import _static_b1
from tests.helpers.layerwise_models import _copy_with


torch = pytest.importorskip("torch")
nn = torch.nn


@pytest.mark.slow
def test_layerwise_diff_static_batch_and_input_shape_batch(tmp_path):
    a = _static_b1(tmp_path / "ref.onnx", batch="N")
    b = _static_b1(tmp_path / "b1.onnx")
    np.savez(tmp_path / "feed.npz", input=np.random.default_rng(0).standard_normal(
        (5, 3, 8, 8)).astype(np.float32))
    feed = load_feed(tmp_path / "feed.npz", None, 0, a)
    res = run_layer_diff(a, b, feed, batch=8)
    assert res["first_divergent"] is None and res["n_samples"] == 5
    # --input-shape's first dimension is the batch per run; --n the number of samples.
    feed, batch = feed_plan(load_feed(None, None, 8, a, ["input:2,3,8,8"]),
                                      [a], input_shape_batch(["input:2,3,8,8"]))
    assert batch == 2 and len(feed["input"]) == 8
    with pytest.raises(UsageError):
        feed_plan(feed, [b, _static_b1(tmp_path / "b2.onnx", batch=2)], None)
    p = subprocess.run([sys.executable, "layerwise.py", "diff", str(a), str(b), "--inputs",
                        str(tmp_path / "feed.npz")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_diff_accepts_a_candidate_with_fp16_inputs(tmp_path):
    a = _static_b1(tmp_path / "ref.onnx", batch="N")
    m = onnx.load(str(a))
    for t in m.graph.initializer:
        if t.name == "big":
            t.CopyFrom(numpy_helper.from_array(np.array(2.0, np.float32), "big"))
    onnx.save(m, str(a))
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m16 = float16.convert_float_to_float16(onnx.load(str(a)), keep_io_types=False)
    onnx.save(m16, str(tmp_path / "io16.onnx"))
    feed = {"input": np.random.default_rng(0).standard_normal((4, 3, 8, 8)).astype(np.float32)}
    res = run_layer_diff(a, tmp_path / "io16.onnx", feed)
    assert res["status"] == "ok" and res["first_divergent"] is None


def _row(res, node):
    return [r for r in res["layers"] if r["node"] == node]


# ------------------------------------------------------------------------------------------
# diff: fault injection
# ------------------------------------------------------------------------------------------
def test_no_fault_passes(token_model, tmp_path):
    _, path, feed = token_model
    res = run_layer_diff(path, path, feed, out_dir=tmp_path)
    assert res["status"] == "ok" and res["first_divergent"] is None
    assert res["summary"]["fail"] == 0 and res["summary"]["pass"] > 10
    assert all(v["status"] == "pass" for v in res["final_outputs"].values())
    assert (tmp_path / "layerwise.png").stat().st_size > 1000
    assert "No divergent layer" in (tmp_path / "layerwise.md").read_text()


def test_weight_fault_names_final_linear(token_model, tmp_path):
    """The issue's report: head1's second Linear agrees, its final Linear (256 -> 2) does not."""
    _, path, feed = token_model

    def edit(m):
        for t in m.graph.initializer:
            if t.name == "head1.fc3.weight":
                w = numpy_helper.to_array(t)
                t.CopyFrom(numpy_helper.from_array((w[::-1] * 0.5).copy(), t.name))

    bad = _copy_with(path, tmp_path / "bad.onnx", edit)
    res = run_layer_diff(path, bad, feed, out_dir=tmp_path)
    fd = res["first_divergent"]
    assert fd["node"] == "/head1/fc3/Gemm"
    assert fd["inputs_agreed"] is True and "is wrong" in fd["verdict"]
    assert "head1.fc3.weight" in fd["detail"]["weights_differ"]
    for pred in ("/head1/fc1/Gemm", "/head1/act1/Relu", "/head1/fc2/Gemm", "/head1/act2/Relu"):
        assert [r["status"] for r in _row(res, pred)] == ["pass"], pred
    assert res["origins"] == ["/head1/fc3/Gemm"]
    assert res["final_outputs"]["out1"]["status"] == "fail"
    assert res["final_outputs"]["out0"]["status"] == "pass"
    saved = json.loads((tmp_path / "layerwise.json").read_text())
    assert saved["first_divergent"]["node"] == "/head1/fc3/Gemm"


def test_op_swap_names_that_node(cnn_model, tmp_path):
    _, path, feed = cnn_model

    def edit(m):
        for n in m.graph.node:
            if n.name == "/se1/act/Relu":
                n.op_type = "Sigmoid"

    bad = _copy_with(path, tmp_path / "swap.onnx", edit)
    res = run_layer_diff(path, bad, feed, out_dir=tmp_path)
    fd = res["first_divergent"]
    assert fd["node"] == "/se1/act/Relu" and fd["inputs_agreed"] is True
    assert fd["detail"]["op_type_b"] == "Sigmoid"
    idx = fd["index"]
    assert all(r["status"] == "pass" for r in res["layers"][:idx])
    # Downstream layers fail too, but their inputs already differed: not origins.
    assert any(r["status"] == "fail" and r["inputs_agreed"] is False for r in res["layers"][idx:])
    assert res["origins"][0] == "/se1/act/Relu"


def test_fp16_no_false_alarm(cnn_model, token_model, tmp_path):
    from onnxconverter_common import float16

    for i, (_, path, feed) in enumerate((cnn_model, token_model)):
        m16 = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
        p16 = tmp_path / f"fp16_{i}.onnx"
        onnx.save(m16, str(p16))
        res = run_layer_diff(path, p16, feed)
        assert res["precision"] == "fp16"
        assert res["first_divergent"] is None, res["verdict"]
        assert res["summary"]["pass"] >= 10


# ------------------------------------------------------------------------------------------
# Q/DQ look-through on a model ModelOpt really quantized (~3 s; deselect with -k 'not modelopt')
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cnn_int8(cnn_model, tmp_path_factory):
    """The SE CNN quantized once by ModelOpt INT8 (8 random calibration samples)."""
    pytest.importorskip("modelopt.onnx.quantization")
    from modelopt.onnx.quantization import quantize

    _, path, _ = cnn_model
    calib = np.random.default_rng(1).standard_normal((8, 3, 32, 32)).astype(np.float32)
    q = tmp_path_factory.mktemp("int8") / "int8.onnx"
    quantize(onnx_path=str(path), quantize_mode="int8", calibration_data={"input": calib},
             output_path=str(q))
    return q


@pytest.mark.slow
def test_qdq_lookthrough_modelopt(cnn_model, cnn_int8, tmp_path):
    _, path, feed = cnn_model
    q = cnn_int8
    qm = onnx.load(str(q))
    assert any(n.op_type == "DequantizeLinear" for n in qm.graph.node)
    alias = lookthrough_aliases(qm)
    assert alias["/se1/act/Relu_output_0_DequantizeLinear_Output"] == "/se1/act/Relu_output_0"
    res = run_layer_diff(path, q, feed, out_dir=tmp_path)
    assert res["precision"] == "int8" and res["status"] == "ok"
    compared = [r for r in res["layers"] if r["status"] in ("pass", "fail")]
    # Every compute node of the FP32 graph found its float tensor in the Q/DQ graph.
    assert res["summary"]["unmatched"] == 0 and len(compared) >= 15
    assert all(r["cosine_min"] > 0.9 for r in compared)
    # The error enters at the first quantised Conv (visible, but within INT8 tolerance).
    assert compared[0]["node"] == "/stem/stem.0/Conv" and compared[0]["cosine_min"] < 0.999999
    assert (tmp_path / "layerwise.png").exists()

    # A wrong activation scale in the Q/DQ pair feeding se1.fc2 is blamed on that layer.
    def edit(mm):
        for t in mm.graph.initializer:
            if t.name == "/se1/act/Relu_output_0_scale_2":
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 8, t.name))

    bad = _copy_with(q, tmp_path / "int8_bad.onnx", edit)
    res = run_layer_diff(path, bad, feed)
    assert res["first_divergent"]["node"] == "/se1/fc2/Conv"
    assert res["first_divergent"]["inputs_agreed"] is True


@pytest.mark.slow
def test_qdq_divergence_blamed_on_ort_optimiser_when_unoptimised_run_agrees(cnn_model, cnn_int8,
                                                                           monkeypatch):
    """A Q/DQ divergence that only exists with ORT graph optimisations on (as ModelOpt fp16
    scales + ORT's WeightBiasQuantization produce on EfficientNet-Lite0) is reported as a
    backend effect, not a quantisation error. The optimiser fault is simulated: B's outputs
    of one node are corrupted unless the level is 'disable'."""
    _, path, feed = cnn_model
    q = cnn_int8
    real = ort_activations

    def faulty(model_or_path, feed_, *, opt_level="all", **kw):
        is_b = "DequantizeLinear" in str(getattr(model_or_path, "graph", "")) or \
            str(model_or_path).endswith("int8.onnx")
        for out, n in real(model_or_path, feed_, opt_level=opt_level, **kw):
            if is_b and opt_level != "disable":
                out = {k: (v * np.nan if k.startswith("/se1/fc2/") else v) for k, v in out.items()}
            yield out, n

    monkeypatch.setattr(layerwise_diff, "ort_activations", faulty)
    res = run_layer_diff(path, q, feed)
    assert res["first_divergent"]["node"] == "/se1/fc2/Conv"
    assert res["backend_check"]["backend_caused"] is True
    assert "ORT graph optimisations cause" in res["verdict"] and "NaN" in res["verdict"]
    # Without the simulated optimiser fault the check does not run and blames nobody.
    monkeypatch.setattr(layerwise_diff, "ort_activations", real)
    assert run_layer_diff(path, q, feed).get("backend_check") is None


# --------------------------------------------------------------------------------------------
# Issue 19: NaN outputs and a final output missing from one side are failures (exit 1)
# --------------------------------------------------------------------------------------------
def _mm_model(path, head="Identity", out="y", w_scale=1.0):
    """``out = head(relu(x @ W))``, x float32 [N, 4], W [4, 3] seeded (times ``w_scale``);
    ``head="Sqrt"`` of ``relu(..) - 100``: NaN everywhere."""
    from onnx import helper

    w = (np.random.default_rng(0).standard_normal((4, 3)) * w_scale).astype(np.float32)
    nodes = [onnx.helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             onnx.helper.make_node("Relu", ["h"], ["r"], name="relu")]
    inits = [numpy_helper.from_array(w, "W")]
    if head == "Sqrt":
        inits.append(numpy_helper.from_array(np.array(100, np.float32), "c"))
        nodes += [helper.make_node("Sub", ["r", "c"], ["rc"], name="shift"),
                  helper.make_node("Sqrt", ["rc"], [out], name="head")]
    else:
        nodes.append(helper.make_node("Identity", ["r"], [out], name="head"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, ["N", 4])],
                          [helper.make_tensor_value_info(out, 1, ["N", 3])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(path))
    return path


def _diff_cli(capsys, *argv):
    """``layerwise.py diff ...`` in this process: (exit status, stderr)."""
    from deploykit.tools.layerwise import cli_main, get_args_parser

    args = get_args_parser().parse_args(["diff", *map(str, argv)])
    try:
        cli_main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_diff_fails_when_the_final_output_is_missing_from_one_side_or_nan(tmp_path, capsys):
    a = _mm_model(tmp_path / "a.onnx")
    # B: the same layers, then a head that makes every output NaN, under another output name:
    # every compared layer agreed and the NaN output was never compared (exit 0 before)
    b = _mm_model(tmp_path / "b.onnx", head="Sqrt", out="logits")
    code, err = _diff_cli(capsys, a, b, "--input-shape", "x:4,4")
    assert code == 1, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("FAILED:")]
    code, err0 = _diff_cli(capsys, a, b, "--input-shape", "x:4,4", "--exit-zero")
    assert code in (0, None) and "FAILED:" in err0  # --exit-zero: the line, exit 0
    assert "final output 'y' of A (a.onnx) is missing from B (b.onnx, outputs: logits)" in line
    assert line.endswith("--map-output logits=y")
    # the fix it names: now the NaN output is compared, and its first non-finite layer named
    code, err = _diff_cli(capsys, a, b, "--input-shape", "x:4,4", "--map-output", "logits=y")
    assert code == 1
    (line,) = [ln for ln in err.splitlines() if ln.startswith("FAILED:")]
    assert line.startswith("FAILED: first non-finite layer: head (Identity), output 'y' holds "
                           "NaN/Inf in B (b.onnx)")
    # the same files without the fault pass, so the failure is the fault's
    good = _mm_model(tmp_path / "good.onnx", out="logits")
    code, err = _diff_cli(capsys, a, good, "--input-shape", "x:4,4", "--map-output", "logits=y")
    assert code == 0 and "FAILED" not in err, err


def test_diff_names_a_nan_reference_as_the_reference_not_the_candidate(tmp_path):
    a = _mm_model(tmp_path / "a.onnx")
    feed = {"x": np.full((4, 4), np.nan, np.float32)}
    res = run_layer_diff(a, a, feed)
    assert res["failure"].startswith("first non-finite layer: mm (MatMul), output 'h' holds "
                                     "NaN/Inf in A, the reference itself")


def test_failure_reason_names_a_final_output_nan_only_without_marking():
    from deploykit.layerwise.diff import failure_reason

    res = {"a": {"onnx": "/x/a.onnx"}, "b": {"onnx": "/x/b.onnx"},
           "layers": [{"node": "mm", "op_type": "MatMul", "tensor": "h", "status": "pass"}],
           "final_missing": {"in_a": [], "in_b": [], "a_outputs": ["y"], "b_outputs": ["y"]},
           "final_outputs": {"y": {"status": "fail", "nonfinite_b": 12}}}
    assert failure_reason(res).startswith("final output 'y' of B (b.onnx) holds NaN/Inf in "
                                          "the unmarked run")
    res["final_outputs"]["y"] = {"status": "pass"}
    assert failure_reason(res) is None


def test_a_final_output_out_of_tolerance_fails_the_diff_though_no_marked_layer_diverges():
    """The deployed (unmarked) output is what ships: out of tolerance there is a divergence
    even when every marked layer agrees (a fused kernel), exit 1 unless --exit-zero."""
    from types import SimpleNamespace

    from deploykit.layerwise.report import render_table
    from deploykit.tools.layerwise import exit_status

    res = {"a": {"onnx": "/x/a.onnx", "backend": "ORT"}, "b": {"onnx": "/x/b.onnx",
                                                               "backend": "ORT"},
           "layers": [{"index": 0, "node": "mm", "op_type": "MatMul", "tensor": "h",
                       "status": "pass", "inputs_agreed": True}],
           "first_divergent": None, "failure": None,
           "final_outputs": {"y": {"status": "fail", "cosine_min": 0.5, "max_abs_err": 3.0}}}
    diff = SimpleNamespace(cmd="diff", exit_zero=False)
    assert exit_status(diff, res) == 1
    assert exit_status(SimpleNamespace(cmd="diff", exit_zero=True), res) == 0
    assert "final output `y` is out of tolerance" in render_table(res)
    assert "No divergent layer:** every" not in render_table(res)
    res["final_outputs"]["y"]["status"] = "pass"
    assert exit_status(diff, res) == 0
    assert "No divergent layer:** every compared tensor" in render_table(res)


def test_the_printed_diff_of_an_own_data_model_runs_on_its_reference_inputs(tmp_path):
    """The next step of a failed own-data row diagnosed on random inputs; it now names stage
    1's reference file, whose in:* arrays load_feed reads as the feed."""
    import shlex

    from deploykit.feeds import load_feed
    from deploykit.layerwise.diff import diff_command

    ref = tmp_path / "ref_outputs.npz"
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.savez(ref, **{"in:x": x, "out:y": x[:, :2], "meta:synthetic": np.array(False)})
    cmd = diff_command("pkg.m:f", tmp_path / "fp32.onnx", tmp_path / "fp16.onnx", "FP16",
                       tmp_path / "out", classifier=False, inputs=ref)
    words = shlex.split(cmd)
    assert words[words.index("--inputs") + 1] == str(ref)
    assert "--inputs" not in diff_command("efficientnet_lite0", tmp_path / "a.onnx",
                                          tmp_path / "b.onnx", "FP16", tmp_path / "o",
                                          classifier=True, inputs=ref)
    m = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])]))
    onnx.save(m, tmp_path / "m.onnx")
    feed = load_feed(ref, None, 8, tmp_path / "m.onnx")
    assert list(feed) == ["x"] and np.array_equal(feed["x"], x)


def test_the_printed_torch_vs_onnx_uses_the_reference_weights(tmp_path):
    """A row of a model run with --weights printed a diagnostic that loaded the model's default
    (hub) weights: it failed offline, and online it would blame the wrong thing."""
    import shlex

    from deploykit.layerwise.diff import diff_command

    onnx_path = tmp_path / "fp32.onnx"
    w = tmp_path / "my w.pt"

    def words(weights):
        return shlex.split(diff_command("resnet10t", onnx_path, onnx_path, "FP32", tmp_path / "o",
                                        classifier=True, weights=weights))

    assert words(str(w))[-2:] == ["--weights", str(w)]
    assert words("random-init")[-1] == "--random-init"
    assert "--weights" not in words("default") and "--random-init" not in words(None)


def test_a_missing_ep_names_the_layerwise_way_out(tmp_path):
    """An EP this onnxruntime lacks: layerwise.py fails (exit 1) with a way out it accepts
    (run where the EP exists, or name cpu), not stage 3's --allow-cpu-fallback, which its
    parser would refuse."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    np.savez(tmp_path / "x.npz", x=np.ones((2, 4), np.float32))
    p = subprocess.run([sys.executable, "layerwise.py", "diff", str(path), str(path), "--ep-b",
                        "cuda", "--inputs", str(tmp_path / "x.npz")], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    assert "CUDAExecutionProvider is not in this onnxruntime build" in p.stderr
    assert "--allow-cpu-fallback" not in p.stderr and "name the CPU EP" in p.stderr
