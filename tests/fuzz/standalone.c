/* standalone.c — a main for the harnesses of tests/fuzz where libFuzzer is not available (gcc
 * builds, CI): it replays the seed corpus, then runs a fixed-time loop of random mutations with
 * a fixed seed, so that a sanitized gcc build exercises every harness under ASan and UBSan.
 *
 * It has no coverage feedback: the corpus never grows and the mutations are blind. What it
 * brings is determinism and reach without clang: the same seed gives the same inputs, and the
 * mutations are those that find bugs in fp8c's readers (numbers swapped for extreme ones, words
 * of the corpus inserted, lengths and offsets of binary headers overwritten, pieces of two
 * inputs spliced). Coverage-guided runs use libFuzzer (-DFP8C_FUZZ=ON with clang).
 *
 * Its command line is the part of libFuzzer's that tools/fuzz/run_fuzzers.sh uses, so the
 * script runs either kind of binary: files and directories of inputs to replay, -seed=N,
 * -max_total_time=S and -runs=N (mutated inputs for S seconds, at most N of them; with neither,
 * the inputs are only replayed), -max_len=N, -timeout=S (per input), -artifact_prefix=P; other
 * -flag=value options are ignored. It prints libFuzzer's stat:: lines at the end. An input that
 * crashes, aborts, trips a sanitizer or makes the code under test call exit() is written to
 * P + "crash-" + its hash, one that runs over the timeout to P + "timeout-" + its hash, before
 * the process dies. Leaks are reported by LeakSanitizer when the process exits, without the
 * input (reproduce them with libFuzzer, or by replaying the inputs one by one). */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Set by the sanitizer runtimes when they are linked: called before they end the process. */
void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

typedef struct {
    uint8_t *data;
    size_t size;
} Input;

typedef struct {
    Input *items;
    int n, cap;
} Inputs;

static const char *artifact_prefix = "";
static const uint8_t *volatile current_data;   /* the input being run, NULL between inputs */
static volatile size_t current_size;

/* FNV-1a, as the name of an artifact: the same input always lands in the same file. */
static uint64_t input_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Writes the current input to the artifact file named kind-hash. Only open/write/close, which
 * are safe in a signal handler; runs once. */
static void artifact_write(const char *kind)
{
    static volatile sig_atomic_t done;
    const uint8_t *p = current_data;
    if (!p || done) return;
    done = 1;
    size_t n = current_size;
    char path[4096];
    uint64_t h = input_hash(p, n);
    size_t len = strlen(artifact_prefix), klen = strlen(kind);
    if (len + klen + 18 >= sizeof path) return;
    memcpy(path, artifact_prefix, len);
    memcpy(path + len, kind, klen);
    len += klen;
    path[len++] = '-';
    for (int i = 15; i >= 0; i--) path[len++] = "0123456789abcdef"[(h >> (4 * i)) & 15];
    path[len] = '\0';
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    for (size_t off = 0; off < n;) {
        ssize_t k = write(fd, p + off, n - off);
        if (k <= 0) break;
        off += (size_t)k;
    }
    close(fd);
    static const char msg[] = "standalone: the failing input was written to ";
    (void)!write(2, msg, sizeof msg - 1);
    (void)!write(2, path, len);
    (void)!write(2, "\n", 1);
}

static void on_death(void) { artifact_write("crash"); }

static void on_signal(int sig)
{
    artifact_write("crash");
    signal(sig, SIG_DFL);
    raise(sig);
}

/* exit() inside the code under test ends the process as a crash would: libFuzzer counts it as
 * one ("fuzz target exited"), and so does this driver. */
static void on_exit_in_input(void)
{
    if (!current_data) return;
    static const char msg[] = "standalone: the input made the code under test call exit()\n";
    (void)!write(2, msg, sizeof msg - 1);
    artifact_write("crash");
    _exit(77);
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "standalone: an input ran over the timeout\n";
    (void)!write(2, msg, sizeof msg - 1);
    artifact_write("timeout");
    _exit(70);
}

static void catch_failures(void)
{
    if (__sanitizer_set_death_callback) {
        __sanitizer_set_death_callback(on_death);
    } else {   /* no sanitizer: its handlers are not there to be replaced */
        signal(SIGSEGV, on_signal);
        signal(SIGBUS, on_signal);
        signal(SIGFPE, on_signal);
        signal(SIGILL, on_signal);
    }
    signal(SIGABRT, on_signal);   /* assertions, and sanitizers told to abort_on_error */
    signal(SIGALRM, on_alarm);
    atexit(on_exit_in_input);
}

static unsigned timeout_s = 10;

static void run_one(const uint8_t *data, size_t size)
{
    /* a copy of exactly size bytes, so that ASan sees a read past the end */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) abort();
    memcpy(copy, data, size);
    current_size = size;
    current_data = copy;
    alarm(timeout_s);
    LLVMFuzzerTestOneInput(copy, size);
    alarm(0);
    current_data = NULL;
    free(copy);
}

