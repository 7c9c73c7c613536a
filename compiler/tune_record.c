/* tune_record.c — the tuning record: what `fp8c tune` measured, as JSON, and reading it back.
 *
 * A record says for which device, which fp8c and which model and build flags it was measured,
 * and for every choice point of the kernel program its candidates, their times and the winner.
 * `fp8c build/train/plan --tune FILE` reads it back and builds with the winners. A record is
 * only valid for what it was measured on: the same device (the GEMM algorithms of one cuBLASLt
 * on one GPU mean nothing on another; thread counts and tile paths belong to one CPU), the same
 * fp8c (its choice points and their names can change), and the same model text and build flags
 * (node ids, shapes and chunk counts follow from them). So the reader compares three keys and
 * names the first that differs; the caller refuses the record, or goes on with the defaults
 * when asked to (--tune-mismatch=defaults).
 *
 * The keys:
 *  - device: a fingerprint (16 hex digits, ir_fingerprint) of the device's description: for the
 *    CPU its model name, the features the kernels use and the online CPUs; for a GPU its name,
 *    SM count, driver, CUDA and cuBLASLt versions (the training binary's tuning mode reports
 *    them). The description is kept beside it for people to read.
 *  - fp8c: the version string.
 *  - model: a SHA-256 of the model file's text and the build flags that shape the graph (what
 *    `fp8c build` is given, less the output, the record itself and the tuner's own flags),
 *    each flag followed by the contents of the file it names (a --policy or --config file).
 *
 * Reading is strict: a file that is not JSON, or lacks a field, or has a choice name or value
 * the choice table does not allow, is one line naming the file and the field, and no record.
 * The JSON reader is the runtime's (runtime/json.c). */
#include "compiler.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rt.h"
#ifdef FP8C_HAVE_CUDA
#include "gpu.h"
#endif

/* ---------------------------------------------------------------- keys */

/* Flags that do not shape the graph or the kernel program: the output, the record, the tuner's
 * own flags and what only `plan` prints. Their values are skipped with them, in either
 * spelling that fp8c reads (`--device cuda`, `--device=cuda`, `-o NAME`, `-oNAME`). */
static bool flag_is_ignored(const char *f, bool *takes_value)
{
    static const char *const with_value[] = {"-o", "--tune", "--budget", "--memory-budget", "--device",
                                             "--tune-steps", "--tune-mismatch", "--print-ir-after",
                                             "--stop-after"};
    static const char *const alone[] = {"--json", "--kernels", "--print-kernels", "--verify",
                                        "--print-ir-after-all"};
    *takes_value = false;
    for (size_t i = 0; i < sizeof with_value / sizeof *with_value; i++) {
        const char *w = with_value[i];
        size_t n = strlen(w);
        if (!strcmp(f, w)) return *takes_value = true;
        if (!strncmp(f, w, n) && (f[n] == '=' || (w[1] != '-' && f[n]))) return true;
    }
    for (size_t i = 0; i < sizeof alone / sizeof *alone; i++)
        if (!strcmp(f, alone[i])) return true;
    return false;
}

/* The SHA-256 of a file a flag names, as a NUL-terminated field of the model key. */
static bool hash_named_file(FILE *key, const char *path)
{
    FILE *f = fopen(path, "rb");
    char *text = NULL;
    size_t len = 0;
    FILE *m = f ? open_memstream(&text, &len) : NULL;
    char chunk[65536];
    size_t got;
    while (m && (got = fread(chunk, 1, sizeof chunk, f)) > 0) fwrite(chunk, 1, got, m);
    bool ok = m && !ferror(f);
    int err = errno;
    if (f) fclose(f);
    if (m) fclose(m);
    if (!ok) {
        fprintf(stderr, "fp8c: error: cannot read '%s': %s\n", path, strerror(err));
        free(text);
        return false;
    }
    char hex[65];
    cache_sha256_hex(text, len, hex);
    free(text);
    fputs(hex, key);
    fputc(0, key);
    return true;
}

