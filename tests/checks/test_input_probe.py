"""The input-convention probe names a BGR / double-normalisation file as the likely cause of a
failed FP32 row (deploykit.checks.input_probe, deploykit.evaluate.input_convention_hint)."""
from __future__ import annotations

import argparse
import time

import numpy as np
import pytest

from deploykit.evaluate import EvalData, evaluate, run_outputs
from deploykit.runners import OrtRunner, TorchRunner
from tests.helpers.runners import _export, _tiny_torch

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _data(n=12):
    rng = np.random.default_rng(1)
    return EvalData(x_u8=rng.integers(0, 256, (n, 3, 8, 8), dtype=np.uint8),
                    y=rng.integers(0, 10, n), files=[f"f{i}" for i in range(n)],
                    mean=MEAN, std=STD)


class _Wrapped:
    """``model`` behind an input transform (built lazily: torch is imported in the test)."""

    def __new__(cls, model, kind):
        import torch

        class W(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model
                self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
                self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))

            def forward(self, x):
                x = x.flip(1) if kind == "bgr" else (x - self.mean) / self.std
                return self.m(x)
        return W().eval()


def _row(tmp_path, kind, precision="FP32"):
    model = _tiny_torch()
    data = _data()
    with TorchRunner(model) as r:
        data.ref = run_outputs(r, data, 16)["logits"]
    path = _export(_Wrapped(model, kind), tmp_path / f"{kind}.onnx")
    with OrtRunner(path) as r:
        rec, _ = evaluate(r, data, stage="3_onnx_eval", precision=precision, model="m",
                          tag="t", args=argparse.Namespace(), started=time.time(), iters=2,
                          warmup=0, write=False)
    return rec


@pytest.mark.parametrize("kind, best, cause", [
    ("bgr", "bgr", "likely cause: the file expects BGR input (parity with reversed channels"),
    ("renorm", "unnormalised_0_1", "likely cause: the file expects unnormalised input in 0..1"),
])
def test_a_failed_fp32_row_names_the_input_convention_that_restores_parity(tmp_path, kind,
                                                                            best, cause):
    rec = _row(tmp_path, kind)
    assert rec["status"] != "ok", rec["parity"]
    probe = rec["diagnostics"]["input_convention"]
    assert probe["best"] == best, probe
    assert probe["n_samples"] == 8
    assert probe["probes"][best]["cosine_min"] >= 0.99999 > probe["as_fed"]["cosine_min"]
    assert cause in rec["status_reason"] and "; fix: " in rec["status_reason"]
    assert rec["reason"] == rec["status_reason"]
    assert rec["status_reason"].startswith("logits ")  # the metric verdict stays first


def test_an_ok_row_and_an_int8_row_are_not_probed(tmp_path):
    model = _tiny_torch()
    data = _data()
    with TorchRunner(model) as r:
        data.ref = run_outputs(r, data, 16)["logits"]
    with OrtRunner(_export(model, tmp_path / "ok.onnx")) as r:
        rec, _ = evaluate(r, data, stage="3_onnx_eval", precision="FP32", model="m", tag="t",
                          args=argparse.Namespace(), started=time.time(), iters=2, warmup=0,
                          write=False)
    assert rec["status"] == "ok" and "input_convention" not in rec["diagnostics"]
    rec = _row(tmp_path, "bgr", precision="INT8")
    assert "input_convention" not in rec["diagnostics"]
    assert "likely cause" not in (rec["status_reason"] or "")


def test_a_wrong_file_of_no_input_convention_gets_no_cause():
    from deploykit.checks.input_probe import probe_input_convention

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (10, 3, 4, 4), dtype=np.uint8)
    w = rng.standard_normal((48, 5))
    ref = (x.reshape(10, -1) / 255.0) @ w
    res = probe_input_convention(lambda f: rng.standard_normal((len(f), 5)), x, ref, MEAN, STD,
                                 "FP32")
    assert res["cause"] is None and res["best"] is None and res["n_samples"] == 8
