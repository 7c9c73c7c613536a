/* spec_attn.c — the plans of attention and its backward (cuda/kernels/attn*.cuh).
 *
 * plan_attention picks the kernels of one ATTENTION or ATTENTION_BWD node and their shapes:
 * the CUDA-core kernels (attn.cuh) for any format and head size, the tensor-core ones for bf16
 * at head dims 64 and 128 (attn_tc.cuh's mma.sync, attn_wgmma.cuh's warpgroup MMA, attn_ws.cuh's
 * producer warpgroup), the backward as its statistics, a dq pass and a dk/dv pass (or dq in the
 * dk/dv pass; on warpgroup MMA the dq pass makes the statistics from the saved y), with the
 * rules that choose among them where the choices (attn.*, docs/tuning.md) are not set: key
 * tiles of 128 from T 2048 on, the dk/dv pass of a grouped-query attention in parts by a
 * balance rule. plan_attention_choices plans the attentions again on warpgroup MMA
 * with the choices each node reads. What the kernels do and why is in their files and in
 * docs/gpu-backend.md. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec_internal.h"

/* the attention argument block: sizes, q/k/v strides and columns; t[] from the node, with a
 * packed q|k|v passed as q, k and v (three views of one tensor) */
static void attn_args(CuLaunch *l, const Node *n, bool packed, const int64_t *sz) {
    bool bwd = n->op == OP_ATTENTION_BWD;
    arg_node(l, 0, n);
    int base = bwd ? 2 : 1;
    if (bwd) arg_node(l, 1, n->in[0]);
    for (int k = 0; k < 3; k++) arg_node(l, base + k, n->in[packed ? base - 1 : base - 1 + k]);
    l->args.n_in = n->n_in;
    for (int k = 0; k < 11; k++) l->args.i[k] = sz[k];
    l->args.f[0] = IR_FATTR(n, ATTENTION, scale);
}

/* The parts of a wgmma dk/dv block's steps (attn_wgmma.cuh, PARTS): the choice
 * attn.dkv_parts where set, else the balance rule. A block of key tile kt walks the group's
 * query heads over the query tiles at and after it; its blocks run heaviest first on
 * ATTN_PLAN_SMS SMs, three blocks an SM (two where a step is whole, one for blocks of two
 * warpgroups). The pass takes at least as long as its longest block, so the rule halves the
 * blocks until the longest has at most half the steps that each place on the GPU gets on
 * average, at most eight parts. Llama 1.1B at 4 x 2048 takes 4 (its longest block 256 steps
 * whole, 171 a place on average; a simulation of the heaviest-first order put the pass at 0.67
 * of its work's balance whole, 0.97 in four parts); GPT-2 d12 and d48, whose heads are their own
 * groups and whose longest blocks take 16 steps, take 1. */
enum { ATTN_PLAN_SMS = 132 };
static int dkv_parts(const Spec *s, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
    if (s->attn_dkv_parts) return s->attn_dkv_parts;
    int64_t rows = 64 * s->attn_dkv_wgs, n_kt = (T + rows - 1) / rows, grp = H / Hkv, steps = 0;
    for (int64_t kt = 0; kt < n_kt; kt++) steps += grp * ((T - kt * rows + 63) / 64);
    int64_t per_sm = s->attn_dkv_wgs == 2 ? 1 : s->attn_dkv_split == 2 && D == 64 ? 3 : 2;
    double place = (double)(B * Hkv * steps) / (double)(ATTN_PLAN_SMS * per_sm);
    int64_t longest = grp * ((T + 63) / 64);
    int parts = 1;
    while (parts < 8 && (double)longest / parts > place / 2) parts *= 2;
    return parts;
}

