/* attn_ws.cuh — the attention forward with a producer warpgroup (warp specialization).
 *
 * ck_attn_wg_fwd (attn_wgmma.cuh) has every thread load: at the top of each 64-key step all
 * 256 threads wait for their copies of the tile, meet at a barrier and issue the next tile's
 * copies, so the block's two warpgroups start every step together and one tile is in flight.
 * Here the loading is a warpgroup's own work. A block is WGS consumer warpgroups (64 query rows
 * each: 192 rows at WGS 3, 128 at 2) and one producer warpgroup, one block an SM (16 warps an
 * SM at WGS 3, the most that keep 128 registers a thread). The producer copies Q and then the
 * K and V tiles into a ring of STAGES slots, as far ahead as the ring allows; the consumers
 * take the tiles in order and hand each slot back when all are done with it. Nothing makes
 * the warpgroups wait for each other, so one's softmax may run while another's products are
 * on the tensor cores.
 *
 * The hand-over is two arrays of shared-memory barriers (mbarrier), each passing through
 * phases 0, 1, 0, ... as its arrivals complete:
 *   full[s]   128 arrivals, one per producer thread: its copies of the tile in slot s landed;
 *   empty[s]  4 WGS arrivals, one per consumer warp: the warp's products have read slot s.
 * Tile j sits in slot j % STAGES and is the (j / STAGES)-th use of it, so a consumer waits for
 * phase parity (j / STAGES) & 1 of full[s], and the producer, before it reuses the slot for
 * tile j, for parity (j / STAGES - 1) & 1 of empty[s]. A consumer whose rows end before the
 * last tile (the upper warpgroups of a diagonal block, or rows past T) still waits for each
 * tile and hands it back, so that every phase of empty[s] gets its arrivals in order.
 *
 * The copies are cp.async, and each producer thread, once it has issued a tile's, arrives on
 * full[s] through cp.async.mbarrier.arrive.noinc: the arrival happens when its copies have
 * landed, and the thread goes on to the next tile at once. They are writes through the
 * generic proxy, and wgmma reads shared memory through the async proxy, so a consumer fences
 * the two (fence.proxy.async) after its wait and before its products read the tile.
 *
 * Measured on an H200 it is slower than ck_attn_wg_fwd, so the choice attn.fwd_ws is 0 by
 * default and not among fp8c tune's candidates (docs/results.md "(n)"): a GPT-2 d12 -O1 step's
 * forwards took 3.36 ms at WGS 3 and 3.75 at WGS 2 against 2.84, Llama 1.1B's 5.75 against
 * 5.68. Three versions were measured. A producer warp that waited for its own copies before
 * arriving kept one tile in flight and doubled the forward's time; with arrivals on landing,
 * one warp could not issue the copies as fast as three warpgroups use them (ncu: the
 * consumers' waits on full[s] held two fifths of the kernel's stall samples); a producer
 * warpgroup feeds them, but three consumer warpgroups an SM overlap less than
 * ck_attn_wg_fwd's two blocks of two. What FlashAttention-3 has besides is TMA: one thread's
 * instruction a tile instead of a warpgroup's 16-byte copies, through a tensor map made on the
 * host for each operand. With attn.fwd_tma (below) the producer loads so. It is right (within
 * 2.6e-3 of the reference, the same bytes run to run) and no faster: d12's forwards 3.29 ms at
 * WGS 3 and 3.70 at WGS 2 against the default's 2.82, Llama's 5.69 against 5.64 (results.md
 * "(o)"). The loads were not what held the consumers back; their own overlap is.
 *
 * Two more forms (the choices attn.fwd_keys and attn.fwd_pipeline), both right and the same
 * bytes run to run (test_gpu_ops): key tiles of 128 (KEYS), the consumers taking the registers
 * the producer gives back (setmaxnreg: 160 a consumer thread at WGS 3 with TMA), where Llama
 * 1.1B's forwards (T 2048) took 4.93 ms a step against the default's 5.62 and GPT-2's (T 1024)
 * were slower (d12 2.90 against 2.81); and each consumer's products overlapped with its
 * softmax (PIPE, ck_wg_pipe_step), slower in every form measured (d12 3.26 ms at KEYS 128,
 * 3.37 at 64; Llama 5.72). docs/results.md "(s)".
 *
 * The products (ck_wg_qk, ck_wg_pv), the tile layout (128-byte swizzle, attn_wgmma.cuh) and
 * the outputs are ck_attn_wg_fwd's. Its whole tile as one function shared with
 * ck_attn_wg_fwd gave that kernel other code (123 registers, not the 120 measured); the two
 * products and the softmax's masking and sums as functions give every attention kernel the
 * machine code it had (the same bytes, compared in the cubins). The softmax differs in one
 * rounding: each probability is 2^(s scale log2(e) - m) with the scaling and
 * the subtraction in one fused multiply-add (ck_ws_softmax_tile), where ck_softmax_tile rounds
 * s scale log2(e) first; the row maximum is taken over the raw scores, which scaling by a
 * positive number keeps in order, so m and the logsumexp stored for the backward are the same
 * values. Results repeat bit for bit. */

