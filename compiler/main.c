/* main.c — the fp8c command line.
 *
 *   fp8c plan  MODEL [build flags] [--json] [--vs -On | --vs-model M]   precision + memory table
 *   fp8c plan  MODEL [build flags] --kernels [--device cuda|cpu]        the kernel program
 *   fp8c build MODEL [build flags] -o NAME                               a training binary
 *   fp8c train MODEL [build flags] [-- run flags]                        build, then run it
 *   fp8c tune  MODEL [build flags] --device cuda|cpu [--budget S] -o FILE  measure the choices
 *   fp8c tune  MODEL [build flags] --device cuda|cpu --list-candidates  what tune would build
 *   fp8c opt   FILE.ir --passes=a,b                                      run passes on textual IR
 *   fp8c passes                                                          list the passes
 *   fp8c recipes                                                         list the --recipe names
 *
 * The flags are one table, fp8c_flags below: each row is a flag's name, whether it takes a
 * value, what it sets (an id that parse_flag's switch acts on) and its help text; getopt_long's
 * options, `fp8c --help` and the suggestions for an unknown flag are made from it
 * (runtime/cli.c), so a new flag is a row and a case. A value follows as the next word or
 * after '=' (--batch 8, --batch=8); -O takes its level attached (-O2); flags are written whole
 * (an abbreviation is refused and the flag it abbreviates suggested); a flag given again
 * replaces the earlier value, but -D, --precision and --choice add up and --recipe is refused
 * twice. Every flag is checked; a bad one is one line on stderr and exit status 2. */
#include "codegen.h"
#include "compiler.h"
#include "rt.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DEFINES 64
#define MAX_OVERRIDES 64
#define MAX_CHOICES 1024
#define TUNE_DEFAULT_BUDGET 300

/* One arena for the command. It is reachable from here until main returns, also when a user
 * error ends the run early through exit(), so leak checkers see no lost compilation. */
static Arena *the_arena;

static Arena *session_arena(void)
{
    if (!the_arena) the_arena = arena_new();
    return the_arena;
}

/* What each flag sets: parse_flag's switch acts on it. */
enum {
    F_LEVEL, F_BATCH, F_SEQ, F_DEFINE, F_CONFIG, F_POLICY, F_PRECISION, F_RECIPE, F_OPTIMIZER, F_NESTEROV, F_GRAD_RELEASE,
    F_VERIFY, F_GPUS, F_SHARD_STATES, F_PRINT_IR_AFTER, F_PRINT_IR_AFTER_ALL, F_STOP_AFTER, F_CPU, F_PRINT_KERNELS,
    F_TUNE, F_TUNE_MISMATCH, F_CHOICE, F_OUTPUT, F_JSON, F_VS, F_KERNELS, F_DEVICE, F_BUDGET,
    F_MEMORY_BUDGET, F_TUNE_STEPS, F_LIST_CANDIDATES, F_PASSES, F_HELP,
};

/* The flags, one row each: getopt_long's options, the --help lines and the suggestions of
 * an unknown flag are all made from this table (runtime/cli.c). */
#define FLAG(name, letter, has_arg, value, id, help) \
    {name, letter, has_arg, value, RT_FLAG_BY_ID, 0, 0, 0, id, help}
