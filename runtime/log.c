/* log.c — what the training binary tells its user: errors, the progress line, JSON lines.
 *
 * Errors from the runtime are about bad input (a shard with the wrong magic, a truncated
 * checkpoint, a flag with a nonsense value), never about the program itself, so each is one line
 * that names the file and the problem, printed once by the function that found it. The last
 * message is also kept, so that tests can check what a user would read without capturing
 * stderr.
 *
 * Progress goes to stderr: on a terminal one line that is rewritten in place with '\r' (a long
 * run does not scroll the screen away), anywhere else one plain line per step (a log file or a
 * CI transcript keeps every step). The machine-readable record is a file of JSON lines, one
 * object per step, written with "%.9g" so that every f32 value (loss, grad norm) round-trips
 * exactly: resumed runs are compared with straight ones by these strings. A resumed run first
 * drops the log's lines of the steps it is about to repeat (rt_log_trim), so that the file holds
 * each step once, in order. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rt.h"

static const char *log_program = "fp8c-train";
static FILE *log_error_stream;          /* NULL: stderr */
static char log_last_error[65536];   /* one line, which may name many tensors */

void rt_set_program_name(const char *name) {
    if (!name || !*name) return;
    const char *slash = strrchr(name, '/');
    log_program = slash ? slash + 1 : name;
}

void rt_set_error_stream(FILE *f) { log_error_stream = f; }

const char *rt_program_name(void) { return log_program; }

const char *rt_last_error(void) { return log_last_error; }

void rt_clear_error(void) { log_last_error[0] = 0; }

void rt_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(log_last_error, sizeof log_last_error, fmt, ap);
    va_end(ap);
    FILE *out = log_error_stream ? log_error_stream : stderr;
    fprintf(out, "%s: error: %s\n", log_program, log_last_error);
    fflush(out);
}

static bool log_quiet;                 /* rt_note says nothing (the ranks after 0) */
void rt_set_quiet(bool quiet) { log_quiet = quiet; }

void rt_note(const char *fmt, ...) {
    if (log_quiet) return;
    FILE *out = log_error_stream ? log_error_stream : stderr;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(out, "%s: %s\n", log_program, buf);
    fflush(out);
}

bool rt_log_open(RtLog *l, const char *path, bool append) {
    memset(l, 0, sizeof *l);
    l->tty = isatty(fileno(stderr));
    if (!path) return true;
    l->json = fopen(path, append ? "a" : "w");
    if (!l->json) {
        rt_error("%s: cannot open the log file: %s", path, strerror(errno));
        return false;
    }
    l->path = path;
    return true;
}

/* A run resumed from the checkpoint of step s repeats steps s+1..., and a log it shares with
 * the run it continues already has lines for those (the earlier run got further than its last
 * checkpoint), perhaps ending in a line a crash cut short. Appending would log those steps
 * twice; instead the log is made to say what the checkpoint says: it is cut at the first line
 * that is incomplete (no newline) or whose step is beyond s, and everything from there on is
 * dropped, since the log is written in step order. The resumed run then appends its own lines
 * for those steps, bit-identical in loss and gradient norm to the ones dropped when the data and
 * flags are the same. The file is truncated in place (it keeps its owner, mode and links); a
 * line without a leading "step" is kept. */
bool rt_log_trim(const char *path, int64_t step, int *dropped) {
    *dropped = 0;
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return true;
    int64_t size = 0;
    uint8_t *text = rt_read_file(path, &size);
    if (!text) return false;
    int64_t cut = -1;
    for (int64_t at = 0; at < size;) {
        const uint8_t *nl = memchr(text + at, '\n', (size_t)(size - at));
        if (!nl) {
            if (cut < 0) cut = at;
            (*dropped)++;
            break;
        }
        int64_t end = nl - text + 1;
        long long s;
        char head[40];
        size_t k = (size_t)(end - at) < sizeof head - 1 ? (size_t)(end - at) : sizeof head - 1;
        memcpy(head, text + at, k);
        head[k] = 0;
        if (cut < 0 && sscanf(head, "{\"step\":%lld", &s) == 1 && s > step) cut = at;
        if (cut >= 0) (*dropped)++;
        at = end;
    }
    free(text);
    if (cut < 0) return true;
    if (truncate(path, (off_t)cut) != 0) {
        rt_error("%s: cannot drop the log's lines of steps after %lld: %s", path,
                 (long long)step, strerror(errno));
        return false;
    }
    return true;
}

bool rt_stdout_flush(void) {
    errno = 0;
    bool flushed = fflush(stdout) == 0;
    int err = errno;
    if (flushed && !ferror(stdout)) return true;
    /* an earlier write that failed inside printf leaves only the error flag, not its errno */
    rt_error("standard output: cannot write: %s", !flushed && err ? strerror(err) : "a write failed");
    return false;
}

bool rt_log_check_appendable(const char *path) {
    static const char head[] = "{\"step\":";   /* how every line of a log starts */
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size == 0) return true;
    char got[sizeof head - 1];
    FILE *f = fopen(path, "rb");
    if (!f) {
        rt_error("%s: cannot read the log file: %s", path, strerror(errno));
        return false;
    }
    size_t n = fread(got, 1, sizeof got, f);
    fclose(f);
    /* a first line a crash cut short within its first bytes is a prefix of the head */
    if (n > 0 && !memcmp(got, head, n)) return true;
    rt_error("%s: not a log of a training run (its first line is no {\"step\":...}), which a "
             "run that resumes or evaluates appends to: give another --log", path);
    return false;
}

