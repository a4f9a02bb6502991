"""Stage 5 in Python (5_quantize.py, its 5_quantize.sh wrapper) and the ModelOpt child runner
(deploykit.quant.modelopt_runner). ModelOpt itself is stubbed here (a fake runner or a fake
interpreter); the end-to-end runs with ModelOpt are in tests/stages/test_stage5_quantize.py and tests/quant/.
The tests that start the stage as a process are in the slow lane."""
from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deploykit.errors import StageError, UsageError


from deploykit.quant import modelopt_runner, quantize  # noqa: E402
from tests.helpers.stages import ROOT, load_stage  # noqa: E402
from tests.helpers.auto_models import _save  # noqa: E402
from tests.helpers.quant_models import conv_model  # noqa: E402

stage5 = load_stage("5_quantize")


@pytest.fixture(autouse=True)
def _no_worker_process(monkeypatch):
    """These tests' ModelOpt is FakeModelOpt: no worker process is started (a real one imports
    ModelOpt, seconds each; tests/quant/test_modelopt_worker.py tests it)."""
    monkeypatch.setattr(modelopt_runner.ModelOptWorker, "start", lambda self: None)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A small conv model (stem, depthwise, grouped conv) with its calibration npz in private
    ARTIFACTS/RESULTS folders; the environment stage 5 reads is set as a user would."""
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    for k in ("CALIB_BATCH", "AUTO_ARGS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("EPS", "cpu")
    monkeypatch.setenv("CALIB_STATS_CHECK", "0")
    d = tmp_path / "a" / "tiny"
    (d / "onnx").mkdir(parents=True)
    _save(conv_model(size=16), d / "onnx" / "fp32.onnx")
    np.savez(d / "calib.npz", input=np.random.default_rng(0).standard_normal(
        (8, 3, 16, 16)).astype(np.float32))
    return d


class FakeModelOpt:
    """Stands in for modelopt_runner.run_modelopt: records each call and the bytes of the
    calibration file it was handed (what ModelOpt would read), "quantizes" by copying the
    float model, and writes a log."""

    def __init__(self, fail: bool = False, on_call=None):
        self.calls: list[dict] = []
        self.fail = fail
        self.on_call = on_call

    def __call__(self, onnx_path, output_path, flags, log, *, calib_batch="all", replace=None,
                 **kw):
        flags = list(flags)
        calib = Path(flags[flags.index("--calibration_data_path") + 1])
        if self.on_call:
            self.on_call(calib)
        self.calls.append({"flags": flags, "calib": calib, "calib_bytes": calib.read_bytes(),
                           "calib_batch": calib_batch, "onnx_path": Path(onnx_path)})
        Path(log).write_text("fake ModelOpt\nWARNING: a warning worth keeping\n")
        if not self.fail:
            Path(output_path).write_bytes(Path(onnx_path).read_bytes())
        argv = modelopt_runner.modelopt_argv(onnx_path, output_path, flags, calib_batch)
        return modelopt_runner.ModelOptRun(
            status="failed" if self.fail else "ok", returncode=1 if self.fail else 0,
            wall_s=0.25, argv=tuple(argv), shown=modelopt_runner.shown_command(argv, replace),
            log=Path(log), output=Path(output_path))


def _args(*argv: str):
    return stage5.get_args_parser().parse_args(["--model", "tiny", *argv])


def _count_opens(monkeypatch, path: Path) -> list[str]:
    """Every open() of ``path`` in this process from now on (builtins.open and io.open: numpy,
    hashlib readers and pathlib all go through one of them)."""
    opened: list[str] = []
    target = os.path.realpath(path)
    real_open = builtins.open

    def counting(file, *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)) and \
                os.path.realpath(os.fsdecode(file)) == target:
            opened.append(str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)
    return opened


# --------------------------------------------------------------------------------------------
# One process: the calibration file read, validated and planned once
# --------------------------------------------------------------------------------------------
def test_calibration_read_validated_and_planned_once_for_several_variants(tiny, monkeypatch):
    fake = FakeModelOpt()
    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    counts = {"validate": 0, "plan": 0, "depthwise": 0}
    for name, key in (("validate_calibration", "validate"), ("calibration_plan", "plan"),
                      ("list_depthwise", "depthwise")):
        where = stage5 if name == "list_depthwise" else quantize  # who calls it
        real = getattr(where, name)

        def wrapped(*a, _real=real, _key=key, **kw):
            counts[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(where, name, wrapped)
    opened = _count_opens(monkeypatch, tiny / "calib.npz")
    recs = stage5.main(_args("int8_hp32", "excl_dw"))
    assert [r["variant"] for r in recs] == ["int8_hp32", "excl_dw"]
    assert len(fake.calls) == 2
    assert len(opened) == 1, opened  # one read of calib.npz for everything the stage does
    assert counts == {"validate": 1, "plan": 1, "depthwise": 1}
    # Both ModelOpt runs got the planned batch (all 8 samples) and the depthwise exclusion.
    assert [c["calib_batch"] for c in fake.calls] == [8, 8]
    assert all("^dw$" in c["flags"] for c in fake.calls)


def test_every_run_of_the_stage_shares_one_histogram_cache_and_the_record_names_the_source(
        tiny, monkeypatch):
    """The ModelOpt runs of one stage get the same histogram cache folder (inside the stage's
    work folder, gone afterwards); a run whose log says it took an earlier run's histograms has
    that run's name in its record, the others None."""
    from deploykit.quant.modelopt import HISTOGRAM_MARK

    fake, caches = FakeModelOpt(), []

    def run(onnx_path, output_path, flags, log, **kw):
        caches.append(kw.get("histogram_cache"))
        out = fake(onnx_path, output_path, flags, log, **kw)
        if len(caches) == 2:
            with open(log, "a") as f:
                f.write(f"{HISTOGRAM_MARK}int8_hp32's run: 3 tensors, same graph, ...\n")
        return out
    monkeypatch.setattr(modelopt_runner, "run_modelopt", run)
    recs = stage5.main(_args("int8_hp32", "excl_dw"))
    assert len(set(caches)) == 1 and caches[0] is not None and not Path(caches[0]).exists()
    assert [r["calibration_histograms_from"] for r in recs] == [None, "int8_hp32"]
    saved = json.loads((Path(os.environ["RESULTS"]) / "tiny" / "quant_excl_dw.json").read_text())
    assert saved["calibration_histograms_from"] == "int8_hp32"


