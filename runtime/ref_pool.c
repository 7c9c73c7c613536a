/* ref_pool.c — the executors' threads.
 *
 * Both CPU executors split their GEMMs, attention and row ops across cores through
 * ref_parallel_for. A persistent pool (started on first use) runs each op's tasks on its
 * threads; the caller is one of them. A step runs hundreds of small ops back to back (a
 * gpt2_tiny step at batch 1 is about 400 kernels of a few microseconds each), so what an op
 * costs beyond its tasks is what this file is about. On a 16-core Xeon an op of 64 small
 * tasks took 8.6 us when every thread claimed its tasks from one shared counter and added
 * them to one shared count of finished tasks: each of those atomic operations moves a cache
 * line from core to core, one thread after another. Now the shared writes are few and spread
 * out, and the op takes 4.1 us:
 *
 * - Each thread has a range of the op's tasks (the i-th of n ranges, in index order) in a
 *   counter on its own cache line, `next | end` in one 64-bit word, which the caller writes
 *   before it publishes the op. A thread claims its own range's tasks first, one at a time,
 *   then takes what is left in the others' ranges (a thread that was slow to wake, or asleep,
 *   has its tasks run by the rest). A claim is a compare-and-swap of the word from (i, end) to
 *   (i + 1, end), so a claim that succeeds always takes an unclaimed task of the op in flight,
 *   whatever the claiming thread saw before; the op's function and context are read after the
 *   claim, from where the caller wrote them before it wrote the counters.
 * - Each thread counts the tasks it has run, over the pool's lifetime, on a line of its own;
 *   the op is done when those counts add up to the tasks issued so far. The caller polls them.
 * - Workers that have finished spin on the op's generation for a while (200 microseconds)
 *   before they sleep on a condition variable; the caller spins the same way for the tasks to
 *   finish. A sleeping thread takes a futex wake-up per op, which at sixteen
 *   threads costs more than the op itself; the spins are bounded, so idle threads sleep.
 *   Whether anyone sleeps is read without the lock, in the order that makes a missed wake-up
 *   impossible (the flag is raised before the condition is rechecked, the condition is
 *   published before the flag is read, both sequentially consistent).
 *
 * Determinism is not the pool's job but its contract: any thread may run any task (the ranges
 * balance uneven tasks such as causal attention rows by being taken from), hence a task must
 * own its outputs and compute each of them in a fixed order. Then the thread count changes
 * only speed. A parallel_for issued from inside a task (or while another is running) runs
 * serially.
 *
 * Most callers outside the executors' kernels walk one long array (a parameter being made, a
 * state being cleared, a tensor converted): ref_parallel_ranges cuts [0, n) into fixed ranges
 * and hands each to a function that is the serial loop over [lo, hi), so the serial pass and
 * the parallel one are the same code. */
#define _GNU_SOURCE   /* sched_getaffinity, CPU_COUNT */
#include "ref_internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { MAX_THREADS = RT_MAX_THREADS };

/* A thread's share of the op in flight and what it has run; two cache lines, so that the
 * caller's polling of `ran` does not take the claims' line away from its owner. */
typedef struct {
    _Alignas(64) atomic_uint_fast64_t range;   /* next task (high 32 bits) | end (low 32) */
    _Alignas(64) atomic_int_fast64_t ran;      /* tasks this thread has run, ever */
} Slot;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    pthread_t *threads;
    Slot *slots;            /* per thread, the caller's first */
    int n_threads;          /* the caller and its workers */
    bool started;
    int64_t issued;         /* tasks of all ops so far (the caller's) */
    _Alignas(64) atomic_uint_fast64_t generation;   /* bumped for each op; workers wait for a new one */
    atomic_bool quit;
    _Alignas(64) atomic_int sleepers;   /* workers waiting on `wake`, or about to */
    atomic_bool caller_sleeps;          /* the caller waits on `done`, or is about to */
    /* the op, written by the caller before the ranges; read after a claim */
    _Alignas(64) RefTaskFn fn;
    void *ctx;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static _Thread_local bool in_task;
