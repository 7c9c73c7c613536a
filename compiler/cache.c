/* cache.c — whole training binaries, cached by everything that determines them.
 *
 * A rebuild of an unchanged model should cost a file copy. The kernel caches (nvrtc.c, llvm.c)
 * already spare NVRTC and LLVM their work, but a build still parses, runs every pass, prints
 * and reads back the artifact, lowers the CPU kernels and links. So `fp8c build` first computes
 * a key over everything the binary's bytes can depend on, and when the cache holds a binary
 * under that key it copies it and stops.
 *
 * The key is a SHA-256 over, in this order:
 *  - a format line ("fp8c-binary-cache 1"), to be bumped if an entry's layout changes;
 *  - fp8c's own executable, byte for byte: its passes, renderers and the kernel library text it
 *    embeds. Any change to fp8c is a new key, with no version number to forget to bump;
 *  - the build flags as given (every argument before `--`, less `-o NAME`), each followed by
 *    the contents of the file it names when it (or its value, in `--flag=VALUE`) names a
 *    readable file: the model, a --policy file, and whatever file a future flag names, without
 *    this file having to know the flag;
 *  - every FP8C_* environment variable (name and value, sorted) but FP8C_CACHE_DIR and
 *    FP8C_NO_CACHE, which say where the cache is and whether to use it: FP8C_GPU, FP8C_CPU,
 *    FP8C_CC, FP8C_LIBDIR, FP8C_CUDA_INCLUDE and the rest, including ones no build reads;
 *  - the runtime libraries the binary is linked from (contents), and the tools that do the
 *    compiling and linking, named by path, size and modification time: the C compiler and the
 *    `as` and `ld` on PATH, and every shared object fp8c has loaded (/proc/self/maps: libLLVM
 *    and libnvrtc among them), so that a new toolkit or a new LLVM is a new key;
 *  - the CPU that LLVM compiles the CPU kernels for when none is named (a cache directory
 *    shared between machines must not hand one machine the other's vector instructions).
 * Leaving out something that matters would return a stale binary; an extra input only costs a
 * miss now and then (e.g. `-D x=1` and `-Dx=1` are two keys for one binary).
 *
 * An entry is two files in the cache directory (nvrtc.c's: $FP8C_CACHE_DIR, else
 * $XDG_CACHE_HOME/fp8c, else ~/.cache/fp8c): bin-KEY, the binary, and bin-KEY.meta, a few lines
 * of text with the key, the binary's size and SHA-256, the figures of the final `wrote` line,
 * the model's name and the notes the build printed, which a hit prints again. A lookup checks
 * every one of them; an entry that does not check out (truncated, corrupt, an older layout) is
 * a miss: it is removed and the build runs in full. Files are written under temporary names and renamed, the
 * binary before its meta, so a build running at the same time never takes half an entry.
 * Commands that print more than a binary (--print-kernels, --print-ir-after, --stop-after) do
 * not use the cache. */
#include "compiler.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef FP8C_HAVE_LLVM
#include "codegen.h"
#endif

#define CACHE_FORMAT "fp8c-binary-cache 1"

extern char **environ;

/* ---------------------------------------------------------------- SHA-256 (FIPS 180-4) */

typedef struct {
    uint32_t h[8];
    uint64_t len;           /* bytes hashed */
    unsigned char buf[64];
    size_t n;               /* bytes in buf */
} Sha256;

static const uint32_t sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha_block(Sha256 *s, const unsigned char *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | (uint32_t)p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = s->h[0], b = s->h[1], c = s->h[2], d = s->h[3];
    uint32_t e = s->h[4], f = s->h[5], g = s->h[6], h = s->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + sha_k[i] +
                      w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    s->h[0] += a, s->h[1] += b, s->h[2] += c, s->h[3] += d;
    s->h[4] += e, s->h[5] += f, s->h[6] += g, s->h[7] += h;
}

static void sha_init(Sha256 *s)
{
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memset(s, 0, sizeof *s);
    memcpy(s->h, h0, sizeof h0);
}

static void sha_update(Sha256 *s, const void *data, size_t n)
{
    const unsigned char *p = data;
    s->len += n;
    if (s->n) {
        size_t k = 64 - s->n < n ? 64 - s->n : n;
        memcpy(s->buf + s->n, p, k);
        s->n += k, p += k, n -= k;
        if (s->n < 64) return;
        sha_block(s, s->buf);
        s->n = 0;
    }
    for (; n >= 64; p += 64, n -= 64) sha_block(s, p);
    memcpy(s->buf, p, n);
    s->n = n;
}

