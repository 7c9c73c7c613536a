/* ckpt_resume.c — a resumed run takes its settings from the checkpoint it resumes.
 *
 * checkpoint.c writes the run's settings into every checkpoint's metadata (learning rate, its
 * floor, warm-up, steps, gradient accumulation, seed, batch, sequence, level). A resume reads
 * them back before anything else (rt_train, first): what the binary fixed (batch, sequence,
 * -O level, optimizer) must match, or the run could not continue as itself, and the resume stops with
 * the flag that would make a binary that can; what the command line sets is restored when it
 * is not given, and where it is given and differs, a note says so, since the schedule then
 * differs from the straight run's. Kept apart from checkpoint.c, which is the file format and
 * knows nothing of flags. */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

static bool meta_real(const RtStFile *f, const char *key, double *out) {
    const char *s = rt_ckpt_meta_get(f->meta, f->n_meta, key);
    if (!s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno) return false;
    *out = v;
    return true;
}

/* The run's settings as the checkpoint may hold them, each in the range its flag takes (the
 * learning rates as f32, which the step is fed). A key that is missing is of a checkpoint
 * written before it was recorded, and restores nothing; one that is present but is no such
 * number is a damaged file: taking the binary's default in its place would run another
 * schedule without a word, so it is refused, naming the key. */
static bool ckpt_settings_valid(const RtStFile *f, const char *path) {
    static const struct {
        const char *key;
        double lo, hi;
        bool whole;
        const char *what;
    } settings[] = {
        {RT_META_LR, 0, FLT_MAX, false, "a positive number within f32's range"},
        {RT_META_MIN_LR, 0, FLT_MAX, false, "a non-negative number within f32's range"},
        {RT_META_WARMUP, 0, INT32_MAX, true, "a whole number from 0 to 2147483647"},
        {RT_META_STEPS, 1, INT32_MAX, true, "a whole number from 1 to 2147483647"},
        {RT_META_GRAD_ACCUM, 1, 1 << 16, true, "a whole number from 1 to 65536"},
        {"batch", 1, INT32_MAX, true, "a whole number from 1 to 2147483647"},
        {"seq", 1, INT32_MAX, true, "a whole number from 1 to 2147483647"},
        {"opt_level", 0, 3, true, "a level from 0 to 3"},
    };
    for (size_t i = 0; i < sizeof settings / sizeof settings[0]; i++) {
        const char *s = rt_ckpt_meta_get(f->meta, f->n_meta, settings[i].key);
        double v = 0;
        if (!s) continue;
        bool ok = meta_real(f, settings[i].key, &v) && v >= settings[i].lo && v <= settings[i].hi &&
                  (!settings[i].whole || v == floor(v));
        if (ok && !strcmp(settings[i].key, RT_META_LR)) ok = (float)v > 0;
        if (!ok) {
            rt_error("%s: checkpoint metadata \"%s\" is '%s', not %s", path, settings[i].key, s,
                     settings[i].what);
            return false;
        }
    }
    return true;
}

/* One setting: restored when not given, else compared; a change is appended to `changed`. */
static void restore_real(const RtStFile *f, const char *key, const char *flag, bool given,
                         double *value, char *restored, char *changed, size_t len) {
    double saved;
    if (!meta_real(f, key, &saved)) return;
    size_t r = strlen(restored), c = strlen(changed);
    if (!given) {
        *value = saved;
        snprintf(restored + r, len - r, " %s %.9g", flag, saved);
    } else if ((float)*value != (float)saved) {
        snprintf(changed + c, len - c, "%s%s %.9g (the run's %.9g)", c ? ", " : "", flag, *value,
                 saved);
    }
}

/* The optimizer's states are the run's: AdamW's m and v mean nothing to Lion or SGD, so a
 * checkpoint of another optimizer is refused in one line before its tensors are matched (a
 * checkpoint without the key is of the time when AdamW was the only one). */
static bool ckpt_same_optimizer(const Graph *g, const RtStFile *f, const char *path) {
    const char *optim = rt_ckpt_meta_get(f->meta, f->n_meta, "optimizer");
    const char *saved = optim ? optim : "adamw", *mine = ir_optim_name(g->optim.kind);
    if (!strcmp(saved, mine)) return true;
    rt_error("%s: the run trained with --optimizer %s, this binary with %s: build it with "
             "--optimizer %s to continue the run (--init takes the weights into a fresh run "
             "with any optimizer)", path, saved, mine, saved);
    return false;
}