bool tune_model_key(const char *model, char **flags, int n_flags, char hex[65], char *shown,
                    size_t shown_len)
{
    FILE *f = fopen(model, "rb");
    if (!f) {
        fprintf(stderr, "fp8c: error: cannot read '%s': %s\n", model, strerror(errno));
        return false;
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    char chunk[65536];
    size_t got;
    while (m && (got = fread(chunk, 1, sizeof chunk, f)) > 0) fwrite(chunk, 1, got, m);
    fclose(f);
    if (!m) return false;
    fputc(0, m);   /* the text ends; the flags follow, each NUL-terminated */
    if (shown_len) shown[0] = 0;
    size_t at = 0;
    for (int i = 0; i < n_flags; i++) {
        if (!strcmp(flags[i], "--")) break;
        bool skip_value;
        if (flag_is_ignored(flags[i], &skip_value)) {
            i += skip_value;
            continue;
        }
        if (!strcmp(flags[i], model)) continue;   /* the file's text is hashed, not its path */
        fputs(flags[i], m);
        fputc(0, m);
        /* a file a flag names (--policy, --config) shapes the graph by what it holds: an edited
         * one is another model, whatever its path */
        const char *named = cache_flag_file(flags[i]);
        if (named && !hash_named_file(m, named)) {
            fclose(m);
            free(buf);
            return false;
        }
        if (at + strlen(flags[i]) + 2 < shown_len)
            at += (size_t)snprintf(shown + at, shown_len - at, "%s%s", at ? " " : "", flags[i]);
    }
    fclose(m);
    cache_sha256_hex(buf, len, hex);
    free(buf);
    return true;
}

void tune_device_fingerprint(const char *description, char out[17]) { ir_fingerprint(description, out); }

/* /proc/cpuinfo's model name and the features the CPU kernels choose between. */
bool tune_cpu_description(char *out, size_t len)
{
    char model[256] = "unknown CPU", flags[8192] = "";
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        char line[8192];
        bool have_model = false, have_flags = false;
        while (fgets(line, sizeof line, f) && !(have_model && have_flags)) {
            char *colon = strchr(line, ':');
            if (!colon) continue;
            char *v = colon + 1;
            while (*v == ' ') v++;
            v[strcspn(v, "\n")] = 0;
            if (!have_model && !strncmp(line, "model name", 10)) {
                snprintf(model, sizeof model, "%s", v);
                have_model = true;
            } else if (!have_flags && !strncmp(line, "flags", 5)) {
                snprintf(flags, sizeof flags, " %s ", v);
                have_flags = true;
            }
        }
        fclose(f);
    }
    static const char *const wanted[] = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                                         "amx_tile", "amx_bf16"};
    size_t at = (size_t)snprintf(out, len, "%s; features", model);
    for (size_t i = 0; i < sizeof wanted / sizeof *wanted && at < len; i++) {
        char key[32];
        snprintf(key, sizeof key, " %s ", wanted[i]);
        if (strstr(flags, key)) at += (size_t)snprintf(out + at, len - at, " %s", wanted[i]);
    }
    if (at < len) snprintf(out + at, len - at, "; %d threads", ref_cpu_count());
    return true;
}

const char *tune_current_device(const char *kind, char id[17])
{
    char desc[512];
    if (!strcmp(kind, "cpu")) {
        tune_cpu_description(desc, sizeof desc);
        tune_device_fingerprint(desc, id);
        return id;
    }
#ifdef FP8C_HAVE_CUDA
    if (cuda_device_description(desc, sizeof desc)) {
        tune_device_fingerprint(desc, id);
        return id;
    }
#endif
    return NULL;
}

/* ---------------------------------------------------------------- writing */

static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static void json_ms(FILE *f, const char *key, double ms)
{
    if (ms >= 0) fprintf(f, ", \"%s\": %.4f", key, ms);
    else fprintf(f, ", \"%s\": null", key);
}