/* The digest as 64 lowercase hex digits and a NUL. */
static void sha_final_hex(Sha256 *s, char hex[65])
{
    uint64_t bits = s->len * 8;
    unsigned char pad[72] = {0x80};
    size_t k = (s->n < 56 ? 56 : 120) - s->n;
    for (int i = 0; i < 8; i++) pad[k + (size_t)i] = (unsigned char)(bits >> (56 - 8 * i));
    sha_update(s, pad, k + 8);
    for (int i = 0; i < 8; i++) snprintf(hex + 8 * i, 9, "%08x", s->h[i]);
}

void cache_sha256_hex(const void *data, size_t n, char hex[65])
{
    Sha256 s;
    sha_init(&s);
    sha_update(&s, data, n);
    sha_final_hex(&s, hex);
}

/* A labelled, length-prefixed field, so that no two different inputs hash the same stream. */
static void sha_field(Sha256 *s, const char *label, const void *data, size_t n)
{
    uint64_t len = n;
    sha_update(s, label, strlen(label) + 1);
    sha_update(s, &len, sizeof len);
    sha_update(s, data, n);
}

static void sha_string(Sha256 *s, const char *label, const char *str)
{
    sha_field(s, label, str ? str : "", str ? strlen(str) : 0);
}

/* A file's contents as a field; false when it cannot be read. */
static bool sha_file(Sha256 *s, const char *label, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    Sha256 inner;
    sha_init(&inner);
    unsigned char buf[1 << 16];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0) sha_update(&inner, buf, got);
    bool ok = !ferror(f);
    fclose(f);
    char hex[65];
    sha_final_hex(&inner, hex);
    sha_field(s, label, hex, 64);
    return ok;
}

/* A tool's identity without reading it: its path, size and modification time. */
static void sha_stat(Sha256 *s, const char *label, const char *path)
{
    struct stat st;
    char id[4200];
    if (stat(path, &st) == 0)
        snprintf(id, sizeof id, "%s %lld %lld.%09ld %llu", path, (long long)st.st_size,
                 (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec, (unsigned long long)st.st_ino);
    else
        snprintf(id, sizeof id, "%s missing", path);
    sha_string(s, label, id);
}

/* ---------------------------------------------------------------- the key */
/* (`fp8c train` uses the same key: the flags before `--` make the binary, those after it are
 * the binary's own.) */

static bool names_regular_file(const char *path)
{
    struct stat st;
    return *path && stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, R_OK) == 0;
}

const char *cache_flag_file(const char *word)
{
    if (names_regular_file(word)) return word;
    const char *eq = strncmp(word, "--", 2) ? NULL : strchr(word, '=');
    return eq && names_regular_file(eq + 1) ? eq + 1 : NULL;
}

/* The program `name` as exec would find it on PATH, in out; false when it is nowhere. */
static bool find_on_path(const char *name, char *out, size_t len)
{
    if (strchr(name, '/')) {
        snprintf(out, len, "%s", name);
        return true;
    }
    const char *path = getenv("PATH");
    if (!path) path = "/usr/bin:/bin";
    for (const char *p = path; *p;) {
        const char *colon = strchr(p, ':');
        size_t n = colon ? (size_t)(colon - p) : strlen(p);
        snprintf(out, len, "%.*s/%s", (int)n, n ? p : ".", name);
        if (access(out, X_OK) == 0) return true;
        p += n + (colon != NULL);
    }
    return false;
}

static int compare_strings(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Each distinct shared object mapped into this process, sorted: the order of
 * /proc/self/maps follows load addresses, which change from run to run. Taken once, when fp8c
 * starts a build: libraries loaded later (NVRTC opens its builtins when it first compiles)
 * would make the key of the same build differ before and after it. */
static void sha_mapped_libraries(Sha256 *s, const char *self)
{
    static char digest[65];
    if (digest[0]) {
        sha_field(s, "mapped", digest, 64);
        return;
    }
    Sha256 maps;
    sha_init(&maps);
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) {
        sha_string(s, "maps", "unreadable");
        return;
    }
    char **paths = NULL;
    int n = 0, cap = 0;
    char line[4400];
    while (fgets(line, sizeof line, f)) {
        char *path = strchr(line, '/');
        if (!path) continue;
        path[strcspn(path, "\n")] = 0;
        if (!strcmp(path, self)) continue;   /* hashed by its contents */
        /* shared objects only: a tool that maps a file of its own per process (valgrind's
         * pipes, say) would otherwise make every key new */
        const char *base = strrchr(path, '/') + 1;
        if (!strstr(base, ".so")) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **more = realloc(paths, sizeof *paths * (size_t)cap);
            if (!more) break;
            paths = more;
        }
        paths[n++] = strdup(path);
    }
    fclose(f);
    qsort(paths, (size_t)n, sizeof *paths, compare_strings);
    for (int i = 0; i < n; i++) {
        if (paths[i] && (i == 0 || !paths[i - 1] || strcmp(paths[i], paths[i - 1])))
            sha_stat(&maps, "mapped", paths[i]);
    }
    for (int i = 0; i < n; i++) free(paths[i]);
    free(paths);
    sha_final_hex(&maps, digest);
    sha_field(s, "mapped", digest, 64);
}

