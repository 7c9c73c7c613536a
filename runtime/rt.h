/* rt.h — the runtime: what a training binary runs. Small and stable.
 *
 * Sections: the reference executor (ref_exec.c), parameter init (init.c), and the training
 * program's pieces (data.c, checkpoint.c, log.c, train.c). */
#ifndef FP8C_RT_H
#define FP8C_RT_H

#include "ir.h"

/* ---------------------------------------------------------------- ref_exec.c
 * Plain C, one op at a time, f32 storage semantics through each tensor's Format (inputs are
 * decoded to f32, results rounded into their element type), f64 accumulation in reductions.
 * It is the ground truth the backends are tested against. Every tensor a node reads or writes
 * must be bound (Tensor.data) before it runs. */
void ref_exec_node(Node *n);
void ref_run_phase(Graph *g, Phase phase);             /* every node of `phase`, in order */
float *ref_load(const Tensor *t);                      /* decoded f32 copy; free() it */
void ref_store(Tensor *t, const float *x);             /* encode through t's format */
/* Threads the executor uses: FP8C_THREADS, else the online CPUs. Results are bit-identical
 * whatever the count: work is split by output elements, each computed in a fixed order. */
void ref_set_threads(int n);
int ref_threads(void);

/* ---------------------------------------------------------------- init.c
 * Fills every PARAM per its init attribute (normal(0, std), zeros, ones) from a counter-based
 * generator keyed by (seed, parameter name, element index): values do not depend on node order
 * or thread count. STATE is zeroed, except scales (1) and master copies (the parameter's
 * unrounded initial value). Everything is written through the tensors' formats. */
void rt_init_params(Graph *g, uint64_t seed);

#endif