bool tune_record_write(const TuneRecord *r, const char *path)
{
    /* written beside the target and renamed: a failed write never leaves half a record */
    size_t n = strlen(path) + 16;
    char *tmp = malloc(n);
    if (!tmp) return false;
    snprintf(tmp, n, "%s.XXXXXX", path);
    int fd = mkstemp(tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        fprintf(stderr, "fp8c: error: %s: cannot write the record: %s\n", path, strerror(errno));
        if (fd >= 0) close(fd), unlink(tmp);
        free(tmp);
        return false;
    }
    fprintf(f, "{\n  \"fp8c_tuning_record\": %d,\n  \"fp8c_version\": ", TUNE_RECORD_FORMAT);
    json_string(f, r->fp8c_version);
    fputs(",\n  \"device\": {\"kind\": ", f);
    json_string(f, r->device_kind);
    fputs(", \"id\": ", f);
    json_string(f, r->device_id);
    fputs(", \"description\": ", f);
    json_string(f, r->device_description);
    fputs("},\n  \"model\": {\"file\": ", f);
    json_string(f, r->model_file);
    fputs(", \"flags\": ", f);
    json_string(f, r->model_flags);
    fputs(", \"hash\": ", f);
    json_string(f, r->model_hash);
    fprintf(f, "},\n  \"method\": {\"steps\": %d, \"warmup\": %d, \"tolerance\": %g, \"budget_s\": %.1f, "
               "\"elapsed_s\": %.1f},\n",
            r->steps, r->warmup, r->tolerance, r->budget_s, r->elapsed_s);
    if (r->memory_budget > 0) fprintf(f, "  \"memory_budget_gib\": %.3f,\n", r->memory_budget / 1073741824.0);
    fprintf(f, "  \"default_step_ms\": %.4f,\n  \"tuned_step_ms\": %.4f,\n", r->default_ms, r->tuned_ms);
    fprintf(f, "  \"default_peak_mib\": %.1f,\n  \"tuned_peak_mib\": %.1f,\n", (double)r->default_peak / 1048576.0,
            (double)r->tuned_peak / 1048576.0);
    fputs("  \"choices\": [", f);
    for (int i = 0; i < r->n_points; i++) {
        const TunePoint *p = &r->points[i];
        fputs(i ? ",\n    {\"name\": " : "\n    {\"name\": ", f);
        json_string(f, p->name);
        fputs(", \"what\": ", f);
        json_string(f, p->what);
        fputs(", \"default\": ", f);
        json_string(f, p->dflt);
        fputs(", \"winner\": ", f);
        json_string(f, p->winner);
        fprintf(f, ", \"measured\": %s, \"unit\": \"%s\", \"candidates\": [", p->measured ? "true" : "false",
                p->per_gemm ? "us" : "ms");
        for (int k = 0; k < p->n_cand; k++) {
            const TuneCandidate *c = &p->cand[k];
            fputs(k ? ",\n      {\"value\": " : "\n      {\"value\": ", f);
            json_string(f, c->value);
            if (c->label[0]) {
                fputs(", \"label\": ", f);
                json_string(f, c->label);
            }
            json_ms(f, "median", c->median);
            json_ms(f, "min", c->min);
            json_ms(f, "max", c->max);
            if (c->max_rel_diff >= 0) fprintf(f, ", \"max_rel_diff\": %.3g", c->max_rel_diff);
            else fputs(", \"max_rel_diff\": null", f);
            if (c->peak > 0) fprintf(f, ", \"peak_mib\": %.1f", (double)c->peak / 1048576.0);
            fprintf(f, ", \"ok\": %s", c->ok ? "true" : "false");
            if (c->note[0]) {
                fputs(", \"note\": ", f);
                json_string(f, c->note);
            }
            fputc('}', f);
        }
        fputs(p->n_cand ? "]}" : "]}", f);
    }
    fputs("\n  ]\n}\n", f);
    bool ok = !ferror(f);
    if (fclose(f) != 0) ok = false;
    if (ok && rename(tmp, path) != 0) ok = false;
    if (!ok) {
        fprintf(stderr, "fp8c: error: %s: cannot write the record: %s\n", path, strerror(errno));
        unlink(tmp);
    }
    free(tmp);
    return ok;
}

