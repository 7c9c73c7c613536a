/* args.c — the training binary's flags: the --help text and their parsing.
 *
 * Every flag is checked where it is read, so a run starts only with values it can use: counts
 * within their ranges, real numbers finite as the f32 the step is fed, paths that are not empty,
 * switches without values. `--flag value` and `--flag=value` are both accepted. A bad flag is one
 * rt_error line and RT_ARGS_ERROR; what the flags mean together (a resume against a fresh --out,
 * sampling flags without --generate) is checked here too, and what depends on files (whether
 * --out holds another run) is checked by train.c when it opens them. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

void rt_usage(FILE *out, const char *prog) {
    fprintf(out,
            "usage: %s --data FILE [options]\n"
            "Trains the model compiled into this binary.\n"
            "\n"
            "data\n"
            "  --data FILE         training tokens: an llm.c shard (.bin: 256 x int32 header,\n"
            "                      magic 20240520 with uint16 tokens, or 20240801 with uint32) or\n"
            "                      any text file (byte-level tokenizer: token = byte, vocabulary\n"
            "                      256); a glob or a comma list\n"
            "  --val FILE          validation tokens, same formats; without it, a text --data\n"
            "                      keeps its last 5%% for validation, a shard --data has none\n"
            "schedule\n"
            "  --steps N           optimizer steps to train to (default 100)\n"
            "  --lr X              peak learning rate (default: the model's optimizer lr)\n"
            "  --warmup N          linear warm-up steps (default 0), then cosine decay\n"
            "  --min-lr X          learning rate reached at the last step (default lr/10)\n"
            "  --grad-accum N      micro-steps per optimizer step (default 1)\n"
            "  --seed N            parameter init and batch order (default 1)\n"
            "evaluation and output\n"
            "  --eval-every N      evaluate every N steps and at the end (default 100; 0: end only)\n"
            "  --eval-batches N    validation batches per evaluation (default 8)\n"
            "  --log FILE          JSON lines: step, loss, val_loss, lr, grad_norm, tokens_per_s,\n"
            "                      ms, mem_bytes\n"
            "  --out DIR           checkpoints DIR/step_NNNNNN.safetensors and DIR/latest\n"
            "  --save-every N      checkpoint every N steps (default 0: at the end only)\n"
            "  --stop-at N         end this run after step N with a checkpoint; the schedule still\n"
            "                      runs to --steps, and --resume continues it exactly; 0 writes\n"
            "                      the initial state (step_000000) and trains nothing\n"
            "  --resume PATH       continue from a checkpoint file, or DIR's latest; --log is\n"
            "                      appended to, less its lines of the steps this run repeats;\n"
            "                      --lr, --min-lr, --warmup, --steps, --grad-accum and --seed\n"
            "                      are the run's unless given\n"
            "  --init PATH         start a fresh run from these weights: a Hugging Face GPT-2 or\n"
            "                      Llama model (a directory with config.json and model.safetensors\n"
            "                      or a sharded index) or an fp8c checkpoint (weights only)\n"
            "  --export-hf DIR     write the state of --resume or --init as a Hugging Face model\n"
            "                      (DIR/config.json, DIR/model.safetensors in f32) and stop\n"
            "  --eval-only         print the validation loss of the initial (--init) or resumed\n"
            "                      state, write it to --log, and stop; needs --val or a text --data\n"

            "  --overwrite         let a run that does not resume write into an --out that holds\n"
            "                      another run's checkpoints (its latest is removed at the start)\n"
            "                      and start a non-empty --log afresh; without it both are refused;\n"
            "                      it lets --export-hf replace the model in its DIR\n"
            "sampling (on the host, through the reference executor; trains nothing)\n"
            "  --generate N        write N tokens sampled from the initial or resumed state to\n"
            "                      stdout: bytes for a vocabulary of 256, else token ids\n"
            "  --prompt TEXT       the context to continue: text for a vocabulary of 256 (default\n"
            "                      a newline), else token ids separated by spaces or commas\n"
            "  --temperature X     softmax temperature (default 1; 0: always the likeliest token)\n"
            "  --top-k K           sample among the K likeliest tokens (default 0: all)\n"
            "  --logits FILE       also write the logits each token was drawn from: vocabulary\n"
            "                      f32 values (little-endian) per token, in order\n"
            "machine\n"
            "  --device NAME       where to run: cpu, cuda (a GPU, when this binary carries GPU\n"
            "                      kernels), or auto (default: the GPU if one is found, else cpu);\n"
            "                      ref: the reference executor (the ground truth, slow)\n"
            "  --threads N         CPU threads (default: $FP8C_THREADS, else every online CPU;\n"
            "                      results are bit-identical for any count)\n"
            "data parallel (GPUs, NCCL; a binary built with fp8c build --gpus N)\n"
            "  --gpus N            N ranks on this host, one GPU and one process each, started by\n"
            "                      this binary; each reads its own share of every batch (global\n"
            "                      batch N x the compiled batch x --grad-accum); gradients are\n"
            "                      averaged; rank 0 logs and writes checkpoints\n"
            "  --rank R            this process is rank R (0 .. W-1) of --world-size W processes\n"
            "  --world-size W      launched by the user, e.g. one per host; GPU: R %% GPUs here\n"
            "  --comm-file PATH    where rank 0 leaves NCCL's id for the others (a shared file\n"
            "                      system across hosts; it must not exist yet; removed once met)\n"
            "  --comm-timeout S    seconds to wait for the other ranks, at the start and in each\n"
            "                      collective, before the job ends with an error (default 600)\n"
            "  --help              this text\n",
            prog);
}

/* An unknown flag: one line, naming the flag of --help nearest to it. */
static void args_unknown(const char *flag) {
    char *help = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&help, &len);
    if (f) {
        rt_usage(f, "");
        fclose(f);
    }
    const char *near = help ? rt_nearest_flag(flag, help) : NULL;
    if (near) rt_error("%s: unknown flag; did you mean %s? (see --help)", flag, near);
    else rt_error("%s: unknown flag (see --help)", flag);
    free(help);
}