template <int D, int WGS, int KEYS = 64> struct CkWs {
    enum {
        THREADS = 128 * (WGS + 1),                 /* WGS consumer warpgroups, then the producer's */
        BM = 64 * WGS,                             /* query rows of a block */
        BN = KEYS,                                 /* keys of a tile: 64 or 128 */
        STAGES = D * KEYS <= 4096 ? 4 : 3,         /* k, v slots of the ring */
        Q_BYTES = BM * D * 2,
        TILE = BN * D * 2,                         /* one k or v tile */
        BARS = Q_BYTES + STAGES * 2 * TILE,        /* the barriers, from the aligned start */
        SMEM = 1024 + BARS + (1 + 2 * STAGES) * 8  /* slack to align to 1024; q; slots; barriers */
    };
};

static __device__ __forceinline__ void ck_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* arrive (release: the caller's earlier accesses happen before the phase completes) */
static __device__ __forceinline__ void ck_mbar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
/* wait until the phase of parity `parity` has completed (acquire) */
static __device__ __forceinline__ void ck_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
/* an arrival on the barrier once every cp.async the thread has issued so far has landed; the
 * barrier's count includes it (.noinc), and the thread goes on at once */
static __device__ __forceinline__ void ck_mbar_arrive_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

/* ck_softmax_tile with the scaling fused into the exponent's argument (see the head of the
 * file); the same fragment layout, masks and outputs */
template <int NB = 8>
static __device__ __forceinline__ void ck_ws_softmax_tile(float (*s)[4], float scale2, bool edge, int k0, int row0,
                                                          int tig, int Ti, float *m, float *l, unsigned (*pf)[4],
                                                          float *corr) {
    float mx[2];
    ck_tile_mask_max<NB>(s, edge, k0, row0, tig, Ti, mx);
    ck_softmax_rows<NB, true>(s, mx, scale2, m, l, pf, corr);
}

/* TMA (attn.fwd_tma): a.tmaps holds the tensor maps of q, k and v that the executor made
 * (cuda/exec.c, exec_tensor_maps: a 3-D view of width, T rows, B batches, 64 x 64 boxes with
 * the 128-byte swizzle, rows past T read as zeros). One thread issues a box's copy, the
 * hardware writes the box in the layout the descriptors name and counts its bytes on the
 * barrier, which the thread told to expect them (mbarrier expect_tx). The maps are in global
 * memory, written by the host before the launch; a proxy fence makes them the tensor-map
 * proxy's before the first copy. Not yet run on a GPU. */
static __device__ __forceinline__ void ck_mbar_expect(unsigned bar, unsigned bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void ck_tma_box(unsigned dst, const void *map, int x, int y, int z, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4}], [%5];\n" ::"r"(dst),
                 "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
                 : "memory");
}
/* rows [t0, t0 + R) of the head whose columns start at col into the swizzled tile at dst: a
 * box for each 64 rows and each 64 columns (a column block of R rows, as ck_wg_chunk) */
