"""Reliability of the data stage and the model/paths helpers (issue 11): bad data folders,
labels checked against the 1000 ImageNet WNIDs, split rules that never leave an empty evaluation
split, every image mode loaded with its real contents, truncated caches, full disks, unwritable
folders, unsafe names, bad --weights / --input-shape / factories.

Every test builds its own input (symlinks to a few embedded images, generated images, tiny
models) and checks the message, the exit status and that earlier files survive.
"""
from __future__ import annotations

import errno
import json
import os
import resource
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_stage
from deploykit.data.images import (
    LargeImageWarning,
    imagenet_wnids,
    list_images,
    load_image_rgb,
    preprocess_image,
)
from deploykit.data.splits import align_reference, load_split, make_splits
from deploykit.errors import StageError, UsageError
from deploykit.io import atomic_path, write_json
from deploykit.layout import DEFAULT_DATA, safe_name
from deploykit.models import build_model, model_spec, parse_input_shapes
from deploykit.results import write_result

DATA = DEFAULT_DATA
SAMPLE = sorted(DATA.glob("*.JPEG"))


def _env(tmp_path: Path, **extra) -> dict:
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"),
               PYTHONPATH=str(ROOT))
    env.pop("VAL_ROOT", None)
    env.pop("ALLOW_CLASS_SUBSET", None)
    return {**env, **extra}


def _class_folders(root: Path, files, nested: str = "") -> Path:
    """``root/<WNID>/[nested/]<name>`` symlinks to embedded images."""
    for f in files:
        d = root / f.name[:9] / nested
        d.mkdir(parents=True, exist_ok=True)
        (d / f"val_{f.name}").symlink_to(f)
    return root


# ------------------------------------------------------------------------------- WNID labels
def test_wnid_list_is_timms_sorted_list_and_matches_the_sample():
    from timm.data import ImageNetInfo

    w = imagenet_wnids()
    assert list(w) == ImageNetInfo("imagenet-1k").label_names()
    assert len(w) == 1000 and list(w) == sorted(w)
    assert list(w) == sorted({f.name[:9] for f in SAMPLE})


def test_class_folder_that_is_not_a_wnid_is_refused_not_shifting_labels(tmp_path):
    """999 real class folders plus one whose name looks like a WNID but is none: the old code
    counted 1000 folders and shifted every label after it (top-1 3 %, exit 0)."""
    _class_folders(tmp_path, SAMPLE[:-1])
    fake = tmp_path / "n99999999"
    fake.mkdir()
    (fake / "x.JPEG").symlink_to(SAMPLE[-1])
    with pytest.raises(StageError, match=r"not ImageNet WNIDs: n99999999 \(1 images\)"):
        list_images(tmp_path)
    fake.rename(tmp_path / "cats")  # a plain folder name with images: named too
    with pytest.raises(StageError, match=r"cats \(1 images\).*rename each to its WNID"):
        list_images(tmp_path)


def test_missing_classes_refused_unless_subset_flag_then_real_wnid_index(tmp_path):
    picks = [SAMPLE[1], SAMPLE[500], SAMPLE[999]]
    _class_folders(tmp_path, picks)
    with pytest.raises(StageError, match="3 of the 1000.*--allow-class-subset"):
        list_images(tmp_path)
    items, layout = list_images(tmp_path, allow_subset=True)
    assert layout == "class-folders"
    assert [c for _, c in items] == [1, 500, 999]  # the WNID's index, not 0, 1, 2


def test_stage0_subset_flag_and_env(tmp_path):
    data = _class_folders(tmp_path / "d", SAMPLE[:6])
    args = ["0_prepare_data.py", "--data-root", str(data), "--model", "efficientnet_lite0"]
    p = run_stage(args, _env(tmp_path), check=False)
    assert p.returncode == 1 and "--allow-class-subset" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "a" / "splits.json").exists()
    run_stage(args, _env(tmp_path, ALLOW_CLASS_SUBSET="1"))
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert split["n_classes"] == 6 and split["class_subset"] is True
    assert sorted(c for _, c in split["eval"] + split["calib"]) == list(range(6))


