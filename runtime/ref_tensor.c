/* ref_tensor.c — the reference executor's tensor access: every value read and written
 * through its format.
 *
 * The op kernels (ref_ops.c, ref_gemm.c, ref_attn.c, ref_optim.c, ref_quant.c) and the
 * dispatcher (ref_exec.c) meet here and nowhere else: a kernel sees decoded f32 arrays, and
 * the few that work in place (AdamW, accumulation, the scale ops) load and store their
 * tensors themselves. Keeping this file below both is what lets the executor's files import
 * one way: ref_exec.c calls the kernels, the kernels call this file, and nothing calls back
 * up into the dispatcher.
 *
 * Loads decode to f32 (ref_load) and stores round into the storage format (ref_store), exactly
 * where a GPU kernel would convert. Scaled formats store q = enc(x * s) and read dec(q) / s,
 * with one scale per tensor, per row of the 2-D view (rows = all leading dims), per group of G
 * along the last axis (1x128 tiles are groups of 128), or per 128x128 block, the scales read
 * from the format's scale tensor. Loads and stores never compute scales or amaxes: the scaling
 * pass makes that explicit work (quant_scale, amax_record, delayed_scale in ref_quant.c), so
 * the reference executes exactly the graph it is given. Optimizer-state codecs (range
 * expansion, companding) are decoded and encoded with ir/codecs.c, their per-group side values
 * kept in the scale tensor; a split master is handled by AdamW and init, next to its
 * parameter, and reading it alone stops the run with a message rather than computing
 * something else.
 *
 * Also here: the errors that name a node (ref_die_node), the 2-D view of a tensor (ref_rows,
 * ref_cols), checked indices (ref_id) and the vectorized bf16 conversions. */
#include "ref_internal.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

_Noreturn void ref_die_node(const Node *n, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ir_die(__FILE__, __LINE__, "reference executor: %s %%%d (%s): %s", ir_op_info(n->op)->text,
           n->id, n->t.name ? n->t.name : "unnamed", msg);
}

int64_t ref_rows(const Tensor *t)
{
    int64_t r = 1;
    for (int i = 0; i + 1 < t->rank; i++) r *= t->dims[i];
    return r;
}

int64_t ref_cols(const Tensor *t) { return t->rank ? t->dims[t->rank - 1] : 1; }

int64_t ref_id(const Node *n, float v, int64_t limit, const char *what)
{
    if (!(v >= 0 && v < (float)limit) || v != floorf(v))
        ref_die_node(n, "%s %g out of range [0, %lld)", what, (double)v, (long long)limit);
    return (int64_t)v;
}

static const char *tensor_label(const Tensor *t) { return t->name ? t->name : "unnamed"; }

static void check_bound(const Tensor *t)
{
    if (!t->data && ir_numel(t) > 0)
        ir_die(__FILE__, __LINE__, "reference executor: tensor '%s' %s[%d dims] is not bound",
               tensor_label(t), fmt_elem_name(t->fmt.elem), t->rank);
}

/* ---------------------------------------------------------------- scale layout
 * Where the scale of element (r, c) of the 2-D view lives, and how many scales there are. */

RefScaleMap ref_scale_map(Scaling kind, int group, int64_t rows, int64_t cols)
{
    IR_ASSERT(kind > SCALE_NONE && kind < SCALE_COUNT);
    IR_ASSERT(fmt_scaling_info(kind)->block_cols >= 0 || group > 0);
    ScaleGrid g = fmt_scale_grid(kind, group, rows, cols);
    return (RefScaleMap){.kind = kind, .rows = rows, .cols = cols, .block_rows = g.block_rows,
                         .group = g.block_cols, .n_col_groups = g.grid_cols,
                         .count = g.grid_rows * g.grid_cols};
}

int64_t ref_scale_index(const RefScaleMap *m, int64_t r, int64_t c)
{
    switch (m->kind) {
    case SCALE_PER_TENSOR: return 0;
    case SCALE_PER_ROW: return r;
    default: return (r / m->block_rows) * m->n_col_groups + c / m->group;
    }
}

