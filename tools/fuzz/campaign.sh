#!/bin/sh
# campaign.sh DIR MINUTES — a long fuzzing run on a many-core machine: every libFuzzer harness
# in DIR/bin (made by tools/fuzz/prepare_campaign.sh, which also copies this script into DIR)
# at once, each in libFuzzer's fork mode with its share of the cores, for MINUTES minutes.
#
# Each harness fuzzes one corpus, DIR/corpus/NAME, which its forks share and which keeps what
# they find: a second campaign on the same DIR goes on from where the first stopped. Crash,
# leak, timeout and out-of-memory inputs go to DIR/artifacts/NAME/; a crash does not stop the
# harness (-ignore_crashes), so one run reports every kind of failure it meets. The logs go to
# DIR/logs/DATE/NAME.log, and the summary, a line per harness with its executions, corpus size
# and failures, to DIR/summary-DATE.txt, which is also printed.
#
# The binaries are linked with their sanitizer runtimes and need only libc, libm, libstdc++ and
# libgcc_s: no clang, LLVM or CUDA on this machine. Stack traces are symbolized by addr2line
# (binutils) where llvm-symbolizer is missing. Environment: CORES (default: all of them),
# HARNESSES (default: every one in DIR/bin). Exit status 1 when a harness found anything.
set -u
dir=${1:?usage: campaign.sh DIR MINUTES}
minutes=${2:?usage: campaign.sh DIR MINUTES}
case $minutes in
    ''|*[!0-9]*|0) echo "campaign.sh: MINUTES must be a positive whole number, not '$minutes'" >&2; exit 2 ;;
esac
dir=$(cd "$dir" 2>/dev/null && pwd) || { echo "campaign.sh: no directory '$1'" >&2; exit 2; }
cores=${CORES:-$(nproc)}
harnesses=${HARNESSES:-$(cd "$dir/bin" 2>/dev/null && ls fuzz_* 2>/dev/null | sed 's/^fuzz_//')}
[ -n "$harnesses" ] || { echo "campaign.sh: no harness in $dir/bin (run prepare_campaign.sh)" >&2; exit 2; }

stamp=$(date -u +%Y-%m-%dT%H%MZ)
logs=$dir/logs/$stamp
summary=$dir/summary-$stamp.txt
if [ -e "$logs" ] || [ -e "$summary" ]; then
    echo "campaign.sh: $logs or $summary exists; wait a minute and start again" >&2
    exit 2
fi
mkdir -p "$logs"

# Cores per harness: the model language and the command line run the whole pipeline on each
# input (about 1,000 executions a second a core against 10,000 or more for the readers), so
# they get twice the share of the others; every harness gets at least one.
weight() { case $1 in model|cli) echo 2 ;; *) echo 1 ;; esac; }
total=0
for h in $harnesses; do total=$((total + $(weight "$h"))); done

export ASAN_OPTIONS=${ASAN_OPTIONS:-allow_addr2line=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:abort_on_error=1}
seconds=$((minutes * 60))
echo "campaign: $minutes min on $cores cores, logs in $logs"
for h in $harnesses; do
    forks=$((cores * $(weight "$h") / total))
    [ "$forks" -ge 1 ] || forks=1
    echo "$forks" > "$logs/$h.forks"
    mkdir -p "$dir/corpus/$h" "$dir/artifacts/$h"
    ls "$dir/corpus/$h" | wc -l > "$logs/$h.before"
    # a hard stop well after the requested time, should a fork not wind up
    timeout -s INT $((seconds + 600)) "$dir/bin/fuzz_$h" -fork="$forks" -max_total_time="$seconds" \
        -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 -timeout=10 -rss_limit_mb=2048 \
        -max_len=65536 -artifact_prefix="$dir/artifacts/$h/" "$dir/corpus/$h" \
        > "$logs/$h.log" 2>&1 &
    echo $! > "$logs/$h.pid"
done
status=0
for h in $harnesses; do
    wait "$(cat "$logs/$h.pid")"
    echo $? > "$logs/$h.rc"
done

# the failures of this run: inputs newer than the start (earlier runs' stay beside them)
found() { find "$dir/artifacts/$1" -type f -name "$2" -newer "$logs/$1.before" | wc -l; }
{
    echo "fp8c fuzzing campaign $stamp: $minutes min, $cores cores, $(uname -n)"
    [ -f "$dir/VERSION" ] && echo "harnesses built from $(cat "$dir/VERSION")"
    printf '%-6s %5s %14s %9s %7s %6s %8s %5s  %s\n' harness forks executions corpus crashes leaks timeouts ooms result
    for h in $harnesses; do
        # the fork-mode parent's last progress line: "#EXECS: cov: ... corp: N ..."
        execs=$(sed -n 's/^#\([0-9]*\): cov:.*/\1/p' "$logs/$h.log" | tail -n 1)
        before=$(cat "$logs/$h.before")
        after=$(ls "$dir/corpus/$h" | wc -l)
        crashes=$(found "$h" 'crash-*')
        leaks=$(found "$h" 'leak-*')
        timeouts=$(found "$h" 'timeout-*')
        ooms=$(found "$h" 'oom-*')
        rc=$(cat "$logs/$h.rc")
        result=ok
        if [ $((crashes + leaks + timeouts + ooms)) -gt 0 ]; then
            result="FOUND: $dir/artifacts/$h/"
            status=1
        elif [ "$rc" -ne 0 ] || [ -z "$execs" ]; then
            result="exit $rc: $logs/$h.log"
            status=1
        fi
        printf '%-6s %5s %14s %9s %7s %6s %8s %5s  %s\n' "$h" "$(cat "$logs/$h.forks")" \
            "${execs:-?}" "$before>$after" "$crashes" "$leaks" "$timeouts" "$ooms" "$result"
    done
} > "$summary"
cat "$summary"
echo "summary: $summary"
exit $status
