"""deploykit.data.images: the embedded sample, listing (flat, class folders, CSV, links, nested),
WNIDs, decoding every PIL mode to RGB and preprocessing."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from deploykit.data.images import (
    imagenet_wnids, LargeImageWarning, list_images, load_image_rgb, normalize, preprocess_image,
)
from deploykit.errors import StageError
from deploykit.layout import DEFAULT_DATA
from deploykit.models import IMAGENET_MEAN, IMAGENET_STD

from tests.helpers.stages import ROOT
from tests.helpers.images import _class_folders


SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))
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


# ----------------------------------------------------------------- data folder: folder links
def _linked_class_folders(tmp_path: Path, n: int = 3) -> tuple[Path, list[Path]]:
    sample = sorted(DEFAULT_DATA.glob("n*.JPEG"))[:n]
    data = tmp_path / "data"
    for f in sample:
        (data / f.name[:9]).mkdir(parents=True)
        (data / f.name[:9] / f.name).symlink_to(f)
    return data, sample


@pytest.mark.parametrize("target", ["root", "other_class", "itself", "parent_of_root"])
def test_folder_link_loops_never_list_images_twice_or_under_another_label(tmp_path, capsys,
                                                                          target):
    """A link inside a class folder back to the data folder (a loop: os.walk follows it until
    ELOOP), to another class or to itself listed every image again under this class's label,
    exit 0; now each folder is listed once and the link is named."""
    data, sample = _linked_class_folders(tmp_path)
    first = data / sample[0].name[:9]
    dest = {"root": "..", "other_class": f"../{sample[1].name[:9]}", "itself": ".",
            "parent_of_root": "../.."}[target]
    (first / "link").symlink_to(dest)
    items, _ = list_images(data, allow_subset=True)
    wnids = imagenet_wnids()
    truth = {f"{f.name[:9]}/{f.name}": wnids.index(f.name[:9]) for f in sample}
    assert dict(items) == truth            # each image once, with its own class's label
    err = capsys.readouterr().err
    assert "folder link(s)" in err and str(first / 'link') in err and "not followed" in err


def test_two_class_folders_that_are_one_folder_are_refused(tmp_path):
    data, sample = _linked_class_folders(tmp_path, 2)
    wnid = imagenet_wnids()[500]
    (data / wnid).symlink_to(data / sample[0].name[:9])
    with pytest.raises(StageError, match=f"{sample[0].name[:9]}, {wnid}|{wnid}, "
                                                f"{sample[0].name[:9]}") as e:
        list_images(data, allow_subset=True)
    assert "two labels" in str(e.value)


# ---------------------------------------------------- EXIF orientation, formats, huge images
def _two_halves(w: int = 64, h: int = 32):
    """An RGB image whose left half is red and right half blue."""
    from PIL import Image

    a = np.zeros((h, w, 3), np.uint8)
    a[:, :w // 2] = (255, 0, 0)
    a[:, w // 2:] = (0, 0, 255)
    return Image.fromarray(a, "RGB")


def test_exif_orientation_is_applied_before_resize_and_crop(tmp_path):
    from PIL import Image

    img = _two_halves()
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation 6: the camera was turned; shown rotated 90 degrees clockwise
    img.save(tmp_path / "sideways.jpg", exif=exif.tobytes(), quality=95)
    img.save(tmp_path / "plain.jpg", quality=95)
    up = load_image_rgb(tmp_path / "sideways.jpg")
    assert up.size == (32, 64)  # portrait, as shown
    a = np.asarray(up).astype(int)
    assert a[2, 16, 0] > 200 and a[2, 16, 2] < 60     # top: red
    assert a[-3, 16, 2] > 200 and a[-3, 16, 0] < 60   # bottom: blue
    x = preprocess_image(up, 32, 32, "bilinear")
    assert x[0, 2, 16] > 200 and x[2, -3, 16] > 200
    assert load_image_rgb(tmp_path / "plain.jpg").size == (64, 32)


def test_unread_image_formats_are_counted_and_named(tmp_path):
    from PIL import Image

    data = _class_folders(tmp_path / "data", SAMPLE[:2])
    d = data / SAMPLE[0].name[:9]
    _two_halves().save(d / "a.gif")       # read (first frame)
    _two_halves().save(d / "b.jpe", format="JPEG")  # read
    (d / "c.heic").write_bytes(b"\0\0\0\x18ftypheic")  # not read
    (data / SAMPLE[1].name[:9] / "d.svg").write_text("<svg/>")
    unread: list[str] = []
    items, _ = list_images(data, allow_subset=True, unread=unread)
    names = [Path(p).name for p, _ in items]
    assert "a.gif" in names and "b.jpe" in names and len(items) == 4
    assert unread == [f"{SAMPLE[0].name[:9]}/c.heic", f"{SAMPLE[1].name[:9]}/d.svg"]
    assert load_image_rgb(d / "a.gif").size == (64, 32)
    # a folder holding only unread formats: the error counts and names them
    only = tmp_path / "only"
    only.mkdir()
    (only / "x.heic").write_bytes(b"x")
    with pytest.raises(StageError, match=r"1 file\(s\) in a format not read \(1 \.heic, first: "
                                         r"x\.heic\): convert them to JPEG or PNG"):
        list_images(only)


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG whose IHDR says ``w`` x ``h`` (8-bit RGB) and whose pixel data is empty."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_decompression_bomb_header_is_refused_with_its_pixel_count(tmp_path):
    from deploykit.data.splits import preprocess_items

    (tmp_path / "bomb.png").write_bytes(_png_header_only(30000, 30000))
    x, good, bad = preprocess_items(tmp_path, [("bomb.png", 0)],
                                    {"resize": 32, "crop": 32, "interpolation": "bilinear"})
    assert not good and x.shape[0] == 0
    assert bad[0][0] == "bomb.png" and "900000000 pixels" in bad[0][1]


def test_huge_jpeg_is_decoded_in_draft_mode(tmp_path, monkeypatch):
    from PIL import Image

    _two_halves(4096, 2048).save(tmp_path / "big.jpg", quality=90)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4096 * 2048 - 1)
    with pytest.warns(LargeImageWarning, match=r"big\.jpg: 4096x2048 px .*decoded at 2048x1024 "
                                               r"\(JPEG draft mode\)"):
        img = load_image_rgb(tmp_path / "big.jpg")
    assert img.size == (2048, 1024)


def test_strip_images_are_center_cropped_before_the_resize(monkeypatch):
    import torchvision.transforms.v2.functional as F
    from PIL import Image

    seen = []
    real = F.resize
    monkeypatch.setattr(F, "resize", lambda img, *a, **k: seen.append(img.size) or real(img, *a, **k))
    for size in ((8000, 1), (1, 8000), (8000, 3)):
        x = preprocess_image(Image.new("RGB", size, (9, 8, 7)), 256, 224, "bilinear")
        assert x.shape == (3, 224, 224) and (x[:, 112, 112] == (9, 8, 7)).all()
    assert seen == [(4, 1), (1, 4), (12, 3)]
    # an ordinary photo is untouched (torchvision's preprocessing, bit for bit)
    seen.clear()
    preprocess_image(Image.new("RGB", (500, 375)), 256, 224, "bilinear")
    assert seen == [(500, 375)]


# ------------------------------------------------------------- labels CSV as editors save it
_ROWS = ["ImageId,PredictionString", "ILSVRC2012_val_00000001,n01440764 1 2 3 4",
         "ILSVRC2012_val_00000002,n01443537 1 2 3 4", "ILSVRC2012_val_00000003,n01484850 1 2 3 4"]


@pytest.mark.parametrize("encode", [
    lambda rows: ("\r\n".join(rows) + "\r\n").encode("utf-8-sig"),               # Excel: BOM+CRLF
    lambda rows: ("\n".join(rows)).encode("utf-8-sig"),                          # BOM, no last EOL
    lambda rows: "\r\n".join(rows[1:]).encode("utf-8-sig"),                      # BOM, no header
    lambda rows: "\r\n".join(",".join(f'"{c}"' for c in r.split(",")) + ",,"
                             for r in rows).encode(),                            # quoted, empty cols
    lambda rows: "\n".join(r.replace("val_00000002,", "val_00000002.JPEG,")
                           for r in rows).encode(),                              # id with suffix
])
def test_labels_csv_with_bom_crlf_quotes_is_read(tmp_path, encode):
    val = _flat_csv(tmp_path, [])
    (tmp_path / "LOC_val_solution.csv").write_bytes(encode(_ROWS))
    items, layout = list_images(val, allow_subset=True)
    assert layout == "flat+csv" and [c for _, c in items] == [0, 1, 2]


@pytest.mark.parametrize("rows, message", [
    (_ROWS[:2] + ["ILSVRC2012_val_00000002,n01443537 1 2,extra"] + _ROWS[3:],
     r"line 3: malformed line 'ILSVRC2012_val_00000002,n01443537 1 2,extra' \(3 field\(s\), "
     r"2 expected\): fix or delete that line"),
    (_ROWS[:3] + [",n01484850 1 2 3 4"], r"line 4: malformed line ',n01484850"),
    (_ROWS[:3] + ["ILSVRC2012_val_00000003,"], r"line 4: malformed line"),
])
def test_malformed_labels_csv_rows_are_named_by_line(tmp_path, rows, message):
    val = _flat_csv(tmp_path, [])
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_bytes("\r\n".join(rows).encode("utf-8-sig"))
    with pytest.raises(StageError, match=message):
        list_images(val, allow_subset=True)
    assert csv.read_bytes() == "\r\n".join(rows).encode("utf-8-sig")


def test_labels_csv_not_utf8_or_a_fifo_is_named(tmp_path):
    import os

    val = _flat_csv(tmp_path, [])
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_bytes("\n".join(_ROWS[:2] + ["ILSVRC2012_val_00000002,n01443537 é"]).encode("latin-1"))
    with pytest.raises(StageError, match=r"LOC_val_solution\.csv, line 3: not UTF-8 text .*: "
                                         r"save the file as UTF-8"):
        list_images(val, allow_subset=True)
    fifo = tmp_path / "labels.csv"
    os.mkfifo(fifo)
    with pytest.raises(StageError, match=r"--labels-csv .*labels\.csv is a FIFO \(named pipe\)"):
        list_images(val, labels_csv=fifo, allow_subset=True)


@pytest.mark.parametrize("mean, std", [((0.5,) * 3, (0.5,) * 3), (IMAGENET_MEAN, IMAGENET_STD)])
def test_normalize_gives_the_bits_of_the_float32_expression(mean, std):
    """normalize computes in place: every uint8 value of every channel, in a contiguous and a
    strided array, gives the bits of ``(x.astype(float32) / 255 - mean) / std``; a one-channel
    array still broadcasts to the three channels."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16), (1, 3, 16, 16)),
                        rng.integers(0, 256, (3, 3, 16, 16), dtype=np.uint8)])
    m = np.asarray(mean, np.float32).reshape(1, 3, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, 3, 1, 1)
    for a in (x, x[:, :, ::2, ::3]):
        want = (a.astype(np.float32) / 255.0 - m) / s
        got = normalize(a, mean, std)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes()
    one = normalize(x[:, :1], mean, std)
    assert one.shape == x.shape and one.tobytes() == ((x[:, :1].astype(np.float32) / 255.0 - m)
                                                      / s).tobytes()