static RefScaleMap scale_map(const Tensor *t)
{
    const Format *f = &t->fmt;
    if ((f->scaling == SCALE_PER_GROUP) && f->group <= 0)
        ir_die(__FILE__, __LINE__, "tensor '%s': per-group scaling with group %d",
               tensor_label(t), f->group);
    return ref_scale_map(f->scaling, f->group, ref_rows(t), ref_cols(t));
}

static bool is_scaled(const Format *f) { return f->scaling != SCALE_NONE; }

/* Optimizer-state codecs (ir/codecs.c) keep their per-group side values in the scale tensor.
 * A split master is only meaningful next to its parameter: AdamW and init decode it there. */
static bool is_group_codec(Codec c)
{
    return c == CODEC_EXPAND || c == CODEC_COMPAND || c == CODEC_SQRT;
}

static Tensor *codec_params_tensor(const Tensor *t)
{
    if (t->fmt.codec == CODEC_SPLIT)
        ir_die(__FILE__, __LINE__,
               "reference executor: the split master '%s' is read only with its parameter",
               tensor_label(t));
    const Tensor *st = t->fmt.scale ? &t->fmt.scale->t : NULL;
    int64_t want = codec_param_count(t->fmt.codec, ir_numel(t));
    if (!st || st->fmt.elem != FMT_F32 || ir_numel(st) != want)
        ir_die(__FILE__, __LINE__,
               "reference executor: '%s' (codec %s) needs %lld f32 side values in its scale tensor",
               tensor_label(t), fmt_codec_name(t->fmt.codec), (long long)want);
    check_bound(st);
    return (Tensor *)st;
}

/* The scale factors of t: read from its scale tensor, or the static scale when it has none. */
static float *scales_read(const Tensor *t, const RefScaleMap *m)
{
    const Format *f = &t->fmt;
    float *s;
    if (f->scale) {
        const Tensor *st = &f->scale->t;
        if (is_scaled(&st->fmt) || ir_numel(st) != m->count)
            ir_die(__FILE__, __LINE__,
                   "reference executor: tensor '%s' (%s scaling) needs %lld plain scales, its "
                   "scale tensor '%s' has %lld", tensor_label(t), fmt_scaling_name(f->scaling),
                   (long long)m->count, tensor_label(st), (long long)ir_numel(st));
        s = ref_load(st);
    } else if (f->recipe == RECIPE_STATIC) {
        s = malloc(sizeof(float) * (size_t)m->count);
        IR_ASSERT(s);
        for (int64_t i = 0; i < m->count; i++) s[i] = f->static_scale;
    } else {
        ir_die(__FILE__, __LINE__, "reference executor: tensor '%s' is scaled (%s) but has no "
               "scale tensor", tensor_label(t), fmt_scaling_name(f->scaling));
    }
    return s;
}

/* ---------------------------------------------------------------- load and store */

/* Conversions are elementwise and a training step converts every activation twice (stored,
 * then read), so they are split across the threads in fixed chunks like any other op. f32 to
 * f32 is a copy, split too: into fresh arena pages (the first store of a master) the copy's
 * cost is the kernel's page faults, which only more threads take faster. A group codec's
 * chunk is whole groups (the chunk is a multiple of every codec's group), each with its side
 * values, so chunks encode what the whole tensor would. */
enum { CODEC_CHUNK = 1 << 15 };

typedef struct {
    ElemType elem;
    const void *src;
    void *dst;
    bool encode;
} CodecJob;

/* bf16 is the element type of every activation at -O0..-O2, so it gets loops the compiler can
 * vectorize instead of a call per element. They are bit-identical to num_f32_to_bf16 and
 * num_bf16_to_f32 (round to nearest even, overflow to infinity, NaN to 0x7FFF); test_ops
 * compares them on every bf16 value and on edge and random f32 values. */
static inline uint16_t bf16_of_bits(uint32_t u)
{
    uint32_t abs = u & 0x7FFFFFFFu;
    uint32_t r = ((u >> 16) & 0x8000u) | ((abs + 0x7FFFu + ((abs >> 16) & 1u)) >> 16);
    return (uint16_t)(abs > 0x7F800000u ? 0x7FFFu : r);
}

