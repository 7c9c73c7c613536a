/* init.c — initial values of parameters and persistent state.
 *
 * A parameter's initial values must not depend on anything but the seed and the parameter
 * itself: not on node order (passes reorder), not on the thread count, not on which other
 * parameters exist (a model with one more layer keeps the first layers' values). So each
 * value is a pure function of (seed, hash of the parameter's name, element index): element i
 * of a parameter takes outputs 2i and 2i+1 of a SplitMix64 stream whose start is keyed by the
 * seed and the name, and turns them into one normal value by Box-Muller. A counter-based
 * generator like this needs no state between elements, so the work splits across threads
 * freely.
 *
 * Values go through ref_store, so a bf16 parameter holds the rounded value; its f32 master
 * copy, when the optimizer made one, holds the unrounded value the parameter was rounded from.
 * Other persistent state starts at zero (gradient accumulators, Adam moments, amax histories),
 * except scale tensors, which start at 1: a zero scale would make every read of the scaled
 * tensor infinite before its first amax is known. A weight's FP8 copy that its update writes
 * for the next step is made once here, from the initial weights, with current scaling.
 *
 * Every pass over a parameter or a state runs on the threads, not the draws alone: the
 * stores into each format, the split masters, the codec states, the copies and their amax,
 * the clearing. Left serial, they were most of the set-up on a many-core host once the draws
 * were split: GPT-2 d12 at -O3 spent 3.9 s in them on one thread against 5.5 s of draws, which
 * sixteen threads take in a third of a second. Each is cut into ranges fixed by the tensor, so
 * the bytes do not depend on the thread count (tests/test_init.c).
 *
 * Weights that come from a file (--init: Hugging Face weights, another run's checkpoint) take
 * the same path with the file's values in place of the generator's, so masters, FP8 copies and
 * every format are derived from them exactly as from random ones. */
#include "ref_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { INIT_NORMAL = 0, INIT_ZEROS = 1, INIT_ONES = 2 };
enum { INIT_CHUNK = 1 << 14 };

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* FNV-1a: names are short, the hash only needs to be stable and spread by splitmix64 */
static uint64_t hash_name(const char *s)
{
    uint64_t h = 0xCBF29CE484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001B3ull;
    return h;
}

typedef struct {
    uint64_t key;
    double std;
    float *x;
} InitJob;

