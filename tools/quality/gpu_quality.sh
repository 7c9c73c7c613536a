#!/usr/bin/env bash
# GPT-2 d12's quality on one GPU, the issue's bound: at each level (and any variant), STEPS steps
# of batch 16 x 1024 on the shared GCIDE corpus (byte level, the last 5% held out), SEEDS seeds,
# the final validation loss of every run, their mean, and the mean's difference to -O0's (each
# FP8 level within 0.5%). The settings are those of docs/results.md's quality table: lr 6e-4,
# 100 warm-up steps and a cosine, validation on 16 batches every STEPS / 4 steps. Two halves:
#
#   tools/quality/gpu_quality.sh prepare [DIR]   here (no GPU): the training binaries into
#                                                DIR/bin (default build-quality), the corpus
#                                                into DIR/data (13 MiB, gzip)
#   tools/quality/gpu_quality.sh run DIR         on the GPU machine, from the repository root:
#                                                the runs, PARALLEL at a time on the GPU, then
#                                                the table; logs and summary.txt to $OUT (else
#                                                DIR/out)
#
# knobs: LEVELS ("O0 O1 O2 O3"); VARIANTS, more builds as NAME=FLAGS separated by ';'
# (VARIANTS='O1h8=-O1 --precision gemm:wte*=e5m2' is -O1 with the output head in FP8; a
# variant is compared with -O0 as the levels are); prepare's BUILD (the fp8c build tree,
# default build), MODEL, BATCH and SEQ (models/gpt2.model, 16, 1024); run's SEEDS ("1 2"),
# STEPS (2000), WARMUP (100), PARALLEL (2: two trainings share the GPU, so the logs' tokens/s are not
# throughput figures), DEVICE (cuda; cpu for a smoke test of the script with a small MODEL),
# ONLY (the runs to make, as NAME:SEED words, e.g. "O2:1 O2:2"; default all), LIMIT_S (no run
# starts once LIMIT_S seconds are gone less RUN_S, its expected length: defaults 540 and 160).
# On an H200 (2026-11-29) a run of 2000 steps took about 150 s beside one other (70 ms a step)
# and 220 s beside two (108 ms): the GPU is the bound, some 75 s of it a run whatever PARALLEL
# is, so a device call of ten minutes holds six runs. The logs and the summary are packed into
# $OUT.tar.xz as runs end, so that a call cut short still returns them in one file.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?usage: gpu_quality.sh prepare [DIR] | run DIR}
LEVELS=${LEVELS:-O0 O1 O2 O3}
VARIANTS=${VARIANTS:-}

