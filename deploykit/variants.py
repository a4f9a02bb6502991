"""The one registry of model variants: every ONNX file the pipeline makes, which stage makes it,
its precision, its ModelOpt recipe, and which stages build or evaluate it by default.

Every stage and script reads this table (``5_quantize.sh`` and ``run_all.sh`` through the
command line below), so a variant is added in one place.

Command line (for the shell scripts; the root script ``variants.py``)::

    python variants.py list [--stage 5|6|7] [--all] [--auto-precision]
                                                         # names, one per line, pipeline order
    python variants.py describe NAME                     # one-line description
    python variants.py needs-tuning NAME                 # exit 0 if NAME needs the tuning split
    python variants.py modelopt-args NAME --calib C --eps E [--depthwise N ...] [--stem N ...]
                                     [--auto N ...]      # ModelOpt CLI flags, one per line

Tags derived from a variant name ``v``: ORT row ``ort_v``, TensorRT row ``trt_v``, engine build
row ``trt_build_v``, quantization record ``quant_v``; ONNX file ``artifacts/<model>/onnx/v.onnx``,
plan ``artifacts/<model>/engines/v.plan``.

"""
from __future__ import annotations

import dataclasses
from typing import Sequence



EXPORT = "2_export_onnx.py"


QUANT = "5_quantize.sh"


INT4 = "5b_quantize_int4.py"


# Placeholders in a recipe, filled from the graph by stage 5 (qdq_tools.py list-depthwise /
# list-stem, anchored regexes) or by the mixed-precision search (auto_precision.py search).
DEPTHWISE = "{depthwise}"


STEM = "{stem}"


AUTO = "{auto}"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ONNX variant of a model.

    Attributes:
        name: the name on every command line; the ONNX file is ``<name>.onnx``.
        precision: report label: ``FP32``, ``FP16``, ``INT8`` or ``INT4``.
        kind: what decides the TensorRT precision flags: ``fp32`` (plain FP32 graph), ``fp16``
            (FP16-typed graph), ``qdq`` (INT8 Q/DQ graph), ``int4`` (INT4 weight-only Q/DQ).
        producer: the stage that writes the ONNX file (named in "missing input" errors).
        description: one line for ``--help`` and the report.
        modelopt: stage 5 only: ModelOpt CLI flags besides input/output/calibration, with the
            placeholders :data:`DEPTHWISE` and :data:`STEM` for graph-derived node lists.
        default: made and evaluated (ORT) by a default run; False = ``--all-variants`` only.
        engine: stage 6 builds it by default (when its ONNX exists) and stage 7 evaluates it
            (not a failure reproduction).
        high_precision_fp16: the Q/DQ graph keeps its non-quantized layers in FP16 (ModelOpt
            ``--high_precision_dtype fp16``, its default); a weakly typed TensorRT build then
            needs ``--fp16`` besides ``--int8``.
        expected_failure: made on purpose to reproduce a known failure (not a deliverable).
        needs_tuning: made only on request, from a tuning split (``0_prepare_data.py
            --tune-fraction``, ``run_all.sh --auto-precision``): left out of every default and
            ``--all`` list unless ``auto_precision=True`` (:func:`for_stage`), so a default run
            keeps its rows.
    """

    name: str
    precision: str
    kind: str
    producer: str
    description: str
    modelopt: tuple[str, ...] | None = None
    default: bool = False
    engine: bool = False
    high_precision_fp16: bool = False
    expected_failure: bool = False
    needs_tuning: bool = False

    @property
    def onnx_file(self) -> str:
        """File name under ``artifacts/<model>/onnx/``."""
        return f"{self.name}.onnx"

    @property
    def ort_tag(self) -> str:
        return f"ort_{self.name}"

    @property
    def trt_tag(self) -> str:
        return f"trt_{self.name}"

    @property
    def build_tag(self) -> str:
        return f"trt_build_{self.name}"


_INT8 = ("--quantize_mode", "int8")


_CONV_GEMM = ("--op_types_to_quantize", "Conv", "Gemm")


_HP32 = ("--high_precision_dtype", "fp32")


_HP16 = ("--high_precision_dtype", "fp16")


_EXCL_DW = ("--nodes_to_exclude", DEPTHWISE)


# Pipeline order: the report lists rows in this order within a backend and precision.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("fp32", "FP32", "fp32", EXPORT, "ONNX FP32 export", default=True, engine=True),
    Variant("fp16", "FP16", "fp16", EXPORT, "ONNX FP16 (fp16 weights and compute, fp32 I/O)",
            default=True, engine=True),
    Variant("baseline", "INT8", "qdq", QUANT,
            "ModelOpt INT8 defaults: all default op types, entropy, fp16 high-precision dtype",
            modelopt=_INT8, default=True, high_precision_fp16=True),
    Variant("int8", "INT8", "qdq", QUANT,
            "recipe: Conv+Gemm only, depthwise excluded, fp16 high-precision dtype",
            modelopt=_INT8 + _CONV_GEMM + _EXCL_DW + _HP16, default=True, engine=True,
            high_precision_fp16=True),
    Variant("int8_hp32", "INT8", "qdq", QUANT,
            "recipe with fp32 high-precision dtype (scales kept fp32)",
            modelopt=_INT8 + _CONV_GEMM + _EXCL_DW + _HP32, default=True, engine=True),
    Variant("calib_max", "INT8", "qdq", QUANT, "ablation: baseline + --calibration_method max",
            modelopt=_INT8 + ("--calibration_method", "max"), high_precision_fp16=True),
    Variant("fp32_only", "INT8", "qdq", QUANT, "ablation: baseline + --high_precision_dtype fp32",
            modelopt=_INT8 + _HP32),
    Variant("excl_stem", "INT8", "qdq", QUANT, "ablation: baseline + stem conv excluded",
            modelopt=_INT8 + ("--nodes_to_exclude", STEM), high_precision_fp16=True),
    Variant("excl_dw", "INT8", "qdq", QUANT, "ablation: baseline + depthwise convs excluded",
            modelopt=_INT8 + _EXCL_DW, high_precision_fp16=True),
    Variant("conv_gemm", "INT8", "qdq", QUANT,
            "ablation: baseline + --op_types_to_quantize Conv Gemm",
            modelopt=_INT8 + _CONV_GEMM, high_precision_fp16=True),
    Variant("excl_dw_hp32", "INT8", "qdq", QUANT,
            "ablation: fp32_only + depthwise convs excluded", modelopt=_INT8 + _HP32 + _EXCL_DW),
    Variant("conv_gemm_hp32", "INT8", "qdq", QUANT,
            "ablation: fp32_only + --op_types_to_quantize Conv Gemm",
            modelopt=_INT8 + _HP32 + _CONV_GEMM),
    Variant("int8_auto", "INT8", "qdq", QUANT,
            "mixed precision for an accuracy budget: Conv+Gemm INT8 except the nodes the search "
            "keeps in float (auto_precision.py), fp32 scales",
            modelopt=_INT8 + _CONV_GEMM + ("--nodes_to_exclude", AUTO) + _HP32, engine=True,
            needs_tuning=True),
    Variant("int4", "INT4", "int4", INT4,
            "INT4 weight-only, blocked, Gemm/MatMul, block size chosen and axis verified",
            default=True, engine=True),
    Variant("int4_cli_broken", "INT4", "int4", QUANT,
            "INT4 via the ModelOpt CLI, default block 128 (awq_clip): reproduces the axis bug",
            modelopt=("--quantize_mode", "int4"), engine=True, expected_failure=True),
)}


PRECISION_ORDER = {"FP32": 0, "FP16": 1, "INT8": 2, "INT4": 3}


def get_variant(name: str) -> Variant:
    """The variant called ``name``.

    Raises:
        KeyError: unknown name; the message lists the known ones.
    """
    try:
        return VARIANTS[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}") from None


def variant_order(name: str | None) -> int:
    """Position of ``name`` in the registry (unknown names sort last)."""
    names = list(VARIANTS)
    return names.index(name) if name in VARIANTS else len(names)


def for_stage(stage: int, include_all: bool = False, auto_precision: bool = False
              ) -> list[Variant]:
    """Variants a stage handles, in pipeline order.

    Args:
        stage: 5 (quantized by ``5_quantize.sh`` + ``5b_quantize_int4.py``), 6/7 (TensorRT
            engines), 3 (ORT rows of the export stage).
        include_all: also the ablations and failure reproductions (``--all-variants``).
        auto_precision: also the variants that need a tuning split (``needs_tuning``:
            ``int8_auto``; ``run_all.sh --auto-precision``).
    """
    keep = [v for v in VARIANTS.values() if auto_precision or not v.needs_tuning]
    if stage == 3:
        return [v for v in keep if v.producer == EXPORT]
    if stage == 5:
        return [v for v in keep if v.producer in (QUANT, INT4)
                and (include_all or v.default or v.needs_tuning)]
    if stage == 6:  # a failure reproduction is built (to show the failure) when its ONNX exists
        return [v for v in keep if v.engine]
    if stage == 7:
        return [v for v in keep if v.engine and not v.expected_failure]
    raise ValueError(f"no variants for stage {stage}")


def variant_of_file(path) -> Variant | None:
    """The variant whose ONNX/plan file stem is ``path``'s (``int8.onnx``, ``int8.plan``)."""
    from pathlib import Path

    return VARIANTS.get(Path(path).stem)