/* ---------------------------------------------------------------- reading */

static bool field_fail(const char *path, const char *what)
{
    fprintf(stderr, "fp8c: error: %s: not a usable tuning record: %s\n", path, what);
    return false;
}

static bool get_str(const char *path, const Jv *o, const char *key, char *out, size_t len)
{
    const Jv *v = rt_json_get(o, key);
    char what[128];
    snprintf(what, sizeof what, "\"%s\" is missing or not a string", key);
    if (!v || v->kind != JV_STR) return field_fail(path, what);
    if (strlen(v->str) >= len) {
        snprintf(what, sizeof what, "\"%s\" is too long", key);
        return field_fail(path, what);
    }
    memcpy(out, v->str, strlen(v->str) + 1);
    return true;
}

static double get_ms(const Jv *o, const char *key)
{
    const Jv *v = rt_json_get(o, key);
    return v && v->kind == JV_NUM ? v->num : -1;
}

bool tune_record_read(const char *path, TuneRecord *r)
{
    memset(r, 0, sizeof *r);
    Jv root;
    rt_set_program_name("fp8c");
    if (!rt_json_read(path, &root)) return false;   /* its one line names the file and the byte */
    bool ok = false;
    const Jv *fmt = rt_json_get(&root, "fp8c_tuning_record");
    const Jv *dev = rt_json_get(&root, "device"), *model = rt_json_get(&root, "model");
    const Jv *choices = rt_json_get(&root, "choices");
    if (!fmt || fmt->kind != JV_NUM) {
        field_fail(path, "no \"fp8c_tuning_record\" format number (is this a tuning record?)");
    } else if (fmt->num != TUNE_RECORD_FORMAT) {
        char what[96];
        snprintf(what, sizeof what, "record format %g, this fp8c reads format %d", fmt->num, TUNE_RECORD_FORMAT);
        field_fail(path, what);
    } else if (!dev || dev->kind != JV_OBJ || !model || model->kind != JV_OBJ) {
        field_fail(path, "\"device\" or \"model\" is missing or not an object");
    } else if (!choices || choices->kind != JV_ARR) {
        field_fail(path, "\"choices\" is missing or not an array");
    } else if (get_str(path, &root, "fp8c_version", r->fp8c_version, sizeof r->fp8c_version) &&
               get_str(path, dev, "kind", r->device_kind, sizeof r->device_kind) &&
               get_str(path, dev, "id", r->device_id, sizeof r->device_id) &&
               get_str(path, dev, "description", r->device_description, sizeof r->device_description) &&
               get_str(path, model, "file", r->model_file, sizeof r->model_file) &&
               get_str(path, model, "flags", r->model_flags, sizeof r->model_flags) &&
               get_str(path, model, "hash", r->model_hash, sizeof r->model_hash)) {
        ok = true;
        if (strcmp(r->device_kind, "cpu") && strcmp(r->device_kind, "cuda"))
            ok = field_fail(path, "device \"kind\" is neither \"cpu\" nor \"cuda\"");
        r->default_ms = get_ms(&root, "default_step_ms");
        r->tuned_ms = get_ms(&root, "tuned_step_ms");
        r->default_peak = (int64_t)(get_ms(&root, "default_peak_mib") * 1048576.0);
        r->tuned_peak = (int64_t)(get_ms(&root, "tuned_peak_mib") * 1048576.0);
        r->points = calloc((size_t)(choices->n ? choices->n : 1), sizeof *r->points);
        if (!r->points) ok = field_fail(path, "out of memory");
        for (int i = 0; ok && i < choices->n; i++) {
            const Jv *c = &choices->items[i];
            TunePoint *p = &r->points[r->n_points++];
            char what[160];
            snprintf(what, sizeof what, "choice %d is not an object", i);
            if (c->kind != JV_OBJ) {
                ok = field_fail(path, what);
                break;
            }
            ok = get_str(path, c, "name", p->name, sizeof p->name) &&
                 get_str(path, c, "default", p->dflt, sizeof p->dflt) &&
                 get_str(path, c, "winner", p->winner, sizeof p->winner);
            if (!ok) break;
            const Jv *what_v = rt_json_get(c, "what");
            if (what_v && what_v->kind == JV_STR) snprintf(p->what, sizeof p->what, "%s", what_v->str);
            const Jv *unit = rt_json_get(c, "unit");
            p->per_gemm = unit && unit->kind == JV_STR && !strcmp(unit->str, "us");
            const Jv *meas = rt_json_get(c, "measured");
            p->measured = meas && meas->kind == JV_BOOL && meas->num != 0;
            if (!ir_choice_name_ok(p->name) || !ir_choice_value_ok(p->winner) ||
                (p->dflt[0] && !ir_choice_value_ok(p->dflt))) {
                snprintf(what, sizeof what, "choice \"%.60s\": a name or value with characters a choice cannot have",
                         p->name);
                ok = field_fail(path, what);
                break;
            }
            const Jv *cands = rt_json_get(c, "candidates");
            for (int k = 0; cands && cands->kind == JV_ARR && k < cands->n && p->n_cand < TUNE_MAX_CANDIDATES; k++) {
                const Jv *cv = &cands->items[k];
                const Jv *val = rt_json_get(cv, "value");
                if (!val || val->kind != JV_STR) continue;
                TuneCandidate *t = &p->cand[p->n_cand++];
                snprintf(t->value, sizeof t->value, "%s", val->str);
                const Jv *label = rt_json_get(cv, "label");
                if (label && label->kind == JV_STR) snprintf(t->label, sizeof t->label, "%s", label->str);
                t->median = get_ms(cv, "median");
                t->min = get_ms(cv, "min");
                t->max = get_ms(cv, "max");
                double peak = get_ms(cv, "peak_mib");
                t->peak = peak > 0 ? (int64_t)(peak * 1048576.0) : 0;
                const Jv *okv = rt_json_get(cv, "ok");
                t->ok = okv && okv->kind == JV_BOOL && okv->num != 0;
            }
        }
    }
    rt_json_free(&root);
    if (!ok) tune_record_free(r);
    return ok;
}

