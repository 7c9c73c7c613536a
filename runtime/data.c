/* data.c — token sources for training and evaluation.
 *
 * Two kinds of file feed the training binary. A token shard in one of llm.c's two formats: a
 * header of 256 little-endian int32 (magic, version, token count), then the tokens — uint16
 * under magic 20240520 version 1 (GPT-2's vocabulary), uint32 under magic 20240801 version 7
 * (vocabularies beyond 65536, Llama 3's). Both pairs are those of llm.c's writer,
 * dev/data/data_common.py (HEADERS_INFO: "gpt-2" and "llama-3"). Any other file is plain text,
 * read through the built-in byte-level tokenizer: token = byte value, so the vocabulary is 256
 * and every file is valid input. A file is taken as a shard when its name ends in ".bin" or it
 * starts with a shard magic; a ".bin" file without one is an error rather than text, since
 * training on the bytes of a broken shard would be silent nonsense.
 *
 * Every source is held in memory in its file's width, uint16 or uint32 (the whole file is read
 * once; GPT-2-sized shards are a few hundred MB). A source may be several files: a comma list
 * and/or globs.
 *
 * Batches are a pure function of (seed, step, micro-step, row): each row of a training batch is
 * T+1 contiguous tokens starting at a position drawn by hashing those four numbers. Nothing is
 * carried from one step to the next, so a run resumed from a checkpoint at step s sees exactly
 * the batches that a straight run saw after step s. Validation batches are fixed: row r of
 * validation batch i reads the (i*B + r)-th window of T+1 tokens, windows laid end to end over
 * the validation tokens and wrapping around when there are fewer than asked for. */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rt.h"

#define SHARD_HEADER_INTS 256
#define SHARD_HEADER_BYTES (SHARD_HEADER_INTS * 4)

static inline uint32_t shard_tok(const TokenShard *s, int64_t i) {
    return s->tok32 ? s->tok32[i] : s->tok[i];
}

static char *data_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

static bool data_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static uint32_t data_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static const char *data_file_kind(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "something other than a file";
}

/* Every file the binary reads (data, checkpoints, `latest`) is a regular file, and anything
 * else is refused before it is opened: opening a FIFO for reading waits for a writer, so a
 * mistyped path could otherwise hang the run with nothing said. stat() decides; the open itself
 * is non-blocking and checked again with fstat(), so a path swapped for a FIFO in between
 * cannot block either. */
FILE *rt_open_regular(const char *path, const char *what, int64_t *size) {
    struct stat st;
    if (stat(path, &st) != 0) {
        rt_error("%s: %s: %s", path, what, strerror(errno));
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        rt_error("%s: %s: it is %s, not a regular file", path, what, data_file_kind(st.st_mode));
        return NULL;
    }
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        rt_error("%s: %s: %s", path, what, strerror(errno));
        return NULL;
    }
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rt_error("%s: %s: it is %s, not a regular file", path, what, data_file_kind(st.st_mode));
        close(fd);
        return NULL;
    }
    int flags = fcntl(fd, F_GETFL);
    FILE *f = flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 ? NULL : fdopen(fd, "rb");
    if (!f) {
        rt_error("%s: %s: %s", path, what, strerror(errno));
        close(fd);
        return NULL;
    }
    if (size) *size = st.st_size;
    return f;
}

/* Reads a whole file. Returns NULL after rt_error on failure; *size may be 0. */
uint8_t *rt_read_file(const char *path, int64_t *size) {
    int64_t bytes = 0;
    FILE *f = rt_open_regular(path, "cannot open", &bytes);
    if (!f) return NULL;
    uint8_t *buf = malloc(bytes ? (size_t)bytes : 1);
    if (!buf) {
        rt_error("%s: cannot allocate %lld bytes to read it", path, (long long)bytes);
        fclose(f);
        return NULL;
    }
    size_t got = fread(buf, 1, (size_t)bytes, f);
    fclose(f);
    if (got != (size_t)bytes) {
        rt_error("%s: read %zu of %lld bytes", path, got, (long long)bytes);
        free(buf);
        return NULL;
    }
    *size = bytes;
    return buf;
}

void rt_byte_tokenize(const uint8_t *text, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = text[i];
}

