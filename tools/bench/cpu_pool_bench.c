/* cpu_pool_bench.c — what an op costs the thread pool beyond its tasks.
 *
 * A training step on the CPU is hundreds of small ops, each a ref_parallel_for, so the pool's
 * dispatch and wait are paid hundreds of times a step. This times ops of 16 and 64 tasks, each
 * task empty or a chain of 300 dependent adds (about 1200 cycles), back to back, at
 * FP8C_THREADS threads, and prints the time per op (after a warm-up of 2000 ops, over 20000).
 * Build from the repository root after scripts/setup.sh build:
 *   cc -O2 -std=gnu11 -I ir -I runtime tools/bench/cpu_pool_bench.c -L build -lfp8c_rt \
 *      -lfp8c_kernels -lfp8c_ir -lm -lpthread -o /tmp/cpu_pool_bench */
#include <stdio.h>
#include <time.h>

#include "ref_internal.h"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static float sink[4096 * 16];   /* a line per task's result, so that tasks share none */

static void task(void *ctx, int64_t t)
{
    int64_t adds = *(const int64_t *)ctx;
    float s = 0;
    for (int64_t i = 0; i < adds; i++) s += (float)i * 1e-9f;
    sink[(t & 4095) * 16] += s;
}

int main(void)
{
    const int task_counts[] = {16, 64};
    const int64_t adds[] = {0, 300};
    printf("pool: %d threads\n", ref_threads());
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++) {
            int n = task_counts[a];
            int64_t work = adds[b];
            for (int i = 0; i < 2000; i++) ref_parallel_for(n, task, &work);
            int ops = 20000;
            double t0 = now_s();
            for (int i = 0; i < ops; i++) ref_parallel_for(n, task, &work);
            printf("%3d tasks of %3lld adds: %6.2f us an op\n", n, (long long)work, (now_s() - t0) / ops * 1e6);
        }
    return 0;
}
