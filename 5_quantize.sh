#!/usr/bin/env bash
# Stage 5 (INT8 with ModelOpt's ONNX PTQ, one variant per command): 5_quantize.py does the work.
# Usage: 5_quantize.sh [--model M] VARIANT [VARIANT ...] | --default | --all-variants | --list
# (--help lists the variants and the environment it reads: MODEL, EPS, CALIB_BATCH,
# CALIB_STATS_CHECK, AUTO_ARGS; PYTHON is the interpreter, default python).
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/5_quantize.py" "$@"