def test_record_hashes_the_calibration_bytes_modelopt_was_given(tiny, monkeypatch):
    """calib.npz replaced while the stage runs (stage 4 rerun): ModelOpt still gets the bytes
    that were validated, and the record's hashes are those bytes', not the new file's."""
    calib = tiny / "calib.npz"
    before = calib.read_bytes()

    def replace_calib(_):
        np.savez(calib, input=np.zeros((8, 3, 16, 16), np.float32))
    fake = FakeModelOpt(on_call=replace_calib)
    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    (rec,) = stage5.main(_args("int8_hp32"))
    used = fake.calls[0]["calib_bytes"]
    assert used == before and _sha(calib.read_bytes()) != _sha(before)
    assert rec["calibration"]["sha256"] == _sha(used)
    assert rec["provenance"]["input_sha256"][str(calib)] == _sha(used)
    saved = json.loads((Path(os.environ["RESULTS"]) / "tiny" / "quant_int8_hp32.json")
                       .read_text())
    assert saved["calibration"]["sha256"] == _sha(used)
    # ModelOpt's private copy is not named in the record: the shown command names calib.npz.
    assert f"--calibration_data_path {calib}" in rec["command"]
    assert ".tmp-5_quantize" not in rec["command"]
    assert shlex.split(rec["command"])[1:3] == ["qdq_tools.py", "modelopt"]
    assert rec["warnings"] == ["WARNING: a warning worth keeping"]
    # the stand-in ModelOpt writes the float graph: no MAC node is quantized, and it says so
    assert rec["unquantized"].startswith("0 of 3 MatMul/Conv/Gemm quantized: ")
    assert "WARNING: 0 of 3" in rec["check"]["summary"]
    assert rec["status"] == "ok" and rec["check"]["summary"].startswith("check:")


def test_modelopt_failure_keeps_the_earlier_file_and_removes_the_work_folder(tiny, monkeypatch):
    out = tiny / "onnx" / "int8_hp32.onnx"
    out.write_bytes(b"earlier good file")
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt(fail=True))
    with pytest.raises(StageError, match="(?s)ModelOpt failed on int8_hp32.*fake ModelOpt"):
        stage5.main(_args("int8_hp32"))
    assert out.read_bytes() == b"earlier good file"
    assert not list((tiny / "onnx").glob(".tmp*"))
    rec = json.loads((Path(os.environ["RESULTS"]) / "tiny" / "quant_int8_hp32.json").read_text())
    assert rec["status"] == "failed" and "inspect" not in rec


