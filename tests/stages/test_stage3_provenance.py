"""Stage 3 rows record what they were measured against (reference, file, and a derived file's
recorded fp32.onnx), flag a stale source, and warn when overwriting a row measured in another
ARTIFACTS folder. In-process, on a MatMul model with its own data."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from deploykit.io import sha256_file
from deploykit.layout import model_results
from deploykit.results import staleness
from tests.helpers import provenance as P
from tests.helpers.stages import ROOT, load_stage

FAST = ["--iters", "2", "--warmup", "0", "--model", P.MODEL]


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    return tmp_path


def _run(onnx, tag, *extra):
    """3_onnx_eval.main in this process, with the command line a user would have typed."""
    stage = load_stage("3_onnx_eval")
    argv = ["--onnx", str(onnx), "--tag", tag, *FAST, *extra]
    old, sys.argv = sys.argv, ["3_onnx_eval.py", *argv]
    try:
        return stage.main(stage.get_args_parser().parse_args(argv))
    finally:
        sys.argv = old


def test_rows_record_reference_file_and_source(dirs, capsys):
    ref = P.reference()
    fp32, fp16 = P.export_pair(fp16_scale=1.0001)
    rec = _run(fp32, "ort_fp32")
    ma = rec["measured_against"]
    assert ma["reference"]["sha256"] == sha256_file(ref)
    assert ma["evaluated"]["sha256"] == sha256_file(fp32)
    assert rec["provenance"]["artifacts_root"] == str((dirs / "a").resolve())
    assert staleness(rec) == []
    rec = _run(fp16, "ort_fp16", "--precision", "FP16")
    assert rec["measured_against"]["fp32"]["sha256"] == sha256_file(fp32)
    assert rec["source"]["record"] == "export.json" and rec["stale_source"] is None
    assert "WARNING" not in capsys.readouterr().err
    # stage 1 rerun with other weights: the reference changes, both rows go stale
    P.reference(scale=-1.0)
    row = json.loads((model_results(P.MODEL) / "ort_fp32.json").read_text())
    (why,) = staleness(row)
    assert why.startswith("the PyTorch reference") and "has changed" in why
    # the command to paste: this run's ARTIFACTS/RESULTS, then the stage with its flags
    art = (dirs / "a").resolve()
    assert f"rerun cd {ROOT} && ARTIFACTS={art} " in why and f" {ROOT / '3_onnx_eval.py'} --onnx " in why


def test_a_file_made_from_another_fp32_is_measured_and_flagged(dirs, capsys):
    P.reference()
    fp32, fp16 = P.export_pair()
    P.reexport(scale=3.0)  # fp32.onnx re-exported, fp16.onnx left from the earlier export
    rec = _run(fp16, "ort_fp16", "--precision", "FP16")
    err = capsys.readouterr().err
    assert f"WARNING: {fp16} is stale: it was made from an fp32.onnx" in err
    # (the helper's export.json records only "command": run in the repository root)
    assert f"remake it: cd {ROOT} && " in err and "python 2_export_onnx.py --model" in err
    assert "re-exported since" in rec["stale_source"] and rec["parity"] is not None
    why = staleness(rec)
    assert why and "2_export_onnx.py" in why[0] and why[0].index("2_export") < why[0].index(
        "3_onnx_eval")


def test_a_derived_file_no_record_names_is_unknown(dirs, capsys):
    P.reference()
    P.export_pair()
    other = P.matmul_onnx(dirs / "elsewhere" / "fp16.onnx", 5.0)  # another model version
    rec = _run(other, "ort_other", "--precision", "FP16")
    assert "WARNING: no record in" in capsys.readouterr().err
    assert rec["source"] is None and "fp32" not in rec["measured_against"]


def test_overwriting_a_row_of_another_artifacts_folder_warns(dirs, monkeypatch, capsys):
    P.reference()
    fp32, _ = P.export_pair()
    _run(fp32, "ort_fp32")
    P.copy_artifacts(dirs / "b")
    monkeypatch.setenv("ARTIFACTS", str(dirs / "b"))
    capsys.readouterr()
    _run(dirs / "b" / fp32.relative_to(dirs / "a"), "ort_fp32")
    err = capsys.readouterr().err
    assert f"was measured in ARTIFACTS={(dirs / 'a').resolve()}" in err
    assert f"measured in ARTIFACTS={(dirs / 'b').resolve()}" in err


def test_a_file_whose_qdq_quantizes_no_mac_is_measured_as_float_and_said(dirs, capsys):
    """Issue 19: a dead QuantizeLinear->DequantizeLinear pair made stage 3 call a float file
    INT8 (judged in the loose INT8 band); the label now follows the quantized MACs."""
    import onnx
    from onnx import helper, numpy_helper

    P.reference()
    fp32, _ = P.export_pair()
    m = onnx.load(str(fp32))
    m.graph.initializer.extend([numpy_helper.from_array(np.array(0.1, np.float32), "qs")])
    m.graph.node.extend([helper.make_node("QuantizeLinear", ["x", "qs"], ["xq"], name="q"),
                         helper.make_node("DequantizeLinear", ["xq", "qs"], ["xd"], name="dq")])
    del m.opset_import[:]
    m.opset_import.extend([helper.make_opsetid("", 19)])
    dead = fp32.with_name("dead_qdq.onnx")
    onnx.save(m, str(dead))
    rec = _run(dead, "ort_dead_qdq")
    err = capsys.readouterr().err
    assert rec["precision"] == "FP32" and rec["tolerance"]["band"] == "fp32"
    assert "0 of 1 MatMul/Conv/Gemm quantized" in rec["qdq_without_int8_macs"]
    assert "WARNING: dead_qdq.onnx: 2 QuantizeLinear/DequantizeLinear node(s)" in err
    assert "WARNING: no record in" in err  # still a derived file of unknown source
    # its layer-wise diagnostic compares at the INT8 tolerance: the Q/DQ still round x
    lw = _run(dead, "ort_dead_qdq_lw", "--layerwise")["diagnostics"]["layerwise"]
    assert json.loads((Path(lw["out_dir"]) / "layerwise.json").read_text())["precision"] == "int8"
