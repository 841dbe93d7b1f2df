#!/usr/bin/env bash
# The desktop app (issue 31) is Tauri through pytauri-wheel: it needs WebKitGTK, GTK and the
# ayatana app indicator at run time, and its headless tests need Xvfb, a D-Bus session, a
# notification daemon, a tray host and Debian's WebKitWebDriver. Installed when missing and this
# runs as root with apt; otherwise tests/desktop skips and says why (under CI=true it fails).
set -euo pipefail
PKGS=(libwebkit2gtk-4.1-0 libgtk-3-0 libayatana-appindicator3-1 xvfb xauth dbus dunst trayer
      webkit2gtk-driver xdotool imagemagick)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} = 0 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[racon] installing the desktop app's packages (apt-get): ${missing[*]}"
  if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/tmp/racon-desktop-apt.log 2>&1; then
    echo "[racon] apt-get install of the desktop packages failed (log: /tmp/racon-desktop-apt.log); tests/desktop will skip (fail under CI)" >&2
  fi
else
  echo "[racon] the desktop packages are missing (${missing[*]}) and this is not root with apt: tests/desktop will skip" >&2
fi