def test_failed_rerun_keeps_the_good_record_and_log_beside_the_installed_file(tiny, monkeypatch):
    """A good int8_hp32 is installed with its record and log; a failed rerun (ModelOpt error)
    leaves all three as they were and writes quant_int8_hp32.failed.json and
    int8_hp32.quant.failed.log beside them; the next good run removes both leftovers."""
    res = Path(os.environ["RESULTS"]) / "tiny"
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    stage5.main(_args("int8_hp32"))
    good = (res / "quant_int8_hp32.json").read_text()
    good_log = (tiny / "onnx" / "int8_hp32.quant.log").read_text()
    good_file = (tiny / "onnx" / "int8_hp32.onnx").read_bytes()
    assert json.loads(good)["status"] == "ok"

    class Fails(FakeModelOpt):
        def __call__(self, onnx_path, output_path, flags, log, **kw):
            r = super().__call__(onnx_path, output_path, flags, log, **kw)
            Path(log).write_text("the failed run's log\n")
            return r
    monkeypatch.setattr(modelopt_runner, "run_modelopt", Fails(fail=True))
    with pytest.raises(StageError, match="ModelOpt failed on int8_hp32"):
        stage5.main(_args("int8_hp32"))
    assert (res / "quant_int8_hp32.json").read_text() == good
    assert (tiny / "onnx" / "int8_hp32.quant.log").read_text() == good_log
    assert (tiny / "onnx" / "int8_hp32.onnx").read_bytes() == good_file
    failed = json.loads((res / "quant_int8_hp32.failed.json").read_text())
    assert failed["status"] == "failed" and failed["log"].endswith("int8_hp32.quant.failed.log")
    assert (tiny / "onnx" / "int8_hp32.quant.failed.log").read_text() == "the failed run's log\n"
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    stage5.main(_args("int8_hp32"))
    assert not (res / "quant_int8_hp32.failed.json").exists()
    assert not (tiny / "onnx" / "int8_hp32.quant.failed.log").exists()