#define HEADING(text) {NULL, 0, RT_ARG_NONE, NULL, RT_FLAG_HEADING, 0, 0, 0, 0, text}
static const RtFlag fp8c_flags[] = {
    HEADING("build flags (plan, build, train, tune):"),
    FLAG(NULL, 'O', RT_ARG_ATTACHED, "0..3", F_LEVEL, "the level, attached: -O0 (BF16 baseline) .. -O3"),
    FLAG("batch", 0, RT_ARG_VALUE, "N", F_BATCH, "sequences per step"),
    FLAG("seq", 0, RT_ARG_VALUE, "N", F_SEQ, "tokens per sequence"),
    FLAG(NULL, 'D', RT_ARG_VALUE, "name=value", F_DEFINE, "a config constant of the model (-D layers=2)"),
    FLAG("config", 0, RT_ARG_VALUE, "FILE", F_CONFIG, "a Hugging Face config.json's sizes as -D; -D wins"),
    FLAG("policy", 0, RT_ARG_VALUE, "FILE", F_POLICY, "per-tensor precision rules (docs/precision.md)"),
    FLAG("precision", 0, RT_ARG_VALUE, "PATTERN=FORMAT", F_PRECISION, "one per-tensor precision rule"),
    FLAG("recipe", 0, RT_ARG_VALUE, "NAME", F_RECIPE, "another system's settings (fp8c recipes)"),
    FLAG("optimizer", 0, RT_ARG_VALUE, "adamw|lion|sgd", F_OPTIMIZER, "in place of the model's optimizer clause"),
    FLAG("nesterov", 0, RT_ARG_NONE, NULL, F_NESTEROV, "sgd: Nesterov momentum"),
    FLAG("grad-release", 0, RT_ARG_NONE, NULL, F_GRAD_RELEASE, "weight gradients feed the update at once"),
    FLAG("verify", 0, RT_ARG_NONE, NULL, F_VERIFY, "verify the graph after every pass"),
    FLAG("gpus", 0, RT_ARG_VALUE, "N", F_GPUS, "data parallel: gradients averaged over N GPUs; plan: per GPU"),
    FLAG("shard-states", 0, RT_ARG_ATTACHED, "1|2|3", F_SHARD_STATES,
         "with --gpus N: each GPU keeps 1/N of the master weights and optimizer\n"
         "states (ZeRO stage 1, the default), =2 of the gradients too (stage 2),\n"
         "=3 of the weights too, gathered per layer (stage 3)"),
    FLAG("print-ir-after", 0, RT_ARG_VALUE, "PASS|all", F_PRINT_IR_AFTER, "the textual IR after a pass"),
    FLAG("print-ir-after-all", 0, RT_ARG_NONE, NULL, F_PRINT_IR_AFTER_ALL,
         "the textual IR after every pass"),
    FLAG("stop-after", 0, RT_ARG_VALUE, "PASS", F_STOP_AFTER, "run the passes up to this one (no binary)"),
    FLAG("cpu", 0, RT_ARG_VALUE, "NAME", F_CPU,
         "CPU kernels for an LLVM CPU, e.g. x86-64-v3; default: this one"),
    FLAG("print-kernels", 0, RT_ARG_NONE, NULL, F_PRINT_KERNELS,
         "build: the CPU kernels, as the binary runs them, to stdout"),
    FLAG("tune", 0, RT_ARG_VALUE, "FILE", F_TUNE, "a record of fp8c tune: its winners"),
    FLAG("tune-mismatch", 0, RT_ARG_VALUE, "defaults|refuse", F_TUNE_MISMATCH,
         "a record made for another device, fp8c or model"),
    FLAG("choice", 0, RT_ARG_VALUE, "NAME=VALUE", F_CHOICE, "one choice of the kernel program (docs/tuning.md)"),
    FLAG(NULL, 'o', RT_ARG_VALUE, "NAME", F_OUTPUT, "build: the training binary; tune: the record"),
    HEADING("plan:"),
    FLAG("json", 0, RT_ARG_NONE, NULL, F_JSON, "the plan as JSON"),
    FLAG("vs", 0, RT_ARG_VALUE, "-On", F_VS, "the plan beside another level's"),
    FLAG("kernels", 0, RT_ARG_NONE, NULL, F_KERNELS, "the kernel program instead of the table"),
    FLAG("device", 0, RT_ARG_VALUE, "cuda|cpu", F_DEVICE, "plan --kernels, tune: the device (plan: default cuda)"),
    HEADING("tune:"),
    FLAG("budget", 0, RT_ARG_VALUE, "SECONDS", F_BUDGET, "time to measure in (default 300)"),
    FLAG("memory-budget", 0, RT_ARG_VALUE, "GiB", F_MEMORY_BUDGET, "the fastest choices that fit"),
    FLAG("tune-steps", 0, RT_ARG_VALUE, "N", F_TUNE_STEPS, "steps timed per candidate, 4..60"),
    FLAG("list-candidates", 0, RT_ARG_NONE, NULL, F_LIST_CANDIDATES,
         "the --choice of each binary tune would build, one a line; no -o"),
    HEADING("opt:"),
    FLAG("passes", 0, RT_ARG_VALUE, "a,b", F_PASSES, "the passes to run, in order (fp8c passes)"),
    FLAG("help", 'h', RT_ARG_NONE, NULL, F_HELP, "this text"),
    {0},
};
#undef FLAG
#undef HEADING

static void usage(FILE *out)
{
    fputs("usage: fp8c plan  MODEL [build flags] [--json] [--vs -On] [--kernels [--device cuda|cpu]]\n"
          "       fp8c build MODEL [build flags] -o NAME\n"
          "       fp8c train MODEL [build flags] [-- run flags]\n"
          "       fp8c tune  MODEL [build flags] --device cuda|cpu [--budget SECONDS] [--memory-budget GiB]\n"
          "                  [--tune-steps N] -o FILE\n"
          "       fp8c tune  MODEL [build flags] --device cuda|cpu --list-candidates\n"
          "       fp8c opt   FILE.ir --passes=a,b [--print-ir-after=PASS|all]\n"
          "       fp8c passes\n"
          "       fp8c recipes\n"
          "       fp8c --version\n"
          "A flag's value is the next word or follows '=' (--batch 8, --batch=8); flags are written\n"
          "whole (no abbreviations); after '--', fp8c train passes the rest to the training binary.\n",
          out);
    rt_cli_help(out, fp8c_flags, 28);
}

static _Noreturn void bad_flag(const char *fmt, const char *arg)
{
    fprintf(stderr, "fp8c: error: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see fp8c --help)\n");
    exit(2);
}

/* An unknown flag, as written, and the known one nearest to it. */
static _Noreturn void unknown_flag(const char *word, const char *near)
{
    fprintf(stderr, "fp8c: error: unknown flag '%s'", word);
    if (near) fprintf(stderr, "; did you mean '%s'?", near);
    fprintf(stderr, " (see fp8c --help)\n");
    exit(2);
}

/* --recipe NAME: a known recipe fp8c can run, or exit status 2 with the reason. */
static const NamedRecipe *find_recipe_or_exit(const char *name)
{
    const NamedRecipe *r = name ? precision_find_recipe(name) : NULL;
    if (!r) {
        int n;
        const NamedRecipe *all = precision_recipes(&n);
        const char *names[64];
        for (int i = 0; i < n && i < 63; i++) names[i] = all[i].name;
        names[n < 63 ? n : 63] = NULL;
        const char *near = name ? rt_nearest_word(name, names) : NULL;
        fprintf(stderr, "fp8c: error: --recipe needs a recipe name, not '%s'%s%s%s (fp8c recipes "
                        "lists them)\n", name ? name : "", near ? "; did you mean '" : "",
                near ? near : "", near ? "'?" : "");
        exit(2);
    }
    if (r->refused) {
        fprintf(stderr, "fp8c: error: --recipe %s (%s): fp8c cannot run it: %s\n", r->name, r->what,
                r->refused);
        exit(2);
    }
    return r;
}

static int cmd_recipes(void)
{
    int n;
    const NamedRecipe *all = precision_recipes(&n);
    for (int i = 0; i < n; i++) {
        printf("%-20s -O%d%s  %s\n", all[i].name, all[i].level, all[i].level_fixed ? "" : "+",
               all[i].what);
        if (all[i].refused) printf("%-26s refused: %s\n", "", all[i].refused);
        for (int k = 0; k < RECIPE_MAX_RULES && all[i].rules[k]; k++)
            printf("%-26s --precision '%s'\n", "", all[i].rules[k]);
    }
    return 0;
}

