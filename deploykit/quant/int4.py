"""INT4 weight-only quantization (stage 5b): blocked DequantizeLinear axis / scale-shape
consistency and the axis repair for ModelOpt 0.47.0's Gemm weights, blocked dequantization, the
block size choice, the [K, N] weight layout ModelOpt expects, its INT4 call and the verification
of every block against the float weight.
"""
from __future__ import annotations

import contextlib

import logging
import os
from pathlib import Path

import numpy as np

from deploykit.errors import StageError, UsageError
from deploykit.io import load_npz
from deploykit.layout import model_results
from deploykit.onnx.graph import attr, constants, consumers
from deploykit.quant.health import check_against_float, check_weights
from deploykit.quant.modelopt_log import log_warnings
from deploykit.quant.qdq import reduction_axis, weight_consumers


# --------------------------------------------------------------------------------------------
# INT4 blocked DequantizeLinear: axis detection and repair
# --------------------------------------------------------------------------------------------
def _fits(x_shape, s_shape, axis: int, block: int) -> bool:
    """True if ``s_shape`` is the blocked-scale shape of ``x_shape`` along ``axis`` (ONNX
    DequantizeLinear-21: equal everywhere except ``ceil(x[axis] / block)`` on ``axis``)."""
    if len(x_shape) != len(s_shape):
        return False
    return all(s == (-(-x // block) if a == axis else x)
               for a, (x, s) in enumerate(zip(x_shape, s_shape)))


def check_blocked_dq(model) -> list[dict]:
    """Every blocked DequantizeLinear (``block_size > 0``) with its axis verdict.

    Returns:
        ``[{"name", "axis", "block_size", "x_shape", "scale_shape", "valid_axes", "status"}]``
        with ``status`` ``ok`` (``axis`` fits the scale layout), ``mismatch`` (exactly one other
        axis fits: repairable), ``unrepairable`` (none or several fit) or ``unknown`` (data or
        scale are not constants).
    """
    consts = constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or int(attr(n, "block_size", 0) or 0) <= 0:
            continue
        block = int(attr(n, "block_size"))
        rec = {"name": n.name, "axis": int(attr(n, "axis", 1)), "block_size": block,
               "x_shape": None, "scale_shape": None, "valid_axes": [], "status": "unknown"}
        if n.input[0] in consts and len(n.input) > 1 and n.input[1] in consts:
            xs, ss = consts[n.input[0]].shape, consts[n.input[1]].shape
            rec["x_shape"], rec["scale_shape"] = list(xs), list(ss)
            valid = [a for a in range(len(xs)) if _fits(xs, ss, a, block)]
            rec["valid_axes"] = valid
            axis = rec["axis"] % len(xs) if xs else rec["axis"]
            if axis in valid:
                rec["status"] = "ok"
            elif len(valid) == 1:
                rec["status"] = "mismatch"
            else:
                rec["status"] = "unrepairable"
        out.append(rec)
    return out


def fix_int4_axis(model) -> tuple[object, list[dict]]:
    """Repair the ``axis`` of blocked DequantizeLinear nodes flagged ``mismatch`` by
    :func:`check_blocked_dq`, in place; consistent nodes are not touched.

    Returns:
        ``(model, fixed)`` with ``fixed`` the records of the repaired nodes (``new_axis`` added).
    Raises:
        StageError: a node is ``unrepairable`` (the scale shape fits no axis, or several).
    """
    from onnx import helper

    report = check_blocked_dq(model)
    bad = [r for r in report if r["status"] == "unrepairable"]
    if bad:
        raise StageError(
            f"{len(bad)} blocked DequantizeLinear node(s) whose scale fits no single axis, e.g. "
            f"{bad[0]['name']}: x {bad[0]['x_shape']}, scale {bad[0]['scale_shape']}, block "
            f"{bad[0]['block_size']}: re-quantize with a block size that divides K")
    todo = {r["name"]: r for r in report if r["status"] == "mismatch"}
    fixed = []
    for n in model.graph.node:
        if n.name in todo and n.op_type == "DequantizeLinear":
            rec = dict(todo[n.name], new_axis=todo[n.name]["valid_axes"][0])
            keep = [a for a in n.attribute if a.name != "axis"]
            del n.attribute[:]
            n.attribute.extend(keep + [helper.make_attribute("axis", rec["new_axis"])])
            fixed.append(rec)
    return model, fixed


def dequantize_blocked(q: np.ndarray, scale: np.ndarray, axis: int, block: int,
                       zero_point: np.ndarray | None = None) -> np.ndarray:
    """Reference blocked dequantization (ONNX DequantizeLinear-21) in float64."""
    s = np.repeat(scale.astype(np.float64), block, axis=axis)
    s = np.take(s, np.arange(q.shape[axis]), axis=axis)
    zp = 0.0
    if zero_point is not None:
        zp = np.take(np.repeat(zero_point.astype(np.float64), block, axis=axis),
                     np.arange(q.shape[axis]), axis=axis)
    return (q.astype(np.float64) - zp) * s


DEFAULT_CANDIDATES = (128, 64, 32, 16)


def quantized_k_dims(model) -> list[dict]:
    """The Gemm/MatMul nodes ModelOpt's INT4 path quantizes (constant 2-D weight) with their
    reduction dimension K.

    Returns:
        ``[{"node", "op", "weight", "shape", "k"}]``; for Gemm ``K = shape[1]`` if ``transB``
        else ``shape[0]``; for MatMul ``K = shape[-2]``.
    """
    consts = constants(model)
    out = []
    for n in model.graph.node:
        if n.op_type not in ("Gemm", "MatMul") or len(n.input) < 2 or n.input[1] not in consts:
            continue
        shape = consts[n.input[1]].shape
        if len(shape) < 2:
            continue
        if n.op_type == "Gemm":
            k = shape[1] if int(attr(n, "transB", 0)) else shape[0]
        else:
            k = shape[-2]
        out.append({"node": n.name, "op": n.op_type, "weight": n.input[1],
                    "shape": list(shape), "k": int(k)})
    return out


def choose_block_size(ks: list[int], override: int | None = None,
                      candidates=DEFAULT_CANDIDATES) -> int:
    """Block size for INT4: ``override`` if given (checked), else the first of ``candidates``
    that divides every K.

    Raises:
        UsageError: ``override`` is not positive or does not divide every K.
        StageError: no K at all, or no candidate divides every K (message lists the K values).
    """
    if not ks:
        raise StageError("no Gemm/MatMul with a constant weight: nothing to quantize "
                         "to INT4 (ModelOpt's ONNX INT4 path is Gemm/MatMul only)")
    if override is not None:
        if override <= 0:
            raise UsageError(f"--block-size {override}: must be > 0")
        bad = sorted({k for k in ks if k % override})
        if bad:
            raise UsageError(f"--block-size {override} does not divide K = {bad}")
        return override
    for b in candidates:
        if b > 0 and all(k % b == 0 for k in ks):
            return int(b)
    raise StageError(f"no block size in {list(candidates)} divides every K "
                     f"({sorted(set(ks))}): pass --block-size or --block-candidates")


def layout_for_int4(model) -> tuple[object, list[dict]]:
    """Copy of ``model`` whose Gemm weights are ``[K, N]``: every Gemm with ``transB=1`` and a
    constant 2-D weight gets the transposed weight (new initializer ``<name>_KN``) and
    ``transB=0`` (the same function). ModelOpt's INT4 path blocks along axis 0, which is then K
    for every Gemm and MatMul weight.

    Returns:
        ``(new model, [{"node", "weight", "new_weight", "shape"}])``.
    """
    import copy

    from onnx import helper, numpy_helper

    model = copy.deepcopy(model)
    consts = constants(model)
    inits = {i.name for i in model.graph.initializer}
    changed = []
    for n in model.graph.node:
        if (n.op_type != "Gemm" or len(n.input) < 2 or n.input[1] not in inits
                or not int(attr(n, "transB", 0))):
            continue
        w = consts[n.input[1]]
        if w.ndim != 2:
            continue
        new = f"{n.input[1]}_KN"
        if new not in inits:
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), new))
            inits.add(new)
        changed.append({"node": n.name, "weight": n.input[1], "new_weight": new,
                        "shape": list(w.T.shape)})
        n.input[1] = new
        keep = [a for a in n.attribute if a.name != "transB"]
        del n.attribute[:]
        n.attribute.extend(keep + [helper.make_attribute("transB", 0)])
    used = {i for n in model.graph.node for i in n.input}
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return model, changed


