#!/usr/bin/env bash
# Installs the system packages ebb's build and tests use, when missing:
# libzmq (ZeroMQ for cgo), Python's zmq and msgpack (the example client and
# its test), and NVRTC 11.8 from Debian non-free (compiles the CUDA kernels
# in CI, where there is no GPU). Safe to run again; does nothing when all is there.
set -euo pipefail

need=()
for pkg in libzmq3-dev pkg-config python3-zmq python3-msgpack libnvrtc11.2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: please install ${need[*]} (no apt-get here)" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"

# libnvrtc11.2 lives in Debian's non-free component.
if printf '%s\n' "${need[@]}" | grep -q nvrtc; then
  src=/etc/apt/sources.list.d/debian.sources
  if [ -f "$src" ] && ! grep -q 'non-free' "$src"; then
    $sudo sed -i 's/^Components: main$/Components: main contrib non-free/' "$src"
  fi
fi
echo "install-deps: installing ${need[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null || {
  # NVRTC is optional (its test skips without it); the rest is not.
  rest=()
  for p in "${need[@]}"; do [ "$p" = libnvrtc11.2 ] || rest+=("$p"); done
  [ ${#rest[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${rest[@]}" >/dev/null
}