/* A count (--batch, --seq, --gpus, --tune-steps): a whole number from 1 to 2^30. */
static int64_t parse_size(const char *flag, const char *s)
{
    int64_t v;
    if (!rt_cli_int(s, &v)) {
        fprintf(stderr, "fp8c: error: %s: '%s' is not a whole number\n", flag, s);
        exit(2);
    }
    if (v <= 0 || v > (1LL << 30)) {
        fprintf(stderr, "fp8c: error: %s needs a positive integer, not '%s'\n", flag, s);
        exit(2);
    }
    return v;
}

/* --budget, --memory-budget: a number above 0 and at most 1e6. */
static double parse_amount(const char *flag, const char *what, const char *s)
{
    double v;
    if (!rt_cli_real(s, &v)) {
        fprintf(stderr, "fp8c: error: %s: '%s' is not a number\n", flag, s);
        exit(2);
    }
    if (!(v > 0) || v > 1e6) {
        fprintf(stderr, "fp8c: error: %s needs %s, not '%s' (see fp8c --help)\n", flag, what, s);
        exit(2);
    }
    return v;
}

typedef struct {
    BuildOptions build;
    Define defines[MAX_DEFINES];
    char define_names[MAX_DEFINES][64];
    const char *overrides[MAX_OVERRIDES];
    const char *model;
    const char *config;        /* --config: a Hugging Face config.json */
    const char *output;
    bool json;
    bool level_given;          /* -On was on the command line (opt: overrides the IR's opt=) */
    int vs_level;              /* --vs -On: compare with another level; -1 none */
    bool kernels;              /* plan --kernels: the kernel program instead of the table */
    const char *device;        /* plan --kernels --device cuda|cpu (default cuda) */
    const char *passes;        /* opt: --passes= */
    char **run_args;           /* train: what follows -- */
    int n_run_args;
    char **flags;              /* everything after the command (the binary cache's key) */
    int n_flags;
    bool print_kernels;
    const char *tune;          /* --tune FILE: a tuning record to build with */
    bool tune_defaults;        /* --tune-mismatch=defaults: a record that does not fit is left out */
    double budget;             /* tune --budget SECONDS */
    double memory_budget;      /* tune --memory-budget GiB */
    int tune_steps;            /* tune --tune-steps N */
    bool list_candidates;      /* tune --list-candidates: print, measure nothing */
    Choice choices[MAX_CHOICES];   /* --choice flags, then the record's winners */
    int n_choices;
    TuneRecord record;         /* --tune's, read */
} Args;

/* --config FILE: the sizes a Hugging Face config.json gives, as -D defines of the config
 * constants models/gpt2.model and models/llama.model use. They go before the command line's
 * own -D, so that an explicit -D wins (the last -D of a name does). Keys the model has no
 * constant for (activation, rope type, tied head, head size) are what --init checks against
 * the built graph when the weights are loaded; a model_type that is neither family is refused
 * here. */
typedef struct {
    const char *key, *define;
} ConfigKey;

static const ConfigKey config_gpt2[] = {
    {"n_layer", "layers"}, {"n_embd", "dim"}, {"n_head", "heads"}, {"vocab_size", "vocab"},
    {"n_positions", "max_seq"}, {NULL, NULL}};
static const ConfigKey config_llama[] = {
    {"num_hidden_layers", "layers"}, {"hidden_size", "dim"}, {"num_attention_heads", "heads"},
    {"num_key_value_heads", "kv_heads"}, {"intermediate_size", "hidden"},
    {"vocab_size", "vocab"}, {"rms_norm_eps", "norm_eps"}, {"rope_theta", "rope_theta"},
    {NULL, NULL}};

static _Noreturn void config_fail(const char *path, const char *what, const char *key)
{
    fprintf(stderr, "fp8c: error: %s: %s%s\n", path, what, key ? key : "");
    exit(2);
}

static void config_defines(Args *a)
{
    Jv cfg;
    rt_set_program_name("fp8c");
    if (!rt_json_read(a->config, &cfg)) exit(2);   /* the reader printed the line */
    const Jv *type = rt_json_get(&cfg, "model_type");
    if (!type || type->kind != JV_STR)
        config_fail(a->config, "no model_type (gpt2 or llama)", NULL);
    const ConfigKey *keys = !strcmp(type->str, "gpt2") ? config_gpt2
                          : !strcmp(type->str, "llama") ? config_llama : NULL;
    if (!keys) config_fail(a->config, "model_type is not gpt2 or llama: ", type->str);
    Define found[16];
    int n = 0;
    Arena *arena = session_arena();
    for (const ConfigKey *k = keys; k->key; k++) {
        const Jv *v = rt_json_get(&cfg, k->key);
        if (!strcmp(k->key, "rope_theta") && (!v || v->kind == JV_NULL)) {   /* transformers 5 */
            const Jv *rp = rt_json_get(&cfg, "rope_parameters");
            v = rp ? rt_json_get(rp, "rope_theta") : NULL;
        }
        if (!v || v->kind == JV_NULL) continue;
        if (v->kind != JV_NUM) config_fail(a->config, "not a number: ", k->key);
        /* NaN, Infinity and 1e400 read as numbers, and would reach the model as a -D the
         * command line never had: said here, of the file's key */
        if (!isfinite(v->num)) config_fail(a->config, "not a finite number: ", k->key);
        found[n++] = (Define){k->define, arena_printf(arena, "%.15g", v->num)};
    }
    rt_json_free(&cfg);
    int have = a->build.front.n_defines;
    if (have + n > MAX_DEFINES) bad_flag("too many -D flags with --config %s", a->config);
    memmove(a->defines + n, a->defines, (size_t)have * sizeof *a->defines);
    memcpy(a->defines, found, (size_t)n * sizeof *found);
    a->build.front.n_defines = have + n;
}

