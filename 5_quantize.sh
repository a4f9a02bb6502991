#!/usr/bin/env bash
# Stage 5: INT8 (and the broken INT4 CLI reproduction) with ModelOpt's ONNX PTQ (its CLI flags,
# run through qdq_tools.py modelopt for the calibration batch), one variant per command.
#
# Reads:  artifacts/<model>/onnx/fp32.onnx (2_export_onnx.py), artifacts/<model>/calib.npz
#         (4_make_calib.py).
# Writes: artifacts/<model>/onnx/<variant>.onnx, artifacts/<model>/onnx/<variant>.quant.log,
#         results/<model>/quant_<variant>.json (wall time, exact command, ModelOpt warnings,
#         calibration samples/batch/order seed, `qdq_tools.py inspect` summary and the
#         `qdq_tools.py check` findings of the file).
# Rerun:  MODEL=efficientnet_lite0 ./5_quantize.sh int8
#
# int8_auto (mixed precision for an accuracy budget; needs a tuning split: 0_prepare_data.py
# --tune-fraction F or run_all.sh --auto-precision): auto_precision.py search quantizes every
# candidate once, measures each node on the tuning split and chooses the nodes to keep in float;
# ModelOpt then re-quantizes with them as --nodes_to_exclude, and auto_precision.py verify
# measures the file (tuning and evaluation splits) before it is installed. Budget and search
# flags: AUTO_ARGS="--min-agreement 99 --min-cosine 0.998" (auto_precision.py search --help).
# Writes also results/<model>/auto_precision.{json,md,png}.
#
# Usage:  5_quantize.sh [--model M] VARIANT [VARIANT ...] | --default | --all-variants | --list
# Env:    MODEL (default mobilenet_v3_small; package.module:factory works too), EPS (calibration
#         EP: cpu, cuda:0, trt; default cuda:0 when onnxruntime has the CUDA EP, else cpu),
#         CALIB_BATCH (calibration batch: all (default: one batch, see qdq_tools.py
#         calibration_plan for why) or a number), CALIB_STATS_CHECK (1; 0 skips the comparison
#         of the calibration data with the evaluation data, recorded), PYTHON (default: python),
#         AUTO_ARGS (int8_auto only: extra flags of auto_precision.py search, e.g. the budget).
#
# Before ModelOpt runs, the calibration npz is validated against the model (qdq_tools.py
# check-calib: input names, shapes, dtypes, NaN/Inf, statistics vs the evaluation data); after
# it, every file is health-checked (qdq_tools.py check: findings recorded, printed, not fatal).
#
# The depthwise list comes from the graph (qdq_tools.py list-depthwise --anchored: ^name$
# regexes, because ModelOpt matches --nodes_to_exclude with re.match, a prefix match).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python}
MODEL=${MODEL:-mobilenet_v3_small}

# The variants, their recipes and the default set come from the registry (variants.py).
usage() {
  echo "usage: $0 [--model M] VARIANT [VARIANT ...] | --default | --all-variants | --list" >&2
  echo "variants (ModelOpt CLI; int4 is made by 5b_quantize_int4.py):" >&2
  local v
  for v in $("$PYTHON" variants.py list --stage 5 --all --auto-precision); do
    [[ $v == int4 ]] || printf '  %-16s %s\n' "$v" "$("$PYTHON" variants.py describe "$v")" >&2
  done
  echo "--default = $(cli_variants --stage 5 | tr '\n' ' ')" >&2
  echo "--all-variants = all of the above except those made on request only:" \
    "$(comm -23 <(cli_variants --stage 5 --all --auto-precision | sort) \
                <(cli_variants --stage 5 --all | sort) | tr '\n' ' ')" >&2
  echo "int8_auto needs a tuning split (0_prepare_data.py --tune-fraction F); its budget and" \
    "search flags go in AUTO_ARGS, e.g. AUTO_ARGS=\"--min-agreement 99 --min-cosine 0.998\"" \
    "(python auto_precision.py search --help)" >&2
  exit "${1:-2}"
}

# Stage-5 variants made by the ModelOpt CLI (int4 comes from 5b_quantize_int4.py).
cli_variants() {
  "$PYTHON" variants.py list "$@" | grep -vx int4
}

