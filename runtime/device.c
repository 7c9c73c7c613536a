/* device.c — which device runs the step: the registry and the cpu device.
 *
 * The runtime library itself knows only the cpu (the reference executor on the host arenas);
 * a binary that carries GPU kernels registers its GPU device from main before the flags are
 * checked. Keeping the registry here, and the GPU code in its own library, means tests and
 * CPU-only builds link nothing of CUDA, and the training binary links no GPU library at all:
 * the CUDA device opens the driver with dlopen only once it is chosen. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

#define DEVICE_MAX 4

static const RtDevice *device_table[DEVICE_MAX];
static int device_count;

/* ---------------------------------------------------------------- the cpu */

static bool cpu_probe(char *why, size_t why_len) {
    (void)why, (void)why_len;
    return true;
}
static bool cpu_open(Graph *g, RtMemory *host) {
    (void)g, (void)host;
    return true;
}
static void cpu_close(void) {}
static bool cpu_run_phase(Graph *g, Phase p) {
    ref_run_phase(g, p);
    return true;
}
static bool cpu_run_micro_step(Graph *g) {
    ref_run_micro_step(g);
    return true;
}
static bool cpu_sync(Tensor *const *ts, int n) {
    (void)ts, (void)n;
    return true;
}
static bool cpu_all_finite(Tensor *const *ts, int n, bool *finite) {
    *finite = true;
    for (int i = 0; i < n && *finite; i++) {
        float *x = ref_load(ts[i]);
        int64_t count = ir_numel(ts[i]);
        for (int64_t k = 0; k < count && *finite; k++) *finite = isfinite(x[k]);
        free(x);
    }
    return true;
}
static bool cpu_zero(Tensor *const *ts, int n) {
    for (int i = 0; i < n; i++)
        memset(ts[i]->data, 0, (size_t)(ir_numel(ts[i]) * fmt_elem_bytes(ts[i]->fmt.elem)));
    return true;
}
static const char *cpu_describe(void) { return "cpu"; }

const RtDevice rt_cpu_device = {
    .name = "cpu", .probe = cpu_probe, .open = cpu_open, .close = cpu_close,
    .run_phase = cpu_run_phase, .run_micro_step = cpu_run_micro_step, .push = cpu_sync, .pull = cpu_sync,
    .all_finite = cpu_all_finite, .zero = cpu_zero, .describe = cpu_describe,
};

/* ---------------------------------------------------------------- selection */

void rt_device_register(const RtDevice *d) {
    for (int i = 0; i < device_count; i++)
        if (device_table[i] == d) return;
    if (device_count < DEVICE_MAX) device_table[device_count++] = d;
}

static const RtDevice *device_find(const char *name) {
    for (int i = 0; i < device_count; i++)
        if (strcmp(device_table[i]->name, name) == 0) return device_table[i];
    return NULL;
}

const RtDevice *rt_device_find(const char *name) { return device_find(name); }

bool rt_device_known(const char *name) {
    return !strcmp(name, "cpu") || !strcmp(name, "ref") || !strcmp(name, "auto") || device_find(name);
}

/* "ref" is always the reference executor; "cpu" is the compiled CPU kernels when the binary
 * registered them (cpu_exec.c), else the reference too. */
const RtDevice *rt_device_select(const char *name) {
    char why[512] = "";
    if (!strcmp(name, "ref")) return &rt_cpu_device;
    if (!strcmp(name, "cpu") && !device_find("cpu")) return &rt_cpu_device;
    if (!strcmp(name, "auto")) {
        for (int i = 0; i < device_count; i++) {
            why[0] = 0;
            if (device_table[i]->probe(why, sizeof why)) return device_table[i];
        }
        return &rt_cpu_device;
    }
    const RtDevice *d = device_find(name);
    if (!d) {
        rt_error("--device %s: this runtime runs on the cpu only", name);
        return NULL;
    }
    if (!d->probe(why, sizeof why)) {
        rt_error("--device %s: %s", name, why);
        return NULL;
    }
    return d;
}
