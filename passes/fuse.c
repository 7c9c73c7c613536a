/* fuse.c — the `fuse` pass: reports the kernel groups.
 *
 * Which nodes run together as one kernel is codegen's decision (codegen/fuse.c): the lowering
 * and the GPU plans read it, and it rests on the op classes the lowering can compute inline.
 * The grouping is a pure function of the planned graph, recomputed wherever it is needed, so
 * nothing is stored here; the pass stays in the pipeline, last, for two reasons: it numbers
 * the nodes in schedule order (what the groups are indexed by), and `--print-ir-after=fuse`
 * and `--stop-after=fuse` name the point where the graph is complete.
 *
 * The passes sit below codegen and never call up into it: the report comes through
 * PassOptions.print_groups, which the compiler (a layer above both) sets to codegen's
 * fuse_print. Without it (a test running the pass alone) the pass prints nothing. */
#include "passes.h"

#include <string.h>

bool pass_fuse(Graph *g, const PassOptions *opt)
{
    ir_renumber(g);
    if (opt && opt->print_groups && opt->print_after &&
        (!strcmp(opt->print_after, "fuse") || !strcmp(opt->print_after, "all")))
        opt->print_groups(g, stdout);
    return true;
}
