/* args.c — the training binary's flags: the --help text and their parsing.
 *
 * The flags are one table (train_flags), read by cli.c: a flag is one row naming the field of
 * TrainOptions it sets and its range, so adding one is a line here. `--flag value` and
 * `--flag=value` are the same, and a flag given twice keeps the last value. Every flag is
 * checked where it is read, so a run starts only with values it can use: whole numbers within
 * their ranges, real numbers finite as the f32 the step is fed, paths that are not empty,
 * switches without values. A bad flag is one rt_error line and RT_ARGS_ERROR; what the flags
 * mean together (a resume against a fresh --out, sampling flags without --generate) is checked
 * here too, and what depends on files (whether --out holds another run) is checked by train.c
 * when it opens them. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "rt.h"

/* The flags, one row each: the parsing, --help and the suggestions are made from this table.
 * TEXT, INT, INT32, REAL: the field of TrainOptions the value goes to (and its range);
 * SWITCH: a flag without a value. */
#define TO(field) offsetof(TrainOptions, field)
#define HEADING(text) {NULL, 0, RT_ARG_NONE, NULL, RT_FLAG_HEADING, 0, 0, 0, 0, text}
#define TEXT(name, value, field, help) {name, 0, RT_ARG_VALUE, value, RT_FLAG_TEXT, TO(field), 0, 0, 0, help}
#define INT(name, value, field, lo, hi, help) {name, 0, RT_ARG_VALUE, value, RT_FLAG_INT, TO(field), lo, hi, 0, help}
#define INT32(name, value, field, lo, hi, help) {name, 0, RT_ARG_VALUE, value, RT_FLAG_INT32, TO(field), lo, hi, 0, help}
#define REAL(name, value, field, positive, help) {name, 0, RT_ARG_VALUE, value, RT_FLAG_REAL, TO(field), positive, 0, 0, help}
#define SWITCH(name, field, help) {name, 0, RT_ARG_NONE, NULL, RT_FLAG_TRUE, TO(field), 0, 0, 0, help}
static const RtFlag train_flags[] = {
    HEADING("data"),
    TEXT("data", "FILE", data, "training tokens: an llm.c shard (.bin: 256 x int32 header,\n"
                               "magic 20240520 with uint16 tokens, or 20240801 with uint32) or\n"
                               "any text file (byte-level tokenizer: token = byte, vocabulary\n"
                               "256); a glob or a comma list"),
    TEXT("val", "FILE", val, "validation tokens, same formats; without it, a text --data\n"
                             "keeps its last 5% for validation, a shard --data has none"),
    HEADING("schedule"),
    INT("steps", "N", steps, 1, INT32_MAX, "optimizer steps to train to (default 100)"),
    REAL("lr", "X", lr, 1, "peak learning rate (default: the model's optimizer lr)"),
    INT("warmup", "N", warmup, 0, INT32_MAX, "linear warm-up steps (default 0), then cosine decay"),
    REAL("min-lr", "X", min_lr, 0, "learning rate reached at the last step (default lr/10)"),
    INT32("grad-accum", "N", grad_accum, 1, 1 << 16, "micro-steps per optimizer step (default 1)"),
    INT("seed", "N", seed, 0, INT64_MAX, "parameter init and batch order (default 1)"),
    HEADING("evaluation and output"),
    INT("eval-every", "N", eval_every, 0, INT32_MAX,
        "evaluate every N steps and at the end (default 100; 0: end only)"),
    INT("eval-batches", "N", eval_batches, 1, 1 << 20, "validation batches per evaluation (default 8)"),
    TEXT("log", "FILE", log, "JSON lines: step, loss, val_loss, lr, grad_norm, tokens_per_s,\n"
                             "ms, mem_bytes"),
    TEXT("out", "DIR", out, "checkpoints DIR/step_NNNNNN.safetensors and DIR/latest"),
    INT("save-every", "N", save_every, 0, INT32_MAX, "checkpoint every N steps (default 0: at the end only)"),
    INT("stop-at", "N", stop_at, 0, INT32_MAX,
        "end this run after step N with a checkpoint; the schedule still\n"
        "runs to --steps, and --resume continues it exactly; 0 writes\n"
        "the initial state (step_000000) and trains nothing"),
    TEXT("resume", "PATH", resume, "continue from a checkpoint file, or DIR's latest; --log is\n"
                                   "appended to, less its lines of the steps this run repeats;\n"
                                   "--lr, --min-lr, --warmup, --steps, --grad-accum and --seed\n"
                                   "are the run's unless given"),
    TEXT("init", "PATH", init, "start a fresh run from these weights: a Hugging Face GPT-2 or\n"
                               "Llama model (a directory with config.json and model.safetensors\n"
                               "or a sharded index) or an fp8c checkpoint (weights only)"),
    TEXT("export-hf", "DIR", export_hf, "write the state of --resume or --init as a Hugging Face model\n"
                                        "(DIR/config.json, DIR/model.safetensors in f32) and stop"),
    SWITCH("eval-only", eval_only, "print the validation loss of the initial (--init) or resumed\n"
                                 "state, write it to --log, and stop; needs --val or a text --data"),
    SWITCH("overwrite", overwrite, "let a run write into an --out that holds checkpoints of a run\n"
                                 "it does not resume (their latest is removed at the start)\n"
                                 "and start a non-empty --log afresh; without it both are refused;\n"
                                 "it lets --export-hf replace the model in its DIR"),
    HEADING("sampling (on the host, through the reference executor; trains nothing)"),
    INT("generate", "N", generate, 1, INT32_MAX, "write N tokens sampled from the initial or resumed state to\n"
                                                 "stdout: bytes for a vocabulary of 256, else token ids"),
    TEXT("prompt", "TEXT", prompt, "the context to continue: text for a vocabulary of 256 (default\n"
                                   "a newline), else token ids separated by spaces or commas"),
    REAL("temperature", "X", temperature, 0, "softmax temperature (default 1; 0: always the likeliest token)"),
    INT("top-k", "K", top_k, 0, INT32_MAX, "sample among the K likeliest tokens (default 0: all)"),
    TEXT("logits", "FILE", logits, "also write the logits each token was drawn from: vocabulary\n"
                                   "f32 values (little-endian) per token, in order"),
    HEADING("machine"),
    TEXT("device", "NAME", device, "where to run: cpu, cuda (a GPU, when this binary carries GPU\n"
                                   "kernels), or auto (default: the GPU if one is found, else cpu);\n"
                                   "ref: the reference executor (the ground truth, slow)"),
    INT32("threads", "N", threads, 1, RT_MAX_THREADS, "CPU threads (default: $FP8C_THREADS, else every online CPU;\n"
                                            "results are bit-identical for any count)"),
    TEXT("start-after", "FILE", start_after, "make the training state, then wait until FILE exists before\n"
                                            "opening the device (fp8c tune makes one candidate's state\n"
                                            "while the one before it runs on the GPU)"),
    HEADING("data parallel (GPUs, NCCL; a binary built with fp8c build --gpus N)"),
    INT32("gpus", "N", gpus, 1, 1024, "N ranks on this host, one GPU and one process each, started by\n"
                                      "this binary; each reads its own share of every batch (global\n"
                                      "batch N x the compiled batch x --grad-accum); gradients are\n"
                                      "averaged; rank 0 logs and writes checkpoints. A binary built with\n"
                                      "--shard-states keeps 1/N of the master weights and optimizer\n"
                                      "states on each GPU, with --shard-states=2 of the gradients too\n"
                                      "(reduced every micro-step); its start line says which"),
    INT32("rank", "R", rank, 0, 1 << 20, "this process is rank R (0 .. W-1) of --world-size W processes"),
    INT32("world-size", "W", world_size, 1, 1 << 20, "launched by the user, e.g. one per host; GPU: R % GPUs here"),
    TEXT("comm-file", "PATH", comm_file, "where rank 0 leaves NCCL's id for the others (a shared file\n"
                                         "system across hosts; it must not exist yet; removed once met)"),
    REAL("comm-timeout", "S", comm_timeout, 1, "seconds to wait for the other ranks, at the start and in each\n"
                                               "collective, before the job ends with an error (default 600)"),
    {"help", 'h', RT_ARG_NONE, NULL, RT_FLAG_BY_ID, 0, 0, 0, 0, "this text"},
    {0},
};
#undef TO
#undef HEADING
#undef TEXT
#undef INT
#undef INT32
#undef REAL
#undef SWITCH

