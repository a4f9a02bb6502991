"""Stage 4 (4_make_calib.py): calibration files keyed to the input, preprocessed like evaluation,
never in the evaluation split; missing split; unnormalised pixels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploykit.data.images import list_images, load_image_rgb, normalize, preprocess_image
from deploykit.data.splits import load_split
from deploykit.errors import StageError
from deploykit.io import sha256_file, write_json
from deploykit.layout import DEFAULT_DATA, model_artifacts, splits_path
from deploykit.models import model_spec

from tests.helpers.stages import ROOT, load_stage
from tests.helpers.auto_models import _save
from tests.helpers.quant_models import _ort_run, conv_model


make_calib = load_stage("4_make_calib")


@pytest.mark.slow
def test_unnormalised_pixels_refused_for_a_classifier(tmp_path, monkeypatch):
    """Calibration npz of 0..255 pixels for EfficientNet-Lite0 (eval data normalised to
    [-1, 1]): refused with the numbers; the stage-4 npz passes."""
    items, _ = list_images(DEFAULT_DATA)
    split = {"data_root": str(DEFAULT_DATA.resolve()),
             "eval": [list(i) for i in items[:4]], "calib": [list(i) for i in items[500:503]]}
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    write_json(splits_path(), split)
    onnx_dir = model_artifacts("efficientnet_lite0") / "onnx"
    onnx_dir.mkdir(parents=True)
    from onnx import helper

    g = helper.make_graph([helper.make_node("Relu", ["input"], ["y"])], "g",
                          [helper.make_tensor_value_info("input", 1, ["N", 3, 224, 224])],
                          [helper.make_tensor_value_info("y", 1, None)])
    _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
          onnx_dir / "fp32.onnx")
    rec = make_calib.main(make_calib.get_args_parser().parse_args(["--model",
                                                                   "efficientnet_lite0"]))
    assert rec["stats_check"].startswith("passed") and rec["order_seed"] == 0
    spec = model_spec("efficientnet_lite0")
    x_u8, _, _ = load_split("calib", spec)
    np.savez(tmp_path / "raw.npz", input=x_u8.astype(np.float32))
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"))
    p = subprocess.run([sys.executable, "qdq_tools.py", "check-calib", str(onnx_dir / "fp32.onnx"),
                        "--calib", str(tmp_path / "raw.npz"), "--model", "efficientnet_lite0"],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.returncode == 1 and "std ratio" in p.stderr and "unnormalised" in p.stderr
    p = subprocess.run([sys.executable, "qdq_tools.py", "check-calib", str(onnx_dir / "fp32.onnx"),
                        "--calib", str(model_artifacts("efficientnet_lite0") / "calib.npz"),
                        "--model", "efficientnet_lite0", "--json", str(tmp_path / "c.json")],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "3"  # the calibration batch: all 3 samples at once
    rec = json.loads((tmp_path / "c.json").read_text())
    assert rec["order_seed"] == 0 and rec["plan"]["batches"] == [3]


# --------------------------------------------------------------------------------------------
# Calibration data (stage 4)
# --------------------------------------------------------------------------------------------
@pytest.fixture()
def tiny_split(tmp_path, monkeypatch):
    """Private ARTIFACTS/RESULTS with a 4 eval / 3 calib split of the embedded real images."""
    items, _ = list_images(DEFAULT_DATA)
    split = {"data_root": str(DEFAULT_DATA.resolve()), "eval": [list(i) for i in items[:4]],
             "calib": [list(i) for i in items[500:503]]}
    art = tmp_path / "artifacts"
    monkeypatch.setenv("ARTIFACTS", str(art))
    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    write_json(art / "splits.json", split)
    return split


def _calib_args(model="efficientnet_lite0", **kw):
    argv = ["--model", model] + [x for k, v in kw.items() for x in (f"--{k}", str(v))]
    return make_calib.get_args_parser().parse_args(argv)


def test_calibration_keyed_to_renamed_input_and_preprocessed_as_eval(tiny_split):
    onnx_dir = model_artifacts("efficientnet_lite0") / "onnx"
    onnx_dir.mkdir(parents=True)
    path = _save(conv_model("input"), onnx_dir / "fp32.onnx")
    make_calib.main(_calib_args())
    with np.load(model_artifacts("efficientnet_lite0") / "calib.npz") as z:
        assert z.files == ["input"]
    _save(conv_model("pixel_values"), path)  # the same graph with its input renamed
    rec = make_calib.main(_calib_args())
    assert rec["input_name"] == "pixel_values"
    with np.load(model_artifacts("efficientnet_lite0") / "calib.npz") as z:
        assert z.files == ["pixel_values"]
        x = z["pixel_values"]
    # Exactly eval's preprocessing, recomputed here from the image files, in the recorded
    # (seeded) order.
    spec = model_spec("efficientnet_lite0")
    assert sorted(rec["files"]) == [p for p, _ in tiny_split["calib"]] and rec["order_seed"] == 0
    ref = np.stack([preprocess_image(load_image_rgb(DEFAULT_DATA / p),
                                            **spec.preprocessing()) for p in rec["files"]])
    np.testing.assert_array_equal(x, normalize(ref, spec.mean, spec.std))
    assert x.dtype == np.float32 and x.shape == (3, 3, 224, 224)
    _ort_run(path, {"pixel_values": x[:1]})  # the npz feeds the model as is


def test_calibration_files_never_in_eval_split(tiny_split):
    onnx_dir = model_artifacts("efficientnet_lite0") / "onnx"
    onnx_dir.mkdir(parents=True)
    _save(conv_model(), onnx_dir / "fp32.onnx")
    rec = make_calib.main(_calib_args())
    ev = {p for p, _ in tiny_split["eval"]}
    assert sorted(rec["files"]) == [p for p, _ in tiny_split["calib"]]
    assert not ev & set(rec["files"])
    # An overlapping split is refused before anything is written.
    bad = dict(tiny_split, calib=tiny_split["calib"] + [tiny_split["eval"][0]])
    write_json(splits_path(), bad)
    (model_artifacts("efficientnet_lite0") / "calib.npz").unlink()
    with pytest.raises(StageError, match="also evaluation images"):
        make_calib.main(_calib_args())
    assert not (model_artifacts("efficientnet_lite0") / "calib.npz").exists()


@pytest.mark.slow
def test_pipeline_split_and_calibration_are_disjoint(stage_env):
    """Stages 0 (run by the fixture on the embedded images), 2 and 4 as a user runs them:
    no calibration image of calib.json is in the eval split, by path or by content."""
    from tests.helpers.stages import run_stage

    env = stage_env
    art = Path(env["ARTIFACTS"]) / "efficientnet_lite0"
    if not (art / "onnx" / "fp32.onnx").exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    run_stage(["4_make_calib.py"], env)
    split = json.loads((Path(env["ARTIFACTS"]) / "splits.json").read_text())
    rec = json.loads((Path(env["RESULTS"]) / "efficientnet_lite0" / "calib.json").read_text())
    ev = {p for p, _ in split["eval"]}
    assert len(rec["files"]) == 100 and not ev & set(rec["files"])
    root = Path(split["data_root"])
    digests = {sha256_file(root / p) for p in rec["files"]}
    assert not digests & {sha256_file(root / p) for p in ev}
    with np.load(art / "calib.npz") as z:
        assert list(z.files) == ["input"] and z["input"].shape == (100, 3, 224, 224)


def test_calibration_missing_split_names_producer(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTIFACTS", str(tmp_path / "a"))
    monkeypatch.setenv("RESULTS", str(tmp_path / "r"))
    (tmp_path / "a" / "efficientnet_lite0" / "onnx").mkdir(parents=True)
    _save(conv_model(), tmp_path / "a" / "efficientnet_lite0" / "onnx" / "fp32.onnx")
    with pytest.raises(StageError, match="0_prepare_data.py"):
        make_calib.main(_calib_args())
