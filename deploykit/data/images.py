"""Image files: listing a folder (ImageNet WNID folders or a labels CSV), decoding to RGB8,
resize + center crop (uint8 ``[3, H, W]``) and per-model normalisation to float32.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.errors import StageError
from deploykit.layout import DEFAULT_DATA
from deploykit.io import check_regular_file


# --------------------------------------------------------------------------------------------
# Data: listing, loading, preprocessing, splits, cache
# --------------------------------------------------------------------------------------------
# Suffixes read (Pillow decodes all of them without plugins; a GIF contributes its first frame).
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".jpe", ".jfif", ".png", ".bmp", ".webp", ".tif", ".tiff",
                  ".gif", ".ppm", ".pgm", ".pbm", ".pnm", ".tga"}
# Image suffixes not read (no decoder without plugins, or not reliable: multi-image, vector,
# camera raw, HDR): such files are counted and named by the data stage, never silently skipped.
UNREAD_IMAGE_SUFFIXES = {".heic", ".heif", ".avif", ".jxl", ".jp2", ".j2k", ".jpx", ".svg",
                         ".psd", ".ico", ".icns", ".dds", ".exr", ".hdr", ".raw", ".dng", ".cr2",
                         ".cr3", ".nef", ".arw", ".orf", ".rw2", ".raf", ".pcx", ".xcf",
                         ".jpg2", ".pic", ".sgi", ".eps", ".apng"}

# An image whose long side exceeds this many times its short side is center-cropped to that
# ratio before the resize (the evaluation crop is square and central, so nothing it uses is
# lost): resizing an 8000x1 strip to a 256-pixel short side would allocate 2048000x256 pixels.
MAX_ASPECT = 4
# JPEGs above Pillow's MAX_IMAGE_PIXELS are decoded at a reduced DCT scale (draft mode) whose
# short side stays at least this many pixels (above every model's resize).
DRAFT_MIN_SIDE = 1024


_WNID = re.compile(r"^n\d{8}$")


SUBSET_FLAG = "--allow-class-subset (run_all.sh: ALLOW_CLASS_SUBSET=1)"


@functools.lru_cache(maxsize=1)
def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ImageNet-1k WNIDs in class-index order.

    Source: timm's ImageNet-1k synset list (``timm/data/_info/imagenet_synsets.txt``, the file
    behind ``timm.data.ImageNetInfo("imagenet-1k").label_names()``, timm >= 0.9), read directly
    because importing timm takes seconds; ``ImageNetInfo`` when the file is not where expected.
    The order is the sorted WNID order that torchvision's ``ImageFolder`` gives ImageNet and
    that the torchvision/timm ImageNet weights are trained with: class index = position here.
    """
    import importlib.util

    spec = importlib.util.find_spec("timm")
    txt = (Path(spec.submodule_search_locations[0]) / "data" / "_info" / "imagenet_synsets.txt"
           if spec and spec.submodule_search_locations else None)
    if txt is not None and txt.is_file():
        wnids = tuple(w.strip() for w in txt.read_text().splitlines() if w.strip())
    else:
        from timm.data import ImageNetInfo

        wnids = tuple(ImageNetInfo("imagenet-1k").label_names())
    if len(wnids) != 1000:  # a broken timm install; nothing could be labelled
        raise StageError(f"timm's ImageNet-1k synset list has {len(wnids)} entries, not 1000")
    return wnids


