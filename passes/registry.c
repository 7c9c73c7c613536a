/* registry.c — the table of passes and the one way to run a pass.
 *
 * passes.def lists every pass once (name, function, what it requires). The pipeline,
 * `fp8c opt --passes=a,b` and the golden tests all go through pass_run, so that the checks
 * that follow a pass (ir_verify, --print-ir-after) cannot be forgotten by one caller: a pass
 * that breaks an invariant is caught right after it ran, by name. */
#include "passes.h"

#include <string.h>

static const PassInfo pass_infos[] = {
#define X(name, fn, requires, summary) {#name, fn, requires, summary},
#include "passes.def"
#undef X
};

enum { PASS_COUNT = (int)(sizeof pass_infos / sizeof pass_infos[0]) };

const PassInfo *pass_find(const char *name)
{
    for (int i = 0; i < PASS_COUNT; i++)
        if (strcmp(pass_infos[i].name, name) == 0) return &pass_infos[i];
    return NULL;
}

const PassInfo *pass_table(int *count)
{
    if (count) *count = PASS_COUNT;
    return pass_infos;
}

/* A pass that returns false has reported a user error. A graph that fails verification after a
 * pass is a compiler bug in that pass; it is reported and returned as a failure rather than
 * aborted, and still printed when asked, so that `fp8c opt` shows what the pass produced. */
bool pass_run(Graph *g, const PassInfo *p, const PassOptions *opt)
{
    static const PassOptions defaults = {0};
    if (!opt) opt = &defaults;
    if (!p->fn(g, opt)) return false;
    bool good = !opt->verify || ir_verify(g, p->name) == 0;
    if (opt->print_after &&
        (strcmp(opt->print_after, "all") == 0 || strcmp(opt->print_after, p->name) == 0)) {
        printf("# IR after %s\n", p->name);
        ir_print(g, stdout);
        fflush(stdout);
    }
    return good;
}
