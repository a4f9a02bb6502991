"""Mixed precision for an accuracy budget (issue 14): the tuning split, MACs in INT8, the Q/DQ
configurations the search edits, the search itself on random-init MobileNetV3-Small with one
node made sensitive on purpose (structure only: random weights, never an accuracy claim), the
cache, stage 5's int8_auto path and the report column."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import deploykit.quant.auto.search as auto_search
import deploykit.tools.auto_precision as auto_precision_cli
from deploykit.errors import StageError
from deploykit.layout import model_artifacts
from deploykit.tools import auto_precision as auto_precision_cli
from deploykit.cli import cli
from deploykit.compare import cosine_rows
from deploykit.data.images import list_images
from deploykit.data.splits import load_split, make_splits, split_tuning
from deploykit.errors import StageError, UsageError
from deploykit.evaluate import EvalData, base_record
from deploykit.io import write_json
from deploykit.layout import DEFAULT_DATA
from deploykit.models import build_model, model_spec
from deploykit.onnx.graph import QDQ_OPS, attr, constants, consumers, load_onnx, producers
from deploykit.quant.auto.inputs import tuning_data
from deploykit.quant.auto.report import publish, record_paths, render_markdown, write_outputs
from deploykit.quant.auto.search import (
    Budget,
    Cache,
    MODE,
    SEMANTICS,
    anchored,
    budget_warnings,
    data_digest,
    fmt_metrics,
    output_metrics,
    run_model,
    search,
)
from deploykit.quant.auto.space import QdqSpace, prune_unused
from deploykit.quant.macs import mac_summary, mac_table
from deploykit.tools.auto_precision import budget_from_args
from deploykit.variants import for_stage, modelopt_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402
pass  # noqa: E402

report = importlib.import_module("8_report")
SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PIPELINE_ROOT=str(ROOT), PYTHONPATH=str(ROOT), PYTHON=sys.executable,
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for k in ("VAL_ROOT", "ALLOW_CLASS_SUBSET", "WEIGHTS", "INPUT_SHAPE", "AUTO_ARGS"):
        env.pop(k, None)
    return {**env, **extra}


def _run(args: list[str], env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable] + args if args[0].endswith(".py") else args
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------------- splits
def test_tuning_split_is_carved_from_eval_seeded_and_off_by_default():
    items, _ = list_images(DEFAULT_DATA)
    ev, ca = make_splits(items, None, 10, 0.1, 0)
    assert split_tuning(ev, 0.0, 0) == (ev, [])  # default: the run is unchanged
    ev2, tu = split_tuning(ev, 0.25, 0)
    assert (len(ev2), len(tu)) == (675, 225)
    paths = [{p for p, _ in s} for s in (ev2, tu, ca)]
    assert not (paths[0] & paths[1]) and not (paths[1] & paths[2])
    assert paths[0] | paths[1] == {p for p, _ in ev}
    assert split_tuning(ev, 0.25, 0) == (ev2, tu)
    assert split_tuning(ev, 0.25, 1)[1] != tu
    # several images per class: every class keeps one for evaluation
    many = [(f"c{c}/{i}.JPEG", c) for c in range(20) for i in range(3)]
    ev3, tu3 = split_tuning(many, 0.9, 0)
    assert {c for _, c in ev3} == set(range(20)) and len(tu3) == 40
    with pytest.raises(UsageError, match="--tune-fraction"):
        split_tuning(ev, 1.0, 0)


def test_stage0_tune_fraction_keeps_calibration_and_shrinks_eval(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in SAMPLE[:40]:
        (data / f.name).symlink_to(f)
    env = _env(tmp_path, ALLOW_CLASS_SUBSET="1")
    base = ["0_prepare_data.py", "--model", "efficientnet_lite0", "--data-root", str(data)]
    p = _run(base, env)
    assert p.returncode == 0, p.stderr
    before = json.loads((tmp_path / "a" / "splits.json").read_text())
    p = _run(base + ["--tune-fraction", "0.25"], env)
    assert p.returncode == 0, p.stderr
    after = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert after["calib"] == before["calib"] and len(after["tune"]) == 9
    assert sorted(after["eval"] + after["tune"]) == sorted(before["eval"])
    assert "9 tuning" in p.stdout
    summary = json.loads((tmp_path / "r" / "efficientnet_lite0" / "data.json").read_text())
    assert summary["n_tune"] == 9 and summary["n_eval"] == len(after["eval"])
    p = _run(base + ["--tune-fraction", "1.5"], env)
    assert p.returncode == 2 and "--tune-fraction 1.5: must be in [0, 1)" in p.stderr


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
    p = _run(["auto_precision.py", "search", "--model", "efficientnet_lite0"], _env(tmp_path))
    assert p.returncode == 1 and "--tune-fraction" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "a" / "efficientnet_lite0" / "auto_precision" / "base.onnx").exists()


def test_int8_auto_only_on_request():
    names = lambda *a: [v.name for v in for_stage(*a)]  # noqa: E731
    for stage in (5, 6, 7):
        assert "int8_auto" not in names(stage) and "int8_auto" not in names(stage, True)
        assert "int8_auto" in names(stage, False, True)
    assert modelopt_args("int8_auto", "c.npz", "cpu", auto=["^a$"])[:8] == [
        "--quantize_mode", "int8", "--op_types_to_quantize", "Conv", "Gemm",
        "--nodes_to_exclude", "^a$", "--high_precision_dtype"]
    assert "--nodes_to_exclude" not in modelopt_args("int8_auto", "c.npz", "cpu")


def test_run_all_auto_precision_usage(tmp_path):
    env = _env(tmp_path, MODEL="efficientnet_lite0")
    p = subprocess.run(["bash", "run_all.sh", "--auto-precision=1.5"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "needs a fraction 0 < F < 1" in p.stderr
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "splits.json").write_text(json.dumps({"eval": [], "calib": []}))
    p = subprocess.run(["bash", "run_all.sh", "--auto-precision", "--stage", "5"], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "has no tuning split" in p.stderr and "start from stage 0" \
        in p.stderr


# --------------------------------------------------------------------------- small graphs
def _save(model, path: Path) -> Path:
    import onnx

    onnx.save(model, str(path))
    return path


def _conv_chain(size: int = 16):
    """x [N,3,s,s] -> Conv a (3->8, 3x3) -> depthwise Conv dw -> GlobalAveragePool -> Flatten
    -> Gemm fc (8->10) -> MatMul mm (10->4) -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = {"wa": (8, 3, 3, 3), "wdw": (8, 1, 3, 3), "wfc": (10, 8), "wmm": (10, 4)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in w.items()]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="a", pads=[1] * 4),
             helper.make_node("Conv", ["a", "wdw"], ["b"], name="dw", group=8, pads=[1] * 4),
             helper.make_node("GlobalAveragePool", ["b"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wfc"], ["g"], name="fc", transB=1),
             helper.make_node("MatMul", ["g", "wmm"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    return m


def _qdq(model, tensor: str, scale, axis: int | None = None, zp_dtype=np.int8):
    """Insert QuantizeLinear -> DequantizeLinear on ``tensor`` (every consumer reads the
    dequantized tensor, as ONNX Runtime's quantizer does)."""
    from onnx import helper, numpy_helper

    scale = np.asarray(scale, np.float32)
    g = model.graph
    s, z = f"{tensor}_scale", f"{tensor}_zp"
    g.initializer.extend([numpy_helper.from_array(scale, s),
                          numpy_helper.from_array(np.zeros(scale.shape, zp_dtype), z)])
    for n in g.node:
        for i, t in enumerate(n.input):
            if t == tensor:
                n.input[i] = f"{tensor}_dq"
    kw = {} if axis is None else {"axis": axis}
    g.node.extend([helper.make_node("QuantizeLinear", [tensor, s, z], [f"{tensor}_q"],
                                    name=f"{tensor}_QuantizeLinear", **kw),
                   helper.make_node("DequantizeLinear", [f"{tensor}_q", s, z], [f"{tensor}_dq"],
                                    name=f"{tensor}_DequantizeLinear", **kw)])
    _toposort(model)


def _toposort(model) -> None:
    g = model.graph
    have = {i.name for i in g.input} | {t.name for t in g.initializer}
    nodes, out = list(g.node), []
    while nodes:
        for n in nodes:
            if all(i in have for i in n.input if i):
                out.append(n)
                have.update(n.output)
                nodes.remove(n)
                break
        else:
            raise AssertionError("cycle")
    del g.node[:]
    g.node.extend(out)


def test_macs_counted_from_the_graph_and_int8_only_with_both_inputs_quantized():
    m = _conv_chain()
    rows = {r["name"]: r for r in mac_table(m)}
    assert rows["a"]["macs"] == 8 * 16 * 16 * 3 * 3 * 3
    assert rows["dw"]["macs"] == 8 * 16 * 16 * 1 * 3 * 3
    assert rows["fc"]["macs"] == 10 * 8 and rows["mm"]["macs"] == 4 * 10
    assert not any(r["int8"] for r in rows.values())
    _qdq(m, "x", 0.05)                       # a: input and weight 8-bit -> INT8
    _qdq(m, "wa", np.full(8, 0.01), axis=0)
    _qdq(m, "wfc", np.full(10, 0.01), axis=0)  # fc: weight only -> not INT8 compute
    rows = {r["name"]: r for r in mac_table(m)}
    assert rows["a"]["int8"] and not rows["fc"]["int8"] and not rows["dw"]["int8"]
    s = mac_summary(m)
    total = 8 * 16 * 16 * 27 + 8 * 16 * 16 * 9 + 80 + 40
    assert s["total_macs"] == total and s["int8_macs"] == 8 * 16 * 16 * 27
    assert abs(s["int8_fraction"] - 8 * 16 * 16 * 27 / total) < 1e-12


def _shared_input_model():
    """x -> Q/DQ (shared) -> Conv A and Conv B (both with Q/DQ weights) -> Add -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), n)
             for n in ("wA", "wB")]
    nodes = [helper.make_node("Conv", ["x", "wA"], ["ya"], name="A"),
             helper.make_node("Conv", ["x", "wB"], ["yb"], name="B"),
             helper.make_node("Add", ["ya", "yb"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    fp32 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    fp32.ir_version = 9
    q = type(fp32)()
    q.CopyFrom(fp32)
    _qdq(q, "x", 0.1)
    _qdq(q, "wA", np.full(4, 0.02), axis=0)
    _qdq(q, "wB", np.full(4, 0.02), axis=0)
    return fp32, q


def _ort(model, x):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_configurations_follow_modelopt_a_shared_input_stays_quantized_while_one_reader_is_int8():
    fp32, q = _shared_input_model()
    space = QdqSpace(q, fp32)
    assert space.names == ["A", "B"] and space.owners == {"x_DequantizeLinear": {"A", "B"}}
    nodes = lambda m: {n.name: n for n in m.graph.node}  # noqa: E731
    only_a_float = nodes(space.model({"A"}))
    # A's weight is float again, but x is still quantized for B, so A reads it too (ModelOpt's
    # --nodes_to_exclude A gives the same: ORT's quantizer rewires every consumer of x)
    assert list(only_a_float["A"].input) == ["x_dq", "wA"]
    assert list(only_a_float["B"].input) == ["x_dq", "wB_dq"]
    assert "wA_QuantizeLinear" not in only_a_float  # dead Q/DQ pruned
    all_float = space.model({"A", "B"})
    assert not any(n.op_type in QDQ_OPS for n in all_float.graph.node)
    assert {t.name for t in all_float.graph.initializer} == {"wA", "wB"}
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(_ort(all_float, x), _ort(fp32, x))
    np.testing.assert_array_equal(_ort(space.model(()), x), _ort(q, x))
    with pytest.raises(KeyError, match="not a quantized candidate"):
        space.model({"add"})


def test_integer_weights_are_restored_from_the_fp32_model():
    """A DequantizeLinear of a constant int8 weight (ModelOpt --dq_only) has no float copy in
    the Q/DQ model: the float weight comes from the FP32 model, and without it the error says
    so."""
    from onnx import numpy_helper

    fp32, q = _shared_input_model()
    consts = constants(q)
    wq = np.clip(np.round(consts["wA"] / 0.02), -128, 127).astype(np.int8)
    q.graph.initializer.append(numpy_helper.from_array(wq, "wA_int8"))
    for n in q.graph.node:
        if n.name == "wA_DequantizeLinear":
            n.input[0] = "wA_int8"
    prune_unused(q)
    space = QdqSpace(q, fp32)
    m = space.model({"A", "B"})
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(_ort(m, x), _ort(fp32, x))
    with pytest.raises(StageError, match="--fp32"):
        QdqSpace(q, None)


def test_budget_and_its_flags():
    ref = np.eye(4, dtype=np.float32)[[0, 1, 2, 3] * 50]
    out = ref.copy()
    out[0] = [0, 1, 0, 0]  # one flip in 200
    m = output_metrics(ref, out, np.zeros(200, np.int64))
    assert m["agreement"] == 99.5 and m["flips"] == 1
    assert Budget(99.5, None).met(m) and not Budget(99.6, None).met(m)
    assert "cosine" in Budget(None, 0.999).misses(m)[0]
    parser = auto_precision_cli.get_args_parser()
    args = parser.parse_args(["search", "--min-agreement", "off", "--min-cosine", "0.99"])
    assert budget_from_args(args) == Budget(None, 0.99, None)
    for bad, msg in ((["--min-cosine", "2"], "cosine similarity lies in"),
                     (["--min-agreement", "off", "--min-cosine", "off"], "every budget bound")):
        with pytest.raises(UsageError, match=msg):
            budget_from_args(parser.parse_args(["search", *bad]))


def test_cache_key_covers_every_input(tmp_path):
    fields = {"fp32": "a", "qdq": "b", "calib": "c", "tune": "d", "mode": MODE}
    c = Cache(tmp_path, fields)
    c.put({"n1"}, {"cosine_mean": 0.5})
    assert Cache(tmp_path, fields).get({"n1"}) == {"cosine_mean": 0.5}
    for k in fields:
        other = Cache(tmp_path, {**fields, k: "changed"})
        assert other.path != c.path and other.get({"n1"}) is None


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


def test_search_keeps_the_sensitive_node_in_float_and_modelopt_reproduces_it(mnv3_sensitive,
                                                                             tmp_path):
    pytest.importorskip("modelopt.onnx.quantization")
    d, sensitive = mnv3_sensitive
    env = _env(tmp_path)
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


def _chain_qdq():
    """The conv chain with a, dw and fc quantized by hand (per-tensor inputs, per-channel
    weights)."""
    fp32 = _conv_chain()
    q = type(fp32)()
    q.CopyFrom(fp32)
    _qdq(q, "x", 4.0 / 127)
    _qdq(q, "wa", np.full(8, 0.01), axis=0)
    _qdq(q, "a", 0.2)
    _qdq(q, "wdw", np.full(8, 0.01), axis=0)
    _qdq(q, "f", 0.02)
    _qdq(q, "wfc", np.full(10, 0.005), axis=0)
    return fp32, q


def test_search_in_process_rerun_with_another_budget_runs_no_per_node_measurement(
        tmp_path, monkeypatch):
    fp32, q = _chain_qdq()
    space = QdqSpace(q, fp32)
    assert space.names == ["a", "dw", "fc"]
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (16, 3, 16, 16)).astype(np.float32)})
    ref = run_model(fp32, data)
    runs = []
    real = run_model
    fake = lambda m, *a, **k: runs.append(1) or real(m, *a, **k)  # noqa: E731
    monkeypatch.setattr(auto_search, "run_model", fake)
    monkeypatch.setattr(auto_precision_cli, "run_model", fake)
    fields = {"fp32": "f", "qdq": "q", "calib": None, "tune": data_digest(data),
              "mode": MODE}
    first = search(space, data, ref, Budget(None, 0.99999), Cache(tmp_path, fields))
    n_first = len(runs)
    assert n_first == first["evaluations"]["run"] >= 2 + 2 * 3
    assert len(first["path"]) == 4 and first["path"][0]["metrics"] == first["full_int8"]
    cache = Cache(tmp_path, fields)
    second = search(space, data, ref, Budget(None, 0.999), cache)
    new = len(runs) - n_first
    # per-node measurements and the path come from the cache; only pruning trials may be new
    assert new == second["evaluations"]["run"] == cache.misses <= len(second["steps"])
    assert second["evaluations"]["cached"] >= 2 + 2 * 3
    assert [p["metrics"] for p in second["path"]] == [p["metrics"] for p in first["path"]]
    before = len(runs)
    third = search(space, data, ref, Budget(None, 0.9999), Cache(tmp_path, fields),
                      prune=False)
    assert len(runs) == before and third["evaluations"]["run"] == 0  # --no-prune: nothing new
    assert third["excluded"] == sorted(third["order"][:third["path_choice"]],
                                       key=space.names.index)
    assert [r["int8_alone"] for r in first["candidates"]] == \
        [r["int8_alone"] for r in second["candidates"]]
    # deterministic: the same inputs give the same choice
    again = search(space, data, ref, Budget(None, 0.999), Cache(tmp_path, fields))
    assert again["excluded"] == second["excluded"] and again["order"] == second["order"]


@pytest.mark.slow
def test_rerun_with_another_budget_uses_the_cache(mnv3_sensitive, tmp_path):
    pytest.importorskip("modelopt.onnx.quantization")
    d, sensitive = mnv3_sensitive
    env = _env(tmp_path)
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


# --------------------------------------------------------------------------------- stage 5
def test_quantize_sh_int8_auto_budget_usage_error_exits_2(tmp_path):
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(_conv_chain(), d / "onnx" / "fp32.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "calib.npz", x=rng.standard_normal((8, 3, 16, 16)).astype(np.float32))
    np.savez(d / "tune.npz", x=rng.standard_normal((8, 3, 16, 16)).astype(np.float32))
    env = _env(tmp_path, MODEL="tiny", EPS="cpu", CALIB_STATS_CHECK="0",
               AUTO_ARGS="--min-cosine 2")
    p = _run(["bash", "5_quantize.sh", "int8_auto"], env)
    assert p.returncode == 2 and "cosine similarity lies in [-1, 1]" in p.stderr
    assert not (d / "onnx" / "int8_auto.onnx").exists()


@pytest.mark.slow
def test_quantize_sh_int8_auto_end_to_end(tmp_path):
    """5_quantize.sh int8_auto on a small model with a tuning npz: search, ModelOpt with the
    exclusion list, verification before the file is installed, records."""
    pytest.importorskip("modelopt.onnx.quantization")
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    m = _conv_chain(32)
    _save(m, d / "onnx" / "fp32.onnx")
    rng = np.random.default_rng(0)
    np.savez(d / "calib.npz", x=rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
    np.savez(d / "tune.npz", x=rng.standard_normal((16, 3, 32, 32)).astype(np.float32))
    env = _env(tmp_path, MODEL="tiny", EPS="cpu", CALIB_STATS_CHECK="0",
               AUTO_ARGS="--min-agreement off --min-cosine 0.9999")
    p = _run(["bash", "5_quantize.sh", "int8_auto"], env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rec = json.loads((tmp_path / "r" / "tiny" / "auto_precision.json").read_text())
    quant = json.loads((tmp_path / "r" / "tiny" / "quant_int8_auto.json").read_text())
    assert rec["verify"]["tune_budget_met"] and rec["verify"]["onnx"] == str(
        d / "onnx" / "int8_auto.onnx")
    assert abs(quant["macs"]["int8_fraction"] - rec["int8_mac_fraction"]) < 1e-9
    for r in anchored(rec["excluded"]):
        assert r.replace("\\", "") in quant["command"].replace("\\", "")


# --------------------------------------------------------------------------------- report
def test_report_shows_int8_macs_beside_agreement(tmp_path):
    rows = [base_record("t", "FP32", "m", "pytorch_fp32_cpu",
                                 {"backend": "PyTorch", "device": "cpu"},
                                 accuracy={"top1": 88.0, "top5": 97.0}, n_images=675),
            base_record("t", "INT8", "m", "ort_int8_auto",
                                 {"backend": "ORT", "device": "cpu"},
                                 accuracy={"top1": 87.5, "top5": 97.0},
                                 parity={"cosine_mean": 0.999, "top1_agreement": 99.6},
                                 n_images=675)]
    folder = tmp_path / "m"  # results/<model>/: rows name their model
    for r in rows:
        write_json(folder / f"{r['tag']}.json", r)
    write_json(folder / "quant_int8_auto.json",
                      {"macs": {"int8_fraction": 0.9123}, "check": {"summary": "check: clean"}})
    t = {r["tag"]: r for r in report.table_rows(report.load_rows(folder))}
    assert t["ort_int8_auto"]["INT8 MACs %"] == "91.2"
    assert t["pytorch_fp32_cpu"]["INT8 MACs %"] == ""
    cols = report.COLUMNS
    assert cols.index("top-1 agree %") == cols.index("top-1 %") + 1
    md = report.render_markdown("m", report.load_rows(folder), {"n_eval": 675, "n_tune": 225})
    assert "225 more images" in md and "[auto_precision.md](auto_precision.md)" in md


# ------------------------------------------------- faults found by trying it (review_auto)
def test_tuning_npz_is_checked_like_calibration_data(tmp_path):
    """A tuning npz with other keys, another shape or dtype, NaN or no samples is refused with
    the problem named (it used to surface as an ONNX Runtime traceback, or NaN metrics)."""
    fp32 = _save(_conv_chain(), tmp_path / "fp32.onnx")
    rng = np.random.default_rng(0)
    good = rng.standard_normal((4, 3, 16, 16)).astype(np.float32)
    nan = good.copy()
    nan[1, 0, 0, 0] = np.nan
    cases = {"key": ({"image": good}, r"keys \['image'\].*inputs are \['x'\]"),
             "shape": ({"x": good[:, :, :8, :8]}, r"does not fit"),
             "dtype": ({"x": good.astype(np.float64)}, r"float64 but the model takes float32"),
             "nan": ({"x": nan}, r"1 NaN .*samples \[1\]"),
             "empty": ({"x": good[:0]}, r"no samples")}
    for name, (arrays, msg) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        with pytest.raises(StageError, match=f"tuning data {re.escape(str(path))}.*{msg}"):
            tuning_data("mobilenet_v3_small", fp32, path)
    np.savez(tmp_path / "good.npz", x=good)
    data, info = tuning_data("mobilenet_v3_small", fp32, tmp_path / "good.npz")
    assert len(data) == info["n"] == 4


def test_nan_outputs_miss_the_budget_and_the_node_that_makes_them_stays_float(tmp_path):
    """A configuration whose outputs are NaN must never meet a budget (NaN < bound is False),
    and the node that makes them ranks as the most sensitive (it used to score 0)."""
    fp32, q = _chain_qdq()
    for t in q.graph.initializer:  # fc's weight scale inf: 0 * inf = NaN in DequantizeLinear
        if t.name == "wfc_scale":
            from onnx import numpy_helper
            t.CopyFrom(numpy_helper.from_array(np.full(10, np.inf, np.float32), t.name))
    space = QdqSpace(q, fp32)
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (8, 3, 16, 16)).astype(np.float32)})
    ref = run_model(fp32, data)
    full = output_metrics(ref, run_model(space.model(()), data))
    assert full["nonfinite"] == 8 and full["cosine_mean"] is None and full["agreement"] == 0
    for budget in (Budget(None, 0.9), Budget(50, None), Budget(None, None, 1.0)):
        assert not budget.met(full)
        assert any("8 of 8 samples give NaN/Inf outputs" in m for m in budget.misses(full))
    res = search(space, data, ref, Budget(None, 0.99), Cache(tmp_path, {"k": 1}))
    assert res["order"][0] == "fc" and "fc" in res["excluded"] and res["budget_met"]
    assert "undefined" in fmt_metrics(full) and "8 sample(s) NaN/Inf" in fmt_metrics(full)
    # the cache round trip (JSON: NaN is written as null) gives the same verdict
    again = search(space, data, ref, Budget(None, 0.99), Cache(tmp_path, {"k": 1}))
    assert again["excluded"] == res["excluded"] and again["evaluations"]["run"] == 0
    render_markdown({**res, "model": "m", "budget": {"min_cosine": 0.99},
                        "budget_text": "b", "semantics": "s", "tuning": {"source": "t", "n": 8},
                        "base": {"command": "c"}, "search": {"evaluations": res["evaluations"],
                                                             "wall_s": 0, "machine": "x"},
                        "exclude_regexes": anchored(res["excluded"]),
                        "outputs": {"png": str(tmp_path / "p.png")}})


def _two_outputs():
    """x -> Conv a -> GAP -> Flatten f -> Gemm fc -> y (logits), and f -> Gemm aux -> z (a
    second output); a and aux quantized, aux's weight so coarsely that z is ruined."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = {"wa": (8, 3, 3, 3), "wfc": (10, 8), "waux": (3, 8)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in w.items()]
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], name="a", pads=[1] * 4),
             helper.make_node("GlobalAveragePool", ["a"], ["p"], name="gap"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wfc"], ["y"], name="fc", transB=1),
             helper.make_node("Gemm", ["f", "waux"], ["z"], name="aux", transB=1)]
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    g = helper.make_graph(nodes, "g", [vi("x", ["batch", 3, 16, 16])],
                          [vi("y", ["batch", 10]), vi("z", ["batch", 3])], inits)
    fp32 = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)])
    fp32.ir_version = 9
    q = type(fp32)()
    q.CopyFrom(fp32)
    _qdq(q, "x", 4.0 / 127)
    _qdq(q, "wa", np.full(8, 0.005), axis=0)
    _qdq(q, "waux", np.full(3, 0.5), axis=0)  # weights ~N(0, 0.3) -> {-1, 0, 1} x 0.5
    _qdq(q, "f", 0.01)
    return fp32, q


