/* fuzz_cli.c — fp8c's own command line (plan, build, train, opt): parse_args of compiler/main.c
 * on an argv split from the input at NUL bytes and newlines, then, when the flags parse, the
 * whole pipeline on a small fixed model with those flags (-On, -D, --batch, --seq,
 * --precision rules, --grad-release, --stop-after), as `fp8c plan` would run it.
 *
 * parse_args is static in main.c, so main.c is compiled into this harness (its main renamed);
 * that keeps the driver as one file and tests the parser that ships rather than a copy. The
 * parser ends the command on a bad flag (exit status 2) or after --help (0): here exit() jumps
 * back to the harness, which checks the status, so the parser needs no change to be fuzzed,
 * whatever exits it gains. Its messages, written to stderr and stdout, go to fuzz_null() unless
 * FP8C_FUZZ_VERBOSE is set.
 *
 * What the pipeline sees is bounded so that one input stays cheap: the model is the fixed one
 * below (not the file the input names), --policy files and --print-ir-after are dropped, and
 * an input with a -D value longer than 8 characters, more than 8 layers (the one size that
 * multiplies the graph) or a batch x seq above 4096 tokens is parsed only. (Large sizes are
 * the model harness's business; the bounds on them are checked by the front end's own tests.) */
#include <setjmp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "fuzz_util.h"

#ifndef FP8C_VERSION
#define FP8C_VERSION "fuzz"
#endif

static FILE *fuzz_cli_err(void);

/* Where exit() goes while parse_args runs: back to LLVMFuzzerTestOneInput, with status + 1. */
static jmp_buf fuzz_cli_jump;
static bool fuzz_cli_parsing;

static _Noreturn void fuzz_cli_exit(int status)
{
    if (!fuzz_cli_parsing) exit(status);
    fuzz_cli_parsing = false;
    longjmp(fuzz_cli_jump, status + 1);
}

#undef stderr
#undef stdout
#define stderr fuzz_cli_err()
#define stdout fuzz_cli_err()
#define exit(status) fuzz_cli_exit(status)
#define main fp8c_main
int main(int argc, char **argv);
#include "../../compiler/main.c"
#undef main
#undef exit
#undef stdout
#undef stderr

#include "rt.h"

static FILE *fuzz_cli_err(void) { return fuzz_null(); }

static const char fuzz_cli_model[] =
    "model fuzz_cli\n"
    "config vocab = 32, dim = 16, hidden = 32, layers = 2\n"
    "input tokens: i32[B, T]\n"
    "input targets: i32[B, T]\n"
    "param embed.weight: [vocab, dim] = normal(0.02)\n"
    "block ffn(x) {\n"
    "    param norm.weight: [dim] = ones\n"
    "    param norm.bias: [dim] = zeros\n"
    "    param fc1.weight: [hidden, dim] = normal(0.02)\n"
    "    param fc2.weight: [dim, hidden] = normal(0.02)\n"
    "    h = layernorm(x, norm.weight, norm.bias)\n"
    "    return x + linear(gelu(linear(h, fc1.weight)), fc2.weight)\n"
    "}\n"
    "x = embedding(embed.weight, tokens)\n"
    "for i in 0..layers {\n"
    "    x = ffn(x) as h[i]\n"
    "}\n"
    "param head.weight: [vocab, dim] = normal(0.02)\n"
    "logits = linear(x, head.weight)\n"
    "loss cross_entropy(logits, targets)\n"
    "optimizer adamw(lr=1e-3, weight_decay=0.01)\n";

enum { MAX_ARGS = 64 };

/* What parse_args promises when it accepts a command line; a broken promise aborts. */
static void fuzz_cli_check(const Args *a, int argc)
{
    const PassOptions *p = &a->build.passes;
    const FrontOptions *f = &a->build.front;
    if (p->opt_level < 0 || p->opt_level > 3) abort();
    if (f->batch < 0 || f->batch > (1 << 30) || f->seq < 0 || f->seq > (1 << 30)) abort();
    if (f->n_defines < 0 || f->n_defines > MAX_DEFINES) abort();
    for (int i = 0; i < f->n_defines; i++)
        if (!f->defines[i].name[0] || strlen(f->defines[i].name) >= sizeof a->define_names[0]) abort();
    if (p->n_overrides < 0 || p->n_overrides > MAX_OVERRIDES) abort();
    for (int i = 0; i < p->n_overrides; i++)
        if (!strchr(p->overrides[i], '=')) abort();
    if (a->vs_level < -1 || a->vs_level > 3) abort();
    if (a->n_run_args < 0 || a->n_run_args > argc) abort();
}

/* The flags applied to the fixed model, when they keep one input cheap. */
static void fuzz_cli_compile(Args *a, const char *model)
{
    if (a->build.front.batch * (a->build.front.seq ? a->build.front.seq : 1) > 4096) return;
    for (int i = 0; i < a->build.front.n_defines; i++) {
        const Define *d = &a->build.front.defines[i];
        char *end;
        double v = strtod(d->value, &end);
        if (strlen(d->value) > 8 || (!strcmp(d->name, "layers") && end != d->value && v > 8)) return;
    }
    BuildOptions o = a->build;
    o.passes.policy_file = NULL;
    o.passes.print_after = NULL;
    o.passes.verify = true;
    if (!o.front.batch) o.front.batch = 2;
    if (!o.front.seq) o.front.seq = 8;
    Arena *arena = arena_new();
    Graph *g = pipeline_compile(arena, model, &o);
    if (getenv("FP8C_FUZZ_VERBOSE"))
        fprintf(fuzz_null(), "compiled: %d nodes, %d errors\n", g ? g->n_nodes : 0, diag_error_count());
    arena_free(arena);
    diag_reset();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > FUZZ_MAX_INPUT) return -1;
    static const char *model;
    if (!model) model = fuzz_write("fuzz_cli.model", (const uint8_t *)fuzz_cli_model,
                                   sizeof fuzz_cli_model - 1);
    diag_set_stream(fuzz_null());
    rt_set_error_stream(fuzz_null());
    char *text = fuzz_text(data, size);
    char *argv[MAX_ARGS + 1];
    int argc = 0;
    char *p = text, *end = text + size;
    while (p < end && argc < MAX_ARGS) {
        char *q = p;
        while (q < end && *q != '\0' && *q != '\n') q++;
        *q = '\0';
        argv[argc++] = p;
        p = q + 1;
    }
    argv[argc] = NULL;
    static Args a;   /* static: it must outlive a longjmp out of parse_args */
    int jumped = setjmp(fuzz_cli_jump);
    if (!jumped) {
        fuzz_cli_parsing = true;
        parse_args(argc, argv, &a);
        fuzz_cli_parsing = false;
        fuzz_cli_check(&a, argc);
        fuzz_cli_compile(&a, model);
    } else if (jumped - 1 != 0 && jumped - 1 != 2) {
        abort();   /* the parser ends a command with 2 (a bad flag) or 0 (--help), nothing else */
    }
    emit_set_cpu(NULL);   /* parse_args kept a pointer into this input */
    emit_set_print_kernels(false);
    free(text);
    return 0;
}