/* One flag of the table read, with its value v (NULL when it takes none). */
static void parse_flag(Args *a, const RtFlag *f, const char *v, const char *word)
{
    switch (f->id) {
    case F_LEVEL:   /* -O0 .. -O3, the digit attached */
        if (!v || v[0] < '0' || v[0] > '3' || v[1]) unknown_flag(word, NULL);
        a->build.passes.opt_level = v[0] - '0';
        a->level_given = true;
        break;
    case F_BATCH:
        a->build.front.batch = parse_size("--batch", v);
        break;
    case F_SEQ:
        a->build.front.seq = parse_size("--seq", v);
        break;
    case F_DEFINE: {
        const char *eq = strchr(v, '=');
        if (!eq || eq == v) bad_flag("-D needs name=value, not '%s'", v);
        if (a->build.front.n_defines == MAX_DEFINES) bad_flag("too many -D flags%s", "");
        if (eq - v >= (ptrdiff_t)sizeof a->define_names[0]) bad_flag("-D name too long: '%s'", v);
        int k = a->build.front.n_defines++;
        memcpy(a->define_names[k], v, (size_t)(eq - v));
        a->define_names[k][eq - v] = 0;
        a->defines[k] = (Define){a->define_names[k], eq + 1};
        break;
    }
    case F_CONFIG:
        a->config = v;
        break;
    case F_RECIPE:
        if (a->build.passes.recipe) bad_flag("--recipe is given twice (%s)", a->build.passes.recipe->name);
        a->build.passes.recipe = find_recipe_or_exit(v);
        break;
    case F_POLICY:
        a->build.passes.policy_file = v;
        break;
    case F_PRECISION:
        if (!strchr(v, '=')) bad_flag("--precision needs PATTERN=FORMAT, not '%s'", v);
        if (a->build.passes.n_overrides == MAX_OVERRIDES) bad_flag("too many --precision flags%s", "");
        a->overrides[a->build.passes.n_overrides++] = v;
        break;
    case F_OPTIMIZER: {
        OptimKind kind;
        if (!ir_optim_from_name(v, &kind)) bad_flag("--optimizer needs adamw, lion or sgd, not '%s'", v);
        a->build.passes.optimizer = v;
        break;
    }
    case F_NESTEROV:
        a->build.passes.nesterov = true;
        break;
    case F_GRAD_RELEASE:
        a->build.passes.grad_release = true;
        break;
    case F_GPUS: {
        int64_t n = parse_size("--gpus", v);
        if (n > 1024) bad_flag("--gpus needs a count from 1 to 1024, not '%s'", v);
        a->build.passes.gpus = (int)n;
        break;
    }
    case F_SHARD_STATES:   /* --shard-states is stage 1; =2 the gradients as well, =3 the weights */
        if (v && *v && strcmp(v, "1") && strcmp(v, "2") && strcmp(v, "3"))
            bad_flag("--shard-states takes the ZeRO stage, 1 (the default: master weights and optimizer "
                     "states), 2 (the gradients too) or 3 (the weights too), not '%s'", v);
        a->build.passes.shard_states = v && *v ? v[0] - '0' : 1;
        break;
    case F_VERIFY:
        a->build.passes.verify = true;
        break;
    case F_PRINT_IR_AFTER:
        a->build.passes.print_after = v;
        break;
    case F_PRINT_IR_AFTER_ALL:
        a->build.passes.print_after = "all";
        break;
    case F_STOP_AFTER:
        a->build.stop_after = v;
        break;
    case F_PASSES:
        a->passes = v;
        break;
    case F_CPU:
        if (!v[0]) bad_flag("--cpu needs an LLVM CPU name such as x86-64-v3%s", "");
        emit_set_cpu(v);
        break;
    case F_PRINT_KERNELS:
        emit_set_print_kernels(true);
        a->print_kernels = true;
        break;
    case F_OUTPUT:
        a->output = v;
        break;
    case F_TUNE:
        a->tune = v;
        break;
    case F_TUNE_MISMATCH:
        if (strcmp(v, "defaults") && strcmp(v, "refuse"))
            bad_flag("--tune-mismatch takes defaults or refuse, not '%s'", v);
        a->tune_defaults = !strcmp(v, "defaults");
        break;
    case F_BUDGET:
        a->budget = parse_amount("--budget", "seconds", v);
        break;
    case F_MEMORY_BUDGET:
        a->memory_budget = parse_amount("--memory-budget", "GiB", v);
        break;
    case F_TUNE_STEPS:
        a->tune_steps = (int)parse_size("--tune-steps", v);
        if (a->tune_steps < 4 || a->tune_steps > 60) bad_flag("--tune-steps needs 4..60, not '%s'", v);
        break;
    case F_CHOICE: {
        const char *eq = strchr(v, '=');
        if (!eq) bad_flag("--choice needs NAME=VALUE, not '%s'", v);
        if (a->n_choices == MAX_CHOICES) bad_flag("too many --choice flags%s", "");
        char *name = arena_printf(session_arena(), "%.*s", (int)(eq - v), v);
        if (!ir_choice_name_ok(name) || !ir_choice_value_ok(eq + 1))
            bad_flag("--choice: '%s' is not NAME=VALUE (names: letters, digits, _ . @)", v);
        char why[160];
        if (ir_choice_check(name, eq + 1, why, sizeof why)) bad_flag("--choice: %s", why);
        a->choices[a->n_choices++] = (Choice){name, eq + 1};
        break;
    }
    case F_LIST_CANDIDATES:
        a->list_candidates = true;
        break;
    case F_JSON:
        a->json = true;
        break;
    case F_KERNELS:
        a->kernels = true;
        break;
    case F_DEVICE:
        if (strcmp(v, "cuda") && strcmp(v, "cpu")) bad_flag("--device needs cuda or cpu, not '%s'", v);
        a->device = v;
        break;
    case F_VS:
        if (v[0] != '-' || v[1] != 'O' || v[2] < '0' || v[2] > '3' || v[3])
            bad_flag("--vs needs a level such as -O0, not '%s'", v);
        a->vs_level = v[2] - '0';
        break;
    case F_HELP:
        usage(stdout);
        exit(0);
    }
}

