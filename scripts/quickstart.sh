#!/usr/bin/env bash
# Installs, builds, and trains models/gpt2_tiny.model on the bundled text (data/), byte by
# byte, printing the loss as it falls. About a minute on two cores. Each run starts over in
# out/ (--overwrite): the log and checkpoints are the last run's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
mkdir -p out
build/fp8c train models/gpt2_tiny.model --batch 16 --seq 128 -- \
  --data data/gcide_sample.txt --steps ${STEPS:-150} --warmup 20 --lr 3e-3 \
  --eval-every 50 --log out/quickstart.jsonl --out out/quickstart --overwrite
