"""Helpers for the mixed-precision tests: small conv chains and Q/DQ graphs, stage runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers.stages import ROOT


def _auto_env(tmp_path: Path, **extra) -> dict:
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
