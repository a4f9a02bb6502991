"""TensorRT rules, per-version trtexec command lines and detection, for stages 6 and 7.

The command users type; its subcommands, flags and code live in :mod:`deploykit.tools.trt_tools`
(``python trt_tools.py --help``).
"""
from deploykit.tools.trt_tools import main

if __name__ == "__main__":
    main()
