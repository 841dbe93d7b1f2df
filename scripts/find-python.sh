#!/usr/bin/env bash
# Print a Python >= 3.12 interpreter (Django 6 needs it), or fail with one clear line.
set -u
ok() { "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
  [ -n "$cand" ] || continue
  path=$(command -v "$cand" 2>/dev/null) || continue
  if ok "$path"; then echo "$path"; exit 0; fi
done
# pyenv installs that are not the global version (their shims refuse to run).
for path in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
  [ -x "$path" ] && ok "$path" && { echo "$path"; exit 0; }
done
echo "error: RACoN needs Python 3.12 or newer (Django 6); install it or set PYTHON=/path/to/python3.12" >&2
exit 1
