/* precision.c — decides the storage format of every tensor.
 *
 * This pass is where fp8c differs from a framework: TransformerEngine, MS-AMP, COAT, FlashOptim
 * and DeepSeek-V3 each hard-code one answer to "what precision does this tensor get"; here the
 * answer is a table (the levels O0..O3 of DESIGN.md §4) plus user rules, applied to every tensor
 * of the step, and the result is data on the tensors that `fp8c plan` prints and every later
 * pass and backend obeys.
 *
 * What it decides (the scaling pass then makes it so, inserting scales and quantize nodes):
 *   - parameters, master copies (it adds the master states), gradient accumulators, Adam m and v
 *     (element type and codec);
 *   - which GEMMs take FP8 operands (MATMUL fp8=1): all at O1+, except the head that produces
 *     the logits of the loss, which stays bf16 as in TransformerEngine and torchao recipes, and
 *     GEMMs whose K or N is not a multiple of 16, which cuBLASLt cannot run in FP8 (bf16,
 *     marked unaligned=1 for the plan);
 *   - which forward values the backward reads (role saved), since the levels store those
 *     differently; every other transient value is bf16, scalars and losses f32;
 *   - whether attention's backward reads the forward's result and logsumexp (where the result
 *     is kept as it is anyway) or recomputes them.
 *
 * Rules, from --precision flags and a --policy file (one rule a line, '#' comments), are
 * PATTERN=FORMAT with shell globs over tensor names:
 *   lm_head.weight=f32            a parameter (or state: "*:adam_v=f32") kept in this format
 *   gemm:h.0.*=bf16               GEMMs whose weight matches run in bf16 (all three of a linear
 *                                 layer; gemm.fwd:, gemm.dgrad:, gemm.wgrad: one); =e5m2 means FP8 with
 *                                 e4m3 forward and e5m2 gradients (the default), =e4m3 FP8 with
 *                                 e4m3 everywhere (DeepSeek-V3); :row, :block128 (1x128
 *                                 activation tiles, 128x128 weight blocks), :delayed16
 *   saved:h.*.mlp.*=e4m3:group16  saved activations whose name matches, in this format
 *                                 (unnamed ones match "*")
 *   value:*=f32                   transient values (activations, their gradients; unnamed ones
 *                                 match "*") kept in this 16- or 32-bit format instead of bf16:
 *                                 with "*=f32" it makes a step with no reduced precision at all,
 *                                 the one to compare with an f32 framework
 *   comm:grad=e5m2                a data-parallel build (--gpus N) sends the gradient sums in
 *                                 e5m2 (or e4m3) with one scale per bucket (comm.c); this pass
 *                                 only checks the rule
 * FORMAT is an element type with optional modifiers: e4m3:tensor|row|group16|tile128|block128,
 * :current|:delayed16 (amax history length) with :recent (the latest amax, not the history's
 * max) and :margin1 (scales / 2^margin), :static0.5 (a fixed scale), :expand|:compand|:sqrt
 * (state codecs). Later rules win over earlier ones.
 *
 * Every rule does what it says or is an error at its place: a format the update or a GEMM
 * cannot honour (an unscaled FP8 state, an e5m2 range-expanded one, an FP8 parameter, a GEMM
 * in groups) is refused when it is read or first matched, not approximated.
 *
 * Recipes (--recipe NAME) are the settings of other systems by the names their users know
 * (torchao's tensorwise and rowwise, TransformerEngine's delayed and hybrid, DeepSeek-V3's
 * blockwise, MS-AMP's O1 and O2, COAT, FlashOptim): each is a level and a few rules, in one
 * table below, so that `fp8c plan` shows what a name means tensor by tensor and a user's own
 * rules still win. A recipe fp8c cannot run as its system does is refused with the reason. */
#include "passes.h"

#include <ctype.h>
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef enum { RULE_TENSOR, RULE_GEMM, RULE_SAVED, RULE_VALUE, RULE_COMM } RuleKind;

/* The three GEMMs of a linear layer y = x W: the forward, the input gradient dx = dy W^T
 * (dgrad) and the weight gradient dW = x^T dy (wgrad). A gemm: rule reaches all three,
 * gemm.fwd:, gemm.dgrad: and gemm.wgrad: one each. */
enum { GEMM_FWD = 1, GEMM_DGRAD = 2, GEMM_WGRAD = 4, GEMM_ALL = 7 };


typedef struct {
    RuleKind kind;
    int gemms;              /* RULE_GEMM: which of the three (GEMM_*) */
    const char *pattern;
    Format fmt;
    SrcLoc loc;             /* where it was written, for errors found when it is applied */
    const char *text;
    bool refused;           /* reported once; the tensors it matched keep their defaults */
    bool matched;           /* some tensor or GEMM matched it (a later rule may have won) */
} Rule;

typedef struct {
    Rule *rules;
    int n_rules;
} Policy;

/* "groupN", "delayedN", "marginN": N in [lo, hi] with nothing after it. */
static bool modifier_int(const char *part, const char *name, long lo, long hi, int *n)
{
    size_t len = strlen(name);
    if (strncmp(part, name, len) || !isdigit((unsigned char)part[len])) return false;
    char *end;
    errno = 0;
    long v = strtol(part + len, &end, 10);
    *n = *end || errno || v < lo || v > hi ? -1 : (int)v;
    return true;
}