def test_every_output_is_judged_not_only_the_first(tmp_path):
    """A node that only feeds a second output must count (the search used to read the first
    output only, so ruining the second one met any budget)."""
    fp32, q = _two_outputs()
    space = QdqSpace(q, fp32)
    assert space.names == ["a", "fc", "aux"]  # fc: its input is quantized
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (16, 3, 16, 16)).astype(np.float32)})
    ref = run_model(fp32, data)
    assert list(ref) == ["y", "z"]
    full = output_metrics(ref, run_model(space.model(()), data))
    assert full["outputs"]["y"]["cosine_mean"] > 0.99 > full["outputs"]["z"]["cosine_mean"]
    assert full["cosine_mean"] == full["outputs"]["z"]["cosine_mean"]
    res = search(space, data, ref, Budget(None, 0.99), Cache(tmp_path, {"k": 2}))
    assert "aux" in res["excluded"] and "a" not in res["excluded"] and res["budget_met"]


def test_a_tuning_split_too_small_for_the_agreement_budget_is_named():
    """With 18 tuning images one flip is 5.6 points: a 99.5 % agreement budget then means
    "no flip", met by chance on 1-3 images; the search says so (and records it)."""
    (w,) = budget_warnings(Budget(99.5, 0.999), 18)
    assert "18 sample(s)" in w and "5.56 points" in w and ">= 200 samples" in w
    assert budget_warnings(Budget(99.5, 0.999), 200) == []
    assert budget_warnings(Budget(None, 0.999), 1) == []  # no agreement bound
    assert budget_warnings(Budget(90, None), 10) == []    # one flip of 10 = 90 %: ok
    assert len(budget_warnings(Budget(90, None), 9)) == 1


