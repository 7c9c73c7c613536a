"""Where a GPU step's time goes, kernel by kernel, and how near the memory's speed each runs.

usage: python3 tools/bench/trace_kernels.py TRACE PLAN [--step K] [--top N]

TRACE is what a training binary writes with FP8C_CUDA_TRACE=TRACE (a tab-separated line per
launch of every run list: the list's number, the launch's index in it, the op, the kernel, the
node, the tensor, the milliseconds of that launch timed alone). PLAN is what
`fp8c plan MODEL FLAGS --kernels --device cuda` prints for the same build: a line per launch
in launch order, with the bytes the plan gives it (MiB: each tensor once, a lower bound where
a kernel reads and writes the same tensor, as the update's AdamW does its states) and its
FLOPs.

A step runs a list of the micro-step's launches (the forward, then the backward) and a list of
the update's; the trace numbers its lists in the order they ran, evaluation's included. The
K-th list (default 2: the first has the graphs captured) whose launch count is the plan's
forward and backward together is matched line by line with the plan, and the list of the
update that follows it with the plan's update lines; a launch whose op is not among the plan
line's ends the run with a line saying which (another build's trace). Printed: per kernel (the
plan's name; `gemm` for cuBLASLt), the launches, milliseconds, GiB the plan counts and
GB/s, largest time first, and the step's sums.

A launch timed alone includes its launch: the host records an event, launches, records another,
and waits, so even a launch that does nothing takes some microseconds (on an H200 about 6: a
one-block scale launch). The last column is the GB/s with that floor taken off each launch:
--floor MS, by default the shortest launch of the step. It is what the kernel's own bytes and
time say; inside a CUDA graph launches are cheaper than alone, but not free.
"""
import argparse, collections, sys


def read_plan(path):
    """(phase, kernel, MiB, the ops it computes) per launch line of `fp8c plan --kernels`, in order."""
    lines = []
    for line in open(path):
        f = line.split()
        if len(f) < 7 or not f[0].isdigit() or f[1] not in ("forward", "backward", "update"):
            continue
        kernel = "gemm" if f[2] == "gemm" else f[3]
        mib = float(f[-2]) if f[-2] != "-" else 0.0
        lines.append((f[1], kernel, mib, f[4].split("+")))
    return lines


def read_trace(path):
    """{list number: [(op, kernel function, ms)]} in launch order."""
    lists = collections.defaultdict(list)
    for line in open(path):
        f = line.rstrip("\n").split("\t")
        if len(f) < 7 or not f[0].isdigit():
            continue
        lists[int(f[0])].append((f[2], f[3], float(f[6])))
    return lists


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("plan")
    ap.add_argument("--step", type=int, default=2, help="which step's lists (1 is the first)")
    ap.add_argument("--top", type=int, default=40, help="kernels printed at most")
    ap.add_argument("--floor", type=float, default=None,
                    help="ms of a launch that does nothing (default: the step's shortest launch)")
    a = ap.parse_args()
    plan = read_plan(a.plan)
    micro = [p for p in plan if p[0] != "update"]
    update = [p for p in plan if p[0] == "update"]
    lists = read_trace(a.trace)
    if not micro or not lists:
        sys.exit(f"trace_kernels: {a.plan if not micro else a.trace}: no launch lines")
    steps = [k for k in sorted(lists) if len(lists[k]) == len(micro)]
    if len(steps) < a.step:
        sys.exit(f"trace_kernels: the trace has {len(steps)} list(s) of the plan's {len(micro)} forward and "
                 f"backward launches; --step {a.step} asked")
    first = steps[a.step - 1]
    pairs = list(zip(micro, lists[first]))
    if update and first + 2 in lists and len(lists[first + 2]) == len(update):
        pairs += list(zip(update, lists[first + 2]))   # the list after the finite check's
    else:
        print(f"trace_kernels: no update list of {len(update)} launches after list {first}: the update "
              f"is left out", file=sys.stderr)
    for k, ((phase, kernel, mib, ops), (op, fn, ms)) in enumerate(pairs):
        if op not in ops:
            sys.exit(f"trace_kernels: launch {k} of the step is {op} ({fn}) where the plan has {'+'.join(ops)}: "
                     f"not the same build")
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    total_ms = total_mib = 0.0
    for (phase, kernel, mib, ops), (op, fn, ms) in pairs:
        a_ = agg[kernel]
        a_[0] += 1
        a_[1] += ms
        a_[2] += mib
        total_ms += ms
        total_mib += mib
    floor = a.floor if a.floor is not None else min(ms for _, (op, fn, ms) in pairs)
    print(f"step {a.step} (trace lists {first} and {first + 2}): {len(pairs)} launches, "
          f"{total_ms:.2f} ms timed alone, {total_mib / 1024:.1f} GiB by the plan; "
          f"a launch's floor {floor * 1000:.1f} us ({len(pairs) * floor:.2f} ms of the step)")
    print(f"{'kernel':14s} {'launches':>8s} {'ms':>9s} {'GiB':>8s} {'GB/s':>7s} {'less floor':>10s}")

    def rate(mib, ms):
        return f"{mib * 1.048576 / ms:7.0f}" if ms > 0 and mib > 0 else "      -"
    for kernel, (n, ms, mib) in sorted(agg.items(), key=lambda x: -x[1][1])[:a.top]:
        print(f"{kernel:14s} {n:8d} {ms:9.2f} {mib / 1024:8.2f} {rate(mib, ms)} {rate(mib, ms - n * floor):>10s}")


if __name__ == "__main__":
    main()
