#!/usr/bin/env bash
# The browser test drives Debian's chromium through Playwright (a browser download by Playwright
# itself cannot work here). Installed when missing and this runs as root with apt; otherwise the
# browser test skips and says why.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[racon] installing Debian's chromium for the browser test (apt-get)..."
  if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/tmp/racon-chromium-apt.log 2>&1; then
    echo "[racon] apt-get install chromium failed (log: /tmp/racon-chromium-apt.log); the browser test will skip" >&2
  fi
else
  echo "[racon] chromium is not installed and this is not root with apt: the browser test will skip" >&2
fi