/* Turns a file's bytes into a shard view; takes ownership of `buf`. */
static bool data_parse(const char *path, uint8_t *buf, int64_t size, TokenShard *s) {
    memset(s, 0, sizeof *s);
    s->path = data_strdup(path);
    if (size == 0) {
        rt_error("%s: empty file", path);
        free(buf);
        return false;
    }
    bool magic = size >= 4 && (data_le32(buf) == RT_SHARD_MAGIC || data_le32(buf) == RT_SHARD32_MAGIC);
    if (!magic && !data_ends_with(path, ".bin")) {
        /* plain text: one token per byte, converted in place from the back */
        uint16_t *tok = malloc((size_t)size * sizeof *tok);
        if (!tok) {
            rt_error("%s: cannot allocate memory for %lld tokens", path, (long long)size);
            free(buf);
            return false;
        }
        rt_byte_tokenize(buf, size, tok);
        free(buf);
        s->base = s->tok = tok;
        s->n = size;
        s->is_text = true;
        return true;
    }
    if (size < SHARD_HEADER_BYTES) {
        rt_error("%s: truncated token shard: %lld bytes, shorter than the %d-byte header", path,
                 (long long)size, SHARD_HEADER_BYTES);
        free(buf);
        return false;
    }
    uint32_t h[3] = {data_le32(buf), data_le32(buf + 4), data_le32(buf + 8)};
    if (h[0] != RT_SHARD_MAGIC && h[0] != RT_SHARD32_MAGIC) {
        rt_error("%s: not a token shard: magic %u, expected %u (uint16 tokens) or %u (uint32) "
                 "(files ending in .bin are read as llm.c shards)", path, h[0], RT_SHARD_MAGIC,
                 RT_SHARD32_MAGIC);
        free(buf);
        return false;
    }
    bool wide = h[0] == RT_SHARD32_MAGIC;
    uint32_t version = wide ? RT_SHARD32_VERSION : RT_SHARD_VERSION;
    int width = wide ? 4 : 2;
    if (h[1] != version) {
        rt_error("%s: token shard version %u, expected %u for magic %u", path, h[1], version, h[0]);
        free(buf);
        return false;
    }
    int64_t held = (size - SHARD_HEADER_BYTES) / width;
    if ((int64_t)h[2] > held) {
        rt_error("%s: truncated token shard: the header says %u tokens, the file holds %lld",
                 path, h[2], (long long)held);
        free(buf);
        return false;
    }
    if ((int64_t)h[2] * width + SHARD_HEADER_BYTES != size) {
        rt_error("%s: token shard has %lld bytes after its %u tokens", path,
                 (long long)(size - SHARD_HEADER_BYTES - width * (int64_t)h[2]), h[2]);
        free(buf);
        return false;
    }
    if (h[2] == 0) {
        rt_error("%s: token shard holds no tokens", path);
        free(buf);
        return false;
    }
    /* decoded byte by byte: the file is little-endian whatever the host is */
    s->n = h[2];
    void *tok = malloc((size_t)s->n * (size_t)width);
    if (!tok) {
        rt_error("%s: cannot allocate memory for %lld tokens", path, (long long)s->n);
        free(buf);
        return false;
    }
    for (int64_t i = 0; i < s->n; i++) {
        const uint8_t *p = buf + SHARD_HEADER_BYTES + width * i;
        if (wide) ((uint32_t *)tok)[i] = data_le32(p);
        else ((uint16_t *)tok)[i] = (uint16_t)(p[0] | p[1] << 8);
    }
    free(buf);
    if (wide) s->base32 = s->tok32 = tok;
    else s->base = s->tok = tok;
    return true;
}

static bool data_add_file(TokenData *d, const char *path) {
    int64_t size = 0;
    uint8_t *buf = rt_read_file(path, &size);
    if (!buf) return false;
    TokenShard *grown = realloc(d->shards, (size_t)(d->n_shards + 1) * sizeof *grown);
    if (!grown) {
        free(buf);
        rt_error("%s: out of memory", path);
        return false;
    }
    d->shards = grown;
    TokenShard *s = &d->shards[d->n_shards];
    if (!data_parse(path, buf, size, s)) {
        free(s->path);
        return false;
    }
    d->n_shards++;
    d->n_tokens += s->n;
    return true;
}

