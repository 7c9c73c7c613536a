"""PyTorch reference for Llama-shaped training throughput and memory, beside torch_gpt.py.

usage: python3 torch_llama.py MODE B T [STEPS] [-D name=value ...]
  MODE  bf16       torch.compile + bf16 autocast + fused AdamW + SDPA attention
        bf16eager  the same without torch.compile
        fp8tw / fp8rw  torchao float8 (tensorwise / rowwise); needs torchao importable
  -D    layers, dim, heads, kv_heads, hidden, vocab (defaults: models/llama.model's, TinyLlama
        1.1B: 22 layers, dim 2048, 32 heads, 4 KV heads, SwiGLU 5632, vocabulary 32000)

The model is Hugging Face's LlamaForCausalLM written out (as models/llama.model is): RMSNorm
before attention and MLP (eps 1e-5), rotary embeddings (theta 10000, HF's rotate-half
convention), grouped-query attention through SDPA (causal, enable_gqa), SwiGLU
down(silu(gate(x)) * up(x)), no biases, an untied output head; AdamW with models/llama.model's
hyper-parameters. Prints one JSON line: ms/step, tokens/s, model TFLOP/s (6N + 12·L·d·T per
token), peak GiB. Random tokens; 5 warm-up steps (compilation) are not timed.
"""
import sys, time, json
import torch, torch.nn as nn, torch.nn.functional as F

DEFAULTS = {"layers": 22, "dim": 2048, "heads": 32, "kv_heads": 4, "hidden": 5632, "vocab": 32000}


class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-5):
        super().__init__()
        s.weight = nn.Parameter(torch.ones(d)); s.eps = eps

    def forward(s, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + s.eps)).to(x.dtype) * s.weight


def rope_tables(T, hd, theta, device):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, device=device).float() / hd)
    f = torch.outer(torch.arange(T, device=device).float(), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(s, d, h, hkv):
        super().__init__()
        s.h, s.hkv, s.hd = h, hkv, d // h
        s.q_proj = nn.Linear(d, h * s.hd, bias=False); s.k_proj = nn.Linear(d, hkv * s.hd, bias=False)
        s.v_proj = nn.Linear(d, hkv * s.hd, bias=False); s.o_proj = nn.Linear(h * s.hd, d, bias=False)

    def forward(s, x, cos, sin):
        B, T, _ = x.shape
        q = s.q_proj(x).view(B, T, s.h, s.hd).transpose(1, 2)
        k = s.k_proj(x).view(B, T, s.hkv, s.hd).transpose(1, 2)
        v = s.v_proj(x).view(B, T, s.hkv, s.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.hkv != s.h)
        return s.o_proj(y.transpose(1, 2).reshape(B, T, s.h * s.hd))


class Layer(nn.Module):
    def __init__(s, d, h, hkv, hidden):
        super().__init__()
        s.input_layernorm = RMSNorm(d); s.self_attn = Attention(d, h, hkv)
        s.post_attention_layernorm = RMSNorm(d)
        s.gate_proj = nn.Linear(d, hidden, bias=False); s.up_proj = nn.Linear(d, hidden, bias=False)
        s.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(s, x, cos, sin):
        x = x + s.self_attn(s.input_layernorm(x), cos, sin)
        h = s.post_attention_layernorm(x)
        return x + s.down_proj(F.silu(s.gate_proj(h)) * s.up_proj(h))


class Llama(nn.Module):
    def __init__(s, c, T):
        super().__init__()
        s.embed_tokens = nn.Embedding(c["vocab"], c["dim"])
        s.layers = nn.ModuleList([Layer(c["dim"], c["heads"], c["kv_heads"], c["hidden"]) for _ in range(c["layers"])])
        s.norm = RMSNorm(c["dim"]); s.lm_head = nn.Linear(c["dim"], c["vocab"], bias=False)
        cos, sin = rope_tables(T, c["dim"] // c["heads"], 10000.0, "cpu")
        s.register_buffer("cos", cos, persistent=False); s.register_buffer("sin", sin, persistent=False)
        for name, p in s.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(s, idx, tgt):
        x = s.embed_tokens(idx)
        cos, sin = s.cos.to(x.dtype), s.sin.to(x.dtype)
        for layer in s.layers:
            x = layer(x, cos, sin)
        logits = s.lm_head(s.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), tgt.reshape(-1))


def main():
    args = [a for a in sys.argv[1:]]
    c = dict(DEFAULTS)
    while "-D" in args:
        i = args.index("-D")
        k, v = args[i + 1].split("=")
        if k not in c:
            sys.exit(f"torch_llama.py: -D {k}: not one of {', '.join(c)}")
        c[k] = int(v)
        del args[i:i + 2]
    mode, B, T = args[0], int(args[1]), int(args[2])
    steps = int(args[3]) if len(args) > 3 else 20
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    m = Llama(c, T).cuda()
    nparam = sum(p.numel() for p in m.parameters())
    if mode.startswith("fp8"):
        from torchao.float8 import convert_to_float8_training, Float8LinearConfig
        cfg = Float8LinearConfig.from_recipe_name("rowwise" if mode == "fp8rw" else "tensorwise")
        convert_to_float8_training(m, config=cfg, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    opt = torch.optim.AdamW(m.parameters(), lr=4e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    fwd = m if mode == "bf16eager" else torch.compile(m)
    g = torch.Generator(device="cuda").manual_seed(1)
    data = torch.randint(0, c["vocab"], (8, B, T + 1), device="cuda", generator=g)

    def step(i):
        bt = data[i % 8]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(bt[:, :-1], bt[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.time()
    for i in range(5):
        step(i)
    torch.cuda.synchronize(); warm = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for i in range(steps):
        loss = step(i)
    torch.cuda.synchronize(); dt = (time.time() - t0) / steps
    tok = B * T / dt
    flops_per_tok = 6 * nparam + 12 * c["layers"] * c["dim"] * T
    print(json.dumps({"size": "llama", "mode": mode, "B": B, "T": T, "params_M": round(nparam / 1e6, 1),
                      "ms_per_step": round(dt * 1e3, 2), "tok_per_s": round(tok),
                      "tflops": round(tok * flops_per_tok / 1e12, 1),
                      "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      "loss": round(loss.item(), 4), "warmup_s": round(warm, 1),
                      "gpu": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
