#!/usr/bin/env python3
"""Mixed precision chosen for an accuracy budget: which nodes of an INT8 Q/DQ model to keep in

The command users type; its subcommands, flags and code live in
:mod:`deploykit.tools.auto_precision` (``python auto_precision.py --help``).
"""
from deploykit.cli import cli
from deploykit.tools.auto_precision import get_args_parser, main

if __name__ == "__main__":
    cli(get_args_parser, main)
