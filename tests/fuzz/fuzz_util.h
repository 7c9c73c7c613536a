/* fuzz_util.h — what every harness shares: a private temporary directory for the inputs that
 * the code under test reads from a file, and quiet error streams (a message per input would
 * cost more than the parse). Included by one harness per executable, so everything is static. */
#ifndef FP8C_FUZZ_UTIL_H
#define FP8C_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Inputs larger than this are skipped: every reader is linear in its input, and libFuzzer finds
 * more with short inputs than with long ones. */
#define FUZZ_MAX_INPUT (64 * 1024)

static char fuzz_dir[64];
static char fuzz_path[96];

static inline void fuzz_cleanup(void) {
    if (fuzz_path[0]) unlink(fuzz_path);
    if (fuzz_dir[0]) rmdir(fuzz_dir);
}

/* The file a harness writes its input to, in a directory of its own under TMPDIR, else
 * /dev/shm, else /tmp, removed at exit. Memory first: creating and truncating a file on a disk
 * can take half a millisecond, 30 times what parsing it takes. */
static inline const char *fuzz_file(const char *name) {
    if (!fuzz_dir[0]) {
        const char *tmp = getenv("TMPDIR");
        if (!tmp || !*tmp) tmp = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(fuzz_dir, sizeof fuzz_dir, "%s/fp8c-fuzz-XXXXXX", tmp);
        if (!mkdtemp(fuzz_dir)) {
            perror("mkdtemp");
            abort();
        }
        snprintf(fuzz_path, sizeof fuzz_path, "%s/%s", fuzz_dir, name);
        atexit(fuzz_cleanup);
    }
    return fuzz_path;
}

static inline const char *fuzz_write(const char *name, const uint8_t *data, size_t size) {
    const char *path = fuzz_file(name);
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0) {
        perror(path);
        abort();
    }
    return path;
}

/* The input as a NUL-terminated string (malloc'ed; free it). */
static inline char *fuzz_text(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) abort();
    memcpy(text, data, size);
    text[size] = '\0';
    return text;
}

/* Where the code under test writes its messages: nowhere, unless FP8C_FUZZ_VERBOSE is set (to
 * read why a reproduced input fails). */
static inline FILE *fuzz_null(void) {
    static FILE *null;
    if (!null && getenv("FP8C_FUZZ_VERBOSE")) null = stderr;
    if (!null) null = fopen("/dev/null", "w");
    if (!null) abort();
    return null;
}

#endif