/* Parses the flags shared by plan, build, train and opt: argv holds what follows the command,
 * read by the table above in order. The first word that is not a flag is the model; `--` ends
 * the flags and keeps the rest for the training binary (train). A bad flag ends the command
 * with one line and status 2. */
static void parse_args(int argc, char **argv, Args *a)
{
    memset(a, 0, sizeof *a);
    a->flags = argv;
    a->n_flags = argc;
    a->vs_level = -1;
    a->build.passes.opt_level = 0;
    a->build.front.defines = a->defines;
    a->build.passes.overrides = a->overrides;
    a->build.passes.print_groups = fuse_print;   /* the groups are codegen's (codegen/fuse.c) */
    a->build.choices = a->choices;
#ifndef NDEBUG
    a->build.passes.verify = true;
#endif
    /* getopt reads from argv[1]: the words behind a program name of their own (kept from one
     * command to the next, so that a bad flag's exit leaves nothing unreachable) */
    static char **words;
    free(words);
    words = malloc(sizeof *words * (size_t)(argc + 2));
    if (!words) bad_flag("out of memory%s", "");
    words[0] = "fp8c";
    memcpy(words + 1, argv, sizeof *words * (size_t)argc);
    words[argc + 1] = NULL;
    RtCli c;
    rt_cli_begin(&c, fp8c_flags, argc + 1, words);
    for (int got; (got = rt_cli_next(&c)) != RT_CLI_END;) {
        if (got == RT_CLI_REST) {
            a->run_args = argv + c.rest - 1;
            a->n_run_args = argc - (c.rest - 1);
            break;
        }
        switch (got) {
        case RT_CLI_FLAG:
            parse_flag(a, c.flag, c.value, c.word);
            break;
        case RT_CLI_WORD:
            if (c.value[0] == '-') unknown_flag(c.value, NULL);   /* "-" */
            if (a->model) bad_flag("unexpected argument '%s'", c.value);
            a->model = c.value;
            break;
        case RT_CLI_MISSING:
            if (c.flag->name) fprintf(stderr, "fp8c: error: --%s needs a value (see fp8c --help)\n", c.flag->name);
            else fprintf(stderr, "fp8c: error: -%c needs a value (see fp8c --help)\n", c.flag->letter);
            exit(2);
        case RT_CLI_NO_VALUE:
            fprintf(stderr, "fp8c: error: --%s takes no value: %s (see fp8c --help)\n", c.flag->name, c.word);
            exit(2);
        default:   /* RT_CLI_UNKNOWN */
            unknown_flag(c.word, c.near);
        }
    }
    if (a->config) config_defines(a);
    const NamedRecipe *r = a->build.passes.recipe;
    if (r && !a->level_given) {
        a->build.passes.opt_level = r->level;
    } else if (r && r->level_fixed && a->build.passes.opt_level != r->level) {
        fprintf(stderr, "fp8c: error: --recipe %s is -O%d's states with its rules: drop -O%d\n",
                r->name, r->level, a->build.passes.opt_level);
        exit(2);
    }
    int64_t b = a->build.front.batch, t = a->build.front.seq;   /* each at most 2^30 */
    if (b && t && b * t > IR_MAX_NUMEL) {
        fprintf(stderr, "fp8c: error: --batch %lld x --seq %lld is %lld tokens a step; at most 2^40\n",
                (long long)b, (long long)t, (long long)(b * t));
        exit(2);
    }
    a->build.n_choices = a->n_choices;
    const char *pa = a->build.passes.print_after, *sa = a->build.stop_after;
    if (pa && strcmp(pa, "all") && strcmp(pa, "front") && !pass_find(pa))
        bad_flag("--print-ir-after names no pass: '%s' (fp8c passes lists them)", pa);
    if (sa && strcmp(sa, "front") && !pass_find(sa))
        bad_flag("--stop-after names no pass: '%s' (fp8c passes lists them)", sa);
}

static int cmd_passes(void)
{
    int n;
    const PassInfo *t = pass_table(&n);
    for (int i = 0; i < n; i++) printf("%-10s %s\n", t[i].name, t[i].summary);
    return 0;
}

/* The file's text, or NULL with errno set: also when a read fails after the open, as it does
 * for a directory (EISDIR), which would otherwise read as an empty file. */
static char *read_whole_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (size_t k; buf && (k = fread(buf + len, 1, cap - len - 1, f)) > 0;) {
        len += k;
        if (len + 1 == cap) buf = realloc(buf, cap *= 2);
    }
    int err = ferror(f) ? errno : buf ? 0 : ENOMEM;
    fclose(f);
    if (err) {
        free(buf);
        errno = err;
        return NULL;
    }
    buf[len] = 0;
    return buf;
}

