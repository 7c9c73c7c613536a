"""Attention alone: fp8c's kernels against PyTorch's SDPA backends, forward and backward, TFLOP/s.

usage: python3 tools/bench/attn_bench.py [--shapes d12,d48,llama] [--trace NAME=FILE ...]
                                         [--iters 30] [--json FILE]

PyTorch side: torch.nn.functional.scaled_dot_product_attention, causal, bf16, (B, H, T, D) as the
training benchmarks run it (d12: 32 x 12 heads x 1024 x 64; d48: 8 x 25 x 1024 x 64; llama:
4 x 32 query heads, 4 key/value heads x 2048 x 64, enable_gqa), once per backend that accepts
the shape (flash, cudnn, efficient), timed with CUDA events over --iters calls after warm-up:
the forward alone, and forward + backward (the backward is the difference).

fp8c side: a trace written by a training binary run with FP8C_CUDA_TRACE=FILE (one line per
launch: run, index, op, kernel, node, name, ms). Each launch is timed alone there, so the
figures include no overlap; a step's `attention` launches are the forward, its `attention_bwd`
launches (statistics, dq and dk/dv passes) the backward, divided by the number of layers. The
shape of a trace is named by NAME (d12, d48 or llama) and must match the binary's.

FLOPs count the causal half: forward 4 B H T^2 D / 2 (S = Q K^T and O = P V), backward 2.5 times
that (five tile products), as FlashAttention reports them.
"""
import argparse, collections, json, sys

SHAPES = {   # B, H, Hkv, T, D, layers
    "d12": (32, 12, 12, 1024, 64, 12),
    "d48": (8, 25, 25, 1024, 64, 48),
    "llama": (4, 32, 4, 2048, 64, 22),
}


def fwd_flops(B, H, T, D):
    return 4.0 * B * H * T * T * D / 2


def torch_rows(name, iters):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, Hkv, T, D, _ = SHAPES[name]
    dev = "cuda"
    q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    gqa = Hkv != H
    rows = []
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        def fwd_bwd():
            y = fwd()
            y.backward(dy)

        try:
            with sdpa_kernel([backend]):
                fwd_bwd()
                torch.cuda.synchronize()
                times = []
                for f in (fwd, fwd_bwd):
                    for _ in range(3):
                        f()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(iters):
                        f()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) / iters)
        except Exception as e:   # a backend that does not take the shape
            print(f"{name}: SDPA {label}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            continue
        q.grad = k.grad = v.grad = None
        rows.append({"shape": name, "system": f"SDPA {label}", "fwd_ms": times[0], "bwd_ms": times[1] - times[0]})
    return rows


def trace_row(name, path):
    B, H, Hkv, T, D, layers = SHAPES[name]
    per_run = collections.defaultdict(lambda: [0.0, 0.0])
    for line in open(path):
        f = line.rstrip("\n").split("\t")
        if len(f) < 7:
            continue
        if f[2] == "attention":
            per_run[int(f[0])][0] += float(f[6])
        elif f[2] == "attention_bwd":
            per_run[int(f[0])][1] += float(f[6])
    runs = sorted(r for r in per_run if per_run[r][1] > 0)
    if not runs:
        sys.exit(f"{path}: no attention launches in the trace")
    keep = runs[len(runs) // 2:] or runs   # later steps: warm caches, graphs captured
    fwd = sum(per_run[r][0] for r in keep) / len(keep) / layers
    bwd = sum(per_run[r][1] for r in keep) / len(keep) / layers
    return {"shape": name, "system": "fp8c", "fwd_ms": fwd, "bwd_ms": bwd}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="d12,d48,llama")
    ap.add_argument("--trace", action="append", default=[], help="NAME=FILE, a training binary's FP8C_CUDA_TRACE")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            sys.exit(f"unknown shape {name}: one of {', '.join(SHAPES)}")
        rows += torch_rows(name, args.iters)
    for t in args.trace:
        name, _, path = t.partition("=")
        if name not in SHAPES or not path:
            sys.exit(f"--trace {t}: expected NAME=FILE with NAME one of {', '.join(SHAPES)}")
        rows.append(trace_row(name, path))
    print(f"{'shape':6} {'system':16} {'fwd ms':>8} {'TFLOP/s':>8} {'bwd ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        B, H, _, T, D, _ = SHAPES[r["shape"]]
        fl = fwd_flops(B, H, T, D)
        r["fwd_tflops"] = fl / r["fwd_ms"] / 1e9
        r["bwd_tflops"] = 2.5 * fl / r["bwd_ms"] / 1e9
        print(f"{r['shape']:6} {r['system']:16} {r['fwd_ms']:8.3f} {r['fwd_tflops']:8.0f} "
              f"{r['bwd_ms']:8.3f} {r['bwd_tflops']:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
