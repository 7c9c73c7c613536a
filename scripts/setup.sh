#!/usr/bin/env bash
# Installs what fp8c needs on a Debian machine (only what is missing) and builds it.
#   scripts/setup.sh [BUILD_DIR] [extra cmake flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true

need=()
command -v cc >/dev/null || need+=(build-essential)
command -v cmake >/dev/null || need+=(cmake)
command -v flex >/dev/null || need+=(flex)
command -v bison >/dev/null || need+=(bison)
[ -f /usr/include/cmocka.h ] || need+=(libcmocka-dev)
command -v llvm-config >/dev/null || need+=(llvm-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "fp8c: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build "$build" -j"$(nproc)"
