/* test_rng.h — the tests' random numbers: splitmix64, seeded by each test's main (from
 * FP8C_TEST_SEED or the clock, printed so that a failing run can be repeated). Fresh random
 * data every run is the point: a backend must compute the same function on any input. */
#ifndef FP8C_TEST_RNG_H
#define FP8C_TEST_RNG_H

#include <math.h>
#include <stdint.h>

static uint64_t rng_state;

static inline uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline double rng_uniform(void) { return ((double)(rng_next() >> 11) + 0.5) / 9007199254740992.0; }

static inline float rng_normal(void)
{
    return (float)(sqrt(-2.0 * log(rng_uniform())) * cos(6.283185307179586 * rng_uniform()));
}

/* an integer in [lo, hi) */
static inline int64_t rng_int(int64_t lo, int64_t hi) { return lo + (int64_t)(rng_next() % (uint64_t)(hi - lo)); }

#endif