bool rt_data_open(TokenData *d, const char *spec) {
    memset(d, 0, sizeof *d);
    if (!spec || !*spec) {
        rt_error("no data file given");
        return false;
    }
    size_t len = strlen(spec);
    if (spec[0] == ',' || spec[len - 1] == ',' || strstr(spec, ",,")) {   /* "a,": a name left out */
        rt_error("%s: an empty name in the list of data files", spec);
        return false;
    }
    char *copy = data_strdup(spec);
    bool ok = true;
    for (char *save = NULL, *item = strtok_r(copy, ",", &save); ok && item;
         item = strtok_r(NULL, ",", &save)) {
        if (!strpbrk(item, "*?[")) {
            ok = data_add_file(d, item);
            continue;
        }
        glob_t gl;
        int rc = glob(item, 0, NULL, &gl);
        if (rc != 0) {
            rt_error("%s: no file matches this pattern", item);
            ok = false;
        }
        for (size_t i = 0; ok && i < gl.gl_pathc; i++) ok = data_add_file(d, gl.gl_pathv[i]);
        if (rc == 0) globfree(&gl);
    }
    free(copy);
    if (ok && d->n_shards == 0) {
        rt_error("%s: names no file", spec);
        ok = false;
    }
    if (!ok) {
        rt_data_free(d);
        return false;
    }
    d->is_text = true;
    for (int i = 0; i < d->n_shards; i++) d->is_text &= d->shards[i].is_text;
    return true;
}

/* The held-out part is a view into the training source's buffers: `val` owns nothing. */
bool rt_data_split_tail(TokenData *train, TokenData *val, double frac) {
    memset(val, 0, sizeof *val);
    int64_t hold = (int64_t)((double)train->n_tokens * frac);
    if (hold <= 0) return true;
    val->shards = calloc((size_t)train->n_shards, sizeof *val->shards);
    if (!val->shards) {
        rt_error("out of memory");
        return false;
    }
    val->is_text = train->is_text;
    val->is_view = true;
    /* walk back from the last file, taking whole files or the tail of one */
    int first = train->n_shards;
    for (int i = train->n_shards - 1; i >= 0 && hold > 0; i--) {
        TokenShard *s = &train->shards[i];
        int64_t take = hold < s->n ? hold : s->n;
        first = i;
        val->shards[i] = (TokenShard){.path = data_strdup(s->path), .n = take, .is_text = s->is_text,
                                      .tok = s->tok ? s->tok + s->n - take : NULL,
                                      .tok32 = s->tok32 ? s->tok32 + s->n - take : NULL};
        s->n -= take;
        train->n_tokens -= take;
        val->n_tokens += take;
        hold -= take;
    }
    /* compact: val keeps files first..n-1; train drops files emptied entirely (their buffers
     * stay owned by train through base, freed by rt_data_free) */
    memmove(val->shards, val->shards + first, (size_t)(train->n_shards - first) * sizeof *val->shards);
    val->n_shards = train->n_shards - first;
    return true;
}

/* A batch row is `window` contiguous tokens of one file, drawn from the windows of every file,
 * so what must hold a batch is the set, not each file: two files of half a batch each are fine
 * together. A file shorter than one window adds no window (no row ever reads it); that is said
 * in a note rather than refused, since a glob's last shard is often short. */
bool rt_data_check(const TokenData *d, const char *what, int64_t window, int64_t min_tokens,
                   int64_t vocab) {
    int64_t usable = 0;
    int first = -1, files = 0;
    for (int i = 0; i < d->n_shards; i++) {
        const TokenShard *s = &d->shards[i];
        if (s->n == 0) continue;        /* emptied by the validation split */
        if (first < 0) first = i;
        files++;
        for (int64_t j = 0; j < s->n; j++) {
            if (shard_tok(s, j) >= vocab) {
                int64_t at = s->tok32 ? s->tok32 + j - s->base32 : s->tok + j - s->base;
                rt_error("%s: token %u at position %lld is outside the model's vocabulary of %lld",
                         s->path, shard_tok(s, j), (long long)at, (long long)vocab);
                return false;
            }
        }
        if (s->n >= window) usable += s->n;
    }
    char name[1100];
    if (first < 0)
        snprintf(name, sizeof name, "%s", d->n_shards ? d->shards[0].path : "(none)");
    else if (files == 1)
        snprintf(name, sizeof name, "%s", d->shards[first].path);
    else
        snprintf(name, sizeof name, "%.1000s and %d more files", d->shards[first].path, files - 1);
    if (usable < min_tokens) {
        rt_error("%s: %s has %lld tokens in files of at least one sequence (%lld tokens), fewer "
                 "than the %lld that one batch needs", name, what, (long long)usable,
                 (long long)window, (long long)min_tokens);
        return false;
    }
    for (int i = 0; i < d->n_shards; i++) {
        const TokenShard *s = &d->shards[i];
        if (s->n > 0 && s->n < window)
            rt_note("%s: %lld tokens, fewer than one sequence (%lld): no batch of %s reads it",
                    s->path, (long long)s->n, (long long)window, what);
    }
    return true;
}

