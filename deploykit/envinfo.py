"""What this machine is: package versions, CPU model and INT8 ISA flags (AVX512-VNNI), GPU
and driver, git SHA, the ONNX Runtime EPs that really load, and ``common.py --env-summary``.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from deploykit.layout import ROOT


# --------------------------------------------------------------------------------------------
# Provenance and results
# --------------------------------------------------------------------------------------------
_VERSION_PACKAGES = ("numpy", "torch", "torchvision", "timm", "onnx", "onnxruntime",
                     "onnxruntime-gpu", "nvidia-modelopt", "onnx-graphsurgeon", "polygraphy",
                     "tensorrt")


def versions() -> dict[str, str | None]:
    """Installed versions of the tools that affect results (None = not installed); read from
    package metadata, so nothing heavy is imported."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for p in _VERSION_PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def gpu_driver() -> str | None:
    """NVIDIA display-driver version (``nvidia-smi --query-gpu=driver_version``), or None when
    nvidia-smi is absent or fails."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


# CPU features that decide ONNX Runtime's int8 kernels on x86-64: without a VNNI dot product
# (avx512_vnni / avx_vnni), MLAS's u8s8 kernels use VPMADDUBSW, whose int16 intermediate sums can
# saturate (ORT PR #12088, "x86/64 U8S8 Gemm Precision Fix"; oneDNN "Nuances of int8
# computations"), so the same Q/DQ model can score differently on two x86 CPUs.
_INT8_FLAGS = ("sse4_1", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu_int8_flags() -> list[str]:
    """The x86-64 features of :data:`_INT8_FLAGS` this CPU has (``/proc/cpuinfo``), [] elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _INT8_FLAGS if f in have]
    except OSError:
        pass
    return []


def cpu_has_vnni() -> bool | None:
    """True if the CPU has an int8 dot-product instruction (AVX512-VNNI or AVX-VNNI), False on
    an x86-64 CPU without one, None when unknown (not x86-64, no /proc/cpuinfo)."""
    flags = cpu_int8_flags()
    if not flags:
        return None
    return bool({"avx512_vnni", "avx_vnni"} & set(flags))


def device_info(torch_device: str | None = None) -> dict:
    """Host and accelerator description: machine, CPU model, core count and, when a GPU is in
    use (torch already imported and sees one), its name, CUDA version, compute capability and
    the NVIDIA driver version."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"machine": platform.machine(), "system": platform.system(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "cpu_flags": cpu_int8_flags(), "gpu": None}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        idx = torch.device(torch_device).index if torch_device and "cuda" in torch_device else 0
        info["gpu"] = torch.cuda.get_device_name(idx or 0)
        info["cuda"] = torch.version.cuda
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(idx or 0)))
        info["driver"] = gpu_driver()
    return info


def git_sha() -> str | None:
    """``HEAD`` commit of the checkout (``+dirty`` when the work tree differs), or None."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        # Code changes make a result "dirty"; regenerated results/ (tracked) do not.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)results"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        if not re.fullmatch(r"[0-9a-f]{40}", sha):  # e.g. a copy of the tree without history
            return None
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------------------------------
# Environment summary (printed by env.sh)
# --------------------------------------------------------------------------------------------
def ort_eps_that_load() -> tuple[str | None, list[str], dict[str, str]]:
    """ONNX Runtime version, the EPs that really create a session on a one-node model, and why
    the others (listed by ``get_available_providers``) did not."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None, [], {}
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    # IR version 8 (ONNX 1.10): old enough for every ORT release this toolkit supports; a newer
    # onnx package would otherwise stamp an IR version an older ORT refuses.
    blob = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()
    ok, failed = [], {}
    for ep in ort.get_available_providers():
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 4
            s = ort.InferenceSession(blob, so, providers=[ep])
            if s.get_providers()[0] == ep:
                ok.append(ep)
            else:
                failed[ep] = f"fell back to {s.get_providers()[0]}"
        except Exception as e:  # noqa: BLE001 - report any EP load failure
            failed[ep] = str(e).splitlines()[0][:120]
    return ort.__version__, ok, failed


def env_summary() -> str:
    """One block describing Python, torch/CUDA, ONNX Runtime EPs, ModelOpt, TensorRT, GPU."""
    v = versions()
    lines = [f"Python     {v['python']} ({sys.executable})"]
    gpu = "CPU only"
    try:
        import torch

        cuda = torch.version.cuda or "none (CPU build)"
        if torch.cuda.is_available():
            gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(f"torch      {torch.__version__}, CUDA {cuda}, torchvision {v['torchvision']}")
    except ImportError:
        lines.append("torch      not installed")
    ort_v, ok, failed = ort_eps_that_load()
    if ort_v is None:
        lines.append("ORT        not installed")
    else:
        pkg = "onnxruntime-gpu" if v.get("onnxruntime-gpu") else "onnxruntime"
        lines.append(f"ORT        {pkg} {ort_v}; EPs that load: {', '.join(ok) or 'none'}"
                     + "".join(f"; {k} fails: {m}" for k, m in failed.items()))
        if v.get("onnxruntime") and v.get("onnxruntime-gpu"):
            lines.append("WARNING    both onnxruntime and onnxruntime-gpu are installed: they "
                         "overwrite each other; uninstall both and install one")
    lines.append(f"ModelOpt   {v['nvidia-modelopt'] or 'not installed'}")
    trt = v.get("tensorrt")
    trtexec = os.environ.get("TRTEXEC")
    lines.append(f"TensorRT   python: {trt or 'not found'}; trtexec: {trtexec or 'not found'}")
    lines.append(f"GPU        {gpu}")
    return "\n".join(lines)
