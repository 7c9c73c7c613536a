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
 * run without the command line repeating them (rt_ckpt_restore_run, in ckpt_resume.c). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
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

static void text_json_string(StrBuf *t, const char *s) {
    char small[256];
    size_t n = rt_json_quote(small, sizeof small, s);
    if (n < sizeof small) {
        strbuf_addn(t, small, n);
        return;
    }
    char *big = malloc(n + 1);
    if (!big) {
        strbuf_addn(t, "\"\"", 2);   /* out of memory: the header is refused when it is read */
        return;
    }
    rt_json_quote(big, n + 1, s);
    strbuf_addn(t, big, n);
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
static bool ckpt_replace_file(const char *path, const StrBuf *head, Tensor *const *ts, int n,
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

    StrBuf head = {0};
    strbuf_addn(&head, "01234567", 8);   /* the length, filled in below */
    strbuf_addn(&head, "{\"__metadata__\":{", 17);
    for (int i = 0; i < n_meta; i++) {
        if (i) strbuf_addn(&head, ",", 1);
        text_json_string(&head, meta[i].key);
        strbuf_addn(&head, ":", 1);
        text_json_string(&head, meta[i].value);
    }
    strbuf_addn(&head, "}", 1);
    int64_t offset = 0;
    for (int i = 0; i < n; i++) {
        const Tensor *t = ts[i];
        int64_t bytes = ckpt_tensor_bytes(t);
        strbuf_addn(&head, ",", 1);
        text_json_string(&head, t->name);
        strbuf_printf(&head, ":{\"dtype\":\"%s\",\"shape\":[", ckpt_dtype_name(t->fmt.elem));
        for (int d = 0; d < t->rank; d++)
            strbuf_printf(&head, "%s%lld", d ? "," : "", (long long)t->dims[d]);
        strbuf_printf(&head, "],\"data_offsets\":[%lld,%lld]}", (long long)offset,
                    (long long)(offset + bytes));
        offset += bytes;
    }
    strbuf_addn(&head, "}", 1);
    while (head.len % 8) strbuf_addn(&head, " ", 1);
    if (head.failed) {
        strbuf_free(&head);
        rt_error("%s: out of memory writing the header", path);
        return false;
    }
    uint64_t hlen = head.len - 8;
    for (int b = 0; b < 8; b++) head.buf[b] = (char)(hlen >> (8 * b));
    bool ok = ckpt_replace_file(path, &head, ts, n, fill, ctx);
    strbuf_free(&head);
    return ok;
}

/* ---------------------------------------------------------------- header reader
 * The header is read by json.c into a tree; this checks it as safetensors defines it: an
 * object of tensor entries (dtype, shape, data_offsets; nothing else, each once) and an
 * optional "__metadata__" of strings. Every error names the byte offset in the header. */

typedef RtStEntry CkptEntry;

typedef struct {
    const char *path;
    bool failed;
} Header;

static bool header_fail(Header *h, const Jv *at, const char *what) {
    if (!h->failed)
        rt_error("%s: bad checkpoint header: %s at byte %ld", h->path, what, (long)at->at);
    h->failed = true;
    return false;
}

/* [n, n, ...] of non-negative integers into out (at most max); *count receives the length. */
static bool header_ints(Header *h, const Jv *v, int64_t *out, int max, int *count) {
    if (v->kind != JV_ARR) return header_fail(h, v, "expected '['");
    if (v->n > max) return header_fail(h, &v->items[max], "array too long");
    for (int i = 0; i < v->n; i++) {
        const Jv *x = &v->items[i];
        if (x->kind != JV_NUM || !x->is_int || x->i < 0)
            return header_fail(h, x, "expected a non-negative integer");
        out[i] = x->i;
    }
    *count = v->n;
    return true;
}

static bool header_tensor(Header *h, Jv *v, CkptEntry *e) {
    if (v->kind != JV_OBJ) return header_fail(h, v, "expected '{'");
    bool have_dtype = false, have_shape = false, have_offsets = false;
    for (int k = 0; k < v->n; k++) {
        const char *key = v->keys[k];
        Jv *x = &v->items[k];
        if (strcmp(key, "dtype") == 0 && !have_dtype) {
            if (x->kind != JV_STR) return header_fail(h, x, "expected a string");
            e->dtype = x->str;          /* taken from the tree */
            x->str = NULL;
            have_dtype = true;
        } else if (strcmp(key, "shape") == 0 && !have_shape) {
            if (!header_ints(h, x, e->dims, IR_MAX_RANK, &e->rank)) return false;
            have_shape = true;
        } else if (strcmp(key, "data_offsets") == 0 && !have_offsets) {
            int64_t off[2];
            int count = 0;
            if (!header_ints(h, x, off, 2, &count)) return false;
            if (count != 2) return header_fail(h, x, "data_offsets needs two numbers");
            if (off[1] < off[0]) return header_fail(h, x, "data_offsets end before they begin");
            e->begin = off[0];
            e->end = off[1];
            have_offsets = true;
        } else {
            return header_fail(h, x, "unexpected or repeated key in a tensor entry");
        }
    }
    if (!have_dtype || !have_shape || !have_offsets)
        return header_fail(h, v, "tensor entry lacks dtype, shape or data_offsets");
    return true;
}

static bool header_metadata(Header *h, const Jv *v, CkptMeta *meta, int max_meta, int *n_meta) {
    if (v->kind != JV_OBJ) return header_fail(h, v, "expected '{'");
    for (int k = 0; k < v->n; k++) {
        if (v->items[k].kind != JV_STR) return header_fail(h, &v->items[k], "expected a string");
        if (*n_meta < max_meta) {
            CkptMeta *m = &meta[(*n_meta)++];
            snprintf(m->key, sizeof m->key, "%s", v->keys[k]);
            snprintf(m->value, sizeof m->value, "%s", v->items[k].str);
        }
    }
    return true;
}

static void ckpt_entries_free(CkptEntry *e, int n) {
    for (int i = 0; i < n; i++) {
        free(e[i].name);
        free(e[i].dtype);
    }
    free(e);
}

typedef struct {
    const char *name;
    int k;                      /* its place among the header's keys */
} HeaderName;

static int header_cmp_name(const void *a, const void *b) {
    const HeaderName *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->k > y->k) - (x->k < y->k);
}

