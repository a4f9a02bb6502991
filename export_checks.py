#!/usr/bin/env python3
"""Export checks: is an ONNX file a faithful, deployable copy of the model, in FP32 and FP16?

The command users type; its subcommands, flags and code live in
:mod:`deploykit.tools.export_checks` (``python export_checks.py --help``).
"""
from deploykit.cli import cli
from deploykit.compat import former_api, former_dir
from deploykit.tools.export_checks import get_args_parser, main

# the functions this file held before the library moved into deploykit/ (import export_checks;
# export_checks.<name>), resolved on first use: deploykit.compat
__getattr__ = former_api("export_checks")
__dir__ = former_dir("export_checks", globals())

if __name__ == "__main__":
    cli(get_args_parser, main)
