#!/usr/bin/env bash
# fp8c tune on a GPU, for several configurations in one kit: each tuned on the GPU, built with
# and without its record, and default against tuned step times printed. Two halves:
#
#   tools/gpu/tune_gpu.sh prepare [KIT]   here (no GPU): an fp8c without LLVM and the runtime
#                                         libraries (kit_lib.sh) into KIT (default
#                                         build-tune/kit); per configuration the GPU modules of
#                                         the defaults and of every candidate fp8c tune builds,
#                                         as `fp8c tune --list-candidates` names them (NVRTC,
#                                         cached in KIT/fp8c-cache); then memory_budget.sh's
#                                         search (MEMORY=0: not), which the kit carries; the
#                                         cache is packed last (fp8c-cache.tar.xz: 1.1 MiB
#                                         for all four configurations and the memory search,
#                                         86 MiB unpacked)
#   tools/gpu/tune_gpu.sh run KIT         on the GPU machine, from the repository root, per
#                                         configuration: fp8c tune (BUDGET seconds), fp8c build
#                                         with and without the record, then ROUNDS alternating
#                                         runs of STEPS steps of each; the medians and the
#                                         record's table (fp8c plan --tune)
#
# CONFIGS names the configurations, SIZE:-On each (kit_lib.sh: d12 is GPT-2 124M at batch 32,
# d48 GPT-2 1.5B at batch 8, both seq 1024): CONFIGS="d12:-O1 d12:-O3 d48:-O1". prepare's
# default is d12:-O1, run's the kit's own list (KIT/CONFIGS). PRECOMPILE names the
# configurations whose candidates prepare compiles (default: all of CONFIGS; the defaults'
# modules are compiled for every one): a configuration left out costs the GPU machine an NVRTC
# compilation per candidate (here, on two cores, 7 to 16 s each), out of tune's budget.
#
# run's knobs: BUDGET (tune's seconds, default 180; per configuration BUDGET_d48 or
# BUDGET_d48_O3 win), STEPS (30) and ROUNDS (3), LIMIT_S (560: a configuration whose BUDGET plus
# 150 s would end past LIMIT_S seconds from the start is skipped, so that a device call's
# 600 s limit ends no tune half-way). $OUT (else KIT/out) receives, per configuration,
# $OUT/d12_O1/ (record.tune, tune.log, build.log, the runs' logs, plan_tune.txt, summary.txt),
# and $OUT/summary.txt, every configuration's section. At the defaults a d12 configuration
# should take about 250 s (d12 -O1 tuned in 168 s of a 150 s budget, then six runs of 30
# steps), a d48 one more (not measured): two d12 configurations a call, or one d48.
#
# The GPU machine must have a C compiler (`cc`: fp8c links every binary it builds, candidates
# included) and the CUDA toolkit's libnvrtc and headers (/usr/local/cuda); run says so when not.
set -euo pipefail
cd "$(dirname "$0")/../.."
. tools/gpu/kit_lib.sh
MODE=${1:?usage: tune_gpu.sh prepare [KIT] | run KIT}

if [ "$MODE" = prepare ]; then
    KIT=${2:-build-tune/kit}
    KIT_ARG=$KIT
    CONFIGS=${CONFIGS:-d12:-O1}
    PRECOMPILE=${PRECOMPILE-$CONFIGS}
    for c in $CONFIGS; do kit_config "$c"; done   # every name checked before minutes of work
    mkdir -p "$KIT"
    KIT=$(cd "$KIT" && pwd)
    kit_build_fp8c "$KIT" "$(dirname "$KIT")/cmake"
    kit_unpack_cache "$KIT" "$KIT"   # a kit made before: its modules are hits
    export FP8C_CACHE_DIR=$KIT/fp8c-cache
    for c in $CONFIGS; do
        kit_config "$c"
        t0=$(date +%s)
        echo "$c: $KIT_MODEL $CFG_FLAGS: the GPU modules of the defaults$(
            case " $PRECOMPILE " in *" $c "*) echo " and of each candidate of fp8c tune" ;; esac)"
        kit_compile "$CFG_FLAGS"
        case " $PRECOMPILE " in
        *" $c "*)
            for choice in $("$KIT/fp8c" tune $KIT_MODEL $CFG_FLAGS --device cuda --list-candidates); do
                kit_compile "$CFG_FLAGS" "$choice"
            done ;;
        esac
        kit_trim_cache
        echo "$c: $(( $(date +%s) - t0 )) s; the cache holds $(du -sh "$FP8C_CACHE_DIR" | cut -f1)"
    done
    echo "$CONFIGS" > "$KIT/CONFIGS"
    [ "${MEMORY:-1}" = 0 ] || KIT_PACK=0 tools/gpu/memory_budget.sh search "$KIT"
    echo "the cache: $(du -sh "$FP8C_CACHE_DIR" | cut -f1) in $(find "$FP8C_CACHE_DIR" -type f | wc -l) modules; packing it"
    kit_pack_cache "$KIT"
    echo "the kit: $(du -sh "$KIT" | cut -f1), of which the packed cache $(du -h "$KIT/fp8c-cache.tar.xz" | cut -f1)"
    echo "ready: carry $KIT_ARG, then run tools/gpu/tune_gpu.sh run $KIT_ARG on the GPU machine"
    exit 0
