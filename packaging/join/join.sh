#!/bin/sh
# RACoN: join this machine to the controller at @@CONTROLLER_URL@@ as a node.
#   curl -fsSL @@CONTROLLER_URL@@/join/<token> | sh            (arguments: | sh -s -- --node-name NAME)
# It finds Python 3.12+, then fetches and runs the join program (/join/<token>.py) with it, which
# installs the agent into ~/.racon-agent/venv from files the controller serves (sha256-checked),
# and starts `node-agent --foreground`. The token is never written to disk: the program reaches
# Python through a pipe, and the agent gets the token in its environment.
# Everything runs inside main, so the shell has read the whole script before it starts anything
# (nothing a child reads from stdin can eat the rest of a piped script).
main() {
  controller=@@CONTROLLER_URL_SH@@
  token=@@TOKEN_SH@@
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
  if command -v curl >/dev/null 2>&1; then
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
