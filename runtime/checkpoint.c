/* checkpoint.c — training state to and from safetensors files.
 *
 * A checkpoint holds every persistent tensor of the plan (parameters under their model names,
 * optimizer states as "P:adam_m", "P:master", scales, amax histories) in its storage dtype, so
 * a resumed run starts from exactly the bits the straight run had: FP8 states are not widened
 * and rounded again. The file is safetensors, readable by the Hugging Face tools: an 8-byte
 * little-endian header length, a JSON header (per tensor: dtype, shape, data_offsets into the
 * data block; "__metadata__": string to string), then the raw little-endian data. The header is
 * padded with spaces to a multiple of 8 bytes so that the data is aligned.
 *
 * Saving never leaves a half-written file under a checkpoint's name: the bytes go to a temp file
 * in the same directory, which is renamed over the target only once it is complete and synced,
 * and the directory is synced after the rename; `latest` is replaced the same way. A save that
 * returns has reached the disk, and a power cut at any point leaves either the old files or the
 * new ones. A failed save removes its temp file and leaves every existing file as it was.
 *
 * Loading checks everything before it writes a single byte into a tensor: the header length
 * against the file, the JSON, the set of tensor names (none missing, none extra), each dtype
 * and shape against the plan, that the data offsets tile the data block exactly, and that no
 * floating-point tensor holds a NaN or an infinity. A checkpoint that fails any check leaves the
 * training state untouched.
 *
 * The metadata also records the run's settings (learning rate, its floor, warm-up, steps,
 * gradient accumulation, seed, batch, sequence, level), so that a resume continues the same
 * run without the command line repeating them (rt_ckpt_restore_run, at the end). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "rt.h"

#define CKPT_MAX_HEADER (100 << 20)   /* safetensors' own limit on the JSON header */

/* ---------------------------------------------------------------- dtypes */

static const char *ckpt_dtype_name(ElemType e) {
    switch (e) {
    case FMT_F32: return "F32";
    case FMT_BF16: return "BF16";
    case FMT_F16: return "F16";
    case FMT_E4M3: return "F8_E4M3";
    case FMT_E5M2: return "F8_E5M2";
    case FMT_I8: return "I8";
    case FMT_U8: return "U8";
    case FMT_E8M0: return "F8_E8M0";
    case FMT_I32: return "I32";
    default: return NULL;
    }
}

static int64_t ckpt_tensor_bytes(const Tensor *t) {
    return ir_numel(t) * fmt_elem_bytes(t->fmt.elem);
}

static void ckpt_shape_text(char *buf, size_t n, int rank, const int64_t *dims) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < rank && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? "," : "", (long long)dims[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

const char *rt_ckpt_meta_get(const CkptMeta *m, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (strcmp(m[i].key, key) == 0) return m[i].value;
    return NULL;
}

/* ---------------------------------------------------------------- header writer */

typedef struct {
    char *buf;
    size_t len, cap;
    bool failed;
} Text;

static void text_putn(Text *t, const char *s, size_t n) {
    if (t->failed) return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (t->len + n + 1 > cap) cap *= 2;
        char *grown = realloc(t->buf, cap);
        if (!grown) {
            t->failed = true;
            return;
        }
        t->buf = grown;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, s, n);
    t->len += n;
    t->buf[t->len] = 0;
}

