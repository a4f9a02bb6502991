"""Tests of the Ray sweep (issue 23): spec, plan, up-to-date rule, resources, task, report, and
an end-to-end sweep on a local 2-CPU Ray (slow: two tiny models, one failing on purpose)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deploykit.sweep import plan, report, resources, stamp, task
from deploykit.sweep.spec import (BUILTIN_TARGETS, Budget, SpecError, Target, build_spec,
                                  load_toml)

ROOT = Path(__file__).resolve().parents[2]
TINY = "tests.sweep.tiny_models:tiny_cnn"
BROKEN = "tests.sweep.tiny_models:broken"
REGISTRY = {"all": ["fp32", "fp16", "baseline", "int8", "int8_hp32", "int8_auto", "int4",
                    "int4_cli_broken"],
            "export": ["fp32", "fp16"],
            "trt": ["fp32", "fp16", "int8", "int8_hp32", "int8_auto", "int4", "int4_cli_broken"]}
# file names and tags deliberately unlike the defaults: the plan must take them from here
REGISTRY["fields"] = {v: {"onnx_file": f"{v}.x.onnx", "ort_tag": f"o_{v}", "trt_tag": f"t_{v}"}
                      for v in REGISTRY["all"]}


def inproc_layout(kind: str, model: str, env: dict) -> str:
    """``python -m deploykit.layout KIND MODEL`` run in this process (the fast lane starts no
    process): the stages' own path rules, with the pipeline's ARTIFACTS/RESULTS."""
    import contextlib
    import io

    from deploykit import layout
    saved = {k: os.environ.get(k) for k in ("ARTIFACTS", "RESULTS")}
    buf = io.StringIO()
    try:
        os.environ.update({k: env[k] for k in ("ARTIFACTS", "RESULTS") if k in env})
        with contextlib.redirect_stdout(buf):
            assert layout.main([kind, model]) == 0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return buf.getvalue().strip()


def build(spec, model, target, out):
    return plan.build_pipeline(spec, model, target, out, REGISTRY, ROOT, sys.executable,
                               layout=inproc_layout)


# ----------------------------------------------------------------------------- spec parsing

def test_spec_from_command_line_defaults_and_overrides():
    s = build_spec(models=["efficientnet_lite0", TINY], variants=["fp16", "int8", "fp16"],
                   targets=["cpu", "orin"], input_shapes=[f"{TINY}=x:1,3,16,16"], limit=8,
                   budget={"min_agreement": 98.0, "max_top1_drop": None})
    assert [m.name for m in s.models] == ["efficientnet_lite0", TINY]
    assert s.models[1].input_shape == "x:1,3,16,16" and s.models[1].custom
    assert not s.models[0].custom
    assert s.variants == ("fp16", "int8")  # duplicates dropped, order kept
    assert [t.name for t in s.targets] == ["cpu", "orin"]
    assert s.targets[1].resources == (("orin", 1.0),) and s.targets[1].trt
    assert s.limit == 8
    assert s.budget == Budget(min_agreement=98.0, max_top1_drop=0.5, min_cosine=0.999)
    d = build_spec(models=["resnet50"])
    assert d.variants == ("fp32",) and [t.name for t in d.targets] == ["cpu"]


def test_the_spec_docstring_example_is_a_valid_spec(tmp_path):
    import deploykit.sweep.spec as spec_mod
    doc = spec_mod.__doc__.split("::", 1)[1].split('"""')[0]
    f = tmp_path / "doc.toml"
    f.write_text(textwrap.dedent(doc))
    s = build_spec(load_toml(f))
    assert [t.name for t in s.targets] == ["cpu", "orin", "h100"]
    assert dict(s.targets[2].resources) == {"accelerator_type:H100": 0.001}
    assert s.models[1].input_shape == "x:1,3,16,16" and s.limit == 64


def test_spec_from_toml_with_own_target_and_cli_override(tmp_path):
    f = tmp_path / "sweep.toml"
    f.write_text(textwrap.dedent(f"""
        models = ["efficientnet_lite0", {{name = "{TINY}", input_shape = "x:1,3,16,16"}}]
        variants = ["int8_hp32"]
        targets = ["cpu", "h200"]
        limit = 16
        [budget]
        min_agreement = 99.5
        [target.h200]
        resources = {{gpu_h200 = 1}}
        num_gpus = 1
        trt = true
        rows = "trt"
    """))
    s = build_spec(load_toml(f))
    h200 = s.targets[1]
    assert (h200.name, h200.num_gpus, h200.resources, h200.trt, h200.rows) == \
        ("h200", 1, (("gpu_h200", 1.0),), True, "trt")
    assert s.limit == 16 and s.budget.min_agreement == 99.5 and s.variants == ("int8_hp32",)
    s2 = build_spec(load_toml(f), targets=["cpu"], limit=4)  # the command line wins
    assert [t.name for t in s2.targets] == ["cpu"] and s2.limit == 4