/* Parses "e4m3:group16:delayed16" into a Format. Returns NULL or an error message. */
static const char *parse_format(Arena *a, const char *spec, Format *out)
{
    char buf[128];
    if (strlen(spec) >= sizeof buf) return "format too long";
    strcpy(buf, spec);
    char *save = NULL, *part = strtok_r(buf, ":", &save);
    if (!part || !fmt_elem_from_name(part, &out->elem) || out->elem == FMT_VOID)
        return arena_printf(a, "unknown element type '%s' (f32, bf16, f16, e4m3, e5m2, i8, u8)", part ? part : "");
    bool fp8 = out->elem == FMT_E4M3 || out->elem == FMT_E5M2;
    if (fp8) {
        out->scaling = SCALE_PER_TENSOR;
        out->recipe = RECIPE_CURRENT;
    }
    while ((part = strtok_r(NULL, ":", &save))) {
        int n = 0;
        Scaling sc;
        if (fmt_scaling_from_rule(part, &sc)) {
            out->scaling = sc;
            out->group = fmt_scaling_group(sc, out->group);
        }
        else if (modifier_int(part, "group", 1, 1 << 20, &n)) {
            if (n < 0) return arena_printf(a, "'%s': a group holds 1 to 1048576 elements", part);
            out->scaling = SCALE_PER_GROUP, out->group = n;
        }
        else if (!strcmp(part, "current")) out->recipe = RECIPE_CURRENT;
        else if (modifier_int(part, "delayed", 1, 1024, &n)) {
            if (n < 0) return arena_printf(a, "'%s': an amax history holds 1 to 1024 steps", part);
            out->recipe = RECIPE_DELAYED, out->history = n, out->history_max = true;
        }
        else if (!strcmp(part, "recent")) out->history_max = false;
        else if (modifier_int(part, "margin", 0, 31, &n)) {
            if (n < 0) return arena_printf(a, "'%s': a margin is 0 to 31 (scales / 2^margin)", part);
            out->margin = n;
        }
        else if (!strncmp(part, "static", 6)) {
            char *end;
            float v = strtof(part + 6, &end);
            if (end == part + 6 || *end || !(v > 0) || !isfinite(v))
                return arena_printf(a, "'%s': a static scale is a positive finite number", part);
            out->static_scale = v, out->recipe = RECIPE_STATIC;
        }
        else if (!strcmp(part, "expand")) out->codec = CODEC_EXPAND;
        else if (!strcmp(part, "compand")) out->codec = CODEC_COMPAND;
        else if (!strcmp(part, "sqrt")) out->codec = CODEC_SQRT;
        else return arena_printf(a, "unknown format modifier '%s'", part);
    }
    if (!fp8 && (out->scaling != SCALE_NONE || out->recipe != RECIPE_NONE) && out->codec == CODEC_PLAIN)
        return arena_printf(a, "'%s': scaling applies to e4m3 and e5m2 only", spec);
    return NULL;
}

/* Adds one "kind:pattern=format" rule; errors are reported at loc. */
static void policy_add(Policy *p, Arena *a, const char *text, SrcLoc loc)
{
    const char *eq = strchr(text, '=');
    if (!eq || eq == text || !eq[1]) {
        diag_error(loc, "a precision rule is PATTERN=FORMAT, not '%s'", text);
        return;
    }
    Rule r = {RULE_TENSOR, 0, NULL, {0}, loc, arena_strdup(a, text), false, false};
    const char *pat = text;
    static const struct { const char *prefix; int gemms; } gemm_prefixes[] = {
        {"gemm:", GEMM_ALL}, {"gemm.fwd:", GEMM_FWD}, {"gemm.dgrad:", GEMM_DGRAD}, {"gemm.wgrad:", GEMM_WGRAD},
    };
    for (size_t k = 0; k < sizeof gemm_prefixes / sizeof gemm_prefixes[0]; k++)
        if (!strncmp(text, gemm_prefixes[k].prefix, strlen(gemm_prefixes[k].prefix)))
            r.kind = RULE_GEMM, r.gemms = gemm_prefixes[k].gemms, pat += strlen(gemm_prefixes[k].prefix);
    if (r.kind != RULE_GEMM && !strncmp(text, "gemm.", 5)) {
        diag_error(loc, "'%.*s': a GEMM rule starts gemm:, gemm.fwd:, gemm.dgrad: or gemm.wgrad:",
                   (int)strcspn(text, ":="), text);
        return;
    }
    if (r.kind == RULE_TENSOR && !strncmp(text, "saved:", 6)) r.kind = RULE_SAVED, pat += 6;
    if (r.kind == RULE_TENSOR && !strncmp(text, "value:", 6)) r.kind = RULE_VALUE, pat += 6;
    if (r.kind == RULE_TENSOR && !strncmp(text, "comm:", 5)) r.kind = RULE_COMM, pat += 5;
    r.pattern = arena_printf(a, "%.*s", (int)(eq - pat), pat);
    const char *err = parse_format(a, eq + 1, &r.fmt);
    /* comm:grad=FMT is how the data-parallel gradient sums travel (comm.c): one FP8 format with
     * one scale per bucket, from the bucket's amax now; anything else would be obeyed in name
     * only */
    if (!err && r.kind == RULE_COMM && strcmp(r.pattern, "grad"))
        err = arena_printf(a, "'comm:%s': a comm: rule names what is reduced over the GPUs, and "
                           "that is the gradients: comm:grad=e5m2 or comm:grad=e4m3", r.pattern);
    if (!err && r.kind == RULE_COMM &&
        (!(r.fmt.elem == FMT_E4M3 || r.fmt.elem == FMT_E5M2) || r.fmt.scaling != SCALE_PER_TENSOR ||
         r.fmt.recipe != RECIPE_CURRENT || r.fmt.margin || r.fmt.codec != CODEC_PLAIN))
        err = "comm:grad takes e5m2 or e4m3 (sent with one scale per bucket from its amax now; "
              "without the rule the gradients are summed in their own format, bf16 or f32)";
    if (!err && r.kind == RULE_VALUE && !(r.fmt.elem == FMT_F32 || r.fmt.elem == FMT_BF16 || r.fmt.elem == FMT_F16))
        err = "a value: rule takes f32, bf16 or f16 (FP8 values are made by gemm: and saved: rules)";
    /* a GEMM runs in bf16 or FP8 with per-tensor, row or 1x128/128x128 block scales: a format
     * it would run otherwise is refused, not approximated */
    bool gemm_fp8 = r.fmt.elem == FMT_E4M3 || r.fmt.elem == FMT_E5M2;
    if (!err && r.kind == RULE_GEMM && !gemm_fp8 && r.fmt.elem != FMT_BF16)
        err = "a gemm: rule takes bf16 (a bf16 GEMM), e4m3 or e5m2 (FP8 operands); the formats of a "
              "bf16 GEMM's values come from value: rules";
    const ScalingInfo *si = fmt_scaling_info(r.fmt.scaling);
    bool gemm_takes = r.fmt.scaling == SCALE_NONE || si->gemm_act >= 0 || si->gemm_weight >= 0;
    if (!err && r.kind == RULE_GEMM && (!gemm_takes || r.fmt.codec != CODEC_PLAIN))
        err = "a gemm: rule scales operands :tensor, :row, :tile128 or :block128 (groups and state "
              "codecs are for saved: rules and optimizer states)";
    if (err) {
        diag_error(loc, "%s", err);
        return;
    }
    Rule *bigger = arena_alloc(a, sizeof *bigger * (size_t)(p->n_rules + 1));
    if (p->n_rules) memcpy(bigger, p->rules, sizeof *bigger * (size_t)p->n_rules);
    bigger[p->n_rules++] = r;
    p->rules = bigger;
}

