#!/usr/bin/env bash
# Stage 6 (build TensorRT engines): a wrapper that runs 6_build_engines.py with the project's
# Python ($PYTHON, else .venv/bin/python, else python3); see `bash 6_build_engines.sh --help`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x "$here/.venv/bin/python" ]; then py="$here/.venv/bin/python"; else py="python3"; fi
exec "$py" "$here/6_build_engines.py" "$@"
