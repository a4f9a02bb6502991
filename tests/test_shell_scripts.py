"""Every shell script passes shellcheck."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.stages import ROOT


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shell_scripts_pass_shellcheck():
    scripts = [str(p) for p in ROOT.glob("*.sh")] + [str(ROOT / ".ci" / "run")]
    p = subprocess.run(["shellcheck", "-x", "-s", "bash", *scripts], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout
