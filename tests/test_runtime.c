/* test_runtime.c — the training binary's pieces without a model: token shards and the byte
 * tokenizer, batch positions, safetensors checkpoints (round trips in every dtype, every kind
 * of corruption, atomic saves), the flags, the learning-rate schedule and the arena binding.
 * Every test writes fresh random files into its own temp directory. */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <sys/syscall.h>

#include "rt.h"
#include "test_files.h"

/* Every fsync the runtime makes is recorded here (by the path of its file descriptor) and then
 * made: this definition takes the place of libc's in this executable. */
static char synced[64][512];
static int n_synced;

int fsync(int fd) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    if (n_synced < 64) {
        ssize_t k = readlink(link, synced[n_synced], sizeof synced[n_synced] - 1);
        synced[n_synced][k > 0 ? k : 0] = 0;
        n_synced++;
    }
    return (int)syscall(SYS_fsync, fd);
}

static uint64_t rng_state;

static uint64_t rng_next(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int setup(void **state) {
    (void)state;
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/fp8c-test-runtime-XXXXXX");
    assert_non_null(mkdtemp(tmp_dir));
    rng_state = 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid() ^ (uint64_t)time(NULL);
    static FILE *devnull;
    if (!devnull) devnull = fopen("/dev/null", "w");
    rt_set_error_stream(devnull);   /* the messages are checked through rt_last_error */
    rt_clear_error();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(tmp_dir);
    return 0;
}

static const char *tmp_path(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmp_dir, name);
    return buf[k];
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
}

/* A shard header with chosen fields followed by n_tokens tokens (not necessarily count). */
static void write_raw_shard(const char *path, uint32_t magic, uint32_t version, uint32_t count,
                            int64_t n_tokens) {
    size_t size = 1024 + 2 * (size_t)n_tokens;
    uint8_t *buf = calloc(1, size);
    uint32_t h[3] = {magic, version, count};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 4; b++) buf[4 * i + b] = (uint8_t)(h[i] >> (8 * b));
    for (int64_t i = 0; i < n_tokens; i++) buf[1024 + 2 * i] = (uint8_t)(rng_next() % 200);
    write_bytes(path, buf, size);
    free(buf);
}

static void assert_error_mentions(const char *a, const char *b) {
    const char *msg = rt_last_error();
    if (!strstr(msg, a) || (b && !strstr(msg, b)))
        fail_msg("error \"%s\" should mention \"%s\"%s%s", msg, a, b ? " and " : "", b ? b : "");
}

/* ---------------------------------------------------------------- shards */

static void test_shard_round_trip(void **state) {
    (void)state;
    int64_t n = 1000 + (int64_t)(rng_next() % 5000);
    uint16_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (uint16_t)rng_next();
    const char *path = tmp_path("good.bin");
    assert_true(rt_data_write_shard(path, tok, n));
    TokenData d;
    assert_true(rt_data_open(&d, path));
    assert_int_equal(d.n_shards, 1);
    assert_false(d.is_text);
    assert_int_equal(d.n_tokens, n);
    assert_memory_equal(d.shards[0].tok, tok, (size_t)n * sizeof *tok);
    /* the vocabulary check finds the largest token */
    uint16_t max = 0;
    for (int64_t i = 0; i < n; i++) max = tok[i] > max ? tok[i] : max;
    assert_true(rt_data_check(&d, "the training data", 17, n, (int64_t)max + 1));
    assert_false(rt_data_check(&d, "the training data", 17, n, max));
    assert_error_mentions(path, "outside the model's vocabulary");
    assert_false(rt_data_check(&d, "the training data", 17, n + 1, 65536));
    assert_error_mentions(path, "fewer than");
    rt_data_free(&d);
    free(tok);
}

/* Several files hold a batch together when none does alone: rows are drawn from windows of
 * every file. A file shorter than one window adds no window, and a set of only such files holds
 * no batch whatever its total. */
static void test_shard_set_holds_batch(void **state) {
    (void)state;
    enum { WINDOW = 17, BATCH = 4 * 16 + 1 };
    int64_t n = BATCH / 2 + 1 + (int64_t)(rng_next() % 8);
    uint16_t tok[BATCH];
    for (int64_t i = 0; i < BATCH; i++) tok[i] = (uint16_t)(rng_next() % 200);
    assert_true(rt_data_write_shard(tmp_path("half_a.bin"), tok, n));
    assert_true(rt_data_write_shard(tmp_path("half_b.bin"), tok, n));
    char spec[1200];
    snprintf(spec, sizeof spec, "%s/half_*.bin", tmp_dir);
    TokenData d;
    assert_true(rt_data_open(&d, spec));
    rt_clear_error();
    if (!rt_data_check(&d, "the training data", WINDOW, BATCH, 256))
        fail_msg("two files of %lld tokens refused for a batch of %d: %s", (long long)n, BATCH,
                 rt_last_error());
    rt_data_free(&d);
    /* a name left out of the list ("a,", ",a", "a,,b") is refused, not skipped */
    char a[512], b[512], list[1100];
    snprintf(a, sizeof a, "%s", tmp_path("half_a.bin"));
    snprintf(b, sizeof b, "%s", tmp_path("half_b.bin"));
    for (int i = 0; i < 3; i++) {
        if (i == 0) snprintf(list, sizeof list, "%s,%s,", a, b);
        if (i == 1) snprintf(list, sizeof list, ",%s,%s", a, b);
        if (i == 2) snprintf(list, sizeof list, "%s,,%s", a, b);
        rt_clear_error();
        assert_false(rt_data_open(&d, list));
        assert_error_mentions(list, "an empty name in the list");
    }
    /* short files: BATCH tokens in all, none holding a window */
    for (int i = 0; i < 5; i++) {
        char name[32];
        snprintf(name, sizeof name, "short_%d.bin", i);
        assert_true(rt_data_write_shard(tmp_path(name), tok, WINDOW - 1));
    }
    snprintf(spec, sizeof spec, "%s/short_*.bin", tmp_dir);
    assert_true(rt_data_open(&d, spec));
    assert_false(rt_data_check(&d, "the training data", WINDOW, BATCH, 256));
    assert_error_mentions("short_0.bin", "fewer than");
    rt_data_free(&d);
}

/* llm.c's uint32 shards (magic 20240801, version 7, as dev/data/data_common.py writes them for
 * Llama 3): written here byte by byte, read back through batches, checked against the
 * vocabulary, split into a validation tail. */
static void test_shard_uint32(void **state) {
    (void)state;
    enum { T = 16, B = 3 };
    int64_t n = 2000 + (int64_t)(rng_next() % 3000);
    uint32_t *tok = malloc((size_t)n * sizeof *tok), max = 0;
    size_t size = 1024 + 4 * (size_t)n;
    uint8_t *buf = calloc(1, size);
    uint32_t h[3] = {RT_SHARD32_MAGIC, RT_SHARD32_VERSION, (uint32_t)n};
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < 4; b++) buf[4 * i + b] = (uint8_t)(h[i] >> (8 * b));
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (uint32_t)(rng_next() % 128256);   /* Llama 3's vocabulary, beyond uint16 */
        max = tok[i] > max ? tok[i] : max;
        for (int b = 0; b < 4; b++) buf[1024 + 4 * i + b] = (uint8_t)(tok[i] >> (8 * b));
    }
    const char *path = tmp_path("wide.bin");
    write_bytes(path, buf, size);
    TokenData d;
    assert_true(rt_data_open(&d, path));
    assert_false(d.is_text);
    assert_int_equal(d.n_tokens, n);
    assert_true(rt_data_check(&d, "the training data", T + 1, B * T + 1, (int64_t)max + 1));
    assert_false(rt_data_check(&d, "the training data", T + 1, B * T + 1, max));
    assert_error_mentions(path, "outside the model's vocabulary");
    /* a training row is T+1 contiguous tokens of the file */
    int32_t x[B * T], y[B * T];
    rt_data_train_batch(&d, rng_next(), 3, 0, B, T, x, y);
    for (int r = 0; r < B; r++) {
        int64_t at = -1;
        for (int64_t i = 0; i + T < n && at < 0; i++)
            if ((int32_t)tok[i] == x[r * T]) {
                bool same = true;
                for (int t = 0; t < T && same; t++)
                    same = (int32_t)tok[i + t] == x[r * T + t] && (int32_t)tok[i + t + 1] == y[r * T + t];
                if (same) at = i;
            }
        assert_true(at >= 0);
    }
    /* the validation tail is a view of the same uint32 tokens */
    TokenData val;
    assert_true(rt_data_split_tail(&d, &val, 0.25));
    rt_data_val_batch(&val, 0, B, T, x, y);
    int64_t start = n - val.n_tokens;
    for (int t = 0; t < T; t++) {
        assert_int_equal(x[t], (int32_t)tok[start + t]);
        assert_int_equal(y[t], (int32_t)tok[start + t + 1]);
    }
    rt_data_free(&val);
    rt_data_free(&d);
    /* the other version, and tokens cut short */
    h[1] = 2;
    for (int b = 0; b < 4; b++) buf[4 + b] = (uint8_t)(h[1] >> (8 * b));
    write_bytes(path, buf, size);
    assert_false(rt_data_open(&d, path));
    assert_error_mentions(path, "version 2, expected 7");
    h[1] = RT_SHARD32_VERSION;
    for (int b = 0; b < 4; b++) buf[4 + b] = (uint8_t)(h[1] >> (8 * b));
    write_bytes(path, buf, size - 2);
    assert_false(rt_data_open(&d, path));
    assert_error_mentions(path, "truncated");
    free(buf);
    free(tok);
}

/* json.c: what config.json files hold, and one error line for what is not JSON. */
/* The one JSON string writer: any bytes (fresh random ones, quotes, backslashes, control
 * characters) quoted by rt_json_quote read back the same through rt_json_read and through a
 * checkpoint's metadata; a short buffer gets a terminated prefix and the length it needs. */
static void test_json_quote(void **state) {
    (void)state;
    for (int round = 0; round < 20; round++) {
        char s[200];
        int n = 1 + (int)(rng_next() % 150);
        for (int i = 0; i < n; i++) s[i] = (char)(1 + rng_next() % 255);
        if (round == 0) snprintf(s, sizeof s, "a\"b\\c\n\t\x01\x1f\x7f");
        else s[n] = 0;
        char q[2048];
        size_t len = rt_json_quote(q, sizeof q, s);
        assert_int_equal(len, strlen(q));
        for (size_t i = 1; i + 1 < len; i++) assert_true((unsigned char)q[i] >= 0x20 && q[i] != 0x7f);
        char small[8];
        assert_int_equal(rt_json_quote(small, sizeof small, s), len);
        size_t kept = len < sizeof small ? len : sizeof small - 1;
        assert_int_equal(strlen(small), kept);
        assert_memory_equal(small, q, kept);
        const char *path = tmp_path("quoted.json");
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs("{\"k\": ", f);
        assert_true(rt_json_write_string(f, s));
        fputs("}", f);
        fclose(f);
        Jv v;
        if (!rt_json_read(path, &v)) fail_msg("round %d: %s", round, rt_last_error());
        assert_string_equal(rt_json_get(&v, "k")->str, s);
        rt_json_free(&v);
        /* the same string as checkpoint metadata */
        float x = 1;
        Tensor t = {.name = "w", .rank = 1, .dims = {1}, .fmt = fmt_plain(FMT_F32), .data = &x};
        Tensor *ts[1] = {&t};
        CkptMeta meta = {.key = "data"};
        snprintf(meta.value, sizeof meta.value, "%s", s);
        const char *ck = tmp_path("quoted.safetensors");
        assert_true(rt_ckpt_save(ck, ts, 1, &meta, 1));
        CkptMeta back[4];
        int n_back = 0;
        assert_true(rt_ckpt_load(ck, ts, 1, back, 4, &n_back));
        assert_string_equal(rt_ckpt_meta_get(back, n_back, "data"), meta.value);
    }
}

static void test_json(void **state) {
    (void)state;
    const char *path = tmp_path("config.json");
    const char *good = "{\"model_type\": \"llama\", \"n\": 32, \"eps\": 1e-05, \"neg\": -2.5E+3,\n"
                       " \"tie\": false, \"scaling\": null, \"archs\": [\"A\", {\"x\": [1, []]}],\n"
                       " \"esc\": \"a\\\"b\\u00e9\\n\", \"nested\": {\"deep\": {\"k\": true}},\n"
                       " \"big\": 9007199254740993, \"small\": -7}";
    write_bytes(path, good, strlen(good));
    Jv v;
    assert_true(rt_json_read(path, &v));
    assert_string_equal(rt_json_get(&v, "model_type")->str, "llama");
    assert_true(rt_json_get(&v, "n")->kind == JV_NUM && rt_json_get(&v, "n")->num == 32);
    assert_true(rt_json_get(&v, "eps")->num == 1e-5 && rt_json_get(&v, "neg")->num == -2500);
    assert_true(rt_json_get(&v, "tie")->kind == JV_BOOL && rt_json_get(&v, "tie")->num == 0);
    assert_true(rt_json_get(&v, "scaling")->kind == JV_NULL);
    assert_int_equal(rt_json_get(&v, "archs")->n, 2);
    assert_string_equal(rt_json_get(&v, "esc")->str, "a\"b\xc3\xa9\n");
    assert_true(rt_json_get(rt_json_get(rt_json_get(&v, "nested"), "deep"), "k")->num == 1);
    assert_null(rt_json_get(&v, "absent"));
    assert_null(rt_json_get(rt_json_get(&v, "n"), "x"));
    /* integers exact (2^53 + 1 has no double), reals not integers, every value's place */
    assert_true(rt_json_get(&v, "n")->is_int && rt_json_get(&v, "n")->i == 32);
    assert_true(rt_json_get(&v, "big")->is_int && rt_json_get(&v, "big")->i == 9007199254740993LL);
    assert_true(rt_json_get(&v, "small")->is_int && rt_json_get(&v, "small")->i == -7);
    assert_false(rt_json_get(&v, "eps")->is_int);
    assert_false(rt_json_get(&v, "neg")->is_int);
    assert_int_equal(rt_json_get(&v, "n")->at, strstr(good, "32") - good);
    assert_int_equal(rt_json_get(&v, "nested")->at, strstr(good, "{\"deep") - good);
    rt_json_free(&v);
    const char *bad[] = {"", "[1, 2]", "{\"a\": }", "{\"a\": 1,}", "{\"a\": \"x}", "{\"a\": 1} 2",
                         "{\"a\": tru}", "{\"a\": \"\\q\"}", "{\"a\": \"tab\there\"}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_bytes(path, bad[i], strlen(bad[i]));
        rt_clear_error();
        if (rt_json_read(path, &v)) fail_msg("read %s", bad[i]);
        assert_error_mentions(path, "bad JSON");
    }
    /* nesting is bounded, not a stack overflow */
    char deep[4096];
    size_t n = 0;
    deep[n++] = '{';
    deep[n++] = '"', deep[n++] = 'a', deep[n++] = '"', deep[n++] = ':';
    for (int i = 0; i < 1000; i++) deep[n++] = '[';
    write_bytes(path, deep, n);
    assert_false(rt_json_read(path, &v));
    assert_error_mentions(path, "nested too deeply");
}

static void test_shard_errors(void **state) {
    (void)state;
    TokenData d;
    struct { const char *name; uint32_t magic, version, count; int64_t held; const char *want; } cases[] = {
        {"magic.bin", 20240519, 1, 100, 100, "magic"},
        {"version.bin", RT_SHARD_MAGIC, 2, 100, 100, "version 2"},
        {"truncated.bin", RT_SHARD_MAGIC, 1, 5000, 4999, "truncated"},
        {"zero.bin", RT_SHARD_MAGIC, 1, 0, 0, "no tokens"},
        {"trailing.bin", RT_SHARD_MAGIC, 1, 10, 12, "after its 10 tokens"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = tmp_path(cases[i].name);
        write_raw_shard(path, cases[i].magic, cases[i].version, cases[i].count, cases[i].held);
        rt_clear_error();
        assert_false(rt_data_open(&d, path));
        assert_error_mentions(path, cases[i].want);
    }
    /* a header cut short, an empty file, a missing file, a glob matching nothing */
    const char *short_path = tmp_path("short.bin");
    write_bytes(short_path, "\x28\xd4\x34\x01", 4);
    assert_false(rt_data_open(&d, short_path));
    assert_error_mentions(short_path, "truncated");
    const char *empty = tmp_path("empty.txt");
    write_bytes(empty, "", 0);
    assert_false(rt_data_open(&d, empty));
    assert_error_mentions(empty, "empty");
    assert_false(rt_data_open(&d, tmp_path("missing.bin")));
    assert_error_mentions("missing.bin", "cannot open");
    assert_false(rt_data_open(&d, tmp_path("nothing*.bin")));
    assert_error_mentions("nothing*.bin", "no file matches");
}

/* A FIFO, a directory or a device named as data or as a checkpoint is refused by one line
 * before it is opened: opening a FIFO for reading would wait for a writer forever (the alarm
 * turns such a wait into a failure). */
static void test_non_regular_files(void **state) {
    (void)state;
    alarm(20);
    const char *fifo = tmp_path("fifo.bin");
    assert_int_equal(mkfifo(fifo, 0666), 0);
    TokenData d;
    rt_clear_error();
    assert_false(rt_data_open(&d, fifo));
    assert_error_mentions(fifo, "FIFO");
    assert_false(rt_data_open(&d, tmp_dir));
    assert_error_mentions(tmp_dir, "directory");
    assert_false(rt_data_open(&d, "/dev/null"));
    assert_error_mentions("/dev/null", "device");
    char resolved[1024];
    assert_false(rt_ckpt_resolve(fifo, resolved, sizeof resolved));
    assert_error_mentions(fifo, "FIFO");
    Tensor t = {.name = "w", .rank = 0, .fmt = fmt_plain(FMT_F32)};
    float x = 0;
    t.data = &x;
    Tensor *ts[1] = {&t};
    CkptMeta meta[4];
    int n_meta;
    assert_false(rt_ckpt_load(fifo, ts, 1, meta, 4, &n_meta));
    assert_error_mentions(fifo, "FIFO");
    /* a checkpoint directory whose latest is a FIFO, and one whose latest names a FIFO */
    char dir[512], latest[600];
    snprintf(dir, sizeof dir, "%s", tmp_path("ck"));
    assert_int_equal(mkdir(dir, 0777), 0);
    snprintf(latest, sizeof latest, "%s/latest", dir);
    assert_int_equal(mkfifo(latest, 0666), 0);
    assert_false(rt_ckpt_resolve(dir, resolved, sizeof resolved));
    assert_error_mentions(latest, "FIFO");
    unlink(latest);
    write_bytes(latest, "step_000001.safetensors\n", 24);
    snprintf(latest, sizeof latest, "%s/step_000001.safetensors", dir);
    assert_int_equal(mkfifo(latest, 0666), 0);
    assert_false(rt_ckpt_resolve(dir, resolved, sizeof resolved));
    assert_error_mentions(latest, "FIFO");
    alarm(0);
}

static void test_byte_tokenizer_and_split(void **state) {
    (void)state;
    size_t n = 2000 + rng_next() % 3000;
    uint8_t *text = malloc(n);
    for (size_t i = 0; i < n; i++) text[i] = (uint8_t)rng_next();
    text[0] = 'x';   /* not the shard magic */
    const char *path = tmp_path("corpus.txt");
    write_bytes(path, text, n);
    TokenData d, val;
    assert_true(rt_data_open(&d, path));
    assert_true(d.is_text);
    assert_int_equal(d.n_tokens, (int64_t)n);
    for (size_t i = 0; i < n; i++) assert_int_equal(d.shards[0].tok[i], text[i]);
    assert_true(rt_data_check(&d, "the training data", 2, 2, RT_BYTE_VOCAB));

    /* the last 5% becomes the validation set, the rest stays for training */
    assert_true(rt_data_split_tail(&d, &val, 0.05));
    int64_t hold = (int64_t)((double)n * 0.05);
    assert_int_equal(val.n_tokens, hold);
    assert_int_equal(d.n_tokens, (int64_t)n - hold);
    assert_memory_equal(val.shards[0].tok, d.shards[0].base + n - hold, (size_t)hold * 2);
    rt_data_free(&val);
    rt_data_free(&d);

    /* a comma list and a glob read every file in order */
    const char *second = tmp_path("corpus2.txt");
    write_bytes(second, text, n / 2);
    char spec[1200];
    snprintf(spec, sizeof spec, "%s,%s/corpus2*.txt", path, tmp_dir);
    assert_true(rt_data_open(&d, spec));
    assert_int_equal(d.n_shards, 2);
    assert_int_equal(d.n_tokens, (int64_t)(n + n / 2));
    rt_data_free(&d);
    free(text);
}

/* Every row is T+1 contiguous tokens of the source, the same for the same (seed, step, micro),
 * and rows of different steps differ. */
static void test_batches(void **state) {
    (void)state;
    int64_t n = 5000;
    uint16_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (uint16_t)(rng_next() % 50000);
    const char *path = tmp_path("batches.bin");
    assert_true(rt_data_write_shard(path, tok, n));
    TokenData d;
    assert_true(rt_data_open(&d, path));
    enum { B = 4, T = 16 };
    int32_t a[B * T], at[B * T], b[B * T], bt[B * T];
    uint64_t seed = rng_next();
    rt_data_train_batch(&d, seed, 7, 1, B, T, a, at);
    rt_data_train_batch(&d, seed, 7, 1, B, T, b, bt);
    assert_memory_equal(a, b, sizeof a);
    assert_memory_equal(at, bt, sizeof at);
    for (int r = 0; r < B; r++) {
        int64_t start = -1;
        for (int64_t p = 0; p + T < n && start < 0; p++) {
            bool match = true;
            for (int t = 0; t < T && match; t++)
                match = tok[p + t] == a[r * T + t] && tok[p + t + 1] == at[r * T + t];
            if (match) start = p;
        }
        assert_true(start >= 0);
    }
    rt_data_train_batch(&d, seed, 8, 1, B, T, b, bt);
    assert_memory_not_equal(a, b, sizeof a);
    rt_data_train_batch(&d, seed, 7, 0, B, T, b, bt);
    assert_memory_not_equal(a, b, sizeof a);
    /* validation batches are fixed windows laid end to end */
    rt_data_val_batch(&d, 2, B, T, a, at);
    for (int r = 0; r < B; r++)
        for (int t = 0; t < T; t++) {
            assert_int_equal(a[r * T + t], tok[(2 * B + r) * T + t]);
            assert_int_equal(at[r * T + t], tok[(2 * B + r) * T + t + 1]);
        }
    rt_data_free(&d);
    free(tok);
}

/* ---------------------------------------------------------------- checkpoints */

enum { N_CKPT = 8 };
static const ElemType ckpt_types[N_CKPT] = {FMT_F32, FMT_BF16, FMT_F16, FMT_E4M3,
                                            FMT_E5M2, FMT_I8, FMT_U8, FMT_I32};

typedef struct {
    Tensor t[N_CKPT];
    Tensor *ptr[N_CKPT];
    char names[N_CKPT][32];
    size_t bytes[N_CKPT];        /* as allocated (tests change shapes and dtypes afterwards) */
} TensorSet;

/* Element k of t set to a NaN (nan) or an infinity of its dtype (e4m3 has no infinity: NaN). */
static void poke_non_finite(Tensor *t, int64_t k, bool nan) {
    uint8_t *p = t->data;
    switch (t->fmt.elem) {
    case FMT_F32: {
        uint32_t u = nan ? 0x7fc00000u : 0xff800000u;
        memcpy(p + 4 * k, &u, 4);
        break;
    }
    case FMT_BF16: p[2 * k] = nan ? 0xc1 : 0x80, p[2 * k + 1] = 0x7f; break;
    case FMT_F16: p[2 * k] = nan ? 0x01 : 0x00, p[2 * k + 1] = 0xfc; break;
    case FMT_E4M3: p[k] = nan ? 0x7f : 0xff; break;
    case FMT_E5M2: p[k] = nan ? 0x7e : 0x7c; break;
    default: fail_msg("no non-finite value in %s", fmt_elem_name(t->fmt.elem));
    }
}

/* Random bytes made finite: a NaN or infinity code has its top exponent bit cleared. */
static void make_finite(Tensor *t) {
    uint8_t *p = t->data;
    int64_t n = ir_numel(t);
    for (int64_t k = 0; k < n; k++) {
        switch (t->fmt.elem) {
        case FMT_F32: if ((p[4 * k + 3] & 0x7f) == 0x7f && (p[4 * k + 2] & 0x80)) p[4 * k + 3] &= 0xbf; break;
        case FMT_BF16: if ((p[2 * k + 1] & 0x7f) == 0x7f && (p[2 * k] & 0x80)) p[2 * k + 1] &= 0xbf; break;
        case FMT_F16: if ((p[2 * k + 1] & 0x7c) == 0x7c) p[2 * k + 1] &= 0xbf; break;
        case FMT_E4M3: if ((p[k] & 0x7f) == 0x7f) p[k] &= 0xfe; break;
        case FMT_E5M2: if ((p[k] & 0x7c) == 0x7c) p[k] &= 0xbf; break;
        default: break;
        }
    }
}

/* Tensors of random shapes in every dtype, filled with random bytes (finite values). */
static void make_tensors(TensorSet *s, bool fill) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < N_CKPT; i++) {
        Tensor *t = &s->t[i];
        snprintf(s->names[i], sizeof s->names[i], i % 2 ? "h.%d.attn.weight:adam_m" : "w%d", i);
        t->name = s->names[i];
        t->rank = i % 3;                 /* scalars, vectors, matrices */
        for (int d = 0; d < t->rank; d++) t->dims[d] = 1 + (int64_t)(rng_next() % 9);
        t->fmt = fmt_plain(ckpt_types[i]);
        t->role = ROLE_PARAM;
        size_t bytes = s->bytes[i] = (size_t)(ir_numel(t) * fmt_elem_bytes(t->fmt.elem));
        t->data = malloc(bytes);
        for (size_t k = 0; k < bytes; k++) ((uint8_t *)t->data)[k] = fill ? (uint8_t)rng_next() : 0xA5;
        make_finite(t);
        s->ptr[i] = t;
    }
}

static void clone_shapes(TensorSet *dst, const TensorSet *src) {
    memset(dst, 0, sizeof *dst);
    for (int i = 0; i < N_CKPT; i++) {
        dst->t[i] = src->t[i];
        memcpy(dst->names[i], src->names[i], sizeof dst->names[i]);
        dst->t[i].name = dst->names[i];
        size_t bytes = dst->bytes[i] = src->bytes[i];
        dst->t[i].data = malloc(bytes);
        memset(dst->t[i].data, 0x5A, bytes);
        dst->ptr[i] = &dst->t[i];
    }
}

static void free_tensors(TensorSet *s) {
    for (int i = 0; i < N_CKPT; i++) free(s->t[i].data);
}

static size_t tensor_bytes(const Tensor *t) {
    return (size_t)(ir_numel(t) * fmt_elem_bytes(t->fmt.elem));
}

static uint8_t *read_all(const char *path, int64_t *size) {
    uint8_t *p = rt_read_file(path, size);
    assert_non_null(p);
    return p;
}

static void test_checkpoint_round_trip(void **state) {
    (void)state;
    TensorSet a, b;
    make_tensors(&a, true);
    clone_shapes(&b, &a);
    CkptMeta meta[2] = {{"model", "tiny \"quoted\" \\ name"}, {"step", "42"}};
    const char *path = tmp_path("round.safetensors");
    assert_true(rt_ckpt_save(path, a.ptr, N_CKPT, meta, 2));
    CkptMeta got[8];
    int n_got = 0;
    assert_true(rt_ckpt_load(path, b.ptr, N_CKPT, got, 8, &n_got));
    for (int i = 0; i < N_CKPT; i++)
        assert_memory_equal(a.t[i].data, b.t[i].data, tensor_bytes(&a.t[i]));
    assert_int_equal(n_got, 2);
    assert_string_equal(rt_ckpt_meta_get(got, n_got, "model"), meta[0].value);
    assert_string_equal(rt_ckpt_meta_get(got, n_got, "step"), "42");

    /* the layout is safetensors': 8-byte length, JSON padded to 8, data after */
    int64_t size;
    uint8_t *file = read_all(path, &size);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--) hlen = hlen << 8 | file[k];
    assert_int_equal(hlen % 8, 0);
    assert_int_equal(file[8], '{');
    size_t total = 0;
    for (int i = 0; i < N_CKPT; i++) total += tensor_bytes(&a.t[i]);
    assert_int_equal((uint64_t)size, 8 + hlen + total);
    assert_non_null(strstr((char *)file + 8, "\"F8_E4M3\""));
    free(file);
    free_tensors(&a);
    free_tensors(&b);
}

/* Writes a variant of a good checkpoint and checks that loading it fails with `want` in the
 * message and leaves the destination tensors untouched. */
static void expect_load_fails(const char *name, const uint8_t *bytes, size_t n, TensorSet *dst,
                              int n_dst, const char *want, const char *want2) {
    const char *path = tmp_path(name);
    write_bytes(path, bytes, n);
    for (int i = 0; i < n_dst; i++) memset(dst->t[i].data, 0x5A, dst->bytes[i]);
    CkptMeta meta[8];
    int n_meta = 0;
    rt_clear_error();
    assert_false(rt_ckpt_load(path, dst->ptr, n_dst, meta, 8, &n_meta));
    assert_error_mentions(want, want2);
    assert_error_mentions(name, NULL);
    for (int i = 0; i < n_dst; i++) {
        const uint8_t *p = dst->t[i].data;
        for (size_t k = 0; k < dst->bytes[i]; k++) assert_int_equal(p[k], 0x5A);
    }
}

static void test_checkpoint_corruption(void **state) {
    (void)state;
    TensorSet a, b;
    make_tensors(&a, true);
    clone_shapes(&b, &a);
    const char *path = tmp_path("good.safetensors");
    assert_true(rt_ckpt_save(path, a.ptr, N_CKPT, NULL, 0));
    int64_t size;
    uint8_t *good = read_all(path, &size);
    uint8_t *bad = malloc((size_t)size);

    expect_load_fails("cut.safetensors", good, (size_t)size - 1, &b, N_CKPT, "truncated", NULL);
    expect_load_fails("tiny.safetensors", good, 5, &b, N_CKPT, "too short", NULL);
    memcpy(bad, good, (size_t)size);
    bad[6] = 0x7f;   /* an absurd header length */
    expect_load_fails("hlen.safetensors", bad, (size_t)size, &b, N_CKPT, "header length", NULL);
    memcpy(bad, good, (size_t)size);
    bad[8] = '[';    /* the header is not an object */
    expect_load_fails("json.safetensors", bad, (size_t)size, &b, N_CKPT, "bad checkpoint header",
                      "byte 0");
    /* one tensor fewer expected: the checkpoint has an extra one */
    expect_load_fails("extra.safetensors", good, (size_t)size, &b, N_CKPT - 1, "which the plan does not have",
                      a.names[N_CKPT - 1]);
    /* a tensor the checkpoint lacks */
    b.t[2].name = "not.in.checkpoint";
    expect_load_fails("lacks.safetensors", good, (size_t)size, &b, N_CKPT, "lacks tensor",
                      "not.in.checkpoint");
    b.t[2].name = b.names[2];
    /* a different shape: both shapes are named */
    int64_t old = b.t[1].dims[0];
    b.t[1].dims[0] = old + 1;
    char want_shape[64];
    snprintf(want_shape, sizeof want_shape, "has shape [%lld]", (long long)old);
    char plan_shape[64];
    snprintf(plan_shape, sizeof plan_shape, "the plan has [%lld]", (long long)old + 1);
    const char *shape_file = "shape.safetensors";
    expect_load_fails(shape_file, good, (size_t)size, &b, N_CKPT, want_shape, plan_shape);
    b.t[1].dims[0] = old;
    /* a different dtype with the same byte size */
    b.t[1].fmt.elem = FMT_F16;
    expect_load_fails("dtype.safetensors", good, (size_t)size, &b, N_CKPT, "is BF16", "as F16");
    b.t[1].fmt.elem = FMT_BF16;
    /* the good file still loads */
    CkptMeta meta[4];
    int n_meta;
    assert_true(rt_ckpt_load(path, b.ptr, N_CKPT, meta, 4, &n_meta));
    free(good);
    free(bad);
    free_tensors(&a);
    free_tensors(&b);
}

/* A safetensors header whose shape has more elements than 64 bits count (2^32 x 2^32 wraps to
 * 0, which its empty data would match) is refused by rt_st_open, whatever the dtype. */
static void test_safetensors_huge_shape(void **state) {
    (void)state;
    static const char *const dtypes[] = {"F32", "XYZ"};
    for (int i = 0; i < 2; i++) {
        char header[160];
        int len = snprintf(header, sizeof header,
                           "{\"x\":{\"dtype\":\"%s\",\"shape\":[4294967296,4294967296],"
                           "\"data_offsets\":[0,0]}}", dtypes[i]);
        const char *path = tmp_path("huge.safetensors");
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        uint8_t len8[8] = {(uint8_t)len};
        assert_int_equal(fwrite(len8, 1, 8, f), 8);
        assert_int_equal(fwrite(header, 1, (size_t)len, f), (size_t)len);
        assert_int_equal(fclose(f), 0);
        RtStFile s;
        rt_clear_error();
        assert_false(rt_st_open(&s, path));
        assert_non_null(strstr(rt_last_error(), "too large"));
    }
    /* a zero dim empties the shape however large the others are */
    const char *ok = "{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,0],"
                     "\"data_offsets\":[0,0]}}";
    const char *path = tmp_path("empty.safetensors");
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t len8[8] = {(uint8_t)strlen(ok)};
    assert_int_equal(fwrite(len8, 1, 8, f), 8);
    assert_int_equal(fwrite(ok, 1, strlen(ok), f), strlen(ok));
    assert_int_equal(fclose(f), 0);
    RtStFile s;
    assert_true(rt_st_open(&s, path));
    rt_st_close(&s);
}

/* A safetensors file: the 8-byte header length, the header, then `data` zero bytes. */
static void write_st(const char *path, const char *header, size_t data) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint64_t len = strlen(header);
    uint8_t len8[8];
    for (int b = 0; b < 8; b++) len8[b] = (uint8_t)(len >> (8 * b));
    assert_int_equal(fwrite(len8, 1, 8, f), 8);
    assert_int_equal(fwrite(header, 1, len, f), len);
    for (size_t i = 0; i < data; i++) fputc(0, f);
    assert_int_equal(fclose(f), 0);
}

/* Safetensors headers go through json.c's reader: random entries come back as written, and
 * each malformed header is refused with its reason and the byte where it lies. */
static void test_safetensors_header(void **state) {
    (void)state;
    srand((unsigned)time(NULL) ^ 0x57);
    const char *path = tmp_path("header.safetensors");
    enum { N = 40 };
    int64_t dims[N][3], at = 0, begin[N];
    int rank[N];
    char header[8192];
    int n = snprintf(header, sizeof header, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < N; i++) {
        rank[i] = rand() % 4;
        int64_t numel = 1;
        n += snprintf(header + n, sizeof header - (size_t)n, ",\"t%d.w%d\":{\"shape\":[", i, rand() % 1000);
        for (int d = 0; d < rank[i]; d++) {
            dims[i][d] = 1 + rand() % 5;
            numel *= dims[i][d];
            n += snprintf(header + n, sizeof header - (size_t)n, "%s%lld", d ? "," : "", (long long)dims[i][d]);
        }
        begin[i] = at;
        at += 2 * numel;
        n += snprintf(header + n, sizeof header - (size_t)n, "],\"dtype\":\"BF16\",\"data_offsets\":[%lld,%lld]}",
                      (long long)begin[i], (long long)at);
    }
    snprintf(header + n, sizeof header - (size_t)n, "}");
    write_st(path, header, (size_t)at);
    RtStFile st;
    assert_true(rt_st_open(&st, path));
    assert_int_equal(st.n_entries, N);
    assert_int_equal(st.n_meta, 1);
    assert_string_equal(st.meta[0].value, "pt");
    for (int i = 0; i < N; i++) {
        const RtStEntry *e = &st.entries[i];
        assert_string_equal(e->dtype, "BF16");
        assert_int_equal(e->rank, rank[i]);
        for (int d = 0; d < rank[i]; d++) assert_int_equal(e->dims[d], dims[i][d]);
        assert_int_equal(e->begin, begin[i]);
        assert_ptr_equal(rt_st_find(&st, e->name), e);
    }
    rt_st_close(&st);

    const struct { const char *header, *want, *at; } bad[] = {
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", "a tensor name appears twice", "{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1"},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"y\":7}}", "unexpected or repeated key", "7}"},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", "non-negative integer", "-1"},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1.0]}}", "non-negative integer", "1.0"},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", "array too long", "1]"},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1]}}", "lacks dtype, shape or data_offsets", "{\"dtype"},
        {"{\"__metadata__\":{\"a\":1}}", "expected a string", "1}"},
        {"{\"x\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,1]}}", "expected a string", "7,"},
        {"{\"x\t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "control character", "\t"},
        {"[]", "expected an object", "[]"},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}} {}", "text after", "{}"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_st(path, bad[i].header, 2);
        rt_clear_error();
        if (rt_st_open(&st, path)) fail_msg("accepted %s", bad[i].header);
        char where[64];
        snprintf(where, sizeof where, " at byte %ld", (long)(strstr(bad[i].header, bad[i].at) - bad[i].header));
        assert_error_mentions("bad checkpoint header", bad[i].want);
        const char *msg = rt_last_error();
        size_t lm = strlen(msg), lw = strlen(where);
        if (lm < lw || strcmp(msg + lm - lw, where)) fail_msg("\"%s\" should end \"%s\"", msg, where);
    }
    /* offsets stay exact past 2^53, where a double would round 2^53 + 1 to 2^53 */
    write_st(path, "{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[9007199254740992,9007199254740993]}}", 0);
    rt_clear_error();
    assert_false(rt_st_open(&st, path));
    assert_error_mentions("ends at byte 9007199254740993", NULL);
}

/* A NaN or an infinity anywhere in a floating-point tensor is refused at load, naming the
 * tensor, before any tensor is written: such a state would only train into NaN. */
static void test_checkpoint_non_finite(void **state) {
    (void)state;
    TensorSet a, b;
    make_tensors(&a, true);
    clone_shapes(&b, &a);
    for (int i = 0; i < N_CKPT; i++) {
        ElemType e = a.t[i].fmt.elem;
        if (e != FMT_F32 && e != FMT_BF16 && e != FMT_F16 && e != FMT_E4M3 && e != FMT_E5M2)
            continue;
        for (int nan = 0; nan < 2; nan++) {
            Tensor *t = &a.t[i];
            uint8_t *keep = malloc(a.bytes[i]);
            memcpy(keep, t->data, a.bytes[i]);
            int64_t k = (int64_t)(rng_next() % (uint64_t)ir_numel(t));
            poke_non_finite(t, k, nan);
            const char *path = tmp_path("nonfinite.safetensors");
            assert_true(rt_ckpt_save(path, a.ptr, N_CKPT, NULL, 0));
            int64_t size;
            uint8_t *bytes = read_all(path, &size);
            char name[64];
            snprintf(name, sizeof name, "nonfinite_%d_%d.safetensors", i, nan);
            char want[96];
            snprintf(want, sizeof want, "tensor %s holds", a.names[i]);
            expect_load_fails(name, bytes, (size_t)size, &b, N_CKPT, want,
                              nan || e == FMT_E4M3 ? "NaN" : "infinity");
            free(bytes);
            memcpy(t->data, keep, a.bytes[i]);
            free(keep);
        }
    }
    free_tensors(&a);
    free_tensors(&b);
}

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    if (d) closedir(d);
    return n;
}

static void test_checkpoint_failed_save(void **state) {
    (void)state;
    TensorSet a;
    make_tensors(&a, true);
    char dir[512];
    snprintf(dir, sizeof dir, "%s", tmp_path("runs/a/ckpt"));   /* parents made as needed */
    char written[1024];
    CkptMeta meta[1] = {{"step", "1"}};
    assert_true(rt_ckpt_save_step(dir, 1, a.ptr, N_CKPT, meta, 1, written, sizeof written));
    char resolved[1024];
    assert_true(rt_ckpt_resolve(dir, resolved, sizeof resolved));
    assert_string_equal(resolved, written);
    int64_t size0;
    uint8_t *before = read_all(written, &size0);

    /* a tensor that cannot be saved: nothing is written, the old file stays */
    Format keep = a.t[3].fmt;
    a.t[3].fmt.elem = FMT_VOID;
    rt_clear_error();
    assert_false(rt_ckpt_save(written, a.ptr, N_CKPT, meta, 1));
    assert_error_mentions(a.names[3], "no safetensors dtype");
    a.t[3].fmt = keep;
    /* the target cannot be replaced (a directory of that name): the temp file is removed */
    char blocked[1024];
    snprintf(blocked, sizeof blocked, "%s/step_000002.safetensors", dir);
    assert_int_equal(mkdir(blocked, 0777), 0);
    char inside[1100];
    snprintf(inside, sizeof inside, "%s/x", blocked);
    write_bytes(inside, "x", 1);
    rt_clear_error();
    assert_false(rt_ckpt_save_step(dir, 2, a.ptr, N_CKPT, meta, 1, NULL, 0));
    assert_error_mentions(blocked, "cannot write");
    assert_int_equal(count_entries(dir), 3);   /* step_000001, latest, the blocking directory */
    assert_true(rt_ckpt_resolve(dir, resolved, sizeof resolved));
    assert_string_equal(resolved, written);
    int64_t size1;
    uint8_t *after = read_all(written, &size1);
    assert_int_equal(size0, size1);
    assert_memory_equal(before, after, (size_t)size0);
    free(before);
    free(after);
    /* resolving a path that is not there names it */
    assert_false(rt_ckpt_resolve(tmp_path("nope"), resolved, sizeof resolved));
    assert_error_mentions("nope", "cannot read");
    free_tensors(&a);
}