bool cache_make_key(char **flags, int n_flags, char key[65])
{
    Sha256 s;
    sha_init(&s);
    sha_string(&s, "format", CACHE_FORMAT);

    /* fp8c itself */
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return false;
    self[len] = 0;
    if (!sha_file(&s, "fp8c", self)) return false;

    /* the flags, and the files they name */
    for (int i = 0; i < n_flags; i++) {
        if (!strcmp(flags[i], "--")) break;
        if (!strcmp(flags[i], "-o")) {
            i++;
            continue;
        }
        sha_string(&s, "flag", flags[i]);
        const char *path = cache_flag_file(flags[i]);
        if (path && !sha_file(&s, "file", path)) return false;
    }

    /* the environment fp8c reads, and any FP8C_ variable it may read one day */
    char **env = NULL;
    int n_env = 0;
    for (char **e = environ; e && *e; e++) n_env++;
    env = malloc(sizeof *env * (size_t)(n_env ? n_env : 1));
    if (!env) return false;
    n_env = 0;
    for (char **e = environ; e && *e; e++)
        if (!strncmp(*e, "FP8C_", 5) && strncmp(*e, "FP8C_CACHE_DIR=", 15) &&
            strncmp(*e, "FP8C_NO_CACHE=", 14))
            env[n_env++] = *e;
    qsort(env, (size_t)n_env, sizeof *env, compare_strings);
    for (int i = 0; i < n_env; i++) sha_string(&s, "env", env[i]);
    free(env);

    /* what the binary is linked from, and with what */
    int n_libs;
    const char *const *libs = emit_runtime_libs(&n_libs);
    for (int i = 0; i < n_libs; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", emit_libdir(), libs[i]);
        if (!sha_file(&s, "lib", path)) return false;   /* the link would fail: no caching */
    }
    const char *tools[] = {emit_compiler(), "as", "ld"};
    for (size_t i = 0; i < sizeof tools / sizeof *tools; i++) {
        char path[4200];
        if (find_on_path(tools[i], path, sizeof path)) sha_stat(&s, "tool", path);
        else sha_string(&s, "tool", tools[i]);
    }
    sha_mapped_libraries(&s, self);
#ifdef FP8C_HAVE_LLVM
    char *host = cg_llvm_host();
    sha_string(&s, "host", host);
    free(host);
#endif
    sha_final_hex(&s, key);
    return true;
}

/* ---------------------------------------------------------------- entries */

static bool cache_dir(char *out, size_t len)
{
    if (build_no_cache()) return false;
    const char *d = getenv("FP8C_CACHE_DIR");
    if (d && *d) snprintf(out, len, "%s", d);
    else if ((d = getenv("XDG_CACHE_HOME")) && *d) snprintf(out, len, "%s/fp8c", d);
    else if ((d = getenv("HOME")) && *d) snprintf(out, len, "%s/.cache/fp8c", d);
    else return false;
    for (char *p = out + 1; *p; p++) {   /* mkdir -p */
        if (*p != '/') continue;
        *p = 0;
        mkdir(out, 0777);
        *p = '/';
    }
    return mkdir(out, 0777) == 0 || errno == EEXIST;
}

static void *read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0, got;
    do {
        if (n == cap) {
            cap = cap ? 2 * cap : 1 << 20;
            char *more = realloc(buf, cap + 1);
            if (!more) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = more;
        }
        got = fread(buf + n, 1, cap - n, f);
        n += got;
    } while (got > 0);
    bool ok = !ferror(f);
    fclose(f);
    if (!ok) {
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *size = n;
    return buf;
}

/* Writes data to path through a temporary file beside it, with the mode a new file (or an
 * executable) gets under the umask. */
static bool write_file(const char *path, const void *data, size_t size, bool executable)
{
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0) return false;
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        close(fd);
        unlink(tmp);
        return false;
    }
    bool ok = fwrite(data, 1, size, f) == size;
    if (fclose(f) != 0) ok = false;
    if (ok) {
        mode_t mask = umask(0);
        umask(mask);
        ok = chmod(tmp, (executable ? 0777 : 0666) & ~mask) == 0;
    }
    if (ok) ok = rename(tmp, path) == 0;
    if (!ok) unlink(tmp);
    return ok;
}

static void entry_paths(const char *dir, const char *key, char *bin, char *meta, size_t len)
{
    snprintf(bin, len, "%s/bin-%s", dir, key);
    snprintf(meta, len, "%s/bin-%s.meta", dir, key);
}

