#!/usr/bin/env bash
# A trimmed copy of the llama.cpp tree that the pinned llama-cpp-python sdist vendors, for the
# device check (scripts/device-check.sh) on a GPU machine that only 64 MiB may travel to: ggml
# (the CPU, CUDA and RPC backends), src, common, include, cmake, vendor, gguf-py (writes the test
# model there) and tools/{server,rpc,mtmd,ui}, with tools/CMakeLists.txt cut down to those. The
# Vulkan-header patch is applied as build-llama.sh would. Out of git: var/ is ignored.
#   scripts/trim-llama-tree.sh [DEST]   (default var/device-check/llama.cpp); prints DEST and its size
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${RACON_CACHE:-$HOME/.cache/racon}
src="$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
dest=${1:-$here/../var/device-check/llama.cpp}
if [ ! -d "$src" ]; then
  echo "no llama.cpp source at $src: run make install (scripts/build-llama.sh fetches it) first" >&2
  exit 1
fi
rm -rf "$dest" && mkdir -p "$dest/tools" "$dest/scripts" "$dest/ggml/src"
cp "$src"/CMakeLists.txt "$src"/LICENSE "$dest/"
cp -r "$src"/src "$src"/common "$src"/include "$src"/cmake "$src"/vendor "$src"/gguf-py "$src"/licenses "$dest/"
cp "$src"/scripts/*.cmake "$dest/scripts/" 2>/dev/null || true
cp -r "$src"/ggml/CMakeLists.txt "$src"/ggml/cmake "$src"/ggml/include "$dest/ggml/"
# ggml/src without the backends the device check never enables (SYCL, OpenCL, Vulkan, Metal, ...).
for f in "$src"/ggml/src/*; do
  case "$(basename "$f")" in
    ggml-sycl | ggml-opencl | ggml-hexagon | ggml-metal | ggml-vulkan | ggml-cann | ggml-webgpu | \
      ggml-openvino | ggml-et | ggml-virtgpu | ggml-zdnn | ggml-musa | ggml-zendnn) ;;
    *) cp -r "$f" "$dest/ggml/src/" ;;
  esac
done
for t in server rpc mtmd ui; do
  cp -r "$src/tools/$t" "$dest/tools/"
done
rm -rf "$dest/tools/ui/tests" "$dest/tools/server/tests" "$dest/gguf-py/tests"
cat >"$dest/tools/CMakeLists.txt" <<'CM'
# Trimmed by RACoN's scripts/trim-llama-tree.sh: only what llama-server and ggml-rpc-server need.
llama_add_compile_flags()
if (LLAMA_BUILD_SERVER)
    add_subdirectory(ui)
    add_subdirectory(server)
endif()
add_subdirectory(mtmd)
if (GGML_RPC)
    add_subdirectory(rpc)
endif()
CM
# The top-level CMakeLists adds app/ unless LLAMA_BUILD_APP=OFF: an empty one keeps any configure valid.
mkdir -p "$dest/app" && echo "# trimmed by RACoN's scripts/trim-llama-tree.sh" >"$dest/app/CMakeLists.txt"
for p in "$here"/patches/*.patch; do
  [ -f "$p" ] || continue
  patch -d "$dest" -p1 -N -s --dry-run <"$p" >/dev/null 2>&1 && patch -d "$dest" -p1 -N -s <"$p" || true
done
echo "$dest ($(du -sh "$dest" | cut -f1))"