bool plan_attention(Spec *s) {
    const Node *n = s->n;
    if (!check_io(s, n, true)) return false;
    bool bwd = n->op == OP_ATTENTION_BWD;
    const Node *ysaved = ir_attention_bwd_reads_y(n) ? n->in[n->n_in - 1] : NULL;
    int n_qkv = n->n_in - (bwd ? 1 : 0) - (ysaved != NULL);
    if (n_qkv != 1 && n_qkv != 3) return spec_fail(s, "takes q, k, v or a packed q|k|v");
    bool packed = n_qkv == 1;
    const Tensor *q = &n->in[bwd ? 1 : 0]->t;
    if (q->rank != 3) return spec_fail(s, "q is not (B, T, H*D)");
    int64_t B = q->dims[0], T = q->dims[1], H = IR_IATTR(n, ATTENTION, heads),
            Hkv = IR_IATTR(n, ATTENTION, kv_heads);
    int64_t width = packed ? q->dims[2] : 0;
    if (H <= 0 || Hkv <= 0 || H % Hkv) return spec_fail(s, "heads do not divide into kv heads");
    int64_t D = packed ? (q->dims[2] % (H + 2 * Hkv) ? 0 : q->dims[2] / (H + 2 * Hkv))
                       : (q->dims[2] % H ? 0 : q->dims[2] / H);
    if (D <= 0) return spec_fail(s, "heads %lld, kv_heads %lld do not divide q", (long long)H, (long long)Hkv);
    if (D % 16 || D > 128) return spec_fail(s, "head dim %lld: the GPU kernel takes multiples of 16 up to 128", (long long)D);
    int64_t sz[11] = {B, T, H, Hkv, D,
                      packed ? width : H * D, 0,
                      packed ? width : Hkv * D, packed ? H * D : 0,
                      packed ? width : Hkv * D, packed ? (H + Hkv) * D : 0};
    int64_t n_t = (T + 63) / 64;
    int base = bwd ? 1 : 0;
    const char *Y = fmt_arg(s, &n->t);
    const char *Q = fmt_arg(s, &n->in[base]->t);
    const char *K = fmt_arg(s, &n->in[packed ? base : base + 1]->t);
    const char *V = fmt_arg(s, &n->in[packed ? base : base + 2]->t);
    const char *DY = bwd ? fmt_arg(s, &n->in[0]->t) : F32_ARG;
    /* the tensor-core kernels take plain bf16 operands (read exactly as bf16) */
    bool tc = true;
    for (int i = 0; i < n->n_in; i++) {
        const Format *f = &n->in[i]->t.fmt;
        if (f->elem != FMT_BF16 || f->scaling != SCALE_NONE) tc = false;
    }
    /* tensor cores: 128 threads, shared memory as CkTc<D> in attn_tc.cuh (bf16 tiles of row
     * stride D + 8: q and double-buffered k, v forward; q, dy and double-buffered k, v for dq;
     * k, v and double-buffered q, dy, lse, Dt for dk/dv) */
    int64_t tile = 64 * (D + 8) * 2;
    unsigned threads = tc ? 128 : 256;
    unsigned fwd_smem = (unsigned)(tc ? 5 * tile : (3 * 64 * (D + 1) + 64 * 65) * 4);
    unsigned dq_smem = (unsigned)(tc ? 6 * tile : (4 * 64 * (D + 1) + 64 * 65) * 4);
    unsigned dkv_smem = (unsigned)(tc ? 6 * tile + 4 * 64 * 4 : (4 * 64 * (D + 1) + 2 * 64 * 65 + 2 * 64) * 4);
    const char *fwd = tc ? "ck_attn_tc_fwd" : "ck_attn_fwd";
    /* warpgroup MMA (attn_wgmma.cuh; the choice attn.wgmma) for the forward and the
     * backward's rerun of it: 256 threads a block of 128 query rows, shared memory as CkWg<D>
     * (1 KiB of alignment slack, the q tile, k and v twice, unpadded: the rows are swizzled).
     * Two blocks an SM, so that one's loads and softmax run under the other's products: at
     * D 128 that caps a thread at 128 registers (135 uncapped; no spills either way) */
    bool wg = tc && s->attn_wgmma && (D == 64 || D == 128);
    unsigned fwd_blocks = (unsigned)(B * H * (wg ? (T + 127) / 128 : n_t)), fwd_threads = wg ? 256 : threads;
    if (wg) fwd = "ck_attn_wg_fwd", fwd_smem = (unsigned)(1024 + 128 * D * 2 + 4 * 64 * D * 2);
    /* at D 64, pipelined (attn.fwd_pipeline=1): CkWgPipe's k tiles twice and v three times.
     * Not the default: on an H200 it took 3.41 ms of a d12 -O1 step's forward against 3.23,
     * and Llama -O1's step 112.65 ms against 111.93 (docs/results.md) */
    if (wg && D == 64 && s->attn_fwd_pipe) fwd = "ck_attn_wg_fwd_pipe", fwd_smem = (unsigned)(1024 + 128 * D * 2 + 5 * 64 * D * 2);
    /* a producer warpgroup and a ring of k, v tiles (attn.fwd_ws = 2 or 3 consumer warpgroups;
     * attn_ws.cuh): 128 (WGS + 1) threads, one block an SM (at most 16 warps an SM keep 128
     * registers a thread), shared memory as CkWs<D, WGS> (q, the slots: four at D 64, three
     * at 128; the barriers). Slower on an H200 than ck_attn_wg_fwd, so off by default. With
     * attn.fwd_tma=1 one producer thread loads by TMA through tensor maps of q, k and v that
     * the executor makes (CuLaunch.tma; not yet run on a GPU) */
    unsigned fwd_min_blocks = wg ? 2 : 0;
    char fwd_head[64];   /* the forward's name and its template arguments before MODE */
    snprintf(fwd_head, sizeof fwd_head, "%s<%lld", fwd, (long long)D);
    /* Key tiles of 128 (attn.fwd_keys=128; at head dim 64 only) run on the producer
     * warpgroup's forward, with three consumer warpgroups and TMA loads where attn.fwd_ws and
     * attn.fwd_tma do not say otherwise. On an H200 Llama 1.1B's forwards (T 2048, 32 heads on
     * 4) took 4.93 ms a step so against 5.62 with the default kernel, and its steps were 0.3 to
     * 0.6 ms shorter in alternating runs in two calls; GPT-2's (T 1024) were slower, d12 2.90
     * against 2.81 and d48 6.35 against 6.23 (docs/results.md, "(s)", "(t)"). The rule, where
     * the choice is not given: tiles of 128 from T 2048 on. */
    int64_t keys = s->attn_fwd_keys == 128 || (s->attn_fwd_keys < 0 && T >= 2048) ? 128 : 64;
    if (D != 64) keys = 64;
    int wgs = s->attn_fwd_ws >= 0 ? s->attn_fwd_ws : keys == 128 ? 3 : 0;
    int tma = s->attn_fwd_tma >= 0 ? s->attn_fwd_tma : keys == 128;
    if (!wgs) keys = 64;
    bool ws = wg && wgs;
    if (ws) {
        /* pipelined with attn.fwd_pipeline; the ring as CkWs<D, WGS, KEYS> */
        int64_t stages = D * keys <= 4096 ? 4 : 3, rows = 64 * wgs;
        snprintf(fwd_head, sizeof fwd_head, "ck_attn_ws_fwd<%lld, %d, %d, %lld, %d", (long long)D, wgs, tma,
                 (long long)keys, s->attn_fwd_pipe ? 1 : 0);
        fwd_threads = (unsigned)(128 * (wgs + 1)), fwd_min_blocks = 1;
        fwd_blocks = (unsigned)(B * H * ((T + rows - 1) / rows));
        fwd_smem = (unsigned)(1024 + rows * D * 2 + stages * 2 * keys * D * 2 + (1 + 2 * stages) * 8);
    }
    /* the wgmma kernels' block order (attn.head_group): a last template argument */
    char hg[16] = "";
    if (wg && s->attn_head_group) snprintf(hg, sizeof hg, ", %d", s->attn_head_group);
    CuLaunch *l;
    if (!bwd) {
        l = spec_launch(s, "attn", fwd_blocks, fwd_threads, "%s, 0, %s, %s, %s, %s, %s%s>(a)", fwd_head, Y, Q, K, V,
                        F32_ARG, hg);
        l->smem = fwd_smem;
        l->min_blocks = fwd_min_blocks;
        attn_args(l, n, packed, sz);
        l->args.i[11] = ir_attention_lse_offset(n);
        if (ws && tma) l->tma = 3, l->tma_first = 1, l->tma_stride = 5;   /* q, k, v; widths i[5, 7, 9] */
        return true;
    }
    /* dq in the dk/dv pass (attn.dq_in_dkv=1; attn_wgmma.cuh, ONE): where one warpgroup owns 64
     * keys at head dim 64 and the statistics pass, which zeroes its counters, is the light one
     * over the saved y. The scratch holds, after lse and Dt, a counter per (b, h, 64 queries)
     * and one for the blocks' numbers, then the f32 sums of dq (B, H, T, 64). Off by default:
     * slower on an H200 at every shape measured (attn_wgmma.cuh) */
    bool one = s->attn_wgmma && s->attn_wgmma_bwd && s->attn_dq_in_dkv && D == 64 && s->attn_dkv_wgs == 1 &&
               tc && ysaved && ir_attention_lse_offset(ysaved);
    int64_t counters = ((B * H * ((T + 63) / 64) + 1) * 4 + 255) / 256 * 256;
    /* a key tile's dk/dv steps in parts (attn.dkv_parts; attn_wgmma.cuh, PARTS): after lse and
     * Dt, a ticket per key tile (B Hkv ceil(T / 64), zeroed by the dq pass), then each part's
     * f32 sums of dk and dv, D floats a thread */
    bool wg_bwd = tc && s->attn_wgmma && s->attn_wgmma_bwd && (D == 64 || D == 128);
    int parts = wg_bwd && !one ? dkv_parts(s, B, T, H, Hkv, D) : 1;
    int64_t sums = 0;
    if (parts > 1) {
        int64_t tickets = (B * Hkv * ((T + 63) / 64) * 4 + 255) / 256 * 256, rows = 64 * s->attn_dkv_wgs;
        sums = tickets + B * Hkv * ((T + rows - 1) / rows) * parts * D * 2 * rows * 4;
    }
    need_scratch(s, 2 * B * H * T * 4 + (one ? counters + B * H * T * 64 * 4 : 0) + sums);
    /* where the forward stored lse after y, the statistics are Dt = dy . y and a copy of lse:
     * the wgmma dq pass makes them for its rows as it starts (attn_wgmma.cuh, CkRowsY) and stores
     * them for the dk/dv pass, one launch and a pass over dy fewer; otherwise a light pass of
     * their own (32 / lanes rows a warp, 8 warps, as ck_attn_stat_lanes) does, or, without the
     * saved y, the forward run again */
    bool y_stats = ysaved && ir_attention_lse_offset(ysaved);
    bool stats_in_dq = y_stats && wg_bwd && !one;
    if (y_stats && !stats_in_dq) {
        int64_t lanes = D % 8 == 0 && 32 % (D / 8) == 0 ? D / 8 : 32, rows = 8 * (32 / lanes);
        l = spec_launch(s, "attnsaved", (unsigned)((B * T * H + rows - 1) / rows), 256,
                        "ck_attn_saved_stats<%s, %s, %d>(a)", DY, fmt_arg(s, &ysaved->t), one);
        attn_args(l, n, packed, sz);
        arg_node(l, 5, ysaved);
        l->args.i[11] = ir_attention_lse_offset(ysaved);
        l->scratch = 0;
    } else if (!y_stats) {
        l = spec_launch(s, "attnstat", fwd_blocks, fwd_threads, "%s, 1, %s, %s, %s, %s, %s%s>(a)", fwd_head, F32_ARG,
                        Q, K, V, DY, hg);
        l->smem = fwd_smem;
        l->min_blocks = fwd_min_blocks;
        attn_args(l, n, packed, sz);
        if (ws && tma) l->tma = 3, l->tma_first = 2, l->tma_stride = 5;   /* after dy */
        l->scratch = 0;
    }
    /* the dq and dk/dv passes on warpgroup MMA (attn_wgmma.cuh; the choice attn.wgmma_bwd):
     * blocks of WGS warpgroups (128 WGS threads) own 64 WGS query rows (dq) or keys (dk/dv);
     * shared memory as CkWgBwd<D, WGS> (1 KiB of alignment slack, the block's two whole tiles,
     * the stepped pair twice, for dk/dv their lse and Dt twice) */
    char dq[64], dkv[64];
    snprintf(dq, sizeof dq, "%s<%lld", tc ? "ck_attn_tc_dq" : "ck_attn_dq", (long long)D);
    snprintf(dkv, sizeof dkv, "%s<%lld", tc ? "ck_attn_tc_dkv" : "ck_attn_dkv", (long long)D);
    unsigned dq_threads = threads, dkv_threads = threads;
    unsigned dq_blocks = (unsigned)(B * H * n_t), dkv_blocks = (unsigned)(B * Hkv * n_t);
    if (wg_bwd) {
        int64_t step = 64 * D * 2, dq_rows = 64 * s->attn_dq_wgs, dkv_rows = 64 * s->attn_dkv_wgs;
        snprintf(dq, sizeof dq, "ck_attn_wg_dq<%lld, %d", (long long)D, s->attn_dq_wgs);
        snprintf(dkv, sizeof dkv, "ck_attn_wg_dkv<%lld, %d", (long long)D, s->attn_dkv_wgs);
        dq_threads = (unsigned)(2 * dq_rows), dkv_threads = (unsigned)(2 * dkv_rows);
        dq_blocks = (unsigned)(B * H * ((T + dq_rows - 1) / dq_rows));
        dkv_blocks = (unsigned)(B * Hkv * ((T + dkv_rows - 1) / dkv_rows) * parts);
        dq_smem = (unsigned)(1024 + 2 * dq_rows * D * 2 + 4 * step);
        dkv_smem = (unsigned)(1024 + 2 * dkv_rows * D * 2 + 4 * step + 4 * 64 * 4);
    }
    const char *bwd_hg = wg_bwd ? hg : "";
    if (!one) {
        /* with parts, the dq pass zeroes the dk/dv pass's tickets (ZERO); with the statistics,
         * it reads the saved y in its format (YS) */
        char dq_tail[96];
        if (stats_in_dq)
            snprintf(dq_tail, sizeof dq_tail, ", %d, %d, %s", s->attn_head_group, parts > 1,
                     fmt_arg(s, &ysaved->t));
        else if (parts > 1)
            snprintf(dq_tail, sizeof dq_tail, ", %d, 1", s->attn_head_group);
        l = spec_launch(s, "attndq", dq_blocks, dq_threads, "%s, %s, %s, %s, %s, %s%s>(a)", dq, Y, DY, Q, K, V,
                        stats_in_dq || parts > 1 ? dq_tail : bwd_hg);
        l->smem = dq_smem;
        /* two blocks of two warpgroups an SM: at most 128 registers a thread (uncapped, NVRTC
         * takes 141 at D 64, and one block an SM) */
        if (wg_bwd && s->attn_dq_wgs == 2) l->min_blocks = 2;
        l->scratch = 0;
        attn_args(l, n, packed, sz);
        if (stats_in_dq) {
            arg_node(l, 5, ysaved);
            l->args.i[11] = ir_attention_lse_offset(ysaved);
        }
    }
    /* a dk/dv step in two parts of 32 queries (attn.dkv_split=2) holds fewer registers: at one
     * warpgroup a block, three blocks an SM where the whole step's 170 registers allow two */
    char split[48] = "";
    bool halves = wg_bwd && s->attn_dkv_split == 2;
    if (parts > 1)
        snprintf(split, sizeof split, ", %d, %d, 0, %d", s->attn_head_group, halves ? 2 : 1, parts);
    else if (halves || one)
        snprintf(split, sizeof split, ", %d, %d, %d", s->attn_head_group, halves ? 2 : 1, one);
    l = spec_launch(s, "attndkv", dkv_blocks, dkv_threads, "%s, %s, %s, %s, %s, %s%s>(a)", dkv, Y, DY, Q, K, V,
                    halves || one || parts > 1 ? split : bwd_hg);
    l->smem = dkv_smem + (one ? 64 * 64 * 2 + 64 * 64 * 4 : 0);   /* ONE: the step's dS^T, the part waiting */
    if (halves && s->attn_dkv_wgs == 1 && D == 64) l->min_blocks = 3;
    l->scratch = 0;
    attn_args(l, n, packed, sz);
    return true;
}