/* Checkpoint files are created 0666 less the umask, like any file a tool writes (mkstemp's
 * 0600 made them unreadable to the group that shares a run directory). */
static void test_checkpoint_umask(void **state) {
    (void)state;
    TensorSet a;
    make_tensors(&a, true);
    CkptMeta meta[1] = {{"step", "1"}};
    mode_t masks[2] = {022, 027};
    for (int i = 0; i < 2; i++) {
        mode_t old = umask(masks[i]);
        char dir[512], path[600];
        snprintf(dir, sizeof dir, "%s/umask%d", tmp_dir, i);
        assert_true(rt_ckpt_save_step(dir, 1, a.ptr, N_CKPT, meta, 1, path, sizeof path));
        struct stat st;
        assert_int_equal(stat(path, &st), 0);
        assert_int_equal(st.st_mode & 0777, 0666 & ~masks[i]);
        snprintf(path, sizeof path, "%s/latest", dir);
        assert_int_equal(stat(path, &st), 0);
        assert_int_equal(st.st_mode & 0777, 0666 & ~masks[i]);
        umask(old);
    }
    free_tensors(&a);
}

/* A save is durable once it returns: the checkpoint and `latest` are synced before their
 * renames, and the directory after each, so a power cut cannot leave `latest` empty or naming
 * a file whose directory entry was lost. */
static void test_checkpoint_synced(void **state) {
    (void)state;
    TensorSet a;
    make_tensors(&a, true);
    CkptMeta meta[1] = {{"step", "1"}};
    char dir[512], path[600], real[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", tmp_path("durable"));
    assert_int_equal(mkdir(dir, 0777), 0);
    assert_non_null(realpath(dir, real));
    n_synced = 0;
    assert_true(rt_ckpt_save_step(dir, 7, a.ptr, N_CKPT, meta, 1, path, sizeof path));
    int dirs = 0, temps = 0, latest = 0;
    for (int i = 0; i < n_synced; i++) {
        dirs += strcmp(synced[i], real) == 0;
        temps += strstr(synced[i], "/.step_000007.safetensors.") != NULL;
        latest += strstr(synced[i], "/.latest.") != NULL;
    }
    if (dirs != 2 || temps != 1 || latest != 1) {
        for (int i = 0; i < n_synced; i++) print_message("synced %s\n", synced[i]);
        fail_msg("want the directory synced twice, the checkpoint and latest once each: %d %d %d",
                 dirs, temps, latest);
    }
    /* the last sync is the directory's, after latest's rename */
    assert_string_equal(synced[n_synced - 1], real);
    free_tensors(&a);
}

/* Before training, --out is made (with its parents) and proven writable by a probe file, and the
 * temp files that interrupted saves left there are removed; nothing else in it is touched. */
static void test_checkpoint_open_dir(void **state) {
    (void)state;
    char dir[512], path[700];
    snprintf(dir, sizeof dir, "%s", tmp_path("runs/x/ckpt"));
    int removed = -1;
    assert_true(rt_ckpt_open_dir(dir, &removed));
    assert_int_equal(removed, 0);
    assert_int_equal(count_entries(dir), 0);
    const char *stale[] = {".step_000003.safetensors.Ab12Cd", ".latest.XyZ123", ".probe.aaaaaa"};
    const char *kept[] = {".hidden", "notes.txt", ".latest.toolong1", "step_000001.safetensors",
                          ".step_x.safetensors.Ab12Cd", "latest"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, stale[i]);
        write_bytes(path, "x", 1);
    }
    for (size_t i = 0; i < 6; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, kept[i]);
        write_bytes(path, "x", 1);
    }
    assert_true(rt_ckpt_open_dir(dir, &removed));
    assert_int_equal(removed, 3);
    assert_int_equal(count_entries(dir), 6);
    for (size_t i = 0; i < 6; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, kept[i]);
        assert_int_equal(access(path, F_OK), 0);
    }
    /* a directory that cannot be made, and one where no file can be created */
    write_bytes(tmp_path("plain"), "x", 1);
    snprintf(path, sizeof path, "%s/ckpt", tmp_path("plain"));
    rt_clear_error();
    assert_false(rt_ckpt_open_dir(path, &removed));
    assert_error_mentions(path, "Not a directory");
    rt_clear_error();
    assert_false(rt_ckpt_open_dir("/proc/self", &removed));
    assert_error_mentions("/proc/self", "cannot create a file");
}

/* ---------------------------------------------------------------- the log */

/* Every write of the log is checked: a full disk (/dev/full) stops the run with one line naming
 * the file and the reason, at the step whose line was lost, not never. A log file is created
 * 0666 less the umask. */
static void test_log_write_errors(void **state) {
    (void)state;
    LogRecord r = {.step = 1, .steps = 2, .steps_width = 1, .loss = 5.5, .lr = 1e-3,
                   .grad_norm = 1.0, .tokens_per_s = 1000, .ms = 10, .mem_bytes = 1 << 20};
    RtLog l;
    mode_t old = umask(027);
    const char *path = tmp_path("log.jsonl");
    assert_true(rt_log_open(&l, path, false));
    assert_true(rt_log_step(&l, &r));
    assert_true(rt_log_close(&l));
    umask(old);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0640);

    assert_true(rt_log_open(&l, "/dev/full", false));
    rt_clear_error();
    assert_false(rt_log_step(&l, &r));
    assert_error_mentions("/dev/full", strerror(ENOSPC));
    rt_log_close(&l);
}

/* A resumed run repeats the steps after its checkpoint, so the log loses its lines of those
 * steps (and a line a crash cut short) before the run appends: each step is then logged once,
 * in order. */
static void test_log_trim(void **state) {
    (void)state;
    const char *path = tmp_path("resume.jsonl");
    char text[4096];
    size_t n = 0, keep = 0;
    int64_t at = 1 + (int64_t)(rng_next() % 5);
    for (int step = 1; step <= 6; step++) {
        n += (size_t)snprintf(text + n, sizeof text - n, "{\"step\":%d,\"loss\":%.9g}\n", step,
                              (double)(rng_next() % 1000) / 7);
        if (step == at) keep = n;
    }
    n += (size_t)snprintf(text + n, sizeof text - n, "{\"step\":7,\"lo");   /* cut by a crash */
    write_bytes(path, text, n);
    int dropped = -1;
    assert_true(rt_log_trim(path, at, &dropped));
    assert_int_equal(dropped, 7 - at);
    int64_t size;
    uint8_t *got = read_all(path, &size);
    assert_int_equal(size, (int64_t)keep);
    assert_memory_equal(got, text, keep);
    free(got);
    /* nothing to drop, no file, not a regular file: nothing changes */
    assert_true(rt_log_trim(path, at, &dropped));
    assert_int_equal(dropped, 0);
    assert_true(rt_log_trim(tmp_path("none.jsonl"), 3, &dropped));
    assert_int_equal(dropped, 0);
    assert_int_equal(access(tmp_path("none.jsonl"), F_OK), -1);
    assert_true(rt_log_trim("/dev/full", 3, &dropped));
    assert_int_equal(dropped, 0);
}

/* ---------------------------------------------------------------- flags and schedule */

static int parse(TrainOptions *o, ...) {
    char *argv[32] = {"train"};
    int argc = 1;
    va_list ap;
    va_start(ap, o);
    for (char *a; (a = va_arg(ap, char *));) argv[argc++] = a;
    va_end(ap);
    rt_clear_error();
    return rt_parse_args(argc, argv, o);
}

