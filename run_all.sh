#!/usr/bin/env bash
# The whole pipeline, stage by stage (Kaldi/ESPnet recipe style). First: source env.sh
#
#   bash run_all.sh                          # all stages for $MODEL (default mobilenet_v3_small)
#   MODEL=efficientnet_lite0 bash run_all.sh
#   bash run_all.sh --stage 3 --stop-stage 3 # rerun one stage
#   bash run_all.sh --all-variants           # also the INT8 ablations of stage 5
#   WEIGHTS=ckpt.pth bash run_all.sh         # a local state dict instead of the default weights
#   bash run_all.sh --limit 64               # smoke run: artifacts/smoke/, results/smoke/
#   bash run_all.sh --auto-precision         # + int8_auto (layers kept in float for a budget)
#   bash run_all.sh --model resnet10t --weights r10t.pth   # a timm (or torchvision) name
#   MODEL=mypkg.mod:build bash run_all.sh    # your factory; ImageNet classifier if it carries
#                                            # its preprocessing, or give --preprocess SPEC
#   bash run_all.sh --model mypkg.mod:build --inputs eval.npz --calib-inputs calib.npz \
#       [--labels labels.npy]                # a model with its own data, every stage
#
# Stages: 0 data, 1 PyTorch baseline, 2 ONNX export, 3 ORT eval (FP32/FP16), 4 calibration data,
# 5 INT8/INT4 quantization + ORT eval, 6 TensorRT engines, 7 TensorRT eval, 8 report.
# Every stage writes results/<model>/*.json; stops at the first failing stage with its log tail.
# One run at a time per artifacts folder (a lock names the run that holds it); Ctrl-C says
# which stage was interrupted and the --stage N command that resumes.
set -euo pipefail

usage() {
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
  echo "options: --stage N --stop-stage M --all-variants --limit N (first N eval images; smoke"
  echo "         runs, written to \$ARTIFACTS/smoke and \$RESULTS/smoke, never over a full run)"
  echo "         --auto-precision[=F] (stage 0 moves a fraction F, default 0.25, of the eval"
  echo "         images to a tuning split, so every row of the run is on the smaller eval split;"
  echo "         stage 5 adds int8_auto: auto_precision.py search + ModelOpt + verify; budget via"
  echo "         AUTO_ARGS, see 5_quantize.sh)"
  echo "         --random-init (seeded random weights in stages 1-2: latency and parity only)"
  echo "         --model M (= MODEL=M), --weights F (= WEIGHTS), --preprocess SPEC (= PREPROCESS:"
  echo "         mean=..,std=..[,resize=..,crop=..,interpolation=..] for a factory's ImageNet"
  echo "         classifier), --inputs NPZ --calib-inputs NPZ --labels FILE (= INPUTS,"
  echo "         CALIB_INPUTS, LABELS: a model with its own data), INPUT_SHAPE=\"name:dims ...\""
  echo "         (synthetic samples when there is no --inputs: latency and structure only)"
}

stage=0
stop_stage=8
random_init=0
all_variants=0
limit=""
tune_fraction=""  # --auto-precision: fraction of the eval images moved to the tuning split
while [ $# -gt 0 ]; do
  case "$1" in
    --stage|--stop-stage|--limit)
      [ $# -ge 2 ] || { echo "run_all.sh: $1 needs a number" >&2; exit 2; }
      case "$1" in
        --stage) stage="$2" ;;
        --stop-stage) stop_stage="$2" ;;
        --limit) limit="$2" ;;
      esac
      shift 2 ;;
    --model|--weights|--preprocess|--inputs|--calib-inputs|--labels)
      if [ $# -lt 2 ] || [ -z "$2" ]; then echo "run_all.sh: $1 needs a value" >&2; exit 2; fi
      case "$1" in  # a flag is its environment variable (the stages read the same)
        --model) MODEL="$2" ;;
        --weights) WEIGHTS="$2" ;;
        --preprocess) PREPROCESS="$2" ;;
        --inputs) INPUTS="$2" ;;
        --calib-inputs) CALIB_INPUTS="$2" ;;
        --labels) LABELS="$2" ;;
      esac
      shift 2 ;;
    --all-variants) all_variants=1; shift ;;
    --random-init) random_init=1; shift ;;
    --auto-precision) tune_fraction=0.25; shift ;;
    --auto-precision=*) tune_fraction="${1#--auto-precision=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_all.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
for n in "$stage" "$stop_stage"; do
  [[ "$n" =~ ^[0-8]$ ]] || { echo "run_all.sh: stages are 0..8, got $n" >&2; exit 2; }
done
if [ "$stage" -gt "$stop_stage" ]; then
  echo "run_all.sh: --stage $stage is after --stop-stage $stop_stage: nothing to run" >&2; exit 2