/* attn.wgmma and attn.wgmma_bwd, on unless set to 0; attn.dq_rows and attn.dkv_rows; each as
 * "NAME@ID" for one node before "NAME" (ir_choice_on, ir_choice_int_at). On
 * an H200 the warpgroup-MMA forward took 0.267 ms a layer of GPT-2 d12 at batch 32 against
 * attn_tc's 0.327, and 0.273 against 0.345 for Llama 1.1B's (docs/results.md); 0 keeps attn_tc.
 * attn.wgmma_bwd (with attn.wgmma) moves the backward's dq and dk/dv passes too. */
void plan_attention_choices(const Graph *g, CuNodePlan *plans, Arena *a) {
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if ((n->op != OP_ATTENTION && n->op != OP_ATTENTION_BWD) || ir_amax_parts_offset(n) ||
            !ir_choice_on(g, "attn.wgmma", n))
            continue;
        char why[256];
        CuNodePlan wgp;
        Spec s = spec_for(g, n, a, &wgp, why, sizeof why);
        s.attn_wgmma = true;
        s.attn_wgmma_bwd = ir_choice_on(g, "attn.wgmma_bwd", n);
        s.attn_fwd_pipe = ir_choice_int_at(g, "attn.fwd_pipeline", n, 0) == 1;
        int64_t ws = ir_choice_int_at(g, "attn.fwd_ws", n, -1);
        s.attn_fwd_ws = ws == 2 || ws == 3 ? (int)ws : ws == 0 ? 0 : -1;
        int64_t tma = ir_choice_int_at(g, "attn.fwd_tma", n, -1);
        s.attn_fwd_tma = tma == 0 || tma == 1 ? (int)tma : -1;
        s.attn_fwd_keys = (int)ir_choice_int_at(g, "attn.fwd_keys", n, -1);   /* -1: the rule's */
        s.attn_dq_wgs = ir_choice_int_at(g, "attn.dq_rows", n, 128) == 64 ? 1 : 2;
        s.attn_dkv_wgs = ir_choice_int_at(g, "attn.dkv_rows", n, 64) == 128 ? 2 : 1;
        int64_t group = ir_choice_int_at(g, "attn.head_group", n, 0);
        s.attn_head_group = group > 0 && group <= 1024 ? (int)group : 0;
        s.attn_dkv_split = ir_choice_int_at(g, "attn.dkv_split", n, 2) == 1 ? 1 : 2;
        s.attn_dq_in_dkv = ir_choice_int_at(g, "attn.dq_in_dkv", n, 0) == 1;
        int64_t parts = ir_choice_int_at(g, "attn.dkv_parts", n, 0);
        s.attn_dkv_parts = parts >= 1 && parts <= 8 ? (int)parts : 0;
        if (plan_attention(&s)) plans[i] = wgp;
    }
}

