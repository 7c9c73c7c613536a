#!/usr/bin/env bash
# The GPU suite, in one command on the GPU machine, under ~8 minutes:
#   1. ctest -L gpu: every kernel and whole training steps (-O0..-O3) against the reference
#      executor, and run-to-run determinism;
#   2. short trainings of gpt2_tiny and GPT-2 d12 at -O0..-O3 on the shared corpus (loss must
#      fall), each on the GPU (--device cuda);
#   3. throughput: PyTorch's GPT-2 d12 (tools/bench/torch_gpt.py, bf16 + torch.compile) and
#      fp8c's d12 binaries on the same GPU in the same run, with the ratio;
#   4. the PyTorch cross-check (tools/torch_crosscheck.py) of GPT-2 d12 in f32 and bf16;
#   5. the benchmark (tools/bench/gpu_bench.py): d12 batch 32, d48 batch 8, every level.
# OUT ($OUT when set, else BUILD/gpu-suite/out) receives three files: summary.txt (also printed
# as it goes), ctest_gpu.log and logs.tgz (every log, JSON log and profile). The build was made
# elsewhere by tools/gpu/prepare_gpu_suite.sh BUILD and carried here.
#
# usage: tools/gpu/run_gpu_suite.sh BUILD
# knobs: TINY_STEPS (300), D12_STEPS (100), BENCH_STEPS (20), SKIP_TESTS=1, SKIP_TRAIN=1,
#        SKIP_BENCH=1, SKIP_XCHECK=1, SKIP_GPU_BENCH=1, BENCH_CONFIGS, BENCH_LEVELS (comma lists), LEVELS ("0 1 2 3"), PROFILE=1 (per-kernel GPU times of 3 d12 steps at
#        each level, FP8C_CUDA_PROFILE)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:?usage: run_gpu_suite.sh BUILD}" && pwd)
RESULTS=${OUT:-$BUILD/gpu-suite/out}
mkdir -p "$RESULTS"
OUT=$(mktemp -d "${TMPDIR:-/tmp}/fp8c-gpu-suite.XXXXXX")   # the logs, packed at the end
TINY_STEPS=${TINY_STEPS:-300}
D12_STEPS=${D12_STEPS:-100}
BENCH_STEPS=${BENCH_STEPS:-20}
LEVELS=${LEVELS:-"0 1 2 3"}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }

export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export FP8C_CACHE_DIR=$BUILD/fp8c-cache
export FP8C_GPU_IR_DIR=$BUILD/tests/gpu/ir
export PYTHONUNBUFFERED=1
T_START=$(date +%s)
elapsed() { echo $(( $(date +%s) - T_START )); }

say "fp8c GPU suite, $(date -u +%Y-%m-%dT%H:%MZ)"
say "$(cat "$BUILD/gpu-suite/BUILD_INFO" 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1 ||
    echo "no nvidia-smi" > "$OUT/gpu.txt"
sed 's/^/GPU: /' "$OUT/gpu.txt" | tee -a "$SUMMARY"

# ---- 1. the GPU tests (the build recorded its own absolute paths: point them here)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    OLD_BUILD=$(sed -n 's/^# Build directory: //p' "$BUILD/CTestTestfile.cmake")
    OLD_SRC=$(sed -n 's/^# Source directory: //p' "$BUILD/CTestTestfile.cmake")
    # the two independently: the build may have been made from another checkout of the source
    if [ -n "$OLD_BUILD" ] && [ "$OLD_BUILD" != "$BUILD" ]; then
        find "$BUILD" -name CTestTestfile.cmake -exec sed -i "s|$OLD_BUILD|$BUILD|g" {} +
    fi
    if [ -n "$OLD_SRC" ] && [ "$OLD_SRC" != "$REPO" ]; then
        find "$BUILD" -name CTestTestfile.cmake -exec sed -i "s|$OLD_SRC|$REPO|g" {} +
    fi
    # -V: the tests' own lines (cases, errors against their bounds) are the record
    (cd "$BUILD" && ctest -L gpu -V --timeout 300) > "$OUT/ctest_gpu.log" 2>&1
    rc=$?
    grep -E "tests passed|tests failed|Passed|Failed|\*\*\*" "$OUT/ctest_gpu.log" | tail -6 | tee -a "$SUMMARY"
    say "ctest -L gpu: exit $rc ($(elapsed) s)"
fi

