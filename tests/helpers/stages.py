"""Running the root stage scripts: as a user would, in their own process (``run_stage``), or
loaded as a module (their names start with a digit, so no import statement can name them):
``load_stage("6_build_engines")``."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def load_stage(name: str) -> ModuleType:
    """The stage script ``<repo>/<name>.py`` as a module (imported once, then cached)."""
    return importlib.import_module(name)


def run_stage(args: list[str], env: dict, check: bool = True, timeout: int = 900
              ) -> subprocess.CompletedProcess:
    """Run a stage script as a user would (own process), return the completed process."""
    cmd = [sys.executable] + args if args[0].endswith(".py") else args
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-3000:]}")
    return p
