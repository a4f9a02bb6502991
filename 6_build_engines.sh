#!/usr/bin/env bash
# Stage 6: build TensorRT engines with trtexec.
#   reads  artifacts/<model>/onnx/{fp32,fp16,int8,int8_hp32,int4,int4_cli_broken}.onnx
#   writes artifacts/<model>/engines/<variant>.{plan,build.log,layers.json}, engines/timing.cache
#          and results/<model>/trt_build_<variant>.json
# Flags are chosen per TensorRT major version (8.x / 10.x / 11.x, see trt_tools.build_command).
# Without trtexec (TRTEXEC, PATH, /usr/src/tensorrt/bin/trtexec) it writes "skipped" rows, exit 0.
#
# Usage: bash 6_build_engines.sh [--model M] [--mem-pool-mb N] [--dla-core N] [VARIANT...]
#        bash 6_build_engines.sh --dry-run --trt-version 10.3.0     # print the command lines only
# Variants: python variants.py list --stage 6 (int4_cli_broken reproduces the INT4 parse failure).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -n "${PYTHON:-}" ]; then
    py="$PYTHON"
elif [ -x "$here/.venv/bin/python" ]; then
    py="$here/.venv/bin/python"
else
    py="python3"
fi
exec "$py" "$here/trt_tools.py" build "$@"