# --------------------------------------------------------------------------------------------
# Refusals before any work
# --------------------------------------------------------------------------------------------
def test_unwritable_results_folder_is_refused_before_any_work(tiny, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the results folder should be")
    monkeypatch.setenv("RESULTS", str(blocker / "r"))  # mkdir fails, even for root
    fake = FakeModelOpt()
    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    opened = _count_opens(monkeypatch, tiny / "calib.npz")
    with pytest.raises(StageError, match="cannot create .*not_a_folder"):
        stage5.main(_args("int8_hp32"))
    assert fake.calls == [] and opened == []  # not even the calibration data was read
    assert sorted(f.name for f in (tiny / "onnx").iterdir()) == ["fp32.onnx"]


@pytest.mark.slow
def test_unwritable_results_folder_exits_1_through_the_wrapper(tiny, tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    env = dict(os.environ, RESULTS=str(blocker / "r"), MODEL="tiny", PYTHON=sys.executable)
    p = subprocess.run(["bash", "5_quantize.sh", "int8_hp32"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "FAILED: cannot create" in p.stderr, p.stderr
    assert sorted(f.name for f in (tiny / "onnx").iterdir()) == ["fp32.onnx"]


@pytest.mark.slow
@pytest.mark.parametrize("argv,env,needle", [
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
    (["no_such_variant"], {}, "unknown variant no_such_variant"),
    ([], {}, "give one or more variants"),
    (["--model", "", "int8"], {}, "empty model name"),
    (["int8_hp32"], {"CALIB_BATCH": "0"}, "CALIB_BATCH='0'"),
    (["int8_hp32"], {"CALIB_BATCH": "many"}, "CALIB_BATCH='many'"),
])
def test_usage_errors_exit_2_with_the_variant_list_and_do_nothing(tiny, argv, env, needle):
    env = dict(os.environ, MODEL="tiny", PYTHON=sys.executable, **env)
    p = subprocess.run(["bash", "5_quantize.sh", *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "usage: " in p.stderr and "int4_cli_broken" in p.stderr
    assert "Traceback" not in p.stderr
    assert sorted(f.name for f in (tiny / "onnx").iterdir()) == ["fp32.onnx"]


def test_variant_order_across_flags_and_duplicates():
    p = stage5.get_args_parser()
    assert p.parse_args(["int8_hp32", "--default", "excl_dw"]).selected == \
        ["int8_hp32", "baseline", "int8", "int8_hp32", "excl_dw"]
    assert p.parse_args(["--model=m", "calib_max"]).model == "m"
    with pytest.raises(SystemExit) as e:
        p.parse_args(["int8", "--default", "nope"])
    assert e.value.code == 2
    assert "int8_auto" not in p.parse_args(["--all-variants"]).selected


def test_list_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        stage5.get_args_parser().parse_args(["--list"])
    assert e.value.code == 0
    names = capsys.readouterr().out.split()
    assert names[:3] == ["baseline", "int8", "int8_hp32"] and "int8_auto" in names
    assert "int4" not in names  # --list: the ModelOpt CLI variants (int4 is 5b's)
    with pytest.raises(SystemExit) as e:
        stage5.get_args_parser().parse_args(["--help"])
    out = capsys.readouterr()
    assert e.value.code == 0 and out.out == ""  # to stderr, as 5_quantize.sh printed it
    assert "CALIB_STATS_CHECK" in out.err and "--all-variants" in out.err


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_wrapper_passes_arguments_environment_and_exit_status_through(tmp_path):
    fake = tmp_path / "fake python"
    dump = tmp_path / "dump.json"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, "
                    f"open({str(dump)!r}, 'w'))\nsys.exit(7)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = dict(os.environ, PYTHON=str(fake), MODEL="m1", EPS="cpu", CALIB_BATCH="16",
               CALIB_STATS_CHECK="0", AUTO_ARGS="--min-cosine 0.99")
    argv = ["--model", "a b", "int8", "", "--default", "*"]
    p = subprocess.run([str(ROOT / "5_quantize.sh"), *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, p.stderr  # exec: the program's exit status is the wrapper's
    got = json.loads(dump.read_text())
    assert Path(got["argv"][0]).resolve() == ROOT / "5_quantize.py"
    assert got["argv"][1:] == argv  # word for word, nothing split, globbed or dropped
    for k in ("MODEL", "EPS", "CALIB_BATCH", "CALIB_STATS_CHECK", "AUTO_ARGS"):
        assert got["env"][k] == env[k]


def test_wrapper_is_one_exec_line_and_shellcheck_clean():
    lines = [ln for ln in (ROOT / "5_quantize.sh").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines == ["set -euo pipefail",
                     'exec "${PYTHON:-python}" "$(dirname "$0")/5_quantize.py" "$@"']


# --------------------------------------------------------------------------------------------
# deploykit.quant.modelopt_runner
# --------------------------------------------------------------------------------------------
def _fake_interpreter(tmp_path: Path, rc: int, write_output: bool = True) -> Path:
    """An executable that stands in for the interpreter: prints its arguments (the log), writes
    the --output_path file unless told not to, exits ``rc``."""
    exe = tmp_path / "fakepy"
    exe.write_text(f"#!{sys.executable}\nimport sys\nprint('args:', sys.argv[1:])\n"
                   "print('to stderr', file=sys.stderr)\n"
                   f"if {write_output}:\n    out = sys.argv[sys.argv.index('--output_path') + 1]\n"
                   "    open(out, 'w').write('q')\n"
                   f"sys.exit({rc})\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_runner_captures_the_log_and_shows_final_paths(tmp_path):
    work = tmp_path / "w o r k"
    work.mkdir()
    final = tmp_path / "final"
    final.mkdir()
    log = final / "v.quant.log"
    log.write_text("an earlier log")
    run = modelopt_runner.run_modelopt(
        work / "fp32.onnx", work / "v.onnx", ["--nodes_to_exclude", "^a$", "^b$"], log,
        calib_batch=16, python=str(_fake_interpreter(tmp_path, 0)),
        replace={work / "fp32.onnx": final / "fp32.onnx", work / "v.onnx": final / "v.onnx"})
    assert run.ok and run.returncode == 0 and run.wall_s > 0
    text = log.read_text()
    assert "'--calib-batch', '16'" in text and "to stderr" in text  # stdout and stderr
    assert oct(log.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert not [f for f in final.iterdir() if f.name.startswith(".tmp")]
    words = shlex.split(run.shown)
    assert words[1:6] == ["qdq_tools.py", "modelopt", "--calib-batch", "16", "--"]
    assert words[words.index("--onnx_path") + 1] == str(final / "fp32.onnx")
    assert words[words.index("--output_path") + 1] == str(final / "v.onnx")
    assert "^a$" in words and str(work) not in run.shown
    assert run.argv[run.argv.index("--output_path") + 1] == str(work / "v.onnx")


@pytest.mark.parametrize("rc,write_output", [(3, True), (0, False)])
def test_runner_failure_is_a_status_not_an_exception(tmp_path, rc, write_output):
    log = tmp_path / "v.quant.log"
    run = modelopt_runner.run_modelopt(tmp_path / "in.onnx", tmp_path / "out.onnx", [], log,
                                       python=str(_fake_interpreter(tmp_path, rc, write_output)))
    assert run.status == "failed" and not run.ok and run.returncode == rc
    assert "to stderr" in run.tail(5) and "args:" in log.read_text()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".tmp")]


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


@pytest.mark.parametrize("name,value,accepted", [
    ("EPS", "bogus", False), ("EPS", "CUDA", False), ("EPS", "cuda", False),
    ("EPS", "cuda:1", True), ("EPS", "cpu", True), ("EPS", "trt", True),
    ("CALIB_STATS_CHECK", "no", False), ("CALIB_STATS_CHECK", "0", True),
    ("CALIB_BATCH", "abc", False), ("CALIB_BATCH", "64", True)])
def test_environment_settings_are_checked_before_any_work(name, value, accepted):
    """A bad EPS reached ModelOpt (its NotImplementedError after the run started); every
    variable the stage reads is a usage error naming the accepted values."""
    if accepted:
        assert quantize.env_settings({name: value})
    else:
        with pytest.raises(UsageError, match=rf"{name}='{value}': .*(one of|or 0|positive)"):
            quantize.env_settings({name: value})


def test_record_links_the_file_to_its_fp32_and_calibration_bytes(tiny, monkeypatch):
    """quant_<variant>.json's source block: the installed file's, the fp32.onnx's and the
    calibration bytes' SHA-256 (those ModelOpt was given, even when calib.npz is rewritten
    meanwhile); stage 3 finds it by the file's hash, and the rewrite makes a row stale."""
    from deploykit.results import check_source, measured_against, source_of, staleness

    calib, fp32 = tiny / "calib.npz", tiny / "onnx" / "fp32.onnx"
    before = calib.read_bytes()
    fake = FakeModelOpt(on_call=lambda _: np.savez(calib, input=np.ones((8, 3, 16, 16),
                                                                        np.float32)))
    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    monkeypatch.setattr(sys, "argv", ["5_quantize.py", "--model", "tiny", "int8_hp32"])
    (rec,) = stage5.main(_args("int8_hp32"))
    out = tiny / "onnx" / "int8_hp32.onnx"
    src = rec["source"]
    assert src["calibration"]["sha256"] == _sha(before) != _sha(calib.read_bytes())
    assert src["fp32"]["sha256"] == _sha(fp32.read_bytes())
    assert src["output"]["sha256"] == _sha(out.read_bytes())
    found = source_of("tiny", out)
    assert found["record"] == "quant_int8_hp32.json" and found["fp32"] == src["fp32"]
    assert "5_quantize" in found["made_by"][0]
    # a row of this file, as stage 3 records it: stale at once (calib.npz rewritten since)
    row = {"tag": "ort_int8_hp32", "measured_against": measured_against(evaluated=out,
                                                                          source=found),
           "source": {"record": found["record"], "made_by": found["made_by"]},
           "provenance": {"command": "3_onnx_eval.py --tag ort_int8_hp32"}}
    (why,) = staleness(row)
    assert why.startswith("the calibration data") and "5_quantize" in why
    assert why.index("5_quantize") < why.index("3_onnx_eval.py")
    # a file with the scales of another model version: no record names it
    other = tiny / "onnx" / "other.onnx"
    other.write_bytes(out.read_bytes() + b"\0")
    assert source_of("tiny", other) is None
    assert "no record" in check_source("tiny", other, fp32)[2]
    # fp32.onnx re-exported: the Q/DQ file's source is stale
    fp32.write_bytes(fp32.read_bytes() + b"\0")
    _, stale, warn = check_source("tiny", out, fp32)
    assert "re-exported since" in stale and warn.startswith(f"WARNING: {out} is stale")


def test_variants_differing_only_in_their_high_precision_dtype_share_one_calibration():
    """int8 and int8_hp32 (the default run), baseline and fp32_only, excl_dw and excl_dw_hp32
    (flags in another order) are pairs; a lone variant, two fp16 variants and a variant that
    needs the tuning split are not."""
    share = quantize.shared_calibration
    assert share(["baseline", "int8", "int8_hp32"]) == {"int8": "int8_hp32"}
    assert share(["baseline", "fp32_only", "excl_dw", "excl_dw_hp32"]) == {
        "baseline": "fp32_only", "excl_dw": "excl_dw_hp32"}
    assert share(["int8"]) == {} and share(["int8_hp32"]) == {}
    assert share(["baseline", "excl_dw", "calib_max"]) == {}
    assert share(["int8", "int8_auto"]) == {}  # int8_auto's flags come from its search


def test_a_shared_run_installs_both_files_each_with_its_own_part_of_the_log(tiny, monkeypatch):
    """One ModelOpt child for int8 and int8_hp32 (a fake one here): both installed, each
    record says it was made by the shared run, int8_hp32's log ends before the FP16
    conversion, int8's holds it."""
    from deploykit.quant.modelopt import FP16_MARK

    calls = []

    def fake(onnx_path, output_path, flags, log, *, calib_batch="all", replace=None,
             fp16_output=None, **kw):
        calls.append({"flags": list(flags), "fp16_output": fp16_output})
        Path(output_path).write_bytes(Path(onnx_path).read_bytes())
        text = "calibrated\n"
        if fp16_output is not None:
            Path(fp16_output).write_bytes(Path(onnx_path).read_bytes())
            text += f"{FP16_MARK}{fp16_output}\nWARNING: values replaced with 6.0e-08\n"
        Path(log).write_text(text)
        argv = modelopt_runner.modelopt_argv(onnx_path, output_path, flags, calib_batch,
                                             fp16_output=fp16_output)
        return modelopt_runner.ModelOptRun(
            status="ok", returncode=0, wall_s=0.5, argv=tuple(argv),
            shown=modelopt_runner.shown_command(argv, replace), log=Path(log),
            output=Path(output_path),
            fp16_output=None if fp16_output is None else Path(fp16_output))

    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    recs = stage5.main(_args("int8", "int8_hp32"))
    assert [r["variant"] for r in recs] == ["int8", "int8_hp32"]  # the order asked for
    assert len(calls) == 1
    flags = calls[0]["flags"]
    assert flags[flags.index("--high_precision_dtype") + 1] == "fp32"
    assert calls[0]["fp16_output"] is not None
    onnx_dir = tiny / "onnx"
    assert (onnx_dir / "int8.onnx").exists() and (onnx_dir / "int8_hp32.onnx").exists()
    assert all(r["shared_calibration"]["fp16"] == "int8" for r in recs)
    assert "--fp16-output" in recs[0]["command"] and str(onnx_dir / "int8.onnx") in recs[0][
        "command"]  # the work paths replaced by the installed ones
    hp16_log = (onnx_dir / "int8.quant.log").read_text()
    hp32_log = (onnx_dir / "int8_hp32.quant.log").read_text()
    assert FP16_MARK in hp16_log and FP16_MARK not in hp32_log
    assert any("replaced with" in w for w in recs[0]["warnings"])
    assert not any("replaced with" in w for w in recs[1]["warnings"])


# --------------------------------------------------------------------------------------------
# The whole stage in one process: int4 through 5b, each file's row through 3_onnx_eval (--eval)
# --------------------------------------------------------------------------------------------
def _fake_scripts(monkeypatch, int4_status="ok"):
    """Stands in for deploykit.cli.run_script in stage 5: records (script, argv) and returns
    what that script's main would (a quant record for 5b, a row for 3_onnx_eval)."""
    calls: list[tuple[str, list[str]]] = []
    # 5b in this process, after the others (the path of a machine without two CPUs); the
    # child-process path has tests of its own below
    monkeypatch.setattr(stage5, "beside_ok", lambda: (False, "tests: in turn"))

    def fake(name, argv):
        calls.append((name, list(argv)))
        if name == "5b_quantize_int4":
            if int4_status == "raise":
                raise StageError("ModelOpt INT4 failed on purpose")
            return {"variant": "int4", "status": int4_status}
        tag = argv[argv.index("--tag") + 1]
        return {"tag": tag, "backend": "ORT", "precision": "INT8", "status": "ok",
                "n_images": 3, "accuracy": {"top1": 50.0}}
    monkeypatch.setattr(stage5, "run_script", fake)
    return calls


def test_eval_makes_every_row_in_this_process_after_its_files_and_leaves_out_reproductions(
        tiny, monkeypatch, capsys):
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    calls = _fake_scripts(monkeypatch)
    recs = stage5.main(_args("int8_hp32", "int4_cli_broken", "int4", "excl_dw", "--eval",
                             "--eval-args", "--limit 3 --iters '2'"))
    assert [r["variant"] for r in recs] == ["int8_hp32", "int4_cli_broken", "excl_dw", "int4"]
    onnx = tiny / "onnx"
    assert calls == [  # every file first (one ModelOpt process for all), then every row
        ("5b_quantize_int4", ["--model", "tiny", "--no-eval"]),
        ("3_onnx_eval", ["--model", "tiny", "--onnx", str(onnx / "int8_hp32.onnx"), "--tag",
                         "ort_int8_hp32", "--limit", "3", "--iters", "2"]),
        ("3_onnx_eval", ["--model", "tiny", "--onnx", str(onnx / "excl_dw.onnx"), "--tag",
                         "ort_excl_dw", "--limit", "3", "--iters", "2"]),
        ("3_onnx_eval", ["--model", "tiny", "--onnx", str(onnx / "int4.onnx"), "--tag",
                         "ort_int4", "--limit", "3", "--iters", "2"]),
    ]
    last = capsys.readouterr().out.strip().splitlines()[-3:]  # one summary line per row
    assert [x.split(":")[0] for x in last] == ["ort_int8_hp32", "ort_excl_dw", "ort_int4"]


def test_a_failed_int4_leaves_the_other_files_rows_made_then_fails(tiny, monkeypatch, capsys):
    """Review finding: with every file made first, an INT4 failure (a ModelOpt error, a killed
    worker) stopped the stage before any row; the INT8 rows are made, then the stage fails."""
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    calls = _fake_scripts(monkeypatch, int4_status="raise")
    with pytest.raises(StageError, match="INT4 failed on purpose"):
        stage5.main(_args("int8_hp32", "int4", "--eval"))
    assert [c[0] for c in calls] == ["5b_quantize_int4", "3_onnx_eval"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == "ort_int4: no row: int4 failed (above)"


def test_int4_is_made_by_5b_and_evaluated_only_when_it_applies(tiny, monkeypatch, capsys):
    calls = _fake_scripts(monkeypatch, int4_status="skipped")
    recs = stage5.main(_args("int4", "--eval", "--calib-inputs", str(tiny / "calib.npz")))
    assert recs == [{"variant": "int4", "status": "skipped"}]
    # its line among the rows' says why there is no row (run_all.sh shows the last lines)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(
        "ort_int4: no row: int4 skipped")
    assert calls == [("5b_quantize_int4", ["--model", "tiny", "--no-eval", "--calib-inputs",
                                           str(tiny / "calib.npz")])]
    calls.clear()
    stage5.main(_args("int4"))  # without --eval: the file only
    assert [c[0] for c in calls] == ["5b_quantize_int4"]


@pytest.mark.parametrize("argv,needle", [
    (["int8", "--eval-args", "--limit 3"], "--eval-args is for --eval"),
    (["int8", "--eval", "--eval-args", "--tag 'x"], "No closing quotation"),
])
def test_eval_args_errors_are_usage_errors_before_any_work(tiny, monkeypatch, argv, needle):
    fake = FakeModelOpt()
    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    with pytest.raises(UsageError, match=needle):
        stage5.main(_args(*argv))
    assert fake.calls == []


def test_run_script_runs_a_script_main_as_its_own_command_line(tmp_path, monkeypatch):
    """deploykit.cli.run_script: the script's parser reads argv, sys.argv is its command line
    while main runs (what its provenance records) and is restored after, also on an error."""
    from deploykit.cli import run_script
    from deploykit.errors import StageError

    (tmp_path / "zz_fake_stage.py").write_text(
        "import argparse, sys\n"
        "from deploykit.errors import StageError\n"
        "def get_args_parser():\n"
        "    p = argparse.ArgumentParser(); p.add_argument('--x', type=int); return p\n"
        "def main(args):\n"
        "    if args.x < 0:\n"
        "        raise StageError('negative')\n"
        "    return list(sys.argv), args.x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.argv)
    assert run_script("zz_fake_stage", ["--x", "3"]) == (["zz_fake_stage.py", "--x", "3"], 3)
    assert sys.argv == before
    with pytest.raises(StageError):
        run_script("zz_fake_stage", ["--x", "-1"])
    assert sys.argv == before
    with pytest.raises(SystemExit):
        run_script("zz_fake_stage", ["--x", "three"])


def test_run_script_makes_a_preprocess_flag_the_environment_while_the_script_runs(
        tmp_path, monkeypatch):
    """Review finding: a --preprocess given to an in-process 3_onnx_eval.py was recorded but
    not used (cli() sets $PREPROCESS from it; run_script did not)."""
    from deploykit.cli import run_script
    from deploykit.models import PREPROCESS_ENV

    (tmp_path / "zz_pp_stage.py").write_text(
        "import argparse, os\n"
        "from deploykit.models import PREPROCESS_ENV\n"
        "def get_args_parser():\n"
        "    p = argparse.ArgumentParser(); p.add_argument('--preprocess'); return p\n"
        "def main(args):\n"
        "    return os.environ.get(PREPROCESS_ENV)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(PREPROCESS_ENV, raising=False)
    assert run_script("zz_pp_stage", ["--preprocess", "mean=0.5,std=0.5"]) == "mean=0.5,std=0.5"
    assert PREPROCESS_ENV not in os.environ  # restored: unset
    monkeypatch.setenv(PREPROCESS_ENV, "mean=0.1,std=0.2")
    assert run_script("zz_pp_stage", ["--preprocess", "mean=0.5,std=0.5"]) == "mean=0.5,std=0.5"
    assert os.environ[PREPROCESS_ENV] == "mean=0.1,std=0.2"
    assert run_script("zz_pp_stage", []) == "mean=0.1,std=0.2"  # no flag: the environment's


@pytest.mark.parametrize("extra,needle", [
    ("--tag mine", "--tag is (or abbreviates) a flag --eval sets for each row"),
    ("--onnx=x.onnx", "--onnx is (or abbreviates) a flag --eval sets"),
    ("-h", "-h is (or abbreviates)"),
    # argparse takes a unique prefix of a flag (second review): refused alike
    ("--ta mine --limit 8", "--ta is (or abbreviates)"),
    ("--onn=x.onnx", "--onn is (or abbreviates)"),
    ("--mod=a.b:c", "--mod is (or abbreviates)"),
    ("--he", "--he is (or abbreviates)"),
    ("--limit 8 --bogus", "3_onnx_eval.py has no --bogus"),
    ("--limit eight", "3_onnx_eval.py refuses it"),
    # the checks 3_onnx_eval.py makes of its flags before reading any file
    ("--limit 0", "3_onnx_eval.py refuses it: --limit must be"),
    ("--inputs x.npz", "--inputs is for models with their own data"),
])
def test_eval_args_are_checked_as_3_onnx_eval_flags_before_any_quantization(
        tiny, monkeypatch, extra, needle):
    import types

    fake = FakeModelOpt()
    monkeypatch.setattr(modelopt_runner, "run_modelopt", fake)
    # "tiny" as an ImageNet classifier (the --inputs case); its name is no registered model
    monkeypatch.setattr(load_stage("3_onnx_eval"), "model_spec",
                        lambda m: types.SimpleNamespace(classifier=True))
    with pytest.raises(UsageError, match=re.escape(needle)):
        stage5.main(_args("int8", "--eval", f"--eval-args={extra}"))
    assert fake.calls == []  # refused in seconds, not after the quantization


def test_eval_args_take_a_single_flag_in_the_equals_form(tiny, monkeypatch):
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    calls = _fake_scripts(monkeypatch)
    stage5.main(_args("int8", "--eval", "--eval-args=--full-eval"))
    assert calls[-1][1][-1] == "--full-eval"


def test_a_files_record_names_the_command_that_remakes_it_alone(tiny, monkeypatch):
    """Second review: a stale row's rerun command redid the whole stage (every variant, int4,
    every row). The record's made_by is now this variant's own command, without --eval."""
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    _fake_scripts(monkeypatch)
    stage5.main(_args("int8_hp32", "excl_dw", "--eval", "--eval-args=--limit 3"))
    made = json.loads((Path(os.environ["RESULTS"]) / "tiny" / "quant_excl_dw.json").read_text()
                      )["source"]["made_by"]
    assert len(made) == 1 and "5_quantize.py --model tiny excl_dw" in made[0]
    assert "int8_hp32" not in made[0] and "--eval" not in made[0]


# --------------------------------------------------------------------------------------------
# INT4 beside the ModelOpt variants (deploykit.quant.beside): started first, printed after them
# --------------------------------------------------------------------------------------------
class FakeBeside:
    """Stands in for ScriptBeside in stage 5: ``start`` is noted in ``events``, ``collect``
    writes what 5b_quantize_int4.py would (its record, a line of output) and returns ``rc``."""

    def __init__(self, events: list, rc: int = 0):
        self.events, self.rc = events, rc

    def __call__(self, script, argv, writes_in=()):
        self.script, self.argv, self.writes_in = script, list(argv), list(writes_in)
        return self

    def start(self):
        self.events.append(("start", self.script, self.argv))
        return self

    def collect(self):
        self.events.append(("collect",))
        if self.rc == 0:
            from deploykit.io import write_json
            from deploykit.layout import model_results

            write_json(model_results("tiny") / "quant_int4.json",
                       {"variant": "int4", "status": "ok", "from": "the child"})
        print("int4: the child's output")
        return self.rc

    def tail(self):
        return "int4: the child's output"

    def stop(self, why="the stage failed first"):
        self.events.append(("stop", why))


def _beside(monkeypatch, rc=0):
    events: list = []
    fake = FakeBeside(events, rc)
    monkeypatch.setattr(stage5, "beside_ok", lambda: (True, "2 CPU(s), tests"))
    monkeypatch.setattr(stage5, "ScriptBeside", fake)
    return events


def test_int4_starts_beside_the_modelopt_variants_and_prints_after_them(tiny, monkeypatch,
                                                                        capsys):
    events = _beside(monkeypatch)
    mo = FakeModelOpt(on_call=lambda calib: events.append(("modelopt",)))
    monkeypatch.setattr(modelopt_runner, "run_modelopt", mo)
    recs = stage5.main(_args("int8_hp32", "int4", "--calib-inputs", str(tiny / "calib.npz")))
    assert events[0] == ("start", "5b_quantize_int4.py",
                         ["--model", "tiny", "--no-eval", "--calib-inputs",
                          str(tiny / "calib.npz")])
    assert [e[0] for e in events] == ["start", "modelopt", "collect"]
    # the folders it writes: their locks taken first (this process holds them), its leftovers
    # removed from there if it is stopped
    from deploykit import lock

    assert {str(p.resolve()) for p in stage5.ScriptBeside.writes_in} == {
        str(tiny.resolve()), str((tiny / "onnx").resolve()),
        str((tiny.parent.parent / "r" / "tiny").resolve())}
    assert all(str(p.resolve()) in lock._HELD for p in stage5.ScriptBeside.writes_in)
    assert recs[-1] == {"variant": "int4", "status": "ok", "from": "the child"}
    out = capsys.readouterr().out
    # its output after the ModelOpt variants', under its own header
    assert out.index("finished int8_hp32") < out.index("Stage 5: quantize int4: 5b_quantize_"
                                                       "int4.py in a process of its own") \
        < out.index("int4: the child's output")


@pytest.mark.parametrize("rc,exc", [(1, StageError), (2, UsageError)])
def test_a_failed_int4_child_fails_the_stage_as_in_process(tiny, monkeypatch, capsys, rc, exc):
    """Exit 1: the other rows are made, then the stage fails naming the command; exit 2 (a
    usage error): the stage's usage error, before any row."""
    _beside(monkeypatch, rc=rc)
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt())
    calls = _fake_scripts(monkeypatch)
    monkeypatch.setattr(stage5, "beside_ok", lambda: (True, "tests"))
    with pytest.raises(exc, match=f"5b_quantize_int4.py --model tiny --no-eval exited {rc}; "
                                  "its last lines .*\n.*the child's output"):
        stage5.main(_args("int8_hp32", "int4", "--eval"))
    assert [c[0] for c in calls] == (["3_onnx_eval"] if rc == 1 else [])
    assert not (tiny.parent.parent / "r" / "tiny" / "quant_int4.json").exists()


def test_an_int8_failure_stops_the_int4_child(tiny, monkeypatch):
    events = _beside(monkeypatch)
    monkeypatch.setattr(modelopt_runner, "run_modelopt", FakeModelOpt(fail=True))
    with pytest.raises(StageError, match="ModelOpt failed on int8_hp32"):
        stage5.main(_args("int8_hp32", "int4"))
    assert [e[0] for e in events] == ["start", "stop"] and events[1][1] == "the stage failed first"
