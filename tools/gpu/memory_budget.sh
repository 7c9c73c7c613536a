#!/usr/bin/env bash
# GPT-2 d48 (1.5B) at the largest batch whose memory plan fits an 80 GiB GPU, at -O1 and -O3,
# against batch 8. Two halves, with the kit of tune_gpu.sh (kit_lib.sh):
#
#   tools/gpu/memory_budget.sh search KIT   here (no GPU; tune_gpu.sh prepare runs it): per
#                                           level, bisection over the batch (seq 1024) on
#                                           `fp8c plan --json`'s peak_bytes; the batches go to
#                                           KIT/memory/batches, with the GPU modules of both
#                                           batches' defaults, and of the candidates of run's
#                                           tune (MEM_TUNE_PRECOMPILE=0: not), compiled into
#                                           KIT/fp8c-cache (packed at the end)
#   tools/gpu/memory_budget.sh run KIT      on the GPU machine: builds each level at its batch
#                                           and at batch 8, runs each MEM_STEPS (20) steps, and
#                                           prints tokens/s, ms a step, the memory the binary
#                                           reports and the most nvidia-smi saw in use; then,
#                                           when MEM_TUNE_BUDGET (default 240) seconds are
#                                           left before LIMIT_S (560), fp8c tune
#                                           --memory-budget for d48 -O3 at its batch
#
# The figure searched on is the one fp8c tune --memory-budget compares (compiler/main.c,
# tune_build): the memory plan's persistent state plus the step arena's peak, which `fp8c plan`
# prints as "peak memory of the step" and --json as peak_bytes; the training binary logs the
# same sum as mem_bytes (docs/training.md: the two arenas, allocated once). The binary's real
# footprint is more, by what the plan does not hold; MARGIN_GIB (default 2) of MEM_GIB (80) is
# kept for it, so that the plan's peak may be at most 78 GiB. The margin is an assumption, made
# of these (not measured here; run measures the sum on the H200, as nvidia-smi's use less the
# binary's mem_bytes):
#   - an "80 GB" H100 has 81,559 MiB, 79.6 GiB, of which the driver shows all as total:
#     0.4 GiB of the nominal 80 are not there;
#   - the CUDA context with its modules loaded (lazy loading, an fp8c binary's one cubin of
#     about 1 MiB): about 0.5 GiB on Hopper;
#   - the runtime's allocation beyond the plan's arenas (cuda/exec.c): cuBLASLt's workspace of
#     32 MiB, the kernels' scratch and the batched launch tables, tens of MiB; cuBLASLt's and
#     the driver's own allocations, assumed under 0.5 GiB;
#   - fragmentation: none worth a margin; the runtime makes one allocation per arena and the
#     plan packs each arena ahead of time.
# That is about 1.5 GiB; 2 GiB leaves a quarter of it spare. The bisection takes the peak to
# grow with the batch; it then checks the 8 batches above the one found, and takes a larger one
# that fits, saying so, when the peak is not monotone there (the loss's chunk count follows
# the batch).
#
# MEM_CHOICES (say "save.attention_inputs=0 save.cheap=0", the memory levers of docs/tuning.md)
# builds every binary, and plans every batch, with those choices: the largest batch the levers
# reach rather than the defaults'. Both halves must be given the same.
#
# run's tune uses --memory-budget TUNE_MEMORY_GIB, by default MEM_GIB - MARGIN_GIB: the same
# plan peak as the search, so that a candidate it lets win fits the card as the batch does.
# Results: $OUT/memory/ (the runs' logs, nvidia-smi's samples, the tune's record and log,
# summary.txt), the summary also appended to $OUT/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/kit_lib.sh
MODE=${1:?usage: memory_budget.sh search KIT | run KIT}
KIT=$(cd "${2:?usage: memory_budget.sh $MODE KIT}" && pwd)
MEM_GIB=${MEM_GIB:-80}
MARGIN_GIB=${MARGIN_GIB:-2}
LEVELS=${LEVELS:--O1 -O3}
CHOICE_FLAGS=""
for c in ${MEM_CHOICES:-}; do CHOICE_FLAGS="$CHOICE_FLAGS --choice $c"; done

# d48's plan peak in bytes at level L and batch B, into PEAK (not a $(...): a failed plan ends
# the search here, instead of reading as a batch that does not fit)
plan_peak() {
    PEAK=$("$KIT/fp8c" plan $KIT_MODEL "$1" $(kit_size_flags d48 "$2") $CHOICE_FLAGS --json |
           python3 -c 'import json, sys; print(json.load(sys.stdin)["peak_bytes"])') && [ -n "$PEAK" ] ||
        { echo "memory_budget.sh: fp8c plan failed for d48 $1 at batch $2" >&2; exit 1; }
}
fits() { plan_peak "$1" "$2"; [ "$PEAK" -le "$target" ]; }
gib() { python3 -c "print(f'{$1 / 2**30:.2f}')"; }