def test_nested_class_folders(tmp_path):
    # images one level below their class folder are found and labelled by the class folder
    _class_folders(tmp_path / "a", SAMPLE[:3], nested="extra")
    items, _ = list_images(tmp_path / "a", allow_subset=True)
    assert [c for _, c in items] == [0, 1, 2] and items[0][0].startswith("n01440764/extra/")
    # class folders one level below the data root: say which folder to use
    _class_folders(tmp_path / "b" / "val", SAMPLE[:3])
    with pytest.raises(StageError, match=r"holds class folders.*--data-root .*b/val"):
        list_images(tmp_path / "b")


def _flat_csv(tmp_path: Path, lines: list[str]) -> Path:
    val = tmp_path / "val"
    val.mkdir()
    for i, f in enumerate(SAMPLE[:3]):
        (val / f"ILSVRC2012_val_{i + 1:08d}.JPEG").symlink_to(f)
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(lines) + "\n")
    return val


def test_malformed_csv_line_is_named(tmp_path):
    val = _flat_csv(tmp_path, ["ImageId,PredictionString",
                               "ILSVRC2012_val_00000001,n01440764 1 2 3 4",
                               "ILSVRC2012_val_00000002 n01443537 1 2 3 4",
                               "ILSVRC2012_val_00000003,n01484850 1 2 3 4"])
    with pytest.raises(StageError, match=r"line 3: malformed line 'ILSVRC2012_val_00000002"):
        list_images(val, allow_subset=True)


def test_csv_unknown_wnid_is_named(tmp_path):
    val = _flat_csv(tmp_path, ["ImageId,PredictionString",
                               "ILSVRC2012_val_00000001,n01440764 1 2 3 4",
                               "ILSVRC2012_val_00000002,n12345678 1 2 3 4",
                               "ILSVRC2012_val_00000003,n01484850 1 2 3 4"])
    with pytest.raises(StageError, match=r"line 3: 'n12345678' is not one of the 1000"):
        list_images(val, allow_subset=True)


def test_csv_without_header_keeps_first_row(tmp_path):
    val = _flat_csv(tmp_path, ["ILSVRC2012_val_00000001,n01440764 1 2 3 4",
                               "ILSVRC2012_val_00000002,n01443537 1 2 3 4",
                               "ILSVRC2012_val_00000003,n01484850 1 2 3 4"])
    items, _ = list_images(val, allow_subset=True)
    assert [c for _, c in items] == [0, 1, 2]


# ------------------------------------------------------------------------------- splits
def _old_make_splits(items, eval_per_class, calib_per_class, calib_fraction, seed):
    """The split rules before issue 11, for data that is all one-image or all many-image."""
    rng = np.random.default_rng(seed)
    by_class = {}
    for p, c in items:
        by_class.setdefault(c, []).append(p)
    ev, ca = [], []
    if max(len(v) for v in by_class.values()) == 1:
        classes = sorted(by_class)
        n_cal = int(round(calib_fraction * len(classes)))
        cal = set(rng.choice(classes, size=n_cal, replace=False).tolist()) if n_cal else set()
        for c in classes:
            (ca if c in cal else ev).append((by_class[c][0], c))
    else:
        for c in sorted(by_class):
            paths = sorted(by_class[c])
            chosen = [paths[i] for i in rng.permutation(len(paths))]
            ca += [(p, c) for p in chosen[:calib_per_class]]
            rest = chosen[calib_per_class:]
            ev += [(p, c) for p in (rest if eval_per_class is None else rest[:eval_per_class])]
    return sorted(ev), sorted(ca)


def test_splits_unchanged_where_the_old_rules_worked():
    items, _ = list_images(DATA)
    assert make_splits(items, None, 10, 0.1, 0) == _old_make_splits(items, None, 10, 0.1, 0)
    many = [(f"c{c}/{i}.JPEG", c) for c in range(50) for i in range(15)]
    assert make_splits(many, 3, 10, 0.1, 0) == _old_make_splits(many, 3, 10, 0.1, 0)


