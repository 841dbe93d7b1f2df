#!/usr/bin/env bash
# The platform of a llama.cpp build: OS, machine, the CPU features it is compiled for, and the
# backends. Two machines with the same key can share a build; a build never runs on another key.
#   platform-key.sh          prints the key
#   platform-key.sh --cmake  prints the cmake flags that compile for exactly those features
#                            and backends
#   platform-key.sh --backends  prints the GPU backends to build (cuda vulkan metal hip), or nothing
# Backends are detected from what the machine has (RACON_LLAMA_BACKENDS overrides: "cpu" for none,
# or a list like "vulkan" or "cuda,vulkan"):
#   cuda    nvcc and an NVIDIA driver (a CUDA toolkit without a driver, as on the CI machine kind,
#           builds nothing it could run)
#   hip     ROCm's hipcc or hipconfig and its /dev/kfd
#   vulkan  a Vulkan loader (libvulkan.so), its headers (vulkan/vulkan.h) and glslc
#   metal   macOS
# On Linux a GPU build uses GGML_BACKEND_DL: every backend is a module loaded at start-up, so the
# build still runs (CPU + RPC) where a backend's runtime library (libcuda, libvulkan) is missing.
# On x86_64 the features come from /proc/cpuinfo instead of -march=native, because native also
# turns on AMX, which a VM can advertise without enabling: ggml's AMX kernels then die with
# SIGILL (seen on this machine kind). AMX is therefore never compiled in.
set -euo pipefail
os=$(uname -s | tr 'A-Z' 'a-z')
arch=$(uname -m)
flags=""
[ -r /proc/cpuinfo ] && flags=" $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2) "
has() { case "$flags" in *" $1 "*) return 0 ;; esac; return 1; }
feats=""
cmake_args=""
if [ "$arch" = "x86_64" ] && [ -n "$flags" ]; then
  cmake_args="-DGGML_NATIVE=OFF"
  # cpuinfo flag → ggml option, in the order ggml checks them
  for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx_vnni:AVX_VNNI \
    avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    flag=${pair%%:*} opt=${pair#*:}
    if has "$flag"; then
      feats="$feats-$flag"
      cmake_args="$cmake_args -DGGML_$opt=ON"
    else
      cmake_args="$cmake_args -DGGML_$opt=OFF"
    fi
  done
  cmake_args="$cmake_args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
else
  cmake_args="-DGGML_NATIVE=${GGML_NATIVE:-ON}"
  for f in neon asimd sve dotprod i8mm; do has "$f" && feats="$feats-$f"; done
fi
detect_backends() {
  local found=""
  if [ "$os" = "darwin" ]; then
    found="$found metal"
  fi
  if command -v nvcc >/dev/null 2>&1 && { [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; }; then
    found="$found cuda"
  fi
  if { command -v hipcc >/dev/null 2>&1 || command -v hipconfig >/dev/null 2>&1; } && [ -e /dev/kfd ]; then
    found="$found hip"
  fi
  # The loader is looked for where Debian and others put it, as join.py does, not through
  # `ldconfig -p | grep -q`: under pipefail that pipeline fails when grep quits early and ldconfig's
  # list is over a pipe's 64 KiB (SIGPIPE), as it is once the desktop's libraries are installed; a
  # CI run built llama.cpp without Vulkan that way. ldconfig is in /usr/sbin, off a user's PATH too.
  local loader=""
  for f in /usr/lib/*/libvulkan.so /usr/lib*/libvulkan.so /usr/local/lib/libvulkan.so; do
    [ -e "$f" ] && loader="$f"
  done
  if command -v glslc >/dev/null 2>&1 && [ -f /usr/include/vulkan/vulkan.h ] && [ -n "$loader" ]; then
    found="$found vulkan"
  fi
  echo "$found"
}
want="${RACON_LLAMA_BACKENDS:-auto}"
case "$want" in
  auto | "") gpu=$(detect_backends) ;;
  *)
    gpu=""
    for b in $(printf '%s' "$want" | tr ',' ' '); do
      case "$b" in
        cpu | rpc) ;;
        cuda | vulkan | metal | hip) gpu="$gpu $b" ;;
        *) echo "platform-key.sh: RACON_LLAMA_BACKENDS names an unknown backend '$b' (known: cpu, cuda, vulkan, metal, hip, auto)" >&2; exit 2 ;;
      esac
    done
    ;;
esac
gpu=$(printf '%s\n' $gpu | sort -u | tr '\n' ' ' | sed 's/^ *//; s/ *$//')
backends="cpu-rpc"
for b in $gpu; do
  backends="$backends-$b"
  case "$b" in
    cuda) cmake_args="$cmake_args -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${RACON_CUDA_ARCHITECTURES:-native}" ;;
    vulkan) cmake_args="$cmake_args -DGGML_VULKAN=ON" ;;
    metal) cmake_args="$cmake_args -DGGML_METAL=ON" ;;
    hip) cmake_args="$cmake_args -DGGML_HIP=ON" ;;
  esac
done
if [ -n "$gpu" ] && [ "$os" = "linux" ]; then
  cmake_args="$cmake_args -DGGML_BACKEND_DL=ON"
fi
[ -n "${RACON_CMAKE_ARGS:-}" ] && backends="$backends-$(printf '%s' "$RACON_CMAKE_ARGS" | sha256sum | cut -c1-8)"
if [ "${1:-}" = "--cmake" ]; then
  echo "$cmake_args"
elif [ "${1:-}" = "--backends" ]; then
  echo "$gpu"
else
  echo "$os-$arch$feats-$backends"
fi
