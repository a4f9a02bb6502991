"""Layer-wise parity: which layer of a deployed model first disagrees with the reference?

The command users type; its subcommands, flags and code live in
:mod:`deploykit.tools.layerwise` (``python layerwise.py --help``).
"""
from deploykit.cli import cli
from deploykit.compat import former_api, former_dir
from deploykit.tools.layerwise import cli_main, get_args_parser

# the functions this file held before the library moved into deploykit/ (import layerwise;
# layerwise.<name>), resolved on first use: deploykit.compat
__getattr__ = former_api("layerwise")
__dir__ = former_dir("layerwise", globals())

if __name__ == "__main__":
    cli(get_args_parser, cli_main)
