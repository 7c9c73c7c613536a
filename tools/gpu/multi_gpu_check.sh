#!/usr/bin/env bash
# Data parallel over NCCL on one host with two GPUs (or more), in one command, ~5 minutes:
#   1. equivalence: GPT-2 d12 -O1 (bf16 gradient reduction) for STEPS steps on 2 GPUs with
#      --gpus 2, on 2 GPUs as two processes (--rank/--world-size/--comm-file), and on 1 GPU
#      with --grad-accum 2, all on the same data: every step's loss within 1e-3 relative of
#      the 1-GPU run; gpt2_tiny -O0 (f32 reduction) the same way;
#   2. tokens/s: d12 batch 32 on 1 GPU and on 2 GPUs (--gpus 2), and the ratio to 2 x one GPU;
#   3. checkpoints: a run saved on 2 GPUs resumes on 1;
#   4. faults: rank 1 killed in the middle of a two-process run: rank 0 must end with an error
#      within --comm-timeout (never hang); rank 0 alone, with no rank 1: ends at the timeout.
# OUT ($OUT when set, else BUILD/multi-gpu/out) receives summary.txt (printed as it goes) and
# logs.tgz. The binaries were built elsewhere by tools/gpu/prepare_multi_gpu.sh BUILD.
#
# usage: tools/gpu/multi_gpu_check.sh BUILD        knobs: STEPS (30), BENCH_STEPS (20)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:?usage: multi_gpu_check.sh BUILD}" && pwd)
BIN=$BUILD/multi-gpu/bin
RESULTS=${OUT:-$BUILD/multi-gpu/out}
mkdir -p "$RESULTS"
W=$(mktemp -d "${TMPDIR:-/tmp}/fp8c-mgpu.XXXXXX")
STEPS=${STEPS:-30}
BENCH_STEPS=${BENCH_STEPS:-20}
SUMMARY=$W/summary.txt
: > "$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }
FAILED=0
fail() { say "FAIL: $*"; FAILED=1; }

export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# NCCL: the system's, else PyTorch's wheel (nvidia-nccl), named to the binaries by FP8C_LIBNCCL
if [ -z "${FP8C_LIBNCCL:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 '; then
    for d in /usr/local/cuda/lib /usr/local/cuda/lib64; do
        [ -f "$d/libnccl.so.2" ] && export FP8C_LIBNCCL=$d/libnccl.so.2 && break
    done
    if [ -z "${FP8C_LIBNCCL:-}" ]; then
        lib=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
for base in site.getsitepackages() + [site.getusersitepackages()]:
    for p in glob.glob(os.path.join(base, "nvidia", "nccl*", "lib", "libnccl.so.2")):
        print(p); raise SystemExit
PY
)
        [ -n "$lib" ] && export FP8C_LIBNCCL=$lib
    fi
fi
DATA=$W/corpus.txt
cp "$REPO/data/gcide_sample.txt" "$DATA"

say "fp8c multi-GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $(cat "$BUILD/multi-gpu/BUILD_INFO" 2>/dev/null)"
say "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)"
say "NCCL: ${FP8C_LIBNCCL:-libnccl.so.2 from the loader path}; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"

# compare LOG_A LOG_B TOL: the loss of every step within TOL relative; prints the worst
compare() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
b = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l]
tol = float(sys.argv[3])
if len(a) != len(b) or not a:
    print(f"steps differ: {len(a)} against {len(b)}"); sys.exit(1)
worst = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))
same = sum(x["loss"] == y["loss"] for x, y in zip(a, b))
print(f"{len(a)} steps, worst relative loss difference {worst:.2e} (tolerance {tol:g}), "
      f"{same} steps bit-identical; last losses {a[-1]['loss']:.5f} / {b[-1]['loss']:.5f}")
sys.exit(0 if worst <= tol else 1)
PY
}
# median tokens/s of the steps after the third
tps() {
    python3 - "$1" <<'PY'
import json, statistics, sys
v = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1]) if '"tokens_per_s"' in l][3:]
print(f"{statistics.median(v):.0f}" if v else "0")
PY
}
# run NAME CMD...: the command with its output in W/NAME.out, its status in $?
run() { local name=$1; shift; "$@" > "$W/$name.out" 2>&1; }
last() { for f in "$@"; do [ -f "$W/$f.out" ] && tail -2 "$W/$f.out"; done | tr '\n' ' '; }

