/* ir.h — the graph IR of fp8c: one graph holds the whole training step.
 *
 * A Graph is an ordered list of Nodes. Each Node is one op (ir/ops.def) applied to earlier
 * nodes, and defines exactly one Tensor: its shape, its role in training and its storage
 * format. Formats are data on tensors, not op kinds: the precision passes rewrite them and the
 * executors read and write every tensor through its format, so a bf16 activation or an e4m3
 * saved tensor is rounded exactly where it would be on the GPU.
 *
 * Memory: every compilation owns one Arena; nodes, names and arrays live there and are freed
 * together. Nothing in the IR is freed one by one.
 *
 * Sections: arena, strings (strbuf.c), diagnostics, formats (formats.def, scaling.def), nodes
 * and graphs (ops.def, attributes by name), shapes, verify, print/read. */
#ifndef FP8C_IR_H
#define FP8C_IR_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Internal invariants: a broken one is a compiler bug, reported with its place and aborted. */
#define IR_ASSERT(cond)                                                                  \
    do {                                                                                 \
        if (!(cond)) ir_die(__FILE__, __LINE__, "assertion failed: %s", #cond);          \
    } while (0)
_Noreturn void ir_die(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---------------------------------------------------------------- arena.c */

typedef struct Arena Arena;
Arena *arena_new(void);
void arena_free(Arena *a);
void *arena_alloc(Arena *a, size_t bytes);            /* zeroed, 16-byte aligned */
char *arena_strdup(Arena *a, const char *s);
char *arena_printf(Arena *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---------------------------------------------------------------- strbuf.c
 * A growable NUL-terminated string on the heap: StrBuf b = {0}; strbuf_printf(&b, ...);
 * strbuf_text(&b); strbuf_free(&b). Out of memory sets `failed` and drops what follows. */
typedef struct {
    char *buf;
    size_t len, cap;
    bool failed;
} StrBuf;
void strbuf_addn(StrBuf *b, const char *s, size_t n);
void strbuf_add(StrBuf *b, const char *s);
void strbuf_printf(StrBuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void strbuf_vprintf(StrBuf *b, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
const char *strbuf_text(const StrBuf *b);              /* "" while empty */
void strbuf_free(StrBuf *b);

/* ---------------------------------------------------------------- diag.c */

/* A place in a source file. Line and column count from 1; line 0 means "no place". */
typedef struct {
    const char *file;
    int line, col;
} SrcLoc;

/* User errors are collected and printed as `file:line:col: error: message`, the source line
 * and a caret. The source text of a file is registered once so that the line can be shown. */
void diag_register_source(const char *file, const char *text);
void diag_error(SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void diag_note(SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int diag_error_count(void);
void diag_reset(void);
void diag_set_stream(FILE *out);                        /* default stderr; tests capture */

/* ---------------------------------------------------------------- formats */

typedef enum {
#define X(name, text, bytes, is_float) FMT_##name,
#include "formats.def"
#undef X
    FMT_COUNT
} ElemType;

/* How a scaled tensor's scale factors are laid out (ir/scaling.def). The value stored is
 * q = enc(x * scale); the value read back is dec(q) / scale. SCALE_PER_GROUP: one per `group`
 * consecutive elements of the last axis (1 x G); SCALE_TILE_1x128: DeepSeek-V3's activation
 * tiles, groups of 128; SCALE_BLOCK_128: 128 x 128 blocks of the 2-D view (weights). */
typedef enum {
#define X(name, text, rule, brows, bcols, selem, gact, gweight, cublaslt, transposable) SCALE_##name,
#include "scaling.def"
#undef X
    SCALE_COUNT
} Scaling;

/* MATMUL's fp8 attribute: how its operands are stored and scaled; scaling.def says which
 * granularity each mode gives activations and weights. */
typedef enum {
    GEMM_BF16,          /* bf16 operands */
    GEMM_FP8_TENSOR,    /* FP8, one scale per tensor */
    GEMM_FP8_ROW,       /* FP8, one scale per row of each operand's 2-D view */
    GEMM_FP8_BLOCK,     /* FP8, activations in 1x128 tiles, weights in 128x128 blocks */
} GemmScaling;

/* Where the scale of a scaled tensor comes from. */
typedef enum {
    RECIPE_NONE,
    RECIPE_CURRENT,     /* from this tensor's amax, found when it is produced */
    RECIPE_DELAYED,     /* from an amax history of `history` steps (max or most recent), margin */
    RECIPE_STATIC,      /* fixed, `static_scale` */
    RECIPE_COUNT
} Recipe;

/* How an optimizer state is encoded in its element type. */
typedef enum {
    CODEC_PLAIN,        /* value (times scale) rounded to the element type */
    CODEC_EXPAND,       /* COAT dynamic range expansion: sign(x)|x/c|^k per group, then FP8 */
    CODEC_COMPAND,      /* FlashOptim: 2x/(1+|x|) of x/absmax into i8 (Adam m) */
    CODEC_SQRT,         /* FlashOptim: sqrt(v)/absmax into u8 (Adam v) */
    CODEC_SPLIT,        /* master weight as bf16 weight + i8 rounding error in bf16 ulps */
    CODEC_COUNT
} Codec;

struct Node;

typedef struct {
    ElemType elem;
    Scaling scaling;
    int group;              /* SCALE_PER_GROUP: elements per group along the last axis */
    Recipe recipe;
    int history;            /* RECIPE_DELAYED: amax history length */
    int margin;             /* RECIPE_DELAYED: scale = fmt_max / amax / 2^margin */
    bool history_max;       /* RECIPE_DELAYED: true: max over history; false: most recent */
    float static_scale;     /* RECIPE_STATIC */
    Codec codec;
    struct Node *scale;     /* the tensor of scale factors (f32), NULL when unscaled */
    struct Node *amax;      /* where the producer records amax (f32), NULL when none */
} Format;

const char *fmt_elem_name(ElemType e);
int fmt_elem_bytes(ElemType e);
bool fmt_elem_is_float(ElemType e);
bool fmt_elem_from_name(const char *s, ElemType *out);
const char *fmt_scaling_name(Scaling s);
/* A row of scaling.def: everything that passes and backends know about a granularity. */
typedef struct {
    const char *text, *rule;
    int block_rows, block_cols;     /* 0: the whole extent; -1: the format's group */
    ElemType scale_elem;
    int gemm_act, gemm_weight;      /* GemmScaling, or -1 */
    const char *cublaslt;           /* CUBLASLT_MATMUL_MATRIX_SCALE_<this>; "": none */
    bool transposable;
} ScalingInfo;
const ScalingInfo *fmt_scaling_info(Scaling s);
bool fmt_scaling_from_rule(const char *word, Scaling *out);      /* "row", "block128", ... */
/* The group a Format of granularity s carries: a tile's fixed width (128), else `group` */
int fmt_scaling_group(Scaling s, int group);
/* The granularity an FP8 GEMM of `mode` gives an operand: its weights' or its activations' */
Scaling fmt_gemm_operand_scaling(GemmScaling mode, bool weight);
/* The GEMM mode whose activations are scaled with s (GEMM_FP8_TENSOR where none is) */
GemmScaling fmt_gemm_mode_of(Scaling s);
/* The layout of the scales of a (rows, cols) view scaled with s (group: the format's G): the
 * block that shares a scale, clipped to the view, and the grid of blocks, rounding up. */
typedef struct {
    int64_t block_rows, block_cols, grid_rows, grid_cols;
} ScaleGrid;
ScaleGrid fmt_scale_grid(Scaling s, int64_t group, int64_t rows, int64_t cols);
const char *fmt_recipe_name(Recipe r);
const char *fmt_codec_name(Codec c);
Format fmt_plain(ElemType e);                          /* unscaled, plain codec */

/* ---------------------------------------------------------------- numerics.c
 * Exact conversions between f32 and the stored element types. Rounding is to nearest even;
 * FP8 saturates to the largest finite value (CUDA's __NV_SATFINITE), NaN stays NaN. The GPU
 * conversion and these agree bit for bit (tests/test_numerics.c, tests/gpu/). */
uint16_t num_f32_to_bf16(float x);
float num_bf16_to_f32(uint16_t h);
uint16_t num_f32_to_f16(float x);
float num_f16_to_f32(uint16_t h);
uint8_t num_f32_to_e4m3(float x);
float num_e4m3_to_f32(uint8_t q);
uint8_t num_f32_to_e5m2(float x);
float num_e5m2_to_f32(uint8_t q);
float num_elem_max(ElemType e);                        /* largest finite value */
float num_round(ElemType e, float x);                  /* x rounded to e and back */
/* Bulk conversion of n elements; for integer types the values are rounded and clamped. */
void num_encode(ElemType e, const float *src, void *dst, int64_t n);
void num_decode(ElemType e, const void *src, float *dst, int64_t n);

/* ---------------------------------------------------------------- nodes and graphs */

typedef enum {
#define X(name, text, arity, iattrs, fattrs, summary, cls) OP_##name,
#include "ops.def"
#undef X
    OP_COUNT
} OpKind;

typedef enum {
    ROLE_ACTIVATION,    /* transient value of the forward pass */
    ROLE_SAVED,         /* forward value that the backward reads (kept across the step) */
    ROLE_GRAD_TEMP,     /* transient value of the backward pass */
    ROLE_INPUT,         /* fed by the runtime: tokens, targets, lr, step */
    ROLE_PARAM,         /* trained weight as the forward reads it */
    ROLE_GRAD,          /* persistent gradient accumulator of a parameter */
    ROLE_MASTER,        /* high-precision master copy of a parameter */
    ROLE_ADAM_M,
    ROLE_ADAM_V,
    ROLE_SCALE,         /* scale factors of scaled tensors */
    ROLE_AMAX_HISTORY,  /* delayed-scaling amax histories */
    ROLE_WORKSPACE,
    ROLE_OUTPUT,        /* read by the runtime after the step: loss, grad norm */
    ROLE_OPTIM_STATE,   /* other persistent optimizer state: the previous step's grad norm */
    ROLE_WEIGHT_COPY,   /* a parameter's FP8 copy, written by its update for the next step */
    ROLE_COUNT
} Role;

/* When a node runs. Evaluation runs PHASE_FORWARD alone; a micro-step runs forward and
 * backward (several times with gradient accumulation); then PHASE_UPDATE runs once. */
typedef enum { PHASE_FORWARD, PHASE_BACKWARD, PHASE_UPDATE, PHASE_COUNT } Phase;

const char *ir_role_name(Role r);
bool ir_role_from_name(const char *s, Role *out);
bool ir_role_is_persistent(Role r);                    /* lives across steps (and checkpoints) */
const char *ir_phase_name(Phase p);

#define IR_MAX_RANK 6
#define IR_MAX_IATTR 8
#define IR_MAX_FATTR 4

typedef struct {
    const char *name;       /* params: Hugging Face style, "h.3.attn.c_attn.weight"; may be NULL */
    int rank;               /* 0 for scalars */
    int64_t dims[IR_MAX_RANK];
    Role role;
    Format fmt;
    Format saved_as;        /* ROLE_SAVED: the format the backward's copy is kept in, as the
                               precision pass asks; elem FMT_VOID: the value itself is kept */
    int64_t offset;         /* byte offset in the arena of its memory class (memplan); -1: none */
    int64_t bytes;          /* storage bytes (memplan), scales excluded */
    void *data;             /* bound at run time: arena base + offset, or a test's buffer */
} Tensor;

typedef struct Node {
    OpKind op;              /* what it computes; see ops.def for the attributes it uses */
    int n_in;
    struct Node **in;
    int64_t iattr[IR_MAX_IATTR];
    double fattr[IR_MAX_FATTR];
    SrcLoc loc;             /* where in the model file it came from (diagnostics) */
    Tensor t;               /* the tensor it defines */
    Phase phase;
    int id;                 /* stable number, printed as %id */
    int index;              /* position in Graph.nodes (ir_renumber keeps it right) */
    struct Node *grad_of;   /* ROLE_GRAD/MASTER/ADAM_*: the parameter this state belongs to */
    void *pass_data;        /* scratch for the pass that runs now; nobody else reads it */
} Node;

/* Attributes by name. ops.def lists each op's attributes, (trans_a,trans_b,fp8,...); from
 * those lists come one enum per op and kind, IATTR_MATMUL_fp8 = 2, FATTR_MATMUL_static_scale
 * = 0, and these accessors, which are lvalues and check the node's op:
 *     IR_IATTR(mm, MATMUL, fp8) = GEMM_FP8_TENSOR;
 *     double s = IR_FATTR(mm, MATMUL, static_scale);
 * A name the op does not have is a compile error. The node may also be of an op that has the
 * same attribute in the same place (PAD read as SLICE, RMSNORM_BWD_X as LAYERNORM: code shared
 * by a family of ops); anything else stops with a message. n is evaluated twice. The textual
 * IR (print.c, read.c) walks the attributes by index; everything else uses these. */
int ir_attr_check(const Node *n, OpKind op, int k, bool fattr);     /* the slow path: graph.c */
static inline int ir_attr_index(const Node *n, OpKind op, int k, bool fattr)
{
    return n->op == op ? k : ir_attr_check(n, op, k, fattr);
}
#define IR_IATTR(n, OP, name) ((n)->iattr[ir_attr_index((n), OP_##OP, IATTR_##OP##_##name, false)])
#define IR_FATTR(n, OP, name) ((n)->fattr[ir_attr_index((n), OP_##OP, FATTR_##OP##_##name, true)])

/* The machinery: IR_ATTR_EACH(M, p, a, b, ...) is M(p, a) M(p, b) ..., up to 8 names. */
#define IR_ATTR_UNPAREN(...) __VA_ARGS__
#define IR_ATTR_COUNT(...) IR_ATTR_COUNT_(__VA_ARGS__, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define IR_ATTR_COUNT_(_1, _2, _3, _4, _5, _6, _7, _8, N, ...) N
#define IR_ATTR_CAT(a, b) IR_ATTR_CAT_(a, b)
#define IR_ATTR_CAT_(a, b) a##b
#define IR_ATTR_EACH(M, p, ...) IR_ATTR_CAT(IR_ATTR_EACH_, IR_ATTR_COUNT(__VA_ARGS__))(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_1(M, p, a) M(p, a)
#define IR_ATTR_EACH_2(M, p, a, ...) M(p, a) IR_ATTR_EACH_1(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_3(M, p, a, ...) M(p, a) IR_ATTR_EACH_2(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_4(M, p, a, ...) M(p, a) IR_ATTR_EACH_3(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_5(M, p, a, ...) M(p, a) IR_ATTR_EACH_4(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_6(M, p, a, ...) M(p, a) IR_ATTR_EACH_5(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_7(M, p, a, ...) M(p, a) IR_ATTR_EACH_6(M, p, __VA_ARGS__)
#define IR_ATTR_EACH_8(M, p, a, ...) M(p, a) IR_ATTR_EACH_7(M, p, __VA_ARGS__)
#define IR_ATTR_ENUMERATOR(p, a) p##a,
/* An op without attributes gets one unused enumerator, IATTR_INPUT_, and a count of 1. */
#define X(name, text, arity, iattrs, fattrs, summary, cls)                                   \
    enum { IR_ATTR_EACH(IR_ATTR_ENUMERATOR, IATTR_##name##_, IR_ATTR_UNPAREN iattrs)          \
           IATTR_##name##_COUNT_ };                                                           \
    enum { IR_ATTR_EACH(IR_ATTR_ENUMERATOR, FATTR_##name##_, IR_ATTR_UNPAREN fattrs)          \
           FATTR_##name##_COUNT_ };                                                           \
    _Static_assert(IATTR_##name##_COUNT_ <= IR_MAX_IATTR && FATTR_##name##_COUNT_ <= IR_MAX_FATTR, \
                   "ops.def: too many attributes for " #name);
#include "ops.def"
#undef X
/* "trans_a,trans_b,..." from (trans_a,trans_b,...), for the op table */
#define IR_ATTR_TEXT(list) IR_ATTR_TEXT_ list
#define IR_ATTR_TEXT_(...) #__VA_ARGS__

/* The optimizer clause of the model file; the optimizer pass turns it into update nodes and
 * the runtime uses lr as the default peak learning rate. */
typedef enum { OPTIM_ADAMW, OPTIM_LION, OPTIM_SGD, OPTIM_COUNT } OptimKind;
const char *ir_optim_name(OptimKind k);                 /* "adamw", "lion", "sgd" */
bool ir_optim_from_name(const char *s, OptimKind *out);

typedef struct {
    bool present;
    double lr, beta1, beta2, eps, weight_decay, clip;   /* clip 0: no clipping; betas: AdamW, Lion */
    OptimKind kind;                                     /* 0: AdamW */
    double momentum;                                    /* SGD */
    bool nesterov;                                      /* SGD */
} OptimSpec;

typedef struct {
    Arena *arena;
    Node **nodes;           /* in order: topological, and after `schedule` the launch order */
    int n_nodes, cap;
    int next_id;
    const char *model_name;
    /* build configuration, recorded so that the artifact and the plan can show it */
    int64_t batch, seq;
    int opt_level;          /* -O0..-O3 */
    OptimSpec optim;
    int64_t persistent_bytes, transient_bytes;   /* memplan: the two arena sizes */
    /* choices of the kernel program fixed at build time (a tuning record's winners, or by
     * hand): name -> value, printed as `choice NAME VALUE` lines; see ir_choice below */
    struct Choice *choices;
    int n_choices;
} Graph;

/* What an op is to fusion and lowering: ops.def's last column, whose header says what each
 * class means. Nodes of an ELEMWISE op run inside another node's kernel when fusion allows;
 * a group holds at most one HEAD; HELD and COLLECTIVE ops run no kernel. */
typedef enum {
    CLASS_HELD,         /* no kernel: the runtime holds the value */
    CLASS_COLLECTIVE,   /* no kernel: the runtime's communication */
    CLASS_ELEMWISE,     /* element for element; inline in a consumer's or a head's kernel */
    CLASS_HEAD,         /* each result element once, where an elementwise epilogue can take it */
    CLASS_ALONE,        /* a kernel nothing fuses with */
    CLASS_COUNT
} OpClass;

typedef struct {
    const char *text;
    int arity;                       /* -1: variadic */
    int n_iattr, n_fattr;
    const char *iattr_names[IR_MAX_IATTR];
    const char *fattr_names[IR_MAX_FATTR];
    const char *summary;
    OpClass cls;
} OpInfo;

const OpInfo *ir_op_info(OpKind op);
OpClass ir_op_class(OpKind op);      /* ops.def's CLASS column */
bool ir_op_from_name(const char *s, OpKind *out);
bool ir_op_is_inplace(OpKind op);   /* ACCUMULATE, the updates, AMAX_RECORD, DELAYED_SCALE,
                                       ASSIGN, ALL_REDUCE */
bool ir_op_is_update(OpKind op);    /* ADAMW, LION, SGD: a parameter's optimizer update */
/* ATTENTION_BWD: whether it reads the forward's result y (its last input) besides dy and q, k, v
 * or q|k|v; the forward's inputs then start at in[1] and number n_in - 2. */
bool ir_attention_bwd_reads_y(const Node *n);
/* Storage bytes of n's tensor: numel x element size, and for an ATTENTION with lse=1 the
 * logsumexp of its rows after the result (from ir_attention_lse_offset), with amax=1 the
 * partial maxima (ir_amax_parts_offset), for a QUANTIZE with transposed=1 the transposed copy
 * (ir_transposed_offset). */
int64_t ir_storage_bytes(const Node *n);
int64_t ir_attention_lse_offset(const Node *n);   /* bytes from the result's start; 0: none */
/* The amax=1 attribute (ops.def): where n's storage keeps the partial maxima of |result| that
 * a GPU kernel writes, IR_AMAX_PARTS f32 after the result; 0: it keeps none. */
#define IR_AMAX_PARTS 1024
bool ir_op_keeps_amax(OpKind op);   /* whether op has the attribute */
/* SQNORM, the sum of squares behind the gradient norm, is taken over chunks of IR_SQNORM_CHUNK
 * consecutive elements from the tensor's start, each chunk's sum in f64, the chunks' sums then
 * added in chunk order: by the GPU kernels of a data-parallel build (--gpus N; one GPU's build
 * keeps its partial sums over the grid's blocks, cuda/spec_ops.c), the reference and the CPU
 * backend (its REDUCE_CHUNK). With --shard-states every shard boundary falls on a chunk boundary
 * (rt_shard_group), so the ranks' chunk sums are the whole tensor's and the norm does not
 * depend on the number of GPUs (cuda/exec_shard.c). */
#define IR_SQNORM_CHUNK 4096
int64_t ir_amax_parts_offset(const Node *n);
void ir_set_keeps_amax(Node *n);    /* n->op must have the attribute */
bool ir_keeps_amax(const Node *n);  /* amax=1 (false for an op without the attribute) */
/* QUANTIZE with transposed=1 (ops.def): where its storage keeps the transposed copy of the
 * result (the last dim first, the others flattened after it); 0: it keeps none. */
int64_t ir_transposed_offset(const Node *n);
/* An update's operands (ops.def): param, grad, its states (ADAMW: m, v; LION, SGD: m), then lr,
 * step, clip, grad_scale from ir_update_lr_index; the optional ones follow: the index of the
 * master, of the FP8 copy (then its scale and its amax state follow it); -1 where there is none.
 * The _adamw_ names serve every update op (they share the copy attribute and the layout). */
int ir_update_states(const Node *n);        /* 2 (ADAMW) or 1 */
/* An update's hyper-parameters from its attributes, for every executor: AdamW's betas, eps and
 * weight decay; Lion's betas and weight decay; SGD's momentum (as b1), weight decay and
 * Nesterov. What an op does not have is 0. */
typedef struct {
    double b1, b2, eps, wd;
    bool nesterov;
} UpdateHparams;
UpdateHparams ir_update_hparams(const Node *n);
int ir_update_lr_index(const Node *n);      /* 2 + ir_update_states */
int ir_adamw_master_index(const Node *n);
int ir_adamw_copy_index(const Node *n);      /* the FP8 copy (copy=1), else -1 */
int ir_update_amax_index(const Node *n);     /* the new weights' amax state (copy=1 or 2), else -1 */
int ir_update_tail(const Node *n);           /* operands after the master: 3 (copy=1), 1 (copy=2), 0 */
/* ROPE's rotations: for position p < T and pair i < head_dim / 2, cs[2 (p head_dim/2 + i)] =
 * cos(p theta^(-2i/head_dim)) and the next element its sin, in f64. The one formula every
 * backend's RoPE reads: the reference executor, the CPU kernels, the GPU executor's table. */
void ir_rope_table(int64_t T, int64_t head_dim, double theta, double *cs);
/* Whether n writes into its i-th operand's storage (ACCUMULATE: acc; ADAMW: param, grad, m, v,
 * master, FP8 copy, the amax state). A value after such a write is read through n (ACCUMULATE's result aliases acc), so
 * every other reader of a mutated operand must run before n. */
bool ir_mutates_input(const Node *n, int i);

Graph *ir_graph_new(Arena *a);
/* The choice table: what `fp8c tune` measured and `fp8c build --tune` wrote into the artifact,
 * for the stages that decide the kernel program (chunk_loss, the CUDA plan, the runtime's GEMM
 * algorithms, the CPU's threads and tile path). A name is [A-Za-z0-9_.@]+, a value
 * [A-Za-z0-9_.:+-]+; a name not in the table means "the default rule". Names and values live in
 * the graph's arena. docs/tuning.md lists the names. */
typedef struct Choice {
    const char *name;
    const char *value;
} Choice;
const char *ir_choice(const Graph *g, const char *name);                  /* NULL: not set */
int64_t ir_choice_int(const Graph *g, const char *name, int64_t dflt);    /* dflt: unset or not a number */
/* A fusion's switch at one site: "KIND@ID" if set, else "KIND", else on. */
bool ir_choice_on(const Graph *g, const char *kind, const Node *site);
/* a whole-number choice, KIND@ID for `site` before KIND; dflt where unset or not a number */
int64_t ir_choice_int_at(const Graph *g, const char *kind, const Node *site, int64_t dflt);
/* NULL where `value` is one the choice `name` (or its NAME@ID form) takes; else why not, one
 * phrase written into why (an unknown name, a value outside its list or range) */
const char *ir_choice_check(const char *name, const char *value, char *why, size_t why_len);
void ir_set_choice(Graph *g, const char *name, const char *value);        /* copies both; replaces */
bool ir_choice_name_ok(const char *s);
/* 16 hex digits (FNV-1a, 64 bits) naming a device by its description: the value of the
 * tune.device choice, computed alike by fp8c and by the training binary. */
void ir_fingerprint(const char *text, char out[17]);
bool ir_choice_value_ok(const char *s);
/* Appends a node. Builders only set op, inputs and location; the caller then sets attributes
 * and calls ir_infer_shape (or fills the tensor itself for leaves). */
Node *ir_add(Graph *g, OpKind op, int n_in, Node *const *in, SrcLoc loc);
Node *ir_add1(Graph *g, OpKind op, Node *a, SrcLoc loc);
Node *ir_add2(Graph *g, OpKind op, Node *a, Node *b, SrcLoc loc);
/* A leaf with its tensor filled: INPUT, PARAM, STATE, CONST. */
Node *ir_leaf(Graph *g, OpKind op, const char *name, Role role, ElemType elem, int rank,
              const int64_t *dims, SrcLoc loc);
void ir_set_shape(Node *n, int rank, const int64_t *dims);
/* The most elements a tensor may have: 2^40 (4 TiB in f32), far beyond any device, and small
 * enough that byte counts, their sums over a graph's tensors and products of a few such counts
 * stay inside int64. The front end refuses larger shapes (ir_infer_shape, ir_shape_fits) with
 * an error at their place in the model, so that no pass meets an overflowing count. */
#define IR_MAX_NUMEL ((int64_t)1 << 40)
bool ir_shape_fits(int rank, const int64_t *dims);   /* dims >= 0, product <= IR_MAX_NUMEL */
int64_t ir_numel(const Tensor *t);
bool ir_same_shape(const Tensor *a, const Tensor *b);
Node *ir_find(const Graph *g, const char *name);      /* by tensor name, NULL if none */
void ir_renumber(Graph *g);                            /* index = position in nodes */
/* users[i] lists the nodes that read node i (by index); returned in the graph's arena. */
typedef struct { int n; Node **list; } Uses;
Uses *ir_fill_uses(const Graph *g);
/* Whether QUANTIZE q is the per-tensor, currently scaled FP8 copy of a norm's or an
 * elementwise activation's value y that nothing else reads (but q's scale, from y's block
 * maxima), keeping no transposed copy: a backend may then run y's kernel a second time at q's
 * place, from y's inputs, instead of storing y (cuda/spec_fuse.c); the memory plan keeps
 * those inputs alive until q for it (passes/memplan.c). */
bool ir_quantize_may_rerun_producer(const Node *q, const Uses *uses);
/* The product (ADD, SUB, MUL of same-sized operands) that activation gradient u (GELU_BWD,
 * SILU_BWD) reads as its dy, where u alone reads it and the choice fuse.inline_elementwise is
 * on at it: the GPU backend computes it inside u's kernel (cuda/spec_fuse.c), so its operands
 * live until u (passes/memplan.c). NULL otherwise. */
const Node *ir_inlined_product(const Graph *g, const Node *u, const Uses *uses);
/* The activation (GELU, SILU of one same-sized input, unscaled) that product y (ADD, SUB,
 * MUL of same-sized operands) reads, where y alone reads it and the choice
 * fuse.inline_elementwise is on at it: the GPU backend may compute it inside y's kernel from
 * its input (cuda/spec_fuse.c), so that input lives until y (passes/memplan.c). NULL
 * otherwise (and where y reads two such, the first). */
const Node *ir_inlined_activation(const Graph *g, const Node *y, const Uses *uses);
/* Whether n is a forward value made again in the backward instead of saved (passes/recompute.c
 * marks its copies so: an activation's role in the backward phase). Its bits must be the
 * forward's: a backend computes it as it computes the original (a GEMM's accumulation mode). */
bool ir_is_recomputed(const Node *n);
/* Replaces every use of `from` by `to` (in nodes after `from`). */
void ir_replace_uses(Graph *g, Node *from, Node *to);
/* Moves n (anywhere after pos) to just before pos; passes use it to insert new nodes. */
void ir_move_before(Graph *g, Node *n, Node *pos);
void ir_move_to_end(Graph *g, Node *n);   /* after every other node (nothing may read it) */
/* Keeps the nodes for which keep[index] is true, preserving order. */
void ir_filter(Graph *g, const bool *keep);

/* ---------------------------------------------------------------- shapes.c */

/* Infers n's result shape from its inputs and attributes. Returns NULL when fine, else a
 * message naming the dimensions that disagree (for diag_error at n->loc). Element types of
 * results default to f32 (i32 for nothing but leaves). */
const char *ir_infer_shape(Node *n, Arena *a);
/* A MATMUL's sizes: op(A) is M x K and op(B) K x N, on the operands' 2-D views. */
void ir_matmul_dims(const Node *mm, int64_t *m, int64_t *n, int64_t *k);
/* "bf16[8,64,768]": a tensor's element type and dims, for messages; in the arena. */
const char *ir_shape_text(Arena *a, const Tensor *t);

/* ---------------------------------------------------------------- verify.c */

/* Checks the invariants every pass must keep: inputs defined earlier, arity, shapes agree with
 * inference, in-place ops ordered after every other reader, formats consistent. Returns the
 * number of problems found (each printed to stderr with the node). */
int ir_verify(const Graph *g, const char *after_pass);

/* ---------------------------------------------------------------- print.c / read.c */

/* Textual IR, one node a line:
 *   %7 = matmul(%5, %6) trans_b=1 : bf16[8,64,768] role=activation phase=forward name="..." @file:12:5
 * The reader accepts exactly what the printer writes (and comments starting with '#'). */
void ir_print(const Graph *g, FILE *out);
void ir_print_node(const Node *n, FILE *out);
void ir_print_format(const char *key, const Format *f, FILE *out);   /* " key{...}" unless plain */
/* Returns NULL and reports diag errors (file:line:col) on malformed text. */
Graph *ir_read(Arena *a, const char *file, const char *text);

/* ---------------------------------------------------------------- codecs.c
 * Optimizer-state codecs (DESIGN.md §4). n f32 values are encoded in groups of
 * codec_group_size() consecutive elements (the last group may be shorter) into
 * codec_elem()-typed codes, with codec_params_per_group() f32 side values per group (the
 * tensor Format.scale points at); see codecs.c for the definitions and docs/numerics.md for
 * the measured errors.
 *   CODEC_PLAIN    e4m3, groups of 128, param: scale = 448/amax   (the per-group FP8 baseline)
 *   CODEC_EXPAND   e4m3, groups of 128, params: c = amax, k       (q = e4m3(448 sign(x)|x/c|^k))
 *   CODEC_COMPAND  i8,   groups of 32,  param: amax               (q = round(127 2y/(1+|y|)))
 *   CODEC_SQRT     u8,   groups of 32,  param: p = max sqrt(v)    (q = round(255 2y/(1+y)),
 *                                                                  y = sqrt(v)/p; v > 0: q >= 1)
 *   CODEC_SPLIT    i8 correction of a bf16 weight, no params: codec_split_encode/decode. */
ElemType codec_elem(Codec c);
int codec_group_size(Codec c);
int codec_params_per_group(Codec c);
int64_t codec_param_count(Codec c, int64_t n);      /* f32 side values for n elements */
void codec_encode(Codec c, const float *src, void *dst, float *params, int64_t n);
void codec_decode(Codec c, const void *src, const float *params, float *dst, int64_t n);
/* Master weight w as hi = bf16(w) (the weight the forward reads) and lo, the rounding error
 * in units of ulp(hi)/256; decoding is exact in f32 and gives w within 2^-16 relative (2^-15
 * for the ~0.2% of weights whose error is within 1/512 ulp of +ulp/2). */
void codec_split_encode(const float *w, uint16_t *hi, int8_t *lo, int64_t n);
void codec_split_decode(const uint16_t *hi, const int8_t *lo, float *w, int64_t n);

#endif
