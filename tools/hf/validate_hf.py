#!/usr/bin/env python3
"""validate_hf.py -- fp8c's Hugging Face import and export, checked against `transformers` itself.

tests/test_hf.c checks the conversions against a forward of Hugging Face's layout written in the
test. This script checks them against the real library, on models that `transformers` makes and
saves, so that what it writes (config keys, tied heads, rope convention, dtypes) is what fp8c
reads, and what fp8c exports is what it loads:

  1. models: a GPT2LMHeadModel from GPT-2 124M's config and a small LlamaForCausalLM with
     grouped-query attention (the config.json files the binaries were built from with
     `fp8c build --config`), randomly initialized,
     trained a few steps in PyTorch so that their losses are far from ln(vocabulary) (a wrongly
     loaded weight then shows), saved with save_pretrained;
  1b. round trip: the saved model started with --init and exported at once (--export-hf) gives
     back every tensor bit for bit;
  2. step 0: each level's training binary starts from the saved model (--init) and evaluates
     (--eval-only) on a token file; transformers computes the loss of the same batches. -O0's
     must agree within bf16 rounding, the FP8 levels' within FP8's;
  3. fine-tune: -O1 and -O3 train from the model for a few steps (the curve is printed), and
     export (--export-hf);
  4. export: from_pretrained loads each export; its loss on the same batches is compared with
     the -O0 binary started from the export and with the training binary's own forward on its
     checkpoint; the greedy continuation of a prompt (generate(do_sample=False) and an explicit
     argmax loop) is compared with the binaries' --generate --temperature 0, and the logits each
     token was drawn from (--logits) with transformers' logits of the same context.

The binaries are built elsewhere by tools/hf/prepare_validate.sh (the GPU machine has no LLVM).
Everything is printed as tables and written to --out: summary.md, summary.json, and the log of
every command run. Without PyTorch (--no-torch) the fp8c side alone runs, from a model fp8c
exports from its own initialization: that checks the plumbing on any machine.

usage: python3 tools/hf/validate_hf.py --dir hf-validate --out OUT [--device auto|cuda|cpu]
"""
import argparse
import json
import math
import os
import re
import shlex
import struct
import subprocess
import sys
import time

SHARD_MAGIC, SHARD_VERSION = 20240520, 1

# Tolerances on a mean loss, relative to it. -O0 runs GEMMs on bf16 operands and keeps bf16
# activations: an 8-bit significand, 2^-9 relative rounding per value; the errors of a loss
# over thousands of tokens mostly cancel, so 1% is far above what agreement gives and far below
# what a wrongly converted tensor does (the losses then differ by whole nats). The FP8 levels
# quantize every GEMM operand to e4m3/e5m2 (3 and 2 significand bits): 5%.
TOL_BF16 = 0.01
TOL_FP8 = 0.05
# Logits of the bf16 forward against transformers' f32 ones, relative to the row's largest.
TOL_LOGITS_BF16 = 0.05


def log(msg):
    print(msg, flush=True)


class Runner:
    """Runs commands, keeping each one's command line and output in OUT/logs/NN-name.log."""

    def __init__(self, out):
        self.dir = os.path.join(out, "logs")
        os.makedirs(self.dir, exist_ok=True)
        self.n = 0

    def run(self, name, argv, check=True):
        self.n += 1
        path = os.path.join(self.dir, "%02d-%s.log" % (self.n, name))
        t0 = time.time()
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with open(path, "w") as f:
            f.write("$ %s\n# status %d, %.1f s\n--- stdout\n%s--- stderr\n%s" %
                    (shlex.join(argv), p.returncode, time.time() - t0, p.stdout, p.stderr))
        if check and p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError("%s failed (status %d): %s [%s]" % (name, p.returncode, tail, path))
        return p


# ---------------------------------------------------------------- data