@pytest.mark.parametrize("kwargs,needle", [
    ({"models": []}, "no models"),
    ({"models": ["m"], "targets": ["tpu"]}, "target 'tpu' is not known"),
    ({"models": [TINY]}, "give its input shape"),
    ({"models": ["resnet50"], "input_shapes": ["resnet50=x:1,3,8,8"]}, "custom models"),
    ({"models": ["m", "m"]}, "given twice"),
    ({"models": ["m"], "input_shapes": ["other=x:1"]}, "not in the models"),
    ({"models": ["m"], "input_shapes": ["nonsense"]}, "MODEL=VALUE"),
    ({"models": ["m"], "limit": 0}, "positive number"),
    ({"models": ["m"], "budget": {"min_agreement": -1}}, "number >= 0"),
])
def test_spec_errors_name_the_problem(kwargs, needle):
    with pytest.raises(SpecError, match=needle):
        build_spec(**kwargs)


@pytest.mark.parametrize("toml,needle", [
    ('models = ["m"]\nbogus = 1\n', "unknown key"),
    ('models = ["m"]\ntargets = ["x"]\n[target.x]\nresources = {x = -1}\n', "positive numbers"),
    ('models = ["m"]\ntargets = ["x"]\n[target.x]\nresources = {GPU = 1}\n', "num_gpus"),
    ('models = ["m"]\ntargets = ["x"]\n[target.x]\nrows = "npu"\n', "rows"),
    ('models = ["m"]\ntargets = ["x"]\n[target.x]\nspeed = 3\n', "unknown key"),
    ('models = ["m"\n', "not valid TOML"),
])
def test_toml_errors(tmp_path, toml, needle):
    f = tmp_path / "s.toml"
    f.write_text(toml)
    with pytest.raises(SpecError, match=needle):
        build_spec(load_toml(f))


