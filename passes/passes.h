/* passes.h — the passes over the IR, one file each, listed in passes.def.
 *
 * A pass is a function Graph -> Graph that rewrites the graph in place (or only analyses it)
 * and returns false after reporting a user error through diag_error. ir_verify runs after
 * every pass in debug builds (pass_run). */
#ifndef FP8C_PASSES_H
#define FP8C_PASSES_H

#include "ir.h"

/* What the user asked for, as the passes see it. */
typedef struct {
    int opt_level;              /* 0..3 */
    const char *policy_file;    /* precision overrides (precision.c), NULL if none */
    const char **overrides;     /* "pattern=format" strings from the command line */
    int n_overrides;
    const struct NamedRecipe *recipe; /* --recipe: its rules go before the policy file's and the
                                   command line's, which win over them; NULL if none */
    bool grad_release;          /* O3: release gradients as soon as their update ran */
    const char *optimizer;      /* --optimizer: adamw, lion or sgd in place of the model's
                                   optimizer clause (optimizer.c); NULL: the clause's */
    bool nesterov;              /* --nesterov: SGD with Nesterov momentum */
    int gpus;                   /* data parallel over this many GPUs (comm.c); 0 or 1: one */
    int shard_states;           /* --shard-states[=1|2|3] (comm.c): 0 off; 1 ZeRO stage 1, each
                                   GPU keeps 1/N of the masters and optimizer states; 2 stage 2,
                                   the gradient accumulators too; 3 stage 3, the GEMMs' weights
                                   too, gathered per layer (runtime/comm_weights.c; plan only) */
    bool verify;                /* run ir_verify after every pass */
    bool fp8_any_shape;         /* keep FP8 GEMMs whose K or N is not a multiple of 16, which
                                   cuBLASLt cannot run (the reference and CPU can): for tests
                                   of the FP8 passes on small graphs */
    const char *print_after;    /* pass name, "all", or NULL */
    void (*print_groups)(const Graph *g, FILE *out);   /* the fuse pass's report of the kernel
                                   groups (codegen's fuse_print, set by the compiler, which
                                   sits above both); NULL: none */
} PassOptions;

typedef bool (*PassFn)(Graph *g, const PassOptions *opt);

#define X(name, fn, requires, summary) bool fn(Graph *g, const PassOptions *opt);
#include "passes.def"
#undef X

typedef struct {
    const char *name;
    PassFn fn;
    const char *requires;
    const char *summary;
} PassInfo;

const PassInfo *pass_find(const char *name);          /* NULL if unknown */
const PassInfo *pass_table(int *count);
/* Runs one pass by name, then ir_verify (if opt->verify) and --print-ir-after. */
bool pass_run(Graph *g, const PassInfo *p, const PassOptions *opt);

/* ---------------------------------------------------------------- precision.c */

/* What an -O level means: the formats it gives persistent state and what it keeps in FP8.
 * This table is the only reader of the level's number; a pass that depends on the level asks
 * it for the property (precision_level(g->opt_level)->weight_copies_per_use). */
typedef struct {
    ElemType param, grad, master;   /* parameters, gradient accumulators, master copies */
    Codec master_codec;             /* CODEC_SPLIT: bf16 parameter + i8 rounding error */
    Format adam_m, adam_v;          /* Adam's moments (element type, codec, groups) */
    bool fp8_gemms;                 /* GEMM operands in FP8 (all but the loss head) */
    bool fp8_saved;                 /* saved activations in FP8 (COAT's mixed granularity) */
    bool weight_copies_per_use;     /* no FP8 weight copy kept across the step: quantized at
                                     * every use, and no copy written by the update */
    bool attention_y_kept;          /* with fp8_saved: attention's result saved as itself, with
                                     * its row statistics, so the backward does not rerun the
                                     * forward (FlashAttention's saved output, as COAT keeps it) */
    bool attention_inputs_remade;   /* attention's q, k, v not saved: the backward makes them
                                     * again with their GEMMs (passes/recompute.c) */
    bool cheap_remade;              /* norms' and elementwise ops' outputs not saved: the
                                     * backward makes them again (passes/recompute.c) */
    bool activations_remade;        /* an activation that the backward reads only in
                                     * elementwise products (SwiGLU's silu(gate)) not saved:
                                     * the products make it from its input's saved copy */
} PrecisionLevel;
enum { PRECISION_LEVELS = 4 };      /* -O0..-O3 */
const PrecisionLevel *precision_level(int opt_level);
/* Whether attention's q, k, v are saved for the backward: the choice save.attention_inputs,
 * else the level's default (not at -O3, whose backward makes them again). */
bool precision_attention_inputs_saved(const Graph *g);
/* Whether norms' and elementwise ops' outputs that the backward reads are saved: the choice
 * save.cheap, else the level's default (not at -O0, whose backward makes them again). */
bool precision_cheap_saved(const Graph *g);
/* Whether a GELU's or SiLU's output that the backward reads only in elementwise products is
 * saved: the choice save.activations, else the level's default (not at -O2 and -O3). */
bool precision_activations_saved(const Graph *g);


/* Which of a linear layer's three GEMMs mm is, and the name gemm: rules match it by (its
 * weight's; for a weight gradient, the parameter it is the gradient of): "fwd", "dgrad" or
 * "wgrad". uses: ir_fill_uses of mm's graph. */
const char *precision_gemm_kind(const Node *mm, const Uses *uses, const char **weight);
/* A recipe by the name other systems give it (docs/recipes.md): a level to build on and
 * precision rules, applied before the user's own (later rules win). */
#define RECIPE_MAX_RULES 6
typedef struct NamedRecipe {
    const char *name;
    int level;                  /* the -O it builds on when none is given */
    bool level_fixed;           /* its states are that level's: another -O contradicts it */
    const char *rules[RECIPE_MAX_RULES];
    const char *what;           /* whose setting it is, in a line */
    const char *refused;        /* why fp8c cannot run it as that system does; NULL: it can */
} NamedRecipe;
const NamedRecipe *precision_recipes(int *n);
const NamedRecipe *precision_find_recipe(const char *name);     /* NULL: no recipe of that name */
/* The element type the comm:grad rule of opt's rules asks the gradient sums to travel in
 * (FMT_E5M2, FMT_E4M3), FMT_VOID without one; text and loc (may be NULL): the rule, for
 * diagnostics. False after reporting a bad rule. */
bool precision_comm_rule(Arena *a, const PassOptions *opt, ElemType *wire, const char **text, SrcLoc *loc);
/* cuBLASLt runs FP8 GEMMs whose K and N are multiples of this; others are planned in bf16 */
#define PRECISION_FP8_GEMM_ALIGN 16

/* ---------------------------------------------------------------- memplan.c */

/* The memory plan's totals per role (bytes), for `fp8c plan` and the runtime. */
typedef struct {
    int64_t by_role[ROLE_COUNT];
    int64_t persistent;         /* size of the persistent arena */
    int64_t transient;          /* size of the step arena (its peak of live bytes) */
    int64_t n_params;           /* parameter elements */
} MemSummary;
void memplan_summarize(const Graph *g, MemSummary *out);
/* The node whose storage n's result shares, or NULL when n has storage of its own: the
 * result of an in-place op with a value (ACCUMULATE, AMAX_RECORD, DELAYED_SCALE) is the
 * operand it updates; a RESHAPE of an unscaled tensor into the same element type and memory
 * class is a view of its input (an executor sees in and out at the same address and has
 * nothing to copy). schedule and memplan agree through this. */
Node *memplan_alias_of(const Node *n);

#endif
