set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/deps/*.whl
export PYTHONPATH=/tmp/site PIPELINE_USE_CURRENT_PYTHON=1
source env.sh
export ARTIFACTS=/tmp/art RESULTS=$OUT/res MODEL=efficientnet_lite0
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E "avx512_vnni|avx_vnni|amx_int8" | tr '\n' ' '; echo
python 0_prepare_data.py
python 1_pytorch_baseline.py --limit 256 --iters 50
python 1_pytorch_baseline.py --device cuda --no-save-reference --latency-batch 64 --compile --limit 256
python 1_pytorch_baseline.py --device cuda --precision fp16 --latency-batch 64 --limit 256
python 1_pytorch_baseline.py --device cuda --no-save-reference --no-tf32 --tag pytorch_fp32_cuda_notf32 --limit 256
python 2_export_onnx.py
python 3_onnx_eval.py --onnx /tmp/art/efficientnet_lite0/onnx/fp32.onnx --tag ort_fp32 --limit 256
python benchmarks/harness_fidelity.py --rounds 3 --iters 100 --out $OUT/harness_fidelity.json
tar czf $OUT/res.tgz -C $OUT res