void rt_usage(FILE *out, const char *prog) {
    fprintf(out, "usage: %s --data FILE [options]\n"
                 "Trains the model compiled into this binary.\n"
                 "\n", prog);
    rt_cli_help(out, train_flags, 20);
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
    RtCli c;
    rt_cli_begin(&c, train_flags, argc, argv);
    for (int got; (got = rt_cli_next(&c)) != RT_CLI_END;) {
        switch (got) {
        case RT_CLI_FLAG:
            if (c.flag->kind == RT_FLAG_BY_ID) return RT_ARGS_HELP;   /* --help, -h */
            if (!rt_cli_store(c.flag, c.value, o)) return RT_ARGS_ERROR;
            continue;
        case RT_CLI_MISSING:
            rt_error("--%s needs a value (see --help)", c.flag->name);
            return RT_ARGS_ERROR;
        case RT_CLI_NO_VALUE:
            rt_error("--%s takes no value: %s", c.flag->name, c.word);
            return RT_ARGS_ERROR;
        case RT_CLI_UNKNOWN:
            if (strncmp(c.word, "--", 2) != 0) {
                rt_error("%s: unexpected argument (flags start with --; see --help)", c.word);
            } else if (c.near) {
                rt_error("%s: unknown flag; did you mean %s? (see --help)", c.name, c.near);
            } else {
                rt_error("%s: unknown flag (see --help)", c.name);
            }
            return RT_ARGS_ERROR;
        case RT_CLI_REST:
            rt_error("--: unknown flag (see --help)");
            return RT_ARGS_ERROR;
        default:   /* RT_CLI_WORD */
            rt_error("%s: unexpected argument (flags start with --; see --help)", c.word);
            return RT_ARGS_ERROR;
        }
    }
    o->steps_given = rt_cli_seen(&c, "steps");
    o->warmup_given = rt_cli_seen(&c, "warmup");
    o->grad_accum_given = rt_cli_seen(&c, "grad-accum");
    o->seed_given = rt_cli_seen(&c, "seed");
    bool sampling_flag = rt_cli_seen(&c, "prompt") || rt_cli_seen(&c, "temperature") ||
                         rt_cli_seen(&c, "top-k") || rt_cli_seen(&c, "logits");
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