template <int D, int R>
static __device__ __forceinline__ void ck_tma_tile(unsigned dst, const void *map, int col, int t0, int b, unsigned bar) {
#pragma unroll
    for (int cb = 0; cb < D / 64; cb++)
#pragma unroll
        for (int rb = 0; rb < R / 64; rb++) ck_tma_box(dst + cb * R * 128 + rb * 64 * 128, map, col + cb * 64, t0 + rb * 64, b, bar);
}
/* The producer's first warp, whole, so that it stays converged for the block's barriers at
 * the end; its first lane (leader) issues. */
template <int D, int WGS, int KEYS>
static __device__ void ck_ws_produce_tma(const CkArgs &a, unsigned sQ, unsigned sKV, unsigned qbar, unsigned full,
                                         unsigned empty, i64 b, i64 h, i64 g, int q0, int n_kt, bool leader) {
    typedef CkWs<D, WGS, KEYS> L;
    const char *maps = (const char *)a.tmaps;   /* q, k, v */
    if (leader) {
        for (int k = 0; k < 3; k++)
            asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(maps + 128 * k) : "memory");
        ck_mbar_expect(qbar, L::Q_BYTES);
        ck_tma_tile<D, L::BM>(sQ, maps, (int)(a.i[6] + h * D), q0, (int)b, qbar);
    }
    for (int j = 0; j < n_kt; j++) {
        int s = j % L::STAGES;
        if (j >= L::STAGES) ck_mbar_wait(empty + 8 * s, (unsigned)((j / L::STAGES - 1) & 1));
        if (leader) {
            unsigned sK = sKV + s * 2 * L::TILE;
            ck_mbar_expect(full + 8 * s, 2 * L::TILE);
            ck_tma_tile<D, L::BN>(sK, maps + 128, (int)(a.i[8] + g * D), j * L::BN, (int)b, full + 8 * s);
            ck_tma_tile<D, L::BN>(sK + L::TILE, maps + 256, (int)(a.i[10] + g * D), j * L::BN, (int)b, full + 8 * s);
        }
        __syncwarp();
    }
}

/* Registers (setmaxnreg): the block starts with the launch's even share, 128 a thread at
 * WGS 3 (512 threads), 168 at WGS 2; the producer gives most of its share back at once
 * (24 with TMA, where one lane issues; 40 where its warpgroup makes the copies' addresses)
 * and the consumers take it, so that a key tile of 128 (S 64 values a thread, P and the
 * previous P 32 each, O 32 at D 64) fits without spilling. */
template <int WGS, int TMA> struct CkWsRegs {
    enum {
        START = (65536 / (128 * (WGS + 1))) / 8 * 8 > 255 ? 248 : (65536 / (128 * (WGS + 1))) / 8 * 8,
        PRODUCER = TMA ? 24 : 40,
        CONSUMER = ((START * (WGS + 1) - PRODUCER) / WGS / 8 * 8) > 240 ? 240 : (START * (WGS + 1) - PRODUCER) / WGS / 8 * 8
    };
};
template <int N> static __device__ __forceinline__ void ck_regs_give() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> static __device__ __forceinline__ void ck_regs_take() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* MODE 0: y = attention(q, k, v) (and lse after y when i[11]); MODE 1 (t[1] = dy): lse and Dt
 * into scratch. Arguments as ck_attn_wg_fwd's; one block per (b, h, 64 WGS query rows), the
 * heaviest tiles first (ck_attn_order). TMA: the producer's loads by one thread (above). KEYS:
 * the keys of a tile, 64 or 128 (at D 64). PIPE: each consumer warpgroup overlaps its products
 * with its softmax as ck_attn_wg_fwd_pipe does (FlashAttention-3's intra-warpgroup
 * pipelining): in step j it issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j alone,
 * takes tile j's softmax while P_{j-1} V_{j-1} runs, then waits for that product, hands tile
 * j - 1's slot back and rescales O; the last P V is issued after the walk. The products and
 * their order are the unpipelined ones, so the results are the same bits. */