static void inputs_add(Inputs *in, uint8_t *data, size_t size)
{
    if (in->n == in->cap) {
        in->cap = in->cap ? 2 * in->cap : 64;
        in->items = realloc(in->items, (size_t)in->cap * sizeof *in->items);
        if (!in->items) abort();
    }
    in->items[in->n++] = (Input){data, size};
}

static int read_file(const char *path, Inputs *in, size_t max_len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return 0;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    for (size_t k; buf && (k = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += k;
        if (n == cap) buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    if (!buf) abort();
    if (n > max_len) n = max_len;
    inputs_add(in, buf, n);
    return 1;
}

static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every regular file of a directory, in name order (the same order on every machine). */
static int read_dir(const char *dir, Inputs *in, size_t max_len)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    char **names = NULL;
    int n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            names = realloc(names, (size_t)cap * sizeof *names);
            if (!names) abort();
        }
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, name_cmp);
    int count = 0;
    for (int i = 0; i < n; i++) {
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) count += read_file(path, in, max_len);
        free(names[i]);
    }
    free(names);
    return count;
}

/* ---------------------------------------------------------------- mutations */

static uint64_t rng_state;

static uint64_t rng_next(void)   /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t rng_below(size_t n) { return n ? (size_t)(rng_next() % n) : 0; }

/* Words of the corpus (runs of letters, digits and -_.:=) that the mutations insert: flag
 * names, keywords, op names, JSON keys. */
typedef struct {
    char **words;
    int n, cap;
} Dict;

static void dict_build(Dict *d, const Inputs *in)
{
    for (int k = 0; k < in->n; k++) {
        const uint8_t *p = in->items[k].data;
        size_t n = in->items[k].size;
        for (size_t i = 0; i < n;) {
            size_t j = i;
            while (j < n && (p[j] == '-' || p[j] == '_' || p[j] == '.' || p[j] == ':' ||
                             p[j] == '=' || (p[j] >= '0' && p[j] <= '9') ||
                             (p[j] >= 'a' && p[j] <= 'z') || (p[j] >= 'A' && p[j] <= 'Z')))
                j++;
            if (j - i >= 2 && j - i <= 32 && d->n < 4096) {
                char *w = strndup((const char *)p + i, j - i);
                int seen = 0;
                for (int m = 0; m < d->n && !seen; m++) seen = !strcmp(d->words[m], w);
                if (seen) {
                    free(w);
                } else {
                    if (d->n == d->cap) {
                        d->cap = d->cap ? 2 * d->cap : 256;
                        d->words = realloc(d->words, (size_t)d->cap * sizeof *d->words);
                        if (!d->words) abort();
                    }
                    d->words[d->n++] = w;
                }
            }
            i = j + 1;
        }
    }
}

static const char *const numbers[] = {
    "0", "1", "-1", "2", "3", "7", "8", "16", "127", "128", "255", "256", "1023", "1024",
    "65535", "65536", "2147483647", "2147483648", "-2147483648", "4294967295", "4294967296",
    "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "18446744073709551615", "99999999999999999999", "1e308", "1e309", "-1e308", "nan", "inf",
    "-inf", "1e-45", "0.0", "-0", "0x10", "1e3", "3.5",
};

static const uint64_t words64[] = {
    0, 1, 0x7f, 0x80, 0xff, 0x7fff, 0x8000, 0xffff, 0x7fffffff, 0x80000000, 0xffffffff,
    0x100000000ull, 0x7fffffffffffffffull, 0x8000000000000000ull, 0xffffffffffffffffull,
};

/* Replaces [at, at+len) of buf (size *n, capacity cap) by src[0..k): false when it would not fit. */
static int splice(uint8_t *buf, size_t *n, size_t cap, size_t at, size_t len, const void *src,
                  size_t k)
{
    if (at > *n) at = *n;
    if (len > *n - at) len = *n - at;
    if (*n - len + k > cap) return 0;
    memmove(buf + at + k, buf + at + len, *n - at - len);
    memcpy(buf + at, src, k);
    *n = *n - len + k;
    return 1;
}