/* fp8c opt FILE.ir --passes=a,b: read textual IR, run the passes, print the result. */
static int cmd_opt(Args *a)
{
    if (!a->model) bad_flag("opt needs an IR file%s", "");
    if (a->passes && *a->passes) {   /* the list before any work: "dce," leaves a name out */
        size_t len = strlen(a->passes);
        if (a->passes[0] == ',' || a->passes[len - 1] == ',' || strstr(a->passes, ",,"))
            bad_flag("--passes has an empty name in its list: '%s'", a->passes);
    }
    char *text = read_whole_file(a->model);
    if (!text) {
        fprintf(stderr, "fp8c: error: cannot read '%s': %s\n", a->model, strerror(errno));
        return 1;
    }
    /* the text and the pass list live in the arena, so every way out leaves nothing behind */
    Arena *arena = session_arena();
    char *source = arena_strdup(arena, text);
    free(text);
    Graph *g = ir_read(arena, a->model, source);
    if (!g) return 1;
    a->build.passes.verify = true;
    if (ir_verify(g, "reading")) return 1;
    if (a->level_given) g->opt_level = a->build.passes.opt_level;
    if (a->passes && *a->passes) {
        char *list = arena_strdup(arena, a->passes), *save = NULL;
        for (char *name = strtok_r(list, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
            const PassInfo *p = pass_find(name);
            if (!p) bad_flag("--passes names no pass: '%s' (fp8c passes lists them)", name);
            if (!pass_run(g, p, &a->build.passes)) return 1;
        }
    }
    if (!a->build.passes.print_after) ir_print(g, stdout);
    return 0;
}

/* The planned graph, or NULL after the errors and their count. */
static Graph *compile(Arena *arena, Args *a)
{
    if (!a->model) bad_flag("a model file is needed%s", "");
    Graph *g = pipeline_compile(arena, a->model, &a->build);
    if (!g || diag_error_count()) {
        if (diag_error_count())
            fprintf(stderr, "%d error%s.\n", diag_error_count(), diag_error_count() == 1 ? "" : "s");
        return NULL;
    }
    return g;
}

static Graph *compile_or_exit(Arena *arena, Args *a)
{
    Graph *g = compile(arena, a);
    if (!g) exit(1);
    return g;
}

/* --tune FILE: read the record, check that it was made for this device, fp8c and model, and
 * add its winners to the build's choices. A record that does not fit is one line and exit 1,
 * or with --tune-mismatch=defaults a note and the defaults. A malformed one is always an
 * error. */
static void apply_tune_record(Args *a)
{
    if (!a->tune) return;
    if (!a->model) bad_flag("a model file is needed%s", "");
    if (!tune_record_read(a->tune, &a->record)) exit(1);
    char hash[65], shown[1024], id[17];
    if (!tune_model_key(a->model, a->flags, a->n_flags, hash, shown, sizeof shown)) exit(1);
    const char *device = tune_current_device(a->record.device_kind, id);
    char why[1024];
    const char *which = tune_record_mismatch(&a->record, hash, FP8C_VERSION, device, why, sizeof why);
    if (which && !a->tune_defaults) {
        fprintf(stderr, "fp8c: error: %s: the record is for another %s: %s (--tune-mismatch=defaults "
                        "builds on the defaults)\n", a->tune, which, why);
        exit(1);
    }
    if (which) {
        fprintf(stderr, "fp8c: note: %s: the record is for another %s: %s; building on the defaults\n",
                a->tune, which, why);
        return;
    }
    if (!device)
        fprintf(stderr, "fp8c: note: %s: no GPU here to check the record's device against; the binary "
                        "checks it when it starts\n", a->tune);
    int room = MAX_CHOICES - a->n_choices;
    int n = tune_record_choices(&a->record, a->choices + a->n_choices, room);
    for (int i = a->n_choices; i < a->n_choices + n; i++) {
        char bad[160];
        if (ir_choice_check(a->choices[i].name, a->choices[i].value, bad, sizeof bad)) {
            fprintf(stderr, "fp8c: error: %s: %s\n", a->tune, bad);
            exit(1);
        }
    }
    /* a --choice given by hand wins over the record's */
    for (int i = a->n_choices; i < a->n_choices + n; i++)
        for (int k = 0; k < a->n_choices; k++)
            if (!strcmp(a->choices[k].name, a->choices[i].name)) a->choices[i] = a->choices[k];
    a->n_choices += n;
    a->build.n_choices = a->n_choices;
}

/* plan --tune: each choice point, its default and winner with their times. */
static void print_tune_table(const TuneRecord *r, FILE *out)
{
    fprintf(out, "\ntuning record: %s on %s (%s)\n", r->model_file, r->device_kind, r->device_description);
    fprintf(out, "step: defaults %.2f ms, tuned %.2f ms\n", r->default_ms, r->tuned_ms);
    fprintf(out, "%-28s %-16s %10s  %-16s %10s  %s\n", "choice", "default", "time", "winner", "time", "saved");
    for (int i = 0; i < r->n_points; i++) {
        const TunePoint *p = &r->points[i];
        double td = -1, tw = -1;
        const char *ld = p->dflt, *lw = p->winner;
        for (int k = 0; k < p->n_cand; k++) {
            if (!strcmp(p->cand[k].value, p->dflt)) td = p->cand[k].median, ld = p->cand[k].label[0] ? p->cand[k].label : ld;
            if (!strcmp(p->cand[k].value, p->winner)) tw = p->cand[k].median, lw = p->cand[k].label[0] ? p->cand[k].label : lw;
        }
        const char *unit = p->per_gemm ? "us" : "ms";
        char a_t[32] = "-", b_t[32] = "-", saved[32] = "-";
        if (td >= 0) snprintf(a_t, sizeof a_t, "%.2f %s", td, unit);
        if (tw >= 0) snprintf(b_t, sizeof b_t, "%.2f %s", tw, unit);
        if (!p->measured) snprintf(saved, sizeof saved, "not measured");
        else if (td > 0 && tw >= 0) snprintf(saved, sizeof saved, "%.1f%%", 100 * (td - tw) / td);
        fprintf(out, "%-28s %-16.16s %10s  %-16.16s %10s  %s\n", p->name, ld, a_t, lw, b_t, saved);
    }
}

static int cmd_plan(Args *a)
{
    if (a->device && !a->kernels) bad_flag("--device %s goes with --kernels", a->device);
    if (a->kernels && (a->json || a->vs_level >= 0)) bad_flag("--kernels lists one plan's program: no --json or --vs%s", "");
    Arena *arena = session_arena();
    Graph *g = compile_or_exit(arena, a);
    if (a->kernels) {
        bool ok = plan_print_kernels(g, a->device ? a->device : "cuda", stdout);
        if (ok && a->tune) print_tune_table(&a->record, stdout);
        return ok ? 0 : 1;
    }
    Graph *other = NULL;
    if (a->vs_level >= 0) {
        Args b = *a;
        b.build.passes.opt_level = a->vs_level;
        b.build.passes.print_after = NULL;
        other = compile_or_exit(arena, &b);
    }
    const NamedRecipe *r = a->build.passes.recipe;
    if (r && !a->json) {   /* what the name stands for, as the rules that follow show it */
        printf("recipe %s (-O%d): %s\n  rules:", r->name, r->level, r->what);
        for (int k = 0; k < RECIPE_MAX_RULES && r->rules[k]; k++) printf(" %s", r->rules[k]);
        printf("\n\n");
    }
    if (other) plan_print_diff(other, g, a->json, stdout);
    else plan_print(g, a->json, stdout);
    if (a->tune && !a->json) print_tune_table(&a->record, stdout);
    return 0;
}

static void print_wrote(const char *output, const BuildSummary *s)
{
    fprintf(stderr, "fp8c: wrote %s (-O%d, batch %lld, seq %lld): %lld parameters, "
                    "memory plan peak %.1f MiB (state %.1f MiB + step %.1f MiB)\n",
            output, s->opt_level, s->batch, s->seq, s->n_params,
            (double)(s->persistent + s->transient) / 1048576.0, (double)s->persistent / 1048576.0,
            (double)s->transient / 1048576.0);
}

/* A training binary at out: from the cache (cache.c) when everything it depends on is as it
 * was, else the whole pipeline and emit, and the result kept in the cache. False after a
 * message. */
static bool make_binary(Args *a, const char *out, BuildSummary *sum)
{
    double t0 = build_clock();
    char key[65];
    bool cacheable = !a->build.stop_after && !a->build.passes.print_after && !a->print_kernels &&
                     !build_no_cache() && cache_make_key(a->flags, a->n_flags, key);
    CacheResult cached = cacheable ? cache_fetch_binary(key, out, sum) : CACHE_MISS;
    if (cached == CACHE_HIT)
        build_progress("binary cached (%.12s), %.2f s", key, build_clock() - t0);
    if (cached != CACHE_MISS) return cached == CACHE_HIT;
    Arena *arena = session_arena();
    double t1 = build_clock();
    Graph *g = compile(arena, a);
    if (!g) return false;
    build_progress("passes %.2f s (%d nodes)", build_clock() - t1, g->n_nodes);
    if (!emit_training_binary(g, out)) return false;
    MemSummary m;
    memplan_summarize(g, &m);
    *sum = (BuildSummary){.opt_level = g->opt_level, .batch = (long long)g->batch,
                          .seq = (long long)g->seq, .n_params = (long long)m.n_params,
                          .persistent = (long long)m.persistent,
                          .transient = (long long)m.transient};
    snprintf(sum->model_name, sizeof sum->model_name, "%s", g->model_name ? g->model_name : "");
    /* stored only when its inputs did not change while it was being built */
    char again[65];
    if (cacheable && cache_make_key(a->flags, a->n_flags, again) && !strcmp(key, again))
        cache_store_binary(key, out, sum, emit_notes());
    return true;
}

/* The input of the build that -o names, or NULL: the model, or a file another flag names
 * (--policy, --config, --tune). The binary is renamed over its output, so such an -o would
 * replace the model text or the rules with the binary made from them. */
static const char *output_input(const Args *a)
{
    struct stat out;
    if (stat(a->output, &out) != 0) return NULL;
    for (int i = 0; i < a->n_flags; i++) {
        const char *w = a->flags[i];
        if (!strcmp(w, "--")) break;
        if (!strcmp(w, "-o")) i++;   /* the output itself, as -o NAME or -oNAME */
        if (!strncmp(w, "-o", 2)) continue;
        const char *path = cache_flag_file(w);
        struct stat in;
        if (path && stat(path, &in) == 0 && in.st_dev == out.st_dev && in.st_ino == out.st_ino)
            return path;
    }
    return NULL;
}

static int cmd_build(Args *a)
{
    if (!a->output) bad_flag("build needs -o NAME%s", "");
    const char *input = output_input(a);
    if (input) {
        fprintf(stderr, "fp8c: error: -o %s names an input of the build (%s): the binary would "
                        "replace it\n", a->output, input);
        exit(2);
    }
    if (a->build.stop_after) {   /* the passes up to one, to print the IR: no binary */
        compile_or_exit(session_arena(), a);
        return 0;
    }
    /* the binary is renamed over -o at the end, after the kernels compile (seconds to a
     * minute): an -o that is a directory, or in one that cannot be written, is found now */
    struct stat st;
    char where[4096];
    snprintf(where, sizeof where, "%s", a->output);
    char *slash = strrchr(where, '/');
    if (slash) slash == where ? (void)(where[1] = 0) : (void)(*slash = 0);
    if (stat(a->output, &st) == 0 && S_ISDIR(st.st_mode)) {
        fprintf(stderr, "fp8c: error: -o %s: is a directory\n", a->output);
        return 1;
    }
    if (access(slash ? where : ".", W_OK | X_OK) != 0) {
        fprintf(stderr, "fp8c: error: -o %s: cannot write in %s: %s\n", a->output, slash ? where : ".",
                strerror(errno));
        return 1;
    }
    BuildSummary sum;
    if (!make_binary(a, a->output, &sum)) return 1;
    print_wrote(a->output, &sum);
    return 0;
}

/* fp8c tune: the tuner (tune.c) builds through this, with extra choices on top of the
 * command's own; they join the cache key as --choice flags, as a user's would. */
static bool tune_build(void *ctx, const Choice *choices, int n, const char *out, int64_t *peak)
{
    const Args *a = ctx;
    Args *b = malloc(sizeof *b);
    if (!b) return false;
    *b = *a;
    b->build.choices = b->choices;
    b->flags = arena_alloc(session_arena(), sizeof(char *) * (size_t)(a->n_flags + 2 * n));
    memcpy(b->flags, a->flags, sizeof(char *) * (size_t)a->n_flags);
    for (int i = 0; i < n && b->n_choices < MAX_CHOICES; i++) {
        b->choices[b->n_choices++] = choices[i];
        b->flags[b->n_flags++] = "--choice";
        b->flags[b->n_flags++] = arena_printf(session_arena(), "%s=%s", choices[i].name, choices[i].value);
    }
    b->build.n_choices = b->n_choices;
    BuildSummary sum;
    bool ok = make_binary(b, out, &sum);
    if (ok && peak) *peak = sum.persistent + sum.transient;
    free(b);
    return ok;
}

static int cmd_tune(Args *a)
{
    if (!a->output && !a->list_candidates) bad_flag("tune needs -o FILE (the record)%s", "");
    if (a->output && a->list_candidates) bad_flag("tune --list-candidates writes no record (no -o)%s", "");
    if (!a->device) bad_flag("tune needs --device cuda or --device cpu%s", "");
    if (a->tune) bad_flag("tune makes a record; --tune reads one%s", "");
    Graph *g = compile_or_exit(session_arena(), a);
    int64_t chunks = 0, attentions = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        chunks += g->nodes[i]->op == OP_CROSS_ENTROPY;
        attentions += g->nodes[i]->op == OP_ATTENTION;
    }
    /* saving attention's output or rerunning the forward for it: a point where the level saves
     * activations in FP8 (passes/precision.c, attention_y_choice) */
    const PrecisionLevel *level = precision_level(g->opt_level);
    int y_default = attentions && level->fp8_saved ? level->attention_y_kept : -1;
    bool gpu = !strcmp(a->device, "cuda");
    TuneRequest q = {.model = a->model, .device = a->device, .output = a->output, .version = FP8C_VERSION,
                     .flags = a->flags, .n_flags = a->n_flags,
                     .budget_s = a->budget > 0 ? a->budget : TUNE_DEFAULT_BUDGET, .tolerance = 1e-2,
                     .memory_budget = a->memory_budget * 1073741824.0,
                     .steps = a->tune_steps ? a->tune_steps : gpu ? 12 : 6, .warmup = 2,
                     .tokens_per_step = g->batch * g->seq, .default_chunks = chunks,
                     .attention_y_default = y_default,
                     .attention_inputs_default = !level->attention_inputs_remade,
                     .cheap_default = !level->cheap_remade,
                     .weight_amax_default = level->weight_copies_per_use ? 1 : -1,
                     .state_bytes = g->persistent_bytes,
                     .build = tune_build, .ctx = a};
    return a->list_candidates ? tune_list_candidates(&q, stdout) : tune_run(&q);
}