template <int D, int WGS, int TMA, int KEYS, int PIPE, int MODE, class Y, class Q, class K, class V, class DY,
          int HG = 0>
__device__ void ck_attn_ws_fwd(const CkArgs &a) {
    static_assert(D == 64 || D == 128, "the warp-specialized forward takes head dims 64 and 128");
    static_assert(KEYS == 64 || (KEYS == 128 && D == 64), "key tiles of 64, or of 128 at head dim 64");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    typedef CkWs<D, WGS, KEYS> L;
    typedef CkWsRegs<WGS, TMA> R;
    const int BN = L::BN, NB = BN / 8;
    unsigned sQ = (ck_smem(smem_raw) + 1023u) & ~1023u;   /* swizzle atoms start at multiples of 1024 */
    unsigned sKV = sQ + L::Q_BYTES;                        /* [slot][k, v] tiles */
    unsigned qbar = sQ + L::BARS, full = qbar + 8, empty = full + 8 * L::STAGES;
    i64 B = a.i[0], T = a.i[1], H = a.i[2], Hkv = a.i[3], n_qt = (T + L::BM - 1) / L::BM, bh, heavy;
    ck_attn_order(blockIdx.x, B * H, n_qt, HG, bh, heavy);
    const i64 b = bh / H, h = bh % H, g = h / (H / Hkv);
    const int q0 = (int)(n_qt - 1 - heavy) * L::BM, Ti = (int)T, tig = threadIdx.x & 3;
    const int n_kt = (q0 + L::BM - 1 < Ti - 1 ? q0 + L::BM - 1 : Ti - 1) / BN + 1;   /* the block's key tiles */
    float scale2 = (float)a.f[0] * CK_LOG2E;   /* scores in base 2 */
    const CkTensor &tq = a.t[MODE + 1], &tk = a.t[MODE + 2], &tv = a.t[MODE + 3];
    if (threadIdx.x == 0) {
        const unsigned fills = TMA ? 1 : 128;   /* the producer's arrivals a tile: one thread's, or each */
        ck_mbar_init(qbar, fills);
        for (int s = 0; s < L::STAGES; s++) ck_mbar_init(full + 8 * s, fills), ck_mbar_init(empty + 8 * s, 4 * WGS);
    }
    __syncthreads();

    if (threadIdx.x >= 128 * WGS) {
        ck_regs_give<R::PRODUCER>();
        /* the producer: Q, then tile j into slot j % STAGES once every warpgroup gave it back;
         * each tile announced when its copies (one group a tile) have landed */
        int pt = threadIdx.x - 128 * WGS;
        if (TMA) {
            if (pt < 32) ck_ws_produce_tma<D, WGS, KEYS>(a, sQ, sKV, qbar, full, empty, b, h, g, q0, n_kt, pt == 0);
        } else {
            ck_wg_load_by<D, L::BM, 128>(pt, sQ, tq, b, T, q0, a.i[5], a.i[6] + h * D);
            ck_mbar_arrive_copies(qbar);
            for (int j = 0; j < n_kt; j++) {
                int s = j % L::STAGES;
                if (j >= L::STAGES) ck_mbar_wait(empty + 8 * s, (unsigned)((j / L::STAGES - 1) & 1));
                unsigned sK = sKV + s * 2 * L::TILE;
                ck_wg_load_by<D, L::BN, 128>(pt, sK, tk, b, T, j * BN, a.i[7], a.i[8] + g * D);
                ck_wg_load_by<D, L::BN, 128>(pt, sK + L::TILE, tv, b, T, j * BN, a.i[9], a.i[10] + g * D);
                ck_mbar_arrive_copies(full + 8 * s);
            }
            ck_cp_wait();   /* nothing of the block's in flight when it ends */
        }
        /* the block's reductions at the end need every thread: none of the producer's rows is
         * before T, so it stores nothing */
        float o[D / 8][4] = {}, m[2] = {0.0f, 0.0f}, l[2] = {1.0f, 1.0f};
        ck_attn_fwd_finish<D, MODE, Y, DY>(a, o, m, l, b, h, Ti, tig, Ti);
        return;
    }
    ck_regs_take<R::CONSUMER>();
    {
        /* a consumer warpgroup: its 64 rows from `rows`, the thread's rows row0 and row0 + 8,
         * its key tiles (none when its rows are all past T) */
        const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
        const int rows = q0 + wg * 64, wg_last = rows + 63 < Ti - 1 ? rows + 63 : Ti - 1;
        const int wg_kt = rows < Ti ? wg_last / BN + 1 : 0;
        const int row0 = rows + warp * 16 + (lane >> 2);
        float o[D / 8][4], m[2] = {-CK_INF, -CK_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        ck_mbar_wait(qbar, 0);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   /* the copies, to wgmma */
        /* the warp is done with slot s */
        auto give_back = [&](int s) {
            __syncwarp();
            if (lane == 0) ck_mbar_arrive(empty + 8 * s);
        };
        auto take = [&](int j) {
            ck_mbar_wait(full + 8 * (j % L::STAGES), (unsigned)((j / L::STAGES) & 1));
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        };
        auto k_at = [&](int j) { return sKV + (j % L::STAGES) * 2 * L::TILE; };
        auto edge = [&](int k0) { return k0 + BN - 1 > rows || k0 + BN > Ti; };
        int j = 0;
        if (!PIPE) {
            for (; j < wg_kt; j++) {
                take(j);
                float sc[NB][4];
                unsigned pf[NB / 2][4];
                float corr[2];
                ck_wg_qk<D, L::BM, BN>(sc, sQ, k_at(j), wg);
                ck_ws_softmax_tile<NB>(sc, scale2, edge(j * BN), j * BN, row0, tig, Ti, m, l, pf, corr);
                ck_wg_pv<D, BN>(o, pf, corr, k_at(j) + L::TILE);
                give_back(j % L::STAGES);
            }
        } else if (wg_kt > 0) {
            /* Every step the same code, tile 0's included: its P V is of P = 0 (pp zeros) against
             * the Q tile (finite values), which adds +0 to O = 0, so O's bits are those of the
             * unpipelined walk. The last P V follows the walk. */
            unsigned pp[NB / 2][4];   /* P_{j-1}, the A operand of the product in flight */
#pragma unroll
            for (int k = 0; k < NB / 2; k++) pp[k][0] = pp[k][1] = pp[k][2] = pp[k][3] = 0u;
            const int rmax[2] = {row0 < Ti - 1 ? row0 : Ti - 1, row0 + 8 < Ti - 1 ? row0 + 8 : Ti - 1};
            for (; j < wg_kt; j++) {
                take(j);
                int k0 = j * BN, lim[2] = {rmax[0] - k0 - 2 * tig, rmax[1] - k0 - 2 * tig};
                ck_wg_pipe_step<D, L::BM, BN, true>(o, pp, sQ, k_at(j), j > 0 ? k_at(j - 1) + L::TILE : sQ, wg, scale2,
                                                    lim, m, l);
                if (j > 0) give_back((j - 1) % L::STAGES);
            }
            ck_wg_pv_issue<D, BN>(o, pp, k_at(wg_kt - 1) + L::TILE);
            ck_wg_wait();
            ck_wg_hold<D / 2>(&o[0][0]);
            give_back((wg_kt - 1) % L::STAGES);
        }
        /* the tiles after every row of the warpgroup: taken and handed back, so that every
         * phase of their slots' empty barriers gets its arrivals */
        for (; j < n_kt; j++) {
            take(j);
            give_back(j % L::STAGES);
        }
        ck_attn_fwd_finish<D, MODE, Y, DY>(a, o, m, l, b, h, row0, tig, Ti);
    }
}