selected=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --model) [[ $# -ge 2 ]] || usage; MODEL=$2; shift 2 ;;
    --model=*) MODEL=${1#--model=}; shift ;;
    --default) mapfile -t -O "${#selected[@]}" selected < <(cli_variants --stage 5); shift ;;
    --all-variants) mapfile -t -O "${#selected[@]}" selected < <(cli_variants --stage 5 --all)
                    shift ;;
    --list) cli_variants --stage 5 --all --auto-precision; exit 0 ;;
    -h|--help) usage 0 ;;
    -*) echo "$0: unknown option $1" >&2; usage ;;
    *) cli_variants --stage 5 --all --auto-precision | grep -qx -- "$1" || {
         echo "$0: unknown variant $1" >&2; usage; }
       selected+=("$1"); shift ;;
  esac
done
[[ ${#selected[@]} -gt 0 ]] || usage

# The same artifact folder every stage uses (package.module:factory -> package.module-factory).
ART=$("$PYTHON" -c 'import sys, common; print(common.model_artifacts(sys.argv[1]))' "$MODEL")
ONNX_DIR=$ART/onnx
RES_DIR=$("$PYTHON" -c 'import sys, common; print(common.model_results(sys.argv[1]))' "$MODEL")
SRC=$ONNX_DIR/fp32.onnx
CALIB=$ART/calib.npz
[[ -f $SRC ]] || { echo "$0: FAILED: $SRC missing: run 2_export_onnx.py --model $MODEL" >&2; exit 1; }
[[ -f $CALIB ]] || { echo "$0: FAILED: $CALIB missing: run 4_make_calib.py --model $MODEL" >&2; exit 1; }
CALIB_BATCH=${CALIB_BATCH:-all}
stats_flag=()
[[ ${CALIB_STATS_CHECK:-1} == 0 ]] && stats_flag=(--no-stats-check)

if [[ -z ${EPS:-} ]]; then
  if "$PYTHON" -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' 2>/dev/null; then
    EPS=cuda:0
  else
    EPS=cpu
  fi
fi

# Graph-derived node lists (anchored regexes), read once.
# (Command substitution, not <(...), so that a failing qdq_tools.py stops the script.)
dw_out=$("$PYTHON" qdq_tools.py list-depthwise --names-only --anchored "$SRC")
stem_out=$("$PYTHON" qdq_tools.py list-stem --names-only --anchored "$SRC")
DW=()
STEM=()
[[ -z $dw_out ]] || mapfile -t DW <<<"$dw_out"
[[ -z $stem_out ]] || mapfile -t STEM <<<"$stem_out"
# A model without convolutions (an MLP, a transformer) has no stem: only the variants that
# exclude it (excl_stem) do not apply, and variants.py says so for them.
echo "stage 5: $MODEL: ${#DW[@]} depthwise conv(s), stem ${STEM[*]:-none}, calibration EP $EPS"

# ModelOpt 0.47.0 rewrites the file given as --onnx_path (same bytes, new mtime): it gets a
# private copy, so fp32.onnx is never written while another stage may be reading it. The work
# folder sits beside the outputs (same file system: the final mv is an atomic rename) and also
# receives ModelOpt's intermediate files (<name>_opset19.onnx, <name>_reconciled.onnx, written
# beside --output_path and left there when ModelOpt fails); the trap removes it on any exit.
WORK=$(mktemp -d "$ONNX_DIR/.tmp-5_quantize.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cp "$SRC" "$WORK/fp32.onnx"

# Calibration data checked before ModelOpt sees it (ModelOpt itself only asserts); prints the
# calibration batch (ModelOpt's CLI would use the model's batch dim, i.e. 1 for a dynamic batch).
if ! calib_batch=$("$PYTHON" qdq_tools.py check-calib "$SRC" --calib "$CALIB" --model "$MODEL" \
    --batch "$CALIB_BATCH" "${stats_flag[@]}" --json "$WORK/calib.json"); then
  echo "$0: FAILED: calibration data $CALIB refused (above); nothing was quantized" >&2
  exit 1
fi

not_made=()
for variant in "${selected[@]}"; do
  # int8_auto: the search chooses the nodes to keep in float (anchored regexes on stdout).
  AUTO=()
  auto=0
  if "$PYTHON" variants.py needs-tuning "$variant"; then
    auto=1
    read -r -a auto_args <<<"${AUTO_ARGS:-}"
    echo "Stage 5: search $variant: which nodes stay in float (auto_precision.py search ${AUTO_ARGS:-})"
    # exit 2 (a usage error in AUTO_ARGS) is passed on as it is
    # the record is written in $WORK and published to results/ only with the installed file
    auto_dir=$WORK/auto_precision
    auto_out=$("$PYTHON" auto_precision.py search --model "$MODEL" --fp32 "$SRC" \
        --calib "$CALIB" --calib-batch "$calib_batch" --eps "$EPS" --variant "$variant" \
        --out-dir "$auto_dir" "${auto_args[@]}") || {
      rc=$?
      echo "$0: FAILED: the mixed-precision search for $variant failed (above); nothing was" \
        "installed" >&2
      exit "$rc"
    }
    [[ -z $auto_out ]] || mapfile -t AUTO <<<"$auto_out"
  fi
  if ! flags_out=$("$PYTHON" variants.py modelopt-args "$variant" --calib "$CALIB" --eps "$EPS" \
      --depthwise "${DW[@]}" --stem "${STEM[@]}" --auto "${AUTO[@]}" 2>"$WORK/variant.err"); then
    echo "$0: $variant not made: $(sed -n 's/^variants.py: error: //p' "$WORK/variant.err")" >&2
    not_made+=("$variant")
    continue
  fi
  mapfile -t FLAGS <<<"$flags_out"
  out=$ONNX_DIR/$variant.onnx
  log=$ONNX_DIR/$variant.quant.log
  tmp=$WORK/$variant.onnx
  # ModelOpt's own CLI flags and quantize(), with the calibration batch set apart from the
  # shapes its GEMV rule reads (qdq_tools.py modelopt_quantize says why).
  cmd=("$PYTHON" qdq_tools.py modelopt --calib-batch "$calib_batch" -- --onnx_path "$WORK/fp32.onnx"
       "${FLAGS[@]}" --output_path "$tmp")
  shown=$(printf '%q ' "${cmd[@]}")
  shown=${shown//"$tmp"/"$out"}
  shown=${shown//"$WORK/fp32.onnx"/"$SRC"}
  echo "Stage 5: quantize $variant: $SRC + $CALIB -> $out"
  start=$(date +%s.%N)
  status=ok
  if ! "${cmd[@]}" >"$log.tmp" 2>&1; then status=failed; fi
  wall=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  mv -f "$log.tmp" "$log"
  # int8_auto: measured on the tuning split (it must meet the budget) and the evaluation split
  # before it replaces anything.
  verify_failed=0
  if [[ $status == ok && -f $tmp && $auto == 1 ]] && ! "$PYTHON" auto_precision.py verify \
      --model "$MODEL" --fp32 "$SRC" --onnx "$tmp" --installed-as "$out" --out-dir "$auto_dir"; then
    verify_failed=1
    status=failed
  fi
  if [[ $status == ok && -f $tmp ]]; then
    mv -f "$tmp" "$out"
  else
    status=failed
    rm -f "$tmp"
  fi
  if [[ $auto == 1 && -f $auto_dir/auto_precision.json ]]; then
    # results/<model>/auto_precision.* always describe the installed file; a run that was not
    # installed is published beside them as auto_precision.failed.*
    publish=("$PYTHON" auto_precision.py publish --from "$auto_dir" --to "$RES_DIR")
    [[ $status == ok ]] || publish+=(--failed)
    "${publish[@]}" >/dev/null
  fi
  "$PYTHON" qdq_tools.py record-quant --model "$MODEL" --variant "$variant" --onnx "$out" \
    --source "$SRC" --calib "$CALIB" --calib-report "$WORK/calib.json" --log "$log" \
    --wall-s "$wall" --status "$status" \
    --description "$("$PYTHON" variants.py describe "$variant")" --command "${shown% }"
  if [[ $verify_failed == 1 ]]; then
    echo "$0: FAILED: $variant re-quantized by ModelOpt misses its budget on the tuning split" \
      "(auto_precision.py verify, above); $out left as it was" >&2
    exit 1
  fi
  if [[ $status != ok ]]; then
    echo "$0: FAILED: ModelOpt failed on $variant; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  echo "  finished $variant [elapsed=${wall}s] -> $out"
done
if [[ ${#not_made[@]} -gt 0 ]]; then
  echo "$0: FAILED: ${not_made[*]} not made (reason above); the other requested" \
    "variants were made" >&2
  exit 1
fi
