#!/usr/bin/env python3
"""Mixed precision chosen for an accuracy budget: which nodes of an INT8 Q/DQ model to keep in

The command users type; its subcommands, flags and code live in
:mod:`deploykit.tools.auto_precision` (``python auto_precision.py --help``).
"""
from deploykit.cli import cli
from deploykit.compat import former_api, former_dir
from deploykit.tools.auto_precision import get_args_parser, main

# the functions this file held before the library moved into deploykit/ (import auto_precision;
# auto_precision.<name>), resolved on first use: deploykit.compat
__getattr__ = former_api("auto_precision")
__dir__ = former_dir("auto_precision", globals())

if __name__ == "__main__":
    cli(get_args_parser, main)
