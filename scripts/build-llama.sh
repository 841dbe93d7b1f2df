#!/usr/bin/env bash
# One cmake build of the llama.cpp that the pinned llama-cpp-python sdist vendors, with ggml-rpc,
# llama.cpp's own server and the RPC server, plus every GPU backend this machine has (CUDA, Vulkan,
# Metal, HIP: scripts/platform-key.sh detects them; RACON_LLAMA_BACKENDS=cpu|vulkan|cuda,... picks).
# Cached under ~/.cache/racon/llama/<version>-<platform>, where <platform> names the machine, the
# CPU features compiled in, and the backends (a Vulkan build's directory ends in -cpu-rpc-vulkan):
# such a build crashes on an older CPU, so it never travels between keys.
# When the build with a GPU backend fails, the CPU + RPC build is made instead, with one line
# naming the backend and the log file: the node still joins, without that GPU.
# Prints the build's prefix on its last line. Layout (stable: the standalone agent bundles it):
#   bin/llama-server, bin/ggml-rpc-server
#   lib/libllama.so*, libggml*.so* (a GPU build: the backends as modules, libggml-cpu.so,
#       libggml-rpc.so, libggml-vulkan.so, ..., linked from bin/ too, where ggml looks for them)
#   PLATFORM, BACKENDS
set -euo pipefail
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${RACON_CACHE:-$HOME/.cache/racon}
PIP=${PIP:-pip}
JOBS=${RACON_BUILD_JOBS:-$(nproc)}
here=$(cd "$(dirname "$0")" && pwd)
key=$("$here/platform-key.sh")
gpu=$("$here/platform-key.sh" --backends)
prefix="$CACHE/llama/$VERSION-$key"
built() {
  [ -x "$prefix/bin/llama-server" ] && [ -f "$prefix/lib/libllama.so.0" ] && [ -x "$prefix/bin/ggml-rpc-server" ] || return 1
  for b in $gpu; do [ -f "$prefix/lib/libggml-$b.so" ] || return 1; done
}
if built; then
  echo "$prefix"
  exit 0
fi
# One build per key at a time (make install, the controller's wheelhouse, a test): the second
# waits for the first, then finds its result.
mkdir -p "$CACHE/llama"
exec 9>"$CACHE/llama/.lock-$VERSION-$key"
flock 9
if built; then
  echo "$prefix"
  exit 0
fi
src="$CACHE/src/llama_cpp_python-$VERSION"
if [ ! -d "$src/vendor/llama.cpp" ]; then
  mkdir -p "$CACHE/src"
  echo "fetching the llama-cpp-python $VERSION source distribution..." >&2
  "$PIP" download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/src" >&2
  tar -xzf "$CACHE/src/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
fi
# Patches to the vendored tree, each saying why at its top (scripts/patches/, or beside this script
# where the join ships it). Idempotent: a patch already in the tree is skipped.
apply_patches() {
  local p
  for p in "$here"/patches/*.patch "$here"/*.patch; do
    [ -f "$p" ] || continue
    if patch -d "$src/vendor/llama.cpp" -p1 -R -s -f --dry-run <"$p" >/dev/null 2>&1; then
      continue
    fi
    patch -d "$src/vendor/llama.cpp" -p1 -N -s <"$p" >&2 || { echo "patch $p does not apply" >&2; return 1; }
  done
}
build="${RACON_LLAMA_BUILD_DIR:-$CACHE/build/$VERSION-$key}"
log="$build.log"
failed="$prefix.failed"
fallback() {
  echo "[racon] building llama.cpp with the ${gpu// /+} backend failed ($1; log: $log); using the CPU + RPC build instead (delete $failed to try again)" >&2
  printf '%s\n' "$1" "$log" >"$failed"
  RACON_LLAMA_BACKENDS=cpu exec "$here/build-llama.sh"
}
if [ -n "$gpu" ] && [ -f "$failed" ]; then
  # Failed before: one line, and no second long attempt on every make.
  log=$(sed -n 2p "$failed")
  fallback "$(sed -n 1p "$failed")"
fi
if [ -n "$gpu" ]; then
  apply_patches || fallback "its source patch did not apply"
fi
mkdir -p "$build"
echo "building llama.cpp (llama-server, ggml-rpc-server, libllama with RPC${gpu:+, ${gpu// /, }}) once into $prefix; about 8 minutes on 2 cores${gpu:+, more with a GPU backend}..." >&2
configure_ok=1
cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_RPC=ON $("$here/platform-key.sh" --cmake) -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_BUILD_RPATH=$ORIGIN;$ORIGIN/../lib' ${RACON_CMAKE_ARGS:-} >"$build.configure.log" 2>&1 \
  || configure_ok=0
if [ "$configure_ok" = 0 ]; then
  log="$build.configure.log"
  [ -n "$gpu" ] && fallback "cmake configure"
  tail -20 "$log" >&2
  exit 1
fi
# With GGML_BACKEND_DL the backends are module targets of their own (ggml-cpu, ggml-vulkan, ...).
targets="llama-server ggml-rpc-server llama mtmd"
[ -n "$gpu" ] && targets="$targets ggml-cpu ggml-rpc $(for b in $gpu; do printf 'ggml-%s ' "$b"; done)"
if ! cmake --build "$build" -j"$JOBS" --target $targets >"$log" 2>&1; then
  [ -n "$gpu" ] && fallback "compile"
  tail -30 "$log" >&2
  exit 1
fi
tmp="$prefix.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp/bin" "$tmp/lib"
# Shared libraries as real files under every name (libggml.so, .so.0, .so.0.x.y), as the
# llama-cpp-python wheel ships them; the soname file is what libllama links against (FACTS.md).
for f in "$build"/bin/*.so*; do cp -L "$f" "$tmp/lib/"; done
cp "$build/bin/llama-server" "$build/bin/ggml-rpc-server" "$tmp/bin/"
if [ -n "$gpu" ]; then
  # ggml_backend_load_all() looks for the backend modules beside the executable (and in the
  # working directory): link them into bin/. Python processes load them from lib/ explicitly
  # (agent/runtime/ggml.py, load_backends).
  for f in "$tmp"/lib/libggml-*.so; do
    case "$(basename "$f")" in libggml-base.so) continue ;; esac
    ln -s "../lib/$(basename "$f")" "$tmp/bin/$(basename "$f")"
  done
fi
printf '%s\n' "$key" >"$tmp/PLATFORM"
printf '%s\n' "cpu rpc $gpu" >"$tmp/BACKENDS"
rm -rf "$prefix" && mv "$tmp" "$prefix"
echo "$prefix"
