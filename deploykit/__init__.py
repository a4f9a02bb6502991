"""deploykit: the library behind the numbered stages, one concern per module.

The stages at the repository root (``0_prepare_data.py`` ... ``8_report.py``) and the tool
commands (``qdq_tools.py``, ``layerwise.py``, ``export_checks.py``, ``auto_precision.py``,
``trt_tools.py``) are thin: argument parsing and ``main`` over calls into this package.
The package never imports a root script.
"""