static void init_normal_range(void *ctx, int64_t lo, int64_t hi)
{
    InitJob *j = ctx;
    const double two_pi = 6.283185307179586, ulp53 = 1.0 / 9007199254740992.0;
    for (int64_t i = lo; i < hi; i++) {
        /* the stream seeded at key, positions 2i and 2i+1: splitmix64 adds its own step */
        uint64_t r1 = splitmix64(j->key + (uint64_t)(2 * i) * 0x9E3779B97F4A7C15ull);
        uint64_t r2 = splitmix64(j->key + (uint64_t)(2 * i + 1) * 0x9E3779B97F4A7C15ull);
        double u1 = ((double)(r1 >> 11) + 1.0) * ulp53;   /* (0, 1]: log stays finite */
        double u2 = (double)(r2 >> 11) * ulp53;
        j->x[i] = (float)(j->std * sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
    }
}

typedef struct {
    float value, *x;
} FillJob;

static void fill_range(void *ctx, int64_t lo, int64_t hi)
{
    const FillJob *j = ctx;
    for (int64_t i = lo; i < hi; i++) j->x[i] = j->value;
}

static void fill_values(float *x, int64_t n, float value)
{
    FillJob j = {.value = value, .x = x};
    ref_parallel_ranges(n, INIT_CHUNK, fill_range, &j);
}

static float *alloc_values(int64_t n)
{
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    IR_ASSERT(x);
    return x;
}

static void fill_param(const Node *p, uint64_t seed, float *x, int64_t n)
{
    switch (IR_IATTR(p, PARAM, init)) {
    case INIT_NORMAL: {
        /* unnamed parameters (hand-built graphs) fall back to their stable id */
        uint64_t h = p->t.name ? hash_name(p->t.name) : splitmix64((uint64_t)p->id);
        InitJob j = {.key = splitmix64(seed ^ splitmix64(h)), .std = IR_FATTR(p, PARAM, std), .x = x};
        ref_parallel_ranges(n, INIT_CHUNK, init_normal_range, &j);
        break;
    }
    case INIT_ZEROS:
    case INIT_ONES:
        fill_values(x, n, IR_IATTR(p, PARAM, init) == INIT_ONES ? 1.0f : 0.0f);
        break;
    default:
        ir_die(__FILE__, __LINE__, "parameter '%s': unknown init %lld",
               p->t.name ? p->t.name : "unnamed", (long long)IR_IATTR(p, PARAM, init));
    }
}

/* Zero bytes, writing only the pages that are not zero already: a fresh arena is untouched
 * anonymous memory, and writing its Adam moments would make the kernel build gigabytes of
 * pages that reading leaves shared. Reading them still costs a fault per page (of the shared
 * zero page), so the pages are read on every thread. */
enum { CLEAR_PAGE = 4096, CLEAR_CHUNK = 256 * CLEAR_PAGE };

static void clear_range(void *ctx, int64_t lo, int64_t hi)
{
    static const unsigned char zeros[CLEAR_PAGE];
    unsigned char *p = ctx;
    for (int64_t at = lo; at < hi; at += CLEAR_PAGE) {
        size_t len = (size_t)(hi - at < CLEAR_PAGE ? hi - at : CLEAR_PAGE);
        if (memcmp(p + at, zeros, len)) memset(p + at, 0, len);
    }
}

static void clear_bytes(unsigned char *p, int64_t n)
{
    ref_parallel_ranges(n, CLEAR_CHUNK, clear_range, p);
}

/* A state of a group codec (Adam's moments at -O2 and -O3) holding zeros, with the bytes that
 * ref_store of zeros gives it, without encoding each element: the codec encodes each group on
 * its own, so every whole group of zeros has the codes and side values of one, and only a
 * shorter last group may differ. The codes go through clear_bytes where they are zero bytes
 * (they are, for every codec: zero maps to code 0), the side values are copied group by group.
 * Encoding GPT-2 d12's -O2 moments element by element took a quarter of its set-up. False,
 * with nothing stored, for a codec whose zero is not code 0: the caller encodes each element. */
typedef struct {
    float *p;                   /* the side values */
    const float *one;           /* those of a whole group of zeros */
    int per_group;
} ParamsJob;

static void params_range(void *ctx, int64_t lo, int64_t hi)
{
    const ParamsJob *j = ctx;
    for (int64_t k = lo; k < hi; k++) memcpy(j->p + k * j->per_group, j->one, sizeof *j->one * (size_t)j->per_group);
}

static bool store_codec_zeros(Tensor *t)
{
    Codec c = t->fmt.codec;
    int g = codec_group_size(c), np = codec_params_per_group(c);
    int64_t n = ir_numel(t), eb = fmt_elem_bytes(codec_elem(c)), groups = (n + g - 1) / g;
    Tensor *pt = t->fmt.scale ? &t->fmt.scale->t : NULL;
    IR_ASSERT(pt && pt->fmt.elem == FMT_F32 && ir_numel(pt) == codec_param_count(c, n) && g > 0 && np > 0);
    float *zeros = calloc((size_t)g, sizeof *zeros), *one = malloc(sizeof *one * (size_t)np),
          *last = malloc(sizeof *last * (size_t)np);
    unsigned char *codes = malloc((size_t)(g * eb));
    IR_ASSERT(zeros && one && last && codes);
    bool zero_codes = true;
    codec_encode(c, zeros, codes, one, g);
    for (int64_t i = 0; i < g * eb; i++) zero_codes &= codes[i] == 0;
    int64_t tail = n - (groups - 1) * g;   /* the last group's elements */
    codec_encode(c, zeros, codes, last, (int)tail);
    for (int64_t i = 0; i < tail * eb; i++) zero_codes &= codes[i] == 0;
    if (zero_codes) {
        clear_bytes(t->data, n * eb);
        ParamsJob j = {.p = pt->data, .one = one, .per_group = np};
        ref_parallel_ranges(groups - 1, INIT_CHUNK, params_range, &j);
        memcpy((float *)pt->data + (groups - 1) * np, last, sizeof *last * (size_t)np);
    }
    free(zeros), free(one), free(last), free(codes);
    return zero_codes;
}

/* A split master from a value read from a file. Such a value is often itself a split master's
 * decoded hi + lo*ulp/256 (an export, or another run's checkpoint), and then it should come
 * back exactly. codec_split_encode takes hi = bf16(x) to nearest even, which for a value
 * exactly halfway between two bf16 numbers may be the lower one, whose correction would be
 * +128 ulp/256 and is clamped to 127: the value would move. Where the encoding is not exact,
 * the neighbouring hi on each side is tried, and one that holds x exactly is kept. (One value
 * per binade edge has two exact encodings; either gives the same weight.) */
typedef struct {
    const float *x;
    uint16_t *hi;
    int8_t *lo;
} ExactJob;

static void split_exact_range(void *ctx, int64_t from, int64_t to)
{
    const ExactJob *j = ctx;
    const float *x = j->x;
    uint16_t *hi = j->hi;
    int8_t *lo = j->lo;
    codec_split_encode(x + from, hi + from, lo + from, to - from);
    for (int64_t i = from; i < to; i++) {
        float w;
        codec_split_decode(&hi[i], &lo[i], &w, 1);
        if (w == x[i] || !isfinite(x[i])) continue;
        for (int side = -1; side <= 1; side += 2) {
            uint16_t h = (uint16_t)(hi[i] + side);
            int8_t zero = 0, one = 1;
            float base, step;
            codec_split_decode(&h, &zero, &base, 1);
            codec_split_decode(&h, &one, &step, 1);
            if (!isfinite(base) || (h & 0x7fff) == 0 || ((h ^ hi[i]) & 0x8000)) continue;
            float r = rintf((x[i] - base) / (step - base));
            if (r < -128.0f || r > 127.0f) continue;
            int8_t l = (int8_t)r;
            codec_split_decode(&h, &l, &w, 1);
            if (w == x[i]) {
                hi[i] = h;
                lo[i] = l;
                break;
            }
        }
    }
}

static void split_encode_exact(const float *x, uint16_t *hi, int8_t *lo, int64_t n)
{
    ExactJob j = {.x = x, .hi = hi, .lo = lo};
    ref_parallel_ranges(n, INIT_CHUNK, split_exact_range, &j);
}

/* Each parameter's master state, or NULL, by the parameter's index in g: one pass over the
 * nodes rather than one per parameter, which on a model of a few hundred parameters among
 * tens of thousands of nodes was a search of millions. */
static Node **masters_by_param(const Graph *g)
{
    Node **master = calloc((size_t)(g->n_nodes > 0 ? g->n_nodes : 1), sizeof *master);
    IR_ASSERT(master);
    for (int k = 0; k < g->n_nodes; k++) {
        Node *m = g->nodes[k];
        if (m->op != OP_STATE || m->t.role != ROLE_MASTER || !m->grad_of) continue;
        const Node *p = m->grad_of;
        IR_ASSERT(p->index >= 0 && p->index < g->n_nodes && g->nodes[p->index] == p);
        if (master[p->index])
            ir_die(__FILE__, __LINE__, "parameter '%s' has two masters",
                   p->t.name ? p->t.name : "unnamed");
        master[p->index] = m;
    }
    return master;
}

void rt_init_params(Graph *g, uint64_t seed)
{
    IR_ASSERT(rt_init_params_from(g, seed, NULL, NULL));
}

/* The states that rt_init_params_from writes whole after clearing the others, by node index:
 * the parameters' masters (master, from masters_by_param) and the updates' FP8 weight copies.
 * Clearing them first, as zeros read from an untouched arena, would map the shared zero page
 * there, and writing the values then takes a copy-on-write fault per page, each flushing the
 * page from every CPU that runs the process: on two cores a fifth of GPT-2 d12 -O2's set-up
 * went to those faults, and each added thread sends every fault more interrupts. */
static bool *states_written_later(const Graph *g, Node *const *master)
{
    bool *later = calloc((size_t)(g->n_nodes > 0 ? g->n_nodes : 1), sizeof *later);
    IR_ASSERT(later);
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (master[i]) {
            IR_ASSERT(master[i]->index >= 0 && master[i]->index < g->n_nodes && g->nodes[master[i]->index] == master[i]);
            later[master[i]->index] = true;
        }
        if (!ir_op_is_update(n->op)) continue;
        int at = ir_adamw_copy_index(n);
        if (at >= 0 && ir_update_amax_index(n) >= 0) {
            const Node *copy = n->in[at];
            IR_ASSERT(copy->index >= 0 && copy->index < g->n_nodes && g->nodes[copy->index] == copy);
            later[copy->index] = true;
        }
    }
    return later;
}