static void test_flags(void **state) {
    (void)state;
    TrainOptions o;
    assert_int_equal(parse(&o, "--data", "x.bin", "--steps=12", "--lr", "3e-3", "--warmup", "2",
                           "--grad-accum", "3", "--seed", "99", "--threads", "2", "--out", "d",
                           "--save-every", "4", NULL), RT_ARGS_OK);
    assert_int_equal(o.steps, 12);
    assert_true(fabs(o.lr - 3e-3) < 1e-15);
    assert_int_equal(o.grad_accum, 3);
    assert_true(o.seed_given && o.seed == 99);
    assert_int_equal(parse(&o, "--help", NULL), RT_ARGS_HELP);
    assert_false(o.overwrite);
    /* --overwrite takes no value */
    assert_int_equal(parse(&o, "--data", "x.bin", "--overwrite", "--steps", "3", NULL), RT_ARGS_OK);
    assert_true(o.overwrite);
    assert_int_equal(o.steps, 3);
    assert_int_equal(parse(&o, "--data", "x.bin", "--overwrite=yes", NULL), RT_ARGS_ERROR);
    assert_error_mentions("--overwrite", "no value");

    struct { const char *flag, *value, *want; } bad[] = {
        {"--steps", "0", "--steps 0"},          {"--steps", "12x", "--steps: '12x' is not a whole number"},
        {"--lr", "-1", "--lr -1"},               {"--lr", "nan", "--lr nan"},
        {"--lr", "0", "positive"},               {"--grad-accum", "0", "--grad-accum 0"},
        {"--device", "cuda", "cpu only"},        {"--threads", "100000", "--threads"},
        /* beyond the thread pool's limit, which asserts on it */
        {"--threads", "2000", "--threads 2000: expected an integer from 1 to 1024"},
        {"--eval-batches", "0", "--eval-batches"}, {"--bogus", "1", "unknown flag"},
        {"--stpes", "3", "--stpes: unknown flag; did you mean --steps?"},
        {"--grad_accum", "2", "did you mean --grad-accum?"},
        {"--warmpu=3", "1", "--warmpu: unknown flag; did you mean --warmup?"},
        {"--seed", "-3", "--seed -3"},           {"--min-lr", "-0.5", "--min-lr"},
        /* finite as doubles, not as the f32 the step is fed */
        {"--lr", "1e308", "--lr 1e308"},         {"--min-lr", "1e39", "--min-lr 1e39"},
        {"--lr", "1e-50", "--lr 1e-50"},         {"--lr", "inf", "--lr inf"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(parse(&o, "--data", "x.bin", bad[i].flag, bad[i].value, NULL),
                         RT_ARGS_ERROR);
        assert_error_mentions(bad[i].want, NULL);
    }
    assert_int_equal(parse(&o, "--steps", "5", NULL), RT_ARGS_ERROR);
    assert_error_mentions("--data is required", NULL);
    assert_int_equal(parse(&o, "--data", NULL), RT_ARGS_ERROR);
    assert_error_mentions("needs a value", NULL);
    assert_int_equal(parse(&o, "--data", "x", "--save-every", "3", NULL), RT_ARGS_ERROR);
    assert_error_mentions("--out", NULL);
    assert_int_equal(parse(&o, "--data", "x", "--steps", "5", "--warmup", "6", NULL), RT_ARGS_ERROR);
    assert_error_mentions("--warmup 6", NULL);
    assert_int_equal(parse(&o, "--data", "x", "--lr", "1e-3", "--min-lr", "1e-2", NULL),
                     RT_ARGS_ERROR);
    assert_int_equal(parse(&o, "--data", "x", "stray", NULL), RT_ARGS_ERROR);
    assert_error_mentions("stray", NULL);
}

/* Two TrainOptions the same, field by field. */
static void assert_same_options(const TrainOptions *a, const TrainOptions *b) {
    const char *const sa[] = {a->data, a->val, a->log, a->out, a->resume, a->init, a->export_hf,
                              a->prompt, a->logits, a->device, a->comm_file};
    const char *const sb[] = {b->data, b->val, b->log, b->out, b->resume, b->init, b->export_hf,
                              b->prompt, b->logits, b->device, b->comm_file};
    for (size_t i = 0; i < sizeof sa / sizeof sa[0]; i++) {
        assert_true(!sa[i] == !sb[i]);
        if (sa[i]) assert_string_equal(sa[i], sb[i]);
    }
    const int64_t ia[] = {a->eval_only, a->generate, a->top_k, a->steps, a->warmup, a->eval_every,
                          a->eval_batches, a->save_every, a->stop_at, a->grad_accum, a->threads,
                          (int64_t)a->seed, a->seed_given, a->steps_given, a->warmup_given,
                          a->grad_accum_given, a->overwrite, a->gpus, a->rank, a->world_size};
    const int64_t ib[] = {b->eval_only, b->generate, b->top_k, b->steps, b->warmup, b->eval_every,
                          b->eval_batches, b->save_every, b->stop_at, b->grad_accum, b->threads,
                          (int64_t)b->seed, b->seed_given, b->steps_given, b->warmup_given,
                          b->grad_accum_given, b->overwrite, b->gpus, b->rank, b->world_size};
    for (size_t i = 0; i < sizeof ia / sizeof ia[0]; i++) assert_int_equal(ia[i], ib[i]);
    assert_true(a->temperature == b->temperature && a->lr == b->lr && a->min_lr == b->min_lr &&
                a->comm_timeout == b->comm_timeout);
}

/* Every flag reads the same as `--flag value` and `--flag=value`; a flag given twice keeps its
 * last value; numbers are whole numbers or reals and nothing else; an abbreviation is refused
 * with the flag it abbreviates; `--` and words that are not flags are refused. */
static void test_flag_spellings(void **state) {
    (void)state;
    static const char *const lines[][40] = {
        {"--data", "x.bin", "--val", "v.bin", "--steps", "12", "--lr", "3e-3", "--warmup", "2",
         "--min-lr", "1e-4", "--grad-accum", "3", "--seed", "99", "--eval-every", "5",
         "--eval-batches", "2", "--log", "l.jsonl", "--out", "d", "--save-every", "4",
         "--stop-at", "6", "--threads", "2", "--device", "cpu", "--overwrite", NULL},
        {"--resume", "ck", "--generate", "5", "--prompt", "1 2", "--temperature", "0.5", "--top-k",
         "3", "--logits", "lg.bin", NULL},
        {"--init", "hf", "--export-hf", "out", "--overwrite", NULL},
        {"--resume", "ck", "--eval-only", "--val", "v.bin", NULL},
        {"--data", "x.bin", "--rank", "1", "--world-size", "2", "--comm-file", "c",
         "--comm-timeout", "30", NULL},
        {"--data", "x.bin", "--gpus", "2", NULL},
    };
    for (size_t k = 0; k < sizeof lines / sizeof lines[0]; k++) {
        char *spaced[42] = {"train"}, *joined[42] = {"train"}, buf[40][128];
        int ns = 1, nj = 1;
        for (int i = 0; lines[k][i]; i++) {
            const char *w = lines[k][i], *next = lines[k][i + 1];
            spaced[ns++] = (char *)w;
            bool takes = strcmp(w, "--overwrite") && strcmp(w, "--eval-only");
            if (takes && next) {
                snprintf(buf[i], sizeof buf[i], "%s=%s", w, next);
                joined[nj++] = buf[i];
                spaced[ns++] = (char *)next;
                i++;
            } else {
                joined[nj++] = (char *)w;
            }
        }
        TrainOptions a, b;
        rt_clear_error();
        int ra = rt_parse_args(ns, spaced, &a);
        if (ra != RT_ARGS_OK) fail_msg("line %zu: %s", k, rt_last_error());
        assert_int_equal(rt_parse_args(nj, joined, &b), RT_ARGS_OK);
        assert_same_options(&a, &b);
    }
    TrainOptions o, p;
    /* given twice: the last value */
    assert_int_equal(parse(&o, "--data", "a", "--steps", "3", "--data=b", "--steps=7", NULL), RT_ARGS_OK);
    assert_string_equal(o.data, "b");
    assert_int_equal(o.steps, 7);
    assert_int_equal(parse(&p, "--data", "b", "--steps", "7", NULL), RT_ARGS_OK);
    assert_same_options(&o, &p);

    struct { const char *const args[4]; const char *want; } bad[] = {
        {{"--steps", NULL}, "--steps needs a value (see --help)"},
        {{"--steps", "abc", NULL}, "--steps: 'abc' is not a whole number"},
        {{"--steps", " 5", NULL}, "--steps: ' 5' is not a whole number"},
        {{"--steps", "+5", NULL}, "--steps: '+5' is not a whole number"},
        {{"--steps", "1e3", NULL}, "--steps: '1e3' is not a whole number"},
        {{"--steps=", NULL}, "--steps: '' is not a whole number"},
        {{"--seed", "0x10", NULL}, "--seed: '0x10' is not a whole number"},
        {{"--seed", "99999999999999999999", NULL}, "--seed 99999999999999999999: expected an integer >= 0"},
        {{"--lr", "abc", NULL}, "--lr: 'abc' is not a number"},
        {{"--lr", " 1", NULL}, "--lr: ' 1' is not a number"},
        {{"--lr", "1e-3x", NULL}, "--lr: '1e-3x' is not a number"},
        {{"--ste", "3", NULL}, "--ste: unknown flag; did you mean --steps? (see --help)"},
        {{"--eval=3", NULL}, "--eval: unknown flag"},   /* --eval-every, --eval-batches, --eval-only */
        {{"--grad=2", NULL}, "--grad: unknown flag; did you mean --grad-accum?"},
        {{"--help=1", NULL}, "--help takes no value: --help=1"},
        {{"--", "--steps", "3", NULL}, "--: unknown flag"},
        {{"-x", NULL}, "-x: unexpected argument (flags start with --"},
        {{"--steps", "3", "stray", NULL}, "stray: unexpected argument"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *const *w = bad[i].args;
        if (parse(&o, "--data", "x.bin", w[0], w[1], w[2], w[3], NULL) != RT_ARGS_ERROR)
            fail_msg("%s %s: not refused", w[0], w[1] ? w[1] : "");
        assert_error_mentions(bad[i].want, NULL);
    }
}

/* The strict numbers of both command lines. */
static void test_cli_numbers(void **state) {
    (void)state;
    int64_t v = (int64_t)rng_next();
    int64_t n = (int64_t)(rng_next() % 1000000);
    char text[32];
    snprintf(text, sizeof text, "%lld", (long long)-n);
    assert_true(rt_cli_int(text, &v) && v == -n);
    assert_true(rt_cli_int("007", &v) && v == 7);
    assert_true(rt_cli_int("9223372036854775807", &v) && v == INT64_MAX && errno == 0);
    assert_true(rt_cli_int("99999999999999999999", &v) && v == INT64_MAX && errno == ERANGE);
    assert_true(rt_cli_int("-99999999999999999999", &v) && v == INT64_MIN && errno == ERANGE);
    static const char *const not_whole[] = {"", "-", "+1", " 1", "1 ", "1.0", "1e3", "0x10", "1_000", "--1"};
    for (size_t i = 0; i < sizeof not_whole / sizeof not_whole[0]; i++)
        if (rt_cli_int(not_whole[i], &v)) fail_msg("'%s' read as a whole number", not_whole[i]);
    double x;
    assert_true(rt_cli_real("6e-4", &x) && x == 6e-4);
    assert_true(rt_cli_real("-2.5", &x) && x == -2.5);
    static const char *const not_real[] = {"", " 1", "1 ", "1e", "abc", "1,5"};
    for (size_t i = 0; i < sizeof not_real / sizeof not_real[0]; i++)
        if (rt_cli_real(not_real[i], &x)) fail_msg("'%s' read as a number", not_real[i]);
}

/* A skipped step under delayed scaling halves every delayed scale and replaces the non-finite
 * amax entries of its history by twice the largest finite one; finite entries stay. */
static void test_scales_back_off(void **state) {
    (void)state;
    float s0 = 0.5f + (float)(rng_next() % 1000), s1 = 3.0f;
    float h0[4] = {INFINITY, 3.0f, 5.0f, NAN}, h1[3] = {0.25f, 0.5f, 0.125f};
    Tensor t[4] = {
        {.rank = 0, .fmt = fmt_plain(FMT_F32), .data = &s0},
        {.rank = 1, .dims = {4}, .fmt = fmt_plain(FMT_F32), .data = h0},
        {.rank = 0, .fmt = fmt_plain(FMT_F32), .data = &s1},
        {.rank = 1, .dims = {3}, .fmt = fmt_plain(FMT_F32), .data = h1},
    };
    float want_s0 = s0 / 2;
    Tensor *pairs[4] = {&t[0], &t[1], &t[2], &t[3]};
    rt_scales_back_off(pairs, 2);
    assert_true(s0 == want_s0 && s1 == 1.5f);
    assert_true(h0[0] == 10.0f && h0[1] == 3.0f && h0[2] == 5.0f && h0[3] == 10.0f);
    assert_true(h1[0] == 0.25f && h1[1] == 0.5f && h1[2] == 0.125f);
}

static void test_lr_schedule(void **state) {
    (void)state;
    double peak = 1e-3 * (1 + (double)(rng_next() % 100) / 10), floor = peak / 10;
    int64_t warmup = 1 + (int64_t)(rng_next() % 20), steps = warmup + 10 + (int64_t)(rng_next() % 100);
    for (int64_t s = 0; s < warmup; s++)
        assert_true(fabs(rt_lr_at(peak, floor, warmup, steps, s) - peak * (s + 1) / warmup) < 1e-15);
    assert_true(fabs(rt_lr_at(peak, floor, warmup, steps, warmup) - peak) < 1e-15);
    for (int64_t s = warmup + 1; s < steps; s++)
        assert_true(rt_lr_at(peak, floor, warmup, steps, s) <= rt_lr_at(peak, floor, warmup, steps, s - 1));
    assert_true(fabs(rt_lr_at(peak, floor, warmup, steps, steps - 1) - floor) < 1e-15);
}

/* ---------------------------------------------------------------- arenas */

static void test_memory_bind(void **state) {
    (void)state;
    Arena *arena = arena_new();
    Graph *g = ir_graph_new(arena);
    SrcLoc loc = {0};
    int64_t dims[2] = {3 + (int64_t)(rng_next() % 5), 4};
    Node *w = ir_leaf(g, OP_PARAM, "w", ROLE_PARAM, FMT_F32, 2, dims, loc);
    Node *m = ir_leaf(g, OP_STATE, "w:adam_m", ROLE_ADAM_M, FMT_BF16, 2, dims, loc);
    Node *x = ir_leaf(g, OP_INPUT, "x", ROLE_INPUT, FMT_F32, 2, dims, loc);
    int64_t wb = dims[0] * dims[1] * 4;
    w->t.offset = 0;
    m->t.offset = wb;
    x->t.offset = 0;
    g->persistent_bytes = wb + dims[0] * dims[1] * 2;
    g->transient_bytes = wb;
    RtMemory mem;
    assert_true(rt_memory_bind(g, &mem));
    assert_ptr_equal(w->t.data, mem.persistent);
    assert_ptr_equal(m->t.data, (char *)mem.persistent + wb);
    assert_ptr_equal(x->t.data, mem.step);
    rt_memory_free(&mem);
    /* a plan whose arena is smaller than its tensors is refused with the tensor's name */
    g->persistent_bytes -= 1;
    rt_clear_error();
    assert_false(rt_memory_bind(g, &mem));
    assert_error_mentions("w:adam_m", "arena");
    arena_free(arena);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_shard_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_uint32, setup, teardown),
        cmocka_unit_test_setup_teardown(test_json, setup, teardown),
        cmocka_unit_test_setup_teardown(test_json_quote, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shard_set_holds_batch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_non_regular_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_byte_tokenizer_and_split, setup, teardown),
        cmocka_unit_test_setup_teardown(test_batches, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_corruption, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_non_finite, setup, teardown),
        cmocka_unit_test_setup_teardown(test_safetensors_huge_shape, setup, teardown),
        cmocka_unit_test_setup_teardown(test_safetensors_header, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_failed_save, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_umask, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_synced, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_open_dir, setup, teardown),
        cmocka_unit_test_setup_teardown(test_log_write_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_log_trim, setup, teardown),
        cmocka_unit_test_setup_teardown(test_flags, setup, teardown),
        cmocka_unit_test_setup_teardown(test_flag_spellings, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cli_numbers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lr_schedule, setup, teardown),
        cmocka_unit_test_setup_teardown(test_scales_back_off, setup, teardown),
        cmocka_unit_test_setup_teardown(test_memory_bind, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