def _dir_key(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the folder ``path`` leads to (links followed), None if unreadable."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _images_under(folder: Path, seen: set | None = None, repeats: list | None = None,
                  unread: list | None = None) -> list[Path]:
    """Image files anywhere below ``folder`` (links followed, hidden names skipped), sorted;
    torchvision ``ImageFolder``'s walk (``os.walk(followlinks=True)``) except that a folder is
    entered once: a link back to an enclosing folder (a loop) or to a folder already listed
    would list its images again, under this folder's class (``os.walk`` does not track loops).

    Args:
        seen: ``(st_dev, st_ino)`` of the folders already listed (shared between calls;
            updated). repeats: receives each link not followed, as ``(link, real folder)``.
        unread: receives the files with a suffix of :data:`UNREAD_IMAGE_SUFFIXES`.
    Raises:
        StageError: a folder below ``folder`` cannot be listed (permissions): its class would
            drop out unseen (``os.walk`` skips such folders silently).
    """
    seen = set() if seen is None else seen
    key = _dir_key(folder)
    if key is not None:
        seen.add(key)
    out = []

    def cannot_list(e: OSError) -> None:
        raise StageError(f"cannot list {e.filename} ({e.strerror}): its images would be left "
                         "out without a word; make it readable (chmod -R u+rX) or move it out "
                         "of the data folder")

    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True, onerror=cannot_list):
        keep = []
        for d in dirnames:
            if d.startswith("."):
                continue
            key = _dir_key(Path(dirpath) / d)
            if key in seen:
                if repeats is not None:
                    repeats.append((Path(dirpath) / d, (Path(dirpath) / d).resolve()))
                continue
            if key is not None:
                seen.add(key)
            keep.append(d)
        dirnames[:] = keep
        out += [Path(dirpath) / f for f in filenames
                if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_SUFFIXES]
        if unread is not None:
            unread += [Path(dirpath) / f for f in filenames if not f.startswith(".")
                       and Path(f).suffix.lower() in UNREAD_IMAGE_SUFFIXES]
    return sorted(out)


