"""Detection: trtexec, the libnvinfer it loads, the Python runtime, Jetson (L4T, DLA cores), and
version conflicts between them.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from deploykit.trt.parsers import Version, decode_version_int, parse_ldd, parse_trtexec_version
from deploykit.trt.rules import vstr


# --------------------------------------------------------------------------------------------
# Detection: trtexec, loaded libnvinfer, Python runtime, Jetson
# --------------------------------------------------------------------------------------------
JETPACK_TRTEXEC = Path("/usr/src/tensorrt/bin/trtexec")  # JetPack / Debian packages, not on PATH


def find_trtexec(env: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """Locate trtexec: ``$TRTEXEC``, else ``PATH``, else ``/usr/src/tensorrt/bin/trtexec``.

    Returns:
        ``(path, how)`` or ``(None, reason)``.
    """
    env = os.environ if env is None else env
    given = env.get("TRTEXEC")
    if given:
        p = Path(given)
        if p.is_file() and os.access(p, os.X_OK):
            return p, "TRTEXEC"
        return None, f"TRTEXEC={given} is not an executable file"
    found = shutil.which("trtexec", path=env.get("PATH", ""))
    if found:
        return Path(found), "PATH"
    if JETPACK_TRTEXEC.is_file() and os.access(JETPACK_TRTEXEC, os.X_OK):
        return JETPACK_TRTEXEC, "JetPack default location"
    return None, ("trtexec not found (not in $TRTEXEC, not on PATH, not at "
                  f"{JETPACK_TRTEXEC}); TensorRT is not installed on this machine")


def run_tool(cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120
         ) -> tuple[int, str]:
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, env=dict(env or os.environ),
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        return 127, f"{type(e).__name__}: {e}"


def loaded_libnvinfer(trtexec: Path | str, env: Mapping[str, str] | None = None
                      ) -> tuple[str | None, str]:
    """Path of the libnvinfer the dynamic loader gives ``trtexec`` under ``env`` (``ldd``).

    Returns:
        ``(resolved path or None, the ldd line or error text)``.
    """
    rc, text = run_tool(["ldd", str(trtexec)], env)
    libs = parse_ldd(text)
    for soname, path in libs.items():
        if soname.startswith("libnvinfer.so"):
            resolved = str(Path(path).resolve()) if path else None
            return resolved, f"{soname} => {path or 'not found'}"
    return None, (text.strip()[-300:] or f"ldd exited {rc}")


def libnvinfer_version(lib: str, env: Mapping[str, str] | None = None) -> Version | None:
    """Version of a libnvinfer file: ``getInferLibVersion()`` called through ctypes in a child
    process (so nothing is loaded here), else the ``libnvinfer.so.X.Y.Z`` file name."""
    code = "import ctypes,sys; print(ctypes.CDLL(sys.argv[1]).getInferLibVersion())"
    rc, text = run_tool([sys.executable, "-c", code, lib], env)
    if rc == 0 and text.strip().splitlines()[-1].isdigit():
        return decode_version_int(int(text.strip().splitlines()[-1]))
    m = re.search(r"libnvinfer\.so\.(\d+(?:\.\d+){1,3})$", lib)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def python_trt_version(env: Mapping[str, str] | None = None) -> tuple[Version | None, str]:
    """``tensorrt.__version__`` of the Python runtime (imported in a child process).

    Returns:
        ``(version or None, detail)``.
    """
    rc, text = run_tool([sys.executable, "-c", "import tensorrt; print(tensorrt.__version__)"], env)
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if rc == 0 and re.fullmatch(r"\d+(\.\d+)+\S*", last):
        return tuple(int(p) for p in re.findall(r"\d+", last)[:4]), last
    return None, (last or f"python exited {rc}")


def python_trt_libdirs(env: Mapping[str, str] | None = None) -> list[str]:
    """Folders holding the Python runtime's own libnvinfer (pip wheels: ``tensorrt_libs``)."""
    code = ("import importlib, os\nfor m in ('tensorrt_libs', 'tensorrt_cu13_libs', "
            "'tensorrt_cu12_libs'):\n    try:\n        print(os.path.dirname("
            "importlib.import_module(m).__file__))\n    except Exception:\n        pass\n")
    rc, text = run_tool([sys.executable, "-c", code], env)
    return [ln for ln in text.splitlines() if ln.strip() and Path(ln).is_dir()] if rc == 0 else []


