#!/usr/bin/env bash
# The GPU check for a one-GPU NVIDIA machine (issue 25, item 6): one prepared command of at most
# 10 minutes, with nvcc, Python 3.12, numpy, psutil, httpx and nvidia-ml-py there, and no network.
# What travels (at most 64 MiB): this checkout plus var/device-check/llama.cpp, the trimmed
# llama.cpp tree (scripts/trim-llama-tree.sh, run beforehand on a machine with the source; ~33 MiB).
# It never needs RACoN's controller: a bare llama-server serves the streams.
#   1. builds llama.cpp with CUDA for this GPU's architecture only (-j16) through
#      scripts/build-llama.sh (RACON_LLAMA_BACKENDS=cuda: the same script, key and patches as a node);
#   2. writes a random-weight model of SmolLM2's shape with gguf-py (the 98 MB model cannot travel);
#   3. runs the agent's device inventory: ggml (in a child process) and NVML must see the same GPU;
#   3b. runs the GPU speed challenge on CUDA0 as the controller would, in its two phases (the
#      agent's ggml child prepares the seeded inputs on the GPU untimed; only the nonce's product
#      B·D·Aᵀ is timed, to its digest; the residues then match the digest and pass Freivalds'):
#      at the controller's default size and at the largest the agent accepts;
#   4. times a prompt pass on the GPU through llama-server (what a GPU speed claim stands for);
#   5. runs llama-server with every layer on CUDA0 at 1, 16 and 64 concurrent streams.
# Usage: scripts/device-check.sh [TREE]   (exit 0: every step ran, the inventory matched and the
# GPU challenge's products were right)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
tree=${1:-$root/var/device-check/llama.cpp}
work=${DEVICE_CHECK_DIR:-/tmp/racon-device-check}
PY=${PYTHON:-python3}
started=$(date +%s)
say() { echo "[device-check +$(($(date +%s) - started))s] $*"; }
[ -f "$tree/CMakeLists.txt" ] || { echo "no llama.cpp tree at $tree: run scripts/trim-llama-tree.sh first" >&2; exit 2; }
mkdir -p "$work/cache/src/llama_cpp_python-${LLAMA_CPP_VERSION:-0.3.36}/vendor"
ln -sfn "$tree" "$work/cache/src/llama_cpp_python-${LLAMA_CPP_VERSION:-0.3.36}/vendor/llama.cpp"
say "machine: $(nvidia-smi --query-gpu=name,memory.total,compute_cap,driver_version --format=csv,noheader 2>&1 | head -1); nvcc $(nvcc --version | tail -1)"
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
export RACON_CACHE="$work/cache" RACON_LLAMA_BACKENDS=cuda RACON_BUILD_JOBS=16
export RACON_CUDA_ARCHITECTURES=${cap:-native}
say "1. building llama.cpp (CPU + RPC + CUDA for sm_${RACON_CUDA_ARCHITECTURES}) with -j16"
prefix=$("$here/build-llama.sh" | tail -n1)
if ! grep -qw cuda "$prefix/BACKENDS" 2>/dev/null; then
  say "FAIL: the CUDA build fell back to $prefix; its log:"; tail -40 "$work"/cache/build/*cuda*.log 2>/dev/null
  exit 1
fi
say "built $prefix ($(cat "$prefix/BACKENDS")): $(ls "$prefix/lib" | tr '\n' ' ')"
say "2. writing the model"
PYTHONPATH="$tree/gguf-py" "$PY" "$here/device_check.py" model "$work/model.gguf" || exit 1
say "3. the agent's device inventory (ggml through $prefix, NVML)"
export RACON_LLAMA_SERVER="$prefix/bin/llama-server"
( cd "$root" && PYTHONPATH="$root" "$PY" "$here/device_check.py" inventory ); inv=$?
say "3b. the GPU speed challenge on CUDA0 (the agent's ggml child: prepare untimed, the nonce timed; digest + Freivalds)"
( cd "$root" && PYTHONPATH="$root" "$PY" "$here/device_check.py" gpu-challenge CUDA0 1024 1024 16384 900000 ); chal=$?
( cd "$root" && PYTHONPATH="$root" "$PY" "$here/device_check.py" gpu-challenge CUDA0 1024 1024 65536 ) || chal=1
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
say "4-5. llama-server, every layer on CUDA0, 64 slots"
"$prefix/bin/llama-server" -m "$work/model.gguf" --host 127.0.0.1 --port "$port" -ngl 99 \
  --device CUDA0 -np 64 -c $((64 * 640)) --cont-batching --log-verbosity 4 >"$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || break
  sleep 1
done
grep -E "CUDA0 (model|KV) buffer size|offloaded" "$work/server.log" | sed 's/^/  llama-server: /'
"$PY" "$here/device_check.py" gpu-timing "http://127.0.0.1:$port"
"$PY" "$here/device_check.py" streams "http://127.0.0.1:$port" 1 16 64
say "done in $(($(date +%s) - started)) s; inventory $([ $inv = 0 ] && echo PASS || echo FAIL); gpu challenge $([ $chal = 0 ] && echo PASS || echo FAIL)"
[ $inv = 0 ] && [ $chal = 0 ]