/* Blocks of 16 with a fixed trip count: GCC's -O2 vectorizes those, not a loop of unknown n. */
void ref_bf16_encode(const float *src, uint16_t *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint32_t u[16];
        memcpy(u, src + i, sizeof u);
        for (int k = 0; k < 16; k++) dst[i + k] = bf16_of_bits(u[k]);
    }
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        dst[i] = bf16_of_bits(u);
    }
}

void ref_bf16_decode(const uint16_t *src, float *dst, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint32_t u[16];
        for (int k = 0; k < 16; k++) u[k] = (uint32_t)src[i + k] << 16;
        memcpy(dst + i, u, sizeof u);
    }
    for (; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        memcpy(dst + i, &u, sizeof u);
    }
}

static void codec_range(void *ctx, int64_t lo, int64_t hi)
{
    const CodecJob *j = ctx;
    int64_t len = hi - lo;
    size_t eb = (size_t)fmt_elem_bytes(j->elem);
    if (j->elem == FMT_BF16 && j->encode)
        ref_bf16_encode((const float *)j->src + lo, (uint16_t *)j->dst + lo, len);
    else if (j->elem == FMT_BF16)
        ref_bf16_decode((const uint16_t *)j->src + lo, (float *)j->dst + lo, len);
    else if (j->encode)
        num_encode(j->elem, (const float *)j->src + lo, (char *)j->dst + (size_t)lo * eb, len);
    else
        num_decode(j->elem, (const char *)j->src + (size_t)lo * eb, (float *)j->dst + lo, len);
}

static void codec_run(ElemType e, const void *src, void *dst, int64_t n, bool encode)
{
    CodecJob j = {.elem = e, .src = src, .dst = dst, .encode = encode};
    ref_parallel_ranges(n, CODEC_CHUNK, codec_range, &j);
}

/* An optimizer-state codec (ir/codecs.c) over whole groups: values to codes q and side values
 * p (encode, from src), or back (decode, into dst). */
typedef struct {
    Codec codec;
    const float *src;
    float *dst;
    void *q;
    float *p;
} GroupCodecJob;

static void group_codec_range(void *ctx, int64_t lo, int64_t hi)
{
    const GroupCodecJob *j = ctx;
    size_t eb = (size_t)fmt_elem_bytes(codec_elem(j->codec));
    void *q = (char *)j->q + (size_t)lo * eb;
    float *p = j->p + codec_param_count(j->codec, lo);
    if (j->src) codec_encode(j->codec, j->src + lo, q, p, hi - lo);
    else codec_decode(j->codec, q, p, j->dst + lo, hi - lo);
}

static void group_codec_run(GroupCodecJob *j, int64_t n)
{
    IR_ASSERT(CODEC_CHUNK % codec_group_size(j->codec) == 0);
    ref_parallel_ranges(n, CODEC_CHUNK, group_codec_range, j);
}

/* dst = src * scale (store) or src / scale (load), element by element with its own scale;
 * split by rows, each row walked in runs that share a scale. */
typedef struct {
    const RefScaleMap *m;
    const float *s, *src;
    float *dst;
    bool multiply;
} ScaleJob;

static void scale_rows_task(void *ctx, int64_t task)
{
    const ScaleJob *j = ctx;
    const RefScaleMap *m = j->m;
    int64_t run = m->group;     /* the columns that share a scale */
    int64_t rows_per_task = 1 + (1 << 14) / (m->cols ? m->cols : 1);
    int64_t r1 = (task + 1) * rows_per_task < m->rows ? (task + 1) * rows_per_task : m->rows;
    for (int64_t r = task * rows_per_task; r < r1; r++)
        for (int64_t c0 = 0; c0 < m->cols; c0 += run) {
            float sc = j->s[ref_scale_index(m, r, c0)];
            int64_t c1 = c0 + run < m->cols ? c0 + run : m->cols;
            const float *a = j->src + r * m->cols;
            float *b = j->dst + r * m->cols;
            if (j->multiply)
                for (int64_t c = c0; c < c1; c++) b[c] = a[c] * sc;
            else
                for (int64_t c = c0; c < c1; c++) b[c] = a[c] / sc;
        }
}