def _record(tmp_path, res, **extra):
    return {**res, "model": "m", "budget": {"min_cosine": 0.99}, "budget_text": "b",
            "semantics": "s", "tuning": {"source": "t", "n": 8}, "base": {"command": "c"},
            "search": {"evaluations": res["evaluations"], "wall_s": 0, "machine": "x"},
            "exclude_regexes": anchored(res["excluded"]),
            "outputs": {k: str(v) for k, v in record_paths("m", tmp_path).items()}, **extra}


def test_no_plot_leaves_no_png_of_an_older_search(tmp_path):
    fp32, q = _chain_qdq()
    space = QdqSpace(q, fp32)
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (4, 3, 16, 16)).astype(np.float32)})
    res = search(space, data, run_model(fp32, data), Budget(None, 0.99),
                    Cache(tmp_path / "c", {"k": 3}))
    png = tmp_path / "auto_precision.png"
    write_outputs(_record(tmp_path, res, warnings=["w1"]), plot=True)
    assert png.exists() and "auto_precision.png" in (tmp_path / "auto_precision.md").read_text()
    assert "**Warning:** w1" in (tmp_path / "auto_precision.md").read_text()
    write_outputs(_record(tmp_path, res, plot=False), plot=False)  # search --no-plot
    assert not png.exists()
    assert "auto_precision.png" not in (tmp_path / "auto_precision.md").read_text()
    write_outputs(_record(tmp_path, res), plot=True)
    write_outputs(_record(tmp_path, res), plot=False)  # verify keeps the search's PNG
    assert png.exists()