bool rt_ckpt_check_optimizer(const Graph *g, const char *path) {
    RtStFile f;
    if (!rt_st_open(&f, path)) return false;
    bool ok = ckpt_same_optimizer(g, &f, path);
    rt_st_close(&f);
    return ok;
}

int rt_ckpt_restore_run(const Graph *g, TrainOptions *o) {
    char path[4096];
    if (!rt_ckpt_resolve(o->resume, path, sizeof path)) return 1;
    RtStFile f;
    if (!rt_st_open(&f, path)) return 1;
    if (!ckpt_settings_valid(&f, path)) {
        rt_st_close(&f);
        return 1;
    }
    /* what the binary fixed: a run made at another shape or level cannot continue as itself */
    double batch = -1, seq = -1, level = -1;
    meta_real(&f, "batch", &batch);
    meta_real(&f, "seq", &seq);
    meta_real(&f, "opt_level", &level);
    if ((batch >= 0 && batch != (double)g->batch) || (seq >= 0 && seq != (double)g->seq)) {
        rt_error("%s: the run trained at batch %g x seq %g, this binary at %lld x %lld: its "
                 "batches would differ; build it with --batch %g --seq %g to continue the run",
                 path, batch, seq, (long long)g->batch, (long long)g->seq, batch, seq);
        rt_st_close(&f);
        return 2;
    }
    if (level >= 0 && level != (double)g->opt_level) {
        rt_error("%s: the run trained at -O%g, this binary at -O%d: build it with -O%g to continue "
                 "the run (--init takes the weights into a fresh run at any level)", path, level,
                 g->opt_level, level);
        rt_st_close(&f);
        return 2;
    }
    if (!ckpt_same_optimizer(g, &f, path)) {
        rt_st_close(&f);
        return 2;
    }
    /* the data is always given; batches are drawn over its files, so other files are other
     * batches (or the same files moved: a note, not an error) */
    const char *data = rt_ckpt_meta_get(f.meta, f.n_meta, "data");
    if (data && o->data && strcmp(data, o->data) != 0)
        rt_note("%s: the run read --data %s, this resume reads %s: unless they are the same "
                "files, its batches differ from the run's", path, data, o->data);
    char restored[512] = "", changed[512] = "";
    double lr = o->lr, min_lr = o->min_lr, warmup = (double)o->warmup, steps = (double)o->steps,
           accum = (double)o->grad_accum;
    restore_real(&f, RT_META_LR, "--lr", o->lr > 0, &lr, restored, changed, sizeof restored);
    double floor = 0;   /* a floor above a new --lr is not kept: the new lr's lr/10 is */
    bool floor_above = o->lr > 0 && meta_real(&f, RT_META_MIN_LR, &floor) && floor > o->lr;
    restore_real(&f, RT_META_MIN_LR, "--min-lr", o->min_lr >= 0 || floor_above, &min_lr, restored,
                 changed, sizeof restored);
    restore_real(&f, RT_META_WARMUP, "--warmup", o->warmup_given, &warmup, restored, changed,
                 sizeof restored);
    restore_real(&f, RT_META_STEPS, "--steps", o->steps_given, &steps, restored, changed,
                 sizeof restored);
    restore_real(&f, RT_META_GRAD_ACCUM, "--grad-accum", o->grad_accum_given, &accum, restored,
                 changed, sizeof restored);
    rt_st_close(&f);
    if (!(lr > 0 || lr == -1) || !(min_lr >= 0 || min_lr == -1) || warmup < 0 || warmup > INT32_MAX ||
        steps < 1 || steps > INT32_MAX || accum < 1 || accum > (1 << 16)) {
        rt_error("%s: checkpoint metadata: a setting of the run is out of range", path);
        return 1;
    }
    o->lr = lr, o->min_lr = min_lr, o->warmup = (int64_t)warmup, o->steps = (int64_t)steps;
    o->grad_accum = (int)accum;
    if (*restored) rt_note("resuming the run of %s with its%s", path, restored);
    if (*changed) rt_note("resuming with %s: given on the command line", changed);
    if (o->warmup > o->steps) {
        rt_error("--warmup %lld is longer than --steps %lld", (long long)o->warmup,
                 (long long)o->steps);
        return 2;
    }
    if (o->lr > 0 && o->min_lr > o->lr) {
        rt_error("--min-lr %g is above --lr %g", o->min_lr, o->lr);
        return 2;
    }
    return 0;
}
