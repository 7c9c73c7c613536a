/* tokenize.c — text to llm.c token shards with the byte-level tokenizer.
 *
 *   fp8c-tokenize [--val-fraction F] [--shard-tokens N] TEXT OUT_PREFIX
 *
 * writes OUT_PREFIX_val.bin (the last F of the text, default 0.05 — the same split the training
 * binary makes when it is given text and no --val) and OUT_PREFIX_train_000000.bin, ... (the
 * rest, at most N tokens per shard, default 100M). The training binary reads text directly, so
 * this tool is only needed where shards are wanted: to share them with llm.c-format tooling, to
 * read the data faster, or to fix the split once for several runs. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

static void usage(FILE *out) {
    fprintf(out, "usage: fp8c-tokenize [--val-fraction F] [--shard-tokens N] TEXT OUT_PREFIX\n"
                 "Byte-level tokens (token = byte, vocabulary 256) into llm.c .bin shards:\n"
                 "OUT_PREFIX_val.bin (the last F of the text, default 0.05) and\n"
                 "OUT_PREFIX_train_NNNNNN.bin (at most N tokens each, default 100000000).\n");
}

int main(int argc, char **argv) {
    rt_set_program_name(argv[0]);
    double val_fraction = 0.05;
    long long shard_tokens = 100000000;
    const char *pos[2] = {0};
    int n_pos = 0;
    for (int i = 1; i < argc; i++) {
        char *end = NULL;
        if (!strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--val-fraction") && i + 1 < argc) {
            errno = 0;
            val_fraction = strtod(argv[++i], &end);
            if (*end || errno || !(val_fraction >= 0 && val_fraction < 1)) {
                rt_error("--val-fraction %s: expected a number in [0, 1)", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--shard-tokens") && i + 1 < argc) {
            errno = 0;
            shard_tokens = strtoll(argv[++i], &end, 10);
            if (*end || errno || shard_tokens < 1 || shard_tokens > UINT32_MAX) {
                rt_error("--shard-tokens %s: expected an integer from 1 to %u", argv[i],
                         UINT32_MAX);
                return 2;
            }
        } else if (argv[i][0] == '-' && argv[i][1]) {
            rt_error("%s: unknown flag or missing value (see --help)", argv[i]);
            return 2;
        } else if (n_pos < 2) {
            pos[n_pos++] = argv[i];
        } else {
            rt_error("%s: unexpected argument (see --help)", argv[i]);
            return 2;
        }
    }
    if (n_pos != 2) {
        usage(stderr);
        return 2;
    }
    int64_t n = 0;
    uint8_t *text = rt_read_file(pos[0], &n);
    if (!text) return 1;
    if (n == 0) {
        rt_error("%s: empty file", pos[0]);
        return 1;
    }
    uint16_t *tok = malloc((size_t)n * sizeof *tok);
    if (!tok) {
        rt_error("%s: cannot allocate memory for %lld tokens", pos[0], (long long)n);
        return 1;
    }
    rt_byte_tokenize(text, n, tok);
    free(text);

    int64_t n_val = (int64_t)((double)n * val_fraction), n_train = n - n_val;
    size_t len = strlen(pos[1]) + 32;
    char *path = malloc(len);
    int status = 0;
    if (n_val > 0) {
        snprintf(path, len, "%s_val.bin", pos[1]);
        if (!rt_data_write_shard(path, tok + n_train, n_val)) status = 1;
        else printf("%s: %lld tokens\n", path, (long long)n_val);
    }
    for (int64_t at = 0, k = 0; status == 0 && at < n_train; at += shard_tokens, k++) {
        int64_t count = n_train - at < shard_tokens ? n_train - at : shard_tokens;
        snprintf(path, len, "%s_train_%06lld.bin", pos[1], (long long)k);
        if (!rt_data_write_shard(path, tok + at, count)) status = 1;
        else printf("%s: %lld tokens\n", path, (long long)count);
    }
    free(path);
    free(tok);
    return status;
}
