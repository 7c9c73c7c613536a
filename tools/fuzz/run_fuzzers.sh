#!/bin/sh
# run_fuzzers.sh BUILD [SECONDS] [HARNESS...] — runs each fuzz harness of tests/fuzz built in
# BUILD for SECONDS (default 60) on a copy of its seed corpus, with a fixed seed, and prints a
# line per harness: executions, seconds, result. BUILD is either a libFuzzer build (clang,
# -DFP8C_FUZZ=ON) or any other build with the tests, whose harnesses have the standalone driver
# (tests/fuzz/standalone.c: the corpus replayed, then blind mutations); both take the same
# flags. The copies, the logs and any crash, leak or timeout input stay in a directory named at
# the end (the corpora in the tree are never written). Exit status: 1 when a harness failed.
set -u
build=${1:?usage: run_fuzzers.sh BUILD [SECONDS] [HARNESS...]}
seconds=${2:-60}
[ $# -ge 2 ] && shift 2 || shift $#
root=$(cd "$(dirname "$0")/../.." && pwd)
harnesses=${*:-model ir ckpt data args cli}
# a UBSan report ends the process through abort(), where either driver saves the input
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:abort_on_error=1}
work=$(mktemp -d "${TMPDIR:-/tmp}/fp8c-fuzz-run-XXXXXX")
status=0
printf '%-8s %12s %8s  %s\n' harness executions seconds result
for h in $harnesses; do
    bin=$build/tests/fuzz/fuzz_$h
    if [ ! -x "$bin" ]; then
        printf '%-8s %12s %8s  %s\n' "$h" - - "missing: $bin"
        status=1
        continue
    fi
    mkdir -p "$work/$h/corpus" "$work/$h/artifacts"
    cp "$root/tests/fuzz/corpus/$h/"* "$work/$h/corpus/"
    start=$(date +%s)
    "$bin" -seed=1 -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 -artifact_prefix="$work/$h/artifacts/" \
        "$work/$h/corpus" > "$work/$h/log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$h/log" | tail -n 1)
    if [ $rc -eq 0 ]; then
        result=ok
    else
        status=1
        found=$(ls "$work/$h/artifacts" | head -n 1)
        result="FAILED (exit $rc): $work/$h/artifacts/$found"
        [ -n "$execs" ] || execs=$(grep -o '^#[0-9]*' "$work/$h/log" | tail -n 1 | tr -d '#')
    fi
    printf '%-8s %12s %8s  %s\n' "$h" "${execs:-?}" "$took" "$result"
done
echo "logs and inputs: $work"
exit $status
