/* json.c — the runtime's one JSON reader: documents as a tree.
 *
 * It reads a model's config.json, a sharded model's index and the header of every safetensors
 * file (checkpoint.c). The documents are small next to the data they describe (a header of
 * a few thousand tensor entries is well under a megabyte; safetensors caps it at 100 MB), and
 * each caller looks up the keys it knows and checks what it finds, so a tree is the simpler
 * shape: one parser, and the checks of each format next to its meaning. Every value remembers
 * the byte where it starts, so that a caller's check can name the place as a syntax error does.
 * Numbers keep their exact integer value when they are written as one (offsets and sizes past
 * 2^53 stay exact); strings may not hold raw control characters (RFC 8259). Depth is bounded,
 * and every error is one line naming the file, what was read and the byte offset.
 *
 * The writing side is one function, rt_json_quote: every JSON string fp8c writes (checkpoint
 * headers, log lines, `fp8c plan --json`) goes through it, so a name or a path with a quote,
 * a backslash or a control character never makes a file that JSON readers refuse. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

#define JSON_MAX_DEPTH 64

typedef struct {
    const char *path, *what, *start, *p, *end;
    bool failed;
} JsonIn;

static bool jin_fail(JsonIn *j, const char *why) {
    if (!j->failed)
        rt_error("%s: bad %s: %s at byte %ld", j->path, j->what, why, (long)(j->p - j->start));
    j->failed = true;
    return false;
}

static void jin_space(JsonIn *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static bool jin_eat(JsonIn *j, char c) {
    jin_space(j);
    if (j->p < j->end && *j->p == c) {
        j->p++;
        return true;
    }
    return false;
}

/* A string, decoded into a malloc'ed copy (\uXXXX as UTF-8, never longer than its escape). */
static char *jin_string(JsonIn *j) {
    if (!jin_eat(j, '"')) return jin_fail(j, "expected a string"), NULL;
    const char *close = j->p;
    while (close < j->end && *close != '"') close += *close == '\\' && close + 1 < j->end ? 2 : 1;
    char *out = malloc((size_t)(close - j->p) + 1);
    if (!out) return jin_fail(j, "out of memory"), NULL;
    size_t k = 0;
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if ((unsigned char)c < 0x20) {
            j->p--;
            free(out);
            return jin_fail(j, "control character in a string"), NULL;
        }
        if (c != '\\') {
            out[k++] = c;
            continue;
        }
        if (j->p >= j->end) break;
        char e = *j->p++;
        if (e == 'u') {
            unsigned u = 0;
            for (int i = 0; i < 4; i++) {
                char h = j->p < j->end ? *j->p++ : 0;
                int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                      : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                if (v < 0) {
                    free(out);
                    return jin_fail(j, "bad \\u escape"), NULL;
                }
                u = u << 4 | (unsigned)v;
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
            continue;
        }
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
        const char *at = strchr(from, e);
        if (!at || !e) {
            free(out);
            return jin_fail(j, "bad escape in a string"), NULL;
        }
        out[k++] = to[at - from];
    }
    if (j->p >= j->end) {
        free(out);
        return jin_fail(j, "unterminated string"), NULL;
    }
    j->p++;
    out[k] = 0;
    return out;
}

void rt_json_free(Jv *v) {
    free(v->str);
    for (int i = 0; i < v->n; i++) {
        if (v->keys) free(v->keys[i]);
        rt_json_free(&v->items[i]);
    }
    free(v->keys);
    free(v->items);
    memset(v, 0, sizeof *v);
}