/* fp8c train: the binary (cached as a build's is) in a temp directory, named after the model,
 * run with the flags after `--`, then removed. */
static int cmd_train(Args *a)
{
    if (!a->model) bad_flag("a model file is needed%s", "");
    char *dir = emit_train_dir();
    if (!dir) return 1;
    char *bin = emit_train_path(dir, "train");
    BuildSummary sum;
    if (!bin || !make_binary(a, bin, &sum)) {
        if (bin) unlink(bin);
        rmdir(dir);
        free(bin);
        free(dir);
        return 1;
    }
    char *named = emit_train_path(dir, sum.model_name);
    if (named && strcmp(named, bin) && rename(bin, named) == 0) {
        free(bin);
        bin = named;
    } else {
        free(named);
    }
    return emit_train_run(dir, bin, a->run_args, a->n_run_args);
}

static int dispatch(int argc, char **argv, Args *a);

int main(int argc, char **argv)
{
    static Args args;
    int status = dispatch(argc, argv, &args);
    tune_record_free(&args.record);
    arena_free(the_arena);
    /* plan's table and JSON, opt's IR, --print-* go to stdout: output lost to a full disk is an
     * error, not a status 0 over a truncated file */
    rt_set_program_name("fp8c");
    if (!rt_stdout_flush() && status == 0) status = 1;
    return status;
}

