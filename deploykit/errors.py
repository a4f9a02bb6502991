"""The two error kinds every stage maps to exit codes: :class:`StageError` (runtime, exit 1)
and :class:`UsageError` (bad arguments, exit 2 with the usage line).
"""
from __future__ import annotations




# --------------------------------------------------------------------------------------------
# Errors and CLI wiring
# --------------------------------------------------------------------------------------------
class StageError(RuntimeError):
    """A runtime failure of a stage (missing artifact, backend failure). Exit status 1."""


class UsageError(ValueError):
    """Bad command-line input. Exit status 2, with the usage line and the message."""