VERIFY_KINDS = ("block_axis", "block_scale_shape", "block_opset", "weight_error", "dead_channels")


def verify_blocks(q_model, float_model) -> tuple[list[dict], list[dict]]:
    """Every quantized weight checked: blocked DequantizeLinear axis = reduction axis of its
    consumer, scale shape fits, opset defines ``block_size``, dequantized weight within the
    bit width's tolerance of the float weight per output channel (:mod:`deploykit.quant.health`).

    Returns:
        ``(problems [finding dicts of the kinds in VERIFY_KINDS], per-weight rows)``.
    """

    consts = constants(q_model)
    problems = [f.as_dict() for f in check_weights(q_model, consts)
                if f.kind in VERIFY_KINDS]
    found, rows = check_against_float(q_model, float_model, consts)
    problems += [f.as_dict() for f in found]
    return problems, rows


def repair_axes(model) -> list[dict]:
    """Set ``axis`` of blocked DequantizeLinear nodes to the reduction axis of their consumer
    where the scale is laid out along that axis and ``axis`` says otherwise (ModelOpt's
    awq_clip on ``[N, K]`` Gemm weights). Other inconsistencies are left for
    :func:`verify_blocks` to refuse.

    Returns:
        the :func:`deploykit.quant.int4.check_blocked_dq` records of the repaired nodes (``new_axis``).
    """
    from onnx import helper

    cons = consumers(model)
    fixed = []
    nodes = {n.name: n for n in model.graph.node}
    for r in check_blocked_dq(model):
        if r["status"] != "mismatch":
            continue
        dq = nodes[r["name"]]
        users = weight_consumers(dq.output[0], cons)
        if not users:
            continue
        node, pos = users[0]
        red = reduction_axis(node, len(r["x_shape"]), pos)
        if red is None or red not in r["valid_axes"]:
            continue
        keep = [a for a in dq.attribute if a.name != "axis"]
        del dq.attribute[:]
        dq.attribute.extend(keep + [helper.make_attribute("axis", red)])
        fixed.append(dict(r, new_axis=red))
    return fixed


