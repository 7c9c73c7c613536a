"""fp8c against PyTorch on one GPU, in one invocation: training-step throughput and memory.

usage: python3 tools/bench/gpu_bench.py --bins DIR --data FILE [--configs d12:32,d48:8,llama:4:2048]
                                        [--levels 0,1,2,3] [--torchao tw,rw] [--steps 30]
                                        [--torch-steps 20] [--json FILE]

For each configuration NAME:BATCH[:SEQ] (NAME d12, d24, d36, d48 for GPT-2 shapes, or llama for
models/llama.model's TinyLlama shape; SEQ 1024 unless given), PyTorch runs first
(tools/bench/torch_gpt.py or torch_llama.py in bf16: autocast, torch.compile, fused AdamW, SDPA
attention), then torchao float8 (--torchao: tw tensorwise, rw rowwise; skipped where torchao
does not import), then each fp8c level from the training binary DIR/<prefix>_bBATCH_O<level>
(prefix gpt2_d12 .. gpt2_d48, or llama; built by `fp8c build models/gpt2.model -O<level>
--batch BATCH --seq 1024 [-D ...]` or `fp8c build models/llama.model -O<level> --batch BATCH
--seq SEQ`) trains --steps steps on FILE with --device cuda. fp8c's step time is the median over
the steps after the first quarter (the first replays capture the CUDA graphs); tokens/s is
batch x seq over it; model TFLOP/s counts 6N + 12 L d T FLOPs per token as the PyTorch scripts
do. Memory: fp8c's is the device memory in use that the binary reports once its arenas are
allocated (arenas, the CUDA context, cuBLASLt's workspace), PyTorch's is
torch.cuda.max_memory_allocated (its caching allocator's peak, without the context): the
comparison flatters PyTorch by the context's few hundred MiB. Prints one table; --json FILE
also writes the rows ({"model", "batch", "seq", "system", "level", "ms", "peak_gib", ...}),
rewritten after every row, so that a run cut short (a device call's time limit) keeps the rows
it made; a FILE that exists already is refused, not overwritten.
"""
import argparse, json, os, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = {"d12": (12, 768), "d24": (24, 1024), "d36": (36, 1280), "d48": (48, 1600), "llama": (22, 2048)}


def run_torch(size, batch, seq, steps, mode="bf16"):
    script = "torch_llama.py" if size == "llama" else "torch_gpt.py"
    args = [mode, str(batch), str(seq), str(steps)] if size == "llama" else [size, mode, str(batch), str(seq), str(steps)]
    cmd = [sys.executable, os.path.join(ROOT, "tools/bench", script)] + args
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        print(f"PyTorch {mode} {size} batch {batch} failed ({p.returncode}):\n{p.stderr[-2000:]}", file=sys.stderr)
        return None
    r = json.loads(lines[-1])
    names = {"bf16": "PyTorch bf16 compiled", "fp8tw": "torchao float8 tensorwise", "fp8rw": "torchao float8 rowwise"}
    return {"system": names[mode], "ms": r["ms_per_step"], "tok_s": r["tok_per_s"],
            "tflops": r["tflops"], "mem_gib": r["peak_GiB"]}


def run_fp8c(binary, data, steps, size, batch, seq, work):
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
    tok = batch * seq / (ms / 1e3)
    return {"ms": ms, "tok_s": tok, "tflops": tok * (6 * nparam + 12 * L * d * seq) / 1e12,
            "mem_gib": float(mem.group(1)) if mem else float("nan"), "loss": rows[-1]["loss"]}


def ratio(r, key):
    """a row's ratio to PyTorch bf16, rounded; PyTorch's own is 1, none without a PyTorch row"""
    if key in r:
        return round(r[key], 3)
    return 1.0 if r["system"].startswith("PyTorch") else None


def write_json(path, table):
    """The rows so far into path, through a temporary file renamed over it (never half written)."""
    rows = [{"model": r["model"], "batch": r["batch"], "seq": r["seq"], "system": r["system"],
             "level": r["level"], "ms": round(r["ms"], 2), "peak_gib": round(r["mem_gib"], 2),
             "tok_s": round(r["tok_s"]), "tflops": round(r["tflops"], 1),
             "speed_ratio": ratio(r, "speed_ratio"), "mem_ratio": ratio(r, "mem_ratio")}
            for r in table]
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bins", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--configs", default="d12:32,d48:8")
    ap.add_argument("--levels", default="0,1,2,3")
    ap.add_argument("--torchao", default="", help="comma list of tw, rw")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--torch-steps", type=int, default=20)
    ap.add_argument("--work", default="/tmp/fp8c-gpu-bench")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.json and os.path.exists(a.json):
        sys.exit(f"gpu_bench.py: --json {a.json} exists; it is not overwritten")
    os.makedirs(a.work, exist_ok=True)
    table = []

    def save(row):
        table.append(row)
        if a.json:
            write_json(a.json, table)

    for cfg in a.configs.split(","):
        parts = cfg.split(":")
        size, batch = parts[0], int(parts[1])
        seq = int(parts[2]) if len(parts) > 2 else (2048 if size == "llama" else 1024)
        if size not in SIZES:
            sys.exit(f"gpu_bench.py: --configs {cfg}: unknown model {size}")
        base = dict(config=f"{size} b{batch}" + (f" x {seq}" if seq != 1024 else ""), model=size, batch=batch, seq=seq)
        ref = run_torch(size, batch, seq, a.torch_steps)
        if ref:
            save(dict(ref, level=None, **base))
            print(f"{base['config']} PyTorch: {ref}", flush=True)
        for kind in filter(None, a.torchao.split(",")):
            r = run_torch(size, batch, seq, a.torch_steps, "fp8" + kind)
            if r:
                if ref:
                    r["speed_ratio"] = r["tok_s"] / ref["tok_s"]
                    r["mem_ratio"] = r["mem_gib"] / ref["mem_gib"]
                save(dict(r, level=None, **base))
                print(f"{base['config']} {r['system']}: {r}", flush=True)
        prefix = "llama" if size == "llama" else f"gpt2_{size}"
        for level in a.levels.split(","):
            binary = os.path.join(a.bins, f"{prefix}_b{batch}_O{level}")
            if not os.path.exists(binary):
                continue
            r = run_fp8c(binary, a.data, a.steps, size, batch, seq, a.work)
            if not r:
                continue
            r.update(system=f"fp8c -O{level}", level=int(level), **base)
            if ref:
                r["speed_ratio"] = r["tok_s"] / ref["tok_s"]
                r["mem_ratio"] = r["mem_gib"] / ref["mem_gib"]
            save(r)
            print(f"{base['config']} fp8c -O{level}: {r}", flush=True)
    print()
    print(f"| config | system | ms/step | tokens/s | model TFLOP/s | memory GiB | speed vs PyTorch | memory vs PyTorch |")
    print(f"|---|---|---|---|---|---|---|---|")
    for r in table:
        sr = f"{r['speed_ratio']:.2f}x" if "speed_ratio" in r else "1.00x" if r["system"].startswith("PyTorch") else ""
        mr = f"{r['mem_ratio']:.2f}x" if "mem_ratio" in r else "1.00x" if r["system"].startswith("PyTorch") else ""
        print(f"| {r['config']} | {r['system']} | {r['ms']:.1f} | {r['tok_s']:,.0f} | {r['tflops']:.0f} | "
              f"{r['mem_gib']:.2f} | {sr} | {mr} |")


if __name__ == "__main__":
    main()
