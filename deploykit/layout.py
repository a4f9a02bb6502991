"""Where every artifact and result of a model and variant lives: the one path owner.

``ARTIFACTS``/``RESULTS`` (environment) or ``<repo>/artifacts`` and ``<repo>/results``;
``package.module:factory`` models map to a safe folder name (:func:`model_tag`). The shell asks
this module (``python -m deploykit.layout``) instead of spelling paths.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from deploykit.errors import UsageError
from deploykit.variants import VARIANTS


ROOT = Path(__file__).resolve().parents[1]  # the repository: stages, data/, artifacts/


DEFAULT_DATA = ROOT / "data" / "imagenet-sample-1k"


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
    """File-system-safe name of a model spec (``pkg.mod:factory`` -> ``pkg.mod-factory``).

    Raises:
        UsageError: the name maps to no plain folder name (``..``, ``.``, only punctuation):
            it would point at or above the artifacts folder.
    """
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-")
    if not _SAFE_NAME.match(tag) or ".." in tag:
        raise UsageError(f"--model {model!r}: not a model name (its folder would be {tag!r}); "
                         "use a torchvision/timm name or package.module:factory")
    return tag


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


def check_row_tag(model: str, tag: str, flag: str = "--tag", stage: str | None = None) -> str:
    """Return ``tag`` if ``results/<model>/<tag>.json`` may hold a results row, else raise.

    Besides :func:`safe_name`: a tag ending in ``.failed``/``.skipped`` would be taken for the
    failure kept beside the row ``<tag without it>`` (and deleted by that row's next good run),
    a tag naming a results file that is no row (``data``, ``export``, ``calib``,
    ``quant_<variant>``, a benchmark's output) would replace that file, and, with ``stage``, a
    tag naming a row another stage wrote (its ``stage`` field; e.g. ``3_onnx_eval.py --tag
    pytorch_fp32_cpu`` over the PyTorch reference) would replace that row.

    Args:
        stage: the writing stage's name (``3_onnx_eval``), as its rows' ``stage`` field.
    Raises:
        UsageError: naming the flag, the value, the file it would clash with (and its stage)
            and the fix.
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
    owner = existing.get("stage")
    if stage is not None and isinstance(owner, str) and owner != stage:
        raise UsageError(
            f"{flag} {tag!r}: {path} is a row written by stage {owner} ({existing.get('backend')} "
            f"{existing.get('precision')}), not by {stage}, and would be replaced; choose "
            f"another tag (e.g. {tag}_{stage.split('_', 1)[-1]}), or delete that file first if "
            "it is to go")
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


def result_sidecars(model: str, tag: str) -> list[Path]:
    """The ``<tag>.failed.json`` / ``<tag>.skipped.json`` files that hold a rerun's failure
    beside an earlier good row (:func:`write_result`)."""
    folder = model_results(model)
    return [folder / f"{tag}.{s}.json" for s in ("failed", "skipped")]


# --------------------------------------------------------------------------------------------
# Paths shared by stages 6 and 7
# --------------------------------------------------------------------------------------------
def engines_dir(model: str) -> Path:
    """``artifacts/<model>/engines``."""
    return model_artifacts(model) / "engines"


def engine_paths(model: str, variant: str) -> dict[str, Path]:
    """Plan, build log, layer info, timing cache, converted ONNX and calibration cache paths of
    ``variant``."""
    d = engines_dir(model)
    return {"plan": d / f"{variant}.plan", "log": d / f"{variant}.build.log",
            "layers": d / f"{variant}.layers.json", "cache": d / "timing.cache",
            "opset17": d / f"{variant}.opset17.onnx", "calib": d / f"{variant}.calib.cache"}


def onnx_dir(model: str) -> Path:
    """``artifacts/<model>/onnx``: the exported, converted and quantized ONNX files."""
    return model_artifacts(model) / "onnx"


def fp32_onnx_path(model: str) -> Path:
    """``artifacts/<model>/onnx/fp32.onnx`` (stage 2): the source of every derived file."""
    return onnx_dir(model) / "fp32.onnx"


def calib_path(model: str) -> Path:
    """``artifacts/<model>/calib.npz`` (stage 4): the calibration samples keyed by input name."""
    return model_artifacts(model) / "calib.npz"


def ref_logits_path(model: str) -> Path:
    """``artifacts/<model>/ref_logits.npz`` (stage 1): the PyTorch reference outputs."""
    return model_artifacts(model) / "ref_logits.npz"


def ref_outputs_path(model: str) -> Path:
    """``artifacts/<model>/ref_outputs.npz`` (stage 1, models that are not ImageNet classifiers):
    the inputs (``in:<name>``) and PyTorch outputs (``out:<name>``) every later stage compares
    against."""
    return model_artifacts(model) / "ref_outputs.npz"


def variant_onnx_path(model: str, variant: str) -> Path:
    """``artifacts/<model>/onnx/<file>`` of ``variant``."""
    return onnx_dir(model) / VARIANTS[variant].onnx_file


#: ``python -m deploykit.layout NAME MODEL [VARIANT]``: the shell asks for paths here.
PATHS = {"tag": lambda m: model_tag(m), "artifacts": model_artifacts, "results": model_results,
         "onnx-dir": onnx_dir, "fp32-onnx": fp32_onnx_path, "calib": calib_path,
         "ref-logits": ref_logits_path, "ref-outputs": ref_outputs_path, "engines": engines_dir}


def get_args_parser():
    """``python -m deploykit.layout NAME MODEL [VARIANT]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m deploykit.layout",
        description="Print one artifact or result path of a model (or its folder tag) for the "
                    "shell; ARTIFACTS and RESULTS are read from the environment as every stage "
                    "reads them.",
        epilog="example: python -m deploykit.layout fp32-onnx efficientnet_lite0; "
               "python -m deploykit.layout variant-onnx efficientnet_lite0 int8")
    p.add_argument("name", choices=sorted([*PATHS, "variant-onnx"]), help="which path")
    p.add_argument("model", help="the --model value (a name or package.module:factory)")
    p.add_argument("variant", nargs="?", default=None,
                   help=f"with variant-onnx: one of {', '.join(VARIANTS)}")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the path; a bad name, model or variant is a usage error (exit 2, as argparse).

    Raises:
        SystemExit: 2 on a usage error (argparse's message names the argument).
    """
    p = get_args_parser()
    args = p.parse_args(argv)
    if args.name == "variant-onnx":
        if args.variant not in VARIANTS:
            p.error(f"variant-onnx needs a VARIANT, one of {', '.join(VARIANTS)} "
                    f"(got {args.variant!r})")
        print(variant_onnx_path(args.model, args.variant))
        return 0
    if args.variant is not None:
        p.error(f"{args.name} takes no VARIANT (got {args.variant!r})")
    try:
        print(PATHS[args.name](args.model))
    except UsageError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
