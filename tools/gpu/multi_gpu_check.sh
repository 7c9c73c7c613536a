#!/usr/bin/env bash
# Data parallel over NCCL on one host with two GPUs (or more), in one command, ~6 minutes:
#   1. equivalence: GPT-2 d12 -O1 (bf16 gradient sums) for STEPS (50) steps on 2 GPUs with
#      --gpus 2, on 2 GPUs as two processes (--rank/--world-size/--comm-file), with the sums
#      after the backward (comm.overlap=0), and on 1 GPU with --grad-accum 2, all on the same
#      data with the same GEMM algorithms (FP8C_CUDA_TUNE=0: the heuristic's first, not timed,
#      so that separate runs are comparable bit for bit). The two launches and the two
#      schedules of the sums must be bit-identical; against one GPU, every step's loss within
#      1e-3 relative, or within what one GPU does to itself under another equally valid
#      rounding (the same run with timed GEMM algorithms), whichever is larger. gpt2_tiny -O0
#      (f32 sums) the same way, bit-identical. Every step's losses: equivalence_BINARY.tsv.
#   2. tokens/s: d12 batch 32 on 1 GPU and on 2 GPUs (--gpus 2), with the sums overlapped with
#      the backward and after it, and the ratio to 2 x one GPU;
#   3. checkpoints: a run saved on 2 GPUs resumes on 1;
#   4. faults: rank 1 killed in the middle of a two-process run: rank 0 must end with an error
#      within --comm-timeout (never hang); rank 0 alone, with no rank 1: ends at the timeout.
#   5. the FP8 gradient reduction (--precision comm:grad=e5m2, e4m3), ~4 minutes: test_gpu_comm
#      (its kernels against the host reference bit for bit, the ranks equal); GPT-2 d12 -O1
#      batch 8, STEPS steps on 2 GPUs against 1 GPU with --grad-accum 2 (the same data and GEMM
#      algorithms), every step's relative loss difference printed, the worst within
#      docs/multi-gpu.md's tolerance (FP8_TOL_E5M2 1e-2, FP8_TOL_E4M3 3e-2), beside the bf16
#      sums' own difference; tokens/s of d12 batch 32 a GPU on 2 GPUs, bf16 sums against e5m2;
#   6. against PyTorch DDP: tools/bench/torch_gpt.py (bf16, torch.compile, fused AdamW) on 1 GPU
#      and under torchrun on 2 GPUs, d12 batch 32 a GPU, beside fp8c's section 2 runs (made here
#      when section 2 did not run): the scaling of each, and fp8c's ratio to PyTorch on 1 and 2.
#   7. sharded optimizer state (--shard-states), ~4 minutes: test_gpu_comm (where section 5 did
#      not run it: sharded against unsharded gpt2_tiny at -O1..-O3, bit for bit with clipping
#      active in every step); GPT-2 d12 -O1 and -O3 batch 32 a GPU, STEPS steps on 2 GPUs with
#      and without --shard-states (the same data and GEMM algorithms; the model's clip 1.0 is
#      active from step 1): every step's loss and gradient norm must be bit-identical (the norm
#      is summed over chunks the shards respect, so the clip coefficient is the unsharded one;
#      the count of identical steps and the worst difference are printed), tokens/s, and memory
#      per GPU (nvidia-smi's peak, the executor's persistent arena, the plan's figure); a
#      sharded checkpoint of gpt2_tiny -O3 resumed on 2 GPUs (bit for bit) and on 1 GPU (within
#      1e-3). And stage 2 (--shard-states=2, sharded gradients): test_gpu_comm's
#      test_sharded_grads, and d12 -O3 batch 32 with it against the unsharded run (every step
#      bit-identical: one micro-step on 2 GPUs sums as stage 1 does), tokens/s and memory per
#      GPU beside stage 1's. And stage 3 (--shard-states=3, sharded weights gathered layer by
#      layer): test_gpu_comm's test_sharded_weights, and d12 -O3 batch 32 with it against the
#      unsharded run and against stage 2 (every step bit-identical: the same sums, norm and
#      gathered bytes), tokens/s and memory per GPU beside stage 2's.
# OUT ($OUT when set, else BUILD/multi-gpu/out) receives summary.txt (printed as it goes),
# equivalence_d12_O1_b8.tsv, equivalence_tiny_O0.tsv, equivalence_fp8.tsv,
# equivalence_shard_O1.tsv, equivalence_shard_O3.tsv, equivalence_shard2_O3.tsv,
# equivalence_shard3_O3.tsv and logs.tgz. The
# binaries were built elsewhere by tools/gpu/prepare_multi_gpu.sh BUILD.
#
# usage: tools/gpu/multi_gpu_check.sh BUILD
# knobs: STEPS (50), BENCH_STEPS (20), MORE_GPUS ("4": sections 2 and 6 on 4 GPUs too), SECTIONS ("1 2 3 4 5 6 7"; SECTIONS=5: the FP8 reduction
# alone; SECTIONS=7: the sharded step alone)
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:?usage: multi_gpu_check.sh BUILD}" && pwd)
BIN=$BUILD/multi-gpu/bin
RESULTS=${OUT:-$BUILD/multi-gpu/out}
mkdir -p "$RESULTS"
W=$(mktemp -d "${TMPDIR:-/tmp}/fp8c-mgpu.XXXXXX")
STEPS=${STEPS:-50}
BENCH_STEPS=${BENCH_STEPS:-20}
SECTIONS=" ${SECTIONS:-1 2 3 4 5 6 7} "
section() { [[ $SECTIONS == *" $1 "* ]]; }
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
d = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b)]
worst = max(d)
at = d.index(worst) + 1
same = sum(x["loss"] == y["loss"] for x, y in zip(a, b))
print(f"{len(a)} steps, worst relative loss difference {worst:.2e} at step {at} (tolerance {tol:g}), "
      f"{same} steps bit-identical; last losses {a[-1]['loss']:.5f} / {b[-1]['loss']:.5f}")