def run_modelopt(src: Path, dst: Path, log: Path, calib: Path | dict | None, method: str,
                 block: int, eps: str, calibration_shapes: str | None = None) -> list[str]:
    """``modelopt.onnx.quantization.quantize`` (INT4) with its log captured in ``log``.

    ``calib``: the calibration arrays already read (``{input name: array}``, as stage 5b
    hashes them), or an npz path (read here), or None (``rtn_dq``).

    Inside stage 5 (``5_quantize.py ... int4``) the run goes to the stage's ModelOpt worker
    (:func:`deploykit.quant.modelopt_runner.active_worker`; ``qdq_tools.py modelopt-int4``, this
    function there, on the same model and the same arrays saved to an npz), so that the stage's
    own process never imports ModelOpt; ModelOpt's console output is printed here after it.

    Returns:
        the ModelOpt warnings worth keeping.
    Raises:
        StageError: ModelOpt raised (message carries the log tail), or the worker's run failed.
    """
    import shutil
    import tempfile

    from deploykit.quant.modelopt_runner import active_worker

    worker = active_worker()
    if worker is not None:
        return _run_in_worker(worker, src, dst, log, calib, method, block, eps,
                              calibration_shapes)

    from modelopt.onnx.quantization import quantize

    # ModelOpt 0.47.0 rewrites the file given as onnx_path: hand it a private copy.
    work = Path(tempfile.mkdtemp(dir=log.parent, prefix=".tmp-5b_int4."))  # beside the log
    if isinstance(src, Path):
        src = Path(shutil.copy2(src, work / "fp32.onnx"))
    else:  # a ModelProto (the [K, N] layout)
        import onnx

        onnx.save(src, str(work / "fp32.onnx"))
        src = work / "fp32.onnx"
    kwargs = {"onnx_path": str(src), "quantize_mode": "int4", "calibration_method": method,
              "calibration_eps": [eps], "block_size": block, "output_path": str(dst),
              "log_file": str(work / log.name), "log_level": "INFO"}
    # ModelOpt opens its log by name: it writes in the private work folder (no link can be
    # planted there) and the log is moved to ``log`` when it is done.
    work_log = work / log.name
    if calib is not None:
        kwargs["calibration_data"] = calib if isinstance(calib, dict) else load_npz(
            calib, None, "4_make_calib.py", flag="--calib", feed=True)
        if calibration_shapes:
            kwargs["calibration_shapes"] = calibration_shapes
    try:
        quantize(**kwargs)
    except Exception as e:  # noqa: BLE001 - ModelOpt raises many types
        tail = (work_log.read_text(errors="replace").splitlines()[-15:] if work_log.exists()
                else [])
        raise StageError(f"ModelOpt INT4 failed: {type(e).__name__}: {e}\n"
                         + "\n".join(tail)) from e
    finally:
        for h in list(logging.getLogger("modelopt").handlers):
            if (isinstance(h, logging.FileHandler)
                    and Path(h.baseFilename) == work_log.resolve()):
                h.close()
                logging.getLogger("modelopt").removeHandler(h)
        if work_log.exists():
            os.replace(work_log, log)
        shutil.rmtree(work, ignore_errors=True)
    return log_warnings(log) if log.exists() else []