static void text_printf(Text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void text_printf(Text *t, const char *fmt, ...) {
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < (int)sizeof small) {
        text_putn(t, small, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        t->failed = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    text_putn(t, big, (size_t)n);
    free(big);
}

static void text_json_string(Text *t, const char *s) {
    char small[256];
    size_t n = rt_json_quote(small, sizeof small, s);
    if (n < sizeof small) {
        text_putn(t, small, n);
        return;
    }
    char *big = malloc(n + 1);
    if (!big) {
        t->failed = true;
        return;
    }
    rt_json_quote(big, n + 1, s);
    text_putn(t, big, n);
    free(big);
}

/* ---------------------------------------------------------------- save */

static bool ckpt_write_all(FILE *f, const void *p, size_t n) {
    return n == 0 || fwrite(p, 1, n, f) == n;
}

/* Makes a temp file next to `path`, named ".BASE.XXXXXX" (six letters or digits; the next
 * start in the directory removes such files that a crash left behind, rt_ckpt_open_dir).
 * Created with mode 0666 so that the umask applies, as to any file a tool writes: mkstemp's
 * 0600 would hide checkpoints from the group that shares a run directory. Returns its FILE and
 * name (to free), NULL on failure with errno set. */
static FILE *ckpt_temp_beside(const char *path, char **tmp_name) {
    static const char letters[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    static uint64_t counter;
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path + 1) : 0;
    const char *base = slash ? slash + 1 : path;
    size_t n = dir_len + strlen(base) + 16;
    char *name = malloc(n);
    if (!name) return NULL;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    uint64_t x = (uint64_t)now.tv_nsec ^ (uint64_t)now.tv_sec << 30 ^ (uint64_t)getpid() << 16;
    for (int attempt = 0; attempt < 100; attempt++) {
        char suffix[7];
        /* splitmix64's steps: distinct suffixes for successive attempts and calls */
        uint64_t h = x + ++counter * 0x9e3779b97f4a7c15ull;
        h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
        h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
        h ^= h >> 31;
        for (int i = 0; i < 6; i++, h /= 62) suffix[i] = letters[h % 62];
        suffix[6] = 0;
        snprintf(name, n, "%.*s.%s.%s", (int)dir_len, path, base, suffix);
        int fd = open(name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno == EEXIST) continue;
        if (fd < 0) break;
        FILE *f = fdopen(fd, "wb");
        if (!f) {
            int err = errno;
            close(fd);
            unlink(name);
            errno = err;
            break;
        }
        *tmp_name = name;
        return f;
    }
    free(name);
    return NULL;
}

/* fsync of the directory holding `path`: a rename is durable only once its directory is. A file
 * system that cannot sync directories (EINVAL) has nothing more to offer and is not an error. */
static bool ckpt_sync_dir_of(const char *path) {
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        rt_error("%s: cannot open the directory to sync it: %s", dir, strerror(errno));
        return false;
    }
    bool ok = fsync(fd) == 0 || errno == EINVAL;
    int err = errno;
    close(fd);
    if (!ok) rt_error("%s: cannot sync the directory: %s", dir, strerror(err));
    return ok;
}

/* Writes the header and the tensors' data to `path` through a synced temp file and a rename. */
static bool ckpt_replace_file(const char *path, const Text *head, Tensor *const *ts, int n,
                              RtCkptFill fill, void *ctx) {
    char *tmp = NULL;
    FILE *f = ckpt_temp_beside(path, &tmp);
    if (!f) {
        rt_error("%s: cannot create a temp file beside it: %s", path, strerror(errno));
        return false;
    }
    bool ok = ckpt_write_all(f, head->buf, head->len);
    int err = 0;
    for (int i = 0; ok && i < n; i++) {
        size_t bytes = (size_t)ckpt_tensor_bytes(ts[i]);
        if (!fill) {
            ok = ckpt_write_all(f, ts[i]->data, bytes);
            continue;
        }
        void *buf = malloc(bytes ? bytes : 1);
        if (!buf || !fill(ctx, i, buf)) {   /* fill reported its own error */
            if (!buf) rt_error("%s: out of memory writing tensor %s", path, ts[i]->name);
            free(buf);
            fclose(f);
            unlink(tmp);
            free(tmp);
            return false;
        }
        ok = ckpt_write_all(f, buf, bytes);
        free(buf);
    }
    if (!ok) err = errno;
    if (ok && fflush(f) != 0) ok = false, err = errno;
    if (ok && fsync(fileno(f)) != 0) ok = false, err = errno;
    if (fclose(f) != 0 && ok) ok = false, err = errno;
    if (ok && rename(tmp, path) != 0) ok = false, err = errno;
    if (!ok) {
        rt_error("%s: cannot write: %s", path, strerror(err));
        unlink(tmp);
    }
    free(tmp);
    return ok && ckpt_sync_dir_of(path);
}

bool rt_ckpt_save(const char *path, Tensor *const *ts, int n, const CkptMeta *meta, int n_meta) {
    return rt_ckpt_save_filled(path, ts, n, meta, n_meta, NULL, NULL);
}

bool rt_ckpt_save_filled(const char *path, Tensor *const *ts, int n, const CkptMeta *meta,
                         int n_meta, RtCkptFill fill, void *ctx) {
    for (int i = 0; i < n; i++) {
        const Tensor *t = ts[i];
        if (!t->name || !*t->name) {
            rt_error("%s: cannot save a tensor without a name", path);
            return false;
        }
        if (!ckpt_dtype_name(t->fmt.elem)) {
            rt_error("%s: cannot save tensor %s: element type %s has no safetensors dtype", path,
                     t->name, fmt_elem_name(t->fmt.elem));
            return false;
        }
        if (!fill && !t->data && ckpt_tensor_bytes(t) > 0) {
            rt_error("%s: cannot save tensor %s: it has no storage", path, t->name);
            return false;
        }
        for (int j = 0; j < i; j++)
            if (strcmp(ts[j]->name, t->name) == 0) {
                rt_error("%s: cannot save two tensors named %s", path, t->name);
                return false;
            }
    }

    Text head = {0};
    text_putn(&head, "01234567", 8);   /* the length, filled in below */
    text_putn(&head, "{\"__metadata__\":{", 17);
    for (int i = 0; i < n_meta; i++) {
        if (i) text_putn(&head, ",", 1);
        text_json_string(&head, meta[i].key);
        text_putn(&head, ":", 1);
        text_json_string(&head, meta[i].value);
    }
    text_putn(&head, "}", 1);
    int64_t offset = 0;
    for (int i = 0; i < n; i++) {
        const Tensor *t = ts[i];
        int64_t bytes = ckpt_tensor_bytes(t);
        text_putn(&head, ",", 1);
        text_json_string(&head, t->name);
        text_printf(&head, ":{\"dtype\":\"%s\",\"shape\":[", ckpt_dtype_name(t->fmt.elem));
        for (int d = 0; d < t->rank; d++)
            text_printf(&head, "%s%lld", d ? "," : "", (long long)t->dims[d]);
        text_printf(&head, "],\"data_offsets\":[%lld,%lld]}", (long long)offset,
                    (long long)(offset + bytes));
        offset += bytes;
    }
    text_putn(&head, "}", 1);
    while (head.len % 8) text_putn(&head, " ", 1);
    if (head.failed) {
        free(head.buf);
        rt_error("%s: out of memory writing the header", path);
        return false;
    }
    uint64_t hlen = head.len - 8;
    for (int b = 0; b < 8; b++) head.buf[b] = (char)(hlen >> (8 * b));
    bool ok = ckpt_replace_file(path, &head, ts, n, fill, ctx);
    free(head.buf);
    return ok;
}

/* ---------------------------------------------------------------- header parser
 * Only what safetensors headers use: objects, arrays, strings, non-negative integers. Every
 * error names the byte offset in the header where it was found. */

typedef struct {
    const char *path;
    const char *start, *p, *end;
    bool failed;
} Json;

static bool json_fail(Json *j, const char *what) {
    if (!j->failed)
        rt_error("%s: bad checkpoint header: %s at byte %ld of the JSON header", j->path, what,
                 (long)(j->p - j->start));
    j->failed = true;
    return false;
}

static void json_space(Json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static bool json_eat(Json *j, char c) {
    json_space(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return true;
    }
    return false;
}

static bool json_expect(Json *j, char c) {
    if (json_eat(j, c)) return true;
    char what[32];
    snprintf(what, sizeof what, "expected '%c'", c);
    return json_fail(j, what);
}

static int json_hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Parses a string into a malloc'ed copy with escapes decoded (\uXXXX as UTF-8). */
static char *json_string(Json *j) {
    json_space(j);
    if (j->p >= j->end || *j->p != '"') return json_fail(j, "expected a string"), NULL;
    j->p++;
    char *out = malloc((size_t)(j->end - j->p) + 1);
    if (!out) return json_fail(j, "out of memory"), NULL;
    size_t k = 0;
    while (j->p < j->end && *j->p != '"') {
        unsigned char c = (unsigned char)*j->p++;
        if (c < 0x20) {
            free(out);
            return json_fail(j, "control character in a string"), NULL;
        }
        if (c != '\\') {
            out[k++] = (char)c;
            continue;
        }
        if (j->p >= j->end) break;
        char e = *j->p++;
        switch (e) {
        case '"': case '\\': case '/': out[k++] = e; break;
        case 'b': out[k++] = '\b'; break;
        case 'f': out[k++] = '\f'; break;
        case 'n': out[k++] = '\n'; break;
        case 'r': out[k++] = '\r'; break;
        case 't': out[k++] = '\t'; break;
        case 'u': {
            unsigned u = 0;
            for (int i = 0; i < 4; i++) {
                int h = j->p < j->end ? json_hex(*j->p++) : -1;
                if (h < 0) {
                    free(out);
                    return json_fail(j, "bad \\u escape"), NULL;
                }
                u = u << 4 | (unsigned)h;
            }
            if (u < 0x80) {
                out[k++] = (char)u;
            } else if (u < 0x800) {
                out[k++] = (char)(0xc0 | u >> 6);
                out[k++] = (char)(0x80 | (u & 0x3f));
            } else {
                out[k++] = (char)(0xe0 | u >> 12);
                out[k++] = (char)(0x80 | ((u >> 6) & 0x3f));
                out[k++] = (char)(0x80 | (u & 0x3f));
            }
            break;
        }
        default: free(out); return json_fail(j, "bad escape in a string"), NULL;
        }
    }
    if (j->p >= j->end) {
        free(out);
        return json_fail(j, "unterminated string"), NULL;
    }
    j->p++;
    out[k] = 0;
    return out;
}

static bool json_int(Json *j, int64_t *out) {
    json_space(j);
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') return json_fail(j, "expected an integer");
    int64_t v = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        if (v > (INT64_MAX - 9) / 10) return json_fail(j, "integer too large");
        v = v * 10 + (*j->p++ - '0');
    }
    *out = v;
    return true;
}

/* [n, n, ...] into out (at most max); *count receives the length. */
static bool json_int_array(Json *j, int64_t *out, int max, int *count) {
    if (!json_expect(j, '[')) return false;
    *count = 0;
    if (json_eat(j, ']')) return true;
    do {
        if (*count == max) return json_fail(j, "array too long");
        if (!json_int(j, &out[(*count)++])) return false;
    } while (json_eat(j, ','));
    return json_expect(j, ']');
}

typedef RtStEntry CkptEntry;

static bool json_tensor(Json *j, CkptEntry *e) {
    if (!json_expect(j, '{')) return false;
    bool have_dtype = false, have_shape = false, have_offsets = false;
    do {
        char *key = json_string(j);
        if (!key || !json_expect(j, ':')) {
            free(key);
            return false;
        }
        bool ok = true;
        if (strcmp(key, "dtype") == 0 && !have_dtype) {
            ok = (e->dtype = json_string(j)) != NULL;
            have_dtype = true;
        } else if (strcmp(key, "shape") == 0 && !have_shape) {
            ok = json_int_array(j, e->dims, IR_MAX_RANK, &e->rank);
            have_shape = true;
        } else if (strcmp(key, "data_offsets") == 0 && !have_offsets) {
            int64_t off[2];
            int count = 0;
            ok = json_int_array(j, off, 2, &count);
            if (ok && count != 2) ok = json_fail(j, "data_offsets needs two numbers");
            if (ok && off[1] < off[0]) ok = json_fail(j, "data_offsets end before they begin");
            e->begin = off[0];
            e->end = off[1];
            have_offsets = true;
        } else {
            ok = json_fail(j, "unexpected or repeated key in a tensor entry");
        }
        free(key);
        if (!ok) return false;
    } while (json_eat(j, ','));
    if (!json_expect(j, '}')) return false;
    if (!have_dtype || !have_shape || !have_offsets)
        return json_fail(j, "tensor entry lacks dtype, shape or data_offsets");
    return true;
}

static bool json_metadata(Json *j, CkptMeta *meta, int max_meta, int *n_meta) {
    if (!json_expect(j, '{')) return false;
    if (json_eat(j, '}')) return true;
    do {
        char *key = json_string(j);
        char *value = key && json_expect(j, ':') ? json_string(j) : NULL;
        bool ok = value != NULL;
        if (ok && *n_meta < max_meta) {
            CkptMeta *m = &meta[(*n_meta)++];
            snprintf(m->key, sizeof m->key, "%s", key);
            snprintf(m->value, sizeof m->value, "%s", value);
        }
        free(key);
        free(value);
        if (!ok) return false;
    } while (json_eat(j, ','));
    return json_expect(j, '}');
}

static void ckpt_entries_free(CkptEntry *e, int n) {
    for (int i = 0; i < n; i++) {
        free(e[i].name);
        free(e[i].dtype);
    }
    free(e);
}

/* The whole header: entries (malloc'ed) and metadata. */
static bool json_header(Json *j, CkptEntry **entries, int *n_entries, CkptMeta *meta,
                        int max_meta, int *n_meta) {
    *entries = NULL;
    *n_entries = 0;
    int cap = 0;
    if (!json_expect(j, '{')) return false;
    if (json_eat(j, '}')) return true;
    do {
        char *key = json_string(j);
        if (!key || !json_expect(j, ':')) {
            free(key);
            return false;
        }
        if (strcmp(key, "__metadata__") == 0) {
            free(key);
            if (!json_metadata(j, meta, max_meta, n_meta)) return false;
            continue;
        }
        for (int i = 0; i < *n_entries; i++)
            if (strcmp((*entries)[i].name, key) == 0) {
                free(key);
                return json_fail(j, "a tensor name appears twice");
            }
        if (*n_entries == cap) {
            cap = cap ? 2 * cap : 64;
            CkptEntry *grown = realloc(*entries, (size_t)cap * sizeof *grown);
            if (!grown) {
                free(key);
                return json_fail(j, "out of memory");
            }
            *entries = grown;
        }
        CkptEntry *e = &(*entries)[(*n_entries)++];
        memset(e, 0, sizeof *e);
        e->name = key;
        if (!json_tensor(j, e)) return false;
    } while (json_eat(j, ','));
    if (!json_expect(j, '}')) return false;
    json_space(j);
    if (j->p != j->end) return json_fail(j, "text after the header object");
    return true;
}

/* ---------------------------------------------------------------- load */

static int ckpt_cmp_begin(const void *a, const void *b) {
    const CkptEntry *x = *(CkptEntry *const *)a, *y = *(CkptEntry *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Everything a checkpoint must satisfy against the plan, before any tensor is written. */
static bool ckpt_check(const char *path, CkptEntry *entries, int n_entries, Tensor *const *ts,
                       int n, int64_t data_bytes, CkptEntry **match) {
    for (int i = 0; i < n; i++) {
        const Tensor *t = ts[i];
        CkptEntry *e = NULL;
        for (int k = 0; k < n_entries && !e; k++)
            if (!entries[k].used && strcmp(entries[k].name, t->name) == 0) e = &entries[k];
        if (!e) {
            rt_error("%s: checkpoint lacks tensor %s", path, t->name);
            return false;
        }
        e->used = true;
        match[i] = e;
        const char *want = ckpt_dtype_name(t->fmt.elem);
        if (!want || strcmp(e->dtype, want) != 0) {
            rt_error("%s: tensor %s is %s in the checkpoint, the plan stores it as %s", path,
                     t->name, e->dtype, want ? want : fmt_elem_name(t->fmt.elem));
            return false;
        }
        bool same = e->rank == t->rank;
        for (int d = 0; same && d < t->rank; d++) same = e->dims[d] == t->dims[d];
        if (!same) {
            char a[128], b[128];
            ckpt_shape_text(a, sizeof a, e->rank, e->dims);
            ckpt_shape_text(b, sizeof b, t->rank, t->dims);
            rt_error("%s: tensor %s has shape %s in the checkpoint, the plan has %s", path,
                     t->name, a, b);
            return false;
        }
        if (e->end - e->begin != ckpt_tensor_bytes(t)) {
            rt_error("%s: tensor %s has %lld data bytes, its shape and dtype need %lld", path,
                     t->name, (long long)(e->end - e->begin), (long long)ckpt_tensor_bytes(t));
            return false;
        }
        if (e->end > data_bytes) {
            rt_error("%s: truncated: tensor %s ends at byte %lld of the data, the file holds %lld",
                     path, t->name, (long long)e->end, (long long)data_bytes);
            return false;
        }
    }
    for (int k = 0; k < n_entries; k++)
        if (!entries[k].used) {
            rt_error("%s: checkpoint has tensor %s, which the plan does not have", path,
                     entries[k].name);
            return false;
        }
    /* the data block must be tiled exactly: no overlaps, no holes, nothing after */
    CkptEntry **order = malloc((size_t)(n_entries ? n_entries : 1) * sizeof *order);
    if (!order) {
        rt_error("%s: out of memory", path);
        return false;
    }
    for (int k = 0; k < n_entries; k++) order[k] = &entries[k];
    qsort(order, (size_t)n_entries, sizeof *order, ckpt_cmp_begin);
    int64_t at = 0;
    bool ok = true;
    for (int k = 0; k < n_entries && ok; k++) {
        if (order[k]->begin != at) {
            rt_error("%s: tensor %s's data starts at byte %lld, expected %lld (overlap or hole)",
                     path, order[k]->name, (long long)order[k]->begin, (long long)at);
            ok = false;
        }
        at = order[k]->end;
    }
    free(order);
    if (ok && at != data_bytes) {
        rt_error("%s: %lld bytes after the last tensor's data", path, (long long)(data_bytes - at));
        ok = false;
    }
    return ok;
}

/* What a stored element is when it is not finite ("NaN", "infinity"), else NULL; the data is
 * little-endian. e4m3 has no infinity (0x7f/0xff are NaN), e8m0's only non-finite code is
 * 0xff, and integer types are always finite. */
static const char *ckpt_non_finite(ElemType e, const uint8_t *p) {
    switch (e) {
    case FMT_F32: {
        uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        if ((u >> 23 & 0xff) != 0xff) return NULL;
        return u & 0x7fffff ? "NaN" : "infinity";
    }
    case FMT_BF16: {
        unsigned u = p[0] | p[1] << 8;
        if ((u >> 7 & 0xff) != 0xff) return NULL;
        return u & 0x7f ? "NaN" : "infinity";
    }
    case FMT_F16: {
        unsigned u = p[0] | p[1] << 8;
        if ((u >> 10 & 0x1f) != 0x1f) return NULL;
        return u & 0x3ff ? "NaN" : "infinity";
    }
    case FMT_E4M3: return (p[0] & 0x7f) == 0x7f ? "NaN" : NULL;
    case FMT_E5M2:
        if ((p[0] >> 2 & 0x1f) != 0x1f) return NULL;
        return p[0] & 3 ? "NaN" : "infinity";
    case FMT_E8M0: return p[0] == 0xff ? "NaN" : NULL;
    default: return NULL;
    }
}

/* A training state holds only finite values: the runtime never applies an update after a
 * non-finite loss or gradient, and it backs non-finite amax entries off before it saves. A NaN
 * or infinity in a checkpoint therefore means a damaged or foreign file, and resuming from it
 * would only train into NaN. The data of every floating-point tensor is read once in chunks to
 * check it before any tensor is written (the read that fills the tensors then comes from the
 * page cache). */
static bool ckpt_check_finite(const char *path, FILE *f, int64_t data_start, Tensor *const *ts,
                              int n, CkptEntry *const *match) {
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = NULL;
    bool ok = true;
    for (int i = 0; ok && i < n; i++) {
        ElemType e = ts[i]->fmt.elem;
        int64_t size = fmt_elem_bytes(e);
        if (e == FMT_I8 || e == FMT_U8 || e == FMT_I32) continue;
        int64_t bytes = match[i]->end - match[i]->begin, chunk = CHUNK / size * size;
        if (!buf && bytes && !(buf = malloc(CHUNK))) {
            rt_error("%s: out of memory", path);
            return false;
        }
        if (bytes && fseeko(f, data_start + match[i]->begin, SEEK_SET) != 0) {
            rt_error("%s: read error in tensor %s", path, ts[i]->name);
            ok = false;
        }
        for (int64_t at = 0; ok && at < bytes; at += chunk) {
            size_t want = (size_t)(bytes - at < chunk ? bytes - at : chunk);
            if (fread(buf, 1, want, f) != want) {
                rt_error("%s: read error in tensor %s", path, ts[i]->name);
                ok = false;
                break;
            }
            for (size_t k = 0; k < want; k += (size_t)size) {
                const char *what = ckpt_non_finite(e, buf + k);
                if (what) {
                    rt_error("%s: tensor %s holds %s at element %lld: a training state is finite",
                             path, ts[i]->name, what, (long long)((at + (int64_t)k) / size));
                    ok = false;
                    break;
                }
            }
        }
    }
    free(buf);
    return ok;
}

/* The header is read and checked in memory; the data is then read straight into the tensors,
 * so loading a checkpoint never needs a second copy of the model's state. */
bool rt_ckpt_load(const char *path, Tensor *const *ts, int n, CkptMeta *meta, int max_meta,
                  int *n_meta) {
    *n_meta = 0;
    int64_t size = 0;
    FILE *f = rt_open_regular(path, "cannot read the checkpoint", &size);
    if (!f) return false;
    bool ok = false;
    char *header = NULL;
    CkptEntry *entries = NULL;
    int n_entries = 0;
    CkptEntry **match = NULL;
    uint8_t len8[8];
    if (size < 8 || fread(len8, 1, 8, f) != 8) {
        rt_error("%s: not a checkpoint: %lld bytes, too short for a safetensors header", path,
                 (long long)size);
        goto done;
    }
    uint64_t hlen = 0;
    for (int b = 7; b >= 0; b--) hlen = hlen << 8 | len8[b];
    if (hlen < 2 || hlen > CKPT_MAX_HEADER || hlen > (uint64_t)(size - 8)) {
        rt_error("%s: not a checkpoint or truncated: header length %llu, file size %lld", path,
                 (unsigned long long)hlen, (long long)size);
        goto done;
    }
    header = malloc(hlen);
    if (!header || fread(header, 1, hlen, f) != hlen) {
        rt_error("%s: cannot read the %llu-byte header", path, (unsigned long long)hlen);
        goto done;
    }
    Json j = {.path = path, .start = header, .p = header, .end = header + hlen};
    if (!json_header(&j, &entries, &n_entries, meta, max_meta, n_meta)) goto done;
    match = malloc((size_t)(n ? n : 1) * sizeof *match);
    if (!match) {
        rt_error("%s: out of memory", path);
        goto done;
    }
    int64_t data_start = 8 + (int64_t)hlen;
    if (!ckpt_check(path, entries, n_entries, ts, n, size - data_start, match)) goto done;
    if (!ckpt_check_finite(path, f, data_start, ts, n, match)) goto done;
    for (int i = 0; i < n; i++) {
        size_t bytes = (size_t)(match[i]->end - match[i]->begin);
        if (bytes && (fseeko(f, data_start + match[i]->begin, SEEK_SET) != 0 ||
                      fread(ts[i]->data, 1, bytes, f) != bytes)) {
            rt_error("%s: read error in tensor %s", path, ts[i]->name);
            goto done;
        }
    }
    ok = true;
done:
    if (!ok) *n_meta = 0;
    free(match);
    ckpt_entries_free(entries, n_entries);
    free(header);
    fclose(f);
    return ok;
}

/* ---------------------------------------------------------------- reading any safetensors file
 * For weights that are not a training state (Hugging Face files given to --init): the header
 * is parsed and checked as above, and every entry's bytes must lie within the data block and,
 * for a dtype this file knows, match its shape; what the entries mean is the caller's business.
 * The data is read one tensor at a time on request, so a model of many gigabytes is never held
 * twice. */

int rt_st_dtype_bytes(const char *dtype) {
    static const struct { const char *name; int bytes; } sizes[] = {
        {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
        {"F8_E8M0", 1}, {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1}, {"U8", 1}, {"BOOL", 1},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (strcmp(dtype, sizes[i].name) == 0) return sizes[i].bytes;
    return 0;
}

bool rt_st_open(RtStFile *s, const char *path) {
    memset(s, 0, sizeof *s);
    int64_t size = 0;
    FILE *f = rt_open_regular(path, "cannot read the weights", &size);
    if (!f) return false;
    uint8_t len8[8];
    char *header = NULL;
    if (size < 8 || fread(len8, 1, 8, f) != 8) {
        rt_error("%s: not a safetensors file: %lld bytes, too short for a header", path,
                 (long long)size);
        goto fail;
    }
    uint64_t hlen = 0;
    for (int b = 7; b >= 0; b--) hlen = hlen << 8 | len8[b];
    if (hlen < 2 || hlen > CKPT_MAX_HEADER || hlen > (uint64_t)(size - 8)) {
        rt_error("%s: not a safetensors file or truncated: header length %llu, file size %lld",
                 path, (unsigned long long)hlen, (long long)size);
        goto fail;
    }
    header = malloc(hlen);
    if (!header || fread(header, 1, hlen, f) != hlen) {
        rt_error("%s: cannot read the %llu-byte header", path, (unsigned long long)hlen);
        goto fail;
    }
    Json j = {.path = path, .start = header, .p = header, .end = header + hlen};
    if (!json_header(&j, &s->entries, &s->n_entries, s->meta, RT_ST_MAX_META, &s->n_meta))
        goto fail;
    free(header);
    header = NULL;
    s->data_start = 8 + (int64_t)hlen;
    int64_t data_bytes = size - s->data_start;
    for (int k = 0; k < s->n_entries; k++) {
        const RtStEntry *e = &s->entries[k];
        if (e->end > data_bytes) {
            rt_error("%s: truncated: tensor %s ends at byte %lld of the data, the file holds %lld",
                     path, e->name, (long long)e->end, (long long)data_bytes);
            goto fail;
        }
        /* a shape whose bytes would not fit in 64 bits (at 8 bytes an element, the widest
         * dtype) describes no file: refused whatever the dtype, so that no caller multiplies
         * the dims into an overflow */
        int64_t numel = 1;
        bool huge = false, empty = false;
        for (int d = 0; d < e->rank; d++) {
            huge |= __builtin_mul_overflow(numel, e->dims[d], &numel);
            empty |= e->dims[d] == 0;
        }
        if (empty) numel = 0, huge = false;
        if (huge || numel > INT64_MAX / 8) {
            char shape[128];
            ckpt_shape_text(shape, sizeof shape, e->rank, e->dims);
            rt_error("%s: tensor %s has shape %s, too large for any file", path, e->name, shape);
            goto fail;
        }
        int bytes = rt_st_dtype_bytes(e->dtype);
        if (bytes && e->end - e->begin != numel * bytes) {
            rt_error("%s: tensor %s has %lld data bytes, its shape and dtype need %lld", path,
                     e->name, (long long)(e->end - e->begin), (long long)(numel * bytes));
            goto fail;
        }
    }
    s->path = strdup(path);
    s->f = f;
    return s->path != NULL;
fail:
    free(header);
    ckpt_entries_free(s->entries, s->n_entries);
    s->entries = NULL;
    s->n_entries = 0;
    fclose(f);
    return false;
}

const RtStEntry *rt_st_find(const RtStFile *s, const char *name) {
    for (int k = 0; k < s->n_entries; k++)
        if (strcmp(s->entries[k].name, name) == 0) return &s->entries[k];
    return NULL;
}

bool rt_st_read(const RtStFile *s, const RtStEntry *e, void *dst) {
    size_t bytes = (size_t)(e->end - e->begin);
    if (bytes && (fseeko(s->f, s->data_start + e->begin, SEEK_SET) != 0 ||
                  fread(dst, 1, bytes, s->f) != bytes)) {
        rt_error("%s: read error in tensor %s", s->path, e->name);
        return false;
    }
    return true;
}

void rt_st_close(RtStFile *s) {
    if (s->f) fclose(s->f);
    ckpt_entries_free(s->entries, s->n_entries);
    free(s->path);
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------- directories */

static bool ckpt_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* mkdir -p: `--out runs/gpt2/ckpt` should not need its parents made by hand. */
static bool ckpt_make_dirs(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    for (char *p = path + 1; ; p++) {
        if (*p != '/' && *p) continue;
        char c = *p;
        *p = 0;
        if (!ckpt_is_dir(path) && mkdir(path, 0777) != 0 && errno != EEXIST) return false;
        *p = c;
        if (!c) return true;
    }
}

/* Whether `name` is one of the temp files this file makes: ".BASE.XXXXXX", BASE being
 * "latest", "probe" or "step_DIGITS.safetensors", XXXXXX six letters or digits. Nothing else is
 * ever removed. */
static bool ckpt_is_temp_name(const char *name) {
    size_t n = strlen(name);
    if (n < 9 || name[0] != '.' || name[n - 7] != '.') return false;
    for (size_t i = n - 6; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
              (name[i] >= '0' && name[i] <= '9')))
            return false;
    const char *base = name + 1;
    size_t len = n - 8;
    if ((len == 6 && strncmp(base, "latest", 6) == 0) || (len == 5 && strncmp(base, "probe", 5) == 0))
        return true;
    const char *ext = ".safetensors";
    size_t digits = len > 5 + strlen(ext) ? len - 5 - strlen(ext) : 0;
    if (!digits || strncmp(base, "step_", 5) != 0 || strncmp(base + 5 + digits, ext, strlen(ext)) != 0)
        return false;
    for (size_t i = 0; i < digits; i++)
        if (base[5 + i] < '0' || base[5 + i] > '9') return false;
    return true;
}

/* Run once before training, so that a directory the run cannot write to is found before step 1
 * rather than at the first save, hours later: make DIR, then create and remove a probe file in
 * it. A save killed mid-write leaves its temp file behind (the rename never came); those are
 * removed here, as nothing but a save in progress owns them. */
bool rt_ckpt_open_dir(const char *dir, int *removed) {
    *removed = 0;
    if (!ckpt_make_dirs(dir)) {
        rt_error("%s: cannot create the checkpoint directory: %s", dir, strerror(errno));
        return false;
    }
    char probe[4096], *tmp = NULL;
    snprintf(probe, sizeof probe, "%s/probe", dir);
    FILE *f = ckpt_temp_beside(probe, &tmp);
    if (!f) {
        rt_error("%s: cannot create a file in the checkpoint directory: %s", dir, strerror(errno));
        return false;
    }
    bool ok = fclose(f) == 0;
    int err = errno;
    if (unlink(tmp) != 0 && ok) ok = false, err = errno;
    free(tmp);
    if (!ok) {
        rt_error("%s: cannot write in the checkpoint directory: %s", dir, strerror(err));
        return false;
    }
    DIR *d = opendir(dir);
    if (!d) {
        rt_error("%s: cannot list the checkpoint directory: %s", dir, strerror(errno));
        return false;
    }
    for (struct dirent *e; (e = readdir(d));) {
        if (!ckpt_is_temp_name(e->d_name)) continue;
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (lstat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (unlink(path) != 0) {
            rt_error("%s: cannot remove this temp file of an interrupted save: %s", path,
                     strerror(errno));
            closedir(d);
            return false;
        }
        (*removed)++;
    }
    closedir(d);
    return true;
}

bool rt_ckpt_dir_holds_run(const char *dir, char *found, size_t found_len) {
    DIR *d = opendir(dir);
    if (!d) return false;
    bool holds = false;
    for (struct dirent *e; !holds && (e = readdir(d));) {
        const char *name = e->d_name;
        size_t n = strlen(name), digits = 0;
        if (strcmp(name, "latest") == 0) {
            holds = true;
        } else if (strncmp(name, "step_", 5) == 0 && n > 17 &&
                   strcmp(name + n - 12, ".safetensors") == 0) {
            while (name[5 + digits] >= '0' && name[5 + digits] <= '9') digits++;
            holds = 5 + digits + 12 == n;
        }
        if (holds) snprintf(found, found_len, "%s", name);
    }
    closedir(d);
    return holds;
}

bool rt_ckpt_save_step(const char *dir, int64_t step, Tensor *const *ts, int n,
                       const CkptMeta *meta, int n_meta, char *written, size_t written_len) {
    if (!ckpt_make_dirs(dir)) {
        rt_error("%s: cannot create the checkpoint directory: %s", dir, strerror(errno));
        return false;
    }
    char name[64], path[4096];
    snprintf(name, sizeof name, "step_%06lld.safetensors", (long long)step);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (!rt_ckpt_save(path, ts, n, meta, n_meta)) return false;
    /* `latest` names the newest file; it is replaced by rename too, so a reader never sees it
     * half-written or pointing at a checkpoint that is not complete */
    char latest[4096];
    snprintf(latest, sizeof latest, "%s/latest", dir);
    char *tmp = NULL;
    FILE *f = ckpt_temp_beside(latest, &tmp);
    bool ok = f != NULL;
    int err = errno;
    if (f) {
        /* synced before the rename, or a crash could publish an empty `latest` */
        ok = fprintf(f, "%s\n", name) > 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
        err = errno;
        if (fclose(f) != 0 && ok) ok = false, err = errno;
        if (ok && rename(tmp, latest) != 0) ok = false, err = errno;
        if (!ok) unlink(tmp);
        free(tmp);
    }
    if (!ok) {
        rt_error("%s: cannot update: %s", latest, strerror(err));
        return false;
    }
    if (!ckpt_sync_dir_of(latest)) return false;
    if (written) snprintf(written, written_len, "%s", path);
    return true;
}

bool rt_ckpt_resolve(const char *path, char *out, size_t out_len) {
    if (!ckpt_is_dir(path)) {
        FILE *f = rt_open_regular(path, "cannot read the checkpoint", NULL);
        if (!f) return false;
        fclose(f);
        snprintf(out, out_len, "%s", path);
        return true;
    }
    char latest[4096];
    snprintf(latest, sizeof latest, "%s/latest", path);
    if (access(latest, F_OK) != 0) {
        rt_error("%s: a checkpoint directory needs a file 'latest' naming its newest checkpoint: "
                 "%s", path, strerror(errno));
        return false;
    }
    FILE *f = rt_open_regular(latest, "cannot read", NULL);
    if (!f) return false;
    char name[512] = {0};
    bool ok = fgets(name, sizeof name, f) != NULL;
    fclose(f);
    name[strcspn(name, "\r\n")] = 0;
    if (!ok || !*name || strchr(name, '/')) {
        rt_error("%s: does not name a checkpoint file", latest);
        return false;
    }
    snprintf(out, out_len, "%s/%s", path, name);
    char what[4200];
    snprintf(what, sizeof what, "named by %s, cannot be read", latest);
    FILE *named = rt_open_regular(out, what, NULL);
    if (!named) return false;
    fclose(named);
    return true;
}

/* ---------------------------------------------------------------- the run's settings */

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

int rt_ckpt_restore_run(const Graph *g, TrainOptions *o) {
    char path[4096];
    if (!rt_ckpt_resolve(o->resume, path, sizeof path)) return 1;
    RtStFile f;
    if (!rt_st_open(&f, path)) return 1;
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