def write_shard(path, tokens):
    header = struct.pack("<256i", SHARD_MAGIC, SHARD_VERSION, len(tokens), *([0] * 253))
    with open(path, "wb") as f:
        f.write(header)
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def make_data(dirpath, text_path, out):
    """The text's bytes as token ids (every id is below both vocabularies): a corpus both sides
    read the same way, and one a model learns from within a few steps."""
    data = open(text_path, "rb").read()
    cut = len(data) * 9 // 10
    train, val = list(data[:cut]), list(data[cut:])
    paths = (os.path.join(out, "train.bin"), os.path.join(out, "val.bin"))
    write_shard(paths[0], train)
    write_shard(paths[1], val)
    return train, val, paths


def val_batches(val, B, T, count):
    """fp8c's validation batches (runtime/data.c rt_data_val_batch): batch i, row r is window
    (i*B + r) mod rows of the windows of T+1 tokens laid end to end, sharing one token at the
    seams."""
    rows = (len(val) - 1) // T
    out = []
    for i in range(count):
        batch = []
        for r in range(B):
            w = (i * B + r) % rows
            batch.append(val[w * T: w * T + T + 1])
        out.append(batch)
    return out


# ---------------------------------------------------------------- fp8c

def fp8c_eval(run, binary, name, src_flag, src, val_path, batches, device, out):
    p = run.run(name, [binary, src_flag, src, "--eval-only", "--val", val_path,
                       "--eval-batches", str(batches), "--device", device,
                       "--log", os.path.join(out, name + ".jsonl"), "--overwrite"])
    m = re.search(r"val_loss ([-+0-9.eEinfa]+)", p.stdout)
    if not m:
        raise RuntimeError("%s: no val_loss in its output" % name)
    return float(m.group(1))


def fp8c_generate(run, binary, name, src_flag, src, prompt, count, out):
    logits_path = os.path.join(out, name + ".logits")
    p = run.run(name, [binary, src_flag, src, "--generate", str(count), "--temperature", "0",
                       "--prompt", " ".join(map(str, prompt)), "--logits", logits_path,
                       "--overwrite", "--device", "ref"])
    ids = [int(x) for x in p.stdout.split()]
    if ids[:len(prompt)] != list(prompt) or len(ids) != len(prompt) + count:
        raise RuntimeError("%s: unexpected output %r" % (name, p.stdout[:200]))
    raw = open(logits_path, "rb").read()
    vocab = len(raw) // 4 // count
    rows = [struct.unpack_from("<%df" % vocab, raw, 4 * vocab * k) for k in range(count)]
    return ids[len(prompt):], rows


def read_curve(path):
    curve = []
    for line in open(path):
        r = json.loads(line)
        if "loss" in r:
            curve.append(r)
    return curve


# ---------------------------------------------------------------- transformers

