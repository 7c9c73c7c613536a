"""PyTorch as an outside judge of a GPT-2 training binary: the same start, the same batches, the
same schedule and optimizer, per-step losses compared.

usage: python3 tools/torch_crosscheck.py BINARY DATA.bin --heads H --mode f32|bf16
                                         [--steps 20] [--seed 1] [--lr X] [--warmup N]
                                         [--device cuda|cpu] [--work DIR] [--bound X]

BINARY is a training binary built by `fp8c build models/gpt2.model` (or gpt2_tiny): for
--mode f32 with `-O0 --precision '*=f32' --precision 'value:*=f32'` (no reduced precision
anywhere), for --mode bf16 with plain `-O0`. DATA.bin is an llm.c token shard.

What it does:
  1. `BINARY --stop-at 0` writes the initial state; its parameters (the f32 master where the
     parameter itself is bf16) become the PyTorch model's.
  2. BINARY trains --steps steps (JSON log); PyTorch trains the same steps from the same state:
     each batch is drawn by the binary's rule (runtime/data.c: row r of micro-step 0 of step s
     starts at splitmix(splitmix(splitmix(splitmix(seed) ^ s) ^ 0) ^ r) mod windows), the
     learning rate follows rt_lr_at (linear warm-up, cosine to lr/10), the update is the
     binary's AdamW (bias-corrected, decoupled weight decay on the matrices except wpe and
     the norms, global-norm clipping at 1.0).
  3. The relative difference of the losses, step by step, against --bound (default 1e-4 for
     f32, 1e-2 for bf16). Exit status 1 when a step is over it.

f32 mode turns TF32 off, so both sides do f32 arithmetic and differ only in summation order.
bf16 mode runs PyTorch under bf16 autocast (bf16 GEMMs and attention, f32 norms and softmax
statistics) from f32 weights, as the usual mixed-precision recipe does; fp8c -O0 keeps bf16
weights beside an f32 master, so the two recipes round in different places, hence the looser
bound. fp8c itself never depends on Python: this is a check, not a component.
"""
import argparse, json, math, os, struct, subprocess, sys, tempfile

import torch
import torch.nn.functional as F

MASK = (1 << 64) - 1


