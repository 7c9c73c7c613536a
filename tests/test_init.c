/* test_init.c — the initial training state: the same bytes on any number of threads.
 *
 * rt_init_params splits every pass over a parameter or a state across the threads: the normal
 * draws, the conversions into each format, the split masters, the codec-encoded Adam moments,
 * the first FP8 weight copies and their amax, the clearing of states. Each pass is cut into
 * ranges fixed by the tensor alone, and a range's bytes depend on nothing else, so the thread
 * count may change the time and nothing more. Here a model is compiled, bound and made on one
 * thread, then again on two and on three: every byte of the persistent arena (which is what a
 * checkpoint holds) equal. The models are gpt2_tiny widened (its MLP weights are 1280 x 320,
 * several ranges of every pass with a short last one, its states a few MiB) and a two-layer
 * Llama (no biases, RMSNorm, grouped heads, an untied head), at -O1 (bf16 weights, f32
 * masters, FP8 copies) and -O3 (split masters, companded moments).
 *
 * A control that the comparison sees the state: another seed changes the bytes. And the Adam
 * moments of the group codecs (-O2, -O3), which are not encoded element by element: zeros, in
 * the codes ref_store gives zeros.
 *
 * The seed is printed; FP8C_TEST_SEED=n repeats a run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "compiler.h"
#include "rt.h"
#include "test_state.h"

static unsigned seed;

static Graph *compile(Arena *a, const char *model, int level, const Define *defines, int n_defines)
{
    BuildOptions o = {0};
    o.front.batch = 2;
    o.front.seq = 32;
    o.front.defines = defines;
    o.front.n_defines = n_defines;
    o.passes.opt_level = level;
    o.passes.verify = true;
    Graph *g = pipeline_compile(a, model, &o);
    assert_non_null(g);
    return g;
}

/* The persistent arena after rt_init_params(g, s) on `threads` threads, copied out. */
static uint8_t *state_made(Graph *g, uint64_t s, int threads, int64_t *bytes)
{
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    ref_set_threads(threads);
    rt_init_params(g, s);
    *bytes = mem.persistent_bytes;
    uint8_t *copy = malloc((size_t)(*bytes ? *bytes : 1));
    assert_non_null(copy);
    memcpy(copy, mem.persistent, (size_t)*bytes);
    rt_memory_free(&mem);
    return copy;
}

static void check_threads(const char *model, int level, const Define *defines, int n_defines)
{
    Arena *a = arena_new();
    Graph *g = compile(a, model, level, defines, n_defines);
    int saved = ref_threads();
    int64_t bytes = 0, other = 0;
    uint8_t *one = state_made(g, seed, 1, &bytes);
    for (int threads = 2; threads <= 3; threads++) {
        uint8_t *many = state_made(g, seed, threads, &other);
        assert_int_equal(other, bytes);
        const char *bad = state_where_differs(g, one, many, bytes);
        if (bad) fail_msg("%s -O%d: '%s' differs between 1 and %d threads", model, level, bad, threads);
        free(many);
    }
    uint8_t *reseeded = state_made(g, (uint64_t)seed + 1, 3, &other);
    assert_non_null(state_where_differs(g, one, reseeded, bytes));
    free(reseeded);
    free(one);
    ref_set_threads(saved);
    arena_free(a);
}

/* The Adam moments that a group codec holds (-O2's range expansion, -O3's companding and
 * square roots), which rt_init_params does not encode element by element: codes of zero, the
 * codes ref_store gives zeros, and every value decoded exactly 0. */
static void check_codec_zeros(const char *model, int level, const Define *defines, int n_defines)
{
    Arena *a = arena_new();
    Graph *g = compile(a, model, level, defines, n_defines);
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    rt_init_params(g, seed);
    int checked = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *s = g->nodes[i];
        Codec c = s->t.fmt.codec;
        if (s->op != OP_STATE || c == CODEC_PLAIN || c == CODEC_SPLIT || s->t.role == ROLE_SCALE) continue;
        const char *name = s->t.name ? s->t.name : "unnamed";
        int64_t n = ir_numel(&s->t), code_bytes = n * fmt_elem_bytes(codec_elem(c));
        float *x = ref_load(&s->t);
        for (int64_t k = 0; k < n; k++)
            if (x[k] != 0.0f) fail_msg("%s -O%d: '%s' decodes to %g at %lld", model, level, name, x[k], (long long)k);
        free(x);
        /* the codes as ref_store makes them of zeros (its side values are rewritten: the scale
         * tensor's own initial value comes after in the graph) */
        uint8_t *codes = malloc((size_t)code_bytes);
        float *zeros = calloc((size_t)n, sizeof *zeros);
        assert_true(codes && zeros);
        memcpy(codes, s->t.data, (size_t)code_bytes);
        memset(s->t.data, 0x55, (size_t)code_bytes);
        ref_store(&s->t, zeros);
        if (memcmp(codes, s->t.data, (size_t)code_bytes))
            fail_msg("%s -O%d: '%s' (codec %s): codes not ref_store's of zeros", model, level, name, fmt_codec_name(c));
        free(codes), free(zeros);
        checked++;
    }
    assert_true(checked >= 2);   /* both moments of at least one weight */
    rt_memory_free(&mem);
    arena_free(a);
}

static const Define wide_gpt2[] = {{"layers", "2"}, {"dim", "320"}, {"heads", "5"}};
static const Define small_llama[] = {{"layers", "2"}, {"dim", "256"}, {"heads", "4"}, {"kv_heads", "2"},
                                     {"hidden", "704"}, {"vocab", "1000"}};

static void test_gpt2_o1(void **state)
{
    (void)state;
    check_threads(FP8C_SOURCE_DIR "/models/gpt2_tiny.model", 1, wide_gpt2, 3);
}

static void test_gpt2_o3(void **state)
{
    (void)state;
    check_threads(FP8C_SOURCE_DIR "/models/gpt2_tiny.model", 3, wide_gpt2, 3);
}

static void test_llama_o1(void **state)
{
    (void)state;
    check_threads(FP8C_SOURCE_DIR "/models/llama.model", 1, small_llama, 6);
}

static void test_llama_o3(void **state)
{
    (void)state;
    check_threads(FP8C_SOURCE_DIR "/models/llama.model", 3, small_llama, 6);
}

static void test_gpt2_o2(void **state)
{
    (void)state;
    check_threads(FP8C_SOURCE_DIR "/models/gpt2_tiny.model", 2, wide_gpt2, 3);
}

static void test_codec_zeros(void **state)
{
    (void)state;
    check_codec_zeros(FP8C_SOURCE_DIR "/models/gpt2_tiny.model", 2, wide_gpt2, 3);
    check_codec_zeros(FP8C_SOURCE_DIR "/models/gpt2_tiny.model", 3, wide_gpt2, 3);
}

int main(void)
{
    const char *env = getenv("FP8C_TEST_SEED");
    seed = env && *env ? (unsigned)strtoul(env, NULL, 10) : (unsigned)time(NULL) ^ (unsigned)getpid();
    printf("test_init: seed %u\n", seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpt2_o1),
        cmocka_unit_test(test_gpt2_o2),
        cmocka_unit_test(test_gpt2_o3),
        cmocka_unit_test(test_llama_o1),
        cmocka_unit_test(test_llama_o3),
        cmocka_unit_test(test_codec_zeros),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