static bool policy_load_file(Policy *p, Arena *a, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        diag_error((SrcLoc){path, 0, 0}, "cannot read the policy file: %s", strerror(errno));
        return false;
    }
    char line[1024];
    int lineno = 0;
    size_t total = 0;
    char *all = arena_alloc(a, 1 << 20);
    while (fgets(line, sizeof line, f)) {
        size_t len = strlen(line);
        if (total + len < (1 << 20) - 1) memcpy(all + total, line, len), total += len;
        lineno++;
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        char *s = line;
        while (isspace((unsigned char)*s)) s++;
        char *e = s + strlen(s);
        while (e > s && isspace((unsigned char)e[-1])) *--e = 0;
        if (!*s) continue;
        diag_register_source(path, all);
        policy_add(p, a, s, (SrcLoc){path, lineno, (int)(s - line) + 1});
    }
    /* a read that fails (a directory opens, then reads EISDIR) is not an empty policy */
    bool ok = !ferror(f);
    int err = errno;
    fclose(f);
    if (!ok) diag_error((SrcLoc){path, 0, 0}, "cannot read the policy file: %s", strerror(err));
    return ok;
}

/* The last matching rule of a kind, or NULL; gemm: rules must also cover the GEMM kind. Every
 * rule that matches is marked, the ones a later rule overrides too. */
static Rule *policy_match_gemm(const Policy *p, RuleKind kind, int gemm, const char *name)
{
    if (!name) return NULL;
    Rule *found = NULL;
    for (int i = 0; i < p->n_rules; i++)
        if (p->rules[i].kind == kind && (!gemm || (p->rules[i].gemms & gemm)) &&
            fnmatch(p->rules[i].pattern, name, 0) == 0) {
            found = &p->rules[i];
            found->matched = true;
        }
    return found;
}

static Rule *policy_match(const Policy *p, RuleKind kind, const char *name)
{
    return policy_match_gemm(p, kind, 0, name);
}

/* Why a tensor of this role cannot be stored as fmt says, or NULL. The update and the executors
 * store parameters, gradients and masters plainly (a master in i8 is the split codec), and Adam
 * states plainly or through a codec of ir/codecs.c, whose element type and group are fixed
 * (the GPU kernels have them built in): an FP8 state without a codec would be stored unscaled,
 * where almost all of Adam's m underflows to zero, so the rule is refused rather than obeyed in
 * name only. */
static const char *stored_format_error(Arena *a, const Format *f, Role role)
{
    bool wide = f->elem == FMT_F32 || f->elem == FMT_BF16 || f->elem == FMT_F16;
    bool fp8 = f->elem == FMT_E4M3 || f->elem == FMT_E5M2;
    switch (role) {
    case ROLE_PARAM:
        if (wide && f->codec == CODEC_PLAIN) return NULL;
        return "a parameter is stored in f32, bf16 or f16 (FP8 GEMMs read FP8 copies of it, with "
               "scales: gemm: rules choose them)";
    case ROLE_GRAD:
        if (wide && f->codec == CODEC_PLAIN) return NULL;
        return "a gradient accumulator is stored in f32, bf16 or f16";
    case ROLE_MASTER:
        if ((wide || f->elem == FMT_I8) && (f->codec == CODEC_PLAIN || f->codec == CODEC_SPLIT)) return NULL;
        return "a master copy is stored in f32, bf16, f16 or i8 (bf16 weight + i8 correction)";
    case ROLE_ADAM_M:
    case ROLE_ADAM_V:
        if (f->codec == CODEC_PLAIN) {
            if (wide) return NULL;
            if (fp8)
                return "an FP8 optimizer state needs a scale per group, which the update keeps "
                       "through the range-expansion codec: e4m3:expand (groups of 128)";
            return "an 8-bit integer state needs its codec: i8:compand or u8:sqrt (groups of 32)";
        }
        if (f->codec == CODEC_SPLIT) return "the split codec is for master copies";
        if (f->elem != codec_elem(f->codec))
            return arena_printf(a, "the :%s codec stores %s codes", fmt_codec_name(f->codec),
                                fmt_elem_name(codec_elem(f->codec)));
        if ((f->group > 0 && f->group != codec_group_size(f->codec)) ||
            (f->scaling != SCALE_NONE && f->scaling != SCALE_PER_GROUP && f->scaling != SCALE_PER_TENSOR))
            return arena_printf(a, "the :%s codec scales groups of %d", fmt_codec_name(f->codec),
                                codec_group_size(f->codec));
        if (f->recipe == RECIPE_DELAYED || f->recipe == RECIPE_STATIC)
            return "a state's scales are found as the update stores it: :delayedN and :static do not apply";
        return NULL;
    default:
        return NULL;
    }
}

/* The tensor rule for a stored tensor of this role, or NULL when none matches or the one that
 * does cannot be honoured (reported once, at the rule). */
static const Rule *stored_rule(Arena *a, const Policy *p, const char *name, Role role)
{
    Rule *r = policy_match(p, RULE_TENSOR, name);
    if (!r || r->refused) return NULL;
    const char *err = stored_format_error(a, &r->fmt, role);
    if (!err) return r;
    diag_error(r->loc, "'%s' matches '%s' (%s): %s", r->text, name, ir_role_name(role), err);
    r->refused = true;
    return NULL;
}

/* ---------------------------------------------------------------- recipes */