def test_few_images_per_class_never_give_an_empty_eval_split():
    items = [(f"c{c}/{i}.JPEG", c) for c in range(20) for i in range(3)]  # 3 per class
    assert not _old_make_splits(items, None, 10, 0.1, 0)[0]  # the old rules: 0 eval
    ev, ca = make_splits(items, None, 10, 0.1, 0)
    assert len(ev) == 20 and len(ca) == 40 and {c for _, c in ev} == set(range(20))
    assert not {p for p, _ in ev} & {p for p, _ in ca}


def test_one_stray_extra_image_does_not_empty_the_eval_split():
    items, _ = list_images(DATA)
    items = items + [("stray_a.JPEG", 3), ("stray_b.JPEG", 7)]  # two classes now have 2 images
    assert len(_old_make_splits(items, None, 10, 0.1, 0)[0]) == 0
    ev, ca = make_splits(items, None, 10, 0.1, 0)
    assert len(ev) == 900 and len(ca) == 102  # 100 held-out classes + 1 from each 2-image class


def test_calib_fraction_that_leaves_no_eval_names_the_flag():
    with pytest.raises(UsageError, match="lower --calib-fraction"):
        make_splits([("a.JPEG", 0)], None, 10, 0.9, 0)


def test_empty_eval_split_message_names_a_flag_that_helps(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTIFACTS", str(tmp_path))
    (tmp_path / "splits.json").write_text(json.dumps({"data_root": "/x", "eval": [],
                                                      "calib": [["a", 0]]}))
    with pytest.raises(StageError, match="--calib-fraction or --calib-per-class"):
        load_split("eval", model_spec("efficientnet_lite0"))


# ------------------------------------------------------------------------------- image modes
def _write_png16(path: Path, a: np.ndarray, color_type: int) -> None:
    """A 16-bit PNG written by hand (Pillow cannot write 16-bit RGB): ``a`` uint16 HxWxC."""
    h, w = a.shape[:2]
    raw = b"".join(b"\x00" + a[y].astype(">u2").tobytes() for y in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))

    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw))
                     + chunk(b"IEND", b""))


def _rgb(path) -> np.ndarray:
    return np.asarray(load_image_rgb(path))


def test_16bit_gray_png_keeps_its_contents(tmp_path):
    v16 = np.array([[0, 257, 128 * 257, 65535], [1000, 20000, 40000, 60000]], np.uint16)
    from PIL import Image

    Image.fromarray(v16).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    want = np.rint(v16 / 257.0).astype(np.uint8)
    got = _rgb(tmp_path / "g16.png")
    assert got.shape == (2, 4, 3)
    np.testing.assert_array_equal(got[..., 0], want)
    np.testing.assert_array_equal(got[..., 2], want)
    assert got.mean() < 200  # Pillow's convert("RGB") made this pure white


def test_48bit_rgb_and_16bit_gray_alpha_png(tmp_path):
    a = np.zeros((2, 2, 3), np.uint16)
    a[..., 0], a[..., 1], a[..., 2] = 40000, 2770, 65535
    _write_png16(tmp_path / "rgb48.png", a, 2)
    got = _rgb(tmp_path / "rgb48.png")
    assert np.abs(got.astype(int) - np.rint(a / 257.0)).max() <= 1  # Pillow keeps the high byte
    la = np.zeros((1, 2, 2), np.uint16)
    la[0, 0] = (30000, 65535)  # opaque gray
    la[0, 1] = (0, 0)          # fully transparent black: shows as the white page
    _write_png16(tmp_path / "la16.png", la, 4)
    got = _rgb(tmp_path / "la16.png")
    assert abs(int(got[0, 0, 0]) - round(30000 / 257)) <= 1 and got[0, 1].tolist() == [255] * 3