static atomic_flag running = ATOMIC_FLAG_INIT;
static int wanted_threads;  /* 0: not decided yet */

/* How long a thread spins before it sleeps, in nanoseconds: 200 us, or FP8C_POOL_SPIN_US.
 * A time rather than a count of pause instructions, whose length differs tenfold between
 * CPUs. Between the ops of a step the threads rarely wait that long; between steps (data,
 * logging, evaluation) they may, and then sleep. */
static int64_t spin_ns(void)
{
    static int64_t ns = -1;
    if (ns < 0) {
        const char *s = getenv("FP8C_POOL_SPIN_US");
        int64_t v = 200;
        if (s && (!rt_cli_int(s, &v) || v < 0 || v > 1000000000)) {   /* as strict as a flag */
            rt_error("FP8C_POOL_SPIN_US=%s: expected a whole number of microseconds, 0 to 1000000000", s);
            exit(2);
        }
        ns = v * 1000;
    }
    return ns;
}

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claims the next task of a range; false when the range is used up. */
static bool claim(Slot *s, int64_t *task)
{
    uint64_t w = atomic_load_explicit(&s->range, memory_order_relaxed);
    for (;;) {
        uint64_t next = w >> 32, end = w & 0xFFFFFFFFu;
        if (next >= end) return false;
        if (atomic_compare_exchange_weak_explicit(&s->range, &w, w + ((uint64_t)1 << 32),
                                                  memory_order_acquire, memory_order_relaxed)) {
            *task = (int64_t)next;
            return true;
        }
    }
}

/* Runs tasks of the op in flight, thread `self`'s range first, until every range is used up;
 * then counts them as run. */
static void run_tasks(int self)
{
    int n = pool.n_threads;
    int64_t ran = 0, task;
    for (int k = 0; k < n; k++) {
        Slot *s = &pool.slots[(self + k) % n];
        while (claim(s, &task)) {
            pool.fn(pool.ctx, task);
            ran++;
        }
    }
    if (!ran) return;
    Slot *mine = &pool.slots[self];
    atomic_store(&mine->ran, atomic_load_explicit(&mine->ran, memory_order_relaxed) + ran);
    if (atomic_load(&pool.caller_sleeps)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_signal(&pool.done);
        pthread_mutex_unlock(&pool.mu);
    }
}

static int64_t tasks_run(void)
{
    int64_t sum = 0;
    for (int i = 0; i < pool.n_threads; i++)
        sum += atomic_load_explicit(&pool.slots[i].ran, memory_order_acquire);
    return sum;
}

static void *pool_worker(void *arg)
{
    int self = (int)(intptr_t)arg;
    in_task = true;
    uint64_t seen = 0;
    for (;;) {
        int64_t deadline = now_ns() + spin_ns();
        for (int k = 1; atomic_load_explicit(&pool.generation, memory_order_acquire) == seen &&
                        !atomic_load_explicit(&pool.quit, memory_order_relaxed);
             k++) {
            cpu_relax();
            if (k % 64 == 0 && now_ns() > deadline) break;
        }
        if (atomic_load(&pool.generation) == seen && !atomic_load(&pool.quit)) {
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.quit))
                pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        if (atomic_load(&pool.quit)) break;
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        run_tasks(self);
    }
    return NULL;
}

/* FP8C_THREADS is --threads' default: a value that is no count is refused as the flag's would
 * be (status 2), not replaced by every online CPU without a word. */
static int threads_from_env(void)
{
    const char *s = getenv("FP8C_THREADS");
    if (s && *s) {
        int64_t v;
        if (!rt_cli_int(s, &v) || v < 1 || v > MAX_THREADS) {
            rt_error("FP8C_THREADS=%s: expected a whole number from 1 to %d", s, MAX_THREADS);
            exit(2);
        }
        return (int)v;
    }
    int cpus = ref_cpu_count();
    return cpus < MAX_THREADS ? cpus : MAX_THREADS;
}