# ---- 2. trainings
DATA_DIR=$(mktemp -d "${TMPDIR:-/tmp}/fp8c-gpu-data.XXXXXX")
trap 'rm -rf "$DATA_DIR"' EXIT
DATA=$DATA_DIR/corpus.txt
if [ -f "$BUILD/gpu-suite/data/corpus.txt.gz" ]; then gzip -dc "$BUILD/gpu-suite/data/corpus.txt.gz" > "$DATA"; fi
[ -s "$DATA" ] || DATA=$BUILD/gpu-suite/data/sample.txt
train() {   # name steps [flags]
    local name=$1 steps=$2
    shift 2
    local bin=$BUILD/gpu-suite/bin/$name
    [ -x "$bin" ] || { say "$name: no binary"; return; }
    "$bin" --data "$DATA" --device cuda --steps "$steps" --eval-every "$steps" --eval-batches 8 \
        --warmup $((steps / 10)) --log "$OUT/$name.jsonl" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    python3 - "$OUT/$name.jsonl" "$name" "$rc" <<'PY' | tee -a "$SUMMARY"
import json, sys, statistics
path, name, rc = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    rows = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
except OSError:
    rows = []
steps = [r for r in rows if "loss" in r and "step" in r]
if not steps:
    print(f"{name}: exit {rc}, no steps logged"); sys.exit()
tps = [r.get("tokens_per_s", 0) for r in steps[len(steps) // 4:]]
val = [r["val_loss"] for r in steps if r.get("val_loss") is not None]
print(f"{name}: exit {rc}, {len(steps)} steps, loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}"
      f"{', val %.3f' % val[-1] if val else ''}, median {statistics.median(tps):,.0f} tok/s,"
      f" {statistics.median([r.get('ms', 0) for r in steps[len(steps) // 4:]]):.1f} ms/step")
PY
}
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
    for O in $LEVELS; do train gpt2_tiny_O$O "$TINY_STEPS"; done
    say "gpt2_tiny trainings done ($(elapsed) s)"
    for O in $LEVELS; do train gpt2_d12_O$O "$D12_STEPS"; done
    say "d12 trainings done ($(elapsed) s)"
fi

# ---- per-kernel times (launches timed one by one: slower than the graph replay above)
if [ "${PROFILE:-0}" = 1 ]; then
    for O in $LEVELS; do
        FP8C_CUDA_PROFILE=1 "$BUILD/gpu-suite/bin/gpt2_d12_O$O" --data "$DATA" --device cuda --steps 3 \
            --eval-every 0 > "$OUT/profile_d12_O$O.txt" 2>&1
        say "profile d12 -O$O (3 steps), top kernels:"
        grep -A9 "GPU profile" "$OUT/profile_d12_O$O.txt" | tee -a "$SUMMARY"
    done
fi

# ---- 3. PyTorch on the same GPU, same run (fp8c's d12 figures are the trainings' above)
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    B=$(sed -n 's/.*batch \([0-9]*\) x.*/\1/p' "$OUT/gpt2_d12_O0.log" 2>/dev/null | head -1)
    B=${B:-16}
    python3 "$REPO/tools/bench/torch_gpt.py" d12 bf16 "$B" 1024 "$BENCH_STEPS" > "$OUT/torch_d12_bf16.log" 2>&1
    say "PyTorch d12 bf16 compiled, batch $B: $(tail -1 "$OUT/torch_d12_bf16.log")"
    python3 - "$OUT" "$LEVELS" <<'PY' | tee -a "$SUMMARY"
import json, sys, statistics
out, levels = sys.argv[1], sys.argv[2].split()
try:
    ref = json.loads(open(f"{out}/torch_d12_bf16.log").read().strip().splitlines()[-1])["tok_per_s"]
except Exception:
    ref = None
for O in levels:
    try:
        rows = [json.loads(l) for l in open(f"{out}/gpt2_d12_O{O}.jsonl") if l.startswith("{")]
        tps = statistics.median(r["tokens_per_s"] for r in rows[len(rows) // 4:] if "tokens_per_s" in r)
    except Exception:
        print(f"fp8c d12 -O{O}: no figures"); continue
    ratio = f" = {tps / ref:.2f}x PyTorch bf16" if ref else ""
    print(f"fp8c d12 -O{O}: {tps:,.0f} tok/s{ratio}")
PY
fi
# ---- 4. PyTorch as an outside judge: 20 steps of GPT-2 d12 from the same state, same batches
if [ "${SKIP_XCHECK:-0}" != 1 ] && [ -x "$BUILD/gpu-suite/bin/xcheck_d12_f32" ]; then
    "$BUILD/fp8c-tokenize" --val-fraction 0.01 "$DATA" "$DATA_DIR/tok" > /dev/null 2>&1 ||
        say "cross-check: no tokenizer output"
    for mode in f32 bf16; do
        python3 "$REPO/tools/torch_crosscheck.py" "$BUILD/gpu-suite/bin/xcheck_d12_$mode" \
            "$DATA_DIR/tok_train_000000.bin" --heads 12 --mode $mode --steps 20 \
            --binary-device cuda --work "$OUT/xcheck_$mode" > "$OUT/xcheck_$mode.log" 2>&1
        say "cross-check d12 $mode: exit $? -- $(tail -1 "$OUT/xcheck_$mode.log")"
    done
fi

# ---- 5. the benchmark: d12 batch 32 and d48 batch 8 at every level against PyTorch
if [ "${SKIP_GPU_BENCH:-0}" != 1 ] && ls "$BUILD"/gpu-suite/bin/gpt2_d*_b*_O* > /dev/null 2>&1; then
    python3 "$REPO/tools/bench/gpu_bench.py" --bins "$BUILD/gpu-suite/bin" --data "$DATA" \
        --configs "${BENCH_CONFIGS:-d12:32,d48:8}" --levels "${BENCH_LEVELS:-0,1,2,3}" \
        --steps "${GPU_BENCH_STEPS:-30}" --work "$OUT/bench" --json "$OUT/bench.json" \
        > "$OUT/bench.log" 2>&1
    sed -n '/^| config/,$p' "$OUT/bench.log" | tee -a "$SUMMARY"
fi
say "total $(elapsed) s"
cp "$SUMMARY" "$RESULTS/summary.txt"
[ -f "$OUT/ctest_gpu.log" ] && cp "$OUT/ctest_gpu.log" "$RESULTS/ctest_gpu.log"
tar czf "$RESULTS/logs.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "logs: $RESULTS/logs.tgz"