static bool args_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi) {
        if (hi == INT64_MAX)
            rt_error("%s %s: expected an integer >= %lld", flag, s, (long long)lo);
        else
            rt_error("%s %s: expected an integer from %lld to %lld", flag, s, (long long)lo,
                     (long long)hi);
        return false;
    }
    *out = v;
    return true;
}

/* A real-valued hyper-parameter. The step is fed f32 scalars, so the value must be finite as
 * an f32, not only as a double: --lr 1e308 would reach the update as infinity and --lr 1e-50
 * as zero. */
static bool args_real(const char *flag, const char *s, bool allow_zero, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !isfinite(v) || v < 0 || (!allow_zero && v == 0)) {
        rt_error("%s %s: expected a %s number", flag, s, allow_zero ? "non-negative" : "positive");
        return false;
    }
    if (!isfinite((float)v) || (!allow_zero && (float)v == 0)) {
        rt_error("%s %s: expected a %s number within f32's range (%g to %g)", flag, s,
                 allow_zero ? "non-negative" : "positive", (double)FLT_TRUE_MIN, (double)FLT_MAX);
        return false;
    }
    *out = v;
    return true;
}

/* The data-parallel flags together: one way of launching, a rank inside its world, a file to
 * meet through, a GPU run that trains. */
static bool args_check_world(const TrainOptions *o) {
    if (o->gpus && (o->rank >= 0 || o->world_size)) {
        rt_error("--gpus %d starts its ranks itself: drop --rank and --world-size (they are for "
                 "processes launched one by one)", o->gpus);
        return false;
    }
    if ((o->rank >= 0) != (o->world_size > 0)) {
        rt_error("%s: give --rank R and --world-size W together",
                 o->rank >= 0 ? "--rank without --world-size" : "--world-size without --rank");
        return false;
    }
    if (o->world_size && o->rank >= o->world_size) {
        rt_error("--rank %d: ranks of --world-size %d are 0 to %d", o->rank, o->world_size,
                 o->world_size - 1);
        return false;
    }
    bool several = o->gpus > 1 || o->world_size > 1;
    if (o->world_size > 1 && !o->comm_file) {
        rt_error("--world-size %d: give --comm-file PATH, where rank 0 leaves NCCL's id for the "
                 "others (every rank the same path)", o->world_size);
        return false;
    }
    if (o->comm_file && o->world_size <= 1) {
        rt_error("--comm-file goes with --rank and --world-size above 1%s",
                 o->gpus ? " (--gpus makes its own)" : "");
        return false;
    }
    if (several && (!strcmp(o->device, "cpu") || !strcmp(o->device, "ref"))) {
        rt_error("--device %s: data parallel runs on GPUs (--device cuda or auto)", o->device);
        return false;
    }
    if (several && (o->export_hf || o->eval_only || o->generate)) {
        rt_error("%s runs in one process: drop --gpus / --world-size",
                 o->export_hf ? "--export-hf" : o->eval_only ? "--eval-only" : "--generate");
        return false;
    }
    return true;
}