bool rt_init_params_from(Graph *g, uint64_t seed, RtParamValuesFn values, void *ctx)
{
    /* state first: scale tensors must hold their 1 before scaled parameters are stored */
    Node **master = masters_by_param(g);
    bool *later = states_written_later(g, master);
    for (int i = 0; i < g->n_nodes; i++) {
        Node *s = g->nodes[i];
        if (s->op != OP_STATE || s->t.fmt.elem == FMT_VOID || s->t.fmt.codec == CODEC_SPLIT)
            continue;
        if (later[i]) continue;
        if (s->t.role != ROLE_SCALE && s->t.fmt.codec == CODEC_PLAIN) {
            /* zero in every plain format, scaled or not, is all-zero bytes */
            clear_bytes(s->t.data, ir_numel(&s->t) * fmt_elem_bytes(s->t.fmt.elem));
            continue;
        }
        if (s->t.role != ROLE_SCALE && ir_numel(&s->t) > 0 && store_codec_zeros(&s->t)) continue;
        int64_t n = ir_numel(&s->t);
        float *x = alloc_values(n);
        fill_values(x, n, s->t.role == ROLE_SCALE ? 1.0f : 0.0f);
        ref_store(&s->t, x);
        free(x);
    }
    free(later);
    bool ok = true;
    for (int i = 0; i < g->n_nodes && ok; i++) {
        Node *p = g->nodes[i], *m = master[i];
        if (p->op != OP_PARAM) continue;
        int64_t n = ir_numel(&p->t);
        float *x = alloc_values(n);
        if (!values) fill_param(p, seed, x, n);
        else ok = values(ctx, p, x, n);
        if (ok) ref_store(&p->t, x);
        if (ok && m) {
            if (ir_numel(&m->t) != n)
                ir_die(__FILE__, __LINE__, "master '%s' and parameter '%s' differ in size",
                       m->t.name ? m->t.name : "unnamed", p->t.name ? p->t.name : "unnamed");
            if (m->t.fmt.codec == CODEC_SPLIT && values)   /* hi is the parameter */
                split_encode_exact(x, p->t.data, m->t.data, n);
            else if (m->t.fmt.codec == CODEC_SPLIT)
                ref_split_encode(x, p->t.data, m->t.data, n);
            else
                ref_store(&m->t, x);
        }
        free(x);
    }
    free(master);
    if (!ok) return false;
    /* the FP8 copies that updates write for the next step: the first from the initial weights */
    for (int i = 0; i < g->n_nodes; i++)
        if (ir_op_is_update(g->nodes[i]->op)) ref_adamw_first_copy(g->nodes[i]);
    return true;
}
