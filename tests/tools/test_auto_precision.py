"""auto_precision.py (deploykit.tools.auto_precision) run as a command: the search on
MobileNetV3-Small with one sensitive node, the cache across budgets, missing tuning split."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from deploykit.compare import cosine_rows
from deploykit.data.splits import load_split
from deploykit.errors import StageError
from deploykit.layout import DEFAULT_DATA
from deploykit.models import build_model, model_spec
from deploykit.onnx.graph import attr, constants, consumers, load_onnx, producers
from deploykit.quant.auto.search import anchored, SEMANTICS
from deploykit.quant.macs import mac_table
from deploykit.variants import modelopt_args

from tests.helpers.auto_models import _auto_env, _conv_chain, _run, _save


@pytest.mark.slow
def test_without_tuning_split_int8_auto_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "splits.json").write_text(json.dumps(
        {"data_root": str(DEFAULT_DATA), "eval": [["x.JPEG", 0]], "calib": [["y", 1]]}))
    with pytest.raises(StageError, match="--tune-fraction 0.25, or bash run_all.sh "
                                                "--auto-precision"):
        load_split("tune", model_spec("efficientnet_lite0"))
    # the search itself, as stage 5 calls it: exit 1 with that message, before any quantizer
    onnx_dir = tmp_path / "a" / "efficientnet_lite0" / "onnx"
    onnx_dir.mkdir(parents=True)
    _save(_conv_chain(), onnx_dir / "fp32.onnx")
    p = _run(["auto_precision.py", "search", "--model", "efficientnet_lite0"], _auto_env(tmp_path))
    assert p.returncode == 1 and "--tune-fraction" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "a" / "efficientnet_lite0" / "auto_precision" / "base.onnx").exists()


# ------------------------------------------------- the search on MobileNetV3-Small (random)
def _make_sensitive(model, scale: float = 1000.0) -> str:
    """Scale output channel 0 of a Conv that feeds a ReLU (weight and bias) by ``scale`` and the
    next Conv's weights for that input channel by 1 / ``scale``: the float function is the same
    (ReLU is positively homogeneous), but the next Conv's input now has one channel ``scale``
    times wider than the others, so its per-tensor INT8 input scale flattens the rest. Returns
    the name of that next Conv (the sensitive node)."""
    from onnx import numpy_helper

    cons, prod = consumers(model), producers(model)
    consts = constants(model)

    def const(t):
        while t not in consts:  # the legacy exporter shares equal constants through Identity
            t = prod[t].input[0]
        return consts[t].copy()

    for relu in model.graph.node:
        if relu.op_type != "Relu":
            continue
        x, ys = prod.get(relu.input[0]), cons[relu.output[0]]
        if x is None or x.op_type != "Conv" or len(ys) != 1 or ys[0].op_type != "Conv":
            continue
        src = prod.get(x.input[0])
        if src is not None and src.op_type in ("GlobalAveragePool", "ReduceMean"):
            continue  # squeeze-excitation: hardly reaches the logits
        y = ys[0]
        wx, bx, wy = const(x.input[1]), const(x.input[2]), const(y.input[1])
        wx[0] *= scale
        bx[0] *= scale
        if int(attr(y, "group", 1)) == 1:
            wy[:, 0] /= scale
        else:
            wy[0] /= scale
        for node, i, arr in ((x, 1, wx), (x, 2, bx), (y, 1, wy)):
            name = f"{node.name}_sensitive_{i}"
            model.graph.initializer.append(numpy_helper.from_array(arr, name))
            node.input[i] = name
        return y.name
    raise AssertionError("no Conv -> Relu -> Conv in the model")


@pytest.fixture(scope="module")
def mnv3_sensitive(tmp_path_factory):
    """Random-init MobileNetV3-Small at 64x64 with one node made sensitive, its calibration and
    tuning samples (seeded normal inputs: structure only)."""
    import onnx
    import torch

    d = tmp_path_factory.mktemp("mnv3_auto")
    model, _ = build_model("mobilenet_v3_small", pretrained=False)
    model.eval()
    torch.onnx.export(model, (torch.zeros(1, 3, 64, 64),), str(d / "plain.onnx"),
                      input_names=["input"], output_names=["logits"], opset_version=17,
                      dynamo=False, dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    m = onnx.load(str(d / "plain.onnx"))
    sensitive = _make_sensitive(m)
    _save(m, d / "fp32.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "calib.npz", input=rng.standard_normal((32, 3, 64, 64)).astype(np.float32))
    np.savez(d / "tune.npz", input=rng.standard_normal((32, 3, 64, 64)).astype(np.float32))
    # the edit keeps the float function
    x = {"input": np.load(d / "tune.npz")["input"][:4]}
    import onnxruntime as ort

    a, b = (ort.InferenceSession(str(d / f), providers=["CPUExecutionProvider"]).run(None, x)[0]
            for f in ("plain.onnx", "fp32.onnx"))
    assert cosine_rows(a, b).min() > 0.99999
    return d, sensitive


def _search(d: Path, env: dict, *budget: str) -> tuple[subprocess.CompletedProcess, dict]:
    p = _run(["auto_precision.py", "search", "--model", "mnv3_sensitive", "--fp32",
              str(d / "fp32.onnx"), "--calib", str(d / "calib.npz"), "--tune-npz",
              str(d / "tune.npz"), "--work-dir", str(d / "work"), "--out-dir", str(d / "out"),
              "--min-agreement", "off", *budget], env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p, json.loads((d / "out" / "auto_precision.json").read_text())


@pytest.mark.slow
def test_search_keeps_the_sensitive_node_in_float_and_modelopt_reproduces_it(mnv3_sensitive,
                                                                             tmp_path):
    pytest.importorskip("modelopt.onnx.quantization")
    d, sensitive = mnv3_sensitive
    env = _auto_env(tmp_path)
    p, rec = _search(d, env, "--min-cosine", "0.99")
    regexes = p.stdout.split()
    assert anchored([sensitive])[0] in regexes
    rows = {r["name"]: r for r in rec["candidates"]}
    assert rows[sensitive]["kept_float"]
    worst = max(rec["candidates"], key=lambda r: r["cosine_error_added"])
    assert worst["name"] == sensitive
    assert rec["full_int8"]["cosine_mean"] < 0.99 <= rec["predicted"]["cosine_mean"]
    assert rec["budget_met"] and 0 < rec["int8_mac_fraction"] < 1
    assert rec["base"]["reused"] is False and "--op_types_to_quantize Conv Gemm" in \
        rec["base"]["command"]
    assert SEMANTICS in (d / "out" / "auto_precision.md").read_text()
    assert (d / "out" / "auto_precision.png").stat().st_size > 1000
    # ModelOpt re-quantizes with the anchored exclusion list; verify measures that file
    out = d / "int8_auto.onnx"
    q = _run(["qdq_tools.py", "modelopt", "--", "--onnx_path", str(d / "fp32.onnx"),
              *modelopt_args("int8_auto", str(d / "calib.npz"), "cpu", auto=regexes),
              "--output_path", str(out)], env)
    assert q.returncode == 0, q.stderr[-2000:]
    v = _run(["auto_precision.py", "verify", "--model", "mnv3_sensitive", "--fp32",
              str(d / "fp32.onnx"), "--onnx", str(out), "--work-dir", str(d / "work"),
              "--out-dir", str(d / "out")], env)
    assert v.returncode == 0, v.stderr[-3000:]
    ver = json.loads((d / "out" / "auto_precision.json").read_text())["verify"]
    assert ver["tune_budget_met"] and not ver["structure_differences"]
    assert ver["vs_searched_configuration"]["cosine_min"] > 0.99999
    int8 = {r["name"]: r["int8"] for r in mac_table(load_onnx(out))}
    assert int8[sensitive] is False and sum(int8.values()) == len(rec["candidates"]) - len(
        rec["excluded"])
    assert ver["eval"] is None  # not an image classifier: no evaluation split here


@pytest.mark.slow
def test_rerun_with_another_budget_uses_the_cache(mnv3_sensitive, tmp_path):
    pytest.importorskip("modelopt.onnx.quantization")
    d, sensitive = mnv3_sensitive
    env = _auto_env(tmp_path)
    _, first = _search(d, env, "--min-cosine", "0.99")
    _, second = _search(d, env, "--min-cosine", "0.995")
    n = len(second["candidates"])
    assert second["base"]["reused"] is True  # ModelOpt did not run again
    ev = second["search"]["evaluations"]
    assert ev["cached"] >= 2 + 2 * n  # every per-node measurement came from the cache
    assert ev["run"] <= len(second["steps"])  # only configurations the new budget needs
    assert second["search"]["cache"] == first["search"]["cache"]
    for a, b in zip(first["candidates"], second["candidates"]):
        assert a["int8_alone"] == b["int8_alone"] and a["float_alone"] == b["float_alone"]
    assert sensitive in second["excluded"] and second["predicted"]["cosine_mean"] >= 0.995


@pytest.mark.slow
def test_search_without_a_quantized_node_says_where_modelopt_says_why(tmp_path):
    """A model ModelOpt quantized nothing in (e.g. an MLP at batch 1: its GEMV rule) is refused
    naming the op types, the log and the rule, not just "nothing to choose"."""
    fp32 = _save(_conv_chain(), tmp_path / "fp32.onnx")
    np.savez(tmp_path / "tune.npz", x=np.zeros((2, 3, 16, 16), np.float32))
    env = _auto_env(tmp_path)
    p = _run(["auto_precision.py", "search", "--model", "mobilenet_v3_small", "--fp32",
              str(fp32), "--qdq", str(fp32), "--tune-npz", str(tmp_path / "tune.npz"),
              "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "o")], env)
    assert p.returncode == 1, p.stderr
    assert "nothing to choose" in p.stderr and "['Conv', 'Gemm', 'MatMul']" in p.stderr
    assert "GEMV rule" in p.stderr and "Traceback" not in p.stderr
