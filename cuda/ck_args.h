/* ck_args.h — the one argument block every generated GPU kernel takes.
 *
 * This header is read twice: by the host C code that fills the block for each launch
 * (cuda/spec.c, cuda/exec.c) and, as text, by NVRTC at the top of every generated module, so
 * the two sides can never disagree on a field's offset. It therefore uses only what both C11
 * and CUDA C++ accept: plain structs, fixed-width fields, no includes.
 *
 * A tensor is seen by a kernel as its data pointer plus its 2-D view (rows = all leading dims,
 * cols = the last dim) and, when scaled, its scale array laid out as ref_scale_map says. The
 * element type and the scaling kind are template parameters of the kernel (they select code),
 * the rest is data. Passing one block by value (about 1 KiB; Hopper takes 4 KiB of kernel
 * parameters) keeps launches uniform: the executor fills blocks, a CUDA graph replays them.
 * Where many small nodes run the same kernel (the update's one node per parameter), their
 * blocks go to device memory and one launch runs them all (CkBatch). */
#ifndef FP8C_CK_ARGS_H
#define FP8C_CK_ARGS_H

#define CK_MAX_TENSORS 12
#define CK_MAX_IATTR 12
#define CK_MAX_FATTR 6
/* a producer's block maxima (ops.def amax=1): CK_AMAX_PARTS slots at byte i[CK_AMAX_AT] of
 * t[0]; the slot count is ir.h's IR_AMAX_PARTS */
#define CK_AMAX_AT (CK_MAX_IATTR - 1)
#define CK_AMAX_PARTS 1024
/* GEMMs whose dequantization scales one launch computes before its own work (ck_entry) */
#define CK_MAX_INVERSE 4

typedef struct {
    void *p;                /* element data (device) */
    const void *s;          /* scales (device; f32 or e8m0, as the template says), NULL:
                               unscaled or static (sconst) */
    long long n;            /* elements */
    long long rows, cols;   /* the 2-D view */
    long long ncg;          /* per-group and block scaling: scale columns per row (block: per
                               block row) */
    int group;              /* per-group: elements per group; 1x128 tiles and blocks: 128 */
    float sconst;           /* RECIPE_STATIC without a scale tensor */
    int gshift;             /* per-group and 1x128 tiles: log2(group) where group is a power of
                               two that divides cols (element i's scale is then i >> gshift);
                               -1 otherwise */
    int pad_;
} CkTensor;

typedef struct {
    CkTensor t[CK_MAX_TENSORS];   /* t[0]: the result (or the operand updated in place) */
    long long i[CK_MAX_IATTR];    /* sizes and integer attributes, as the op's spec says */
    double f[CK_MAX_FATTR];       /* float attributes */
    void *scratch;                /* this launch's scratch in the workspace (device) */
    const float *const *table;    /* variadic scalar inputs (grad_norm), device */
    const void *tmaps;            /* TMA tensor maps of some operands, 128 bytes each (device;
                                     CuLaunch.tma) */
    unsigned *ticket;             /* a counter at zero, for the block that finishes last (device) */
    int n_in;
    unsigned grid_base;           /* batched launches: this block's first block in the launch */
    unsigned grid_size;           /* batched launches: its blocks (0: the whole grid) */
    int pad_;
    /* block 0 first writes 1 / inv_from[2 j + k][0] at inv_to[j][16 k] (a NULL skips it): the
     * dequantization scales of a later per-tensor FP8 GEMM (spec_scales.c, fold_inverse_scales) */
    const float *inv_from[2 * CK_MAX_INVERSE];
    float *inv_to[CK_MAX_INVERSE];
    /* the last block stores the per-tensor scale of t[0] at scale_to (NULL: none) from the
     * block maxima the launch leaves, max of the copy's element type scale_max, margin
     * scale_margin (ops.cuh's ck_amax_out; spec_scales.c, fold_amax_scales); or, with
     * scale_amax, block 0 stores the scale made from that amax */
    float *scale_to;
    double scale_max;
    long long scale_margin;
    /* not NULL: the launch makes the scale at scale_to itself, from the one f32 amax here, and
     * every block uses the value it computes (prelude.cuh's ck_state_scale; spec_scales.c,
     * fold_state_scales); block 0 stores it at scale_to */
    const float *scale_amax;
} CkArgs;

/* A batched launch: one launch of a kernel over n argument blocks in device memory. Block b
 * of the launch runs entry j, first[j] <= b < first[j + 1], and sees the grid of its entry
 * (grid_base, grid_size). */
typedef struct {
    const CkArgs *args;
    const unsigned *first;
    int n;
    int pad_;
} CkBatch;

/* One gradient accumulator of a bucket of the FP8 gradient reduction (kernels/comm.cuh):
 * its elements are elements start .. start + n - 1 of the bucket. */
typedef struct {
    void *p;                /* the accumulator (device) */
    long long start;
    long long n;
    int elem;               /* its element type: FMT_F32, FMT_BF16 or FMT_F16 */
    int pad_;
} CkSegment;

#endif
