#!/usr/bin/env python3
"""The one registry of model variants: every ONNX file the pipeline makes, which stage makes it,
its precision, its ModelOpt recipe, and which stages build or evaluate it by default.

Every stage and script reads this table (``5_quantize.sh`` and ``run_all.sh`` through the
command line below), so a variant is added in one place.

Command line (for the shell scripts)::

    python variants.py list [--stage 5|6|7] [--all] [--auto-precision]
                                                         # names, one per line, pipeline order
    python variants.py describe NAME                     # one-line description
    python variants.py needs-tuning NAME                 # exit 0 if NAME needs the tuning split
    python variants.py modelopt-args NAME --calib C --eps E [--depthwise N ...] [--stem N ...]
                                     [--auto N ...]      # ModelOpt CLI flags, one per line

Tags derived from a variant name ``v``: ORT row ``ort_v``, TensorRT row ``trt_v``, engine build
row ``trt_build_v``, quantization record ``quant_v``; ONNX file ``artifacts/<model>/onnx/v.onnx``,
plan ``artifacts/<model>/engines/v.plan``.


The registry lives in :mod:`deploykit.variants` (this file is its command line).
"""
from deploykit.cli import cli
from deploykit.variants import get_args_parser, main

if __name__ == "__main__":
    cli(get_args_parser, main)