static void apply_scales(const RefScaleMap *m, const float *s, const float *src, float *dst,
                         bool multiply)
{
    ScaleJob j = {.m = m, .s = s, .src = src, .dst = dst, .multiply = multiply};
    int64_t rows_per_task = 1 + (1 << 14) / (m->cols ? m->cols : 1);
    ref_parallel_for((m->rows + rows_per_task - 1) / rows_per_task, scale_rows_task, &j);
}

float *ref_load(const Tensor *t)
{
    int64_t n = ir_numel(t);
    if (t->fmt.elem == FMT_VOID)
        ir_die(__FILE__, __LINE__, "reference executor: reading void tensor '%s'", tensor_label(t));
    check_bound(t);
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    IR_ASSERT(x);
    if (t->fmt.codec != CODEC_PLAIN) {
        Tensor *params = codec_params_tensor(t);
        IR_ASSERT(is_group_codec(t->fmt.codec));
        GroupCodecJob j = {.codec = t->fmt.codec, .dst = x, .q = t->data, .p = params->data};
        group_codec_run(&j, n);
        return x;
    }
    codec_run(t->fmt.elem, t->data, x, n, false);
    if (!is_scaled(&t->fmt)) return x;

    RefScaleMap m = scale_map(t);
    float *s = scales_read(t, &m);
    apply_scales(&m, s, x, x, false);
    free(s);
    return x;
}

void ref_store(Tensor *t, const float *x)
{
    const Format *f = &t->fmt;
    int64_t n = ir_numel(t);
    if (f->elem == FMT_VOID) return;
    check_bound(t);
    if (f->codec != CODEC_PLAIN) {
        Tensor *params = codec_params_tensor(t);
        GroupCodecJob j = {.codec = f->codec, .src = x, .q = t->data, .p = params->data};
        group_codec_run(&j, n);
        return;
    }
    if (!is_scaled(f)) {
        codec_run(f->elem, x, t->data, n, true);
        return;
    }
    RefScaleMap m = scale_map(t);
    float *s = scales_read(t, &m);
    float *q = malloc(sizeof(float) * (size_t)(n ? n : 1));
    IR_ASSERT(q);
    apply_scales(&m, s, x, q, true);
    codec_run(f->elem, q, t->data, n, true);
    free(q);
    free(s);
}

/* ---------------------------------------------------------------- split masters
 * A split master's weights are its parameter's bf16 value plus the master's i8 correction
 * (ir/codecs.c), each element on its own: split in fixed chunks like any conversion. */
typedef struct {
    float *w;
    uint16_t *hi;
    int8_t *lo;
    bool encode;
} SplitJob;

static void split_range(void *ctx, int64_t a, int64_t b)
{
    const SplitJob *j = ctx;
    if (j->encode) codec_split_encode(j->w + a, j->hi + a, j->lo + a, b - a);
    else codec_split_decode(j->hi + a, j->lo + a, j->w + a, b - a);
}

void ref_split_encode(const float *w, uint16_t *hi, int8_t *lo, int64_t n)
{
    SplitJob j = {.w = (float *)w, .hi = hi, .lo = lo, .encode = true};   /* only read */
    ref_parallel_ranges(n, CODEC_CHUNK, split_range, &j);
}

void ref_split_decode(const uint16_t *hi, const int8_t *lo, float *w, int64_t n)
{
    SplitJob j = {.w = w, .hi = (uint16_t *)hi, .lo = (int8_t *)lo, .encode = false};   /* only read */
    ref_parallel_ranges(n, CODEC_CHUNK, split_range, &j);
}

/* A read-only f32 view of t: its own storage when that is plain f32 (no copy), else a decoded
 * copy returned through *owned for the caller to free. */
const float *ref_load_view(const Tensor *t, float **owned)
{
    *owned = NULL;
    if (t->fmt.elem == FMT_F32 && !is_scaled(&t->fmt) && t->fmt.codec == CODEC_PLAIN) {
        check_bound(t);
        return t->data;
    }
    return *owned = ref_load(t);
}