static int dispatch(int argc, char **argv, Args *ap)
{
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version")) {
        printf("fp8c %s\n", FP8C_VERSION);
        return 0;
    }
    if (!strcmp(cmd, "passes")) return cmd_passes();
    if (!strcmp(cmd, "recipes")) return cmd_recipes();
    Args *a = ap;
    parse_args(argc - 2, argv + 2, a);
    /* fp8c tune times one GPU, where a shard is the whole tensor: what it measures is the
     * unsharded step's, so a record is made without the flag and used with it */
    if (a->build.passes.shard_states && !strcmp(cmd, "tune"))
        bad_flag("--shard-states: fp8c tune times one GPU, where nothing is sharded; tune without it "
                 "and give the record to 'fp8c build --gpus N --shard-states%s --tune FILE'",
                 a->build.passes.shard_states == 3 ? "=3" : a->build.passes.shard_states == 2 ? "=2" : "");
    if (!strcmp(cmd, "tune")) return cmd_tune(a);
    if (a->memory_budget > 0 || a->budget > 0 || a->tune_steps || a->list_candidates)
        bad_flag("--budget, --memory-budget, --tune-steps and --list-candidates go with fp8c tune%s", "");
    if (!strcmp(cmd, "plan") || !strcmp(cmd, "build") || !strcmp(cmd, "train")) apply_tune_record(a);
    if (!strcmp(cmd, "plan")) return cmd_plan(a);
    if (!strcmp(cmd, "build")) return cmd_build(a);
    if (!strcmp(cmd, "train")) return cmd_train(a);
    if (!strcmp(cmd, "opt")) return cmd_opt(a);
    static const char *const commands[] = {"plan", "build", "train", "tune", "opt", "passes", "recipes", NULL};
    const char *near = rt_nearest_word(cmd, commands);
    fprintf(stderr, "fp8c: error: unknown command '%s'%s%s%s (plan, build, train, tune, opt, passes, "
                    "recipes)\n", cmd, near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
    return 2;
}
