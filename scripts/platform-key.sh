#!/usr/bin/env bash
# The platform of a llama.cpp build: OS, machine, the CPU features it is compiled for, and the
# backends. Two machines with the same key can share a build; a build never runs on another key.
#   platform-key.sh          prints the key
#   platform-key.sh --cmake  prints the cmake flags that compile for exactly those features
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
backends="cpu-rpc"
[ -n "${RACON_CMAKE_ARGS:-}" ] && backends="$backends-$(printf '%s' "$RACON_CMAKE_ARGS" | sha256sum | cut -c1-8)"
if [ "${1:-}" = "--cmake" ]; then
  echo "$cmake_args"
else
  echo "$os-$arch$feats-$backends"
fi