fi

[ "$MODE" = run ] || { echo "usage: tune_gpu.sh prepare [KIT] | run KIT" >&2; exit 2; }
set +e   # from here each step says what failed itself
KIT=$(cd "${2:?usage: tune_gpu.sh run KIT}" && pwd)
RESULTS=${OUT:-$KIT/out}
mkdir -p "$RESULTS"
CONFIGS=${CONFIGS:-$(cat "$KIT/CONFIGS" 2>/dev/null || echo d12:-O1)}
STEPS=${STEPS:-30}
ROUNDS=${ROUNDS:-3}
LIMIT_S=${LIMIT_S:-560}
START=$(date +%s)
SUMMARY=$RESULTS/summary.txt
: > "$SUMMARY"
SECTION=/dev/null   # the configuration's own summary.txt, once there is one
say() { echo "$@" | tee -a "$SUMMARY" "$SECTION"; }
say "fp8c tune on the GPU, $(date -u +%Y-%m-%dT%H:%MZ); $(cat "$KIT/BUILD_INFO" 2>/dev/null); configurations: $CONFIGS"
kit_run_env || exit 1
BIN=$(mktemp -d)
KIT_DATA=$BIN/data.txt
kit_data "$KIT_DATA"

# One configuration (kit_config set): false after saying which step failed.
tune_config() {
    local dir=$RESULTS/$CFG_DIR budget which extra r log t0
    budget=$(kit_knob BUDGET 180)
    mkdir -p "$dir"
    SECTION=$dir/summary.txt
    : > "$SECTION"
    say ""
    say "== $c: $KIT_MODEL $CFG_FLAGS, tune budget $budget s"
    grep -qx -- "$c" <(tr ' ' '\n' < "$KIT/CONFIGS" 2>/dev/null) ||
        say "(not in the kit's CONFIGS: this machine compiles its GPU modules itself)"
    rm -f "$dir/record.tune"
    t0=$(date +%s)
    "$FP8C" tune $KIT_MODEL $CFG_FLAGS --device cuda --budget "$budget" -o "$dir/record.tune" 2> "$dir/tune.log" ||
        { say "fp8c tune failed:"; tail -20 "$dir/tune.log" | tee -a "$SUMMARY" "$SECTION"; return 1; }
    say "fp8c tune: $(( $(date +%s) - t0 )) s; $(tail -1 "$dir/tune.log")"
    grep -E "tune: (defaults|winners|[0-9]+ GEMMs)" "$dir/tune.log" | tee -a "$SUMMARY" "$SECTION"
    for which in default tuned; do
        extra=""
        [ $which = tuned ] && extra="--tune $dir/record.tune"
        "$FP8C" build $KIT_MODEL $CFG_FLAGS $extra -o "$BIN/$which" 2>> "$dir/build.log" ||
            { say "fp8c build ($which) failed:"; tail -5 "$dir/build.log" | tee -a "$SUMMARY" "$SECTION"; return 1; }
    done
    for r in $(seq 1 "$ROUNDS"); do
        for which in default tuned; do
            log=$dir/${which}_$r.jsonl
            kit_train "$BIN/$which" "$log" "$STEPS" ||
                { say "$which, round $r, did not run:"; tail -5 "${log%.jsonl}.out" | tee -a "$SUMMARY" "$SECTION"; return 1; }
            say "round $r $which: $(kit_median "$log" ms) ms a step (median of steps 6..$STEPS)"
        done
    done
    # the tuned binary times nothing at start-up: two runs give the same losses
    if [ "$ROUNDS" -ge 2 ]; then
        cmp <(grep -o '"loss":[^,]*' "$dir/tuned_1.jsonl") <(grep -o '"loss":[^,]*' "$dir/tuned_2.jsonl") >/dev/null &&
            say "tuned runs 1 and 2: the same losses, bit for bit" || say "tuned runs 1 and 2: the losses DIFFER"
    fi
    "$FP8C" plan $KIT_MODEL $CFG_FLAGS --tune "$dir/record.tune" | sed -n '/^tuning record/,$p' > "$dir/plan_tune.txt"
    grep -v "^gemm\." "$dir/plan_tune.txt" | tee -a "$SUMMARY" "$SECTION"
    say "GEMM problems: $(grep -c '^gemm\.' "$dir/plan_tune.txt") in the record (their rows: $CFG_DIR/plan_tune.txt)"
    grep "^gemm\." "$dir/plan_tune.txt" | head -8 | tee -a "$SUMMARY" "$SECTION"
}

status=0
for c in $CONFIGS; do
    kit_config "$c" || { SECTION=/dev/null; say ""; say "== $c: not SIZE:-On (d12:-O1, d48:-O3): skipped"; status=1; continue; }
    budget=$(kit_knob BUDGET 180)
    if [ $(( $(date +%s) - START + budget + 150 )) -gt "$LIMIT_S" ]; then
        SECTION=/dev/null
        say ""
        say "== $c: skipped: its tune budget ($budget s) and runs would end past LIMIT_S=$LIMIT_S s"
        status=1
        continue
    fi
    tune_config || status=1
    SECTION=/dev/null
done
rm -rf "$BIN"
say ""
say "done in $(( $(date +%s) - START )) s"
exit $status