# NAME FLAGS lines: the levels, then the variants
builds() {
    for lv in $LEVELS; do echo "$lv -$lv"; done
    local IFS=';'
    for v in $VARIANTS; do
        v=${v# }
        [ -n "$v" ] && echo "${v%%=*} ${v#*=}"
    done
}

if [ "$MODE" = prepare ]; then
    DIR=${2:-build-quality}
    BUILD=${BUILD:-build}
    [ -x "$BUILD/fp8c" ] || { echo "gpu_quality.sh: no $BUILD/fp8c: build fp8c first (scripts/setup.sh)" >&2; exit 1; }
    corpus=${CORPUS:-/work/shared/data/gcide.txt.gz}
    [ -f "$corpus" ] || { echo "gpu_quality.sh: no corpus at $corpus (CORPUS=...)" >&2; exit 1; }
    mkdir -p "$DIR/bin" "$DIR/data"
    rm -f "$DIR"/bin/*
    builds | while read -r name flags; do
        # shellcheck disable=SC2086
        "$BUILD/fp8c" build "${MODEL:-models/gpt2.model}" $flags --batch "${BATCH:-16}" --seq "${SEQ:-1024}" \
            -o "$DIR/bin/d12_$name" 2>"$DIR/bin/build_$name.txt" ||
            { cat "$DIR/bin/build_$name.txt" >&2; exit 1; }
        echo "d12_$name: $flags"
    done
    strip --strip-debug "$DIR"/bin/d12_*
    builds > "$DIR/bin/BUILDS"
    echo "$(basename "${MODEL:-models/gpt2.model}" .model), batch ${BATCH:-16} x ${SEQ:-1024}" > "$DIR/bin/SHAPE"
    git log -1 --format=%H > "$DIR/bin/VERSION"
    cp "$corpus" "$DIR/data/corpus.txt.gz"
    du -sh "$DIR"
    exit 0
fi

[ "$MODE" = run ] || { echo "gpu_quality.sh: the mode is prepare or run, not $MODE" >&2; exit 2; }
DIR=${2:?usage: gpu_quality.sh run DIR}
[ -f "$DIR/bin/BUILDS" ] || { echo "gpu_quality.sh: $DIR has no binaries: run prepare first" >&2; exit 1; }
OUT=${OUT:-$DIR/out}
SEEDS=${SEEDS:-1 2}
STEPS=${STEPS:-2000}
PARALLEL=${PARALLEL:-2}
LIMIT_S=${LIMIT_S:-540}
RUN_S=${RUN_S:-160}
START=$SECONDS
mkdir -p "$OUT"
# The logs packed so far; runs still going change their logs as tar reads them (its status 1, which
# under set -e ended the script and with it the runs): what was read is kept, the next pack has more.
pack() {
    local rc=0
    tar cJf "$OUT.tar.xz.tmp" --warning=no-file-changed --exclude=corpus.txt -C "$(dirname "$OUT")" \
        "$(basename "$OUT")" || rc=$?
    if [ "$rc" -le 1 ]; then mv "$OUT.tar.xz.tmp" "$OUT.tar.xz"; fi
}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
corpus=$OUT/corpus.txt
[ -f "$corpus" ] || gunzip -c "$DIR/data/corpus.txt.gz" > "$corpus"
names=$(awk '{print $1}' "$DIR/bin/BUILDS")
jobs=()
for seed in $SEEDS; do for name in $names; do
    case " ${ONLY:-$name:$seed} " in *" $name:$seed "*) jobs+=("$name $seed") ;; esac
done; done
running=0
for job in "${jobs[@]}"; do
    read -r name seed <<< "$job"
    if [ $((SECONDS - START + RUN_S)) -gt "$LIMIT_S" ]; then
        echo "gpu_quality.sh: $((SECONDS - START)) s gone: d12_$name seed $seed not started (LIMIT_S $LIMIT_S)" | tee -a "$OUT/not_run.txt"
        continue
    fi
    log=$OUT/d12_${name}_s$seed
    "$DIR/bin/d12_$name" --data "$corpus" --device "${DEVICE:-cuda}" --steps "$STEPS" --warmup "${WARMUP:-100}" --lr 6e-4 --seed "$seed" \
        --eval-every $((STEPS / 4)) --eval-batches 16 --log "$log.jsonl" --overwrite > "$log.out" 2>&1 &
    running=$((running + 1))
    if [ "$running" -ge "$PARALLEL" ]; then wait -n || true; running=$((running - 1)); pack; fi
done
wait || true
python3 - "$OUT" "$(cat "$DIR/bin/VERSION")" "$(cat "$DIR/bin/SHAPE")" "$SEEDS" "$STEPS" $names <<'PY' | tee "$OUT/summary.txt"
import json, os, sys
out, version, shape, seeds, steps, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(), sys.argv[5], sys.argv[6:]
def final(name, seed):
    path = f"{out}/d12_{name}_s{seed}.jsonl"
    if not os.path.exists(path):
        return None
    vals = [json.loads(l).get("val_loss") for l in open(path) if l.startswith("{")]
    vals = [v for v in vals if v is not None]
    return vals[-1] if vals else None
print(f"{shape}, {steps} steps: final validation loss (binaries of {version[:7]})")
print("| build | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs -O0 |")
print("|---|" + "---|" * (len(seeds) + 2))
base = None
for name in names:
    v = [final(name, s) for s in seeds]
    got = [x for x in v if x is not None]
    mean = sum(got) / len(got) if len(got) == len(v) else None
    if name == "O0":
        base = mean
    diff = f"{100 * (mean / base - 1):+.2f}%" if mean is not None and base else ""
    cells = " | ".join(f"{x:.4f}" if x is not None else
                       "failed" if os.path.exists(f"{out}/d12_{name}_s{s}.jsonl") else "not run" for x, s in zip(v, seeds))
    print(f"| {name} | {cells} | {f'{mean:.4f}' if mean is not None else ''} | {diff} |")
PY
pack