def preload_modelopt() -> None:
    """Import ModelOpt's ONNX quantization here now, where :func:`run_modelopt` will run it in
    this process (no stage ModelOpt worker is active): stage 5b then times ModelOpt's run, not
    its import (about 3.5 s here; with the import, a run beside stage 5's INT8 variants recorded
    7.3-11.9 s against 2.0-3.0 s: review of stop 46). An import error is left to that run, which
    reports it."""
    from deploykit.quant.modelopt_runner import active_worker

    if active_worker() is None:
        with contextlib.suppress(ImportError):
            import modelopt.onnx.quantization  # noqa: F401


def _run_in_worker(worker, src: Path, dst: Path, log: Path, calib: Path | dict | None,
                   method: str, block: int, eps: str, calibration_shapes: str | None
                   ) -> list[str]:
    """:func:`run_modelopt` in ``worker`` (``qdq_tools.py modelopt-int4``); see there."""
    import shutil
    import sys
    import tempfile

    import onnx

    work = Path(tempfile.mkdtemp(dir=log.parent, prefix=".tmp-5b_int4.")).resolve()
    dst, log = Path(dst).resolve(), Path(log).resolve()
    try:
        if isinstance(src, Path):
            model_path = src.resolve()  # the worker runs at the repository root
        else:  # a ModelProto (the [K, N] layout)
            model_path = work / "float.onnx"
            onnx.save(src, str(model_path))
        argv = ["qdq_tools.py", "modelopt-int4", "--onnx", str(model_path), "--output",
                str(dst), "--log", str(log), "--method", method, "--block", str(block),
                "--eps", eps]
        if isinstance(calib, dict):
            np.savez(work / "calib.npz", **calib)  # the same arrays, bytes and order
            argv += ["--calib", str(work / "calib.npz")]
        elif calib is not None:
            argv += ["--calib", str(Path(calib).resolve())]
        if calibration_shapes:
            argv += ["--calibration-shapes", calibration_shapes]
        out = work / "console.log"
        out.touch()
        rc = worker.run(argv, out)
        text = out.read_text(errors="replace")
        if text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()
        if rc != 0:
            tail = "\n".join(text.splitlines()[-15:])
            raise StageError(f"ModelOpt INT4 failed in stage 5's ModelOpt worker (exit {rc}):\n"
                             f"{tail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return log_warnings(log) if log.exists() else []


def int4_worker_job(args) -> list[str]:
    """``qdq_tools.py modelopt-int4``: :func:`run_modelopt` in this process (the worker's side
    of :func:`_run_in_worker`).

    Raises:
        UsageError: ``--method awq_clip`` without ``--calib`` (ModelOpt would calibrate on
            random data).
    """
    if args.method == "awq_clip" and args.calib is None:
        raise UsageError("--method awq_clip needs --calib (calibration npz): without it ModelOpt "
                         "calibrates on random data")
    return run_modelopt(args.onnx, args.output, args.log, args.calib, args.method, args.block,
                        args.eps, args.calibration_shapes)


def stage4_seed(model: str, sha: str) -> int | None:
    """Order seed stage 4 recorded for the npz with this sha256 (None if another npz)."""
    import json

    path = model_results(model) / "calib.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec.get("order_seed") if rec.get("sha256") == sha else None