int ref_cpu_count(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) >= 1) return CPU_COUNT(&set);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus >= 1 ? (int)cpus : 1;
}

static void pool_stop(void)
{
    if (!pool.started) return;
    pthread_mutex_lock(&pool.mu);
    atomic_store(&pool.quit, true);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    for (int i = 1; i < pool.n_threads; i++) pthread_join(pool.threads[i], NULL);
    free(pool.threads);
    free(pool.slots);
    pool.threads = NULL;
    pool.slots = NULL;
    pool.n_threads = 0;
    pool.issued = 0;
    pool.started = false;
    atomic_store(&pool.quit, false);
    atomic_store(&pool.generation, 0);
}

static void pool_start(void)
{
    if (!wanted_threads) wanted_threads = threads_from_env();
    int n = wanted_threads;
    pool.threads = calloc((size_t)n, sizeof(pthread_t));
    pool.slots = aligned_alloc(64, sizeof(Slot) * (size_t)n);
    IR_ASSERT(pool.threads && pool.slots);
    for (int i = 0; i < n; i++) {
        atomic_init(&pool.slots[i].range, 0);
        atomic_init(&pool.slots[i].ran, 0);
    }
    pool.n_threads = 1;
    for (int i = 1; i < n; i++) {
        if (pthread_create(&pool.threads[i], NULL, pool_worker, (void *)(intptr_t)i) != 0)
            break;   /* fewer threads are slower, not wrong */
        pool.n_threads = i + 1;
    }
    pool.started = true;
}

void ref_set_threads(int n)
{
    IR_ASSERT(n >= 1 && n <= MAX_THREADS);
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
    int n = pool.n_threads;
    if (n == 1) {
        for (int64_t i = 0; i < n_tasks; i++) fn(ctx, i);
        atomic_flag_clear(&running);
        return;
    }
    IR_ASSERT(n_tasks < ((int64_t)1 << 32));
    /* every task of the last op has run (and no thread claims any more of it: its ranges are
     * used up), so the op's fields and the ranges are the caller's to write */
    pool.fn = fn;
    pool.ctx = ctx;
    for (int i = 0; i < n; i++) {
        uint64_t lo = (uint64_t)((n_tasks * i + n - 1) / n), hi = (uint64_t)((n_tasks * (i + 1) + n - 1) / n);
        atomic_store_explicit(&pool.slots[i].range, lo << 32 | hi, memory_order_release);
    }
    pool.issued += n_tasks;
    atomic_store(&pool.generation, atomic_load_explicit(&pool.generation, memory_order_relaxed) + 1);
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mu);
    }

    in_task = true;
    run_tasks(0);
    in_task = false;

    int64_t deadline = now_ns() + spin_ns();
    for (int k = 1; tasks_run() < pool.issued; k++) {
        cpu_relax();
        if (k % 64 == 0 && now_ns() > deadline) break;
    }
    if (tasks_run() < pool.issued) {
        pthread_mutex_lock(&pool.mu);
        atomic_store(&pool.caller_sleeps, true);
        while (tasks_run() < pool.issued) pthread_cond_wait(&pool.done, &pool.mu);
        atomic_store(&pool.caller_sleeps, false);
        pthread_mutex_unlock(&pool.mu);
    }
    atomic_flag_clear(&running);
}

typedef struct {
    int64_t n, chunk;
    RefRangeFn fn;
    void *ctx;
} RangesJob;

static void range_task(void *ctx, int64_t task)
{
    const RangesJob *j = ctx;
    int64_t lo = task * j->chunk, hi = j->n - lo < j->chunk ? j->n : lo + j->chunk;
    j->fn(j->ctx, lo, hi);
}

void ref_parallel_ranges(int64_t n, int64_t chunk, RefRangeFn fn, void *ctx)
{
    IR_ASSERT(chunk > 0);
    RangesJob j = {.n = n, .chunk = chunk, .fn = fn, .ctx = ctx};
    ref_parallel_for((n + chunk - 1) / chunk, range_task, &j);
}
