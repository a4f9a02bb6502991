"""PyTorch versus ONNX per module: the first module whose exported output differs, or the
upstream node (with its source line) when that module's input already differs.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any
import numpy as np

from deploykit.compare import TensorStat, compare_outputs, tolerances_for
from deploykit.feeds import feed_plan
from deploykit.io import write_json
from deploykit.onnx.activations import collect_outputs, ort_activations
from deploykit.onnx.graph import load_onnx


# --------------------------------------------------------------------------------------------
# PyTorch module vs ONNX node
# --------------------------------------------------------------------------------------------
def _unqualified(q: str) -> str:
    """The scope atom the legacy TorchScript exporter uses for module ``q`` (``layer1.0`` stays
    ``layer1.0``, ``layer1.0.conv1`` becomes ``conv1``), as in torch.onnx's
    ``_unqualified_variable_name``."""
    atoms = q.split(".")
    for i in range(len(atoms) - 1, -1, -1):
        if not atoms[i].isnumeric():
            return ".".join(atoms[i:])
    return q


def node_module_paths(node, scope_to_module: dict[str, str]) -> list[str]:
    """Module paths (outermost first) an exported node belongs to.

    Dynamo exporter: node metadata ``pkg.torch.onnx.name_scopes`` (``['', 'se1', 'se1.fc1',
    'conv2d_1']``). Legacy TorchScript exporter: the node name ``/se1/fc1/Conv`` (scope atoms,
    see :func:`_unqualified`), resolved through ``scope_to_module``.
    """
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(p.value)
            except (ValueError, SyntaxError):
                break
            return [s for s in scopes[1:-1] if s]
    name = node.name or ""
    if not name.startswith("/"):
        return []
    parts = name.split("/")[1:-1]
    paths = []
    for k in range(1, len(parts) + 1):
        q = scope_to_module.get("/" + "/".join(parts[:k]))
        if q is not None:
            paths.append(q)
    return paths


def torch_vs_onnx(model, onnx_path: Path | str, feed: dict[str, np.ndarray], *,
                  tolerances: dict[str, float] | None = None, ep: str = "cpu",
                  out_dir: Path | str | None = None) -> dict:
    """Compare each PyTorch module's output with the ONNX tensor of the same module path.

    The module of an ONNX node comes from the exporter (see :func:`node_module_paths`); the
    module's ONNX output is the one tensor its nodes hand to nodes outside the module. Modules
    without nodes of their own (BatchNorm folded into Conv, Dropout, Identity) pass their
    output to the module they follow, so ``conv`` is compared after its folded BN.

    Args:
        model: ``torch.nn.Module`` in eval mode (CPU), the one exported to ``onnx_path``.
        feed: ``{ONNX input name: array}``; passed positionally to ``model`` in this order.
        tolerances: FP32 overrides (defaults: :data:`TOLERANCES` ``fp32``).
    Returns:
        dict with ``modules`` (rows in topological order of the ONNX tensor: ``module``,
        ``tensor``, ``node``, metrics, ``status``; where the module's data input maps to one
        ONNX tensor also ``input_tensor``, ``input_node`` (its producer), ``inputs_agree`` and
        ``input_cosine_min``), ``first_divergent`` (row or None),
        ``unmapped`` (modules with an output but no single ONNX tensor), ``final_outputs``.
    """
    import torch

    tol = tolerances_for("fp32", tolerances)
    onnx_model = load_onnx(onnx_path)
    feed, batch = feed_plan(feed, [onnx_model], None)  # a static batch is fed as it is
    named = dict(model.named_modules())
    scope_to_module = _legacy_scopes(model)

    nodes = list(onnx_model.graph.node)
    node_mods = [node_module_paths(n, scope_to_module) for n in nodes]
    owned: dict[str, list[int]] = {}
    for i, mods in enumerate(node_mods):
        for q in mods:
            owned.setdefault(q, []).append(i)

    # Forward hooks: outputs (cloned: in-place ReLU would overwrite them) and input identities.
    outs: dict[str, Any] = {}
    ins: dict[str, Any] = {}
    keep: list[Any] = []
    first_in: dict[str, int] = {}
    out_id: dict[str, int] = {}

    done: dict[str, int] = {}  # hook order: a successor must finish after its predecessor

    def hook(name):
        def fn(mod, inp, out):
            done.setdefault(name, len(done))
            if isinstance(out, torch.Tensor):
                keep.append(out)
                out_id[name] = id(out)
                outs[name] = out.detach().clone().float().numpy()
            if inp and isinstance(inp[0], torch.Tensor):
                keep.append(inp[0])  # keep it alive so its id() is not reused
                first_in[name] = id(inp[0])
                if inp[0].is_floating_point():
                    ins.setdefault(name, inp[0].detach().clone().float().numpy())
        return fn

    handles = [m.register_forward_hook(hook(q)) for q, m in named.items() if q]
    try:
        with torch.inference_mode():
            final = model(*[torch.from_numpy(np.ascontiguousarray(v)) for v in feed.values()])
    finally:
        for h in handles:
            h.remove()
    finals = final if isinstance(final, (tuple, list)) else [final]
    ort_out = collect_outputs(ort_activations(onnx_model, feed, ep=ep, batch=batch))
    avail = {**feed, **ort_out}  # graph inputs too: a first module reads one

    consumers: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        for t in n.input:
            consumers.setdefault(t, set()).add(i)
    graph_outputs = {o.name for o in onnx_model.graph.output}
    topo = {o: i for i, n in enumerate(nodes) for o in n.output}

    rows, unmapped = [], []
    for q in named:
        if not q or q not in outs or q not in owned:
            continue
        idx = set(owned[q])
        boundary = [o for i in sorted(idx) for o in nodes[i].output if o and (
            o in graph_outputs or consumers.get(o, set()) - idx)]
        # Follow node-less successors that an exporter folds into this module's nodes (a
        # BatchNorm folded into the Conv before it, Dropout, Identity). Other node-less
        # successors are not followed: dynamo attributes a Conv to the BatchNorm after it, so
        # the next block's conv_dw has no node of its own and is not part of this module.
        val, cur, seen = outs[q], q, 0
        while seen < 8:
            nxt = [m for m, src in first_in.items() if src == out_id.get(cur) and m not in owned
                   and m in outs and not list(named[m].children()) and m != cur
                   and _FOLDED_SUCCESSOR.search(type(named[m]).__name__)
                   # an in-place op (ReLU6(inplace=True)) returns the tensor object its
                   # predecessor read earlier: only modules that ran later follow it
                   and done.get(m, -1) > done.get(cur, -1)]
            if not nxt:
                break
            cur, val, seen = nxt[0], outs[nxt[0]], seen + 1
        cands = [o for o in boundary if o in ort_out and ort_out[o].shape == val.shape]
        if len(cands) != 1:
            unmapped.append({"module": q, "boundary": boundary[:4],
                             "reason": "no single ONNX tensor of the module's output shape"})
            continue
        st = TensorStat()
        st.update(val, ort_out[cands[0]], len(val) if val.ndim else 1)
        r = st.result(tol)
        row = {"module": q, "compared_as": cur, "type": type(named[q]).__name__,
               "tensor": cands[0], "node": nodes[topo[cands[0]]].name,
               "depth": q.count(".") + 1, "_topo": topo[cands[0]], **r}
        # The module's data input: the one tensor its nodes read from outside the module
        # (not a constant) with the shape PyTorch handed the module. If it already differs,
        # the error came from upstream (code between modules), not from this module.
        if q in ins:
            srcs = {t for i in idx for t in nodes[i].input if t and t in avail
                    and topo.get(t) not in idx and np.shape(avail[t]) == ins[q].shape}
            if len(srcs) == 1:
                t_in = srcs.pop()
                si = TensorStat()
                si.update(ins[q], avail[t_in], len(ins[q]) if ins[q].ndim else 1)
                ri = si.result(tol)
                row.update(input_tensor=t_in, inputs_agree=ri["status"] == "pass",
                           input_cosine_min=ri.get("cosine_min"),
                           input_node=nodes[topo[t_in]].name if t_in in topo else None)
        rows.append(row)
    rows.sort(key=lambda r: (r["_topo"], -r["depth"]))
    for i, r in enumerate(rows):
        r["index"] = i
        r.pop("_topo")
    out_names = [o.name for o in onnx_model.graph.output]
    t_final = {n: f.detach().float().numpy() for n, f in zip(out_names, finals)
               if isinstance(f, torch.Tensor)}
    fails = [r for r in rows if r["status"] == "fail"]
    result = {"onnx": str(onnx_path), "tolerances": tol, "modules": rows, "unmapped": unmapped,
              "first_divergent": fails[0] if fails else None,
              "final_outputs": compare_outputs(t_final, {k: v for k, v in ort_out.items()
                                                         if k in t_final}, tol),
              "status": "ok"}
    if out_dir:
        write_json(Path(out_dir) / "torch_vs_onnx.json", result)
    return result


_FOLDED_SUCCESSOR = re.compile(r"BatchNorm|Dropout|^Identity$")


def _legacy_scopes(model) -> dict[str, str]:
    """``{legacy scope string: module path}`` built from the module tree (ancestors only)."""
    out = {}

    def walk(mod, prefix: str, scope: str):
        for name, child in mod.named_children():
            q = f"{prefix}.{name}" if prefix else name
            s = f"{scope}/{_unqualified(q)}"
            out[s] = q
            walk(child, q, s)

    walk(model, "", "")
    return out