def test_ctrl_c_exits_130_with_one_line_and_no_traceback(capsys, monkeypatch):
    import argparse

    monkeypatch.setattr(sys, "argv", ["x.py"])
    def main(args):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        try:
            cli(lambda: argparse.ArgumentParser(prog="x.py"), main)
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C escaped common.cli (a traceback)")
    err = capsys.readouterr().err
    assert e.value.code == 130 and "x.py: interrupted" in err and "Traceback" not in err


def test_search_without_a_quantized_node_says_where_modelopt_says_why(tmp_path):
    """A model ModelOpt quantized nothing in (e.g. an MLP at batch 1: its GEMV rule) is refused
    naming the op types, the log and the rule, not just "nothing to choose"."""
    fp32 = _save(_conv_chain(), tmp_path / "fp32.onnx")
    np.savez(tmp_path / "tune.npz", x=np.zeros((2, 3, 16, 16), np.float32))
    env = _env(tmp_path)
    p = _run(["auto_precision.py", "search", "--model", "mobilenet_v3_small", "--fp32",
              str(fp32), "--qdq", str(fp32), "--tune-npz", str(tmp_path / "tune.npz"),
              "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path / "o")], env)
    assert p.returncode == 1, p.stderr
    assert "nothing to choose" in p.stderr and "['Conv', 'Gemm', 'MatMul']" in p.stderr
    assert "GEMV rule" in p.stderr and "Traceback" not in p.stderr


def test_quantize_sh_help_exits_0_and_names_int8_auto_and_auto_args():
    p = subprocess.run(["bash", "5_quantize.sh", "--help"], cwd=ROOT, capture_output=True,
                       text=True, env=_env(Path("/nonexistent")))
    assert p.returncode == 0, p.stderr
    assert "except those made on request only: int8_auto" in p.stderr
    assert "AUTO_ARGS" in p.stderr
    assert subprocess.run(["bash", "5_quantize.sh", "--nope"], cwd=ROOT, capture_output=True,
                          env=_env(Path("/nonexistent"))).returncode == 2


def test_publish_keeps_the_installed_files_record_and_writes_a_failed_run_beside_it(tmp_path):
    """results/<model>/auto_precision.* describe the installed int8_auto.onnx: a search by hand
    writes to the work folder, and a run whose file was not installed is published as
    auto_precision.failed.* (it used to overwrite the good record)."""
    fp32, q = _chain_qdq()
    space = QdqSpace(q, fp32)
    data = EvalData(feed={"x": np.random.default_rng(4).standard_normal(
        (4, 3, 16, 16)).astype(np.float32)})
    res = search(space, data, run_model(fp32, data), Budget(None, 0.99),
                    Cache(tmp_path / "c", {"k": 3}))
    good, bad, results = tmp_path / "good", tmp_path / "bad", tmp_path / "results"
    write_outputs(_record(good, res, budget_text="good budget"), plot=True)
    write_outputs(_record(bad, res, budget_text="bad budget"), plot=True)

    publish(good, results)
    rec = json.loads((results / "auto_precision.json").read_text())
    assert rec["outputs"]["md"] == str(results / "auto_precision.md")
    assert "](auto_precision.png)" in (results / "auto_precision.md").read_text()
    assert (results / "auto_precision.png").stat().st_size > 1000

    publish(bad, results, failed=True)
    assert json.loads((results / "auto_precision.json").read_text())["budget_text"] == \
        "good budget"
    failed = json.loads((results / "auto_precision.failed.json").read_text())
    assert failed["budget_text"] == "bad budget" and failed["published"]["failed"] is True
    assert "](auto_precision.failed.png)" in (results / "auto_precision.failed.md").read_text()
    assert not list(results.glob(".tmp-*"))

    # the default folder of search/verify is the work folder, never results/
    assert record_paths("m")["json"].parent == model_artifacts("m") / "auto_precision"
    with pytest.raises(StageError, match="auto_precision.py search"):
        publish(tmp_path / "empty", results)
