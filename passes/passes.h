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
    bool grad_release;          /* O3: release gradients as soon as their update ran */
    bool verify;                /* run ir_verify after every pass */
    const char *print_after;    /* pass name, "all", or NULL */
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
