/* test_shard_layout.c — the device arena of --shard-states (cuda/exec_shard.c), without a GPU.
 *
 * The sharded step keeps the host mirror whole and cuts the other ranks' shards of the masters,
 * optimizer states and codec side values out of the device's persistent arena. The layout is
 * computed from the graph and the host mirror alone, so it is checked here, with no driver, on
 * the sharded test graphs of gpt2_tiny (-O1, -O2, -O3) for 2 and 3 ranks, every rank:
 *   - every sharded tensor has on the device exactly its rank's range (rt_shard_of's elements,
 *     the codec's side values of its groups), contiguous, at an address with the host offset's
 *     alignment modulo 256 (the kernels' vector paths see the same alignment as unsharded);
 *   - every byte of the host arena that is not another rank's shard is on the device, each
 *     piece inside the allocation;
 *   - rank 0 cuts exactly what the plan says it saves (rt_shard_plan), and the alignment
 *     costs less than 512 bytes a kept run.
 * What the layout cannot show (the update kernels over their shards, the collectives) is
 * test_gpu_comm's, on two GPUs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "exec_internal.h"
#include "passes.h"

#ifndef GPU_IR_DIR
#define GPU_IR_DIR "."
#endif

static Graph *load_graph(Arena *arena, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.ir", GPU_IR_DIR, name);
    int64_t size;
    uint8_t *bytes = rt_read_file(path, &size);
    char *text = bytes ? malloc((size_t)size + 1) : NULL;
    if (!text) {
        free(bytes);
        return NULL;
    }
    memcpy(text, bytes, (size_t)size);
    text[size] = 0;
    free(bytes);
    Graph *g = ir_read(arena, path, text);
    free(text);
    return g;
}

typedef struct {
    int64_t bytes, outside;
} Pieces;

static bool count_piece(CudaExec *e, char *host, CUdeviceptr dev, int64_t bytes, void *ctx) {
    (void)host;
    Pieces *p = ctx;
    p->bytes += bytes;
    p->outside += dev < e->persistent || dev + (CUdeviceptr)bytes > e->persistent + (CUdeviceptr)e->persistent_alloc;
    return true;
}

static void check_graph(const char *name) {
    Arena *arena = arena_new();
    Graph *g = load_graph(arena, name);
    assert_non_null(g);
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    MemSummary m;
    memplan_summarize(g, &m);
    for (int world = 2; world <= 3; world++) {
        RtShardPlan sp;
        rt_shard_plan(g, m.by_role, world, &sp);
        for (int rank = 0; rank < world; rank++) {
            CudaExec *e = calloc(1, sizeof *e);
            assert_non_null(e);
            e->g = g;
            e->host = mem;
            int64_t dev = exec_shard_layout(e, world, rank);
            assert_true(e->shard && dev > 0);
            e->persistent = (CUdeviceptr)1 << 40;   /* any 256-aligned base: nothing is dereferenced */
            e->persistent_alloc = dev;
            int64_t wrong = 0;
            for (int i = 0; i < e->n_shard_tensors; i++) {
                const ExecShardTensor *t = &e->shard_tensors[i];
                const ExecShardUpdate *u = &e->shard_updates[t->update];
                RtShard s = rt_shard_of(u->n, u->group, world, rank);
                int64_t lo = t->codec ? codec_param_count(t->codec, s.off) * 4 : s.off * t->eb;
                int64_t hi = t->codec ? codec_param_count(t->codec, s.off + s.len) * 4 : (s.off + s.len) * t->eb;
                Pieces p = {0, 0};
                assert_true(exec_pieces(e, "a state", (char *)mem.persistent + t->at, t->bytes, count_piece, &p));
                wrong += p.bytes != hi - lo || p.outside;
                if (hi > lo) {
                    CUdeviceptr d0 = exec_shard_map(e, t->at + lo), d1 = exec_shard_map(e, t->at + hi - 1);
                    wrong += d1 - d0 != (CUdeviceptr)(hi - lo - 1);
                    wrong += (int64_t)((d0 - e->persistent) % 256) != (t->at + lo) % 256;
                }
            }
            Pieces all = {0, 0};
            assert_true(exec_pieces(e, "the arena", mem.persistent, mem.persistent_bytes, count_piece, &all));
            int64_t cut = mem.persistent_bytes - all.bytes, pad = dev - all.bytes;
            printf("  %s, rank %d of %d: %d sharded tensors in %d kept runs; %lld of %lld bytes on the device "
                   "(%lld cut, the plan's rank 0 saves %lld; %lld of alignment)\n",
                   name, rank, world, e->n_shard_tensors, e->n_shard_segs, (long long)dev,
                   (long long)mem.persistent_bytes, (long long)cut, (long long)sp.saved, (long long)pad);
            assert_int_equal(wrong, 0);
            assert_int_equal(all.outside, 0);
            if (rank == 0) assert_int_equal(cut, sp.saved);
            assert_true(pad >= 0 && pad < 512 * (int64_t)e->n_shard_segs);
            exec_shard_close(e);
            free(e);
        }
    }
    rt_memory_free(&mem);
    arena_free(arena);
}

static void test_layout(void **state) {
    (void)state;
    check_graph("gpt2_tiny_zero_O1");
    check_graph("gpt2_tiny_zero_O2");
    check_graph("gpt2_tiny_zero_O3");
}

/* Without --shard-states, or on one rank, the device arena is the host's. */
static void test_unsharded(void **state) {
    (void)state;
    Arena *arena = arena_new();
    const char *names[] = {"gpt2_tiny_dp_O1", "gpt2_tiny_zero_O1"};
    for (int k = 0; k < 2; k++) {
        Graph *g = load_graph(arena, names[k]);
        assert_non_null(g);
        RtMemory mem;
        assert_true(rt_memory_bind(g, &mem));
        CudaExec *e = calloc(1, sizeof *e);
        e->g = g;
        e->host = mem;
        assert_int_equal(exec_shard_layout(e, k ? 1 : 2, 0), mem.persistent_bytes);
        assert_false(e->shard);
        exec_shard_close(e);
        free(e);
        rt_memory_free(&mem);
    }
    arena_free(arena);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_layout), cmocka_unit_test(test_unsharded)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