static void mutate_once(uint8_t *buf, size_t *n, size_t cap, const Inputs *in, const Dict *d)
{
    size_t at = rng_below(*n + 1);
    switch (rng_below(11)) {
    case 0:   /* flip a bit */
        if (*n) buf[rng_below(*n)] ^= (uint8_t)(1u << rng_below(8));
        break;
    case 1: {   /* a random byte, or one that separates things */
        static const char special[] = "\n\0 =,-:[](){}\"\\%@.0#";
        uint8_t c = rng_below(2) ? (uint8_t)rng_next() : (uint8_t)special[rng_below(sizeof special - 1)];
        if (*n && rng_below(2)) buf[rng_below(*n)] = c;
        else splice(buf, n, cap, at, 0, &c, 1);
        break;
    }
    case 2:   /* delete a range */
        if (*n) splice(buf, n, cap, at, 1 + rng_below(rng_below(2) ? 4 : *n), "", 0);
        break;
    case 3: {   /* duplicate a range */
        if (!*n) break;
        size_t from = rng_below(*n), len = 1 + rng_below(*n - from < 64 ? *n - from : 64);
        uint8_t tmp[64];
        memcpy(tmp, buf + from, len);
        splice(buf, n, cap, at, 0, tmp, len);
        break;
    }
    case 4: case 5: {   /* a number in place of a number, or anywhere */
        const char *s = numbers[rng_below(sizeof numbers / sizeof numbers[0])];
        size_t i = at, len = 0;
        while (i > 0 && i <= *n && i - 1 < *n && buf[i - 1] >= '0' && buf[i - 1] <= '9') i--;
        while (i + len < *n && ((buf[i + len] >= '0' && buf[i + len] <= '9') || buf[i + len] == '.'))
            len++;
        splice(buf, n, cap, i, len, s, strlen(s));
        break;
    }
    case 6: case 7:   /* a word of the corpus */
        if (d->n) {
            const char *w = d->words[rng_below((size_t)d->n)];
            splice(buf, n, cap, at, rng_below(2) ? 0 : rng_below(8), w, strlen(w));
        }
        break;
    case 8: {   /* a binary integer of 1, 2, 4 or 8 bytes, little-endian, over the bytes there */
        uint64_t v = words64[rng_below(sizeof words64 / sizeof words64[0])];
        if (rng_below(4) == 0) v += rng_below(17) - 8;
        size_t w = (size_t)1 << rng_below(4);
        uint8_t b[8];
        for (size_t i = 0; i < w; i++) b[i] = (uint8_t)(v >> (8 * i));
        if (at + w <= *n) memcpy(buf + at, b, w);
        break;
    }
    case 9: {   /* a piece of another input */
        const Input *o = &in->items[rng_below((size_t)in->n)];
        if (!o->size) break;
        size_t from = rng_below(o->size), len = 1 + rng_below(o->size - from);
        splice(buf, n, cap, at, rng_below(2) ? 0 : len, o->data + from, len);
        break;
    }
    default:   /* cut the input short */
        *n = at;
        break;
    }
}

/* ---------------------------------------------------------------- main */

static long flag_value(const char *arg, const char *name, int *matched)
{
    size_t k = strlen(name);
    if (strncmp(arg, name, k) || arg[k] != '=') return 0;
    *matched = 1;
    return strtol(arg + k + 1, NULL, 10);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    long seed = 1, total_time = 0, runs = -1, max_len = 65536;
    Inputs corpus = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int m = 0;
        if (a[0] != '-') {
            struct stat st;
            if (stat(a, &st) == 0 && S_ISDIR(st.st_mode)) read_dir(a, &corpus, (size_t)max_len);
            else if (!read_file(a, &corpus, (size_t)max_len)) return 1;
            continue;
        }
        long v;
        if ((v = flag_value(a, "-seed", &m)), m) seed = v;
        else if ((v = flag_value(a, "-max_total_time", &m)), m) total_time = v;
        else if ((v = flag_value(a, "-runs", &m)), m) runs = v;
        else if ((v = flag_value(a, "-max_len", &m)), m) max_len = v > 0 ? v : 1;
        else if ((v = flag_value(a, "-timeout", &m)), m) timeout_s = v > 0 ? (unsigned)v : 0;
        else if (!strncmp(a, "-artifact_prefix=", 17)) artifact_prefix = a + 17;
        else fprintf(stderr, "standalone: ignoring %s\n", a);
    }
    catch_failures();
    double t0 = now_s();
    long executed = 0;
    for (int k = 0; k < corpus.n; k++, executed++) run_one(corpus.items[k].data, corpus.items[k].size);
    fprintf(stderr, "standalone: replayed %d inputs; mutating for %ld s, %ld runs, seed %ld\n",
            corpus.n, total_time, runs, seed);
    if (total_time > 0 || runs > 0) {
        if (!corpus.n) inputs_add(&corpus, calloc(1, 1), 0);
        Dict dict = {0};
        dict_build(&dict, &corpus);
        rng_state = (uint64_t)seed;
        size_t cap = (size_t)max_len;
        uint8_t *buf = malloc(cap);
        if (!buf) abort();
        double end = t0 + (double)total_time;
        for (long r = 0; runs < 0 || r < runs; r++) {
            if (total_time > 0 && (r & 63) == 0 && now_s() >= end) break;
            const Input *base = &corpus.items[rng_below((size_t)corpus.n)];
            size_t n = base->size < cap ? base->size : cap;
            memcpy(buf, base->data, n);
            for (size_t k = 1 + rng_below(rng_below(2) ? 2 : 8); k > 0; k--)
                mutate_once(buf, &n, cap, &corpus, &dict);
            run_one(buf, n);
            executed++;
        }
        free(buf);
        for (int i = 0; i < dict.n; i++) free(dict.words[i]);
        free(dict.words);
    }
    double took = now_s() - t0;
    printf("stat::number_of_executed_units: %ld\n", executed);
    printf("stat::average_exec_per_sec:     %.0f\n", took > 0 ? (double)executed / took : 0.0);
    for (int k = 0; k < corpus.n; k++) free(corpus.items[k].data);
    free(corpus.items);
    return 0;
}
