/* ref_pool.c — the reference executor's threads.
 *
 * The CPU training run goes through the reference executor, so its GEMMs, attention and row
 * ops are split across cores. A persistent pool (started on first use) costs a condition
 * variable broadcast per parallel op instead of a thread creation per thread per op, which
 * matters when a step runs hundreds of small ops.
 *
 * Determinism is not the pool's job but its contract: tasks are claimed dynamically (an atomic
 * counter, so uneven tasks such as causal attention rows balance), hence a task must own its
 * outputs and compute each of them in a fixed order. Then the thread count changes only speed.
 * A parallel_for issued from inside a task (or while another is running) runs serially. */
#include "ref_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    pthread_t *threads;
    int n_workers;          /* threads besides the caller */
    bool started, quit;
    uint64_t generation;    /* bumped for each parallel_for; workers wait for a new one */
    int busy;               /* workers still inside the current generation */
    RefTaskFn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_int_fast64_t next;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static _Thread_local bool in_task;
static atomic_flag running = ATOMIC_FLAG_INIT;
static int wanted_threads;  /* 0: not decided yet */

static void pool_drain(RefTaskFn fn, void *ctx, int64_t n_tasks)
{
    for (;;) {
        int64_t i = atomic_fetch_add(&pool.next, 1);
        if (i >= n_tasks) return;
        fn(ctx, i);
    }
}

static void *pool_worker(void *arg)
{
    (void)arg;
    in_task = true;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.generation == seen && !pool.quit) pthread_cond_wait(&pool.wake, &pool.mu);
        if (pool.quit) break;
        seen = pool.generation;
        RefTaskFn fn = pool.fn;
        void *ctx = pool.ctx;
        int64_t n = pool.n_tasks;
        pthread_mutex_unlock(&pool.mu);
        pool_drain(fn, ctx, n);
        pthread_mutex_lock(&pool.mu);
        if (--pool.busy == 0) pthread_cond_signal(&pool.done);
    }
    pthread_mutex_unlock(&pool.mu);
    return NULL;
}

static int threads_from_env(void)
{
    const char *s = getenv("FP8C_THREADS");
    if (s && *s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (*end == 0 && v >= 1 && v <= 1024) return (int)v;
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus >= 1 ? (int)(cpus < 1024 ? cpus : 1024) : 1;
}

static void pool_stop(void)
{
    if (!pool.started) return;
    pthread_mutex_lock(&pool.mu);
    pool.quit = true;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 0; i < pool.n_workers; i++) pthread_join(pool.threads[i], NULL);
    free(pool.threads);
    pool.threads = NULL;
    pool.n_workers = 0;
    pool.started = false;
    pool.quit = false;
}

static void pool_start(void)
{
    if (!wanted_threads) wanted_threads = threads_from_env();
    pool.n_workers = wanted_threads - 1;
    pool.threads = pool.n_workers ? calloc((size_t)pool.n_workers, sizeof(pthread_t)) : NULL;
    IR_ASSERT(pool.n_workers == 0 || pool.threads);
    for (int i = 0; i < pool.n_workers; i++)
        if (pthread_create(&pool.threads[i], NULL, pool_worker, NULL) != 0) {
            pool.n_workers = i;   /* fewer threads are slower, not wrong */
            break;
        }
    pool.started = true;
}

void ref_set_threads(int n)
{
    IR_ASSERT(n >= 1);
    IR_ASSERT(!atomic_flag_test_and_set(&running));
    pool_stop();
    wanted_threads = n;
    atomic_flag_clear(&running);
}

int ref_threads(void)
{
    if (!wanted_threads) wanted_threads = threads_from_env();
    return wanted_threads;
}

void ref_parallel_for(int64_t n_tasks, RefTaskFn fn, void *ctx)
{
    if (n_tasks <= 0) return;
    if (n_tasks == 1 || in_task || atomic_flag_test_and_set(&running)) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    if (!pool.started) pool_start();
    if (pool.n_workers == 0) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i);
        atomic_flag_clear(&running);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_tasks = n_tasks;
    atomic_store(&pool.next, 0);
    pool.busy = pool.n_workers;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);

    in_task = true;
    pool_drain(fn, ctx, n_tasks);
    in_task = false;

    pthread_mutex_lock(&pool.mu);
    while (pool.busy > 0) pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    atomic_flag_clear(&running);
}