def jetson_info() -> dict | None:
    """Jetson facts, or None on other machines.

    Detected by ``/etc/nv_tegra_release`` (L4T), or aarch64 with "tegra" in the kernel release or
    ``/proc/device-tree/compatible``. Returns ``{"l4t": "R36 (release), REVISION: 4.3 ...",
    "l4t_major": 36, "model": "...", "dla_cores": n}``; JetPack 5 is L4T R35 (TensorRT 8.5),
    JetPack 6 is L4T R36 (TensorRT 8.6 in 6.0, 10.3 in 6.1/6.2).
    """
    rel = Path("/etc/nv_tegra_release")
    tegra = rel.exists()
    compat = ""
    try:
        compat = Path("/proc/device-tree/compatible").read_bytes().decode(errors="ignore")
    except OSError:
        pass
    if not tegra and not (platform.machine() == "aarch64"
                          and ("tegra" in platform.release() or "tegra" in compat)):
        return None
    info: dict[str, Any] = {"l4t": None, "l4t_major": None, "model": None, "dla_cores": None}
    if tegra:
        first = rel.read_text(errors="ignore").splitlines()[0] if rel.stat().st_size else ""
        info["l4t"] = first.lstrip("# ").strip()
        m = re.search(r"R(\d+)", first)
        info["l4t_major"] = int(m.group(1)) if m else None
    try:
        raw = Path("/proc/device-tree/model").read_bytes()
        info["model"] = raw.decode(errors="ignore").strip("\x00 \n")
    except OSError:
        pass
    dla = list(Path("/dev").glob("nvhost-nvdla*")) if Path("/dev").is_dir() else []
    info["dla_cores"] = len(dla) if dla else None
    return info


@dataclasses.dataclass
class Detected:
    """What :func:`detect` found. Versions are tuples; None = could not be determined."""

    trtexec: str
    banner: Version | None
    header: Version | None
    libnvinfer: str | None
    libnvinfer_version: Version | None
    python_runtime: Version | None
    python_detail: str
    env: dict
    loader_fix: str | None = None
    ldd: str = ""

    @property
    def version(self) -> Version | None:
        """The TensorRT that builds the plans: the loaded library, else trtexec's own."""
        return self.libnvinfer_version or self.header or self.banner

    def as_dict(self) -> dict:
        return {"trtexec": self.trtexec, "trtexec_banner": vstr(self.banner),
                "trtexec_header": vstr(self.header), "libnvinfer": self.libnvinfer,
                "libnvinfer_version": vstr(self.libnvinfer_version),
                "python_tensorrt": vstr(self.python_runtime), "loader_fix": self.loader_fix,
                "ldd": self.ldd}


def version_conflicts(d: Detected) -> list[str]:
    """Disagreements that make plans unusable (compared on major.minor.patch)."""
    probs = []
    tool = d.header or d.banner
    if d.libnvinfer is None:
        probs.append(f"the loader finds no libnvinfer for {d.trtexec} ({d.ldd})")
    if tool and d.libnvinfer_version and tuple(tool[:3]) != tuple(d.libnvinfer_version[:3]):
        probs.append(f"trtexec was built for TensorRT {vstr(tool)} but loads libnvinfer "
                     f"{vstr(d.libnvinfer_version)} ({d.libnvinfer})")
    built_by = d.libnvinfer_version or tool
    if d.python_runtime and built_by and tuple(d.python_runtime[:3]) != tuple(built_by[:3]):
        probs.append(f"plans would be built by TensorRT {vstr(built_by)} but the Python runtime "
                     f"(7_trt_eval.py) is {vstr(d.python_runtime)}")
    return probs


def detect(trtexec: Path | str, env: Mapping[str, str] | None = None) -> Detected:
    """Versions of trtexec (banner/header from ``trtexec --help``), the libnvinfer it loads and
    the Python runtime, under ``env``."""
    env = dict(os.environ if env is None else env)
    _, text = run_tool([str(trtexec), "--help"], env, timeout=60)
    tv = parse_trtexec_version(text)
    lib, ldd = loaded_libnvinfer(trtexec, env)
    libv = libnvinfer_version(lib, env) if lib else None
    pyv, pyd = python_trt_version(env)
    return Detected(str(trtexec), tv["banner"], tv["header"], lib, libv, pyv, pyd, env, ldd=ldd)


def detect_with_loader_fix(trtexec: Path | str, env: Mapping[str, str] | None = None
                           ) -> tuple[Detected, list[str]]:
    """:func:`detect`, and when versions disagree, retry with each candidate library folder
    first on ``LD_LIBRARY_PATH`` (the fix env.sh applies): the Python runtime's wheel folder
    (``tensorrt_libs``), the tarball's ``<trtexec>/../lib`` and ``$TENSORRT_HOME/lib``.

    Returns:
        ``(detected, remaining conflicts)``; ``detected.env`` is the environment to run
        trtexec with and ``detected.loader_fix`` names the folder that fixed it.
    """
    env = dict(os.environ if env is None else env)
    d = detect(trtexec, env)
    probs = version_conflicts(d)
    if not probs:
        return d, []
    cands = python_trt_libdirs(env) + [str(Path(trtexec).resolve().parent.parent / "lib")]
    if env.get("TENSORRT_HOME"):
        cands.append(str(Path(env["TENSORRT_HOME"]) / "lib"))
    for c in dict.fromkeys(cands):
        if not Path(c).is_dir():
            continue
        e2 = dict(env)
        e2["LD_LIBRARY_PATH"] = c + (os.pathsep + env["LD_LIBRARY_PATH"]
                                     if env.get("LD_LIBRARY_PATH") else "")
        d2 = detect(trtexec, e2)
        if not version_conflicts(d2):
            d2.loader_fix = c
            return d2, []
    return d, probs