def test_32bit_int_and_float_images(tmp_path):
    from PIL import Image

    i32 = np.array([[0, 255, 65535, 32768]], np.int32)
    Image.fromarray(i32, "I").save(tmp_path / "i32.tif")
    assert Image.open(tmp_path / "i32.tif").mode == "I"
    np.testing.assert_array_equal(_rgb(tmp_path / "i32.tif")[..., 1],
                                  np.rint(i32 / 257.0).astype(np.uint8))
    f = np.array([[0.0, 0.25, 0.5, 1.0]], np.float32)
    Image.fromarray(f, "F").save(tmp_path / "f.tif")
    assert Image.open(tmp_path / "f.tif").mode == "F"
    np.testing.assert_array_equal(_rgb(tmp_path / "f.tif")[..., 0], [[0, 64, 128, 255]])


def test_palette_rgba_la_cmyk_against_hand_made_reference(tmp_path):
    from PIL import Image

    # palette: index -> colour
    p = Image.new("P", (2, 1))
    p.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    p.putdata([0, 1])
    p.save(tmp_path / "p.png")
    assert _rgb(tmp_path / "p.png").tolist() == [[[10, 20, 30], [200, 100, 50]]]
    # palette with a transparent index: over white
    p.save(tmp_path / "pt.png", transparency=1)
    assert _rgb(tmp_path / "pt.png").tolist() == [[[10, 20, 30], [255, 255, 255]]]
    # RGBA: alpha composited over white; (0,0,0,0) is white, half-transparent red is pink
    rgba = np.array([[[0, 0, 0, 0], [255, 0, 0, 128], [0, 0, 255, 255]]], np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    a = 128 / 255
    want = [[[255, 255, 255], [255, round(255 * (1 - a)), round(255 * (1 - a))], [0, 0, 255]]]
    assert np.abs(_rgb(tmp_path / "rgba.png").astype(int) - np.array(want)).max() <= 1
    # LA (8-bit)
    la = np.array([[[50, 255], [50, 0]]], np.uint8)
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    assert _rgb(tmp_path / "la.png").tolist() == [[[50] * 3, [255] * 3]]
    # CMYK (lossless TIFF): R = (255 - C)(255 - K) / 255
    cmyk = np.array([[[0, 0, 0, 0], [128, 0, 0, 128], [0, 255, 0, 0]]], np.uint8)
    Image.fromarray(cmyk, "CMYK").save(tmp_path / "cmyk.tif")
    want = [[[255, 255, 255], [63, 127, 127], [255, 0, 255]]]
    assert np.abs(_rgb(tmp_path / "cmyk.tif").astype(int) - np.array(want)).max() <= 1


def test_large_image_warning_names_the_file(tmp_path, monkeypatch):
    from PIL import Image

    Image.new("RGB", (40, 40), (1, 2, 3)).save(tmp_path / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 1600 px: above, but not 2x above
    with pytest.warns(LargeImageWarning, match=r"huge\.png: 40x40 px"):
        img = load_image_rgb(tmp_path / "huge.png")
    assert img.size == (40, 40)


def test_stage0_loads_every_mode_from_a_mixed_folder(tmp_path):
    """Class folders with a 16-bit PNG, an RGBA PNG and a CMYK TIFF next to real JPEGs: stage 0
    reads all, and the 16-bit image is not white in the cache."""
    from PIL import Image

    data = _class_folders(tmp_path / "d", SAMPLE[:4])
    src = np.asarray(Image.open(SAMPLE[4]).convert("L"), np.uint16) * 257
    (data / SAMPLE[4].name[:9]).mkdir()
    Image.fromarray(src).save(data / SAMPLE[4].name[:9] / "g16.png")
    (data / SAMPLE[5].name[:9]).mkdir()
    Image.open(SAMPLE[5]).convert("RGBA").save(data / SAMPLE[5].name[:9] / "rgba.png")
    (data / SAMPLE[6].name[:9]).mkdir()
    Image.open(SAMPLE[6]).convert("CMYK").save(data / SAMPLE[6].name[:9] / "cmyk.tif")
    env = _env(tmp_path, ALLOW_CLASS_SUBSET="1")
    run_stage(["0_prepare_data.py", "--data-root", str(data), "--model", "efficientnet_lite0",
               "--calib-fraction", "0"], env)
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert len(split["eval"]) == 7 and not split["unreadable"]
    z = np.load(next((tmp_path / "a" / "cache").glob("eval-*.npz")))
    i16 = [str(f) for f in z["files"]].index(f"{SAMPLE[4].name[:9]}/g16.png")
    ref = preprocess_image(Image.open(SAMPLE[4]).convert("L").convert("RGB"), 256, 224,
                                  "bicubic")
    assert np.abs(z["x"][i16].astype(int) - ref).max() <= 1


# ------------------------------------------------------------------------------- caches
@pytest.fixture()
def tiny_stage0(tmp_path):
    """Stage 0 run on 6 classes (symlinks to embedded images); returns its environment."""
    data = _class_folders(tmp_path / "d", SAMPLE[:6])
    env = _env(tmp_path, ALLOW_CLASS_SUBSET="1")
    run_stage(["0_prepare_data.py", "--data-root", str(data), "--model", "efficientnet_lite0",
               "--calib-fraction", "0.34"], env)
    return env


def test_truncated_cache_is_named_and_rebuilt(tiny_stage0, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARTIFACTS", tiny_stage0["ARTIFACTS"])
    spec = model_spec("efficientnet_lite0")
    x0, y0, f0 = load_split("eval", spec)
    cache = next((tmp_path / "a" / "cache").glob("eval-*.npz"))
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    x1, y1, f1 = load_split("eval", spec)
    err = capsys.readouterr().err
    assert cache.name in err and "rebuilding" in err
    np.testing.assert_array_equal(x0, x1)
    assert f0 == f1 and (y0 == y1).all()
    np.load(cache)["x"]  # the rebuilt file is whole


def test_truncated_reference_is_named_with_the_stage_that_rewrites_it(tmp_path):
    ref = tmp_path / "ref_logits.npz"
    np.savez(ref, logits=np.zeros((4, 10), np.float32), files=np.array(list("abcd")))
    ref.write_bytes(ref.read_bytes()[:100])
    with pytest.raises(StageError,
                       match=r"ref_logits\.npz is unreadable.*truncated.*1_pytorch_baseline\.py"):
        align_reference(ref, ["a"])
    np.savez(ref, logits=np.zeros((4, 10), np.float32))
    with pytest.raises(StageError, match=r"lacks \['files'\]"):
        align_reference(ref, ["a"])


# ------------------------------------------------------------------------------- writes
def test_disk_full_inside_atomic_write_names_the_path_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "res" / "row.json"
    write_json(target, {"good": 1})
    with pytest.raises(StageError, match=r"cannot write .*row\.json: the disk is full "
                                                r"\[ENOSPC\]; the previous row\.json is unchanged"):
        with atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert json.loads(target.read_text()) == {"good": 1}
    assert list(target.parent.iterdir()) == [target]  # no temporary left


def test_stage0_file_size_limit_names_the_cache_and_keeps_the_previous_split(tiny_stage0,
                                                                            tmp_path):
    """A real failed write (RLIMIT_FSIZE gives EFBIG, as a full disk gives ENOSPC): the new
    cache cannot be written; the message names it and the previous split stays usable."""
    before = (tmp_path / "a" / "splits.json").read_text()
    data = tmp_path / "d"
    (data / SAMPLE[7].name[:9]).mkdir()
    (data / SAMPLE[7].name[:9] / "x.JPEG").symlink_to(SAMPLE[7])  # a new file list

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    import subprocess
    import sys

    p = subprocess.run([sys.executable, "0_prepare_data.py", "--data-root", str(data), "--model",
                        "efficientnet_lite0", "--calib-fraction", "0.34"], cwd=ROOT,
                       env=tiny_stage0, capture_output=True, text=True, preexec_fn=limit,
                       timeout=600)
    assert p.returncode == 1, p.stderr
    assert "cannot write" in p.stderr and ".npz: the file size limit is exceeded" in p.stderr
    assert "Traceback" not in p.stderr
    assert (tmp_path / "a" / "splits.json").read_text() == before
    assert not list((tmp_path / "a").rglob(".tmp-*"))


@pytest.mark.parametrize("where", ["file", "sys"])
def test_unwritable_results_folder_fails_before_the_long_work(tmp_path, where):
    (tmp_path / "f").write_text("a file")
    bad = tmp_path / "f" / "results" if where == "file" else Path("/sys/no_results_here")
    env = dict(_env(tmp_path), RESULTS=str(bad))
    p = run_stage(["0_prepare_data.py", "--model", "efficientnet_lite0"], env, check=False)
    assert p.returncode == 1 and f"cannot create {bad}" in p.stderr, p.stderr
    assert "preprocess" not in p.stderr  # refused before decoding any image
    assert not (tmp_path / "a" / "splits.json").exists()


def test_unsafe_tag_is_refused_and_nothing_is_written_outside(tmp_path, monkeypatch):
    monkeypatch.setenv("RESULTS", str(tmp_path / "results"))
    for bad in ("../../x", "a/b", "..", ".hidden", "", "x y"):
        with pytest.raises(UsageError, match="not a plain name"):
            write_result("efficientnet_lite0", bad, {"status": "ok"})
    assert not list(tmp_path.rglob("*.json"))
    assert safe_name("ort_int8_hp32") == "ort_int8_hp32"


# ------------------------------------------------------------------------------- models
def raising_factory():
    raise RuntimeError("the factory broke on purpose")


def tiny_net():
    import torch

    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())


def other_net():
    import torch

    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_factory_that_raises_is_named():
    with pytest.raises(StageError, match=r"factory tests\.test_reliability_data\."
                                                r"raising_factory\(\) raised RuntimeError"):
        build_model("tests.test_reliability_data:raising_factory")


def test_negative_or_zero_input_shape_is_a_usage_error():
    for bad in ("x:1,-3,224,224", "x:0,3"):
        with pytest.raises(UsageError, match="every dimension must be >= 1"):
            parse_input_shapes([bad])


def test_weights_folder_is_a_usage_error(tmp_path):
    (tmp_path / "model.pth").write_bytes(b"")
    with pytest.raises(UsageError, match=r"is a folder.*found there: model\.pth"):
        build_model("tests.test_reliability_data:tiny_net", weights=tmp_path)


def test_state_dict_of_another_architecture_custom_and_torchvision(tmp_path):
    import torch

    ck = tmp_path / "other.pth"
    torch.save(other_net().state_dict(), ck)
    with pytest.raises(StageError, match=r"does not fit --model tests\.test_reliability_data"
                                                r":tiny_net: .*of another shape.*another architecture"):
        build_model("tests.test_reliability_data:tiny_net", weights=ck)
    with pytest.raises(StageError, match=r"does not fit --model mobilenet_v3_small: "
                                                r"\d+ tensors missing"):
        build_model("mobilenet_v3_small", weights=ck)


def test_stage1_cli_messages_for_bad_model_inputs(tmp_path):
    """The same faults through a stage's command line: exit status and no traceback."""
    env = _env(tmp_path)
    base = ["1_pytorch_baseline.py", "--iters", "1", "--warmup", "0"]
    cases = [
        (["--model", "tests.test_reliability_data:raising_factory", "--input-shape", "x:1,3"],
         1, "raised RuntimeError"),
        (["--model", "tests.test_reliability_data:tiny_net", "--input-shape", "x:1,-3,8,8"],
         2, "every dimension must be >= 1"),
        (["--model", "tests.test_reliability_data:tiny_net", "--input-shape", "x:1,3,8,8",
          "--weights", str(tmp_path)], 2, "is a folder"),
    ]
    for extra, rc, msg in cases:
        p = run_stage(base + extra, env, check=False)
        assert p.returncode == rc and msg in p.stderr, (extra, p.stderr[-2000:])
        assert "Traceback" not in p.stderr