static const NamedRecipe recipes[] = {
    {"tensorwise", 1, false, {"gemm:*=e5m2:tensor:current"},
     "torchao tensorwise, TransformerEngine Float8CurrentScaling: one scale per tensor from its "
     "amax now, e4m3 forward, e5m2 gradients", NULL},
    {"rowwise", 1, false, {"gemm:*=e4m3:row"},
     "torchao rowwise: e4m3 everywhere, one scale per row (the weight gradient's rows lie "
     "across its contraction: per tensor)", NULL},
    {"rowwise_with_gw_hp", 1, false, {"gemm:*=e4m3:row", "gemm.wgrad:*=bf16"},
     "torchao rowwise_with_gw_hp: rowwise, the weight gradients in bf16", NULL},
    {"blockwise", 1, false, {"gemm:*=e4m3:block128"},
     "DeepSeek-V3, TransformerEngine Float8BlockScaling: e4m3, 1x128 activation tiles, 128x128 "
     "weight blocks", NULL},
    {"delayed", 1, false, {"gemm:*=e5m2:delayed1024"},
     "TransformerEngine DelayedScaling's defaults: HYBRID (e4m3 forward, e5m2 gradients), amax "
     "history 1024, its max, margin 0", NULL},
    {"hybrid", 1, false, {"gemm:*=e5m2:tensor:current"},
     "TransformerEngine Format.HYBRID with current scaling: e4m3 forward, e5m2 gradients", NULL},
    {"e4m3", 1, false, {"gemm:*=e4m3:tensor:current"},
     "TransformerEngine Format.E4M3 with current scaling: e4m3 forward and backward", NULL},
    {"msamp-o1", 1, true, {"gemm:*=e5m2:tensor", "*:master=f32", "*:adam_m=f32", "*:adam_v=f32"},
     "MS-AMP O1: FP8 GEMMs, f32 master weights and Adam states; fp8c keeps the weight "
     "gradients in bf16 where MS-AMP keeps them in FP8", NULL},
    {"msamp-o2", 2, true, {"gemm:*=e5m2:tensor", "*:master=f16", "*:adam_m=e4m3:expand",
                           "*:adam_v=f16", "saved:*=bf16"},
     "MS-AMP O2: FP8 GEMMs, f16 master weights, FP8 Adam m (here with a scale per group of 128, "
     "where MS-AMP scales per tensor), f16 Adam v, activations kept in bf16", NULL},
    {"coat", 2, true, {"*:adam_m=e4m3:expand", "*:adam_v=e4m3:expand"},
     "COAT: FP8 GEMMs, Adam m and v in e4m3 with dynamic range expansion (groups of 128), saved "
     "activations in FP8 of mixed granularity (-O2's)", NULL},
    {"flashoptim", 3, true, {"gemm:*=bf16", "saved:*=bf16", "*:master=i8", "*:adam_m=i8:compand",
                             "*:adam_v=u8:sqrt"},
     "FlashOptim: bf16 GEMMs and activations, Adam m companded into i8 and v as sqrt into u8 "
     "(groups of 32), bf16 weights with an i8 correction as the master", NULL},
    {"mxfp8", 1, false, {NULL}, "OCP MXFP8: e4m3 in blocks of 32 with E8M0 power-of-two scales",
     "its blocks of 32 need Blackwell's block-scaled GEMMs; fp8c's GEMMs take tensor, row, "
     "1x128 and 128x128 scales (--recipe blockwise is the nearest)"},
    {"nvfp4", 1, false, {NULL}, "NVFP4: 4-bit values in blocks of 16 with e4m3 scales",
     "fp8c has no 4-bit formats"},
};

const NamedRecipe *precision_recipes(int *n)
{
    *n = (int)(sizeof recipes / sizeof recipes[0]);
    return recipes;
}

const NamedRecipe *precision_find_recipe(const char *name)
{
    for (size_t i = 0; i < sizeof recipes / sizeof recipes[0]; i++)
        if (!strcmp(recipes[i].name, name)) return &recipes[i];
    return NULL;
}

/* A GEMM in bf16: no FP8 operands and none of the scale recipe's attributes. */
static void clear_fp8_attrs(Node *mm)
{
    IR_IATTR(mm, MATMUL, fp8) = GEMM_BF16;
    IR_IATTR(mm, MATMUL, history) = 0;
    IR_IATTR(mm, MATMUL, grad_e4m3) = 0;
    IR_IATTR(mm, MATMUL, recent) = 0;
    IR_IATTR(mm, MATMUL, margin) = 0;
    IR_FATTR(mm, MATMUL, static_scale) = 0;
}

/* ---------------------------------------------------------------- the level table
 * What -O0..-O3 mean (DESIGN.md §4), and the only place that knows: other passes ask
 * precision_level for a property instead of comparing levels. */

#define FMT_GROUPED(e, c, g) {.elem = (e), .codec = (c), .scaling = SCALE_PER_GROUP, .group = (g)}
#define FMT_F32_PLAIN {.elem = FMT_F32}

static const PrecisionLevel levels[PRECISION_LEVELS] = {
    /* O0: the bf16 mixed-precision baseline, saving what PyTorch's compiled graphs save: the
     * outputs of norms and elementwise ops are made again in the backward (the -O0 step fits
     * where PyTorch's does: docs/precision.md) */
    {.param = FMT_BF16, .grad = FMT_F32, .master = FMT_F32, .master_codec = CODEC_PLAIN,
     .adam_m = FMT_F32_PLAIN, .adam_v = FMT_F32_PLAIN, .cheap_remade = true},
    /* O1: FP8 GEMMs (e4m3 forward, e5m2 gradients), bf16 gradients; SwiGLU's silu(gate) made
     * again in the backward's product from gate, which it keeps anyway (docs/precision.md) */
    {.param = FMT_BF16, .grad = FMT_BF16, .master = FMT_F32, .master_codec = CODEC_PLAIN,
     .adam_m = FMT_F32_PLAIN, .adam_v = FMT_F32_PLAIN, .fp8_gemms = true, .activations_remade = true},
    /* O2: COAT: FP8 states with dynamic range expansion in groups of 128, FP8 saved values */
    {.param = FMT_BF16, .grad = FMT_BF16, .master = FMT_F32, .master_codec = CODEC_PLAIN,
     .adam_m = FMT_GROUPED(FMT_E4M3, CODEC_EXPAND, 128),
     .adam_v = FMT_GROUPED(FMT_E4M3, CODEC_EXPAND, 128), .fp8_gemms = true, .fp8_saved = true,
     .attention_y_kept = true, .activations_remade = true},
    /* O3: FlashOptim: companded 8-bit states in groups of 32, bf16 + i8 split master; weights
     * quantized at every use, no FP8 copy kept across the step; attention's output saved and
     * its q, k, v made again in the backward (less memory and less time than the other way
     * round, which reruns the forward: docs/results.md) */
    {.param = FMT_BF16, .grad = FMT_BF16, .master = FMT_I8, .master_codec = CODEC_SPLIT,
     .adam_m = FMT_GROUPED(FMT_I8, CODEC_COMPAND, 32),
     .adam_v = FMT_GROUPED(FMT_U8, CODEC_SQRT, 32), .fp8_gemms = true, .fp8_saved = true,
     .weight_copies_per_use = true, .attention_y_kept = true, .attention_inputs_remade = true,
     .activations_remade = true},
};

