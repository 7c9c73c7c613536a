/* train_internal.h — what train.c and train_gpus.c share: the launcher of a data-parallel
 * run (train_gpus.c) starts ranks that run train.c's training, and train.c asks it whether a
 * world of several ranks can run the graph. Internal to runtime/. */
#ifndef FP8C_TRAIN_INTERNAL_H
#define FP8C_TRAIN_INTERNAL_H

#include "rt.h"

/* ---------------------------------------------------------------- train.c */

/* One rank (or the only process) trains: the whole program but the launcher. */
int train_rank_run(Graph *g, const TrainOptions *opts);

/* ---------------------------------------------------------------- train_gpus.c */

/* Whether g can run on `world` ranks (its update averages gradients, and the binary carries
 * the GPU device), else one line naming `flag`. */
bool train_world_device_ok(const Graph *g, int world, const char *flag);
/* --gpus N: N ranks as child processes, and their fate as this process's exit status. */
int train_launch(Graph *g, const TrainOptions *o);

#endif