def modelopt_args(name: str, calib: str, eps: str, depthwise: Sequence[str] = (),
                  stem: Sequence[str] = (), auto: Sequence[str] = ()) -> list[str]:
    """ModelOpt ONNX CLI flags (besides ``--onnx_path``/``--output_path``) of a stage-5 variant.

    Args:
        calib: ``--calibration_data_path``; eps: ``--calibration_eps``.
        depthwise / stem / auto: node-name regexes substituted for the placeholders (``auto``:
            the nodes the mixed-precision search keeps in float); a flag whose list is empty
            is dropped together with the flag (``--nodes_to_exclude`` with no node would
            swallow the next flag).
    Raises:
        KeyError: unknown variant; ValueError: the variant has no ModelOpt recipe, or it
            excludes the stem and ``stem`` is empty (a model without a stem convolution).
    """
    v = get_variant(name)
    if v.modelopt is None:
        raise ValueError(f"variant {name} is not made by the ModelOpt CLI ({v.producer} makes it)")
    if STEM in v.modelopt and not stem:
        raise ValueError(f"variant {name} excludes the stem convolution, but the model has none "
                         "(qdq_tools.py list-stem finds no Conv fed by a graph input): this "
                         "ablation does not apply to it")
    out: list[str] = []
    for tok in v.modelopt:
        if tok == DEPTHWISE:
            out += list(depthwise)
        elif tok == STEM:
            out += list(stem)
        elif tok == AUTO:
            out += list(auto)
        else:
            out.append(tok)
    # Drop a --nodes_to_exclude that got no names.
    cleaned: list[str] = []
    for i, tok in enumerate(out):
        if tok == "--nodes_to_exclude" and (i + 1 == len(out) or out[i + 1].startswith("--")):
            continue
        cleaned.append(tok)
    return cleaned + ["--calibration_data_path", calib, "--calibration_eps", eps]
