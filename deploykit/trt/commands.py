"""trtexec command lines per TensorRT major version (build and plan-version).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from deploykit.errors import UsageError
from deploykit.trt.profiles import InputProfile, shape_flags
from deploykit.trt.rules import (
    UnsupportedVariant,
    check_supported,
    dla_allowed,
    full_version,
    variant_unsupported,
    vstr,
)
from deploykit.variants import VARIANTS


# --------------------------------------------------------------------------------------------
# Command lines per TensorRT major version
# --------------------------------------------------------------------------------------------
def build_command(onnx: Path | str, plan: Path | str, variant: str, trt_version: Sequence[int], *,
                  timing_cache: Path | str, layer_info: Path | str | None = None,
                  profiles: Sequence[InputProfile] = (), mem_pool_mb: int | None = None,
                  dla_core: int | None = None, int8: str | None = None,
                  calib: Path | str | None = None, no_tf32: bool = False,
                  trtexec: str = "trtexec") -> list[str]:
    """The trtexec command that builds ``variant`` from ``onnx`` on ``trt_version``.

    Precision rules:
    - 8.x (weakly typed only): ``--fp16`` for the FP16 graph, ``--int8`` for Q/DQ graphs (without
      it TensorRT 8 does not pick INT8 kernels for Q/DQ); nothing for FP32. INT4 graphs are not
      buildable (raises :class:`UnsupportedVariant`).
    - 9.x/10.x: ``--stronglyTyped`` for FP16, Q/DQ and INT4 graphs, so precision comes from the
      ONNX tensor types; FP32 is a plain build. DLA builds and the implicit INT8 path are weakly
      typed (``--fp16`` / ``--int8 --fp16 --calib``), the documented DLA path up to 10.7.
    - 11.x: strongly typed only; no precision flag at all (``--fp16``/``--int8``/``--best`` are
      "Unknown option"; ``--stronglyTyped`` is a no-op and left out); no implicit INT8.
    - The implicit INT8 path (``int8="implicit"``): ``onnx`` is the FP32 model,
      ``--int8 --calib=<cache>``, plus ``--fp16`` (layers without a scale run in FP16; DLA has
      no FP32) where the variant keeps FP16 high-precision layers or for DLA (NVIDIA's
      qdq-translator README builds DLA the same way: ``--int8 --fp16 --calib``).
    Never passed: ``--explicitBatch``, ``--workspace``, ``--buildOnly``, ``--best``.

    Args:
        onnx, plan: input model and output plan path.
        variant: a key of :data:`VARIANTS`.
        trt_version: detected (or ``--trt-version``) TensorRT version, e.g. ``(10, 3, 0)``.
        timing_cache: ``--timingCacheFile`` (read if present, updated after the build).
        layer_info: ``--exportLayerInfo`` path (with ``--profilingVerbosity=detailed``); None
            leaves both out.
        profiles: :func:`input_profiles` of the model; the dynamic ones become
            ``--minShapes/--optShapes/--maxShapes`` (trtexec times the build at the opt shape).
            With ``dla_core`` every profile must be static (min = opt = max).
        mem_pool_mb: workspace pool limit in MiB (``--memPoolSize=workspace:N``, a plain number,
            which every trtexec reads as MiB; see the module docstring).
        dla_core: DLA core; always paired with ``--allowGPUFallback``.
        int8: for Q/DQ variants, ``"qdq"`` (default) or ``"implicit"`` (see above).
        calib: calibration cache for the implicit path.
        no_tf32: add ``--noTF32`` (FP32 layers otherwise may use TF32 on Ampere+).
        trtexec: program path.
    Returns:
        argv list.
    Raises:
        UsageError: unknown variant, TensorRT < 8.5, bad DLA request, dynamic profile with DLA,
            implicit INT8 without a cache, a bad memory pool size.
        UnsupportedVariant: the variant cannot be built with this version or device.
    """
    if variant not in VARIANTS:
        raise UsageError(f"unknown variant {variant!r}: choose from {', '.join(VARIANTS)}")
    v = VARIANTS[variant]
    ver = full_version(trt_version)
    major = ver[0]
    check_supported(ver)
    why = variant_unsupported(ver, v)
    if why:
        raise UnsupportedVariant(why)
    implicit = v.kind == "qdq" and int8 == "implicit"
    if implicit and major >= 11:
        raise UnsupportedVariant(f"{variant}: TensorRT {vstr(ver)} has no implicit INT8 "
                                 "(--int8/--calib removed in 11.0)")
    if implicit and not calib:
        raise UsageError(f"{variant}: the implicit INT8 path needs a calibration cache (calib=)")
    if dla_core is not None:
        if dla_core < 0:
            raise UsageError(f"--dla-core {dla_core}: must be >= 0")
        why = dla_allowed(ver, v)
        if why:
            raise UsageError(why)
        if v.kind == "qdq" and not implicit:
            raise UsageError(f"{variant} on DLA: DLA takes INT8 from a calibration cache "
                             "(implicit path), not from Q/DQ nodes (NVIDIA/TensorRT#2222)")
        dyn = [p.name for p in profiles if not p.static_profile]
        if dyn:
            raise UsageError(f"DLA needs a static profile (min = opt = max) for every input "
                             f"('DLA Supported Layers and Restrictions'); dynamic: "
                             f"{', '.join(dyn)}")
    cmd = [trtexec, f"--onnx={onnx}", f"--saveEngine={plan}", f"--timingCacheFile={timing_cache}"]
    cmd += shape_flags(profiles)
    weak = major < 9 or (major < 11 and (dla_core is not None or implicit))
    if weak:
        if v.kind == "fp16":
            cmd.append("--fp16")
        elif v.kind == "qdq":
            # Weak typing ignores the ONNX's float types: the layers ModelOpt left in FP16
            # (high-precision dtype fp16, e.g. the `int8` recipe) run in FP32 unless --fp16 is
            # also given; fp32 high-precision variants (`int8_hp32`) keep them FP32 on purpose.
            # DLA has no FP32 layers, so its unquantized layers need --fp16 in any case.
            cmd.append("--int8")
            if v.high_precision_fp16 or dla_core is not None:
                cmd.append("--fp16")
            if implicit:
                cmd.append(f"--calib={calib}")
    elif major < 11 and v.kind in ("fp16", "qdq", "int4"):
        cmd.append("--stronglyTyped")
    if layer_info is not None:
        cmd += ["--profilingVerbosity=detailed", f"--exportLayerInfo={layer_info}"]
    if mem_pool_mb is not None:
        if mem_pool_mb <= 0:
            raise UsageError(f"--mem-pool-mb {mem_pool_mb}: must be > 0")
        # A plain number: MiB in every trtexec. No unit suffix: 10.0.x scales "N<suffix>" to
        # bytes and then again as MiB (module docstring).
        cmd.append(f"--memPoolSize=workspace:{mem_pool_mb}")
    if dla_core is not None:
        cmd += [f"--useDLACore={dla_core}", "--allowGPUFallback"]
    if no_tf32:
        cmd.append("--noTF32")
    return cmd


def plan_version_command(plan: Path | str, trt_version: Sequence[int], trtexec: str = "trtexec"
                         ) -> list[str] | None:
    """``trtexec --loadEngine=P --getPlanVersionOnly`` where the flag exists (9.x+), else None
    (8.x: verify by deserialising with the Python runtime instead)."""
    if trt_version[0] < 9:
        return None
    return [trtexec, f"--loadEngine={plan}", "--getPlanVersionOnly"]