/* The meta file: its lines, each checked; false for anything else. */
static bool parse_meta(char *text, const char *key, size_t *size, char sha[65], BuildSummary *s,
                       char **notes)
{
    char *save = NULL, *line = strtok_r(text, "\n", &save);
    if (!line || strcmp(line, CACHE_FORMAT)) return false;
    line = strtok_r(NULL, "\n", &save);
    if (!line || strncmp(line, "key ", 4) || strcmp(line + 4, key)) return false;
    unsigned long long n;
    int end = 0;
    line = strtok_r(NULL, "\n", &save);
    if (!line || sscanf(line, "size %llu%n", &n, &end) != 1 || line[end]) return false;
    *size = (size_t)n;
    line = strtok_r(NULL, "\n", &save);
    if (!line || strncmp(line, "sha256 ", 7) || strlen(line + 7) != 64) return false;
    memcpy(sha, line + 7, 65);
    line = strtok_r(NULL, "\n", &save);
    if (!line || sscanf(line, "summary %d %lld %lld %lld %lld %lld%n", &s->opt_level, &s->batch,
                        &s->seq, &s->n_params, &s->persistent, &s->transient, &end) != 6 ||
        line[end])
        return false;
    s->model_name[0] = 0;
    *notes = save;   /* the rest: "name NAME" and "note TEXT" lines */
    return true;
}

CacheResult cache_fetch_binary(const char *key, const char *out_path, BuildSummary *summary)
{
    char dir[4096], bin_path[4300], meta_path[4300];
    if (!cache_dir(dir, sizeof dir)) return CACHE_MISS;
    entry_paths(dir, key, bin_path, meta_path, sizeof bin_path);
    size_t meta_size = 0, size = 0, want_size = 0;
    char *meta = read_file(meta_path, &meta_size);
    if (!meta) return CACHE_MISS;
    CacheResult result = CACHE_HIT;
    char *bin = NULL, want_sha[65], *notes = NULL;
    bool ok = parse_meta(meta, key, &want_size, want_sha, summary, &notes);
    if (ok) bin = read_file(bin_path, &size);
    if (ok) ok = bin && size == want_size;
    if (ok) {
        Sha256 s;
        char sha[65];
        sha_init(&s);
        sha_update(&s, bin, size);
        sha_final_hex(&s, sha);
        ok = !strcmp(sha, want_sha);
    }
    if (!ok) {
        /* a damaged entry: drop it, and build in full */
        build_progress("note: the cached binary %.12s is damaged; building it again", key);
        unlink(meta_path);
        unlink(bin_path);
        result = CACHE_MISS;
    } else if (!write_file(out_path, bin, size, true)) {
        fprintf(stderr, "fp8c: error: %s: cannot write: %s\n", out_path, strerror(errno));
        result = CACHE_FAILED;
    } else {
        char *save = NULL;
        for (char *l = strtok_r(notes, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
            if (!strncmp(l, "note ", 5)) fprintf(stderr, "fp8c: note: %s\n", l + 5);
            if (!strncmp(l, "name ", 5))
                snprintf(summary->model_name, sizeof summary->model_name, "%s", l + 5);
        }
    }
    free(bin);
    free(meta);
    return result;
}

void cache_store_binary(const char *key, const char *bin_path, const BuildSummary *s,
                        const char *notes)
{
    char dir[4096], entry_bin[4300], entry_meta[4300];
    if (!cache_dir(dir, sizeof dir)) return;
    entry_paths(dir, key, entry_bin, entry_meta, sizeof entry_bin);
    size_t size = 0;
    char *bin = read_file(bin_path, &size);
    if (!bin) return;
    Sha256 sh;
    char sha[65];
    sha_init(&sh);
    sha_update(&sh, bin, size);
    sha_final_hex(&sh, sha);
    char *meta = NULL;
    size_t meta_len = 0;
    FILE *m = open_memstream(&meta, &meta_len);
    if (m) {
        fprintf(m, "%s\nkey %s\nsize %zu\nsha256 %s\nsummary %d %lld %lld %lld %lld %lld\n",
                CACHE_FORMAT, key, size, sha, s->opt_level, s->batch, s->seq, s->n_params,
                s->persistent, s->transient);
        if (s->model_name[0] && !strchr(s->model_name, '\n'))
            fprintf(m, "name %s\n", s->model_name);
        for (const char *p = notes; p && *p;) {
            size_t n = strcspn(p, "\n");
            fprintf(m, "note %.*s\n", (int)n, p);
            p += n + (p[n] == '\n');
        }
        fclose(m);
    }
    /* no cache is slower, not wrong: failures here are silent */
    if (meta && write_file(entry_bin, bin, size, false))
        write_file(entry_meta, meta, meta_len, false);
    free(meta);
    free(bin);
}
