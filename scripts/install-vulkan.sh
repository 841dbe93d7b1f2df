#!/usr/bin/env bash
# The GPU path's tests run llama.cpp's Vulkan backend on Mesa's lavapipe, a software Vulkan device
# on the CPU (FACTS.md): Debian's mesa-vulkan-drivers (the device), libvulkan-dev (loader and
# headers), glslc (the shader compiler) and spirv-headers (llama.cpp's Vulkan configure needs it).
# Installed when missing and this runs as root with apt, before the llama.cpp build, so that
# scripts/platform-key.sh detects Vulkan and the one build of the suite is cpu+rpc+vulkan.
# Otherwise the GPU tests skip outside CI (and fail under CI=true), naming this step.
set -euo pipefail
pkgs="mesa-vulkan-drivers libvulkan-dev glslc spirv-headers"
have() {
  command -v glslc >/dev/null 2>&1 && [ -f /usr/include/vulkan/vulkan.h ] \
    && [ -d /usr/include/spirv ] && ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1
}
if have; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[racon] installing the Vulkan build tools and Mesa's software Vulkan device for the GPU tests (apt-get: $pkgs)..."
  if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs) >/tmp/racon-vulkan-apt.log 2>&1; then
    echo "[racon] apt-get install $pkgs failed (log: /tmp/racon-vulkan-apt.log); llama.cpp is built without Vulkan and the GPU tests will skip (fail under CI)" >&2
  fi
else
  echo "[racon] $pkgs are not installed and this is not root with apt: llama.cpp is built without Vulkan and the GPU tests will skip" >&2
fi
