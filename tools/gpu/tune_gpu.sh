#!/usr/bin/env bash
# fp8c tune on a GPU: GPT-2 d12 (batch 32, seq 1024, -O1) tuned on the GPU, built with the
# record, and default against tuned step times printed. Two halves:
#
#   tools/gpu/tune_gpu.sh prepare [KIT]   here (no GPU): builds fp8c without LLVM (the GPU
#                                         machine has none) and the runtime libraries it links
#                                         into binaries, copies them into KIT (default
#                                         build-tune/kit), and compiles the GPU modules of the
#                                         default and of every candidate fp8c tune builds
#                                         (NVRTC, cached in KIT/fp8c-cache: a hit there when the
#                                         GPU machine's NVRTC is the same version)
#   tools/gpu/tune_gpu.sh run KIT         on the GPU machine, from the repository root: fp8c tune
#                                         (BUDGET seconds, default 180), fp8c build with and
#                                         without the record, then ROUNDS (3) alternating runs of
#                                         STEPS (30) steps of each; prints the medians and the
#                                         record's table (fp8c plan --tune). $OUT (else KIT/out)
#                                         receives d12.tune, summary.txt and the logs.
#
# The GPU machine must have a C compiler (`cc`: fp8c links every binary it builds, candidates
# included) and the CUDA toolkit's libnvrtc and headers (/usr/local/cuda); run says so when not.
# KIT stays far below the 64 MiB a device run carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?usage: tune_gpu.sh prepare [KIT] | run KIT}
FLAGS="-O1 --batch 32 --seq 1024"
MODEL=models/gpt2.model