const PrecisionLevel *precision_level(int opt_level)
{
    IR_ASSERT(opt_level >= 0 && opt_level < PRECISION_LEVELS);
    return &levels[opt_level];
}

bool precision_attention_inputs_saved(const Graph *g)
{
    bool remade = precision_level(g->opt_level)->attention_inputs_remade;
    return ir_choice_int(g, "save.attention_inputs", !remade) != 0;
}

bool precision_cheap_saved(const Graph *g)
{
    return ir_choice_int(g, "save.cheap", !precision_level(g->opt_level)->cheap_remade) != 0;
}

bool precision_activations_saved(const Graph *g)
{
    return ir_choice_int(g, "save.activations", !precision_level(g->opt_level)->activations_remade) != 0;
}

/* Per-group parameters of a codec'd state live in a persistent f32 tensor next to it:
 * EXPAND keeps (scale, exponent) per group, COMPAND and SQRT one absmax per group. */
static void attach_codec_scales(Graph *g, Node *state, Node *before)
{
    Format *f = &state->t.fmt;
    if (f->codec != CODEC_EXPAND && f->codec != CODEC_COMPAND && f->codec != CODEC_SQRT) return;
    int64_t groups = (ir_numel(&state->t) + f->group - 1) / f->group;
    int64_t dims[2] = {groups, f->codec == CODEC_EXPAND ? 2 : 1};
    Node *s = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s.scale", state->t.name), ROLE_SCALE, FMT_F32,
                      2, dims, state->loc);
    s->grad_of = state->grad_of;
    ir_move_before(g, s, before);
    f->scale = s;
}

static void set_state_format(Graph *g, Node *state, Format fmt, const Policy *p, Node *before)
{
    const Rule *r = stored_rule(g->arena, p, state->t.name, state->t.role);
    if (r) fmt = r->fmt;
    if (fmt.codec != CODEC_PLAIN && fmt.group <= 0) fmt.group = fmt.codec == CODEC_EXPAND ? 128 : 32;
    if (fmt.codec != CODEC_PLAIN) fmt.scaling = SCALE_PER_GROUP;
    else if (fmt.scaling != SCALE_NONE) fmt.scaling = SCALE_NONE, fmt.recipe = RECIPE_NONE;  /* plain states are unscaled */
    state->t.fmt = fmt;
    attach_codec_scales(g, state, before);
}

/* Adds "P:master" after the scalars of P's update (the 9th operand of AdamW's, the 8th of Lion's
 * and SGD's). */
static Node *add_master(Graph *g, Node *adamw, const PrecisionLevel *l, const Policy *p)
{
    int base = adamw->n_in;
    Node *param = adamw->in[0];
    Node *m = ir_leaf(g, OP_STATE, arena_printf(g->arena, "%s:master", param->t.name), ROLE_MASTER,
                      l->master, param->t.rank, param->t.dims, param->loc);
    m->grad_of = param;
    m->phase = PHASE_UPDATE;
    ir_move_before(g, m, adamw);
    Format f = fmt_plain(l->master);
    f.codec = l->master_codec;
    const Rule *r = stored_rule(g->arena, p, m->t.name, ROLE_MASTER);
    if (r) f = r->fmt;
    if (f.elem == FMT_I8 && f.codec == CODEC_PLAIN) f.codec = CODEC_SPLIT;
    m->t.fmt = f;
    Node **in = arena_alloc(g->arena, sizeof(Node *) * (size_t)(base + 1));
    memcpy(in, adamw->in, sizeof(Node *) * (size_t)base);
    in[base] = m;
    adamw->in = in;
    adamw->n_in = base + 1;
    return m;
}

/* Forward values with a reader outside the forward pass are kept for the backward. The loss's
 * own backward does not count: it runs right after the loss (chunk by chunk, see chunk_loss.c),
 * so the logits and targets it reads are never held across the step. */
static void mark_saved(Graph *g)
{
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++) {
        Node *n = g->nodes[i];
        if (n->phase != PHASE_FORWARD || n->n_in == 0) continue;
        if (n->t.role != ROLE_ACTIVATION && n->t.role != ROLE_SAVED) continue;
        n->t.role = ROLE_ACTIVATION;
        for (int k = 0; k < uses[i].n; k++) {
            const Node *r = uses[i].list[k];
            if (r->phase != PHASE_FORWARD && r->op != OP_CROSS_ENTROPY_BWD) {
                n->t.role = ROLE_SAVED;
                break;
            }
        }
    }
}

static bool stays_f32(const Node *n)
{
    if (n->t.rank == 0) return true;   /* losses, norms, clip coefficients, scales */
    switch (n->op) {
    case OP_QUANT_SCALE: case OP_SQNORM: case OP_CROSS_ENTROPY: case OP_GRAD_NORM: case OP_CLIP_COEF:
        return true;
    default:
        return false;
    }
}

/* The parameter whose gradient the weight-gradient GEMM mm computes, or NULL. dW = x^T dy has
 * no parameter among its operands; its result flows, through the reshapes, casts, transposes,
 * sums and concats autodiff joins contributions with, into the node that autodiff names P.grad
 * (grad_of = P), or into P's gradient accumulator. A few steps suffice: autodiff puts at most
 * a reshape, a sum of tied uses and a concat of slices between them. */
static const Node *wgrad_param(const Node *mm, const Uses *uses)
{
    const Node *frontier[16], *next[16];
    int n = 1;
    frontier[0] = mm;
    for (int depth = 0; depth < 6 && n; depth++) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            const Node *x = frontier[i];
            if (x->grad_of && x->grad_of->op == OP_PARAM) return x->grad_of;
            if (x->op == OP_ACCUMULATE && x->in[0]->grad_of && x->in[0]->grad_of->op == OP_PARAM)
                return x->in[0]->grad_of;
            const Uses *u = &uses[x->index];
            for (int k = 0; k < u->n && m < 16; k++) {
                const Node *r = u->list[k];
                if (r->op == OP_RESHAPE || r->op == OP_CAST || r->op == OP_TRANSPOSE || r->op == OP_ADD_N ||
                    r->op == OP_ADD || r->op == OP_CONCAT || r->op == OP_ACCUMULATE || r->op == OP_SCALE)
                    next[m++] = r;
            }
        }
        memcpy(frontier, next, sizeof *next * (size_t)m);
        n = m;
    }
    return NULL;
}

