#!/usr/bin/env bash
# Install llama-cpp-python built with ggml-rpc into the venv, reusing a wheel built once per machine.
# pip's own wheel cache can hand back a build made without RPC (FACTS.md), so we keep our own
# wheelhouse and always verify llama_supports_rpc() after installing.
set -euo pipefail
VENV=${1:-.venv}
VERSION=${LLAMA_CPP_VERSION:-0.3.36}
WHEELHOUSE=${RACON_WHEELHOUSE:-$HOME/.cache/racon/wheels}
check() { "$VENV/bin/python" -c 'import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)' >/dev/null 2>&1; }
if check; then exit 0; fi
mkdir -p "$WHEELHOUSE"
wheel=$(ls "$WHEELHOUSE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  echo "building llama-cpp-python $VERSION with GGML_RPC=ON (a few minutes on 2 cores)..."
  CMAKE_ARGS="-DGGML_RPC=ON ${CMAKE_ARGS:-}" "$VENV/bin/pip" wheel --no-deps --no-cache-dir -w "$WHEELHOUSE" "llama-cpp-python==$VERSION"
  wheel=$(ls "$WHEELHOUSE"/llama_cpp_python-"$VERSION"-*.whl | head -n1)
fi
"$VENV/bin/pip" install -q --force-reinstall --no-deps "$wheel"
"$VENV/bin/pip" install -q "numpy>=1.20" "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
if ! check; then
  echo "error: the installed llama-cpp-python has no RPC support; remove $wheel and run again" >&2
  exit 1
fi
echo "llama-cpp-python $VERSION with RPC support is installed"