common="--data $DATA --device cuda --seed 7 --lr 6e-4 --warmup 2 --eval-every 0 --overwrite --comm-timeout 120"

# ---------------------------------------------------------------- 1. equivalence
equiv() {   # equiv BINARY LABEL
    local b=$BIN/$1 label=$2
    run ${1}_1gpu "$b" $common --steps "$STEPS" --grad-accum 2 --log "$W/${1}_1gpu.jsonl" ||
        { fail "$label on 1 GPU with --grad-accum 2: $(last ${1}_1gpu)"; return; }
    run ${1}_gpus2 "$b" $common --steps "$STEPS" --gpus 2 --log "$W/${1}_gpus2.jsonl" ||
        { fail "$label with --gpus 2: $(last ${1}_gpus2)"; return; }
    rm -f "$W/${1}.id"
    "$b" $common --steps "$STEPS" --rank 1 --world-size 2 --comm-file "$W/${1}.id" > "$W/${1}_rank1.out" 2>&1 &
    local p1=$!
    run ${1}_rank0 "$b" $common --steps "$STEPS" --rank 0 --world-size 2 --comm-file "$W/${1}.id" \
        --log "$W/${1}_ranks.jsonl"
    local s0=$?
    wait $p1
    local s1=$?
    [ $s0 = 0 ] && [ $s1 = 0 ] ||
        { fail "$label as two processes: rank 0 status $s0, rank 1 status $s1: $(last ${1}_rank0 ${1}_rank1)"; return; }
    local r
    r=$(compare "$W/${1}_gpus2.jsonl" "$W/${1}_1gpu.jsonl" 1e-3) && say "$label, --gpus 2 vs 1 GPU x 2 micro-steps: $r" ||
        fail "$label, --gpus 2 vs 1 GPU x 2 micro-steps: $r"
    r=$(compare "$W/${1}_ranks.jsonl" "$W/${1}_1gpu.jsonl" 1e-3) && say "$label, 2 processes vs 1 GPU x 2 micro-steps: $r" ||
        fail "$label, 2 processes vs 1 GPU x 2 micro-steps: $r"
    r=$(compare "$W/${1}_ranks.jsonl" "$W/${1}_gpus2.jsonl" 0) && say "$label, 2 processes vs --gpus 2: $r" ||
        say "note: $label, 2 processes vs --gpus 2 not bit-identical: $r"
    say "$label tokens/s: 1 GPU x 2 micro-steps $(tps "$W/${1}_1gpu.jsonl"), --gpus 2 $(tps "$W/${1}_gpus2.jsonl"), 2 processes $(tps "$W/${1}_ranks.jsonl")"
}
say ""
say "== 1. equivalence ($STEPS steps, same seed and data)"
equiv d12_O1_b8 "GPT-2 d12 -O1 batch 8 (bf16 reduction)"
grep -h "device:\|data parallel" "$W/d12_O1_b8_gpus2.out" 2>/dev/null | head -2 | tee -a "$SUMMARY"
equiv tiny_O0 "gpt2_tiny -O0 batch 16 (f32 reduction)"

# ---------------------------------------------------------------- 2. throughput
say ""
say "== 2. tokens/s, GPT-2 d12 -O1 batch 32 x 1024 per GPU ($BENCH_STEPS steps, median after 3)"
if run b32_1 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --log "$W/b32_1.jsonl" &&
   run b32_2 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --gpus 2 --log "$W/b32_2.jsonl"; then
    t1=$(tps "$W/b32_1.jsonl"); t2=$(tps "$W/b32_2.jsonl")
    say "1 GPU $t1 tokens/s, 2 GPUs $t2 tokens/s: $(python3 -c "print(f'{$t2 / (2 * $t1):.3f}')") of 2 x one GPU"
else
    fail "throughput runs: $(last b32_1 b32_2)"
fi

