#!/usr/bin/env python3
"""The command line of the one registry of model variants (list, describe, needs-tuning,
modelopt-args): ``5_quantize.sh`` and ``run_all.sh`` take variant names, row tags and ModelOpt
flags from it. The registry itself is :mod:`deploykit.variants` (``python variants.py --help``).
"""

from __future__ import annotations

import argparse
import sys

from deploykit.cli import HelpFormatter, cli, stage_parser
from deploykit.errors import UsageError
from deploykit.variants import VARIANTS, for_stage, get_variant, modelopt_args


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__, prog="variants.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("list", help="variant names, one per line, in pipeline order",
                        formatter_class=HelpFormatter)
    sp.add_argument("--stage", type=int, choices=(3, 5, 6, 7), default=None,
                    help="only the variants this stage handles (default: all variants)")
    sp.add_argument("--all", action="store_true",
                    help="with --stage: include the ablations and failure reproductions")
    sp.add_argument("--auto-precision", action="store_true",
                    help="include the variants that need a tuning split (int8_auto)")
    sp.add_argument("--with", dest="fields", action="append", default=[],
                    choices=("onnx_file", "ort_tag", "trt_tag", "build_tag", "precision"),
                    help="print these fields after the name, tab-separated (repeatable): "
                         "run_all.sh takes row tags and file names from here")
    sp = sub.add_parser("describe", help="one-line description of a variant",
                        formatter_class=HelpFormatter)
    sp.add_argument("name", help="variant name")
    sp = sub.add_parser("needs-tuning", help="exit 0 if the variant needs a tuning split "
                        "(made by the mixed-precision search), 1 if not",
                        formatter_class=HelpFormatter)
    sp.add_argument("name", help="variant name")
    sp = sub.add_parser("modelopt-args", help="ModelOpt CLI flags of a stage-5 variant",
                        formatter_class=HelpFormatter)
    sp.add_argument("name", help="variant name")
    sp.add_argument("--calib", required=True, help="calibration npz (--calibration_data_path)")
    sp.add_argument("--eps", required=True, help="calibration EP (--calibration_eps)")
    sp.add_argument("--depthwise", nargs="*", default=[],
                    help="anchored depthwise-conv node regexes (qdq_tools.py list-depthwise)")
    sp.add_argument("--stem", nargs="*", default=[],
                    help="anchored stem-conv node regex (qdq_tools.py list-stem)")
    sp.add_argument("--auto", nargs="*", default=[],
                    help="anchored regexes of the nodes the mixed-precision search keeps in "
                         "float (auto_precision.py search)")
    return p


def main(args: argparse.Namespace) -> None:
    try:
        if args.cmd == "list":
            vs = (VARIANTS.values() if args.stage is None
                  else for_stage(args.stage, args.all, args.auto_precision))
            print("\n".join("\t".join([v.name, *(str(getattr(v, f)) for f in args.fields)])
                            for v in vs))
        elif args.cmd == "describe":
            print(get_variant(args.name).description)
        elif args.cmd == "needs-tuning":
            sys.exit(0 if get_variant(args.name).needs_tuning else 1)
        else:
            print("\n".join(modelopt_args(args.name, args.calib, args.eps, args.depthwise,
                                          args.stem, args.auto)))
    except (KeyError, ValueError) as e:
        raise UsageError(str(e).strip("'\"")) from e


if __name__ == "__main__":
    cli(get_args_parser, main)