int rt_parse_args(int argc, char **argv, TrainOptions *o) {
    *o = (TrainOptions){.device = "auto", .steps = 100, .eval_every = 100, .eval_batches = 8,
                        .lr = -1, .min_lr = -1, .grad_accum = 1, .seed = 1, .stop_at = -1,
                        .temperature = 1.0, .rank = -1, .comm_timeout = 600};
    bool sampling_flag = false;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) return RT_ARGS_HELP;
        if (strncmp(arg, "--", 2) != 0) {
            rt_error("%s: unexpected argument (flags start with --; see --help)", arg);
            return RT_ARGS_ERROR;
        }
        /* the flags without a value */
        static const char *const switches[] = {"--overwrite", "--eval-only"};
        int sw = -1;
        for (int k = 0; k < 2; k++) {
            size_t len = strlen(switches[k]);
            if (strncmp(arg, switches[k], len) == 0 && (!arg[len] || arg[len] == '=')) sw = k;
        }
        if (sw >= 0) {
            if (strchr(arg, '=')) {
                rt_error("%s takes no value: %s", switches[sw], arg);
                return RT_ARGS_ERROR;
            }
            if (sw == 0) o->overwrite = true;
            else o->eval_only = true;
            continue;
        }
        /* --flag value or --flag=value */
        char flag[64];
        const char *value;
        const char *eq = strchr(arg, '=');
        if (eq) {
            snprintf(flag, sizeof flag, "%.*s", (int)(eq - arg), arg);
            value = eq + 1;
        } else {
            snprintf(flag, sizeof flag, "%s", arg);
            if (i + 1 >= argc) {
                rt_error("%s needs a value (see --help)", flag);
                return RT_ARGS_ERROR;
            }
            value = argv[++i];
        }
        int64_t v = 0;
        bool ok = true;
        if (strcmp(flag, "--data") == 0) o->data = value;
        else if (strcmp(flag, "--val") == 0) o->val = value;
        else if (strcmp(flag, "--log") == 0) o->log = value;
        else if (strcmp(flag, "--out") == 0) o->out = value;
        else if (strcmp(flag, "--resume") == 0) o->resume = value;
        else if (strcmp(flag, "--init") == 0) o->init = value;
        else if (strcmp(flag, "--export-hf") == 0) o->export_hf = value;
        else if (strcmp(flag, "--device") == 0) o->device = value;
        else if (strcmp(flag, "--steps") == 0) {
            ok = args_int(flag, value, 1, INT32_MAX, &o->steps);
            o->steps_given = true;
        } else if (strcmp(flag, "--warmup") == 0) {
            ok = args_int(flag, value, 0, INT32_MAX, &o->warmup);
            o->warmup_given = true;
        }
        else if (strcmp(flag, "--eval-every") == 0)
            ok = args_int(flag, value, 0, INT32_MAX, &o->eval_every);
        else if (strcmp(flag, "--eval-batches") == 0)
            ok = args_int(flag, value, 1, 1 << 20, &o->eval_batches);
        else if (strcmp(flag, "--save-every") == 0)
            ok = args_int(flag, value, 0, INT32_MAX, &o->save_every);
        else if (strcmp(flag, "--stop-at") == 0)
            ok = args_int(flag, value, 0, INT32_MAX, &o->stop_at);
        else if (strcmp(flag, "--grad-accum") == 0) {
            ok = args_int(flag, value, 1, 1 << 16, &v);
            o->grad_accum = (int)v;
            o->grad_accum_given = true;
        } else if (strcmp(flag, "--threads") == 0) {
            ok = args_int(flag, value, 1, 4096, &v);
            o->threads = (int)v;
        } else if (strcmp(flag, "--seed") == 0) {
            ok = args_int(flag, value, 0, INT64_MAX, &v);
            o->seed = (uint64_t)v;
            o->seed_given = true;
        } else if (strcmp(flag, "--generate") == 0) {
            ok = args_int(flag, value, 1, INT32_MAX, &o->generate);
        } else if (strcmp(flag, "--prompt") == 0) {
            o->prompt = value;
            sampling_flag = true;
        } else if (strcmp(flag, "--temperature") == 0) {
            ok = args_real(flag, value, true, &o->temperature);
            sampling_flag = true;
        } else if (strcmp(flag, "--logits") == 0) {
            o->logits = value;
            sampling_flag = true;
        } else if (strcmp(flag, "--top-k") == 0) {
            ok = args_int(flag, value, 0, INT32_MAX, &o->top_k);
            sampling_flag = true;
        } else if (strcmp(flag, "--gpus") == 0) {
            ok = args_int(flag, value, 1, 1024, &v);
            o->gpus = (int)v;
        } else if (strcmp(flag, "--rank") == 0) {
            ok = args_int(flag, value, 0, 1 << 20, &v);
            o->rank = (int)v;
        } else if (strcmp(flag, "--world-size") == 0) {
            ok = args_int(flag, value, 1, 1 << 20, &v);
            o->world_size = (int)v;
        } else if (strcmp(flag, "--comm-file") == 0) {
            o->comm_file = value;
        } else if (strcmp(flag, "--comm-timeout") == 0) {
            ok = args_real(flag, value, false, &o->comm_timeout);
        } else if (strcmp(flag, "--lr") == 0) ok = args_real(flag, value, false, &o->lr);
        else if (strcmp(flag, "--min-lr") == 0) ok = args_real(flag, value, true, &o->min_lr);
        else {
            args_unknown(flag);
            return RT_ARGS_ERROR;
        }
        if (!ok) return RT_ARGS_ERROR;
        if (!*value) {
            rt_error("%s: empty value", flag);
            return RT_ARGS_ERROR;
        }
    }
    if (o->init && o->resume) {
        rt_error("--init starts a fresh run and --resume continues one: give one of them");
        return RT_ARGS_ERROR;
    }
    if (o->export_hf && !o->init && !o->resume) {
        rt_error("--export-hf needs the state to export: --resume CHECKPOINT or --init PATH");
        return RT_ARGS_ERROR;
    }
    if ((o->export_hf != NULL) + o->eval_only + (o->generate > 0) > 1) {
        rt_error("--export-hf, --eval-only and --generate are separate runs: give one of them");
        return RT_ARGS_ERROR;
    }
    if (sampling_flag && !o->generate) {
        rt_error("--prompt, --temperature, --top-k and --logits go with --generate: give --generate N");
        return RT_ARGS_ERROR;
    }
    if ((o->eval_only || o->generate) && (o->out || o->stop_at >= 0 || o->save_every)) {
        rt_error("%s trains nothing and writes no checkpoint: drop --out, --save-every and "
                 "--stop-at", o->eval_only ? "--eval-only" : "--generate");
        return RT_ARGS_ERROR;
    }
    if (o->eval_only && !o->data && !o->val) {
        rt_error("--eval-only needs validation data: --val FILE, or a text --data whose last 5%% "
                 "is held out");
        return RT_ARGS_ERROR;
    }
    if (!o->data && !o->export_hf && !o->generate && !o->eval_only) {
        rt_error("--data is required (see --help)");
        return RT_ARGS_ERROR;
    }
    if (!rt_device_known(o->device)) {
        rt_error("--device %s: this runtime runs on the cpu only", o->device);
        return RT_ARGS_ERROR;
    }
    if (o->stop_at == 0 && !o->out) {
        rt_error("--stop-at 0 writes the initial state: it needs --out DIR");
        return RT_ARGS_ERROR;
    }
    if (o->save_every && !o->out) {
        rt_error("--save-every needs --out DIR to write checkpoints to");
        return RT_ARGS_ERROR;
    }
    if (o->warmup > o->steps && !o->resume) {   /* a resume compares them once restored */
        rt_error("--warmup %lld is longer than --steps %lld", (long long)o->warmup,
                 (long long)o->steps);
        return RT_ARGS_ERROR;
    }
    if (!args_check_world(o)) return RT_ARGS_ERROR;
    if (o->lr > 0 && o->min_lr > o->lr) {
        rt_error("--min-lr %g is above --lr %g", o->min_lr, o->lr);
        return RT_ARGS_ERROR;
    }
    return RT_ARGS_OK;
}