class Torch:
    def __init__(self, device):
        import torch
        import transformers
        self.torch, self.tf = torch, transformers
        if device == "cpu" or not torch.cuda.is_available():
            self.dev = torch.device("cpu")
        else:
            self.dev = torch.device("cuda")
        self.version = "torch %s, transformers %s, %s" % (torch.__version__, transformers.__version__,
                                                          self.dev)

    def make(self, config_dir):
        """A randomly initialized model from the config.json the binaries were built from."""
        cfg = self.tf.AutoConfig.from_pretrained(config_dir)
        return self.tf.AutoModelForCausalLM.from_config(cfg)

    def pretrain(self, model, train, B, T, steps, seed):
        """A few AdamW steps on the training tokens: weights whose loss is far from ln(V)."""
        torch = self.torch
        model.to(self.dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(steps):
            starts = torch.randint(0, len(train) - T - 1, (B,), generator=g).tolist()
            x = torch.tensor([train[s:s + T + 1] for s in starts], device=self.dev)
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss   # shifts inside
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        return losses

    def load(self, path):
        tf, torch = self.tf, self.torch
        try:
            m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        except TypeError:   # transformers before 4.56 spells it torch_dtype
            m = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        return m.to(self.dev).eval()

    def same_weights(self, model, path):
        """Whether every tensor of the safetensors file at path equals the model's, bit for bit:
        (tensors compared, names that differ or are missing on either side)."""
        from safetensors.torch import load_file
        torch = self.torch
        file = load_file(path)
        state = {k: v for k, v in model.state_dict().items()}
        bad = [k for k in file if k not in state or not torch.equal(file[k].float().cpu(),
                                                                    state[k].float().cpu())]
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        bad += [k for k in state if k not in file and k not in tied and not k.endswith(".attn.bias")
                and not k.endswith(".attn.masked_bias")]
        return len(file), bad

    def loss(self, model, batches, bf16=False):
        """Mean over batches of each batch's mean cross-entropy, as fp8c's evaluation."""
        torch = self.torch
        total = 0.0
        with torch.no_grad():
            for b in batches:
                x = torch.tensor(b, device=self.dev)
                with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(input_ids=x[:, :-1]).logits.float()
                total += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item()
        return total / len(batches)

    def greedy(self, model, prompt, count):
        """The argmax continuation by full forwards (no cache), with each step's logits, and
        generate(do_sample=False)'s, with no end-of-text token to stop it early."""
        torch = self.torch
        seq, rows = list(prompt), []
        with torch.no_grad():
            for _ in range(count):
                logits = model(input_ids=torch.tensor([seq], device=self.dev)).logits[0, -1].float()
                rows.append(logits.cpu().tolist())
                seq.append(int(torch.argmax(logits)))
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            gen = model.generate(torch.tensor([prompt], device=self.dev), max_new_tokens=count,
                                 do_sample=False, attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long,
                                                                            device=self.dev))
        return seq[len(prompt):], gen[0, len(prompt):].tolist(), rows


# ---------------------------------------------------------------- comparisons

def compare_tokens(got, want, ref_rows):
    """Tokens equal up to where they part; there, the reference's margin between its top two
    logits relative to the largest (a near tie explains a parting, a wide margin does not)."""
    for k, (a, b) in enumerate(zip(got, want)):
        if a != b:
            row = sorted(ref_rows[k], reverse=True) if ref_rows else None
            margin = (row[0] - row[1]) / max(abs(row[0]), 1e-30) if row else float("nan")
            return k, margin
    return len(got), None


def compare_logits(rows, ref_rows, upto):
    """Largest |fp8c - reference| over the rows of the shared context, relative to each row's
    largest |logit|."""
    worst = 0.0
    for k in range(upto):
        scale = max(abs(v) for v in ref_rows[k]) or 1.0
        worst = max(worst, max(abs(a - b) for a, b in zip(rows[k], ref_rows[k])) / scale)
    return worst


def verdict(ok):
    return "ok" if ok else "FAIL"


def table(headers, rows):
    widths = [max(len(str(x)) for x in [h] + [r[i] for r in rows]) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] +
                     [line(r) for r in rows])


# ---------------------------------------------------------------- one model