def test_missing_toml_is_named(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_toml(tmp_path / "nope.toml")


# ----------------------------------------------------------------------------- plan

def test_pipeline_ids_are_safe_folder_names():
    assert plan.pipeline_id(TINY, "cpu") == "tests.sweep.tiny_models-tiny_cnn@cpu"
    assert plan.pipeline_id("../a b:c", "x/y") == "..-a-b-c@x-y"
    assert "/" not in plan.pipeline_id("a/../../b", "t")


def test_plan_cpu_classifier_runs_run_all_then_the_variant_stages(tmp_path):
    s = build_spec(models=["efficientnet_lite0"], variants=["fp16", "int8_hp32", "int4"],
                   limit=8)
    p = build(s, s.models[0], s.targets[0], tmp_path)
    labels = [st.label for st in p.steps]
    assert labels == ["run_all_0-4", "5_quantize_int8_hp32", "3_onnx_eval_int8_hp32",
                      "5b_quantize_int4", "3_onnx_eval_int4", "run_all_8"]
    first = p.steps[0]
    assert first.argv == ("bash", "run_all.sh", "--stop-stage", "4", "--limit", "8")
    env = dict(first.env)
    assert env["ARTIFACTS"] == str(tmp_path / "pipelines" / p.id / "artifacts")
    # direct stage commands use the smoke folders run_all.sh --limit uses
    ev = p.steps[2]
    assert dict(ev.env)["ARTIFACTS"].endswith("artifacts/smoke")
    # the ONNX path from deploykit.layout, its file name and the row tag from the registry
    assert str(tmp_path / "pipelines" / p.id / "artifacts" / "smoke" / "efficientnet_lite0" /
               "onnx" / "int8_hp32.x.onnx") in ev.argv
    assert ev.argv[ev.argv.index("--tag") + 1] == "o_int8_hp32"
    assert ev.argv[-4:] == ("--warmup", "2", "--iters", "20")
    assert p.results_dir == tmp_path / "pipelines" / p.id / "results" / "smoke" / \
        "efficientnet_lite0"
    assert p.variants == ("fp16", "int8_hp32", "int4") and not p.not_applicable


def test_plan_trt_target_and_custom_model(tmp_path):
    s = build_spec(models=["efficientnet_lite0", TINY], variants=["fp16", "baseline"],
                   targets=["orin", "cpu"], input_shapes=[f"{TINY}=x:1,3,16,16 y:1,4:int64"])
    orin = build(s, s.models[0], s.targets[0], tmp_path)
    labels = [st.label for st in orin.steps]
    # baseline has no engine: not applicable on TensorRT, so not even quantized there
    assert labels == ["run_all_0-3", "6_build_engines", "7_trt_eval_fp16", "run_all_8"]
    assert dict(orin.not_applicable) == {
        "baseline": "no TensorRT engine for this variant (variants.py list --stage 6)"}
    assert orin.steps[1].argv[-1] == "fp16" and orin.steps[2].argv[-1] == "t_fp16"
    assert orin.steps[2].argv[orin.steps[2].argv.index("--engine") + 1].endswith(
        "/artifacts/efficientnet_lite0/engines/fp16.plan")
    custom_cpu = build(s, s.models[1], s.targets[1], tmp_path)
    assert [st.label for st in custom_cpu.steps] == ["run_all_0-3", "run_all_8"]
    assert "baseline" in dict(custom_cpu.not_applicable)
    # the printed command is shell-quoted: pasting it gives back the same argv and env
    words = shlex.split(custom_cpu.steps[0].shell())
    assert "INPUT_SHAPE=x:1,3,16,16 y:1,4:int64" in words
    assert words[-4:] == ["bash", "run_all.sh", "--stop-stage", "3"]
    custom_orin = build(s, s.models[1], s.targets[0], tmp_path)
    assert custom_orin.variants == ()


def test_check_variants():
    plan.check_variants(("fp32", "int8"), REGISTRY)
    with pytest.raises(SpecError, match="not known"):
        plan.check_variants(("int9",), REGISTRY)
    with pytest.raises(SpecError, match="failure reproduction"):
        plan.check_variants(("int4_cli_broken",), REGISTRY)


@pytest.mark.slow  # starts a process
def test_registry_comes_from_variants_py():
    reg = plan.load_registry(ROOT, sys.executable)
    assert reg["export"] == ["fp32", "fp16"]
    assert "int8_hp32" in reg["all"] and "baseline" not in reg["trt"]
    assert reg["fields"]["int8_hp32"] == {"onnx_file": "int8_hp32.onnx",
                                          "ort_tag": "ort_int8_hp32", "trt_tag": "trt_int8_hp32"}


# ----------------------------------------------------------------------------- up-to-date rule

def _pipeline(tmp_path, **kw) -> plan.Pipeline:
    s = build_spec(models=[TINY], input_shapes=[f"{TINY}=x:1,3,16,16"], **kw)
    return build(s, s.models[0], s.targets[0], tmp_path)


def _stamped(tmp_path, git_sha="a" * 40):
    p = _pipeline(tmp_path, limit=8)
    git = {"commit": "a" * 40, "rows_git_sha": git_sha, "diff_sha256": "0" * 64}
    key, parts = stamp.pipeline_key(p, git, stamp.model_inputs(p, ROOT))
    rows_dir = tmp_path / "rows" / p.id
    rows_dir.mkdir(parents=True)
    hashes = {}
    for tag in ("ort_fp32", "pytorch_fp32_cpu"):
        text = json.dumps({"tag": tag, "status": "ok", "provenance": {"git_sha": git_sha}})
        (rows_dir / f"{tag}.json").write_text(text)
        hashes[f"{tag}.json"] = stamp.sha256_bytes(text.encode())
    sp = tmp_path / "stamps" / f"{p.id}.json"
    stamp.write_stamp(sp, key, parts, "ok", hashes)
    return p, git, key, parts, rows_dir, sp


def test_up_to_date_when_nothing_changed(tmp_path):
    p, git, key, parts, rows_dir, sp = _stamped(tmp_path)
    ok, why = stamp.up_to_date(stamp.read_stamp(sp), key, parts, rows_dir, git["rows_git_sha"])
    assert ok, why


def test_not_up_to_date_when_the_spec_or_code_changed(tmp_path):
    p, git, key, parts, rows_dir, sp = _stamped(tmp_path)
    p2 = _pipeline(tmp_path, limit=16)  # another --limit: other commands
    key2, parts2 = stamp.pipeline_key(p2, git, stamp.model_inputs(p2, ROOT))
    ok, why = stamp.up_to_date(stamp.read_stamp(sp), key2, parts2, rows_dir,
                               git["rows_git_sha"])
    assert not ok and "pipeline.steps" in why
    git3 = {**git, "diff_sha256": "1" * 64}  # an uncommitted edit of a tracked file
    key3, parts3 = stamp.pipeline_key(p, git3, stamp.model_inputs(p, ROOT))
    ok, why = stamp.up_to_date(stamp.read_stamp(sp), key3, parts3, rows_dir,
                               git["rows_git_sha"])
    assert not ok and "code.diff_sha256" in why


def test_not_up_to_date_when_rows_differ(tmp_path):
    p, git, key, parts, rows_dir, sp = _stamped(tmp_path)
    st = stamp.read_stamp(sp)
    # rows made by other code than the checkout's
    ok, why = stamp.up_to_date(st, key, parts, rows_dir, "b" * 40)
    assert not ok and "made by code" in why
    (rows_dir / "ort_fp32.json").write_text('{"tag": "ort_fp32", "status": "ok"}')
    ok, why = stamp.up_to_date(st, key, parts, rows_dir, git["rows_git_sha"])
    assert not ok and "changed" in why
    (rows_dir / "ort_fp32.json").unlink()
    ok, why = stamp.up_to_date(st, key, parts, rows_dir, git["rows_git_sha"])
    assert not ok and "missing" in why


def test_failed_or_missing_stamp_reruns(tmp_path):
    p, git, key, parts, rows_dir, sp = _stamped(tmp_path)
    assert stamp.up_to_date(None, key, parts, rows_dir, git["rows_git_sha"])[0] is False
    stamp.write_stamp(sp, key, parts, "failed", {})
    ok, why = stamp.up_to_date(stamp.read_stamp(sp), key, parts, rows_dir, git["rows_git_sha"])
    assert not ok and "failed" in why


def test_model_inputs_hash_the_factory_source_and_weights(tmp_path):
    p = _pipeline(tmp_path)
    inp = stamp.model_inputs(p, ROOT)
    src = ROOT / "tests" / "sweep" / "tiny_models.py"
    assert inp["factory_source"] == {str(src): stamp.sha256_file(src)}
    w = tmp_path / "w.pth"
    w.write_bytes(b"1")
    s = build_spec(models=["resnet50"], weights=[f"resnet50={w}"])
    pw = build(s, s.models[0], s.targets[0], tmp_path)
    git = {"commit": None, "diff_sha256": None}
    k1, _ = stamp.pipeline_key(pw, git, stamp.model_inputs(pw, ROOT))
    w.write_bytes(b"2")
    k2, _ = stamp.pipeline_key(pw, git, stamp.model_inputs(pw, ROOT))
    assert k1 != k2


@pytest.mark.slow  # starts a process
def test_git_state_is_the_checkout():
    g = stamp.git_state(ROOT)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert g["commit"] == head and g["rows_git_sha"].startswith(head)


# ----------------------------------------------------------------------------- resources

def test_targets_map_to_ray_resources():
    assert resources.ray_options(BUILTIN_TARGETS["cpu"], 2) == \
        {"num_cpus": 2.0, "num_gpus": 0.0, "resources": {}}
    o = resources.ray_options(BUILTIN_TARGETS["orin"], 2)
    assert resources.required(o) == {"CPU": 2.0, "orin": 1.0}
    own = Target("h200", num_cpus=4, num_gpus=1, resources=(("gpu_h200", 1.0),))
    assert resources.required(resources.ray_options(own, 2)) == \
        {"CPU": 4.0, "GPU": 1.0, "gpu_h200": 1.0}


def test_availability_is_per_node():
    need = {"CPU": 2.0, "GPU": 1.0}
    assert resources.missing(need, [{"CPU": 16.0, "GPU": 8.0}]) is None
    # the CPUs and the GPU on two different nodes: no single node can run the task
    assert resources.missing(need, [{"CPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}]) is not None
    short = resources.missing({"CPU": 2.0, "orin": 1.0}, [{"CPU": 2.0}])
    assert short == {"orin": 1.0}
    msg = resources.unavailable_reason(BUILTIN_TARGETS["orin"], {"CPU": 2.0, "orin": 1.0},
                                       short, [{"CPU": 2.0}])
    assert "orin" in msg and "CPU: 2" in msg
    cmd = shlex.split(msg.split("and pass --address: ")[1])  # pasteable
    assert cmd[:2] == ["ray", "start"] and json.loads(cmd[-1].split("=", 1)[1]) == {"orin": 1.0}


# ----------------------------------------------------------------------------- the task

def _plan_dict(tmp_path, steps, model="m"):
    res = tmp_path / "p" / "results" / "m"
    return {"id": "m@cpu", "folder": str(tmp_path / "p"), "results_dir": str(res),
            "model": {"name": model},
            "steps": [{"label": lab, "argv": argv, "env": {"X_SWEEP": "1"},
                       "shell": shlex.join(argv)} for lab, argv in steps]}


@pytest.mark.slow  # starts a process
def test_task_stops_at_the_failing_step_and_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    res_dir = tmp_path / "p" / "results" / "m"
    write_row = (f"mkdir -p {res_dir} && echo '{{\"tag\": \"ort_fp32\", \"status\": \"ok\", "
                 f"\"model\": \"m\"}}' > {res_dir}/ort_fp32.json && test \"$X_SWEEP\" = 1")
    fail = "echo 'Stage 3: ONNX Runtime eval: a -> b'; echo '  | 3_onnx_eval.py: FAILED: boom'; exit 3"
    plan_d = _plan_dict(tmp_path, [("one", ["bash", "-c", write_row]),
                                   ("two", ["bash", "-c", fail]),
                                   ("three", ["bash", "-c", "touch never"])])
    r = task.execute_pipeline(plan_d, str(ROOT))
    assert r["status"] == "failed" and r["failed_step"] == "two"
    assert r["failed_stage"] == "stage 3 (ONNX Runtime eval)"
    assert "exited 3" in r["error"] and "3_onnx_eval.py: FAILED: boom" in r["error"]
    assert [s["label"] for s in r["steps"]] == ["one", "two"]
    assert list(r["rows"]) == ["ort_fp32.json"]  # rows written before the failure are kept
    assert Path(r["log"]).is_file() and not (ROOT / "never").exists()


def test_failing_stage_named_from_the_log():
    """The last stage run_all.sh started; a failure in its own checks is the setup."""
    log = "Stage 0: data: x\nStage 0: finished\nStage 1: PyTorch reference: y\n  | boom\n"
    assert task._stage_of(log) == "stage 1 (PyTorch reference)"
    setup = ("run_all.sh: MODEL=m:f: the factory m.f() raised RuntimeError: no (fix the factory)\n")
    assert task._stage_of(setup) == "setup (before stage 0)"
    assert "RuntimeError: no" in task._cause(setup)
    assert task._stage_of("Traceback (most recent call last):\n") is None


@pytest.mark.slow  # starts a process
def test_task_timeout_and_environment_errors_are_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    r = task.execute_pipeline(_plan_dict(tmp_path, [("slow", ["sleep", "30"])]), str(ROOT),
                              timeout_s=1)
    assert r["status"] == "failed" and "timed out after 1 s" in r["error"]
    assert r["wall_s"] < 20
    monkeypatch.delenv("PIPELINE_ROOT")
    r = task.execute_pipeline(_plan_dict(tmp_path, [("x", ["true"])]), str(ROOT))
    assert r["status"] == "failed" and "source env.sh" in r["error"]
    r = task.execute_pipeline(_plan_dict(tmp_path, [("x", ["true"])]), str(tmp_path))
    assert r["status"] == "failed" and "no checkout" in r["error"]


@pytest.mark.slow  # starts a process
def test_task_moves_an_earlier_runs_rows_aside(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    old = tmp_path / "p" / "results" / "m"
    old.mkdir(parents=True)
    (old / "ort_int8.json").write_text('{"tag": "ort_int8", "status": "ok", "model": "m"}')
    r = task.execute_pipeline(_plan_dict(tmp_path, [("x", ["true"])]), str(ROOT))
    assert r["status"] == "ok" and r["rows"] == {}
    assert list((tmp_path / "p" / "previous_results").glob("*/m/ort_int8.json"))


@pytest.mark.slow  # starts a process
def test_an_interrupted_task_ends_its_steps_processes(tmp_path, monkeypatch):
    """ray.cancel raises KeyboardInterrupt in the task: the step's process group must end."""
    import signal
    import time
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    pidfile = tmp_path / "child.pid"
    step = ["bash", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.alarm(2)
        with pytest.raises(KeyboardInterrupt):
            task.execute_pipeline(_plan_dict(tmp_path, [("long", step)]), str(ROOT))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the step's child {pid} outlived the interrupted task")


@pytest.mark.slow  # starts a process
def test_a_sweep_where_nothing_applies_runs_nothing(tmp_path):
    """A custom model on a TensorRT target: not applicable, no Ray started, report written."""
    from deploykit.sweep import driver
    s = build_spec(models=[TINY], input_shapes=[f"{TINY}=x:1,3,16,16"], variants=["fp16"],
                   targets=["orin"])
    logs = []
    res = driver.run_sweep(s, tmp_path / "out", ROOT, log=logs.append)
    assert res["counts"] == {"not_applicable": 1}
    assert any("not applicable, nothing to run" in ln for ln in logs)
    assert not (tmp_path / "out" / "pipelines").exists()  # nothing ran
    assert res["report"]["verdicts"] == {"orin": None}
    assert (tmp_path / "out" / "REPORT.md").is_file()


# ----------------------------------------------------------------------------- report

def _row(tag, backend, precision, variant, p50, top1=None, agree=None, cos=None, status="ok",
         device="cpu", **kw):
    r = {"tag": tag, "backend": backend, "precision": precision, "variant": variant,
         "status": status, "device": device, "model": "m",
         "accuracy": {"top1": top1} if top1 is not None else None,
         "parity": ({"top1_agreement": agree, "cosine_mean": cos} if agree is not None else None),
         "latency": {"end_to_end_ms": {"p50_ms": p50}}}
    r.update(kw)
    return r


def _pipe(model, target, kind, rows, variants, status="ok", error=None, na=None):
    return {"id": f"{model}@{target}", "model": {"name": model},
            "target": {"name": target, "rows": kind}, "variants": variants,
            "requested": variants, "not_applicable": na or {}, "status": status,
            "error": error, "rows": {f"{r['tag']}.json": r for r in rows}}


def _synthetic():
    a = [_row("pytorch_fp32_cpu", "PyTorch", "FP32", None, 40.0, top1=80.0),
         _row("ort_fp16", "ORT", "FP16", "fp16", 12.0, 80.1, 99.8, 0.9999),
         _row("ort_int8", "ORT", "INT8", "int8", 6.0, 79.6, 99.1, 0.998),     # within: -0.4
         _row("ort_int8_hp32", "ORT", "INT8", "int8_hp32", 4.0, 79.0, 99.5, 0.99),  # -1.0 out
         _row("ort_int4", "ORT", "INT4", "int4", 3.0, 80.0, 99.9, 0.999,
              nonfinite_outputs={"logits": 3}),                                 # NaN: out
         _row("trt_int8", "TensorRT", "INT8", "int8", 0.5, 79.9, 99.6, 0.999, device="cuda")]
    b = [_row("pytorch_fp32_cpu", "PyTorch", "FP32", None, 9.0),               # no labels
         _row("ort_fp16", "ORT", "FP16", "fp16", 5.0, agree=100.0, cos=0.99995),
         _row("ort_int8", "ORT", "INT8", "int8", 2.0, agree=99.5, cos=0.99)]   # cosine out
    return [_pipe("A", "cpu", "cpu", a, ["fp16", "int8", "int8_hp32", "int4"]),
            _pipe("A", "cuda", "trt", a, ["fp16", "int8", "int8_hp32", "int4"],
                  na={"int8_hp32": "x"}),
            _pipe("B", "cpu", "cpu", b, ["fp16", "int8"]),
            _pipe("C", "cpu", "cpu", [], ["fp16"], status="failed",
                  error="run_all_0-3 exited 1 in stage 1 (PyTorch FP32 baseline)")]


def test_judge_budget_bounds():
    ref = _row("r", "PyTorch", "FP32", None, 1.0, top1=80.0)
    b = Budget()
    assert report.judge(_row("x", "ORT", "INT8", "int8", 1, 79.5, 99.0, 0.9), ref, b)[0]
    ok, why = report.judge(_row("x", "ORT", "INT8", "int8", 1, 79.4, 99.9, 0.9), ref, b)
    assert not ok and "delta top-1 -0.60" in why
    ok, why = report.judge(_row("x", "ORT", "INT8", "int8", 1, 80.0, 98.9, 0.9), ref, b)
    assert not ok and "agreement 98.90" in why and "one flip" not in why
    ok, why = report.judge(_row("x", "ORT", "INT8", "int8", 1, 80.0, 98.4, 0.9, n_images=64),
                           ref, b)
    assert not ok and "on 64 images one flip is 1.56 %" in why
    ok, why = report.judge(_row("x", "ORT", "INT8", "int8", 1, 80.0, 67.2, 0.9, n_images=64),
                           ref, b)
    assert not ok and "one flip" not in why  # a real miss, not one image
    assert not report.judge(_row("x", "ORT", "INT8", "int8", 1, 80, 100, 1, status="failed"),
                            ref, b)[0]
    # rows without accuracy: parity (agreement and cosine)
    ref_nolab = _row("r", "PyTorch", "FP32", None, 1.0)
    assert report.judge(_row("x", "ORT", "FP16", "fp16", 1, agree=99.5, cos=0.9995),
                        ref_nolab, b)[0]
    ok, why = report.judge(_row("x", "ORT", "FP16", "fp16", 1, agree=99.5, cos=0.99),
                           ref_nolab, b)
    assert not ok and "cosine" in why
    assert report.judge(_row("x", "ORT", "FP16", "fp16", 1, agree=99.5, cos=0.99), ref_nolab,
                        Budget(min_cosine=0.98))[0]


def test_parity_of_a_multi_output_row_is_its_worst_output():
    r = {"parity": None, "parity_outputs": {"a": {"top1_agreement": 100.0, "cosine_mean": 0.9},
                                            "b": {"top1_agreement": 97.0, "cosine_mean": 1.0}}}
    assert report.parity(r) == {"top1_agreement": 97.0, "cosine_mean": 0.9}


def test_pareto_front():
    pts = [(1.0, 70.0), (2.0, 80.0), (3.0, 75.0), (2.0, 79.0), (5.0, 81.0), (1.0, 70.0)]
    # (3,75) and (2,79) are dominated; the duplicate (1,70) points dominate neither each other
    assert report.pareto_front(pts) == [0, 5, 1, 4]
    assert report.pareto_front([]) == []


def test_cross_model_report_verdicts_and_files(tmp_path):
    rep = report.build_report(_synthetic(), Budget())
    v = rep["verdicts"]
    # cpu: the fastest within budget over both models is B fp16 (5 ms); A int8 (6 ms) is A's
    assert (v["cpu"]["model"], v["cpu"]["variant"], v["cpu"]["p50_ms"]) == ("B", "fp16", 5.0)
    assert rep["best_per_model"]["cpu"]["A"]["variant"] == "int8"
    assert v["cuda"]["variant"] == "int8" and v["cuda"]["backend"] == "TensorRT"
    lines = {(ln["model"], ln["target"], ln["variant"]): ln for ln in rep["table"]}
    assert not lines[("A", "cpu", "int8_hp32")]["within_budget"]
    assert "non-finite" in lines[("A", "cpu", "int4")]["budget_reason"]
    assert lines[("A", "cpu", "pytorch_fp32")]["role"] == "reference"
    assert lines[("A", "cuda", "int8_hp32")]["status"] == "n/a"
    assert lines[("A", "cuda", "fp16")]["budget_reason"] == "no row"  # no TensorRT fp16 row
    assert "stage 1" in lines[("C", "cpu", "fp16")]["budget_reason"]
    assert lines[("B", "cpu", "fp16")]["verdict"] == "ship"
    assert lines[("A", "cpu", "int8")]["verdict"] == "best for model"
    assert abs(lines[("A", "cpu", "int8")]["delta_top1"] - (-0.4)) < 1e-9
    # Pareto front of cpu (y: agreement, as B has no accuracy); A int4 (NaN outputs) is no
    # point; A int8_hp32 (4 ms, 99.5 %) is dominated by B int8 (2 ms, 99.5 %)
    front = [(ln["model"], ln["variant"]) for ln in rep["pareto"]["cpu"]]
    assert front == [("B", "int8"), ("B", "fp16")]
    files = report.write_report(rep, tmp_path)
    md = files["markdown"].read_text()
    assert "**cpu**: B fp16" in md and "| A | cpu | int8 |" in md
    assert "`C@cpu`: failed" in md
    assert json.loads(files["json"].read_text())["verdicts"]["cuda"]["variant"] == "int8"
    for t in ("cpu", "cuda"):
        png = files[f"plot:{t}"]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_no_verdict_without_a_row_in_budget(tmp_path):
    rows = [_row("pytorch_fp32_cpu", "PyTorch", "FP32", None, 4.0, top1=80.0),
            _row("ort_int8", "ORT", "INT8", "int8", 1.0, 50.0, 60.0, 0.5)]
    rep = report.build_report([_pipe("A", "cpu", "cpu", rows, ["int8"])], Budget())
    assert rep["verdicts"]["cpu"] is None
    assert "no row within budget" in report.to_markdown(rep)


# ----------------------------------------------------------------------------- command line

def _main(argv):
    import sweep
    return sweep.main(sweep.get_args_parser().parse_args(argv))


@pytest.mark.parametrize("argv,needle", [
    (["--models", "m", "--targets", "tpu"], "target 'tpu' is not known"),
    (["--models", TINY], "give its input shape"),
    (["--models", "m", "--limit", "0"], "--limit must be >= 1"),
    (["--models", "m", "--address", "ray://h:10001", "--num-cpus", "2"], "drop one"),
    pytest.param(["--models", "m", "--variants", "int9", "--dry-run"],
                 "variant 'int9' is not known", marks=pytest.mark.slow),  # runs variants.py
])
def test_usage_errors_exit_2(argv, needle, capsys, monkeypatch):
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    with pytest.raises(SystemExit) as e:
        _main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow  # starts a process
def test_dry_run_prints_pasteable_commands(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    assert _main(["--models", TINY, "--input-shape", f"{TINY}=x:1,3,16,16", "--variants",
                  "fp16", "--limit", "4", "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{plan.pipeline_id(TINY, 'cpu')}: run (no stamp" in out
    cmds = [ln.strip() for ln in out.splitlines() if "run_all.sh" in ln]
    assert len(cmds) == 2 and shlex.split(cmds[0])[-5:] == \
        ["run_all.sh", "--stop-stage", "3", "--limit", "4"]


def test_the_sweep_imports_no_pipeline_library():
    """deploykit.sweep and sweep.py import only the stdlib, deploykit.sweep, ray and matplotlib:
    the stages run as commands, never as imported code."""
    import ast
    allowed = set(sys.stdlib_module_names) | {"ray", "numpy", "matplotlib"}
    files = sorted((ROOT / "deploykit" / "sweep").glob("*.py")) + [ROOT / "sweep.py"]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] in allowed or m.startswith("deploykit.sweep"), \
                    f"{f.name} imports {m}"


def test_nothing_outside_the_sweep_imports_ray():
    import re
    pat = re.compile(r"^\s*(import ray|from ray\b)", re.M)
    hits = []
    for dirpath, dirnames, filenames in os.walk(ROOT):  # symlinks (.venv) not followed
        dirnames[:] = [d for d in dirnames if not d.startswith(".")
                       and d not in ("artifacts", "results", "__pycache__")]
        for f in filenames:
            p = Path(dirpath) / f
            if f.endswith((".py", ".sh")) and pat.search(p.read_text(errors="replace")):
                hits.append(p.relative_to(ROOT).as_posix())
    assert hits and all(h.startswith("deploykit/sweep/") for h in hits), hits


# ----------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_sweep_on_local_ray_two_models_one_failing(tmp_path):
    """Local Ray with 2 CPUs; two tiny models (one fails on purpose) x two variants on the cpu
    target, plus a target no node offers; then a rerun that skips the up-to-date pipeline."""
    pytest.importorskip("ray")
    out = tmp_path / "sweep"
    spec = tmp_path / "sweep.toml"
    spec.write_text(textwrap.dedent(f"""
        models = [{{name = "{TINY}", input_shape = "x:1,3,16,16"}},
                  {{name = "{BROKEN}", input_shape = "x:1,3,16,16"}}]
        variants = ["fp32", "fp16"]
        targets = ["cpu", "bigbox"]
        limit = 4
        [target.bigbox]          # a node this machine is not: reported, never waited on
        resources = {{bigbox = 1}}
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "sweep.py", "--spec", str(spec), "--out", str(out), "--num-cpus", "2"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stdout + p.stderr  # one pipeline failed: a runtime failure
    s = json.loads((out / "sweep.json").read_text())
    by_id = {r["id"]: r for r in s["pipelines"]}
    tiny, broken = plan.pipeline_id(TINY, "cpu"), plan.pipeline_id(BROKEN, "cpu")
    # per-task results: the good model ran every requested variant
    assert by_id[tiny]["status"] == "ok", by_id[tiny]
    assert set(by_id[tiny]["rows"]) == {"pytorch_fp32_cpu.json", "ort_fp32.json",
                                        "ort_fp16.json"}
    # the failure is isolated and named: model, stage, cause, log and the command to rerun
    b = by_id[broken]
    # the factory raises when run_all.sh first builds the model (its kind check, before stage 0)
    assert b["status"] == "failed" and b["failed_stage"] == "setup (before stage 0)", b
    assert "fails on purpose" in b["error"] and Path(b["log"]).is_file()
    assert shlex.split(b["rerun_command"])[:1] == [f"MODEL={BROKEN}"]
    assert f"{broken}: failed" in p.stdout
    for m in (TINY, BROKEN):
        u = by_id[plan.pipeline_id(m, "bigbox")]
        assert u["status"] == "unavailable" and "bigbox" in u["error"]
    # the cross-model report: the verdict is the faster of the tiny model's two ORT rows
    rep = json.loads((out / "report.json").read_text())
    rows = [json.loads((out / "rows" / tiny / f).read_text())
            for f in ("ort_fp32.json", "ort_fp16.json")]
    fastest = min(rows, key=report.p50_ms)
    v = rep["verdicts"]["cpu"]
    assert (v["model"], v["tag"]) == (TINY, fastest["tag"])
    assert v["p50_ms"] == pytest.approx(report.p50_ms(fastest))
    assert rep["verdicts"]["bigbox"] is None
    md = (out / "REPORT.md").read_text()
    assert f"| {BROKEN} | cpu | fp16 |" in md and "fails on purpose" in md
    assert (out / "pareto_cpu.png").stat().st_size > 5000

    # rerun: the good pipeline is up to date (its rows untouched), the failed one reruns
    row_files = sorted((out / "rows" / tiny).glob("*.json"))
    before = {f: f.stat().st_mtime_ns for f in row_files}
    stamp_before = (out / "stamps" / f"{tiny}.json").read_text()
    task_before = (out / "tasks" / f"{broken}.json").read_text()
    p2 = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p2.returncode == 1, p2.stdout + p2.stderr
    s2 = {r["id"]: r for r in json.loads((out / "sweep.json").read_text())["pipelines"]}
    assert s2[tiny]["status"] == "up_to_date" and "up to date" in s2[tiny]["reason"]
    assert f"{tiny}: skipped, up to date" in p2.stdout
    assert {f: f.stat().st_mtime_ns for f in row_files} == before
    assert (out / "stamps" / f"{tiny}.json").read_text() == stamp_before
    assert s2[broken]["status"] == "failed"
    assert (out / "tasks" / f"{broken}.json").read_text() != task_before  # it ran again
    assert f"{broken}: submitted" in p2.stdout
    rep2 = json.loads((out / "report.json").read_text())
    assert rep2["verdicts"]["cpu"]["tag"] == fastest["tag"]  # report rebuilt from stored rows


@pytest.mark.parametrize("argv,needle", [
    (["--models", "my model"], "not a model name"),
    (["--models", "mypk.a-net"], "not a model name"),
    (["--models", "m", "--out", "__FILE__"], "is a file: give a folder"),
])
def test_names_and_folders_refused_before_ray_starts(argv, needle, capsys, monkeypatch,
                                                      tmp_path):
    """A model name no stage takes failed inside the Ray task (exit 1, after Ray started); an
    --out that is a file failed after the pipelines ran."""
    monkeypatch.setenv("PIPELINE_ROOT", str(ROOT))
    f = tmp_path / "a_file"
    f.write_text("not a folder")
    with pytest.raises(SystemExit) as e:
        _main([str(f) if a == "__FILE__" else a for a in argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_an_address_where_nothing_listens_fails_at_once():
    """Ray retried 127.0.0.1:1 for over ten minutes; the probe answers in well under a second."""
    import socket
    import time

    from deploykit.sweep.driver import probe_address

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    with pytest.raises(RuntimeError, match=rf"no Ray cluster answers at 127.0.0.1:{port}"):
        probe_address(f"127.0.0.1:{port}", timeout_s=2)
    assert time.time() - t0 < 2.5
    probe_address("auto")  # left to Ray


# ------------------------------------------------------------------------ planted links
def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text("precious")
    return v


def test_sweep_writes_never_follow_a_link_at_the_old_temporary_names(tmp_path):
    """Stamps, rows and reports used fixed temporary names (``<name>.tmp``, ``<rows>.new``,
    ``<stem>.tmp.png``): a link planted there made the sweep overwrite (or remove) what it
    pointed to."""
    from deploykit.sweep import driver

    victim = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for old in ("s.json.tmp", "rows.new", "x.json.tmp", "p.tmp.png"):
        (out / old).symlink_to(victim)
    stamp.write_stamp(out / "s.json", "key", {}, "ok", {})
    driver._write_json(out / "x.json", {"a": 1})
    driver._store_rows(out / "rows", {"r.json": "{}"})
    stamp.write_atomic(out / "p.png", writer=lambda f: f.write(b"png"))
    assert victim.read_text() == "precious"
    assert json.loads((out / "s.json").read_text())["status"] == "ok"
    assert json.loads((out / "x.json").read_text()) == {"a": 1}
    assert (out / "rows" / "r.json").read_text() == "{}"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_sweep_step_log_replaces_a_planted_link(tmp_path):
    victim = _victim(tmp_path)
    log = tmp_path / "logs" / "00_stage.log"
    log.parent.mkdir()
    log.symlink_to(victim)
    rc, _ = task._run_step({"argv": [sys.executable, "-c", "print('hi')"], "env": {},
                            "shell": "python -c ..."}, tmp_path, log, None)
    assert rc == 0 and victim.read_text() == "precious"
    assert not log.is_symlink() and "hi" in log.read_text()