fi
if [ -n "$limit" ] && ! [[ "$limit" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_all.sh: --limit needs a positive integer, got '$limit'" >&2; exit 2
fi
if [ -n "$tune_fraction" ] && ! [[ "$tune_fraction" =~ ^0?\.[0-9]*[1-9][0-9]*$ ]]; then
  echo "run_all.sh: --auto-precision=F needs a fraction 0 < F < 1 (e.g. 0.25), got" \
    "'$tune_fraction'" >&2; exit 2
fi

# Files named relative to where the user stands, before the cd below; a factory's module is
# importable from there too (PYTHONPATH).
user_dir="$PWD"
for var in WEIGHTS INPUTS CALIB_INPUTS LABELS; do
  val="${!var:-}"
  if [ -n "$val" ]; then
    case "$val" in /*) ;; *) val="$user_dir/$val" ;; esac
    [ -e "$val" ] || { echo "run_all.sh: $var=${!var}: no such file" >&2; exit 2; }
    printf -v "$var" '%s' "$val"
    export "${var?}"
  fi
done
if [[ "${MODEL:-}" == *:* ]]; then
  # PYTHONPATH entries relative to the user's folder stay so after the cd
  abs_pp="$user_dir"
  IFS=: read -r -a pp_parts <<<"${PYTHONPATH:-}"
  for part in "${pp_parts[@]}"; do
    [ -n "$part" ] || continue
    case "$part" in /*) abs_pp+=":$part" ;; *) abs_pp+=":$user_dir/$part" ;; esac
  done
  export PYTHONPATH="$abs_pp"
fi
[ -z "${PREPROCESS:-}" ] || export PREPROCESS
# Folders given relative to where the user stands stay there (the stages resolve them so too);
# unset, ARTIFACTS/RESULTS default to the repository's artifacts/ and results/.
for var in ARTIFACTS RESULTS VAL_ROOT; do
  val="${!var:-}"
  if [ -n "$val" ]; then
    case "$val" in /*) ;; *) printf -v "$var" '%s' "$user_dir/$val"; export "${var?}" ;; esac
  fi
done
cd "$(dirname "$0")"
# (found, not imported: importing torch alone takes about 2 s)
if [ -z "${PIPELINE_ROOT:-}" ] || ! python -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "onnxruntime")))' 2>/dev/null; then
  echo "run_all.sh: environment not set up: run  source env.sh  first" >&2
  exit 2
fi
MODEL="${MODEL:-mobilenet_v3_small}"
export MODEL
# Check the model name before any stage runs (a typo is a usage error, exit 2).
MODEL_TAG="$(python -m deploykit.layout tag "$MODEL")"
# What kind of model: an ImageNet classifier (the real images are its data in every stage) or a
# model with its own data (--inputs / INPUT_SHAPE); a bad name or factory stops here (its line).
kind_rc=0
kind_out="$(python -m deploykit.models kind "$MODEL" --with-spec 2>&1)" || kind_rc=$?
if [ "$kind_rc" != 0 ]; then
  echo "run_all.sh: $kind_out" | head -n 3 >&2
  [[ "$kind_out" != *"unknown model"* ]] || echo "  use mobilenet_v3_small, efficientnet_lite0," \
    "a torchvision or timm classifier name or package.module:factory (README, Models)" >&2
  exit "$kind_rc"
fi
# its last line (a factory's module may print while it is imported)
IFS=$'\t' read -r model_kind kind_note model_spec_json <<<"${kind_out##*$'\n'}"
# the stages take the spec from here instead of building a factory's model (or importing
# torchvision/timm) again each (deploykit.models.SPEC_ENV)
[ -z "$model_spec_json" ] || export PIPELINE_MODEL_SPEC="$model_spec_json"
# Artifacts and results roots, absolute and exported so every stage uses the same ones. A smoke
# run (--limit) gets folders of its own: it never replaces or moves a full run's files.
ART_ROOT="${ARTIFACTS:-artifacts}"
RES_ROOT="${RESULTS:-results}"
case "$ART_ROOT" in /*) ;; *) ART_ROOT="$PWD/$ART_ROOT" ;; esac
case "$RES_ROOT" in /*) ;; *) RES_ROOT="$PWD/$RES_ROOT" ;; esac
user_roots=""  # ARTIFACTS / RESULTS to repeat in a resume command (when not the defaults)
[ "$ART_ROOT" = "$PWD/artifacts" ] || user_roots+=" ARTIFACTS=$(printf '%q' "$ART_ROOT")"
[ "$RES_ROOT" = "$PWD/results" ] || user_roots+=" RESULTS=$(printf '%q' "$RES_ROOT")"
if [ -n "$limit" ]; then
  ART_ROOT="$ART_ROOT/smoke"
  RES_ROOT="$RES_ROOT/smoke"
fi
export ARTIFACTS="$ART_ROOT" RESULTS="$RES_ROOT"
# Paths, row tags and file names come from their owners (deploykit.layout, the variant registry).
dirs_out="$(python -m deploykit.layout artifacts "$MODEL")"
ART="$dirs_out"
dirs_out="$(python -m deploykit.layout onnx-dir "$MODEL")"
ONNX_DIR="$dirs_out"
dirs_out="$(python -m deploykit.layout results "$MODEL")"
RES_DIR="$dirs_out"
LOG_DIR="$ART_ROOT/logs/$MODEL_TAG"
declare -A ORT_TAG TRT_TAG ONNX_FILE
registry_out="$(python variants.py list --with ort_tag --with trt_tag --with onnx_file)"
while IFS=$'\t' read -r v ort_tag trt_tag onnx_file; do
  ORT_TAG[$v]=$ort_tag TRT_TAG[$v]=$trt_tag ONNX_FILE[$v]=$onnx_file
done <<<"$registry_out"
# A smoke run shrinks every stage: stage 0 keeps the first N images of each split, so every
# evaluation and every cross-check are N images; the calibration set is at most SMOKE_CALIB
# samples, stage 2 checks at most SMOKE_CHECK images and runs the true-FP16 check on one sample;
# timed loops are short; stage 5 makes one INT8 variant (the smoke line says what it leaves out).
lim=()
timing=()
smoke_export=()
smoke_calib=()
SMOKE_VARIANT=int8_hp32  # the one INT8 variant of a smoke run (ModelOpt, fp32 scales)
SMOKE_CALIB=32
SMOKE_CHECK=32
if [ -n "$limit" ]; then
  lim=(--limit "$limit"); timing=(--warmup 2 --iters 20)
  smoke_export=(--true-fp16-budget-s 10 --true-fp16-samples 1
                --check-images "$(( limit < SMOKE_CHECK ? (limit < 2 ? 2 : limit) : SMOKE_CHECK ))")
  smoke_calib=(--limit "$(( limit < SMOKE_CALIB ? limit : SMOKE_CALIB ))")
fi
# WEIGHTS=/path/state_dict.pth: a local checkpoint instead of the model's default weights.
weights=()
if [ -n "${WEIGHTS:-}" ]; then
  if [ -d "$WEIGHTS" ]; then
    echo "run_all.sh: WEIGHTS=$WEIGHTS is a folder: give the state-dict file itself" \
      "(e.g. WEIGHTS=$WEIGHTS/model.pth)" >&2
    exit 2
  fi
  [ -f "$WEIGHTS" ] || { echo "run_all.sh: WEIGHTS=$WEIGHTS: no such file" >&2; exit 2; }
  weights=(--weights "$WEIGHTS")
fi
if [ "$random_init" = 1 ]; then  # seeded random weights in stages 1 and 2: latency only
  [ -z "${WEIGHTS:-}" ] || { echo "run_all.sh: --random-init and WEIGHTS/--weights: give one" >&2; exit 2; }
  weights=(--random-init)
fi
# A model with its own data: --inputs (its evaluation samples; --labels for accuracy) and
# --calib-inputs, or INPUT_SHAPE="name:1,3,224,224 other:1,16:int64" for synthetic samples.
custom=0
shape_args=()
data_args=()
calib_args=()
if [ "$model_kind" = own-data ]; then
  custom=1
  if [ -z "${INPUT_SHAPE:-}" ] && [ -z "${INPUTS:-}" ]; then
    echo "run_all.sh: MODEL=$MODEL has its own data ($kind_note): give --inputs eval.npz (one" \
      "array per forward() argument; --calib-inputs calib.npz, --labels labels.npy) or" \
      "INPUT_SHAPE=\"name:d0,d1,...[:dtype] ...\" for synthetic samples (latency only); an" \
      "ImageNet classifier states its preprocessing with --preprocess" >&2
    exit 2
  fi
  if [ -n "${INPUT_SHAPE:-}" ]; then
    # shellcheck disable=SC2086  # INPUT_SHAPE is a space-separated list on purpose
    for s in $INPUT_SHAPE; do shape_args+=(--input-shape "$s"); done
    # shellcheck disable=SC2086
    python - $INPUT_SHAPE <<'EOF' || exit 2
import sys, common
try:
    common.parse_input_shapes(sys.argv[1:])
except common.UsageError as e:
    sys.exit(f"run_all.sh: INPUT_SHAPE: {e}")
EOF
  fi
  [ -z "${INPUTS:-}" ] || data_args+=(--inputs "$INPUTS")
  [ -z "${LABELS:-}" ] || data_args+=(--labels "$LABELS")
  if [ -n "${CALIB_INPUTS:-}" ]; then
    calib_args=(--calib-inputs "$CALIB_INPUTS")
  else  # synthetic calibration: stage 4 warns that the INT8 rows are latency-only
    n_random="${limit:-64}"
    [ "$n_random" -le 64 ] || n_random=64
    [ -z "$limit" ] || [ "$n_random" -le "$SMOKE_CALIB" ] || n_random=$SMOKE_CALIB
    calib_args=(--random "$n_random")
  fi
else
  for var in INPUT_SHAPE INPUTS CALIB_INPUTS LABELS; do
    if [ -n "${!var:-}" ]; then
      # a classifier's data are the images (VAL_ROOT), its input size its preprocessing: say so
      # instead of dropping the setting without a word
      echo "run_all.sh: $var is for models with their own data; $MODEL is an ImageNet" \
        "classifier ($kind_note) whose data are the images (VAL_ROOT): unset $var" >&2
      exit 2
    fi
  done
fi

# --auto-precision: stage 0 makes the tuning split (all later stages then use the smaller eval
# split) and stage 5 adds the variants that need it (variants.py: int8_auto).
auto=()
tune=()
if [ -n "$tune_fraction" ]; then
  if [ "$custom" = 1 ]; then
    echo "run_all.sh: --auto-precision: $MODEL is a custom model; run python auto_precision.py" \
      "search --model $MODEL --tune-npz YOUR.npz and 5_quantize.sh int8_auto yourself" >&2
    exit 2
  fi
  auto=(--auto-precision)
  tune=(--tune-fraction "$tune_fraction")
  if [ "$stage" -gt 0 ] && [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ] && ! python -c '
import json, sys
try:
    sys.exit(0 if json.load(open(sys.argv[1])).get("tune") else 1)
except (OSError, ValueError):
    sys.exit(1)' "$ART_ROOT/splits.json"; then
    echo "run_all.sh: --auto-precision --stage $stage: $ART_ROOT/splits.json has no tuning split" \
      "(stage 0 makes it, and every row must be on the same smaller eval split): start from" \
      "stage 0: bash run_all.sh --auto-precision" >&2
    exit 2
  fi
fi

# Both roots must take files before any long work starts.
for d in "$ART_ROOT" "$RES_ROOT"; do
  if ! mkdir -p "$d" 2>/dev/null || ! probe="$(mktemp "$d/.write-probe-XXXXXX" 2>/dev/null)"; then
    echo "run_all.sh: cannot write to $d: make it writable, or set ARTIFACTS / RESULTS to a" \
      "writable folder (nothing was changed)" >&2
    exit 1
  fi
  rm -f "$probe"
done
mkdir -p "$LOG_DIR"

# The command that reruns this run from stage $1 (printed on Ctrl-C and on a failed stage).
resume_cmd() {
  local c
  c="bash $(printf '%q' "$PWD/run_all.sh") --stage $1"
  [ "$stop_stage" = 8 ] || c+=" --stop-stage $stop_stage"
  [ -z "$limit" ] || c+=" --limit $limit"
  [ "$all_variants" = 0 ] || c+=" --all-variants"
  [ "$random_init" = 0 ] || c+=" --random-init"
  [ -z "$tune_fraction" ] || c+=" --auto-precision=$tune_fraction"
  # every value shell-quoted: the line pastes back as the same arguments and runs nothing else
  local envs
  envs="MODEL=$(printf '%q' "$MODEL")$user_roots"
  [[ "$MODEL" != *:* ]] || envs+=" PYTHONPATH=$(printf '%q' "$PYTHONPATH")"
  [ -z "${WEIGHTS:-}" ] || envs+=" WEIGHTS=$(printf '%q' "$WEIGHTS")"
  [ -z "${VAL_ROOT:-}" ] || envs+=" VAL_ROOT=$(printf '%q' "$VAL_ROOT")"
  local var
  for var in INPUT_SHAPE PREPROCESS LOGITS_OUTPUT INPUTS CALIB_INPUTS LABELS ALLOW_CLASS_SUBSET \
             EPS CALIB_BATCH CALIB_STATS_CHECK AUTO_ARGS; do
    [ -z "${!var:-}" ] || envs+=" $var=$(printf '%q' "${!var}")"
  done
  echo "$envs $c"
}

# One run per artifacts folder: two runs would share logs, caches and temporaries. The lock is a
# folder (mkdir/rename are atomic) holding the owner's pid, start time and command; a lock whose
# owner is gone (killed run) is reported and cleared.
LOCK="$ART_ROOT/.run_all.lock"
lock_held=0
proc_start() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null || true; }
lock_owner_alive() { # pid pstart host
  [ -n "$1" ] || return 1
  if [ -n "$3" ] && [ "$3" != "$(hostname)" ]; then return 0; fi  # another host: cannot tell
  kill -0 "$1" 2>/dev/null || return 1
  # pid reused by another process since the lock was taken?
  if [ -n "$2" ] && [ -r "/proc/$1/stat" ] && [ "$(proc_start "$1")" != "$2" ]; then return 1; fi
  return 0
}
# The owner file alone cannot see a stage that outlives its run_all.sh (kill -9 of the script
# leaves the running stage orphaned, still writing into the folder): an flock(1) on
# $LOCK_FD_FILE, inherited by every stage the run starts, stays held until the last of them
# exits, and the kernel drops it whatever killed them.
LOCK_FD_FILE="$ART_ROOT/.run_all.flock"
lock_holders() { # pids (with commands) of the processes that hold $LOCK_FD_FILE open
  local p f want
  want="$(readlink -f "$LOCK_FD_FILE")"
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    for f in "$p"/fd/*; do
      if [ "$(readlink "$f" 2>/dev/null)" = "$want" ]; then
        printf '%s (%s) ' "${p#/proc/}" "$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null | cut -c1-100)"
        break
      fi
    done
  done
}
take_flock() {
  command -v flock >/dev/null 2>&1 || return 0  # no util-linux: the owner file alone decides
  exec 9>>"$LOCK_FD_FILE" || return 0
  flock -n 9 && return 0
  local pid started cmd
  pid="$(sed -n 's/^pid=//p' "$LOCK/owner" 2>/dev/null || true)"
  started="$(sed -n 's/^started=//p' "$LOCK/owner" 2>/dev/null || true)"
  cmd="$(sed -n 's/^command=//p' "$LOCK/owner" 2>/dev/null || true)"
  if [ -z "$pid" ]; then
    echo "run_all.sh: another run_all.sh is starting in $ART_ROOT: $(lock_holders)" >&2
  elif kill -0 "$pid" 2>/dev/null; then
    echo "run_all.sh: another run_all.sh is using $ART_ROOT: pid $pid on $(hostname)," \
      "started $started, command: $cmd" >&2
  else
    echo "run_all.sh: a stage started by an earlier run_all.sh (pid ${pid:-?}, started" \
      "${started:-?}, command: ${cmd:-?}) is still running in $ART_ROOT although that run is" \
      "gone (killed?): $(lock_holders)" >&2
  fi
  echo "  wait for it to finish (or stop it: kill PID), or give this run folders of its" \
    "own: ARTIFACTS=/other/artifacts RESULTS=/other/results bash run_all.sh ..." >&2
  exit 1
}
take_lock() {
  local tmpd pid pstart started host cmd
  take_flock
  for _ in 1 2 3; do
    tmpd="$(mktemp -d "$ART_ROOT/.run_all.lock.new-XXXXXX")"
    if ! printf 'pid=%s\npstart=%s\nstarted=%s\nhost=%s\ncommand=%s\n' "$$" "$(proc_start $$)" \
      "$(date -u +%FT%TZ)" "$(hostname)" "$run_cmd" 2>/dev/null > "$tmpd/owner"; then
      rm -rf "$tmpd"
      echo "run_all.sh: cannot write $tmpd/owner (disk full? $(df -Pm "$ART_ROOT" 2>/dev/null |
        awk 'NR==2 {print $4 " MB free on " $6}')): free some space or point ARTIFACTS at" \
        "another disk" >&2
      exit 1
    fi
    if mv -T "$tmpd" "$LOCK" 2>/dev/null; then lock_held=1; return 0; fi
    rm -rf "$tmpd"
    pid="$(sed -n 's/^pid=//p' "$LOCK/owner" 2>/dev/null || true)"
    pstart="$(sed -n 's/^pstart=//p' "$LOCK/owner" 2>/dev/null || true)"
    started="$(sed -n 's/^started=//p' "$LOCK/owner" 2>/dev/null || true)"
    host="$(sed -n 's/^host=//p' "$LOCK/owner" 2>/dev/null || true)"
    cmd="$(sed -n 's/^command=//p' "$LOCK/owner" 2>/dev/null || true)"
    if lock_owner_alive "$pid" "$pstart" "$host"; then
      echo "run_all.sh: another run_all.sh is using $ART_ROOT: pid $pid on ${host:-this host}," \
        "started $started, command: $cmd" >&2
      echo "  wait for it to finish (or stop it: kill $pid), or give this run folders of its" \
        "own: ARTIFACTS=/other/artifacts RESULTS=/other/results bash run_all.sh ..." >&2
      exit 1
    fi
    echo "run_all.sh: clearing a stale lock of a run that is no longer running (pid ${pid:-?}," \
      "started ${started:-?}, command: ${cmd:-?})" >&2
    mv -T "$LOCK" "$LOCK.stale.$$" 2>/dev/null && rm -rf "$LOCK.stale.$$"
  done
  echo "run_all.sh: could not take the lock $LOCK (remove it if no run is active)" >&2
  exit 1
}
release_lock() {
  if [ "$lock_held" = 1 ] && [ "$(sed -n 's/^pid=//p' "$LOCK/owner" 2>/dev/null)" = "$$" ]; then
    rm -rf "$LOCK"
  fi
  lock_held=0
}

# Progress: stages write tqdm bars into their log (PIPELINE_PROGRESS=1, common.progress); on a
# terminal a one-line ticker shows the running command, its time and the log's last line.
export PIPELINE_PROGRESS=1
ticker=""
start_ticker() { # log label
  [ -t 1 ] || return 0
  (
    exec 9>&-  # the ticker is no stage: it must not hold the run's flock
    t0=$SECONDS
    while sleep 5; do
      kill -0 $$ 2>/dev/null || exit 0
      last="$(tail -c 4000 "$1" 2>/dev/null | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-110 || true)"
      printf '\r\033[K  ... %s %ds: %s' "$2" $((SECONDS - t0)) "$last"
    done
  ) &
  ticker=$!
}
stop_ticker() {
  if [ -n "$ticker" ]; then
    kill "$ticker" 2>/dev/null || true
    wait "$ticker" 2>/dev/null || true
    ticker=""
    printf '\r\033[K'
  fi
}

# Preload (deploykit.zygote): one Python imports torch, torchvision, timm, onnx, ... once, in the
# background, and runs each `python <stage>.py ...` of this run as a forked child of itself
# (the stage's own command line, folder, environment and output; a command it cannot take runs
# as a plain process). Its log: $LOG_DIR/preload.log. PIPELINE_PRELOAD=0: plain processes only.
preload_pid=""
preload_dir=""
start_preload() {
  [ "${PIPELINE_PRELOAD:-1}" = 1 ] || return 0
  preload_dir="$(mktemp -d "${TMPDIR:-/tmp}/deploykit-preload.XXXXXX")" || { preload_dir=""; return 0; }
  export PIPELINE_PRELOAD_SOCKET="$preload_dir/socket"
  python -m deploykit.zygote serve "$PIPELINE_PRELOAD_SOCKET" </dev/null >"$LOG_DIR/preload.log" 2>&1 &
  preload_pid=$!
  # Its socket before the first command (up to 10 s; it takes about 0.3 s): a command that
  # finds none runs plain, and the server's imports would then run beside it unseen (a timed
  # stage 1 of an own-data model, which has no stage 0 before it, was slowed that way).
  for _ in $(seq 100); do
    [ -S "$PIPELINE_PRELOAD_SOCKET" ] && break
    kill -0 "$preload_pid" 2>/dev/null || break
    sleep 0.1
  done
}
stop_preload() {
  if [ -n "$preload_pid" ]; then
    kill "$preload_pid" 2>/dev/null || true
    wait "$preload_pid" 2>/dev/null || true
    preload_pid=""
  fi
  if [ -n "$preload_dir" ]; then rm -rf "$preload_dir"; preload_dir=""; fi
  unset PIPELINE_PRELOAD_SOCKET
}

cur_stage=""
cur_what=""
cur_cmd=""
on_interrupt() { # what exit-status
  trap - INT TERM
  stop_ticker
  echo >&2
  if [ -n "$cur_stage" ]; then
    echo "run_all.sh: $1: interrupted during stage $cur_stage ($cur_what)${cur_cmd:+; command: $cur_cmd}" >&2
    echo "  finished stages keep their outputs; the interrupted stage reruns from its start." >&2
    echo "  resume with: $(resume_cmd "$cur_stage")" >&2
  else
    echo "run_all.sh: $1: interrupted before the first stage started; nothing was changed" >&2
  fi
  release_lock
  exit "$2"
}
run_cmd="$(resume_cmd "$stage")"
trap 'on_interrupt Ctrl-C 130' INT
trap 'on_interrupt terminated 143' TERM
trap 'stop_ticker; stop_preload; release_lock' EXIT
take_lock
# Seconds per command of this run, one "name<TAB>seconds" line each (benchmarks/profile_run.py)
TIMES="$LOG_DIR/times.tsv"
: > "$TIMES"
start_preload


# A log without progress-bar updates (tqdm's \r lines) and exporter chatter.
log_text() { tr '\r' '\n' < "$1" | grep -v -E '^[[:space:]]*$|^\[torch\.onnx\]| [0-9]+/[0-9]+ \[' || true; }

# A command line as a user can paste it back: every argument shell-quoted (printf %q).
quote_args() {
  local out="" a
  for a in "$@"; do out+="${out:+ }$(printf '%q' "$a")"; done
  printf '%s' "$out"
}

# Open a stage's log as fd 8, created fresh: whatever is at its name (an old log, or a link
# planted there) is removed, and noclobber makes bash create it with O_EXCL, which never
# writes through a link planted in between.
open_log() {
  rm -f -- "$1"
  if ! { set -C; exec 8>"$1"; } 2>/dev/null; then
    set +C
    echo "  FAILED: cannot create the log $1 (something else was created there meanwhile?)" >&2
    exit 1
  fi
  set +C
}

# Run one command of a stage; on failure print its log tail and stop the pipeline. On success
# print every skip reason and the first 3 warnings, then the last $RUN_TAIL lines (default 3).
run() {
  local name="$1" log="$LOG_DIR/$1.log" rc=0 t0 tail_n="${RUN_TAIL:-3}"; shift
  cur_cmd="$(quote_args "$@")"
  open_log "$log"
  start_ticker "$log" "$name"
  t0="$(date +%s.%N)"
  if [ "$1" = python ] && [ -n "$preload_pid" ]; then
    python -m deploykit.zygote run "${@:2}" >&8 2>&1 || rc=$?  # the same command, preloaded
  else
    # not forked by the server (bash 5_quantize.sh, ...): its imports wait meanwhile
    [ -z "$preload_dir" ] || : > "$preload_dir/hold.run_all" 2>/dev/null || true
    "$@" >&8 2>&1 || rc=$?
    [ -z "$preload_dir" ] || rm -f "$preload_dir/hold.run_all"
  fi
  exec 8>&-
  printf '%s\t%s\n' "$name" "$(awk -v a="$t0" -v b="$(date +%s.%N)" \
    'BEGIN { printf "%.1f", b - a }')" >> "$TIMES" 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    stop_ticker
    echo "  FAILED: $cur_cmd" >&2
    log_text "$log" | tail -n 25 | sed 's/^/  | /' >&2
    echo "  full log: $log" >&2
    echo "  after fixing it, resume with: $(resume_cmd "$cur_stage")" >&2
    [ "$rc" = 2 ] && exit 2  # the stage's usage error stays one (bad input, not a crash)
    exit 1
  fi
  stop_ticker
  cur_cmd=""
  # every skip (a result: something was not made, and why), the first 3 warnings; a long line
  # (a pasteable command in it) is cut visibly, pointing at the log that has it whole
  { log_text "$log" | grep -E '(^|: )SKIPPED' || true
    log_text "$log" | grep -E '(^|: )WARNING' | head -n 3 || true; } \
    | awk -v lf="$log" '{ if (length($0) > 300) print "  " substr($0, 1, 300) " ... (whole line in " lf ")"; else print "  " $0 }' || true
  log_text "$log" | grep -v -E '(^|: )(SKIPPED|WARNING)' | tail -n "$tail_n" | sed 's/^/  /' || true
}

# A command that must fail (a failure reproduction): its failure is the expected result.
run_expect_failure() {
  local log="$LOG_DIR/$1.log" rc=0; shift
  open_log "$log"
  "$@" >&8 2>&1 || rc=$?
  exec 8>&-
  if [ "$rc" = 0 ]; then
    echo "  NOTE: expected failure did not reproduce (fixed upstream?): $(quote_args "$@")"
  else
    echo "  expected failure reproduced: $(grep -m1 -E 'FAILED|Error' "$log" | cut -c1-160)"
  fi
}

# Every stage script is part of the checkout: a missing one is an error, not a skip.
have() {
  if [ -e "$1" ]; then return 0; fi
  echo "  FAILED: $1 is missing from this checkout (git status / git checkout -- $1)" >&2
  exit 1
}

# Stage 0 prepares ImageNet images: a model with its own data has its npz files instead.
classifier_only() {
  if [ "$custom" = 1 ]; then
    echo "  not applicable: $MODEL has its own data (${INPUTS:-synthetic samples of INPUT_SHAPE})"
    return 1
  fi
  return 0
}

begin() { # begin N "what: inputs -> outputs"
  stage_start=$SECONDS
  cur_stage="$1"
  cur_what="${2%%:*}"
  echo "Stage $1: $2"
}
end() { echo "Stage $1: finished [elapsed=$((SECONDS - stage_start))s]"; }
want() { [ "$stage" -le "$1" ] && [ "$stop_stage" -ge "$1" ]; }

echo "run_all.sh: model=$MODEL ($model_kind: $kind_note) stages $stage..$stop_stage $(date -u +%FT%TZ)" \
  "(artifacts: $ART_ROOT, results: $RES_ROOT${limit:+; smoke run on $limit images})"
if [ -n "$limit" ]; then
  echo "run_all.sh: smoke run: what it leaves out of a full run: every image after the first" \
    "$limit of each split; calibration beyond $SMOKE_CALIB samples; stage-2 checks beyond" \
    "$SMOKE_CHECK images and the true-FP16 run beyond one sample; timed loops beyond 2 + 20" \
    "runs; INT8 variants but $SMOKE_VARIANT and INT4 (unless --all-variants); the verdict's" \
    "interleaved re-timing (8_report.py --retime). Its rows are no accuracy figures: rerun" \
    "without --limit for those"
fi

# A classifier's images must be there before anything runs or moves: stage 0's own listing
# (deploykit.data.images.list_images: the folder, its layout, its labels) runs first.
data_dir="${VAL_ROOT:-data/imagenet-sample-1k}"
if [ "$custom" = 0 ] && want 0; then
  if ! python - "$data_dir" <<'EOF'
import contextlib, io, os, sys
from deploykit.errors import StageError
from deploykit.data.images import list_images
root = sys.argv[1]
why = (f"data folder {root} does not exist" if not os.path.exists(root) else
       f"{root} is not a folder" if not os.path.isdir(root) else None)
if why is not None:
    sys.exit(f"run_all.sh: {why}; nothing was run or moved: set VAL_ROOT to the ImageNet val "
             "folder, or unset it for the embedded sample")
try:
    with contextlib.redirect_stderr(io.StringIO()):  # its warnings: stage 0 prints them
        list_images(root, None, os.environ.get("ALLOW_CLASS_SUBSET", "") not in ("", "0"))
except (StageError, OSError) as e:
    sys.exit(f"run_all.sh: stage 0 cannot use {root}: {e}; nothing was run or moved")
EOF
  then
    exit 2
  fi
fi

# A full run replaces the model's results: rows of an earlier run (other variants, another
# machine) must not mix into this run's report. They are moved, not deleted.
if [ "$stage" = 0 ] && [ "$stop_stage" = 8 ] && [ -d "$RES_DIR" ] && \
   [ -n "$(ls -A "$RES_DIR" 2>/dev/null)" ]; then
  prev="$ART_ROOT/previous_results/$MODEL_TAG-$(date -u +%Y%m%dT%H%M%SZ)"
  mkdir -p "$(dirname "$prev")"
  mv "$RES_DIR" "$prev"
  echo "previous results of $MODEL moved to $prev"
fi

# what the reference pass (stage 1) runs on
if [ "$custom" = 1 ]; then
  eval_data="${INPUTS:-synthetic samples of INPUT_SHAPE (latency only)}"
  data0="not applicable ($MODEL has its own data)"
else
  eval_data="eval split"
  data0="${VAL_ROOT:-data/imagenet-sample-1k} -> $ART_ROOT/splits.json + cache"
fi

if want 0; then
  begin 0 "prepare data: $data0"
  if classifier_only; then
    run 0_prepare_data python 0_prepare_data.py --model "$MODEL" "${lim[@]}" "${tune[@]}"
  fi
  end 0
fi

if want 1; then
  begin 1 "PyTorch FP32 baseline: $eval_data -> $ART/ref_{logits,outputs}.npz, $RES_DIR/pytorch_fp32_cpu.json"
  run 1_pytorch_baseline python 1_pytorch_baseline.py --model "$MODEL" "${lim[@]}" "${timing[@]}" \
    "${shape_args[@]}" "${data_args[@]}" "${weights[@]}"
  end 1
fi

if want 2; then
  begin 2 "ONNX export: PyTorch -> $ONNX_DIR/fp32.onnx, fp16.onnx (+ parity check)"
  run 2_export_onnx python 2_export_onnx.py --model "$MODEL" "${shape_args[@]}" "${weights[@]}" \
    "${smoke_export[@]}"
  end 2
fi

if want 3; then
  begin 3 "ONNX Runtime eval: $ONNX_DIR/{fp32,fp16}.onnx -> $RES_DIR/ort_{fp32,fp16}.json"
  export_out="$(python variants.py list --stage 3)"
  mapfile -t export_variants <<<"$export_out"
  for v in "${export_variants[@]}"; do
    run "3_onnx_eval_$v" python 3_onnx_eval.py --model "$MODEL" \
      --onnx "$ONNX_DIR/${ONNX_FILE[$v]}" --tag "${ORT_TAG[$v]}" "${lim[@]}" "${timing[@]}"
  done
  end 3
fi

if want 4; then
  begin 4 "calibration data: calib split -> $ART/calib.npz"
  if have 4_make_calib.py; then
    if [ "$custom" = 1 ]; then
      run 4_make_calib python 4_make_calib.py --model "$MODEL" "${calib_args[@]}" \
        "${smoke_calib[@]}"
    else
      run 4_make_calib python 4_make_calib.py --model "$MODEL" "${smoke_calib[@]}"
    fi
  fi
  end 4
fi

if want 5; then
  begin 5 "quantization: $ONNX_DIR/fp32.onnx -> $(python variants.py list --stage 5 "${auto[@]}" | tr '\n' ' ')(+ ORT eval of each)"
  if have 5_quantize.sh; then
    # Stage-5 variants from the registry (variants.py)
    all_flag=()
    if [ "$all_variants" = 1 ]; then all_flag=(--all); fi
    variants_out="$(python variants.py list --stage 5 "${all_flag[@]}" "${auto[@]}")"
    mapfile -t variants <<<"$variants_out"
    if [ -n "$limit" ] && [ "$all_variants" = 0 ] && [ -z "$tune_fraction" ]; then
      # a smoke run makes one INT8 variant: say what it leaves out
      echo "  smoke run (--limit $limit): $SMOKE_VARIANT only, calibrated on at most" \
        "$SMOKE_CALIB samples; left out: $(printf '%s ' "${variants[@]}" |
        sed "s/\b$SMOKE_VARIANT\b //")(--all-variants makes them too)"
      variants=("$SMOKE_VARIANT")
    fi
    # INT4 (5b_quantize_int4.py) only in a full run or with --all-variants
    stage5=()
    for v in "${variants[@]}"; do
      if [ "$v" != int4 ]; then
        stage5+=("$v")
      elif { [ -z "$limit" ] || [ "$all_variants" = 1 ]; } && have 5b_quantize_int4.py; then
        stage5+=(int4)
      fi
    done
    # The whole stage in one process: every ModelOpt variant (the calibration file read,
    # checked and planned once; variants that differ only in their high-precision dtype share
    # one calibration), INT4 through 5b, then each file's ORT row (--eval: 3_onnx_eval.py's
    # row, in that process); it ends with one line per row
    if [ "${#stage5[@]}" -gt 0 ]; then
      n_rows=0  # the stage's last lines: one per row (a failure reproduction has none)
      for v in "${stage5[@]}"; do [ "$v" = int4_cli_broken ] || n_rows=$((n_rows + 1)); done
      RUN_TAIL="$n_rows" run 5_quantize bash 5_quantize.sh --model "$MODEL" \
        "${stage5[@]}" --eval --eval-args="$(quote_args "${lim[@]}" "${timing[@]}")"
    fi
    for v in "${stage5[@]}"; do
      if [ "$v" = int4_cli_broken ]; then
        # Reproduces ModelOpt 0.47.0's INT4 axis bug on purpose: ORT must refuse to run it.
        run_expect_failure "3_onnx_eval_$v" python 3_onnx_eval.py --model "$MODEL" \
          --onnx "$ONNX_DIR/${ONNX_FILE[$v]}" --tag "${ORT_TAG[$v]}" "${lim[@]}" "${timing[@]}"
      fi
    done
  fi
  end 5
fi

if want 6; then
  begin 6 "TensorRT engines: $ONNX_DIR/*.onnx -> $ART/engines/*.plan (skips without TensorRT)"
  if have 6_build_engines.sh; then
    run 6_build_engines bash 6_build_engines.sh
    if [ -n "$tune_fraction" ]; then  # variants made only by this option (int8_auto)
      opt_out="$(comm -13 <(python variants.py list --stage 6 | sort) \
        <(python variants.py list --stage 6 --auto-precision | sort))"
      if [ -n "$opt_out" ]; then
        mapfile -t opt_variants <<<"$opt_out"
        run 6_build_engines_auto bash 6_build_engines.sh "${opt_variants[@]}"
      fi
    fi
  fi
  end 6
fi

if want 7; then
  begin 7 "TensorRT eval: $ART/engines/*.plan -> $RES_DIR/trt_*.json (skips without TensorRT)"
  if have 7_trt_eval.py; then
    trt_out="$(python variants.py list --stage 7 "${auto[@]}")"
    trt_variants=()
    [ -z "$trt_out" ] || mapfile -t trt_variants <<<"$trt_out"
    # every engine in one process, one after another (each row records, and reruns as, its
    # own one-engine command); it ends with one line per row
    engines=()
    for v in "${trt_variants[@]}"; do
      engines+=(--engine "$ART/engines/$v.plan" --tag "${TRT_TAG[$v]}")
    done
    if [ "${#engines[@]}" -gt 0 ]; then
      RUN_TAIL="${#trt_variants[@]}" run 7_trt_eval python 7_trt_eval.py --model "$MODEL" \
        "${engines[@]}" "${lim[@]}" "${timing[@]}"
    fi
  fi
  end 7
fi

if want 8; then
  begin 8 "report: $RES_DIR/*.json -> $RES_DIR/REPORT.md, REPORT.csv, $RES_ROOT/REPORT.md"
  # a full run's verdict ranks the CPU rows by an interleaved re-timing (a smoke run's by
  # its rows' own 20-run p50s: it leaves the re-timing out, and says so above)
  retime=(--retime)
  if [ -n "$limit" ]; then retime=(); fi
  run 8_report python 8_report.py --model "$MODEL" "${retime[@]}"
  end 8
  echo "report: $RES_DIR/REPORT.md"
fi
echo "run_all.sh: finished [elapsed=${SECONDS}s]"