static bool jin_value(JsonIn *j, Jv *v, int depth) {
    memset(v, 0, sizeof *v);
    if (depth > JSON_MAX_DEPTH) return jin_fail(j, "nested too deeply");
    jin_space(j);
    v->at = j->p - j->start;
    if (j->p >= j->end) return jin_fail(j, "unexpected end");
    char c = *j->p;
    if (c == '{' || c == '[') {
        bool obj = c == '{';
        v->kind = obj ? JV_OBJ : JV_ARR;
        j->p++;
        if (jin_eat(j, obj ? '}' : ']')) return true;
        int cap = 0;
        do {
            if (v->n == cap) {
                cap = cap ? 2 * cap : 16;
                Jv *items = realloc(v->items, (size_t)cap * sizeof *items);
                char **keys = obj ? realloc(v->keys, (size_t)cap * sizeof *keys) : NULL;
                if (items) v->items = items;
                if (keys) v->keys = keys;
                if (!items || (obj && !keys)) return jin_fail(j, "out of memory");
            }
            if (obj) {
                char *key = jin_string(j);
                if (!key) return false;
                v->keys[v->n] = key;
                if (!jin_eat(j, ':')) {
                    free(key);
                    return jin_fail(j, "expected ':'");
                }
            }
            bool ok = jin_value(j, &v->items[v->n], depth + 1);
            v->n++;
            if (!ok) return false;
        } while (jin_eat(j, ','));
        return jin_eat(j, obj ? '}' : ']') || jin_fail(j, obj ? "expected '}'" : "expected ']'");
    }
    if (c == '"') {
        v->kind = JV_STR;
        return (v->str = jin_string(j)) != NULL;
    }
    static const struct { const char *word; JvKind kind; double num; } words[] = {
        {"true", JV_BOOL, 1}, {"false", JV_BOOL, 0}, {"null", JV_NULL, 0},
        {"Infinity", JV_NUM, INFINITY}, {"NaN", JV_NUM, NAN},
    };
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        size_t n = strlen(words[i].word);
        if ((size_t)(j->end - j->p) >= n && strncmp(j->p, words[i].word, n) == 0) {
            j->p += n;
            v->kind = words[i].kind;
            v->num = words[i].num;
            return true;
        }
    }
    char buf[64];
    size_t n = 0;
    while (j->p + n < j->end && n < sizeof buf - 1 && strchr("+-0123456789.eE", j->p[n])) n++;
    memcpy(buf, j->p, n);
    buf[n] = 0;
    char *endp;
    v->num = strtod(buf, &endp);
    if (!n || *endp) return jin_fail(j, "expected a value");
    v->kind = JV_NUM;
    /* written as an integer (digits, an optional '-') that fits: its exact value too */
    size_t digits = buf[0] == '-';
    while (buf[digits] >= '0' && buf[digits] <= '9') digits++;
    if (digits == n && n > (size_t)(buf[0] == '-')) {
        errno = 0;
        long long i = strtoll(buf, &endp, 10);
        if (errno == 0 && !*endp) v->is_int = true, v->i = i;
    }
    j->p += n;
    return true;
}

bool rt_json_parse(const char *path, const char *what, const char *text, int64_t len, Jv *v) {
    JsonIn j = {.path = path, .what = what, .start = text, .p = text, .end = text + len};
    memset(v, 0, sizeof *v);
    jin_space(&j);
    if (j.p >= j.end || *j.p != '{') return jin_fail(&j, "expected an object");
    bool ok = jin_value(&j, v, 0);
    jin_space(&j);
    if (ok && j.p != j.end) ok = jin_fail(&j, "text after the object");
    if (!ok) rt_json_free(v);
    return ok;
}

/* Reads and parses a whole JSON file; false after rt_error. */
bool rt_json_read(const char *path, Jv *v) {
    int64_t size = 0;
    uint8_t *text = rt_read_file(path, &size);
    if (!text) return false;
    bool ok = rt_json_parse(path, "JSON", (const char *)text, size, v);
    free(text);
    return ok;
}

const Jv *rt_json_get(const Jv *o, const char *key) {
    if (!o || o->kind != JV_OBJ) return NULL;
    for (int i = 0; i < o->n; i++)
        if (strcmp(o->keys[i], key) == 0) return &o->items[i];
    return NULL;
}

/* ---------------------------------------------------------------- writing */

size_t rt_json_quote(char *dst, size_t cap, const char *s) {
    size_t k = 0;
#define PUT(c) do { if (k + 1 < cap) dst[k] = (c); k++; } while (0)
    PUT('"');
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        static const char hex[] = "0123456789abcdef";
        const char *short_esc = *p == '"' ? "\\\"" : *p == '\\' ? "\\\\" : *p == '\n' ? "\\n"
                              : *p == '\r' ? "\\r" : *p == '\t' ? "\\t" : NULL;
        if (short_esc) {
            PUT(short_esc[0]);
            PUT(short_esc[1]);
        } else if (*p < 0x20 || *p == 0x7f) {
            PUT('\\');
            PUT('u');
            PUT('0');
            PUT('0');
            PUT(hex[*p >> 4]);
            PUT(hex[*p & 15]);
        } else {
            PUT((char)*p);
        }
    }
    PUT('"');
#undef PUT
    if (cap) dst[k < cap ? k : cap - 1] = 0;
    return k;
}

bool rt_json_write_string(FILE *f, const char *s) {
    char small[256];
    size_t n = rt_json_quote(small, sizeof small, s);
    if (n < sizeof small) return fputs(small, f) >= 0;
    char *big = malloc(n + 1);
    if (!big) return false;
    rt_json_quote(big, n + 1, s);
    bool ok = fputs(big, f) >= 0;
    free(big);
    return ok;
}
