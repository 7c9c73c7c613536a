"""fp8c against PyTorch on one GPU, in one invocation: GPT-2 training-step throughput and memory.

usage: python3 tools/bench/gpu_bench.py --bins DIR --data FILE [--configs d12:32,d48:8]
                                        [--levels 0,1,2,3] [--steps 30] [--torch-steps 20]

For each configuration SIZE:BATCH (sequence 1024), PyTorch runs first
(tools/bench/torch_gpt.py SIZE bf16 BATCH 1024: bf16 autocast, torch.compile, fused AdamW,
flash attention), then each fp8c level from the training binary DIR/gpt2_SIZE_bBATCH_O<level>
(built by `fp8c build models/gpt2.model -O<level> --batch BATCH --seq 1024 [-D ...]`) trains
--steps steps on FILE with --device cuda. fp8c's step time is the median over the steps after
the first quarter (the first replays capture the CUDA graphs); tokens/s is batch x 1024 over
it; model TFLOP/s counts 6N + 12 L d T FLOPs per token as torch_gpt.py does. Memory: fp8c's is
the device memory in use that the binary reports once its arenas are allocated (arenas, the
CUDA context, cuBLASLt's workspace), PyTorch's is torch.cuda.max_memory_allocated (its caching
allocator's peak, without the context): the comparison flatters PyTorch by the context's few
hundred MiB. Prints one table; --json FILE also writes the rows.
"""
import argparse, json, os, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"d12": (12, 768), "d24": (24, 1024), "d36": (36, 1280), "d48": (48, 1600)}


def run_torch(size, batch, steps):
    cmd = [sys.executable, os.path.join(ROOT, "tools/bench/torch_gpt.py"), size, "bf16", str(batch), "1024",
           str(steps)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        print(f"PyTorch {size} batch {batch} failed ({p.returncode}):\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    r = json.loads(lines[-1])
    return {"system": "PyTorch bf16 compiled", "ms": r["ms_per_step"], "tok_s": r["tok_per_s"],
            "tflops": r["tflops"], "mem_gib": r["peak_GiB"]}


def run_fp8c(binary, data, steps, size, batch, work):
    log = os.path.join(work, os.path.basename(binary) + ".jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [binary, "--data", data, "--device", "cuda", "--steps", str(steps), "--eval-every", "0",
           "--warmup", "2", "--log", log]
    p = subprocess.run(cmd, capture_output=True, text=True)
    with open(log + ".stderr", "w") as f:
        f.write(p.stderr)
    rows = [json.loads(l) for l in open(log)] if os.path.exists(log) else []
    rows = [r for r in rows if "ms" in r]
    if p.returncode != 0 or not rows:
        print(f"{binary} failed ({p.returncode}):\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    ms = statistics.median(r["ms"] for r in rows[len(rows) // 4:])
    nparam = int(re.search(r"([0-9]+) parameters", p.stderr).group(1))
    mem = re.search(r"([0-9.]+) GiB of device memory in use", p.stderr)
    L, d = SIZES[size]
    tok = batch * 1024 / (ms / 1e3)
    return {"ms": ms, "tok_s": tok, "tflops": tok * (6 * nparam + 12 * L * d * 1024) / 1e12,
            "mem_gib": float(mem.group(1)) if mem else float("nan"), "loss": rows[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bins", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--configs", default="d12:32,d48:8")
    ap.add_argument("--levels", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--torch-steps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/fp8c-gpu-bench")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    table = []
    for cfg in a.configs.split(","):
        size, batch = cfg.split(":")
        batch = int(batch)
        ref = run_torch(size, batch, a.torch_steps)
        if ref:
            table.append(dict(ref, config=f"{size} b{batch}"))
            print(f"{size} b{batch} PyTorch: {ref}", flush=True)
        for level in a.levels.split(","):
            binary = os.path.join(a.bins, f"gpt2_{size}_b{batch}_O{level}")
            if not os.path.exists(binary):
                continue
            r = run_fp8c(binary, a.data, a.steps, size, batch, a.work)
            if not r:
                continue
            r.update(config=f"{size} b{batch}", system=f"fp8c -O{level}")
            if ref:
                r["speed_ratio"] = r["tok_s"] / ref["tok_s"]
                r["mem_ratio"] = r["mem_gib"] / ref["mem_gib"]
            table.append(r)
            print(f"{size} b{batch} fp8c -O{level}: {r}", flush=True)
    print()
    print(f"| config | system | ms/step | tokens/s | model TFLOP/s | memory GiB | speed vs PyTorch | memory vs PyTorch |")
    print(f"|---|---|---|---|---|---|---|---|")
    for r in table:
        sr = f"{r['speed_ratio']:.2f}x" if "speed_ratio" in r else "1.00x" if r["system"].startswith("PyTorch") else ""
        mr = f"{r['mem_ratio']:.2f}x" if "mem_ratio" in r else "1.00x" if r["system"].startswith("PyTorch") else ""
        print(f"| {r['config']} | {r['system']} | {r['ms']:.1f} | {r['tok_s']:,.0f} | {r['tflops']:.0f} | "
              f"{r['mem_gib']:.2f} | {sr} | {mr} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