/* Which of a linear layer's GEMMs mm is (GEMM_FWD, _DGRAD, _WGRAD) and the name gemm: rules
 * match it by: its weight's (the parameter among its operands, or for a weight gradient the
 * parameter it is the gradient of). A GEMM of two values (no weight) matches by its result's
 * name, "" when it has none, so that "*" reaches every GEMM. */
static int gemm_kind(const Node *mm, const Uses *uses, const char **name)
{
    /* a forward GEMM made again in the backward (passes/recompute.c) is the forward's: the
     * rules that reach the forward reach it, so that it makes the same values */
    bool forward = mm->phase == PHASE_FORWARD || ir_is_recomputed(mm);
    for (int i = 0; i < 2; i++) {
        const Node *x = mm->in[i];
        while ((x->op == OP_CAST || x->op == OP_RESHAPE) && x->n_in) x = x->in[0];
        if (x->op == OP_PARAM) {
            *name = x->t.name;
            return forward ? GEMM_FWD : GEMM_DGRAD;
        }
    }
    *name = mm->t.name ? mm->t.name : "";
    if (forward) return GEMM_FWD;
    const Node *p = wgrad_param(mm, uses);
    if (!p) return GEMM_DGRAD;
    *name = p->t.name;
    return GEMM_WGRAD;
}

const char *precision_gemm_kind(const Node *mm, const Uses *uses, const char **weight)
{
    int kind = gemm_kind(mm, uses, weight);
    return kind == GEMM_FWD ? "fwd" : kind == GEMM_DGRAD ? "dgrad" : "wgrad";
}

/* The add of a bias to x: the other operand is broadcast over x's rows. */
static bool is_bias_add(const Node *add, const Node *x)
{
    if (add->op != OP_ADD || add->n_in != 2) return false;
    const Node *b = add->in[0] == x ? add->in[1] : add->in[0];
    return b->t.rank < x->t.rank;
}

/* A GEMM whose result flows (through reshapes, casts and the add of a bias) into the loss's
 * cross-entropy, or the backward of such a GEMM: the output head. */
static bool is_head_gemm(const Node *mm, const Uses *uses, const Graph *g)
{
    const Node *x = mm;
    for (int depth = 0; depth < 4; depth++) {
        const Uses *u = &uses[x->index];
        for (int k = 0; k < u->n; k++)
            if (u->list[k]->op == OP_CROSS_ENTROPY || u->list[k]->op == OP_CROSS_ENTROPY_BWD) return true;
        if (u->n != 1) break;
        const Node *r = u->list[0];
        if (r->op != OP_RESHAPE && r->op != OP_CAST && !is_bias_add(r, x)) break;
        x = r;
    }
    /* backward GEMMs of the head read the cross-entropy gradient directly */
    for (int i = 0; i < mm->n_in; i++)
        if (mm->in[i]->op == OP_CROSS_ENTROPY_BWD) return true;
    (void)g;
    return false;
}

/* O2/O3 default for a saved value, from who reads it in the backward. */
static Format saved_default(const Node *x, const Uses *u)
{
    bool nonlinear = false, fp8_gemm = false;
    for (int k = 0; k < u->n; k++) {
        const Node *r = u->list[k];
        if (r->phase == PHASE_FORWARD) continue;
        switch (r->op) {
        case OP_ATTENTION_BWD: case OP_CROSS_ENTROPY_BWD: case OP_EMBEDDING_BWD:
            return fmt_plain(FMT_VOID);
        case OP_MATMUL:
            if (IR_IATTR(r, MATMUL, fp8)) fp8_gemm = true;
            else return fmt_plain(FMT_VOID);   /* a bf16 GEMM wants its operand in bf16 */
            break;
        default:
            nonlinear = true;
        }
    }
    Format f = {.elem = FMT_E4M3, .scaling = SCALE_PER_TENSOR, .recipe = RECIPE_CURRENT};
    if (nonlinear) f.scaling = SCALE_PER_GROUP, f.group = 16;
    else if (!fp8_gemm) return fmt_plain(FMT_VOID);
    return f;
}

/* Whether b is a, or the copy of a that the backward makes again (passes/recompute.c:
 * save.attention_inputs=0 gives attention's backward copies of q, k, v): the same op with the
 * same attributes and result type over the same values, so the same bits. */
static bool same_value(const Node *a, const Node *b)
{
    if (a == b) return true;
    if (!ir_is_recomputed(b) || a->op != b->op || a->n_in != b->n_in || a->t.fmt.elem != b->t.fmt.elem ||
        memcmp(a->iattr, b->iattr, sizeof a->iattr) || memcmp(a->fattr, b->fattr, sizeof a->fattr))
        return false;
    for (int i = 0; i < a->n_in; i++)
        if (!same_value(a->in[i], b->in[i])) return false;
    return true;
}

/* The forward attention whose backward p is: the same inputs (or their copies), same heads. */
static Node *attention_of(Node *p, const Graph *g)
{
    for (int k = 0; k < g->n_nodes; k++) {
        Node *a = g->nodes[k];
        if (a->op != OP_ATTENTION || a->n_in != p->n_in - 1 ||
            IR_IATTR(a, ATTENTION, heads) != IR_IATTR(p, ATTENTION_BWD, heads) ||
            IR_IATTR(a, ATTENTION, kv_heads) != IR_IATTR(p, ATTENTION_BWD, kv_heads))
            continue;
        bool same = true;
        for (int i = 0; i < a->n_in; i++) same &= same_value(a->in[i], p->in[1 + i]);
        if (same) return a;
    }
    return NULL;
}

/* Where the backward keeps an attention's result y in its own format anyway (other backward
 * nodes read it, and it is saved as itself: O0, O1), attention_bwd reads y too, and the forward
 * stores the logsumexp of each row after y (lse=1): the backward then needs neither the
 * forward's probabilities' statistics nor its output again, only rowsum(dy * y), instead of
 * rerunning the forward. At O2/O3 y is kept as an FP8 copy and the backward recomputes. */
