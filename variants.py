#!/usr/bin/env python3
"""The command line of the one registry of model variants (list, describe, needs-tuning,
modelopt-args).

The command users type; its subcommands, flags and code live in :mod:`deploykit.variants`
(``python variants.py --help``).
"""
from deploykit.cli import cli
from deploykit.variants import get_args_parser, main

if __name__ == "__main__":
    cli(get_args_parser, main)
