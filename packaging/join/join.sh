#!/bin/sh
# RACoN: join this machine to the controller at @@CONTROLLER_URL@@ as a node.
#   curl -fsSL @@CONTROLLER_URL@@/join/<token> | sh            (arguments: | sh -s -- --node-name NAME)
#   (a LAN controller's line adds -k --pinnedpubkey sha256//<pin>: the same pin fetches the program)
# It finds Python 3.12+, then fetches and runs the join program (/join/<token>.py) with it, which
# installs the agent into ~/.racon-agent/venv from files the controller serves (sha256-checked),
# and starts `node-agent --foreground`. The token is never written to disk: the program reaches
# Python through a pipe, and the agent gets the token in its environment.
# Everything runs inside main, so the shell has read the whole script before it starts anything
# (nothing a child reads from stdin can eat the rest of a piped script).
# --- the standalone agent (issue 26): needs only sh, curl (or wget), tar and gzip ------------
# The controller picks the bundle this machine can run (GET /join/<token>/bundle.txt: key=value
# lines); the machine and the glibc are checked before anything is written, the download against
# its sha256; it is unpacked into ~/.racon-agent/bundles/<id> and ~/.racon-agent/agent points at
# it (a symlink switched atomically: `node-agent upgrade` does the same). RACON_JOIN_ROUTE=python
# takes the Python route; =bundle never falls back to it.
join_say() { echo "racon join: $*" >&2; }
join_fail() { code=$1; shift; echo "racon join: error: $*" >&2; exit "$code"; }
join_fetch() {  # URL [FILE]: to stdout or into FILE, with this line's pin when it has one
  if [ -n "${pin:-}" ]; then
    curl -fsSLk --pinnedpubkey "$pin" -H "Authorization: Join $token" -o "${2:--}" "$1"
  elif command -v curl >/dev/null 2>&1; then
    curl -fsSL -H "Authorization: Join $token" -o "${2:--}" "$1"
  elif command -v wget >/dev/null 2>&1; then
    wget -q --header "Authorization: Join $token" -O "${2:--}" "$1"
  else
    join_fail 1 "this line needs curl or wget"
  fi
}
join_sha256() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null 2>&1; then shasum -a 256 "$1" | cut -d' ' -f1
  else openssl dgst -sha256 -r "$1" | cut -d' ' -f1; fi
}
join_version_ge() {  # $1 >= $2, dotted numbers
  [ "$(printf '%s\n%s\n' "$1" "$2" | sort -t. -k1,1n -k2,2n -k3,3n | head -n1)" = "$2" ]
}
join_python_here() {
  for cand in "${RACON_PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$cand" ] || continue
    p=$(command -v "$cand" 2>/dev/null) || continue
    "$p" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1 && return 0
  done
  return 1
}
bundle_route() {
  [ "${RACON_JOIN_ROUTE:-}" = python ] && return 0
  home=${RACON_JOIN_HOME:-$HOME/.racon-agent}
  machine=${RACON_JOIN_MACHINE:-$(uname -m)}
  flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | tr -s ' \t' ',,' | sed 's/^,//; s/,$//')
  glibc=${RACON_JOIN_GLIBC:-$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')}
  tries=0
  while :; do
    answer=$(join_fetch "$controller/join/$token/bundle.txt?machine=$machine&flags=$flags&glibc=$glibc") || {
      rc=$?
      [ "$rc" = 90 ] && join_fail 1 "the controller's certificate does not match the pin in this line"
      # An HTTP error (curl 22, wget 8): a controller older than the bundle; the Python route.
      if [ "$rc" = 22 ] || [ "$rc" = 8 ]; then
        join_say "this controller serves no agent bundle; joining through Python 3.12+"
        return 0
      fi
      join_fail 1 "could not reach the controller at $controller; is it reachable from this machine?"
    }
    wait=$(printf '%s\n' "$answer" | sed -n 's/^wait=//p')
    [ -z "$wait" ] && break
    [ "$tries" = 0 ] && join_say "$(printf '%s\n' "$answer" | sed -n 's/^message=//p'); waiting"
    tries=$((tries + 1))
    [ "$tries" -gt 360 ] && join_fail 1 "the controller did not finish building the agent bundle in 30 minutes"
    sleep "$wait"
  done
  field() { printf '%s\n' "$answer" | sed -n "s/^$1=//p" | head -n1; }
  err=$(field error)
  if [ -n "$err" ]; then
    if [ "${RACON_JOIN_ROUTE:-}" != bundle ] && join_python_here; then
      join_say "$err"
      join_say "joining through this machine's Python 3.12+ instead"
      return 0
    fi
    code=$(field code)
    join_fail "${code:-6}" "$err"
  fi
  name=$(field name) sha=$(field sha256) size=$(field size) unpacked=$(field unpacked)
  b_machine=$(field machine) b_glibc=$(field glibc) version=$(field agent_version)
  # Before anything is written: the architecture, then the C library the bundle was built on.
  [ "$b_machine" = "$machine" ] || join_fail 6 "this machine is $machine, and the controller's agent bundle $name is built for $b_machine: nothing was installed"
  [ -n "$glibc" ] || join_fail 6 "this machine has no GNU C library (glibc), and the agent bundle needs glibc $b_glibc or newer: join through Python 3.12+ (RACON_JOIN_ROUTE=python)"
  join_version_ge "$glibc" "$b_glibc" || join_fail 6 "this machine's glibc is $glibc, and the agent bundle needs glibc $b_glibc or newer (the glibc of the machine it was built on): build one on a machine like this one with \`racon bundle build\` for the operator to upload, or join through Python 3.12+ (RACON_JOIN_ROUTE=python)"
  need=$((size + unpacked + 64 * 1048576))
  probe=$home
  while [ ! -d "$probe" ]; do probe=$(dirname "$probe"); done
  free=${RACON_JOIN_FREE_BYTES:-$(($(df -Pk "$probe" | awk 'NR==2 {print $4}') * 1024))}
  [ "$free" -ge "$need" ] || join_fail 4 "not enough disk space in $probe: the agent needs $(((need + 1048575) / 1048576)) MiB, $((free / 1048576)) MiB are free"
  created=""
  [ -d "$home" ] || created=1
  mkdir -p "$home/bundles"
  dl=$(mktemp -d "$home/.download-XXXXXX")
  undo() { rm -rf "$dl"; [ -z "$created" ] || rm -rf "$home"; }
  join_say "downloading the agent $version for $b_machine ($((size / 1048576)) MiB; no Python needed)"
  join_fetch "$controller$(field url)" "$dl/$name" || { undo; join_fail 1 "download of $name failed"; }
  got=$(join_sha256 "$dl/$name")
  [ "$got" = "$sha" ] || { undo; join_fail 5 "$name: sha256 mismatch (the controller lists $sha, the download is $got); nothing was installed"; }
  if [ -n "${pin:-}" ]; then
    join_fetch "$controller/join/$token/ca.pem" "$dl/controller-ca.pem" || { undo; join_fail 1 "could not fetch the controller's CA"; }
    mv "$dl/controller-ca.pem" "$home/controller-ca.pem"
    export RACON_CA_FILE="$home/controller-ca.pem"
  fi
  id=${name%.tar.gz}
  if [ ! -x "$home/bundles/$id/node-agent" ]; then
    mkdir "$dl/x"
    tar -xzf "$dl/$name" -C "$dl/x" || { undo; join_fail 1 "unpacking $name failed"; }
    rm -rf "$home/bundles/$id"
    mv "$dl/x/node-agent" "$home/bundles/$id"
  fi
  rm -rf "$dl"
  # One rename switches the link (a running agent keeps its files): mv -T, else remove and move.
  ln -sfn "bundles/$id" "$home/agent.new"
  mv -fT "$home/agent.new" "$home/agent" 2>/dev/null || { rm -f "$home/agent"; mv -f "$home/agent.new" "$home/agent"; }
  join_say "installed in $home/agent: node-agent $version with llama-server and ggml-rpc-server ($(du -sm "$home/bundles/$id" | cut -f1) MiB); a vLLM engine needs its own venv and the desktop app WebKitGTK, neither of which this installs"
  [ -z "${RACON_JOIN_NO_START:-}" ] || exit 0
  join_say "starting the agent in the foreground (Ctrl-C stops it; \`$home/agent/node-agent --help\` lists its commands)"
  RACON_ENROLLMENT_TOKEN=$token RACON_CONTROLLER_URL=$controller exec "$home/agent/node-agent" --foreground "$@"
}
main() {
  controller=@@CONTROLLER_URL_SH@@
  token=@@TOKEN_SH@@
  pin=@@PIN_SH@@
  # The standalone agent first (no Python needed); back here only for the Python route.
  bundle_route "$@"
  py=""
  for cand in "${RACON_PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$cand" ] || continue
    path=$(command -v "$cand" 2>/dev/null) || continue
    if "$path" -c 'import sys, venv, ensurepip; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      py=$path
      break
    fi
  done
  if [ -z "$py" ]; then
    echo "racon join: error: the RACoN agent needs Python 3.12 or newer with its venv module: install python3.12 and python3.12-venv (or set RACON_PYTHON=/path/to/python3.12), then run this line again" >&2
    exit 3
  fi
  if [ -n "$pin" ]; then
    # The controller's own CA: the pin checks its key (the program then carries the CA).
    program=$(curl -fsSLk --pinnedpubkey "$pin" "$controller/join/$token.py") || {
      [ $? = 90 ] && echo "racon join: error: the controller's certificate does not match the pin in this line" >&2 && exit 1
      program=""
    }
  elif command -v curl >/dev/null 2>&1; then
    program=$(curl -fsSL "$controller/join/$token.py") || program=""
  elif command -v wget >/dev/null 2>&1; then
    program=$(wget -qO- "$controller/join/$token.py") || program=""
  else
    program=$("$py" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=60).read().decode())' "$controller/join/$token.py") || program=""
  fi
  if [ -z "$program" ]; then
    echo "racon join: error: could not download the join program from $controller/join/…py; is the controller reachable from this machine?" >&2
    exit 1
  fi
  printf '%s\n' "$program" | RACON_JOIN_PYTHON="$py" "$py" - "$@"
}
main "$@"