def validate_model(model, args, man, run, th, train, val, paths, report):
    bins = os.path.join(args.dir, "bin")
    binary = lambda kind, level: os.path.join(bins, "%s_%s_O%d" % (model, kind, level))
    spec = man["%s_train_O0" % model]
    B, T = spec["batch"], spec["seq"]
    work = os.path.join(args.out, model)
    os.makedirs(work, exist_ok=True)
    hf_dir = os.path.join(work, "hf")
    res = report.setdefault(model, {})

    # 1. the model, made and saved by transformers (or, without it, exported by fp8c)
    if th:
        th.torch.manual_seed(args.seed)
        m = th.make(os.path.join(args.dir, spec["config"]))
        res["params"] = sum(p.numel() for p in m.parameters())
        losses = th.pretrain(m, train, B, T, args.pretrain_steps, args.seed) or [float("nan")]
        res["pretrain"] = {"steps": args.pretrain_steps, "first": losses[0], "last": losses[-1]}
        m.save_pretrained(hf_dir)   # safetensors: the default of transformers 4.35 and later
        log("%s: %s parameters, %d PyTorch steps (loss %.3f -> %.3f), saved to %s" %
            (model, res["params"], args.pretrain_steps, losses[0], losses[-1], hf_dir))
    else:
        init = os.path.join(work, "init")
        run.run(model + "-init", [binary("train", 0), "--data", paths[0], "--stop-at", "0",
                                  "--out", init, "--overwrite"])
        run.run(model + "-init-export", [binary("train", 0), "--resume", init, "--export-hf",
                                         hf_dir, "--overwrite"])
        m = None
        log("%s: no PyTorch: fp8c's own initialization, exported, stands in for the model" % model)

    batches = val_batches(val, B, T, args.eval_batches)
    ref = None
    if th:
        ref = {"f32": th.loss(m.to(th.dev), batches), "bf16": th.loss(m, batches, bf16=True)}

    # 1b. the saved model through fp8c and back: --init, then --export-hf, gives the same weights
    exp0 = os.path.join(work, "export_init")
    run.run(model + "-init-export-O0", [binary("train", 0), "--init", hf_dir, "--export-hf", exp0,
                                        "--overwrite"])
    if th:
        n, bad = th.same_weights(m, os.path.join(exp0, "model.safetensors"))
        res["round_trip"] = {"tensors": n, "differ": bad}
        report.setdefault("tables", []).append(
            ("%s: the saved model through --init and --export-hf" % model,
             table(["tensors", "differ or missing", "check"],
                   [[n, ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else "") if bad else "none",
                     verdict(not bad)]])))
    else:   # the stand-in is fp8c's own export: the two files are the same bytes
        same = all(open(os.path.join(hf_dir, f), "rb").read() == open(os.path.join(exp0, f), "rb").read()
                   for f in ("model.safetensors", "config.json"))
        res["round_trip"] = {"tensors": None, "differ": [] if same else ["model.safetensors"]}
        report.setdefault("tables", []).append(
            ("%s: the exported model through --init and --export-hf" % model,
             table(["files", "check"], [["model.safetensors, config.json", verdict(same)]])))

    # 2. step 0: every level started from the saved model
    rows = []
    step0 = res.setdefault("step0", {})
    for level in (0, 1, 3):
        v = fp8c_eval(run, binary("train", level), "%s-step0-O%d" % (model, level), "--init",
                      hf_dir, paths[1], args.eval_batches, args.device, work)
        step0["O%d" % level] = v
        if ref:
            rel = abs(v - ref["f32"]) / ref["f32"]
            tol = TOL_BF16 if level == 0 else TOL_FP8
            rows.append(["-O%d" % level, "%.5f" % v, "%.5f" % ref["f32"], "%.5f" % ref["bf16"],
                         "%.2e" % rel, "%.0e" % tol, verdict(rel <= tol)])
            step0["ok_O%d" % level] = rel <= tol
        else:
            rows.append(["-O%d" % level, "%.5f" % v, "-", "-", "-", "-", "-"])
    report.setdefault("tables", []).append(
        ("%s: step-0 validation loss, %d batches of %d x %d" % (model, args.eval_batches, B, T),
         table(["fp8c", "fp8c loss", "transformers f32", "transformers bf16", "|rel diff|", "tol",
                "check"], rows)))
    if ref:
        step0["transformers"] = ref

    # 3. fine-tune at -O1 and -O3, then export
    curves = {}
    for level in (1, 3):
        name = "%s-finetune-O%d" % (model, level)
        ckpt = os.path.join(work, "ckpt_O%d" % level)
        jl = os.path.join(work, name + ".jsonl")
        run.run(name, [binary("train", level), "--init", hf_dir, "--data", paths[0], "--val",
                       paths[1], "--steps", str(args.finetune_steps), "--warmup", "3", "--lr",
                       str(args.lr), "--eval-every", str(max(1, args.finetune_steps // 4)),
                       "--eval-batches", str(args.eval_batches), "--log", jl, "--out", ckpt,
                       "--device", args.device, "--overwrite"])
        curves[level] = read_curve(jl)
        run.run("%s-export-O%d" % (model, level), [binary("train", level), "--resume", ckpt,
                                                    "--export-hf", os.path.join(work, "export_O%d" % level),
                                                    "--overwrite"])
    rows = []
    for i in range(len(curves[1])):
        r1, r3 = curves[1][i], curves[3][i] if i < len(curves[3]) else {}
        if i % max(1, len(curves[1]) // 10) and "val_loss" not in r1 and i != len(curves[1]) - 1:
            continue
        fmt = lambda r, k: "%.4f" % r[k] if r.get(k) is not None else ""
        rows.append([r1["step"], fmt(r1, "loss"), fmt(r1, "val_loss"), fmt(r3, "loss"),
                     fmt(r3, "val_loss"), "%.0f" % r1.get("tokens_per_s", 0),
                     "%.0f" % r3.get("tokens_per_s", 0)])
    report.setdefault("tables", []).append(
        ("%s: fine-tune from the model, lr %g, batch %d x %d, device %s" % (model, args.lr, B, T,
                                                                             args.device),
         table(["step", "-O1 loss", "-O1 val", "-O3 loss", "-O3 val", "-O1 tok/s", "-O3 tok/s"], rows)))
    res["finetune"] = {"O%d" % k: v for k, v in curves.items()}

    # 4. the exports in transformers
    prompt = val[:args.prompt_tokens]
    rows_loss, rows_gen = [], []
    sources = [("saved model", hf_dir, None)] + [("export -O%d" % l, os.path.join(work, "export_O%d" % l), l)
                                                 for l in (1, 3)]
    exports = res.setdefault("exports", {})
    for label, path, level in sources:
        e = exports.setdefault(label, {})
        hm = th.load(path) if th else None
        if level is not None:
            o0 = fp8c_eval(run, binary("train", 0), "%s-eval-O0-export%d" % (model, level), "--init",
                           path, paths[1], args.eval_batches, args.device, work)
            own = fp8c_eval(run, binary("train", level), "%s-eval-O%d-ckpt" % (model, level),
                            "--resume", os.path.join(work, "ckpt_O%d" % level), paths[1],
                            args.eval_batches, args.device, work)
            e.update({"fp8c_O0_init": o0, "fp8c_own": own})
            if hm is not None:
                hl = th.loss(hm, batches)
                e["transformers"] = hl
                r0, r1 = abs(o0 - hl) / hl, abs(own - hl) / hl
                e["ok"] = r0 <= TOL_BF16 and r1 <= TOL_FP8
                rows_loss.append([label, "%.5f" % hl, "%.5f (%.1e)" % (o0, r0),
                                  "%.5f (%.1e)" % (own, r1), verdict(e["ok"])])
            else:
                rows_loss.append([label, "-", "%.5f" % o0, "%.5f" % own, "-"])
        # greedy continuations: the -O0 forward (bf16) of what was loaded, and the level's own
        for gl in ([0] if level is None else [0, level]):
            name = "%s-generate-O%d-%s" % (model, gl, "hf" if level is None else "export%d" % level)
            got, rows = fp8c_generate(run, binary("gen", gl), name, "--init", path, prompt,
                                      args.gen_tokens, work)
            g = e.setdefault("generate_O%d" % gl, {"tokens": got})
            if hm is None:
                rows_gen.append([label, "-O%d" % gl, " ".join(map(str, got)), "-", "-", "-", "-"])
                continue
            want, gen, ref_rows = th.greedy(hm, prompt, args.gen_tokens)
            agree, margin = compare_tokens(got, want, ref_rows)
            err = compare_logits(rows, ref_rows, min(agree + 1, len(got)))
            tol = TOL_LOGITS_BF16 if gl == 0 else None
            ok = gen == want and (agree == len(got) or margin < 1e-2) and (tol is None or err <= tol)
            g.update({"transformers": want, "generate": gen, "agree": agree, "margin": margin,
                      "logits_rel_err": err, "ok": ok})
            rows_gen.append([label, "-O%d" % gl, "%d/%d" % (agree, len(got)),
                             "-" if margin is None else "%.1e" % margin,
                             "yes" if gen == want else "NO", "%.1e" % err,
                             verdict(ok) if tol is not None else "(fp8)"])
    report.setdefault("tables", []).append(
        ("%s: exports loaded by from_pretrained; loss on the step-0 batches (|rel diff| from "
         "transformers')" % model,
         table(["model", "transformers", "fp8c -O0 --init export", "fp8c own checkpoint", "check"],
               rows_loss)))
    report.setdefault("tables", []).append(
        ("%s: greedy continuation of %d tokens after %d prompt tokens" % (model, args.gen_tokens,
                                                                          len(prompt)),
         table(["model", "fp8c forward", "tokens equal", "margin at parting", "generate() = argmax",
                "logits |rel diff|", "check"], rows_gen)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="hf-validate", help="what prepare_validate.sh built")
    ap.add_argument("--out", default=os.environ.get("OUT", "hf-validate-out"))
    ap.add_argument("--device", default="auto", help="fp8c's --device (auto, cuda, cpu)")
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--pretrain-steps", type=int, default=60)
    ap.add_argument("--finetune-steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--gen-tokens", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-torch", action="store_true", help="the fp8c side only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    man = json.load(open(os.path.join(args.dir, "manifest.json")))
    gen_T = min(s["seq"] for s in man.values() if s["kind"] == "gen")
    if args.prompt_tokens + args.gen_tokens > gen_T:
        sys.exit("validate_hf: --prompt-tokens + --gen-tokens must fit the gen binaries' %d" % gen_T)
    th = None
    if not args.no_torch:
        th = Torch("cpu" if args.device == "cpu" else "auto")
        log(th.version)
    run = Runner(args.out)
    train, val, paths = make_data(args.dir, os.path.join(args.dir, "data", "sample.txt"), args.out)
    report = {"args": vars(args), "torch": th.version if th else None}
    info = os.path.join(args.dir, "BUILD_INFO")
    if os.path.exists(info):
        report["build"] = open(info).read().strip()
    t0 = time.time()
    failed = []
    for model in args.models.split(","):
        try:
            validate_model(model, args, man, run, th, train, val, paths, report)
        except Exception as e:   # one model's failure is reported; the other still runs
            failed.append("%s: %s" % (model, e))
            log("%s: ERROR %s" % (model, e))
    text = ["# fp8c against transformers (%s)" % (report["torch"] or "no PyTorch"),
            report.get("build", ""), "%.0f s" % (time.time() - t0), ""]
    for title, t in report.get("tables", []):
        text += ["## " + title, "", t, ""]
    text += ["errors: " + "; ".join(failed)] if failed else []
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    report.pop("tables", None)
    report["errors"] = failed
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    log("\n".join(text))
    checks = [v for m in args.models.split(",") for v in _checks(report.get(m, {}))]
    return 1 if failed or not all(checks) else 0


def _checks(res):
    out = [v for k, v in res.get("step0", {}).items() if k.startswith("ok_")]
    if "round_trip" in res:
        out.append(not res["round_trip"]["differ"])
    for e in res.get("exports", {}).values():
        if "ok" in e:
            out.append(e["ok"])
        for k, g in e.items():
            if k == "generate_O0" and "ok" in g:
                out.append(g["ok"])
    return out


if __name__ == "__main__":
    sys.exit(main())
