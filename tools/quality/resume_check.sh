#!/usr/bin/env bash
# 100 steps straight against 50 steps, a stop, and 50 more resumed from the checkpoint: every
# logged value and the final checkpoint must be identical.
#   tools/quality/resume_check.sh BUILD_DIR [LEVEL]
set -euo pipefail
build=${1:?build dir}; level=${2:--O0}
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$build/fp8c" build "$root/models/gpt2_tiny.model" $level --batch 8 --seq 64 -o "$work/bin" 2>/dev/null
common="--data $root/data/gcide_sample.txt --steps 100 --warmup 10 --lr 3e-3 --seed 7 --eval-every 50"
"$work/bin" $common --log "$work/straight.jsonl" --out "$work/a" 2>/dev/null
"$work/bin" $common --stop-at 50 --log "$work/split.jsonl" --out "$work/b" 2>/dev/null
"$work/bin" $common --resume "$work/b" --log "$work/split.jsonl" --out "$work/b" 2>/dev/null
python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
a = [json.loads(l) for l in open(f"{w}/straight.jsonl")]
b = [json.loads(l) for l in open(f"{w}/split.jsonl")]
keys = ("loss", "lr", "grad_norm", "val_loss")
same = len(a) == len(b) == 100 and all(x.get(k) == y.get(k) for x, y in zip(a, b) for k in keys)
print(f"100 straight vs 50 + resume 50: {len(a)} and {len(b)} steps logged; "
      f"loss, lr, grad_norm, val_loss identical at every step: {same}; "
      f"final loss {a[-1]['loss']} / {b[-1]['loss']}, val {a[-1]['val_loss']} / {b[-1]['val_loss']}")
sys.exit(0 if same else 1)
PY
cmp "$work/a/step_000100.safetensors" "$work/b/step_000100.safetensors" && echo "step-100 checkpoints byte-identical"