def splitmix(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def read_shard(path):
    with open(path, "rb") as f:
        head = struct.unpack("<256i", f.read(1024))
        if head[0] != 20240520:
            sys.exit(f"{path}: not an llm.c token shard (magic {head[0]})")
        n = head[2]
        raw = f.read(2 * n)
    if len(raw) != 2 * n:
        sys.exit(f"{path}: truncated: {len(raw) // 2} of {n} tokens")
    return torch.frombuffer(bytearray(raw), dtype=torch.int16).to(torch.int64) & 0xFFFF


def batch(tokens, seed, step, B, T):
    windows = tokens.numel() - T
    rows = []
    for r in range(B):
        h = splitmix(seed)
        h = splitmix(h ^ step)
        h = splitmix(h ^ 0)
        h = splitmix(h ^ r)
        rows.append(h % windows)
    x = torch.stack([tokens[w:w + T] for w in rows])
    y = torch.stack([tokens[w + 1:w + T + 1] for w in rows])
    return x, y


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = bytearray(f.read())
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    out = {}
    for name, info in head.items():
        if name == "__metadata__" or info["dtype"] not in dtypes:
            continue
        lo, hi = info["data_offsets"]
        t = torch.frombuffer(data[lo:hi], dtype=dtypes[info["dtype"]]) if hi > lo else torch.empty(0)
        out[name] = t.reshape(info["shape"]).float()
    return head.get("__metadata__", {}), out


def lr_at(peak, floor, warmup, steps, step):
    if step < warmup:
        return peak * (step + 1) / warmup
    if steps <= warmup + 1:
        return peak
    ratio = min(1.0, (step - warmup) / (steps - warmup - 1))
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


def gpt2_loss(p, x, y, layers, heads, autocast):
    B, T = x.shape
    h = p["wte.weight"][x] + p["wpe.weight"][:T]
    C = h.shape[-1]
    ctx = torch.autocast(h.device.type, dtype=torch.bfloat16) if autocast else torch.autocast(
        h.device.type, enabled=False)
    with ctx:
        for i in range(layers):
            pre = f"h.{i}."
            a = F.layer_norm(h, (C,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], 1e-5)
            qkv = F.linear(a, p[pre + "attn.c_attn.weight"], p[pre + "attn.c_attn.bias"])
            q, k, v = [t.view(B, T, heads, C // heads).transpose(1, 2) for t in qkv.split(C, dim=2)]
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            att = att.transpose(1, 2).reshape(B, T, C)
            h = h + F.linear(att, p[pre + "attn.c_proj.weight"], p[pre + "attn.c_proj.bias"])
            m = F.layer_norm(h, (C,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], 1e-5)
            m = F.gelu(F.linear(m, p[pre + "mlp.c_fc.weight"], p[pre + "mlp.c_fc.bias"]), approximate="tanh")
            h = h + F.linear(m, p[pre + "mlp.c_proj.weight"], p[pre + "mlp.c_proj.bias"])
        h = F.layer_norm(h, (C,), p["ln_f.weight"], p["ln_f.bias"], 1e-5)
        logits = F.linear(h, p["wte.weight"])
    return F.cross_entropy(logits.float().view(B * T, -1), y.view(B * T))


def decays(name):
    # the models' rule: decay "*.weight" except "*ln_*", "wpe.weight"
    return name.endswith(".weight") and "ln_" not in name and name != "wpe.weight"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("data")
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--mode", choices=["f32", "bf16"], required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--binary-device", default=None, help="the binary's --device (default: auto)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--bound", type=float, default=None)
    a = ap.parse_args()
    bound = a.bound if a.bound is not None else (1e-4 if a.mode == "f32" else 1e-2)
    work = a.work or tempfile.mkdtemp(prefix="fp8c-crosscheck-")
    os.makedirs(work, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    common = [a.binary, "--data", a.data, "--seed", str(a.seed), "--steps", str(a.steps),
              "--lr", repr(a.lr), "--warmup", str(a.warmup), "--eval-every", "0"]
    if a.binary_device:
        common += ["--device", a.binary_device]
    # --overwrite: a --work reused from an earlier check holds that check's initial state
    subprocess.run(common + ["--stop-at", "0", "--out", f"{work}/init", "--overwrite"], check=True,
                   stdout=subprocess.DEVNULL)
    log = f"{work}/fp8c.jsonl"
    if os.path.exists(log):
        os.remove(log)
    subprocess.run(common + ["--log", log], check=True, stdout=subprocess.DEVNULL)
    fp8c = [json.loads(l) for l in open(log) if l.startswith("{\"step\"")]

    meta, state = read_safetensors(f"{work}/init/step_000000.safetensors")
    B, T = int(meta["batch"]), int(meta["seq"])
    names = [n for n in state if ":" not in n]
    layers = sum(1 for n in names if n.endswith(".ln_1.weight"))
    dev = torch.device(a.device)
    p = {n: (state[n + ":master"] if n + ":master" in state else state[n]).clone().to(dev).requires_grad_()
         for n in names}
    m = {n: torch.zeros_like(p[n]) for n in names}
    v = {n: torch.zeros_like(p[n]) for n in names}
    b1, b2, eps, wd, clip = 0.9, 0.95, 1e-8, 0.1, 1.0
    tokens = read_shard(a.data)

    worst = 0.0
    print(f"{meta.get('model')} -O{meta.get('opt_level')}, batch {B} x {T}, {layers} layers, "
          f"{a.mode}, PyTorch {torch.__version__} on {dev}")
    print(f"{'step':>4} {'fp8c loss':>12} {'torch loss':>12} {'rel diff':>10}")
    for step in range(a.steps):
        x, y = batch(tokens, a.seed, step, B, T)
        loss = gpt2_loss(p, x.to(dev), y.to(dev), layers, a.heads, a.mode == "bf16")
        for t in p.values():
            t.grad = None
        loss.backward()
        with torch.no_grad():
            norm = math.sqrt(sum(float((t.grad.double() ** 2).sum()) for t in p.values()))
            c = min(1.0, clip / norm) if norm > 0 else 1.0
            lr = lr_at(a.lr, a.lr / 10, a.warmup, a.steps, step)
            bc1, bc2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
            for n, t in p.items():
                g = t.grad * c
                m[n].mul_(b1).add_(g, alpha=1 - b1)
                v[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                upd = (m[n] / bc1) / ((v[n] / bc2).sqrt() + eps)
                if decays(n):
                    upd = upd + wd * t
                t.sub_(lr * upd)
        mine, theirs = fp8c[step]["loss"], loss.item()
        rel = abs(mine - theirs) / abs(theirs)
        worst = max(worst, rel)
        print(f"{step + 1:>4} {mine:>12.7f} {theirs:>12.7f} {rel:>10.2e}")
    ok = worst < bound
    print(f"max relative difference {worst:.2e} over {a.steps} steps: "
          f"{'within' if ok else 'OVER'} the bound {bound:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