/* JSON has no NaN or infinity; a non-finite loss is logged as null with the reason beside it. */
static bool log_json_number(FILE *f, const char *key, double x) {
    if (isfinite(x)) return fprintf(f, ",\"%s\":%.9g", key, x) >= 0;
    return fprintf(f, ",\"%s\":null", key) >= 0;
}

static void log_progress_end(RtLog *l) {
    if (l->progress_open) {
        fputc('\n', stderr);
        l->progress_open = false;
    }
}

/* A log that silently stops recording is a run whose record is lost, found out only when the
 * file is read; so every write is checked and a failure (a full disk, a quota, an I/O error) is
 * one line, after which the caller stops the run. The line is flushed at every step: a crash
 * loses no step already logged, and a failure shows at the step it happened. */
static bool log_failed(RtLog *l, int err) {
    if (!l->failed) rt_error("%s: cannot write the log: %s", l->path, strerror(err));
    l->failed = true;
    return false;
}

bool rt_log_step(RtLog *l, const LogRecord *r) {
    if (l->json && !l->failed) {
        FILE *f = l->json;
        errno = 0;
        bool ok = fprintf(f, "{\"step\":%lld", (long long)r->step) >= 0;
        ok = ok && log_json_number(f, "loss", r->loss);
        if (r->has_val) ok = ok && log_json_number(f, "val_loss", r->val_loss);
        ok = ok && log_json_number(f, "lr", r->lr);
        ok = ok && log_json_number(f, "grad_norm", r->grad_norm);
        ok = ok && log_json_number(f, "tokens_per_s", r->tokens_per_s);
        ok = ok && log_json_number(f, "ms", r->ms);
        ok = ok && fprintf(f, ",\"mem_bytes\":%lld", (long long)r->mem_bytes) >= 0;
        if (r->skipped) ok = ok && fputs(",\"skipped\":", f) >= 0 && rt_json_write_string(f, r->skipped);
        ok = ok && fputs("}\n", f) >= 0;
        ok = ok && fflush(f) == 0;
        if (!ok) {
            log_progress_end(l);
            return log_failed(l, errno ? errno : EIO);
        }
    }

    char line[256];
    /* a diverging loss prints as 3.1e+12, not as twenty digits */
    const char *loss_fmt = fabs(r->loss) < 1e4 ? "%.4f" : "%.3e";
    const char *val_fmt = fabs(r->val_loss) < 1e4 ? " | val %.4f" : " | val %.3e";
    int k = snprintf(line, sizeof line, "step %*lld/%lld | loss ", r->steps_width,
                     (long long)r->step, (long long)r->steps);
    k += snprintf(line + k, sizeof line - k, loss_fmt, r->loss);
    if (r->has_val) k += snprintf(line + k, sizeof line - k, val_fmt, r->val_loss);
    snprintf(line + k, sizeof line - k, " | lr %.2e | norm %.3f | %.0f tok/s | %.1f ms%s%s",
             r->lr, r->grad_norm, r->tokens_per_s, r->ms, r->skipped ? " | skipped: " : "",
             r->skipped ? r->skipped : "");
    if (l->tty) {
        /* \033[K clears what a longer previous line left behind. Lines with a validation loss
         * or a skipped update are kept on the screen; the others are overwritten. */
        fprintf(stderr, "\r%s\033[K", line);
        l->progress_open = true;
        if (r->has_val || r->skipped) log_progress_end(l);
    } else {
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
    return !l->failed;
}

bool rt_log_eval(RtLog *l, int64_t step, double val_loss, int64_t batches) {
    if (l->json && !l->failed) {
        errno = 0;
        bool ok = fprintf(l->json, "{\"step\":%lld", (long long)step) >= 0;
        ok = ok && log_json_number(l->json, "val_loss", val_loss);
        ok = ok && fprintf(l->json, ",\"eval_batches\":%lld,\"eval_only\":true}\n",
                           (long long)batches) >= 0;
        ok = ok && fflush(l->json) == 0;
        if (!ok) return log_failed(l, errno ? errno : EIO);
    }
    return true;
}

void rt_log_message(RtLog *l, const char *fmt, ...) {
    log_progress_end(l);
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    rt_note("%s", buf);
}

bool rt_log_close(RtLog *l) {
    log_progress_end(l);
    bool ok = !l->failed;
    if (l->json && fclose(l->json) != 0) ok = log_failed(l, errno);
    l->json = NULL;
    return ok;
}

/* ---------------------------------------------------------------- suggestions */

/* Edit distance (insertions, deletions, substitutions, adjacent swaps) of two short words. */
static int log_word_distance(const char *a, const char *b) {
    enum { MAX = 64 };
    int n = (int)strlen(a), m = (int)strlen(b);
    if (n >= MAX || m >= MAX) return MAX;
    int d[MAX][MAX];
    for (int i = 0; i <= n; i++) d[i][0] = i;
    for (int j = 0; j <= m; j++) d[0][j] = j;
    for (int i = 1; i <= n; i++)
        for (int j = 1; j <= m; j++) {
            int best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    return d[n][m];
}

const char *rt_nearest_word(const char *word, const char *const *list) {
    const char *best = NULL;
    int best_d = 1 + (int)strlen(word) / 3;
    for (int i = 0; list[i]; i++) {
        int d = log_word_distance(word, list[i]);
        if (d < best_d) best_d = d, best = list[i];
    }
    return best;
}
