#!/usr/bin/env bash
# Installs what ebb's build and tests use, when missing: libzmq (ZeroMQ for
# cgo), Python's zmq and msgpack (the example client and its test), PyTorch
# for the CPU (Debian's python3-torch: a real trainer process for the weight
# update tests), NVRTC 11.8 from Debian non-free (compiles the CUDA kernels
# in CI, where there is no GPU), and the OpenAI SDK for Node in .cache/npm
# (the tool-call test). Safe to run again; does nothing when all is there.
set -euo pipefail
cd "$(dirname "$0")/.."

# The OpenAI SDK test is skipped when this cannot be installed.
openai_sdk() {
  [ -d .cache/npm/node_modules/openai ] && return 0
  command -v npm >/dev/null 2>&1 || return 0
  mkdir -p .cache/npm
  timeout 300 npm install --prefix .cache/npm --no-audit --no-fund --silent openai@7.57.0 >/dev/null 2>&1 ||
    echo "install-deps: npm could not install openai (its test will skip)" >&2
}
openai_sdk

need=()
for pkg in libzmq3-dev pkg-config python3-zmq python3-msgpack python3-torch libnvrtc11.2; do
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
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || {
  # NVRTC is optional (its test skips without it); the rest is not.
  rest=()
  for p in "${need[@]}"; do [ "$p" = libnvrtc11.2 ] || rest+=("$p"); done
  [ ${#rest[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${rest[@]}" >/dev/null
}