if [ "$MODE" = search ]; then
    [ -x "$KIT/fp8c" ] || kit_build_fp8c "$KIT" "$(dirname "$KIT")/cmake"
    [ -d "$KIT/fp8c-cache" ] || kit_unpack_cache "$KIT" "$KIT"
    export FP8C_CACHE_DIR=$KIT/fp8c-cache
    target=$(python3 -c "print(int(($MEM_GIB - $MARGIN_GIB) * 2**30))")
    mkdir -p "$KIT/memory"
    : > "$KIT/memory/batches"
    echo "d48: the largest batch whose plan peaks at most $MEM_GIB - $MARGIN_GIB GiB ($target bytes)"
    for level in $LEVELS; do
        lo=0 hi=8 n=0   # lo fits (0: none yet), hi does not; from 8 up by doubling
        while fits "$level" "$hi"; do
            lo=$hi hi=$(( hi * 2 )) n=$(( n + 1 ))
            [ $hi -le 4096 ] || { echo "d48 $level: batch 4096 still fits: no search" >&2; exit 1; }
        done
        while [ $(( hi - lo )) -gt 1 ]; do
            mid=$(( (lo + hi) / 2 )) n=$(( n + 1 ))
            if fits "$level" "$mid"; then lo=$mid; else hi=$mid; fi
        done
        [ $lo -gt 0 ] || { echo "d48 $level: not even batch 1 fits" >&2; exit 1; }
        for b in $(seq $(( lo + 1 )) $(( lo + 8 ))); do
            if fits "$level" "$b"; then
                echo "d48 $level: the peak is not monotone: batch $b fits above $lo"
                lo=$b
            fi
        done
        plan_peak "$level" $(( lo + 1 )); next=$PEAK
        plan_peak "$level" 8; p8=$PEAK
        plan_peak "$level" "$lo"; p=$PEAK
        echo "d48 $level: $(( n + 1 )) plans bisected, 8 checked above"
        echo "d48 $level: batch $lo, plan peak $(gib "$p") GiB (batch $(( lo + 1 )): $(gib "$next") GiB; batch 8: $(gib "$p8") GiB)"
        echo "$level $lo $p $p8" >> "$KIT/memory/batches"
        t0=$(date +%s)
        kit_compile "$level $(kit_size_flags d48 "$lo")$CHOICE_FLAGS"
        kit_compile "$level $(kit_size_flags d48 8)$CHOICE_FLAGS"
        if [ "$level" = -O3 ] && [ "${MEM_TUNE_PRECOMPILE:-1}" != 0 ]; then   # run's tune
            for choice in $("$KIT/fp8c" tune $KIT_MODEL "$level" $(kit_size_flags d48 "$lo") --device cuda --list-candidates); do
                kit_compile "$level $(kit_size_flags d48 "$lo")" "$choice"
            done
        fi
        kit_trim_cache
        echo "d48 $level: modules $(( $(date +%s) - t0 )) s; the cache holds $(du -sh "$FP8C_CACHE_DIR" | cut -f1)"
    done
    echo "$MEM_GIB $MARGIN_GIB" > "$KIT/memory/budget"
    [ "${KIT_PACK:-1}" = 0 ] || kit_pack_cache "$KIT"   # tune_gpu.sh prepare packs it itself
    exit 0
fi

[ "$MODE" = run ] || { echo "usage: memory_budget.sh search KIT | run KIT" >&2; exit 2; }
set +e   # from here each step says what failed itself
[ -s "$KIT/memory/batches" ] || { echo "$KIT/memory/batches: none; run memory_budget.sh search first" >&2; exit 1; }
read -r MEM_GIB MARGIN_GIB < "$KIT/memory/budget"
RESULTS=${OUT:-$KIT/out}
DIR=$RESULTS/memory
mkdir -p "$DIR"
MEM_STEPS=${MEM_STEPS:-20}
MEM_TUNE_BUDGET=${MEM_TUNE_BUDGET:-240}
TUNE_MEMORY_GIB=${TUNE_MEMORY_GIB:-$(python3 -c "print($MEM_GIB - $MARGIN_GIB)")}
LIMIT_S=${LIMIT_S:-560}
START=$(date +%s)
SUMMARY=$DIR/summary.txt
: > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY" "$RESULTS/summary.txt"; }
say ""
say "== memory: GPT-2 d48, the largest batch whose plan fits $MEM_GIB - $MARGIN_GIB GiB, against batch 8${MEM_CHOICES:+ (choices: $MEM_CHOICES)};" \
    "$(date -u +%Y-%m-%dT%H:%MZ); $(cat "$KIT/BUILD_INFO" 2>/dev/null)"
kit_run_env || exit 1
BIN=$(mktemp -d)
KIT_DATA=$BIN/data.txt
kit_data "$KIT_DATA"
GPU_INDEX=${GPU_INDEX:-0}   # the GPU nvidia-smi watches: the one the binary runs on
used_mib() { nvidia-smi -i "$GPU_INDEX" --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }

# One binary: LEVEL BATCH; a line of its numbers, then true when it ran.
measure() {
    local level=$1 batch=$2 name=d48_${1#-}_b$2 base mon peak tps ms mem
    "$FP8C" build $KIT_MODEL "$level" $(kit_size_flags d48 "$batch") $CHOICE_FLAGS -o "$BIN/$name" 2>> "$DIR/build.log" ||
        { say "d48 $level batch $batch: fp8c build failed:"; tail -5 "$DIR/build.log" | tee -a "$SUMMARY"; return 1; }
    base=$(used_mib)
    nvidia-smi -i "$GPU_INDEX" --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$DIR/$name.smi" &
    mon=$!
    kit_train "$BIN/$name" "$DIR/$name.jsonl" "$MEM_STEPS"
    local rc=$?
    kill "$mon" 2>/dev/null; wait "$mon" 2>/dev/null
    rm -f "$BIN/$name"
    [ $rc = 0 ] || { say "d48 $level batch $batch did not run:"; tail -5 "$DIR/$name.out" | tee -a "$SUMMARY"; return 1; }
    peak=$(sort -n "$DIR/$name.smi" | tail -1)
    case "$base$peak" in
    ''|*[!0-9]*) say "d48 $level batch $batch: nvidia-smi gave no memory in use ('$base', '$peak')"; base=0 peak=0 ;;
    esac
    ms=$(kit_median "$DIR/$name.jsonl" ms)
    tps=$(kit_median "$DIR/$name.jsonl" tokens_per_s)
    mem=$(python3 -c 'import json, sys; print(next(json.loads(l)["mem_bytes"] for l in open(sys.argv[1]) if l.startswith("{")))' \
          "$DIR/$name.jsonl")
    say "d48 $level batch $batch: $tps tokens/s, $ms ms a step (medians of steps 6..$MEM_STEPS);" \
        "the binary's memory $(gib "$mem") GiB; nvidia-smi's most in use $(gib "$(( peak - base )) * 2**20") GiB above the" \
        "$base MiB before it (that less the binary's: $(gib "($(( peak - base )) * 2**20 - $mem)") GiB)"
    eval "TPS_${level#-}_$batch=$tps"
}

while read -r level batch peak peak8 <&3; do   # fd 3: what the loop runs may read stdin
    say "d48 $level: batch $batch (plan peak $(gib "$peak") GiB) against batch 8 ($(gib "$peak8") GiB)"
    measure "$level" "$batch"
    measure "$level" 8
    a=TPS_${level#-}_$batch b=TPS_${level#-}_8
    [ -n "${!a:-}" ] && [ -n "${!b:-}" ] &&
        say "d48 $level: batch $batch makes $(python3 -c "print(f'{${!a} / ${!b}:.2f}')") times batch 8's tokens/s"
done 3< "$KIT/memory/batches"

line=$(grep '^-O3 ' "$KIT/memory/batches")
if [ -z "$line" ]; then
    say "no -O3 batch in the kit: no fp8c tune --memory-budget"
elif [ "$MEM_TUNE_BUDGET" = 0 ] || [ $(( $(date +%s) - START + MEM_TUNE_BUDGET + 120 )) -gt "$LIMIT_S" ]; then
    say "fp8c tune --memory-budget: skipped (MEM_TUNE_BUDGET=$MEM_TUNE_BUDGET s and LIMIT_S=$LIMIT_S s," \
        "$(( $(date +%s) - START )) s gone)"
else
    batch=$(echo "$line" | cut -d' ' -f2)
    flags="-O3 $(kit_size_flags d48 "$batch")"
    rec=$DIR/d48_O3_b$batch.tune
    rm -f "$rec"
    t0=$(date +%s)
    if "$FP8C" tune $KIT_MODEL $flags --device cuda --budget "$MEM_TUNE_BUDGET" --memory-budget "$TUNE_MEMORY_GIB" \
           -o "$rec" 2> "$DIR/tune.log"; then
        say "fp8c tune d48 -O3 batch $batch --memory-budget $TUNE_MEMORY_GIB: $(( $(date +%s) - t0 )) s; $(tail -1 "$DIR/tune.log")"
        grep -E "tune: (defaults|winners|[0-9]+ GEMMs|the fastest)" "$DIR/tune.log" | tee -a "$SUMMARY" "$RESULTS/summary.txt"
        "$FP8C" plan $KIT_MODEL $flags --tune "$rec" | sed -n '/^tuning record/,$p' > "$DIR/plan_tune.txt"
        grep -v "^gemm\." "$DIR/plan_tune.txt" | tee -a "$SUMMARY" "$RESULTS/summary.txt"
    else
        say "fp8c tune d48 -O3 batch $batch --memory-budget $TUNE_MEMORY_GIB failed:"
        tail -20 "$DIR/tune.log" | tee -a "$SUMMARY" "$RESULTS/summary.txt"
    fi
fi
rm -rf "$BIN"
say "memory: done in $(( $(date +%s) - START )) s"