static void attention_reads_y(Graph *g)
{
    for (int i = 0; i < g->n_nodes; i++) {
        Node *p = g->nodes[i];
        if (p->op != OP_ATTENTION_BWD || ir_attention_bwd_reads_y(p)) continue;
        Node *y = attention_of(p, g);
        if (!y || y->t.role != ROLE_SAVED || y->t.saved_as.elem != FMT_VOID || y->t.fmt.codec != CODEC_PLAIN ||
            y->t.fmt.scaling != SCALE_NONE || !fmt_elem_is_float(y->t.fmt.elem))
            continue;
        Node **in = arena_alloc(g->arena, sizeof *in * (size_t)(p->n_in + 1));
        memcpy(in, p->in, sizeof *in * (size_t)p->n_in);
        in[p->n_in] = y;
        p->in = in;
        p->n_in++;
        IR_IATTR(y, ATTENTION, lse) = 1;
    }
}

/* Whether attention's result y is saved as itself at a level of FP8 saved activations: the
 * level's attention_y_kept, or the choice save.attention_y (a tuning record's winner, or
 * --choice), fp8c tune's point of saving against recomputing. Where activations are not saved
 * in FP8 (O0, O1) y is kept anyway, and a 0 there is refused: nothing would do it. */
static bool attention_y_choice(const Graph *g, const PrecisionLevel *level, bool *keep)
{
    int64_t v = ir_choice_int(g, "save.attention_y", level->attention_y_kept || !level->fp8_saved);
    if (!v && !level->fp8_saved) {
        diag_error((SrcLoc){0},
                   "save.attention_y=0: at -O%d attention's output is saved as itself (levels with FP8 saved "
                   "activations, -O2 and -O3, take the choice)", g->opt_level);
        return false;
    }
    *keep = v != 0;
    return true;
}

/* The rules of a build, in the order they apply: the recipe's, the policy file's, the command
 * line's. False after reporting a bad rule. */
static bool policy_build(Policy *policy, Arena *a, const PassOptions *opt)
{
    int errors = diag_error_count();
    if (opt->recipe) {
        SrcLoc at = {arena_printf(a, "<recipe %s>", opt->recipe->name), 0, 0};
        for (int i = 0; i < RECIPE_MAX_RULES && opt->recipe->rules[i]; i++)
            policy_add(policy, a, opt->recipe->rules[i], at);
    }
    if (opt->policy_file) policy_load_file(policy, a, opt->policy_file);
    for (int i = 0; i < opt->n_overrides; i++)
        policy_add(policy, a, opt->overrides[i], (SrcLoc){"<command line>", 0, 0});
    return diag_error_count() == errors;
}

/* A user's rule that matched nothing in the whole step would be obeyed in name only, most often
 * a misspelt name (`gemm:h.*.mlp.c_fc.wieght=bf16` leaves every GEMM as it was): it is an error
 * at the rule, as a decay pattern that matches no parameter is (lower_program.c). A recipe's
 * rules are written for every model and may find nothing in one; comm: rules are the comm
 * pass's. False after reporting. */
static bool policy_all_matched(const Policy *p)
{
    static const char *const what[] = {
        [RULE_TENSOR] = "parameter or optimizer state",
        [RULE_GEMM] = "GEMM's weight (or result, without a weight)",
        [RULE_SAVED] = "value the backward reads",
        [RULE_VALUE] = "value stored in 16 bits (losses and scalars stay f32)",
    };
    bool ok = true;
    for (int i = 0; i < p->n_rules; i++) {
        const Rule *r = &p->rules[i];
        if (r->matched || r->kind == RULE_COMM || !strncmp(r->loc.file, "<recipe ", 8)) continue;
        diag_error(r->loc, "'%s' matches no %s in the step (fp8c plan lists the names)", r->text,
                   what[r->kind]);
        ok = false;
    }
    return ok;
}

/* The comm pass asks for its one rule here rather than parse rules itself, so that a comm:
 * rule is read, checked and reported exactly as every other rule. The precision pass has
 * already reported a bad rule when the pipeline gets to comm, and stopped it. */
bool precision_comm_rule(Arena *a, const PassOptions *opt, ElemType *wire, const char **text, SrcLoc *loc)
{
    Policy policy = {0};
    if (!policy_build(&policy, a, opt)) return false;
    *wire = FMT_VOID;
    for (int i = 0; i < policy.n_rules; i++)
        if (policy.rules[i].kind == RULE_COMM) {
            *wire = policy.rules[i].fmt.elem;   /* later rules win */
            if (text) *text = policy.rules[i].text;
            if (loc) *loc = policy.rules[i].loc;
        }
    return true;
}

