"""Stage 2 on model features that used to break the FP16 candidate or the checks (tuple and
dict outputs read inside the graph, a uint8 NHWC input, batch statistics, a wrong input shape,
a forward() that raises), and a failed FP16 candidate that no longer blocks a good FP32."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest

from deploykit.layout import model_tag
from deploykit.results import result_record
from tests.helpers.stages import ROOT

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, bn=None):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 4)
            self.bn1 = bn or nn.Identity()

        def feat(self, x):
            return torch.relu(self.bn1(self.conv(x))).mean((2, 3))

        def forward(self, x):
            return self.fc(self.feat(x))


    class TupleOut(Net):
        def forward(self, x):
            f = self.feat(x)
            return self.fc(f), f  # the feature is an output and read by fc


    class DictU8(Net):
        def forward(self, x):  # NHWC uint8 image, cast and permuted by the model
            f = self.feat(x.permute(0, 3, 1, 2).float() / 255.0)
            return {"logits": self.fc(f), "embed": f}


    class Overflow(Net):
        def __init__(self):
            super().__init__()
            with torch.no_grad():
                self.conv.weight.mul_(1e5)

        def forward(self, x):
            return self.fc(self.feat(x) / 1e5)


    class Raises(Net):
        def forward(self, x):
            raise ValueError("head not configured")


    def plain(): return Net().eval()
    def tuple_out(): return TupleOut().eval()
    def dict_u8(): return DictU8().eval()
    def overflow(): return Overflow().eval()
    def raises(): return Raises().eval()
    def bn_batch_stats(): return Net(nn.BatchNorm2d(8, track_running_stats=False)).eval()
''')

FAST = ["--check-images", "4", "--true-fp16-budget-s", "0"]


@pytest.fixture()
def env(tmp_path):
    (tmp_path / "s2_models.py").write_text(MODELS)
    e = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
             PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    e.pop("MODEL", None)
    return e


def _run(script, argv, env, rc):
    p = subprocess.run([sys.executable, script, *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == rc, f"{argv}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


def _dirs(env, model):
    tag = model_tag(model)
    from pathlib import Path
    return Path(env["ARTIFACTS"]) / tag / "onnx", Path(env["RESULTS"]) / tag


@pytest.mark.slow
def test_fp16_failure_installs_fp32_and_stage3_skips_the_rejected_fp16(env):
    model = "s2_models:overflow"
    onnx_dir, res = _dirs(env, model)
    onnx_dir.mkdir(parents=True)
    res.mkdir(parents=True)
    (onnx_dir / "fp16.onnx").write_bytes(b"fp16 of an earlier fp32.onnx")
    (res / "ort_fp16.json").write_text(json.dumps(result_record(  # a row of the earlier file
        "3_onnx_eval", "ORT", "FP16", model, "ort_fp16")))
    # real samples: on synthetic ones (--input-shape only) the FP16 range audit only warns
    samples = onnx_dir.parent.parent / "samples.npz"
    np.savez(samples, x=np.random.default_rng(0).standard_normal((8, 3, 8, 8))
             .astype(np.float32))
    p = _run("2_export_onnx.py", ["--model", model, "--input-shape", "x:1,3,8,8", "--inputs",
                                  str(samples), *FAST], env, 0)
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("WARNING: FP16 candidate")]
    assert len(warn) == 1 and "(fp16_" in warn[0] and "--no-fp16 skips FP16" in warn[0]
    assert any(ln.startswith("fix (keep those nodes in FP32): ") for ln in p.stderr.splitlines())
    assert (onnx_dir / "fp32.onnx").exists() and not (onnx_dir / "fp16.onnx").exists()
    assert (onnx_dir / "fp16.rejected.onnx").exists()
    assert (onnx_dir / "fp16.stale.onnx").read_bytes() == b"fp16 of an earlier fp32.onnx"
    assert "fp16.stale.onnx" in p.stdout
    rec = json.loads((res / "export.json").read_text())
    assert rec["status"] == "partial" and rec["installed"] == ["fp32"]
    assert rec["files"]["fp32"]["status"] != "fail" and rec["files"]["fp32"]["installed"]
    assert rec["files"]["fp16"]["status"] == "fail" and not rec["files"]["fp16"]["installed"]
    p = _run("3_onnx_eval.py", ["--model", model, "--onnx", str(onnx_dir / "fp16.onnx"),
                                "--tag", "ort_fp16"], env, 0)
    assert "SKIPPED ort_fp16: fp16.onnx was rejected by 2_export_onnx.py's checks: fp16_" \
        in p.stdout
    row = json.loads((res / "ort_fp16.json").read_text())  # the earlier ok row is replaced
    assert row["status"] == "skipped" and row["precision"] == "FP16"
    assert "fp16.rejected.json" in row["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,names", [
    ("s2_models:tuple_out", "x:1,3,8,8", ["output_0", "output_1"]),
    ("s2_models:dict_u8", "x:1,8,8,3:uint8", ["logits", "embed"]),
])
def test_outputs_read_inside_the_graph_and_uint8_input_export(env, model, shape, names):
    _run("2_export_onnx.py", ["--model", model, "--input-shape", shape, *FAST], env, 0)
    onnx_dir, res = _dirs(env, model)
    rec = json.loads((res / "export.json").read_text())
    assert rec["status"] == "ok"
    for f in ("fp32", "fp16"):
        assert list(rec["files"][f]["outputs"]) == names  # checked per output
        assert all(p["cosine_min"] > 0.999 for p in rec["files"][f]["outputs"].values())
    m16 = onnx.load(str(onnx_dir / "fp16.onnx"))
    assert [o.name for o in m16.graph.output] == names
    want = onnx.TensorProto.UINT8 if "uint8" in shape else onnx.TensorProto.FLOAT
    assert m16.graph.input[0].type.tensor_type.elem_type == want


@pytest.mark.slow
def test_batch_statistics_wrong_channels_and_raising_forward_are_one_line(env):
    p = _run("2_export_onnx.py", ["--model", "s2_models:bn_batch_stats", "--input-shape",
                                  "x:1,3,8,8", *FAST], env, 1)
    assert p.stderr.strip().splitlines()[-1].startswith(
        "2_export_onnx.py: FAILED: BatchNorm `bn1` (BatchNorm2d) uses batch statistics")
    p = _run("2_export_onnx.py", ["--model", "s2_models:plain", "--input-shape", "x:1,4,8,8",
                                  *FAST], env, 2)
    assert "forward() fails on --input-shape x:1,4,8,8" in p.stderr
    assert "the first layer conv (Conv2d) expects 3 channels on axis 1, the input has 4" \
        in p.stderr
    p = _run("1_pytorch_baseline.py", ["--model", "s2_models:raises", "--input-shape",
                                       "x:1,3,8,8", "--iters", "2", "--warmup", "1"], env, 1)
    assert "ValueError: head not configured" in p.stderr and "s2_models.py:" in p.stderr
    assert not list((_dirs(env, "s2_models:plain")[0].parent.parent).rglob("*.onnx"))
