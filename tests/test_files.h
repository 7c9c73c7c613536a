/* test_files.h — what the tests that write files share: their temporary directory (tmp_dir,
 * made by the test's setup), removing it with everything in it, and running a command with its
 * output kept there. Included after cmocka.h by one .c file each (static definitions). */
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
