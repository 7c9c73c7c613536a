/* test_state.h — where two persistent arenas of one plan part: the tensor that holds their
 * first differing byte, so that a test comparing training states bit for bit (threads,
 * shards) names what moved rather than an offset. */
#ifndef FP8C_TEST_STATE_H
#define FP8C_TEST_STATE_H

#include <stdint.h>

#include "rt.h"

/* The tensor that holds the first byte where a and b differ, or NULL when none does. */
static inline const char *state_where_differs(const Graph *g, const uint8_t *a, const uint8_t *b, int64_t bytes)
{
    int64_t at = -1;
    for (int64_t k = 0; k < bytes && at < 0; k++)
        if (a[k] != b[k]) at = k;
    if (at < 0) return NULL;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (ir_role_is_persistent(n->t.role) && n->t.offset >= 0 && at >= n->t.offset &&
            at < n->t.offset + rt_storage_bytes(n))
            return n->t.name ? n->t.name : ir_role_name(n->t.role);
    }
    return "(padding)";
}

#endif
