#!/usr/bin/env bash
# Installs, builds and runs every test that needs no GPU (GPU tests carry the label gpu and
# skip themselves where no GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
cd build
ctest --output-on-failure -j"$(nproc)" "$@"