sys.exit(0 if worst <= tol else 1)
PY
}
# identical LOG_A LOG_B: every step's loss and gradient norm equal (the log's 9 significant
# digits, which tell f32 values apart); prints how many steps are, the worst relative loss
# difference and the first step that differs; fails unless all are
identical() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
b = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l]
if len(a) != len(b) or not a:
    print(f"steps differ: {len(a)} against {len(b)}"); sys.exit(1)
same = [x["loss"] == y["loss"] and x.get("grad_norm") == y.get("grad_norm") for x, y in zip(a, b)]
d = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b)]
worst = max(d)
first = same.index(False) + 1 if not all(same) else None
norms = [x.get("grad_norm") for x in a]
print(f"{sum(same)} of {len(a)} steps bit-identical (loss and grad_norm)"
      + (f", first difference at step {first}" if first else "")
      + f"; worst relative loss difference {worst:.2e} at step {d.index(worst) + 1}; grad_norm "
      f"{norms[0]:.4g} at step 1, {norms[-1]:.4g} at step {len(a)}; last losses {a[-1]['loss']:.5f} / {b[-1]['loss']:.5f}")
sys.exit(0 if all(same) else 1)
PY
}
# worst LOG_A LOG_B: the worst relative loss difference, a number
worst() {
    python3 - "$1" "$2" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
b = [json.loads(l)["loss"] for l in open(sys.argv[2]) if '"loss"' in l]
print(f"{max(abs(x - y) / abs(y) for x, y in zip(a, b)):.3e}" if a and len(a) == len(b) else "nan")
PY
}
# table OUT LOG...: every step's loss of each log, and each one's relative difference to the first
table() {
    local out=$1; shift
    python3 - "$out" "$@" <<'PY'
import json, os, sys
logs = sys.argv[2:]
cols = [[json.loads(l)["loss"] for l in open(p) if '"loss"' in l] for p in logs]
names = [os.path.basename(p).rsplit(".", 1)[0] for p in logs]
with open(sys.argv[1], "w") as f:
    f.write("step\t" + "\t".join(names) + "\t" + "\t".join(f"rel_{n}" for n in names[1:]) + "\n")
    for s in range(min(map(len, cols))):
        ref = cols[0][s]
        f.write(f"{s + 1}\t" + "\t".join(f"{c[s]:.8g}" for c in cols) + "\t" +
                "\t".join(f"{abs(c[s] - ref) / abs(ref):.3e}" for c in cols[1:]) + "\n")
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

# (the same GEMM algorithms in every run: FP8C_CUDA_TUNE=0; timing them picks differently in
# different runs, which no reduction could make equal)
fixed="env FP8C_CUDA_TUNE=0"

if section 1; then
# ---------------------------------------------------------------- 1. equivalence
# two_procs BINARY NAME: two ranks as two processes, rank 0 logging to W/NAME.jsonl
two_procs() {
    local b=$BIN/$1 name=$2
    rm -f "$W/$name.id"
    $fixed "$b" $common --steps "$STEPS" --rank 1 --world-size 2 --comm-file "$W/$name.id" > "$W/${name}_rank1.out" 2>&1 &
    local p1=$!
    run ${name}_rank0 $fixed "$b" $common --steps "$STEPS" --rank 0 --world-size 2 --comm-file "$W/$name.id" \
        --log "$W/$name.jsonl"
    local s0=$?
    wait $p1
    local s1=$?
    [ $s0 = 0 ] && [ $s1 = 0 ] && return 0
    fail "$name as two processes: rank 0 status $s0, rank 1 status $s1: $(last ${name}_rank0 ${name}_rank1)"
    return 1
}
equiv() {   # equiv BINARY LABEL [SERIAL_BINARY]
    local b=$BIN/$1 label=$2 serial=${3:-} r
    run ${1}_1gpu $fixed "$b" $common --steps "$STEPS" --grad-accum 2 --log "$W/${1}_1gpu.jsonl" ||
        { fail "$label on 1 GPU with --grad-accum 2: $(last ${1}_1gpu)"; return; }
    run ${1}_gpus2 $fixed "$b" $common --steps "$STEPS" --gpus 2 --log "$W/${1}_gpus2.jsonl" ||
        { fail "$label with --gpus 2: $(last ${1}_gpus2)"; return; }
    two_procs "$1" "${1}_ranks" || return
    r=$(compare "$W/${1}_ranks.jsonl" "$W/${1}_gpus2.jsonl" 0) && say "$label, 2 processes vs --gpus 2: $r" ||
        fail "$label, 2 processes vs --gpus 2 (must be bit-identical): $r"
    local logs=("$W/${1}_1gpu.jsonl" "$W/${1}_gpus2.jsonl" "$W/${1}_ranks.jsonl")
    if [ -n "$serial" ]; then
        if run ${1}_serial $fixed "$BIN/$serial" $common --steps "$STEPS" --gpus 2 --log "$W/${1}_serial.jsonl"; then
            r=$(compare "$W/${1}_serial.jsonl" "$W/${1}_gpus2.jsonl" 0) &&
                say "$label, sums after the backward vs overlapped with it: $r" ||
                fail "$label, sums after the backward vs overlapped (must be bit-identical): $r"
            logs+=("$W/${1}_serial.jsonl")
        else
            fail "$label with comm.overlap=0: $(last ${1}_serial)"
        fi
    fi
    # one GPU against itself under another rounding of the same sums: GEMM algorithms timed
    local floor=0
    if run ${1}_1gpu_timed "$b" $common --steps "$STEPS" --grad-accum 2 --log "$W/${1}_1gpu_timed.jsonl"; then
        floor=$(worst "$W/${1}_1gpu_timed.jsonl" "$W/${1}_1gpu.jsonl")
        say "$label, 1 GPU with timed GEMM algorithms vs the heuristic's first (its own rounding floor): worst $floor"
        logs+=("$W/${1}_1gpu_timed.jsonl")
    fi
    local tol
    tol=$(python3 -c "print(max(1e-3, float('$floor')))")
    r=$(compare "$W/${1}_gpus2.jsonl" "$W/${1}_1gpu.jsonl" "$tol") && say "$label, 2 GPUs vs 1 GPU x 2 micro-steps: $r" ||
        fail "$label, 2 GPUs vs 1 GPU x 2 micro-steps: $r"
    table "$RESULTS/equivalence_$1.tsv" "${logs[@]}"
}
say ""
say "== 1. equivalence ($STEPS steps, same seed, data and GEMM algorithms)"
equiv d12_O1_b8 "GPT-2 d12 -O1 batch 8 (bf16 sums)" d12_O1_b8_serial
grep -h "device:\|data parallel" "$W/d12_O1_b8_gpus2.out" 2>/dev/null | head -2 | tee -a "$SUMMARY"
STEPS=30 equiv tiny_O0 "gpt2_tiny -O0 batch 16 (f32 sums)"
r=$(compare "$W/tiny_O0_gpus2.jsonl" "$W/tiny_O0_1gpu.jsonl" 0) && say "gpt2_tiny -O0, 2 GPUs vs 1 GPU bit for bit: $r" ||
    fail "gpt2_tiny -O0, 2 GPUs vs 1 GPU (f32: must be bit-identical): $r"

fi
if section 2; then
# ---------------------------------------------------------------- 2. throughput
say ""
say "== 2. tokens/s, GPT-2 d12 -O1 batch 32 x 1024 per GPU ($BENCH_STEPS steps, median after 3)"
if run b32_1 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --log "$W/b32_1.jsonl" &&
   run b32_2 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --gpus 2 --log "$W/b32_2.jsonl" &&
   run b32_2s "$BIN/d12_O1_b32_serial" $common --steps "$BENCH_STEPS" --gpus 2 --log "$W/b32_2s.jsonl"; then
    t1=$(tps "$W/b32_1.jsonl"); t2=$(tps "$W/b32_2.jsonl"); t2s=$(tps "$W/b32_2s.jsonl")
    say "1 GPU $t1 tokens/s; 2 GPUs, sums overlapped with the backward: $t2 tokens/s, $(python3 -c "print(f'{$t2 / (2 * $t1):.3f}')") of 2 x one GPU"
    say "2 GPUs, sums after the backward (comm.overlap=0): $t2s tokens/s, $(python3 -c "print(f'{$t2s / (2 * $t1):.3f}')") of 2 x one GPU"
    grep -h "device:" "$W/b32_2.out" 2>/dev/null | head -1 | tee -a "$SUMMARY"
    # MORE_GPUS="4" (or "4 8"): the same on more GPUs of the host (a binary built for 2 runs on any number)
    for n in ${MORE_GPUS:-}; do
        if run b32_$n "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --gpus "$n" --log "$W/b32_$n.jsonl"; then
            tn=$(tps "$W/b32_$n.jsonl")
            say "$n GPUs, sums overlapped: $tn tokens/s, $(python3 -c "print(f'{$tn / ($n * $t1):.3f}')") of $n x one GPU"
        else
            fail "throughput on $n GPUs: $(last b32_$n)"
        fi
    done
else
    fail "throughput runs: $(last b32_1 b32_2 b32_2s)"
fi

fi
if section 3; then
# ---------------------------------------------------------------- 3. resume on 1 GPU
say ""
say "== 3. a checkpoint of 2 GPUs resumes on 1"
if run save2 $fixed "$BIN/d12_O1_b8" $common --steps 10 --stop-at 5 --gpus 2 --out "$W/ck" &&
   run resume1 $fixed "$BIN/d12_O1_b8" $common --steps 10 --grad-accum 2 --resume "$W/ck" --log "$W/resume1.jsonl" &&
   run straight $fixed "$BIN/d12_O1_b8" $common --steps 10 --gpus 2 --log "$W/straight.jsonl"; then
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

fi
if section 4; then
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
fi

if section 5; then
# ---------------------------------------------------------------- 5. the FP8 gradient reduction
say ""
say "== 5. the FP8 gradient reduction (comm:grad=e5m2 / e4m3)"
T=$BUILD/multi-gpu/test
if [ -x "$T/test_gpu_comm" ]; then
    if (cd "$W" && FP8C_GPU_IR_DIR=$T/ir FP8C_CACHE_DIR=$T/cache CMOCKA_MESSAGE_OUTPUT=stdout \
        "$T/test_gpu_comm" > "$W/test_gpu_comm.out" 2>&1); then
        say "test_gpu_comm passed: $(grep -h 'differ from the host reference' "$W/test_gpu_comm.out" | sed 's/^ *//' | tr '\n' ' ')"
        grep -q "skipped" "$W/test_gpu_comm.out" && fail "test_gpu_comm skipped: $(grep skipped "$W/test_gpu_comm.out")"
    else
        fail "test_gpu_comm: $(grep -E 'differ|ERROR|FAIL|status|LINE' "$W/test_gpu_comm.out" | head -8 | tr '\n' ' ')"
    fi
else
    say "test_gpu_comm not carried (BUILD/multi-gpu/test): skipped"
fi
# the same runs as section 1 where it ran: one GPU with two micro-steps, two with bf16 sums
[ -f "$W/d12_O1_b8_1gpu.jsonl" ] ||
    run d12_O1_b8_1gpu $fixed "$BIN/d12_O1_b8" $common --steps "$STEPS" --grad-accum 2 --log "$W/d12_O1_b8_1gpu.jsonl" ||
    fail "d12 -O1 batch 8 on 1 GPU with --grad-accum 2: $(last d12_O1_b8_1gpu)"
[ -f "$W/d12_O1_b8_gpus2.jsonl" ] ||
    run d12_O1_b8_gpus2 $fixed "$BIN/d12_O1_b8" $common --steps "$STEPS" --gpus 2 --log "$W/d12_O1_b8_gpus2.jsonl" ||
    fail "d12 -O1 batch 8 on 2 GPUs (bf16 sums): $(last d12_O1_b8_gpus2)"
fp8_logs=("$W/d12_O1_b8_1gpu.jsonl" "$W/d12_O1_b8_gpus2.jsonl")
for wire in e5m2 e4m3; do
    if run fp8_$wire $fixed "$BIN/d12_O1_b8_$wire" $common --steps "$STEPS" --gpus 2 --log "$W/fp8_$wire.jsonl"; then
        fp8_logs+=("$W/fp8_$wire.jsonl")
    else
        fail "d12 -O1 batch 8 on 2 GPUs, comm:grad=$wire: $(last fp8_$wire)"
    fi
done
grep -h "data parallel\|device:" "$W/fp8_e5m2.out" 2>/dev/null | head -2 | tee -a "$SUMMARY"
if [ ${#fp8_logs[@]} -eq 4 ]; then
    table "$RESULTS/equivalence_fp8.tsv" "${fp8_logs[@]}"
    say "every step's loss relative to 1 GPU with --grad-accum 2 (bf16 sums, e5m2, e4m3 on 2 GPUs):"
    python3 - "$RESULTS/equivalence_fp8.tsv" <<'PY' | tee -a "$SUMMARY"
import sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
print("  step  loss(1 GPU)   bf16 sums   e5m2       e4m3")
for r in rows:
    print(f"  {r[0]:>4}  {float(r[1]):10.5f}   {r[5]}   {r[6]}  {r[7]}")
PY
    bf16_worst=$(worst "$W/d12_O1_b8_gpus2.jsonl" "$W/d12_O1_b8_1gpu.jsonl")
    say "bf16 sums on 2 GPUs against 1 GPU: worst $bf16_worst"
    r=$(compare "$W/fp8_e5m2.jsonl" "$W/d12_O1_b8_1gpu.jsonl" "${FP8_TOL_E5M2:-1e-2}") &&
        say "e5m2 reduction, 2 GPUs vs 1 GPU x 2 micro-steps: $r" || fail "e5m2 reduction, 2 GPUs vs 1 GPU: $r"
    r=$(compare "$W/fp8_e4m3.jsonl" "$W/d12_O1_b8_1gpu.jsonl" "${FP8_TOL_E4M3:-3e-2}") &&
        say "e4m3 reduction, 2 GPUs vs 1 GPU x 2 micro-steps: $r" || fail "e4m3 reduction, 2 GPUs vs 1 GPU: $r"
fi
say "tokens/s, GPT-2 d12 -O1 batch 32 x 1024 per GPU, 2 GPUs ($BENCH_STEPS steps, median after 3):"
if run fp8_b32_bf16 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --gpus 2 --log "$W/fp8_b32_bf16.jsonl" &&
   run fp8_b32_e5m2 "$BIN/d12_O1_b32_e5m2" $common --steps "$BENCH_STEPS" --gpus 2 --log "$W/fp8_b32_e5m2.jsonl"; then
    tb=$(tps "$W/fp8_b32_bf16.jsonl"); te=$(tps "$W/fp8_b32_e5m2.jsonl")
    say "bf16 sums $tb tokens/s; e5m2 reduction $te tokens/s ($(python3 -c "print(f'{$te / $tb:.3f}')") of bf16's)"
else
    fail "throughput runs with the FP8 reduction: $(last fp8_b32_bf16 fp8_b32_e5m2)"
fi
fi

if section 6; then
# ---------------------------------------------------------------- 6. against PyTorch DDP
say ""
say "== 6. against PyTorch DDP (bf16, torch.compile), GPT-2 d12 batch 32 x 1024 per GPU"
if [ -z "${t1:-}" ] || [ -z "${t2:-}" ]; then
    run b32_1 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --log "$W/b32_1.jsonl" &&
        run b32_2 "$BIN/d12_O1_b32" $common --steps "$BENCH_STEPS" --gpus 2 --log "$W/b32_2.jsonl" &&
        t1=$(tps "$W/b32_1.jsonl") && t2=$(tps "$W/b32_2.jsonl") || fail "fp8c d12 batch 32: $(last b32_1 b32_2)"
fi
# tok: the tokens/s of torch_gpt.py's JSON line in W/NAME.out
tok() { python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')][-1]['tok_per_s'])" "$W/$1.out" 2>/dev/null; }
if run torch_1 python3 "$REPO/tools/bench/torch_gpt.py" d12 bf16 32 1024 "$BENCH_STEPS" &&
   run torch_2 torchrun --standalone --nproc_per_node=2 "$REPO/tools/bench/torch_gpt.py" d12 bf16 32 1024 "$BENCH_STEPS" &&
   p1=$(tok torch_1) && p2=$(tok torch_2) && [ -n "$p1" ] && [ -n "$p2" ] && [ -n "${t1:-}" ] && [ -n "${t2:-}" ]; then
    say "PyTorch: 1 GPU $p1 tokens/s; 2 GPUs (DDP) $p2 tokens/s, $(python3 -c "print(f'{$p2 / (2 * $p1):.3f}')") of 2 x one GPU"
    say "fp8c -O1: 1 GPU $t1; 2 GPUs $t2, $(python3 -c "print(f'{$t2 / (2 * $t1):.3f}')") of 2 x one GPU"
    say "fp8c over PyTorch: $(python3 -c "print(f'{$t1 / $p1:.3f}')")x on 1 GPU, $(python3 -c "print(f'{$t2 / $p2:.3f}')")x on 2"
    for n in ${MORE_GPUS:-}; do
        tn=$(tps "$W/b32_$n.jsonl" 2>/dev/null)
        if [ -n "$tn" ] && run torch_$n torchrun --standalone --nproc_per_node="$n" "$REPO/tools/bench/torch_gpt.py" d12 bf16 32 1024 "$BENCH_STEPS" &&
           pn=$(tok torch_$n) && [ -n "$pn" ]; then
            say "$n GPUs: PyTorch DDP $pn tokens/s ($(python3 -c "print(f'{$pn / ($n * $p1):.3f}')") of $n x one), fp8c $tn ($(python3 -c "print(f'{$tn / ($n * $t1):.3f}')")), fp8c over PyTorch $(python3 -c "print(f'{$tn / $pn:.3f}')")x"
        else
            fail "PyTorch DDP on $n GPUs: $(last torch_$n)"
        fi
    done
else
    fail "PyTorch DDP comparison: $(last torch_1 torch_2)"
fi
fi

if section 7; then
# ---------------------------------------------------------------- 7. sharded optimizer state
say ""
say "== 7. sharded optimizer state (--shard-states, ZeRO stage 1), gradients (=2, stage 2) and weights (=3, stage 3)"
T=$BUILD/multi-gpu/test
if [ -f "$W/test_gpu_comm.out" ]; then
    say "test_gpu_comm ran in section 5: $(grep -h 'gradient norms\|of the update' "$W/test_gpu_comm.out" | sed 's/^ *//' | head -4 | tr '\n' ' ')"
elif [ -x "$T/test_gpu_comm" ]; then
    if (cd "$W" && FP8C_GPU_IR_DIR=$T/ir FP8C_CACHE_DIR=$T/cache CMOCKA_MESSAGE_OUTPUT=stdout \
        FP8C_TEST_FILTER='test_sharded_*' "$T/test_gpu_comm" > "$W/test_gpu_comm.out" 2>&1); then
        say "test_gpu_comm (test_sharded_states, test_sharded_grads, test_sharded_weights) passed: $(grep -h 'gradient norms\|of the update' "$W/test_gpu_comm.out" | sed 's/^ *//' | head -4 | tr '\n' ' ')"
        grep -q "skipped" "$W/test_gpu_comm.out" && fail "test_gpu_comm skipped: $(grep skipped "$W/test_gpu_comm.out")"
    else
        fail "test_gpu_comm: $(grep -E 'differ|ERROR|FAIL|status|LINE|did not shard' "$W/test_gpu_comm.out" | head -8 | tr '\n' ' ')"
    fi
else
    say "test_gpu_comm not carried (BUILD/multi-gpu/test): skipped"
fi
# peak MiB each GPU used while CMD ran (nvidia-smi every 200 ms), into W/NAME.mem
with_mem() {
    local name=$1; shift
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$W/$name.smi" 2>/dev/null &
    local smi=$!
    "$@"
    local s=$?
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    python3 - "$W/$name.smi" > "$W/$name.mem" <<'PY'
import sys
peak = {}
for l in open(sys.argv[1]):
    p = [x.strip() for x in l.split(",")]
    if len(p) == 2 and p[1].isdigit(): peak[p[0]] = max(peak.get(p[0], 0), int(p[1]))
print(" ".join(f"GPU{k} {v} MiB" for k, v in sorted(peak.items())) or "nvidia-smi: no samples")
PY
    return $s
}
for o in O1 O3; do
    plain=d12_${o}_b32 zero=d12_${o}_b32_zero
    if with_mem $plain run $plain $fixed "$BIN/$plain" $common --steps "$STEPS" --gpus 2 --log "$W/$plain.jsonl" &&
       with_mem $zero run $zero $fixed "$BIN/$zero" $common --steps "$STEPS" --gpus 2 --log "$W/$zero.jsonl"; then
        r=$(identical "$W/$zero.jsonl" "$W/$plain.jsonl") &&
            say "GPT-2 d12 -$o batch 32, sharded vs unsharded on 2 GPUs, clipping active: $r" ||
            fail "GPT-2 d12 -$o batch 32, sharded vs unsharded on 2 GPUs, clipping active: $r"
        table "$RESULTS/equivalence_shard_$o.tsv" "$W/$plain.jsonl" "$W/$zero.jsonl"
        tp=$(tps "$W/$plain.jsonl"); tz=$(tps "$W/$zero.jsonl")
        say "  tokens/s: unsharded $tp, sharded $tz ($(python3 -c "print(f'{$tz / $tp:.3f}')") of unsharded)"
        say "  nvidia-smi peak: unsharded $(cat "$W/$plain.mem"); sharded $(cat "$W/$zero.mem")"
        say "  executor: $(grep -ho 'persistent arena [0-9]* bytes on this GPU, [0-9]* whole' "$W/$zero.out" | head -1)"
        say "  plan: $(grep -h 'persistent training state per GPU' "$BUILD/multi-gpu/plan_${zero}.txt" 2>/dev/null)"
    else
        fail "d12 -$o batch 32 with and without --shard-states: $(last $plain $zero)"
    fi
done
# stage 2: d12 -O3 with sharded gradients against the unsharded run of the loop above
plain=d12_O3_b32 zero2=d12_O3_b32_zero2
if [ -x "$BIN/$zero2" ] &&
   with_mem $zero2 run $zero2 $fixed "$BIN/$zero2" $common --steps "$STEPS" --gpus 2 --log "$W/$zero2.jsonl"; then
    r=$(identical "$W/$zero2.jsonl" "$W/$plain.jsonl") &&
        say "GPT-2 d12 -O3 batch 32, sharded gradients (stage 2) vs unsharded on 2 GPUs: $r" ||
        fail "GPT-2 d12 -O3 batch 32, sharded gradients (stage 2) vs unsharded on 2 GPUs: $r"
    table "$RESULTS/equivalence_shard2_O3.tsv" "$W/$plain.jsonl" "$W/$zero2.jsonl"
    tp=$(tps "$W/$plain.jsonl"); tz=$(tps "$W/$zero2.jsonl")
    say "  tokens/s: unsharded $tp, stage 2 $tz ($(python3 -c "print(f'{$tz / $tp:.3f}')") of unsharded)"
    say "  nvidia-smi peak: stage 2 $(cat "$W/$zero2.mem")"
    say "  executor: $(grep -ho 'persistent arena [0-9]* bytes on this GPU, [0-9]* whole' "$W/$zero2.out" | head -1)"
    say "  plan: $(grep -h 'persistent training state per GPU\|of gradient buffers' "$BUILD/multi-gpu/plan_${zero2}.txt" 2>/dev/null | tr '\n' ' ')"
else
    fail "d12 -O3 batch 32 with --shard-states=2: $(last $zero2)"
fi
# stage 3: d12 -O3 with sharded weights against the unsharded run, beside stage 2's
zero3=d12_O3_b32_zero3
if [ -x "$BIN/$zero3" ] &&
   with_mem $zero3 run $zero3 $fixed "$BIN/$zero3" $common --steps "$STEPS" --gpus 2 --log "$W/$zero3.jsonl"; then
    r=$(identical "$W/$zero3.jsonl" "$W/$plain.jsonl") &&
        say "GPT-2 d12 -O3 batch 32, sharded weights (stage 3) vs unsharded on 2 GPUs: $r" ||
        fail "GPT-2 d12 -O3 batch 32, sharded weights (stage 3) vs unsharded on 2 GPUs: $r"
    if [ -f "$W/$zero2.jsonl" ]; then
        r=$(identical "$W/$zero3.jsonl" "$W/$zero2.jsonl") &&
            say "  against stage 2 (the same sums and norm; every step bit for bit): $r" ||
            fail "  stage 3 against stage 2 (every step bit for bit): $r"
    fi
    table "$RESULTS/equivalence_shard3_O3.tsv" "$W/$plain.jsonl" "$W/$zero3.jsonl"
    tp=$(tps "$W/$plain.jsonl"); tz=$(tps "$W/$zero3.jsonl")
    t2=$([ -f "$W/$zero2.jsonl" ] && tps "$W/$zero2.jsonl" || echo "?")
    say "  tokens/s: unsharded $tp, stage 2 $t2, stage 3 $tz ($(python3 -c "print(f'{$tz / $tp:.3f}')") of unsharded)"
    say "  nvidia-smi peak: stage 2 $(cat "$W/$zero2.mem" 2>/dev/null); stage 3 $(cat "$W/$zero3.mem")"
    say "  executor: $(grep -ho 'persistent arena [0-9]* bytes on this GPU, [0-9]* whole' "$W/$zero3.out" | head -1)"
    say "  plan: $(grep -h 'persistent training state per GPU\|of gradient buffers\|of layer buffers\|peak memory per GPU' "$BUILD/multi-gpu/plan_${zero3}.txt" 2>/dev/null | tr '\n' ' ')"
else
    fail "d12 -O3 batch 32 with --shard-states=3: $(last $zero3)"
fi
# a sharded checkpoint resumed: on 2 GPUs sharded (bit for bit), on 1 GPU (within 1e-3)
tz=$BIN/tiny_O3_zero
if run zsave $fixed "$tz" $common --steps 10 --stop-at 5 --gpus 2 --out "$W/zck" &&
   run zstraight $fixed "$tz" $common --steps 10 --gpus 2 --log "$W/zstraight.jsonl" &&
   run zresume2 $fixed "$tz" $common --steps 10 --gpus 2 --resume "$W/zck" --log "$W/zresume2.jsonl" &&
   run zresume1 $fixed "$tz" $common --steps 10 --grad-accum 2 --resume "$W/zck" --log "$W/zresume1.jsonl"; then
    r=$(python3 - "$W/zresume2.jsonl" "$W/zresume1.jsonl" "$W/zstraight.jsonl" <<'PY'
import json, sys
def losses(p): return {j["step"]: j["loss"] for j in map(json.loads, open(p)) if "loss" in j}
r2, r1, st = (losses(p) for p in sys.argv[1:])
same2 = all(r2[s] == st[s] for s in r2) and len(r2) > 0
worst1 = max(abs(r1[s] - st[s]) / abs(st[s]) for s in r1) if r1 else float("nan")
print(f"steps {min(r2)}..{max(r2)}: resumed on 2 GPUs sharded {'bit-identical' if same2 else 'DIFFERENT'} "
      f"to the straight run; resumed on 1 GPU worst relative loss difference {worst1:.2e}")
sys.exit(0 if same2 and worst1 <= 1e-3 else 1)
PY
) && say "gpt2_tiny -O3 sharded checkpoint: $r" || fail "gpt2_tiny -O3 sharded checkpoint: $r"
else
    fail "sharded save and resume: $(last zsave zstraight zresume2 zresume1)"
fi
fi

say ""
[ $FAILED = 0 ] && say "multi-GPU check: all passed" || say "multi-GPU check: FAILURES above"
cp "$SUMMARY" "$RESULTS/summary.txt"
tar -C "$W" -czf "$RESULTS/logs.tgz" --exclude corpus.txt --exclude ck . 2>/dev/null
exit $FAILED