void tune_record_free(TuneRecord *r)
{
    free(r->points);
    r->points = NULL;
    r->n_points = 0;
}

/* ---------------------------------------------------------------- checking */

const char *tune_record_mismatch(const TuneRecord *r, const char *model_hash, const char *version,
                                 const char *device_id, char *why, size_t why_len)
{
    if (strcmp(r->fp8c_version, version)) {
        snprintf(why, why_len, "it was made by fp8c %s, this is fp8c %s", r->fp8c_version, version);
        return "fp8c version";
    }
    if (strcmp(r->model_hash, model_hash)) {
        snprintf(why, why_len, "it was made for %s %s (another model text or other build flags)",
                 r->model_file, r->model_flags);
        return "model";
    }
    if (device_id && strcmp(r->device_id, device_id)) {
        snprintf(why, why_len, "it was made on %s: %s", r->device_kind, r->device_description);
        return "device";
    }
    return NULL;
}

int tune_record_choices(const TuneRecord *r, Choice *out, int cap)
{
    int n = 0;
    for (int i = 0; i < r->n_points && n < cap; i++) {
        const TunePoint *p = &r->points[i];
        /* a default that won needs no entry, except a GEMM's algorithm: stored, it spares the
         * binary its timing at start-up */
        if (!p->measured || (!p->per_gemm && !strcmp(p->winner, p->dflt))) continue;
        out[n++] = (Choice){p->name, p->winner};
    }
    if (n < cap && r->device_id[0]) out[n++] = (Choice){"tune.device", r->device_id};
    return n;
}