/* The whole header of hlen bytes: entries (malloc'ed, in the file's order) and metadata. */
static bool header_read(const char *path, const char *text, int64_t hlen, CkptEntry **entries,
                        int *n_entries, CkptMeta *meta, int max_meta, int *n_meta) {
    *entries = NULL;
    *n_entries = 0;
    Jv root;
    if (!rt_json_parse(path, "checkpoint header", text, hlen, &root)) return false;
    Header h = {.path = path};
    size_t cap = (size_t)(root.n ? root.n : 1);
    *entries = calloc(cap, sizeof **entries);
    HeaderName *names = malloc(cap * sizeof *names);
    bool ok = *entries && names ? true : header_fail(&h, &root, "out of memory");
    int n_names = 0;
    for (int k = 0; ok && k < root.n; k++) {
        if (strcmp(root.keys[k], "__metadata__") == 0) {
            ok = header_metadata(&h, &root.items[k], meta, max_meta, n_meta);
            continue;
        }
        names[n_names++] = (HeaderName){root.keys[k], k};
        CkptEntry *e = &(*entries)[(*n_entries)++];
        ok = (e->name = strdup(root.keys[k])) != NULL ? header_tensor(&h, &root.items[k], e)
                                                      : header_fail(&h, &root, "out of memory");
    }
    /* each name once: sorted, so that a header of many entries stays fast; the error names the
     * place of the second */
    if (ok) qsort(names, (size_t)n_names, sizeof *names, header_cmp_name);
    for (int i = 1; ok && i < n_names; i++)
        if (strcmp(names[i - 1].name, names[i].name) == 0)
            ok = header_fail(&h, &root.items[names[i].k], "a tensor name appears twice");
    free(names);
    rt_json_free(&root);
    return ok;
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
    if (!header_read(path, header, (int64_t)hlen, &entries, &n_entries, meta, max_meta, n_meta))
        goto done;
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
    if (!header_read(path, header, (int64_t)hlen, &s->entries, &s->n_entries, s->meta,
                     RT_ST_MAX_META, &s->n_meta))
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
