/* ref_pool.c — the reference executor's threads.
 *
 * The CPU training run goes through the reference executor, so its GEMMs, attention and row
 * ops are split across cores. A persistent pool (started on first use) hands each parallel op
 * to its workers by bumping a generation counter. A step runs hundreds of small ops back to
 * back, so a worker that has finished one spins on the counter for a while (tens of
 * microseconds) before it sleeps on a condition variable, and the caller spins the same way for
 * the workers to finish: a sleeping thread takes a futex wake-up per op, which at sixteen
 * threads costs more than the op itself. The spins are bounded, so idle threads sleep.
 *
 * The caller waits for the op's tasks, not for the workers: a worker that wakes late (or not
 * at all, asleep) finds nothing left to claim, and the caller, which takes tasks like any
 * worker, has long gone on. Waiting for every worker to check in cost each op the slowest
 * worker's wake-up, which grows with the thread count.
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
    bool started;
    atomic_bool quit;
    atomic_uint_fast64_t generation;   /* bumped for each parallel_for; workers wait for a new one */
    /* the tasks left to claim: the generation's low 32 bits over the count left, so that a
     * worker still looking at an earlier generation claims nothing of this one */
    atomic_uint_fast64_t left;
    atomic_int_fast64_t finished;      /* tasks of this generation done */
    int sleepers;           /* workers waiting on `wake` (under mu) */
    bool caller_sleeps;     /* the caller waits on `done` (under mu) */
    /* the op: written by the caller before it publishes `left`, read by a worker only while it
     * holds an unfinished task (so the op cannot have ended and the next one begun) */
    RefTaskFn fn;
    void *ctx;
    int64_t n_tasks;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static _Thread_local bool in_task;
static atomic_flag running = ATOMIC_FLAG_INIT;
static int wanted_threads;  /* 0: not decided yet */

/* about 20-100 microseconds of pause instructions, depending on the CPU */
enum { POOL_SPINS = 4000 };

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claims and runs tasks of generation `gen` until none is left; adds what it ran to
 * `finished` and returns whether that completed the op. */
static bool pool_drain(uint64_t gen)
{
    uint64_t tag = (gen & 0xFFFFFFFFu) << 32;
    int64_t ran = 0, n = 0;
    for (;;) {
        uint64_t w = atomic_load_explicit(&pool.left, memory_order_relaxed);
        if ((w & ~(uint64_t)0xFFFFFFFFu) != tag || (w & 0xFFFFFFFFu) == 0) break;
        if (!atomic_compare_exchange_weak_explicit(&pool.left, &w, w - 1, memory_order_acquire,
                                                   memory_order_relaxed))
            continue;
        n = pool.n_tasks;
        pool.fn(pool.ctx, n - (int64_t)(w & 0xFFFFFFFFu));
        ran++;
    }
    return ran && atomic_fetch_add_explicit(&pool.finished, ran, memory_order_acq_rel) + ran == n;
}

static void *pool_worker(void *arg)
{
    (void)arg;
    in_task = true;
    uint64_t seen = 0;
    for (;;) {
        for (int k = 0; k < POOL_SPINS && atomic_load_explicit(&pool.generation, memory_order_acquire) == seen &&
                        !atomic_load(&pool.quit);
             k++)
            cpu_relax();
        if (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen && !atomic_load(&pool.quit)) {
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.quit)) {
                pool.sleepers++;
                pthread_cond_wait(&pool.wake, &pool.mu);
                pool.sleepers--;
            }
            pthread_mutex_unlock(&pool.mu);
        }
        if (atomic_load(&pool.quit)) break;
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (pool_drain(seen)) {
            pthread_mutex_lock(&pool.mu);
            if (pool.caller_sleeps) pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
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
    atomic_store(&pool.quit, true);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 0; i < pool.n_workers; i++) pthread_join(pool.threads[i], NULL);
    free(pool.threads);
    pool.threads = NULL;
    pool.n_workers = 0;
    pool.started = false;
    atomic_store(&pool.quit, false);
    atomic_store(&pool.generation, 0);
    atomic_store(&pool.left, 0);
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
    IR_ASSERT(n_tasks < ((int64_t)1 << 32));
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_tasks = n_tasks;
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    uint64_t gen = atomic_load_explicit(&pool.generation, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool.left, ((gen & 0xFFFFFFFFu) << 32) | (uint64_t)n_tasks, memory_order_release);
    atomic_store_explicit(&pool.generation, gen, memory_order_release);
    pthread_mutex_lock(&pool.mu);
    if (pool.sleepers) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);

    in_task = true;
    pool_drain(gen);
    in_task = false;

    for (int k = 0; k < POOL_SPINS && atomic_load_explicit(&pool.finished, memory_order_acquire) < n_tasks; k++)
        cpu_relax();
    if (atomic_load_explicit(&pool.finished, memory_order_acquire) < n_tasks) {
        pthread_mutex_lock(&pool.mu);
        pool.caller_sleeps = true;
        while (atomic_load(&pool.finished) < n_tasks) pthread_cond_wait(&pool.done, &pool.mu);
        pool.caller_sleeps = false;
        pthread_mutex_unlock(&pool.mu);
    }
    atomic_flag_clear(&running);
}
