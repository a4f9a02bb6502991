"""Remedies printed for a divergent layer: FP16 keep-FP32 command lines and TensorRT rebuild
flags that exist in the installed TensorRT version.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from deploykit.checks.fp16 import keep_fp32_nodes
from deploykit.commands import run_env, script_argv, shell_line
from deploykit.layout import model_tag, results_dir
from deploykit.onnx.graph import load_onnx
from deploykit.trt.rules import TRT_RULES
from deploykit.variants import get_variant


def fp16_remedy_command(layer: str, onnx_path: Path | str) -> list[str]:
    """Commands that keep ``layer`` in FP32 in the FP16 ONNX and rebuild its engine.

    The FP16 file is remade from its FP32 source by ``export_checks.py fp16`` (the converter of
    stage 2: FP32 inputs/outputs, ``--keep-fp32`` nodes computed in FP32, checked before it is
    installed) under the pipeline's name ``fp16.onnx`` (variant ``fp16`` of ``variants.py``), so
    stage 6 rebuilds it and stages 3/7 evaluate it as before.

    The layer's consumers are kept in FP32 too (when the FP32 file is there to read them):
    onnxconverter-common casts a kept node's output back to FP16 for every other consumer.

    Args:
        layer: ONNX node name (TensorRT's ONNX parser names layers after nodes).
        onnx_path: the ONNX the engine was built from (``artifacts/<model>/onnx/fp16.onnx``, or
            the FP32 file built with ``--fp16`` on TensorRT 8.x/10.x).
    Returns:
        the command lines (the first writes the file, the second rebuilds the engine).
    """

    onnx_path = Path(onnx_path)
    fp16 = get_variant("fp16").onnx_file
    fp32 = get_variant("fp32").onnx_file
    src = onnx_path if onnx_path.name == fp32 else onnx_path.with_name(fp32)
    dst = onnx_path.with_name(fp16)
    art = onnx_path.parent.parent
    calib = art / "calib.npz"
    inputs = ["--inputs", str(calib)] if calib.exists() else []
    keep = [layer]
    if src.exists():  # the layer's consumers too, or its output is cast back to FP16 for them

        m = load_onnx(src, external=False)
        node = next((n for n in m.graph.node if n.name == layer), None)
        if node is not None:
            keep = keep_fp32_nodes(m, [o for o in node.output if o]) or keep
    # pasteable from any folder (deploykit.commands): the model's name, not its folder's tag
    # and in the artifacts folder that holds the file
    model = _model_name(art)
    env = {**run_env(model), "ARTIFACTS": str(art.parent.resolve()), "MODEL": model}
    return [shell_line(script_argv("export_checks.py", ["fp16", str(src), "-o", str(dst),
                                                        "--keep-fp32", ",".join(keep), *inputs]),
                       env),
            shell_line(script_argv("6_build_engines.sh", ["--model", model, "fp16"]), env)]


def _model_name(art: Path) -> str:
    """The model whose artifacts folder is ``art``: ``$MODEL`` when its tag is the folder's
    name, else the ``model`` of its export record (``<RESULTS>/<tag>/export.json``), else the
    folder's name (a ``pkg.module:factory`` model's folder is ``pkg.module-factory``)."""
    env = os.environ.get("MODEL")
    if env and model_tag(env) == art.name:
        return env
    with contextlib.suppress(OSError, ValueError, AttributeError):
        rec = json.loads((results_dir() / art.name / "export.json").read_text())
        if isinstance(rec.get("model"), str) and model_tag(rec["model"]) == art.name:
            return rec["model"]
    return art.name


def trt_remedies(layer: str, onnx_path: Path | str, precision: str,
                 trt_version: str | None, engine_path: Path | str | None = None) -> list[str]:
    """Rebuild commands that may fix a wrong layer, limited to flags of ``trt_version``.

    Args:
        layer: the ONNX node name of the first divergent layer; TensorRT's ONNX parser names
            layers after ONNX nodes, which is what ``--layerPrecisions`` matches.
        precision: precision of the build (``fp32``/``fp16``/``int8``/...).
        trt_version: installed TensorRT version (default: list the 10.x forms and say so).
    Returns:
        Human-readable suggestions, most specific first. For FP16 they include the ONNX-level
        fix (:func:`fp16_remedy_command`), which writes a file the pipeline picks up.
    """
    major = int(trt_version.split(".")[0]) if trt_version else 10
    rules = TRT_RULES.get(major, TRT_RULES[11] if major > 11 else TRT_RULES[8])
    save = f" --saveEngine={engine_path}" if engine_path else ""
    base = f"trtexec --onnx={onnx_path}{save}"
    out = []
    if rules["layer_precisions"] and precision in ("fp16", "tf32", "fp32"):
        prec = " --fp16" if precision == "fp16" else ""
        out.append(f"{base}{prec} --layerPrecisions={layer}:fp32 --layerOutputTypes={layer}:fp32 "
                   "--precisionConstraints=obey  # keep the layer in FP32 (weakly typed build)")
    if precision in ("int8", "int4"):
        out.append(f"remove the Q/DQ pairs feeding {layer} in the ONNX (or re-quantise with "
                   f"ModelOpt, nodes_to_exclude=['{layer}']) and rebuild: {base}"
                   + (" --stronglyTyped" if rules["strongly_typed"] else ""))
    if precision == "fp16":
        why = (f"TensorRT {trt_version} is strongly typed only (no --layerPrecisions/"
               "--precisionConstraints): " if not rules["layer_precisions"] else "")
        cmds = fp16_remedy_command(layer, onnx_path)
        out.append(f"{why}keep {layer} in FP32 in the ONNX (FP32 inputs/outputs, same file "
                   f"name, variant fp16): {cmds[0]}  # then: {cmds[1]}")
    elif not rules["layer_precisions"]:
        out.append(f"TensorRT {trt_version} is strongly typed only (no --layerPrecisions/"
                   f"--precisionConstraints): keep {layer} in FP32 in the ONNX, then rebuild")
    if rules["no_tf32"] and precision in ("fp32", "tf32", "fp16"):
        out.append(f"{base}{' --fp16' if precision == 'fp16' and rules['weak_flags'] else ''} "
                   "--noTF32  # FP32 layers in true FP32 instead of TF32")
    out.append(f"polygraphy run {onnx_path} --trt --onnxrt --trt-outputs mark all "
               "--onnx-outputs mark all  # Polygraphy's own layer-wise cross-check")
    if trt_version is None:
        out.append("(TensorRT not installed here: commands use the 10.x flag set)")
    return out