# ---------------------------------------------------------------- 3. resume on 1 GPU
say ""
say "== 3. a checkpoint of 2 GPUs resumes on 1"
if run save2 "$BIN/d12_O1_b8" $common --steps 10 --stop-at 5 --gpus 2 --out "$W/ck" &&
   run resume1 "$BIN/d12_O1_b8" $common --steps 10 --grad-accum 2 --resume "$W/ck" --log "$W/resume1.jsonl" &&
   run straight "$BIN/d12_O1_b8" $common --steps 10 --gpus 2 --log "$W/straight.jsonl"; then
    r=$(python3 - "$W/resume1.jsonl" "$W/straight.jsonl" <<'PY'
import json, sys
a = {j["step"]: j["loss"] for j in map(json.loads, open(sys.argv[1]))}
b = {j["step"]: j["loss"] for j in map(json.loads, open(sys.argv[2]))}
worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a)
print(f"steps {min(a)}..{max(a)} resumed on 1 GPU against the 2-GPU run: worst relative loss difference {worst:.2e}")
sys.exit(0 if worst <= 1e-3 else 1)
PY
) && say "$r" || fail "$r"
else
    fail "save on 2, resume on 1: $(last save2 resume1 straight)"
fi

# ---------------------------------------------------------------- 4. faults
say ""
say "== 4. faults (--comm-timeout 30)"
rm -f "$W/f.id"
t0=$(date +%s)
"$BIN/d12_O1_b8" $common --steps 1000 --comm-timeout 30 --rank 1 --world-size 2 --comm-file "$W/f.id" > "$W/fault_rank1.out" 2>&1 &
p1=$!
"$BIN/d12_O1_b8" $common --steps 1000 --comm-timeout 30 --rank 0 --world-size 2 --comm-file "$W/f.id" --log "$W/fault.jsonl" > "$W/fault_rank0.out" 2>&1 &
p0=$!
for _ in $(seq 1 240); do [ -f "$W/fault.jsonl" ] && [ "$(wc -l < "$W/fault.jsonl")" -ge 5 ] && break; sleep 0.5; done
reached=$( [ -f "$W/fault.jsonl" ] && wc -l < "$W/fault.jsonl" || echo 0)
kill -9 $p1 2>/dev/null
t_kill=$(date +%s)
( sleep 90; kill -9 $p0 2>/dev/null ) &
guard=$!
wait $p0
s0=$?
kill $guard 2>/dev/null
t_end=$(date +%s)
if [ "$reached" -lt 5 ]; then
    fail "the two-process run did not reach step 5 before rank 1 was to be killed: $(last fault_rank0 fault_rank1)"
elif [ $s0 = 0 ] || [ $s0 = 137 ]; then
    fail "rank 1 killed: rank 0 ended with status $s0 after $((t_end - t_kill)) s (0: it went on; 137: it hung)"
else
    say "rank 1 killed after step $reached: rank 0 ended in $((t_end - t_kill)) s with status $s0: $(grep error "$W/fault_rank0.out" | tail -1)"
fi
rm -f "$W/alone.id"
t0=$(date +%s)
run alone timeout 120 "$BIN/d12_O1_b8" $common --steps 5 --comm-timeout 10 --rank 1 --world-size 2 --comm-file "$W/alone.id"
s=$?
if [ $s = 0 ] || [ $s = 124 ]; then fail "rank 1 without rank 0: status $s"; else
    say "rank 1 without rank 0: status $s after $(( $(date +%s) - t0 )) s: $(tail -1 "$W/alone.out")"; fi
t0=$(date +%s)
run alone0 timeout 120 "$BIN/d12_O1_b8" $common --steps 5 --comm-timeout 10 --rank 0 --world-size 2 --comm-file "$W/alone.id"
s=$?
if [ $s = 0 ] || [ $s = 124 ]; then fail "rank 0 without rank 1: status $s"; else
    say "rank 0 without rank 1: status $s after $(( $(date +%s) - t0 )) s: $(tail -1 "$W/alone0.out")"; fi
[ -e "$W/alone.id" ] && say "note: rank 0 left $W/alone.id (the ranks never met)"

say ""
[ $FAILED = 0 ] && say "multi-GPU check: all passed" || say "multi-GPU check: FAILURES above"
cp "$SUMMARY" "$RESULTS/summary.txt"
tar -C "$W" -czf "$RESULTS/logs.tgz" --exclude corpus.txt --exclude ck . 2>/dev/null
exit $FAILED