def _read_labels_csv(csv: Path, known: dict[str, int]) -> dict[str, str]:
    """``{ImageId: WNID}`` of a ``LOC_val_solution.csv`` (``ImageId,WNID x0 y0 x1 y1 ...``).

    Read as a spreadsheet or Windows editor may have saved it: UTF-8 with or without a byte
    order mark (``utf-8-sig``), LF or CRLF line ends, fields quoted or not, an ImageId written
    with its file suffix (``ILSVRC2012_val_00000001.JPEG``).

    Raises:
        StageError: not a regular file (FIFO, device), unreadable, not UTF-8, or a malformed
            line / unknown WNID / conflicting label, named by line number.
    """
    import csv as csv_mod


    check_regular_file(csv, "--labels-csv")
    try:
        text = csv.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise StageError(f"cannot read --labels-csv {csv}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        line = csv.read_bytes()[:e.start].count(b"\n") + 1
        raise StageError(f"{csv}, line {line}: not UTF-8 text ({e.reason} at byte {e.start}): "
                         "save the file as UTF-8 (or plain ASCII)") from e
    fix = ("fix or delete that line (format: 'ImageId,WNID x_min y_min x_max y_max ...', "
           "as in ImageNet's LOC_val_solution.csv), or pass --labels-csv another file")
    gt: dict[str, str] = {}
    reader = csv_mod.reader(text.splitlines(), skipinitialspace=True)
    try:
        rows = [(reader.line_num, row) for row in reader]
    except csv_mod.Error as e:
        raise StageError(f"{csv}, line {reader.line_num}: malformed CSV ({e}): {fix}") from e
    for n, row in rows:
        while len(row) > 2 and not row[-1].strip():
            row = row[:-1]  # trailing commas (a spreadsheet's empty columns)
        line = ",".join(row)
        if not line.strip() or (n == 1 and line.replace(" ", "").lower().startswith("imageid,")):
            continue  # blank line or the header "ImageId,PredictionString"
        image_id = row[0].strip()
        if Path(image_id).suffix.lower() in IMAGE_SUFFIXES:
            image_id = Path(image_id).stem
        tokens = row[1].split() if len(row) == 2 else []
        if len(row) != 2 or not image_id or not tokens:
            raise StageError(f"{csv}, line {n}: malformed line {line[:100]!r} ({len(row)} "
                             f"field(s), 2 expected): {fix}")
        if tokens[0] not in known:
            raise StageError(f"{csv}, line {n}: {tokens[0]!r} is not one of the 1000 ImageNet "
                             f"WNIDs (line {line[:100]!r}): {fix}")
        if gt.get(image_id, tokens[0]) != tokens[0]:
            raise StageError(f"{csv}, line {n}: {image_id} is labelled {gt[image_id]} earlier "
                             f"and {tokens[0]} here: keep one label per image")
        gt[image_id] = tokens[0]
    return gt


def list_images(root: Path | str, labels_csv: Path | str | None = None,
                allow_subset: bool = False, unread: list | None = None
                ) -> tuple[list[tuple[str, int]], str]:
    """List labelled images under ``root``, every label checked against the 1000 ImageNet WNIDs.

    Layouts (class index = position of the WNID in :func:`imagenet_wnids`, never in the list
    of folders present, so a subset or an extra folder cannot shift labels):
    - ``root/<WNID>/**/*.JPEG`` (class folders, as torchvision's ImageFolder; images may sit in
      subfolders of a class folder).
    - flat ``root/*.JPEG`` with the ground-truth CSV ``LOC_val_solution.csv``
      (``ImageId,PredictionString`` whose first token is the WNID), found in ``root`` or its
      parent, or given as ``labels_csv``.
    - flat files named ``<WNID>_<anything>.JPEG`` (the embedded one-per-class sample).
    Names starting with ``.`` are skipped.

    Args:
        allow_subset: accept data that covers only some of the 1000 classes.
        unread: receives (sorted, relative to ``root``) the files that look like images but
            have a suffix this pipeline does not read (:data:`UNREAD_IMAGE_SUFFIXES`): the
            caller reports them.
    Returns:
        ``([(path relative to root, class index)], layout)`` sorted by path.
    Raises:
        StageError: missing/empty folder, class folders one level deeper than ``root``, a folder
            or file name that is not an ImageNet WNID, a malformed CSV line (named by line
            number), or missing classes without ``allow_subset`` (the message names the flag).
    """
    root = Path(root)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise StageError(f"data folder {root} {what} (set VAL_ROOT to the ImageNet val folder, "
                         f"or unset it to use the embedded sample {DEFAULT_DATA})")
    known = {w: i for i, w in enumerate(imagenet_wnids())}
    dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = sorted(f for f in root.iterdir() if f.is_file() and not f.name.startswith(".")
                   and f.suffix.lower() in IMAGE_SUFFIXES)
    skipped = sorted(f for f in root.iterdir() if f.is_file() and not f.name.startswith(".")
                     and f.suffix.lower() in UNREAD_IMAGE_SUFFIXES)
    items: list[tuple[str, str]] = []
    if any(_WNID.match(d.name) for d in dirs):
        layout = "class-folders"
        # Each folder is listed once: the class folders (and the data folder) are known before
        # the walk, so a link inside a class folder to another class, to the data folder or to
        # itself is not followed (its images would be listed again under the wrong class).
        seen = {k for k in map(_dir_key, [root, *dirs]) if k is not None}
        same = {}
        for d in dirs:
            same.setdefault(_dir_key(d), []).append(d)
        twice = [ds for k, ds in same.items() if k is not None and len(ds) > 1]
        if twice:
            raise StageError(f"{root}: class folders {', '.join(d.name for d in twice[0])} are "
                             f"the same folder ({twice[0][0].resolve()}), so its images would "
                             "get two labels: remove the link(s) that make them one")
        repeats: list[tuple[Path, Path]] = []
        per_dir = {d: _images_under(d, seen, repeats, skipped) for d in dirs}
        if repeats:
            link, real = repeats[0]
            print(f"WARNING: {len(repeats)} folder link(s) in {root} lead to a folder listed "
                  f"already (a loop or a second way in; first: {link} -> {real}): not "
                  "followed, so no image is listed twice or under another class's label; "
                  "remove the link(s)", file=sys.stderr)
        unknown = [d for d in dirs if d.name not in known and per_dir[d]]
        if unknown:
            listed = ", ".join(f"{d.name} ({len(per_dir[d])} images)" for d in unknown[:5])
            raise StageError(
                f"{root}: {len(unknown)} class folder(s) are not ImageNet WNIDs: {listed}"
                f"{' ...' if len(unknown) > 5 else ''}. Labels come from the folder name, so "
                "rename each to its WNID (e.g. n01440764) or move it out of the data folder")
        for d in dirs:
            if d.name in known:
                items += [(f.relative_to(root).as_posix(), d.name) for f in per_dir[d]]
        if files:
            print(f"WARNING: {len(files)} image(s) directly in {root} (first: {files[0].name}) "
                  "are outside any class folder: ignored", file=sys.stderr)
    elif not files:
        deeper = [d for d in dirs if any(s.is_dir() and _WNID.match(s.name)
                                         for s in d.iterdir())]
        if deeper:
            raise StageError(f"no images directly in {root}, but {deeper[0]} holds class "
                             f"folders (<WNID>/): use --data-root {deeper[0]} "
                             f"(VAL_ROOT={deeper[0]})")
        raise StageError(f"no images in {root} (looked for {sorted(IMAGE_SUFFIXES)} files and "
                         "<WNID>/ class folders)" + (
                             f"; {len(skipped)} file(s) in a format not read "
                             f"({_suffix_counts(skipped)}, first: {skipped[0].name}): convert "
                             "them to JPEG or PNG" if skipped else ""))
    else:
        csv = Path(labels_csv) if labels_csv else None
        if csv is None:
            for cand in (root / "LOC_val_solution.csv", root.parent / "LOC_val_solution.csv"):
                if cand.exists():
                    csv = cand
                    break
        if csv is not None:
            layout = "flat+csv"
            gt = _read_labels_csv(csv, known)
            missing = [f.name for f in files if f.stem not in gt]
            if missing:
                raise StageError(f"{len(missing)} images of {root} have no row in {csv} "
                                 f"(first: {missing[0]})")
            items = [(f.name, gt[f.stem]) for f in files]
        elif all(_WNID.match(f.name[:9]) for f in files):
            layout = "flat-wnid-prefix"
            bad = [f.name for f in files if f.name[:9] not in known]
            if bad:
                raise StageError(f"{root}: {len(bad)} file name(s) start with a WNID that is not "
                                 f"one of the 1000 ImageNet classes (first: {bad[0]}): rename "
                                 "them <WNID>_*.JPEG with the image's real WNID, or remove them")
            items = [(f.name, f.name[:9]) for f in files]
        else:
            odd = [f.name for f in files if not _WNID.match(f.name[:9])]
            raise StageError(
                f"cannot label the images in {root} ({len(odd)} of {len(files)} names do not "
                f"start with a WNID, first: {odd[0]}): use class folders <WNID>/*.JPEG, put "
                "LOC_val_solution.csv beside them, or name files <WNID>_*.JPEG")
    if unread is not None:
        unread += sorted(f.relative_to(root).as_posix() for f in skipped)
    if not items:
        raise StageError(f"no images in the class folders of {root}")
    present = {w for _, w in items}
    if len(present) < len(known) and not allow_subset:
        absent = [w for w in known if w not in present]
        raise StageError(
            f"{root}: images for {len(present)} of the 1000 ImageNet classes ({len(absent)} "
            f"missing, first: {', '.join(absent[:3])}). Labels are positions in the full "
            f"1000-WNID list, so a subset is labelled correctly: pass {SUBSET_FLAG} to "
            "evaluate on the classes present")
    return sorted((p, known[w]) for p, w in items), layout


def _suffix_counts(files: Sequence[Path | str]) -> str:
    """``"3 .heic, 1 .svg"``: how many of ``files`` have each suffix."""
    counts: dict[str, int] = {}
    for f in files:
        counts[Path(f).suffix.lower()] = counts.get(Path(f).suffix.lower(), 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def unread_summary(root: Path | str, unread: Sequence[str]) -> str:
    """One line for the data stage's output naming the files :func:`list_images` did not
    read (count per suffix, the first five names) and the fix."""
    names = ", ".join(str(f) for f in unread[:5]) + (" ..." if len(unread) > 5 else "")
    return (f"{len(unread)} file(s) in {root} have an image suffix this pipeline does not read "
            f"({_suffix_counts(unread)}): not used: {names}; convert them to JPEG or PNG "
            f"(read: {' '.join(sorted(IMAGE_SUFFIXES))})")


class LargeImageWarning(UserWarning):
    """An image above Pillow's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``)."""


# Modes whose pixels are not 8-bit: full-scale value -> 255. "I;16*" are 16-bit (PNG/TIFF);
# "I" (32-bit int) and "F" (float) carry no bit depth, so the scale is read from the data.
_16BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")


def _full_scale(mode: str, a: np.ndarray) -> float:
    """Value that maps to 255: 65535 for 16-bit modes; for ``I``/``F`` the smallest of
    1.0 (float images in [0, 1]), 255, 65535 that holds the data's maximum, else the maximum."""
    if mode in _16BIT_MODES:
        return 65535.0
    hi = float(np.nanmax(a)) if a.size else 0.0
    for scale in ((1.0,) if mode == "F" else ()) + (255.0, 65535.0):
        if hi <= scale:
            return scale
    return hi


def to_rgb8(im):
    """Convert a loaded PIL image of any common mode to an 8-bit RGB PIL image with its real
    contents.

    Pillow's ``convert("RGB")`` clips 16-bit and 32-bit values to 255 (a 16-bit PNG turns white)
    and drops alpha, keeping whatever colour transparent pixels happen to store. Here:
    - ``I;16*`` (16-bit gray), ``I`` (32-bit int), ``F`` (float): scaled by :func:`_full_scale`
      to 0..255 (rounded, negatives and NaN to 0), then gray -> RGB;
    - modes with alpha (``RGBA``, ``LA``, ``PA``, ``RGBa``, ``La``) and palette images with a
      transparent colour: composited over white, as the image shows on a white page;
    - ``CMYK``: Pillow's conversion (R = (255 - C)(255 - K) / 255, no ICC colour management);
    - ``P``, ``L``, ``1``, ``YCbCr``, ``RGBX``, ...: ``convert("RGB")``. 16-bit-per-channel RGB
      PNGs are decoded by Pillow to 8 bits (high byte) already.

    Raises:
        ValueError: a mode Pillow cannot convert to RGB (named).
    """
    from PIL import Image

    mode = im.mode
    if mode in _16BIT_MODES or mode in ("I", "F"):
        a = np.asarray(im, dtype=np.float64)
        a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
        g = np.clip(np.rint(a * (255.0 / _full_scale(mode, a))), 0, 255).astype(np.uint8)
        return Image.fromarray(g, "L").convert("RGB")
    if mode == "P" and "transparency" in im.info:
        im, mode = im.convert("RGBA"), "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        return im.convert("RGB")
    except ValueError as e:
        raise ValueError(f"image mode {mode} cannot be converted to RGB ({e}): save the image "
                         "as 8-bit RGB") from e


def load_image_rgb(path: Path | str):
    """Open an image as an 8-bit RGB PIL image with its real contents, upright (:func:`to_rgb8`:
    16-bit, 32-bit and float images scaled, alpha composited over white, grayscale, CMYK,
    palette and PNG data in a .JPEG file converted).

    The EXIF ``Orientation`` tag is applied (``PIL.ImageOps.exif_transpose``), as image viewers
    and torchvision's ``decode_jpeg(apply_exif_orientation=True)`` do: a phone photo stored
    sideways is seen as taken.

    An image above ``PIL.Image.MAX_IMAGE_PIXELS`` (89.5 MP) is decoded with a
    :class:`LargeImageWarning` naming the file and its size; a JPEG that large is decoded at a
    reduced DCT scale (Pillow's draft mode, short side >= :data:`DRAFT_MIN_SIDE`), so memory
    stays bounded. Above twice the limit, Pillow refuses it before decoding
    (``DecompressionBombError`` with the pixel count), which the caller reports as unreadable.

    Raises:
        OSError, PIL.UnidentifiedImageError, PIL.Image.DecompressionBombError, ValueError:
        unreadable or unconvertible file.
    """
    import warnings

    from PIL import Image, ImageOps

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            w, h = im.size
            big = Image.MAX_IMAGE_PIXELS is not None and w * h > Image.MAX_IMAGE_PIXELS
            if big and im.format == "JPEG" and min(w, h) >= 2 * DRAFT_MIN_SIDE:
                k = min(w, h) // DRAFT_MIN_SIDE  # draft picks a scale 1/2..1/8 keeping >= size
                im.draft(None, (max(1, w // k), max(1, h // k)))
            im.load()
            rgb = to_rgb8(ImageOps.exif_transpose(im))
    for wn in caught:
        if issubclass(wn.category, Image.DecompressionBombWarning):
            warnings.warn(LargeImageWarning(
                f"{path}: {w}x{h} px ({w * h / 1e6:.0f} MP) is above Pillow's MAX_IMAGE_PIXELS "
                f"({Image.MAX_IMAGE_PIXELS / 1e6:.1f} MP): "
                + (f"decoded at {rgb.width}x{rgb.height} (JPEG draft mode)" if
                   (rgb.width, rgb.height) not in ((w, h), (h, w)) else
                   f"decoding it is slow and takes {w * h * 3 / 1e9:.1f} GB")
                + "; downscale it if it is not meant to be that large"), stacklevel=2)
        else:
            warnings.warn_explicit(wn.message, wn.category, wn.filename, wn.lineno)
    return rgb


def preprocess_image(img, resize: int, crop: int, interpolation: str) -> np.ndarray:
    """Resize (short side, antialiased) + center crop, as torchvision's classification
    reference does at evaluation.

    An image whose long side is more than :data:`MAX_ASPECT` times its short side is first
    center-cropped to that ratio (memory stays bounded: an 8000x1 strip would otherwise be
    resized to 2048000x256); the square center crop lies inside what is kept.

    Args:
        img: RGB PIL image.
    Returns:
        uint8 array ``[3, crop, crop]`` (no normalisation; see :func:`normalize`).
    """
    import torchvision.transforms.v2.functional as F
    from torchvision.transforms import InterpolationMode

    mode = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
            "nearest": InterpolationMode.NEAREST}[interpolation]
    w, h = img.size
    short = min(w, h)
    if max(w, h) > MAX_ASPECT * short:  # a strip: keep its center (the crop's source and more)
        keep = MAX_ASPECT * short
        left, top = ((w - keep) // 2, 0) if w > h else (0, (h - keep) // 2)
        img = img.crop((left, top, left + (keep if w > h else w), top + (h if w > h else keep)))
    img = F.resize(img, [resize], interpolation=mode, antialias=True)
    img = F.center_crop(img, [crop, crop])
    return np.asarray(F.pil_to_tensor(img), dtype=np.uint8)


def normalize(x_u8: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 ``[N, 3, H, W]`` -> float32 ``(x / 255 - mean) / std``, same shape.

    Computed in place in one float32 array (the same operations in the same order, so the
    same bits as the expression; 900 Lite0 images 0.12 s against 0.40 s with a temporary per
    operation, on the 2-core Intel Xeon of benchmarks/README.md, stop 45).
    """
    m = np.asarray(mean, np.float32).reshape(1, 3, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, 3, 1, 1)
    x = np.asarray(x_u8)
    if np.broadcast_shapes(x.shape, m.shape) != x.shape:  # e.g. one channel: broadcast
        return (x.astype(np.float32) / 255.0 - m) / s
    x = x.astype(np.float32)
    x /= np.float32(255.0)
    x -= m
    x /= s
    return x
