#!/usr/bin/env bash
# One cmake build of the llama.cpp that the pinned llama-cpp-python sdist vendors, with ggml-rpc,
# llama.cpp's own server and the RPC server. Cached under ~/.cache/racon/llama/<version>-<platform>,
# where <platform> names the machine, the CPU features compiled in, and the backends
# (scripts/platform-key.sh): such a build crashes on an older CPU, so it never travels between keys.
# Prints the build's prefix (bin/ and lib/) on its last line.
set -euo pipefail
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${RACON_CACHE:-$HOME/.cache/racon}
PIP=${PIP:-pip}
JOBS=${RACON_BUILD_JOBS:-$(nproc)}
key=$("$(dirname "$0")/platform-key.sh")
prefix="$CACHE/llama/$VERSION-$key"
if [ -x "$prefix/bin/llama-server" ] && [ -f "$prefix/lib/libllama.so.0" ] && [ -x "$prefix/bin/ggml-rpc-server" ]; then
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
build="${RACON_LLAMA_BUILD_DIR:-$CACHE/build/$VERSION-$key}"
mkdir -p "$build"
echo "building llama.cpp (llama-server, ggml-rpc-server, libllama with RPC) once into $prefix; about 8 minutes on 2 cores..." >&2
cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DGGML_RPC=ON $("$(dirname "$0")/platform-key.sh" --cmake) -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_BUILD_RPATH=$ORIGIN;$ORIGIN/../lib' ${RACON_CMAKE_ARGS:-} >"$build.configure.log" 2>&1 \
  || { tail -20 "$build.configure.log" >&2; exit 1; }
cmake --build "$build" -j"$JOBS" --target llama-server ggml-rpc-server llama mtmd >"$build.log" 2>&1 \
  || { tail -30 "$build.log" >&2; exit 1; }
tmp="$prefix.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp/bin" "$tmp/lib"
# Shared libraries as real files under every name (libggml.so, .so.0, .so.0.x.y), as the
# llama-cpp-python wheel ships them; the soname file is what libllama links against (FACTS.md).
for f in "$build"/bin/*.so*; do cp -L "$f" "$tmp/lib/"; done
cp "$build/bin/llama-server" "$build/bin/ggml-rpc-server" "$tmp/bin/"
printf '%s\n' "$key" >"$tmp/PLATFORM"
rm -rf "$prefix" && mv "$tmp" "$prefix"
echo "$prefix"
