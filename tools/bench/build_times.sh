#!/usr/bin/env bash
# build_times.sh — how long `fp8c build` takes: GPT-2 d12 and d48 (and gpt2_tiny) at -O0..-O3.
#
#   tools/bench/build_times.sh [FP8C]        (default: build/fp8c; run from the source root)
#
# For each model and level, three builds into one fresh cache directory:
#   cold       the cache directory empty: every kernel compiled (NVRTC and LLVM), then linked;
#   kernels    the kernels cached but not the binary (an FP8C_ variable that nothing reads is
#              set, which changes the binary cache's key and nothing else): the passes, the
#              kernel rendering and lowering, the link;
#   unchanged  the same command again: the binary comes from the cache.
# Wall-clock seconds. The machine's other load shows in the figures: run it on a quiet machine
# and say which in docs/results.md. MODELS=tiny,d12,d48 and LEVELS=0,1,2,3 pick a subset.
set -euo pipefail

FP8C=${1:-build/fp8c}
MODELS=${MODELS:-tiny,d12,d48}
LEVELS=${LEVELS:-0,1,2,3}
work=$(mktemp -d "${TMPDIR:-/tmp}/fp8c-build-times-XXXXXX")
trap 'rm -rf "$work"' EXIT

flags_of() {
    case $1 in
        tiny) echo "models/gpt2_tiny.model --batch 16 --seq 128" ;;
        d12) echo "models/gpt2.model --batch 32 --seq 1024" ;;
        d48) echo "models/gpt2.model -D layers=48 -D dim=1600 -D heads=25 --batch 8 --seq 1024" ;;
        *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}

# seconds one build takes; its stderr goes to $work/log, and a failure ends the script
timed() {
    local t0 t1
    t0=$(date +%s.%N)
    if ! "$@" 2>"$work/log" >/dev/null; then
        cat "$work/log" >&2
        exit 1
    fi
    t1=$(date +%s.%N)
    awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'
}

echo "fp8c build times (s), $(nproc) cores, $(date -u +%Y-%m-%d), fp8c $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
printf "%-6s %-4s %8s %8s %10s\n" model level cold kernels unchanged
for model in ${MODELS//,/ }; do
    read -r -a flags <<<"$(flags_of "$model")"
    for level in ${LEVELS//,/ }; do
        cache="$work/cache-$model-$level"
        mkdir -p "$cache"
        cold=$(FP8C_CACHE_DIR="$cache" timed "$FP8C" build "${flags[@]}" -O"$level" -o "$work/bin")
        kernels=$(FP8C_CACHE_DIR="$cache" FP8C_BENCH_REBUILD=1 timed "$FP8C" build "${flags[@]}" -O"$level" -o "$work/bin")
        unchanged=$(FP8C_CACHE_DIR="$cache" timed "$FP8C" build "${flags[@]}" -O"$level" -o "$work/bin")
        printf "%-6s -O%-2s %8s %8s %10s\n" "$model" "$level" "$cold" "$kernels" "$unchanged"
        rm -rf "$cache"
    done
done
