#!/usr/bin/env python3
"""Tools for Q/DQ (QuantizeLinear/DequantizeLinear) ONNX models, used by stages 5 and 5b.

The command users type; its subcommands, flags and code live in
:mod:`deploykit.tools.qdq_tools` (``python qdq_tools.py --help``).
"""
from deploykit.cli import cli
from deploykit.compat import former_api, former_dir
from deploykit.tools.qdq_tools import get_args_parser, main

# the functions this file held before the library moved into deploykit/ (import qdq_tools;
# qdq_tools.<name>), resolved on first use: deploykit.compat
__getattr__ = former_api("qdq_tools")
__dir__ = former_dir("qdq_tools", globals())

if __name__ == "__main__":
    cli(get_args_parser, main)
