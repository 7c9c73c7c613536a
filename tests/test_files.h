/* test_files.h — what the tests that write files share: their temporary directory (tmp_dir,
 * made by the test's setup), removing it with everything in it, reading a file of it whole, and
 * running a command with its output kept there. Included after cmocka.h by one .c file each (static definitions). */
#ifndef FP8C_TEST_FILES_H
#define FP8C_TEST_FILES_H

#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmp_dir[256];

/* path and, if it is a directory, everything below it; links are removed, not followed */
static inline void remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char child[1024];
            if (snprintf(child, sizeof child, "%s/%s", path, e->d_name) >= (int)sizeof child) continue;
            remove_tree(child);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

/* A file whole, NUL-terminated, its length in *size when size is not NULL; NULL when it cannot be
 * read. read_tmp: a file of tmp_dir, the test failing when it cannot be read. */
static inline char *read_path(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
    fclose(f);
    if (buf) buf[n] = 0;
    if (size) *size = buf ? (size_t)n : 0;
    return buf;
}

static char *read_tmp(const char *name, size_t *size) __attribute__((unused));
static char *read_tmp(const char *name, size_t *size) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    char *s = read_path(path, size);
    if (!s) fail_msg("cannot read %s", path);
    return s;
}

/* Runs a shell command with stdout and stderr into tmp_dir/NAME.out; returns the exit status. */
static int run(const char *name, const char *fmt, ...) __attribute__((format(printf, 2, 3), unused));
static int run(const char *name, const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    snprintf(cmd + n, sizeof cmd - (size_t)n, " >%s/%s.out 2>&1", tmp_dir, name);
    int status = system(cmd);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

#endif