bool pass_precision(Graph *g, const PassOptions *opt)
{
    Policy policy = {0};
    int errors = diag_error_count();
    if (!policy_build(&policy, g->arena, opt)) return false;

    /* the level is the graph's (the driver sets it from -O; textual IR carries it as opt=) */
    const PrecisionLevel *level = precision_level(g->opt_level);
    mark_saved(g);

    /* persistent state: parameters, masters, gradient accumulators, Adam moments */
    int n = g->n_nodes;
    Node **updates = arena_alloc(g->arena, sizeof(Node *) * (size_t)(n ? n : 1));
    int n_updates = 0;
    for (int i = 0; i < n; i++)
        if (ir_op_is_update(g->nodes[i]->op)) updates[n_updates++] = g->nodes[i];
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (x->op == OP_PARAM) {
            const Rule *r = stored_rule(g->arena, &policy, x->t.name, ROLE_PARAM);
            x->t.fmt = fmt_plain(r ? r->fmt.elem : level->param);
        }
    }
    for (int k = 0; k < n_updates; k++) {
        Node *u = updates[k];
        /* Lion's and SGD's one state (their momentum) is stored as Adam's m is */
        bool two = ir_update_states(u) == 2;
        Node *param = u->in[0], *grad = u->in[1], *m = u->in[2], *v = two ? u->in[3] : NULL;
        /* a master copy is needed when the parameter is stored coarser than f32 */
        if (ir_adamw_master_index(u) < 0 && ir_adamw_copy_index(u) < 0 && param->t.fmt.elem != FMT_F32)
            add_master(g, u, level, &policy);
        Node *acc = grad;
        while (acc->op == OP_ACCUMULATE) acc = acc->in[0];
        if (acc->op == OP_STATE) set_state_format(g, acc, fmt_plain(level->grad), &policy, u);
        set_state_format(g, m, level->adam_m, &policy, u);
        if (v) set_state_format(g, v, level->adam_v, &policy, u);
    }
    if (diag_error_count() > errors) return false;

    /* transient values: bf16, scalars and losses f32; integers stay as they are */
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (x->n_in == 0 || ir_op_is_update(x->op) || !fmt_elem_is_float(x->t.fmt.elem)) continue;
        if (x->op == OP_ACCUMULATE || x->op == OP_AMAX_RECORD || x->op == OP_DELAYED_SCALE) {
            x->t.fmt = x->in[0]->t.fmt;
            continue;
        }
        if (x->op == OP_QUANTIZE) continue;
        bool f32 = stays_f32(x);
        const Rule *v = f32 ? NULL : policy_match(&policy, RULE_VALUE, x->t.name ? x->t.name : "");
        x->t.fmt = fmt_plain(f32 ? FMT_F32 : v ? v->fmt.elem : FMT_BF16);
        /* unnamed values are matched as "", by "*" (as value: rules match them) */
        const Rule *r = x->t.role == ROLE_SAVED ? policy_match(&policy, RULE_SAVED, x->t.name ? x->t.name : "") : NULL;
        if (r && !(r->fmt.elem == FMT_E4M3 || r->fmt.elem == FMT_E5M2)) x->t.fmt = fmt_plain(r->fmt.elem);
    }

    /* GEMMs: FP8 operands at O1 and above, except the output head; gemm: rules decide last */
    Uses *uses = ir_fill_uses(g);
    for (int i = 0; i < g->n_nodes; i++) {
        Node *mm = g->nodes[i];
        if (mm->op != OP_MATMUL) continue;
        bool fp8 = level->fp8_gemms && !is_head_gemm(mm, uses, g);
        const char *name;
        int kind = gemm_kind(mm, uses, &name);
        const Rule *r = policy_match_gemm(&policy, RULE_GEMM, kind, name);
        clear_fp8_attrs(mm);
        IR_IATTR(mm, MATMUL, fp8) = fp8 ? GEMM_FP8_TENSOR : GEMM_BF16;
        if (r) {
            fp8 = r->fmt.elem == FMT_E4M3 || r->fmt.elem == FMT_E5M2;
            /* rows and 1x128 tiles run along the features; the weight gradient x^T dy contracts
             * over the tokens, across them, so its operands are scaled per tensor */
            IR_IATTR(mm, MATMUL, fp8) = !fp8 ? GEMM_BF16
                                      : kind == GEMM_WGRAD ? GEMM_FP8_TENSOR
                                      : fmt_gemm_mode_of(r->fmt.scaling);
            IR_IATTR(mm, MATMUL, history) = fp8 && r->fmt.recipe == RECIPE_DELAYED ? r->fmt.history : 0;
            IR_IATTR(mm, MATMUL, grad_e4m3) = fp8 && r->fmt.elem == FMT_E4M3;
            IR_IATTR(mm, MATMUL, recent) = fp8 && r->fmt.recipe == RECIPE_DELAYED && !r->fmt.history_max;
            IR_IATTR(mm, MATMUL, margin) = fp8 ? r->fmt.margin : 0;
            IR_FATTR(mm, MATMUL, static_scale) =
                fp8 && r->fmt.recipe == RECIPE_STATIC ? r->fmt.static_scale : 0;
        }
        /* cuBLASLt's FP8 GEMMs need K and N (the operands' and the result's leading dims, both
         * operands being k-contiguous) to be multiples of 16, and the GPU backend runs them only
         * where M is one too (cuda/spec.c; at batch 3 x seq 50 an FP8 forward GEMM ran as f32
         * products of decoded operands). Such a GEMM runs in bf16 on every device, so that the
         * one kernel program is the same on all of them, and `fp8c plan` lists it
         * (unaligned=1). */
        int64_t m_dim, n_dim, k_dim;
        ir_matmul_dims(mm, &m_dim, &n_dim, &k_dim);
        if (IR_IATTR(mm, MATMUL, fp8) && !opt->fp8_any_shape &&
            (k_dim % PRECISION_FP8_GEMM_ALIGN || n_dim % PRECISION_FP8_GEMM_ALIGN ||
             m_dim % PRECISION_FP8_GEMM_ALIGN)) {
            clear_fp8_attrs(mm);
            IR_IATTR(mm, MATMUL, unaligned) = 1;
        } else {
            IR_IATTR(mm, MATMUL, unaligned) = 0;
        }
    }

    /* saved activations (COAT's mixed granularity at O2 and O3): what FP8 GEMMs of the backward
     * read is kept as the per-tensor e4m3 copy the forward GEMM made; what non-linear backward
     * ops read is kept in e4m3 with a scale per 1x16 group. Attention's q, k, v and the logits
     * stay as they are (the flash backward and the fused loss need them exact); so does its
     * result y where the level keeps it (O2, as FlashAttention's saved output is in COAT):
     * attention_reads_y then gives the backward y and the forward's logsumexp, and it reads
     * those instead of running the forward again (2.6 ms of a 69 ms GPT-2 d12 step on an H200,
     * for 0.58 GiB). O3 keeps the FP8 copy and reruns. */
    bool keep_y;
    if (!attention_y_choice(g, level, &keep_y)) return false;
    for (int i = 0; i < g->n_nodes; i++) {
        Node *x = g->nodes[i];
        if (x->t.role != ROLE_SAVED || !fmt_elem_is_float(x->t.fmt.elem)) continue;
        Format want = fmt_plain(FMT_VOID);
        bool kept = keep_y && x->op == OP_ATTENTION;
        if (level->fp8_saved && !kept) want = saved_default(x, &uses[i]);
        const Rule *r = policy_match(&policy, RULE_SAVED, x->t.name ? x->t.name : "");
        if (r) want = r->fmt.elem == x->t.fmt.elem && r->fmt.scaling == SCALE_NONE ? fmt_plain(FMT_VOID) : r->fmt;
        if (want.elem == FMT_E4M3 || want.elem == FMT_E5M2) {
            if (want.scaling == SCALE_NONE) want.scaling = SCALE_PER_TENSOR;
            if (want.recipe == RECIPE_NONE) want.recipe = RECIPE_CURRENT;
        }
        x->t.saved_as = want;
    }
    if (!policy_all_matched(&policy)) return false;
    attention_reads_y(g);
    return true;
}
