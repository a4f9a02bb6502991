"""deploykit.commands: printed commands paste back as the same words, from any folder."""
from __future__ import annotations

import os
import shlex
import sys

from deploykit.commands import absolute_args, run_env, script_command, this_command
from deploykit.layout import ROOT

HOSTILE = "a b'c\"$(touch x)`id`;rm -rf ~"


def test_every_word_pastes_back_as_one_argument(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{HOSTILE}.npz").write_bytes(b"")
    monkeypatch.setenv("ARTIFACTS", "rel art")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(sys, "argv", ["3_onnx_eval.py", "--model", f"{HOSTILE}:f",
                                      "--inputs", f"{HOSTILE}.npz", "--tag", "t"])
    words = shlex.split(this_command())
    assert words[:3] == ["cd", str(ROOT), "&&"]
    assert f"ARTIFACTS={tmp_path / 'rel art'}" in words  # absolute, as the run resolved it
    assert f"PYTHONPATH={tmp_path}" in words  # a factory's module is looked up where it ran
    i = words.index(str(ROOT / "3_onnx_eval.py"))
    assert words[i - 1] == sys.executable
    assert words[i + 1:] == ["--model", f"{HOSTILE}:f", "--inputs",
                             str(tmp_path / f"{HOSTILE}.npz"), "--tag", "t"]


def test_only_path_values_are_made_absolute(tmp_path):
    (tmp_path / "x.npz").write_bytes(b"")
    got = absolute_args(["--model", "efficientnet_lite0", "--tag", "ort_int8", "--inputs=x.npz",
                         "-o", "out/new.onnx", "--batch", "8"], tmp_path)
    assert got == ["--model", "efficientnet_lite0", "--tag", "ort_int8",
                   f"--inputs={tmp_path / 'x.npz'}", "-o", "out/new.onnx", "--batch", "8"]
    (tmp_path / "out").mkdir()
    assert absolute_args(["-o", "out/new.onnx"], tmp_path)[1] == str(tmp_path / "out/new.onnx")


def test_names_stay_names_and_dash_values_after_equals_are_paths(tmp_path):
    """A rerun recorded in a folder holding a folder named like the model (``cd results``) or
    a tag with a file suffix kept them as names; ``--engine=-x.plan`` (stage 7's several
    engines write a value starting with '-' so) became absolute (review of stop 47)."""
    (tmp_path / "mobilenet_v3_small").mkdir()
    (tmp_path / "-x.plan").write_bytes(b"")
    got = absolute_args(["--model", "mobilenet_v3_small", "--tag", "r1.log",
                         "--model=mobilenet_v3_small", "--tag=r1.log", "--engine=-x.plan",
                         "-x.plan"], tmp_path)
    assert got == ["--model", "mobilenet_v3_small", "--tag", "r1.log",
                   "--model=mobilenet_v3_small", "--tag=r1.log",
                   f"--engine={tmp_path / '-x.plan'}", "-x.plan"]


def test_run_env_has_artifacts_results_and_no_pythonpath_for_a_named_model(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = run_env("efficientnet_lite0", tmp_path)
    assert env["RESULTS"] == str(tmp_path / "r") and "ARTIFACTS" in env
    assert "PYTHONPATH" not in env
    line = script_command("layerwise.py", ["diff", "a.onnx", "b.onnx"], "efficientnet_lite0")
    # a file name that does not exist yet still names the file beside the run, not the root
    assert shlex.split(line)[-3:] == ["diff", os.path.abspath("a.onnx"),
                                      os.path.abspath("b.onnx")]


def test_rerun_environment_keeps_every_setting_that_changes_the_result(monkeypatch):
    """A pasted rerun that dropped LOGITS_OUTPUT measured the auxiliary head instead of the
    logits; CALIB_STATS_CHECK / AUTO_ARGS / ALLOW_CLASS_SUBSET change stage 0/5 likewise."""
    from deploykit.commands import run_env

    for k, v in {"LOGITS_OUTPUT": "1", "CALIB_STATS_CHECK": "0", "ALLOW_CLASS_SUBSET": "1",
                 "AUTO_ARGS": "--min-agreement 99 --min-cosine 0.998"}.items():
        monkeypatch.setenv(k, v)
    env = run_env("efficientnet_lite0")
    assert env["LOGITS_OUTPUT"] == "1" and env["CALIB_STATS_CHECK"] == "0"
    assert env["ALLOW_CLASS_SUBSET"] == "1"
    assert env["AUTO_ARGS"] == "--min-agreement 99 --min-cosine 0.998"
