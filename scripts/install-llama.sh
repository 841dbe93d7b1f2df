#!/usr/bin/env bash
# Install llama-cpp-python with ggml-rpc into the venv from the one cached llama.cpp build
# (scripts/build-llama.sh): the Python package is installed without compiling (LLAMA_BUILD=OFF)
# and the build's shared libraries are placed in its llama_cpp/lib, where it loads them from.
# The same build provides bin/llama-server, the primary runtime (docs/design/serving.md).
# pip's own wheel cache can hand back a build made without RPC (FACTS.md), so we always verify
# llama_supports_rpc() after installing.
set -euo pipefail
VENV=${1:-.venv}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
here=$(cd "$(dirname "$0")" && pwd)
# A GPU build (GGML_BACKEND_DL) has its backends as modules in llama_cpp/lib, where ggml's own
# search (beside the executable, the working directory) does not look from Python: they are loaded
# from there first, as agent/runtime/ggml.py's load_backends does.
check() {
  "$VENV/bin/python" - >/dev/null 2>&1 <<'PY'
import ctypes, importlib.util, os, sys
lib = os.path.join(os.path.dirname(importlib.util.find_spec("llama_cpp").origin), "lib")
ggml = ctypes.CDLL(os.path.join(lib, "libggml.so.0"), mode=ctypes.RTLD_GLOBAL)
ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
if ggml.ggml_backend_reg_count() == 0:
    ggml.ggml_backend_load_all_from_path(lib.encode())
import llama_cpp
sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)
PY
}
prefix=$(PIP="$VENV/bin/pip" "$here/build-llama.sh" | tail -n1)
pkg=$("$VENV/bin/python" -c 'import importlib.util as u, os; s = u.find_spec("llama_cpp"); print(os.path.dirname(s.origin) if s else "")' 2>/dev/null || true)
same() { for f in "$prefix"/lib/*.so*; do cmp -s "$f" "$pkg/lib/$(basename "$f")" || return 1; done; }
if [ -n "$pkg" ] && check && same; then
  ln -sfn "$prefix" "$VENV/llama.cpp"
  exit 0
fi
src="${RACON_CACHE:-$HOME/.cache/racon}/src/llama_cpp_python-$VERSION"
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$VENV/bin/pip" install -q --no-deps --no-cache-dir --force-reinstall "$src"
"$VENV/bin/pip" install -q "numpy>=1.20" "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
pkg=$("$VENV/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("llama_cpp").origin))')
mkdir -p "$pkg/lib"
# Another build's libraries go first: a CPU build's libggml-rpc.so.0 beside a GPU build's module
# libggml-rpc.so would be a second ggml.
rm -f "$pkg"/lib/*.so*
cp -f "$prefix"/lib/*.so* "$pkg/lib/"
# The venv names the build it uses: the agent finds llama-server at .venv/llama.cpp/bin.
ln -sfn "$prefix" "$VENV/llama.cpp"
if ! check; then
  echo "error: the installed llama-cpp-python has no RPC support; remove $prefix and run again" >&2
  exit 1
fi
echo "llama-cpp-python $VERSION with RPC support is installed (backends: $(cat "$prefix/BACKENDS" 2>/dev/null || echo cpu rpc)); llama-server is $prefix/bin/llama-server"
