/* tune.c — the kernel program's run-time choices, as the artifact's choice table fixes them.
 *
 * `fp8c tune` measures, and `fp8c build --tune FILE` writes into the artifact, the choices the
 * compiled program leaves to the runtime: on the CPU the thread count (cpu.threads), the GEMM
 * and attention tile path (cpu.tiles: amx, bf16dot or off) and the work per task of the loop
 * kernels (cpu.task_work: how finely a kernel's items are split over the threads). They take
 * the place of the defaults (every online CPU, the fastest tile path the CPU has, 2^14
 * operations a task); the environment (FP8C_THREADS, FP8C_CPU_TILES, FP8C_CPU_TASK_WORK) and
 * --threads still override them, which is also how the tuner times the candidates of one
 * binary without rebuilding it. A choice that does not apply here (a tile path this CPU lacks,
 * more threads than the pool allows) is said once and the default kept: the binary still
 * computes the same step, only slower than the record promised.
 *
 * The rule by which a measured candidate wins is here too (rt_tune_could_win), shared by fp8c
 * tune, which picks the winners, and the binary's GEMM tuning mode, which spends its checks
 * only on candidates the rule lets win. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref_internal.h"
#include "rt.h"

static bool env_set(const char *name)
{
    const char *s = getenv(name);
    return s && *s;
}

bool rt_tune_apply(const Graph *g)
{
    int64_t threads = ir_choice_int(g, "cpu.threads", 0);
    if (ir_choice(g, "cpu.threads") && (threads < 1 || threads > 1024)) {
        rt_error("artifact: choice cpu.threads=%s is not a thread count", ir_choice(g, "cpu.threads"));
        return false;
    }
    if (threads && !env_set("FP8C_THREADS")) ref_set_threads((int)threads);

    const char *tiles = ir_choice(g, "cpu.tiles");
    if (tiles && !env_set("FP8C_CPU_TILES") && !env_set("FP8C_CPU_AMX")) {
        int t = !strcmp(tiles, "off") ? CPU_TILES_OFF : !strcmp(tiles, "bf16dot") ? CPU_TILES_BF16DOT
              : !strcmp(tiles, "amx") ? CPU_TILES_AMX : -1;
        if (t < 0) {
            rt_error("artifact: choice cpu.tiles=%s is not amx, bf16dot or off", tiles);
            return false;
        }
        if (!cpu_tiles_select((CpuTiles)t))
            rt_note("the tuned tile path %s is not on this CPU; running the %s path", tiles,
                    cpu_tiles_name(cpu_tiles()));
    }

    int64_t work = ir_choice_int(g, "cpu.task_work", 0);
    if (ir_choice(g, "cpu.task_work") && work < 1) {
        rt_error("artifact: choice cpu.task_work=%s is not a positive count", ir_choice(g, "cpu.task_work"));
        return false;
    }
    if (work && !env_set("FP8C_CPU_TASK_WORK")) rt_cpu_set_task_work(work);
    return true;
}

/* ---------------------------------------------------------------- the winning rule */

static double half_spread(TuneTime t) { return (t.max - t.min) / 2; }

static double default_noise(TuneTime dflt) { return fmax(half_spread(dflt), 0.01 * dflt.median); }

double rt_tune_noise(TuneTime dflt, TuneTime cand) { return fmax(default_noise(dflt), half_spread(cand)); }

int rt_tune_could_win(TuneTime dflt, bool dflt_ok, const TuneTime *t, int n, int *order)
{
    int k = 0;
    if (dflt_ok && dflt.median < 0) return 0;   /* an untimed default is never beaten */
    for (int i = 0; i < n; i++) {
        if (t[i].median < 0) continue;
        if (dflt_ok && !(dflt.median - t[i].median > default_noise(dflt))) continue;
        int at = k++;   /* insertion: n is a few dozen */
        while (at > 0 && t[order[at - 1]].median > t[i].median) {
            order[at] = order[at - 1];
            at--;
        }
        order[at] = i;
    }
    return k;
}
