#!/usr/bin/env bash
# The GPU rows of results/gpu/<model>/: stages 0-3 and 5 of one model on a CUDA machine, with
# PyTorch on CUDA (eager, CUDA graph, torch.compile, FP16, a strict no-TF32 pass, batch-N
# throughput) and ONNX Runtime's CUDA EP (host arrays, I/O binding, CUDA graph, a no-TF32 pass)
# for every ONNX variant. The reference logits are PyTorch FP32 on this machine's CPU.
#
# Usage (project root, an environment with onnxruntime-gpu: `source env.sh`, or on a host that
# already has the packages `PIPELINE_USE_CURRENT_PYTHON=1 source env.sh`):
#   RESULTS=results/gpu bash benchmarks/gpu_rows.sh efficientnet_lite0
#   RESULTS=results/gpu bash benchmarks/gpu_rows.sh mobilenet_v3_small --random-init   # latency only
# Then `python 8_report.py --model M` shows these rows beside the CPU rows of results/M/.
#
# Env: ARTIFACTS (default artifacts), RESULTS (default results/gpu), EPS (ModelOpt calibration
# EP, default cuda:0), INT4_EPS (5b's calibration EP, default cpu: ModelOpt's GPU AWQ path needs
# cupy), LATENCY_BATCH (throughput batch, default 64), STAGES (default "0 1 2 3 4 5": a subset
# splits the work, e.g. STAGES="0 1 2 3" then STAGES="4 5"), WARMUP/ITERS for the GPU timed
# loops (default 100/500; each loop also stops after 5 s).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -ge 1 ] || { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
model=$1
shift
extra=("$@")  # e.g. --random-init (stages 1 and 2)
export RESULTS=${RESULTS:-results/gpu}
export MODEL=$model
lb=${LATENCY_BATCH:-64}
art=$(python -c 'import sys, common; print(common.model_artifacts(sys.argv[1]))' "$model")
onnx=$art/onnx
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU")'

stages=" ${STAGES:-0 1 2 3 4 5} "
gpu=(--warmup "${WARMUP:-100}" --iters "${ITERS:-500}")
step() { echo "== $*"; "$@"; }
want() { [[ $stages == *" $1 "* ]]; }
if want 0; then step python 0_prepare_data.py --model "$model"; fi
if want 1; then
  step python 1_pytorch_baseline.py --model "$model" "${extra[@]}"
  step python 1_pytorch_baseline.py --model "$model" --device cuda --no-save-reference \
    --latency-batch "$lb" --compile "${gpu[@]}" "${extra[@]}"
  step python 1_pytorch_baseline.py --model "$model" --device cuda --no-save-reference \
    --no-tf32 --tag pytorch_fp32_cuda_notf32 "${gpu[@]}" "${extra[@]}"
  step python 1_pytorch_baseline.py --model "$model" --device cuda --precision fp16 \
    --latency-batch "$lb" "${gpu[@]}" "${extra[@]}"
fi
if want 2; then step python 2_export_onnx.py --model "$model" "${extra[@]}"; fi
if want 3; then
  for v in fp32 fp16; do
    step python 3_onnx_eval.py --model "$model" --onnx "$onnx/$v.onnx" --tag "ort_${v}_cuda" \
      --ep cuda --latency-batch "$lb" "${gpu[@]}"
  done
  step python 3_onnx_eval.py --model "$model" --onnx "$onnx/fp32.onnx" \
    --tag ort_fp32_cuda_notf32 --ep cuda --no-tf32 "${gpu[@]}"
fi
if want 4; then step python 4_make_calib.py --model "$model"; fi
if want 5; then
  mapfile -t quant < <(python variants.py list --stage 5)
  cli=()
  for v in "${quant[@]}"; do [ "$v" = int4 ] || cli+=("$v"); done
  step env EPS="${EPS:-cuda:0}" bash 5_quantize.sh --model "$model" "${cli[@]}"
  step python 5b_quantize_int4.py --model "$model" --no-eval --eps "${INT4_EPS:-cpu}"
  for v in "${quant[@]}"; do
    step python 3_onnx_eval.py --model "$model" --onnx "$onnx/$v.onnx" --tag "ort_${v}_cuda" \
      --ep cuda --latency-batch "$lb" "${gpu[@]}"
  done
fi
echo "GPU rows of $model in $RESULTS/$(basename "$art")"
