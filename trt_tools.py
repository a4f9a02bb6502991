"""TensorRT rules, per-version trtexec command lines and detection, for stages 6 and 7.

The command users type; its subcommands, flags and code live in :mod:`deploykit.tools.trt_tools`
(``python trt_tools.py --help``).
"""
from deploykit.compat import former_api, former_dir
from deploykit.tools.trt_tools import main

# the functions this file held before the library moved into deploykit/ (import trt_tools;
# trt_tools.<name>), resolved on first use: deploykit.compat
__getattr__ = former_api("trt_tools")
__dir__ = former_dir("trt_tools", globals())

if __name__ == "__main__":
    main()