void rt_data_free(TokenData *d) {
    for (int i = 0; i < d->n_shards; i++) {
        free(d->shards[i].path);
        if (!d->is_view) free(d->shards[i].base), free(d->shards[i].base32);
    }
    free(d->shards);
    memset(d, 0, sizeof *d);
}

bool rt_data_write_shard(const char *path, const uint16_t *tok, int64_t n) {
    if (n > UINT32_MAX) {
        rt_error("%s: %lld tokens do not fit one shard (at most %u)", path, (long long)n,
                 UINT32_MAX);
        return false;
    }
    FILE *f = fopen(path, "wb");
    if (!f) {
        rt_error("%s: cannot create: %s", path, strerror(errno));
        return false;
    }
    uint8_t header[SHARD_HEADER_BYTES] = {0};
    uint32_t h[3] = {RT_SHARD_MAGIC, RT_SHARD_VERSION, (uint32_t)n};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 4; b++) header[4 * i + b] = (uint8_t)(h[i] >> (8 * b));
    bool ok = fwrite(header, 1, sizeof header, f) == sizeof header;
    uint8_t buf[8192];
    for (int64_t i = 0; ok && i < n;) {
        int k = 0;
        for (; k < (int)sizeof buf / 2 && i < n; k++, i++) {
            buf[2 * k] = (uint8_t)tok[i];
            buf[2 * k + 1] = (uint8_t)(tok[i] >> 8);
        }
        ok = fwrite(buf, 2, (size_t)k, f) == (size_t)k;
    }
    if (fclose(f) != 0) ok = false;
    if (!ok) {
        rt_error("%s: write failed: %s", path, strerror(errno));
        remove(path);
    }
    return ok;
}

/* splitmix64's finalizer: a bijection with good avalanche, enough to spread batch positions. */
static uint64_t data_mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Copies the window of T+1 tokens that starts at `start` of shard s into one row. */
static void data_fill_row(const TokenShard *s, int64_t start, int T, int32_t *tokens,
                          int32_t *targets) {
    for (int t = 0; t < T; t++) {
        tokens[t] = (int32_t)shard_tok(s, start + t);
        targets[t] = (int32_t)shard_tok(s, start + t + 1);
    }
}

void rt_data_train_batch(const TokenData *d, uint64_t seed, int64_t step, int micro, int B, int T,
                         int32_t *tokens, int32_t *targets) {
    int64_t windows = 0;   /* start positions that leave T+1 tokens, over all shards */
    for (int i = 0; i < d->n_shards; i++)
        if (d->shards[i].n > T) windows += d->shards[i].n - T;
    for (int r = 0; r < B; r++) {
        uint64_t h = data_mix(seed);
        h = data_mix(h ^ (uint64_t)step);
        h = data_mix(h ^ (uint64_t)micro);
        h = data_mix(h ^ (uint64_t)r);
        int64_t w = (int64_t)(h % (uint64_t)windows);
        for (int i = 0; i < d->n_shards; i++) {
            const TokenShard *s = &d->shards[i];
            int64_t here = s->n > T ? s->n - T : 0;
            if (w < here) {
                data_fill_row(s, w, T, tokens + (int64_t)r * T, targets + (int64_t)r * T);
                break;
            }
            w -= here;
        }
    }
}

void rt_data_val_batch(const TokenData *d, int64_t index, int B, int T, int32_t *tokens,
                       int32_t *targets) {
    int64_t rows = 0;      /* non-overlapping windows of T+1 (sharing one token at the seams) */
    for (int i = 0; i < d->n_shards; i++)
        if (d->shards[i].n > T) rows += (d->shards[i].n - 1) / T;
    for (int r = 0; r < B; r++) {
        int64_t w = (index * B + r) % rows;
        for (int i = 0; i < d->n_shards; i++) {
            const TokenShard *s = &d->shards[i];
            int64_t here = s->n > T ? (s->n - 1) / T : 0;
            if (w < here) {
                data_fill_row(s, w * T, T, tokens + (int64_t)r * T, targets + (int64_t)r * T);
                break;
            }
            w -= here;
        }
    }
}