if [ "$MODE" = prepare ]; then
    KIT=${2:-build-tune/kit}
    KIT_ARG=$KIT
    BUILD=$(dirname "$KIT")/cmake
    mkdir -p "$BUILD" "$KIT"
    KIT=$(cd "$KIT" && pwd)
    # no LLVM: an fp8c linked to libLLVM would not start where there is none
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLVM_CONFIG=/nonexistent/llvm-config >/dev/null
    make -C "$BUILD" -j"${JOBS:-2}" fp8c fp8c_train_main fp8c_rt fp8c_cuda_rt fp8c_kernels fp8c_ir >/dev/null
    if ldd "$BUILD/fp8c" | grep -qi llvm; then
        echo "tune_gpu.sh: $BUILD/fp8c still links LLVM" >&2
        exit 1
    fi
    cp "$BUILD/fp8c" "$KIT/"
    for lib in libfp8c_train_main.a libfp8c_cuda_rt.a libfp8c_rt.a libfp8c_kernels.a libfp8c_ir.a; do
        cp "$BUILD/$lib" "$KIT/"
    done
    strip --strip-debug "$KIT"/fp8c "$KIT"/*.a
    export FP8C_CACHE_DIR=$KIT/fp8c-cache
    # the modules fp8c tune will ask NVRTC for: the defaults, each loss chunk count it tries
    # (the rule's 25 at batch 32 x 1024 x 50304; then 12, 50 and 1) and each fusion turned off
    tmp=$(mktemp -d)
    echo "compiling the GPU modules of the default and of each candidate (NVRTC, two cores: minutes)"
    "$KIT/fp8c" build $MODEL $FLAGS -o "$tmp/bin" 2>&1 | grep -E "GPU kernels|error" || true
    for c in loss.chunks=12 loss.chunks=50 loss.chunks=1 fuse.producer_quantizes=0 fuse.bias_grads=0 \
             fuse.group_quantizes=0 fuse.ce_lse=0 fuse.gemm_epilogues=0 fuse.gemm_gelu=0 \
             fuse.cast_transposes=0; do
        printf '%s: ' "$c"
        "$KIT/fp8c" build $MODEL $FLAGS --choice "$c" -o "$tmp/bin" 2>&1 | grep -E "GPU kernels|error" || echo
    done
    rm -rf "$tmp"
    rm -f "$FP8C_CACHE_DIR"/*.ptx "$FP8C_CACHE_DIR"/bin-*
    echo "git commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with local changes)')" > "$KIT/BUILD_INFO"
    du -sh "$KIT"
    echo "ready: carry $KIT_ARG, then run tools/gpu/tune_gpu.sh run $KIT_ARG on the GPU machine"
    exit 0
fi

[ "$MODE" = run ] || { echo "usage: tune_gpu.sh prepare [KIT] | run KIT" >&2; exit 2; }
set +e   # from here each step says what failed itself
KIT=$(cd "${2:?usage: tune_gpu.sh run KIT}" && pwd)
RESULTS=${OUT:-$KIT/out}
mkdir -p "$RESULTS"
BUDGET=${BUDGET:-180}
STEPS=${STEPS:-30}
ROUNDS=${ROUNDS:-3}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export FP8C_CACHE_DIR=$KIT/fp8c-cache
export FP8C_LIBDIR=$KIT
FP8C=$KIT/fp8c
SUMMARY=$RESULTS/summary.txt
: > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }
say "fp8c tune on the GPU, $(date -u +%Y-%m-%dT%H:%MZ); $(cat "$KIT/BUILD_INFO" 2>/dev/null)"
say "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
command -v cc >/dev/null || { say "no C compiler (cc) on this machine: fp8c cannot link binaries here"; exit 1; }
[ -f "${FP8C_CUDA_INCLUDE:-/usr/local/cuda/include}/cuda_fp8.h" ] ||
    { say "no CUDA headers in ${FP8C_CUDA_INCLUDE:-/usr/local/cuda/include} (set FP8C_CUDA_INCLUDE): NVRTC needs them"; exit 1; }
"$FP8C" --version >/dev/null 2>&1 || { say "fp8c does not start here: $("$FP8C" --version 2>&1 | head -2)"; exit 1; }

rm -f "$RESULTS/d12.tune"
T0=$(date +%s)
"$FP8C" tune $MODEL $FLAGS --device cuda --budget "$BUDGET" -o "$RESULTS/d12.tune" 2> "$RESULTS/tune.log" || {
    tail -20 "$RESULTS/tune.log" | tee -a "$SUMMARY"; exit 1; }
say "fp8c tune: $(( $(date +%s) - T0 )) s; $(tail -1 "$RESULTS/tune.log")"
grep -E "tune: (defaults|winners|[0-9]+ GEMMs)" "$RESULTS/tune.log" | tee -a "$SUMMARY"

BIN=$(mktemp -d)
for which in default tuned; do
    extra=""
    [ $which = tuned ] && extra="--tune $RESULTS/d12.tune"
    "$FP8C" build $MODEL $FLAGS $extra -o "$BIN/$which" 2>> "$RESULTS/build.log" ||
        { say "fp8c build ($which) failed:"; tail -5 "$RESULTS/build.log" | tee -a "$SUMMARY"; exit 1; }
done
head -c 40000000 /dev/urandom | base64 > "$BIN/data.txt"   # any text: the binaries read bytes

# the median step time of a run's steps after the first 5
median_ms() {
    python3 - "$1" <<'EOF'
import json, statistics, sys
ms = [json.loads(l)["ms"] for l in open(sys.argv[1]) if '"ms"' in l][5:]
print(f"{statistics.median(ms):.2f}" if ms else "nan")
EOF
}
for r in $(seq 1 "$ROUNDS"); do
    for which in default tuned; do
        log=$RESULTS/${which}_$r.jsonl
        rm -f "$log"
        "$BIN/$which" --data "$BIN/data.txt" --steps "$STEPS" --log "$log" --eval-every 0 --eval-batches 1 \
            --device cuda --seed 1 > "$RESULTS/${which}_$r.out" 2>&1 || { tail -5 "$RESULTS/${which}_$r.out"; exit 1; }
        say "round $r $which: $(median_ms "$log") ms a step (median of steps 6..$STEPS)"
    done
done
# the tuned binary times nothing at start-up: two runs give the same losses
cmp <(grep -o '"loss":[^,]*' "$RESULTS/tuned_1.jsonl") <(grep -o '"loss":[^,]*' "$RESULTS/tuned_2.jsonl") >/dev/null &&
    say "tuned runs 1 and 2: the same losses, bit for bit" || say "tuned runs 1 and 2: the losses DIFFER"
"$FP8C" plan $MODEL $FLAGS --tune "$RESULTS/d12.tune" | sed -n '/^tuning record/,$p' > "$RESULTS/plan_tune.txt"
grep -v "^gemm\." "$RESULTS/plan_tune.txt" | tee -a "$SUMMARY"
say "GEMM problems: $(grep -c '^gemm\.' "$RESULTS/plan_tune.txt") in the record (their rows: plan_tune.txt)"
grep "^gemm\." "$RESULTS/plan_tune.txt" | head -8 | tee -a "$SUMMARY"
rm -rf "$BIN"
