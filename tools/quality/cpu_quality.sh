#!/usr/bin/env bash
# Trains models/gpt2_tiny.model on the shared GCIDE corpus (byte level, last 5% held out) at
# each precision level with the same data, seed and schedule, and prints a table of final
# validation loss, its relative difference to -O0, and the plan's bytes per parameter.
#   tools/quality/cpu_quality.sh BUILD_DIR OUT_DIR [STEPS] [LEVELS...]
# LEVELS default: O0 O1 O2 O3 O3R (O3R = -O3 --grad-release).
set -euo pipefail
build=${1:?build dir}; out=${2:?output dir}; steps=${3:-600}; shift 3 || true
levels=("$@"); [ ${#levels[@]} -gt 0 ] || levels=(O0 O1 O2 O3 O3R)
root=$(cd "$(dirname "$0")/../.." && pwd)
corpus=${GCIDE:-$root/../shared/data/gcide.txt.gz}
mkdir -p "$out"
if [ ! -f "$out/gcide_val.bin" ]; then
  zcat "$corpus" > "$out/gcide.txt"
  "$build/fp8c-tokenize" "$out/gcide.txt" "$out/gcide" >/dev/null
  rm -f "$out/gcide.txt"
fi
B=${BATCH:-16}; T=${SEQ:-128}
for lv in "${levels[@]}"; do
  flags="-${lv%R}"; [ "${lv: -1}" = R ] && flags="$flags --grad-release"
  "$build/fp8c" build "$root/models/gpt2_tiny.model" $flags --batch "$B" --seq "$T" -o "$out/tiny_$lv" 2>"$out/build_$lv.txt"
  "$build/fp8c" plan "$root/models/gpt2_tiny.model" $flags --batch "$B" --seq "$T" --json > "$out/plan_$lv.json"
  start=$(date +%s)
  "$out/tiny_$lv" --data "$out/gcide_train_*.bin" --val "$out/gcide_val.bin" --steps "$steps" \
    --warmup $((steps / 20)) --lr ${LR:-3e-3} --seed 1 --eval-every $((steps / 4)) --eval-batches 32 \
    --log "$out/log_$lv.jsonl" --overwrite ${THREADS:+--threads $THREADS} 2> "$out/train_$lv.txt"
  echo "$lv $(( $(date +%s) - start ))" >> "$out/seconds.txt"
done
python3 - "$out" "${levels[@]}" <<'PY'
import json, sys
out, levels = sys.argv[1], sys.argv[2:]
secs = dict(l.split() for l in open(f"{out}/seconds.txt"))
rows, base = [], None
for lv in levels:
    val = [json.loads(l) for l in open(f"{out}/log_{lv}.jsonl") if '"val_loss"' in l][-1]
    plan = json.load(open(f"{out}/plan_{lv}.json"))
    if base is None: base = val["val_loss"]
    rows.append((lv, val["step"], val["val_loss"], (val["val_loss"] - base) / base * 100,
                 plan["bytes_per_param"], plan["peak_bytes"] / 2**20, int(secs[lv])))
print("| level | steps | val loss (nats/byte) | vs O0 | bytes/param | plan peak (MiB) | seconds |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:+.2f}% | {r[4]:.2f} | {r[5]:.1f} | {r[6]} |")
PY
