/* arenas.c — the plan's two arenas in host memory, every tensor bound to its offset.
 *
 * The memory plan gave every tensor of the step an offset in one of two arenas: the persistent
 * one (parameters, accumulators, optimizer states, scales, which checkpoints hold) and the step
 * one (everything a step makes and drops). The runtime makes exactly these two allocations and
 * points each tensor's data at its offset; a GPU run keeps them as the host mirror of its device
 * arenas. Their sizes are checked against the plan's own tensors before anything is touched. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rt.h"

int64_t rt_storage_bytes(const Node *n) {
    int64_t need = ir_storage_bytes(n);
    return n->t.bytes > need ? n->t.bytes : need;
}

bool rt_has_storage(const Node *n) {
    return n->t.fmt.elem != FMT_VOID && !ir_op_is_inplace(n->op);
}

/* An arena is anonymous memory straight from the kernel: zero-filled (persistent states start
 * at zero; steps stay repeatable) and page-aligned, with pages made only when first touched.
 * A GPU run touches little of its host mirror, so a 1.5B-parameter model does not spend its
 * first minute having tens of GiB zeroed that it never reads. */
static void *arenas_alloc(int64_t bytes, const char *which, size_t *mapped) {
    size_t size = (size_t)((bytes + 4095) / 4096 * 4096);
    if (!size) size = 4096;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        rt_error("cannot allocate the %s arena: the plan needs %lld bytes (%.1f MiB)", which,
                 (long long)bytes, (double)bytes / (1 << 20));
        return NULL;
    }
    *mapped = size;
    return p;
}

bool rt_memory_bind(Graph *g, RtMemory *m) {
    memset(m, 0, sizeof *m);
    /* An artifact built without memplan has no offsets at all; then every tensor gets its own
     * slice (no reuse). A plan that places some tensors but not others is broken. */
    int placed = 0, unplaced = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (!rt_has_storage(n)) continue;
        if (n->t.offset >= 0) placed++;
        else unplaced++;
    }
    if (placed && unplaced) {
        for (int i = 0; i < g->n_nodes; i++) {
            Node *n = g->nodes[i];
            if (rt_has_storage(n) && n->t.offset < 0) {
                rt_error("artifact: tensor %%%d%s%s has no place in the memory plan", n->id,
                         n->t.name ? " " : "", n->t.name ? n->t.name : "");
                return false;
            }
        }
    }
    if (!placed && unplaced) {
        int64_t at[2] = {0, 0};
        for (int i = 0; i < g->n_nodes; i++) {
            Node *n = g->nodes[i];
            if (!rt_has_storage(n)) continue;
            int k = ir_role_is_persistent(n->t.role) ? 0 : 1;
            n->t.offset = at[k];
            at[k] += (rt_storage_bytes(n) + 63) / 64 * 64;
        }
        g->persistent_bytes = at[0];
        g->transient_bytes = at[1];
        rt_note("artifact has no memory plan: every tensor gets its own buffer (%lld + %lld bytes)",
                (long long)at[0], (long long)at[1]);
    }
    m->persistent_bytes = g->persistent_bytes;
    m->step_bytes = g->transient_bytes;
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (!rt_has_storage(n)) continue;
        int64_t size = ir_role_is_persistent(n->t.role) ? m->persistent_bytes : m->step_bytes;
        int64_t end = n->t.offset + rt_storage_bytes(n);
        if (end > size) {
            rt_error("artifact: tensor %%%d%s%s ends at byte %lld of its arena, which the plan "
                     "sizes at %lld bytes", n->id, n->t.name ? " " : "",
                     n->t.name ? n->t.name : "", (long long)end, (long long)size);
            return false;
        }
    }
    /* Linux overcommits: a plan larger than the machine would "allocate" and then be killed
     * while the arenas are zeroed. Say so before trying. */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    int64_t total = m->persistent_bytes + m->step_bytes;
    if (pages > 0 && page > 0 && total > (int64_t)pages * page) {
        rt_error("the plan needs %lld bytes (persistent %lld + step %lld), more than this "
                 "machine's %lld bytes of memory", (long long)total,
                 (long long)m->persistent_bytes, (long long)m->step_bytes,
                 (long long)pages * page);
        return false;
    }
    m->persistent = arenas_alloc(m->persistent_bytes, "persistent", &m->persistent_mapped);
    m->step = m->persistent ? arenas_alloc(m->step_bytes, "step", &m->step_mapped) : NULL;
    if (!m->step) {
        rt_memory_free(m);
        return false;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->t.fmt.elem == FMT_VOID)
            n->t.data = NULL;
        else if (ir_op_is_inplace(n->op))
            n->t.data = n->in[0]->t.data;   /* the result is its accumulator */
        else
            n->t.data = (char *)(ir_role_is_persistent(n->t.role) ? m->persistent : m->step) +
                        n->t.offset;
    }
    return true;
}

void rt_memory_free(RtMemory *m) {
    if (m->persistent) munmap(m->persistent, m->persistent_mapped);
    if (m->step) munmap(m->step, m->step_mapped);
    memset(m, 0, sizeof *m);
}

