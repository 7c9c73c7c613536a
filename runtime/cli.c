/* cli.c — the command lines of fp8c and of the training binary, read one way.
 *
 * Both programs describe their flags as a table, one row per flag: its name, whether it takes a
 * value, what it sets and its help text. From that one table come getopt_long's options, the
 * --help lines and the candidates of "did you mean", so a flag added to the table is parsed,
 * listed and suggested at once, and the three cannot drift apart.
 *
 * The parsing itself is glibc's getopt_long, so both programs write flags as people expect:
 * `--flag value` and `--flag=value`, short flags with the value attached or not (`-o NAME`,
 * `-DNAME=V`). Its own messages are switched off (opterr, and ':' first in the short options)
 * and each program prints one line of its own instead. Three choices are made here:
 *
 * - Order is kept (POSIXLY_CORRECT-style, '+' first): getopt stops at a word that is not a
 *   flag, which rt_cli_next hands back as a word and then goes on. Nothing is permuted, so argv
 *   stays as the user wrote it (fp8c keys its binary cache by it), and `--` ends the flags:
 *   what follows is handed back whole (fp8c train passes it to the training binary).
 * - Abbreviations are refused. getopt_long takes any unambiguous prefix (`--ste` for
 *   `--steps`); a prefix that works today can become ambiguous when a flag is added, and a
 *   script that used it would then break, so a flag is its whole name, and a prefix gets the
 *   flag it abbreviates as its suggestion.
 * - A flag given twice is the parser's business (most take the last; fp8c refuses two
 *   --recipe): rt_cli_next counts each flag it reads, in RtCli.seen.
 *
 * getopt keeps its state in globals, so one command line is read at a time; rt_cli_begin
 * starts afresh (optind = 0), which also lets tests and the fuzz harnesses read many. Numbers
 * are read strictly: a whole number is digits with an optional '-', nothing before or after. */
#include <errno.h>
#include <float.h>
#include <getopt.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "rt.h"

_Static_assert(RT_ARG_NONE == no_argument && RT_ARG_VALUE == required_argument &&
               RT_ARG_ATTACHED == optional_argument, "RtFlag.has_arg is getopt's has_arg");

enum { CLI_NAME_LEN = 40 };

/* getopt_long's view of the table being read (getopt itself is global state too) */
static struct option cli_longs[RT_CLI_MAX + 1];
static char cli_shorts[3 * RT_CLI_MAX + 3];

static bool cli_is_end(const RtFlag *f) { return !f->name && !f->letter && !f->help; }
static bool cli_is_flag(const RtFlag *f) { return f->kind != RT_FLAG_HEADING; }

/* The value getopt returns for row i: its letter, or a number above every letter. */
static int cli_val(const RtFlag *f, int i) { return f->letter ? f->letter : 256 + i; }

static const RtFlag *cli_row_of_val(const RtFlag *flags, int val) {
    for (int i = 0; !cli_is_end(&flags[i]); i++)
        if (cli_is_flag(&flags[i]) && cli_val(&flags[i], i) == val) return &flags[i];
    return NULL;
}

void rt_cli_begin(RtCli *c, const RtFlag *flags, int argc, char **argv) {
    memset(c, 0, sizeof *c);
    c->flags = flags;
    c->argc = argc;
    c->argv = argv;
    int n = 0, k = 0;
    cli_shorts[k++] = '+';   /* keep order: stop at the first word that is not a flag */
    cli_shorts[k++] = ':';   /* a missing value is ':', not '?' (and no message of getopt's) */
    for (int i = 0; !cli_is_end(&flags[i]); i++) {
        const RtFlag *f = &flags[i];
        if (!cli_is_flag(f)) continue;
        if (i >= RT_CLI_MAX) abort();   /* a table longer than RT_CLI_MAX: raise it */
        if (f->name) cli_longs[n++] = (struct option){f->name, f->has_arg, NULL, cli_val(f, i)};
        if (f->letter) {
            cli_shorts[k++] = (char)f->letter;
            for (int a = 0; a < f->has_arg; a++) cli_shorts[k++] = ':';
        }
    }
    cli_longs[n] = (struct option){0};
    cli_shorts[k] = 0;
    optind = 0;   /* glibc: start a new scan */
    opterr = 0;
}

/* The nearest named flag to `name`, as "--flag" (static storage, until the next call). */
const char *rt_cli_nearest(const RtFlag *flags, const char *name) {
    static char names[RT_CLI_MAX][CLI_NAME_LEN];
    const char *list[RT_CLI_MAX + 1];
    int n = 0;
    for (int i = 0; !cli_is_end(&flags[i]) && n < RT_CLI_MAX; i++)
        if (cli_is_flag(&flags[i]) && flags[i].name) {
            snprintf(names[n], sizeof names[n], "--%s", flags[i].name);
            list[n] = names[n];
            n++;
        }
    list[n] = NULL;
    return rt_nearest_word(name, list);
}

/* c->name: the flag of word as written, without "=value". */
static void cli_set_name(RtCli *c, const char *word) {
    snprintf(c->name, sizeof c->name, "%.*s", (int)strcspn(word, "="), word);
}

int rt_cli_next(RtCli *c) {
    c->flag = NULL;
    c->value = c->word = c->near = NULL;
    c->name[0] = 0;
    int at = optind > 0 ? optind : 1;   /* the word getopt is about to read */
    if (at >= c->argc) return RT_CLI_END;
    int index = -1;
    int got = getopt_long(c->argc, c->argv, cli_shorts, cli_longs, &index);
    c->word = c->argv[at];
    if (got == -1) {
        if (optind > at) {   /* "--": the rest is not ours */
            c->rest = optind;
            return RT_CLI_REST;
        }
        if (optind >= c->argc) return RT_CLI_END;
        c->value = c->word = c->argv[optind++];
        return RT_CLI_WORD;
    }
    cli_set_name(c, c->word);
    if (got == '?' || got == ':') {
        const RtFlag *f = optopt ? cli_row_of_val(c->flags, optopt) : NULL;
        if (f && got == ':') {
            c->flag = f;
            return RT_CLI_MISSING;
        }
        if (f && !strncmp(c->word, "--", 2)) {   /* a switch given a value */
            c->flag = f;
            return RT_CLI_NO_VALUE;
        }
        if (strncmp(c->word, "--", 2) || !c->word[2]) snprintf(c->name, sizeof c->name, "%s", c->word);
        c->near = rt_cli_nearest(c->flags, c->name);
        return RT_CLI_UNKNOWN;
    }
    const RtFlag *f = cli_row_of_val(c->flags, got);
    if (!f) abort();   /* getopt returned a value the table did not give it */
    if (index >= 0) {   /* a long flag: its whole name, not a prefix of it */
        size_t len = strlen(f->name);
        if (strncmp(c->word + 2, f->name, len) || (c->word[2 + len] && c->word[2 + len] != '=')) {
            static char full[CLI_NAME_LEN];
            snprintf(full, sizeof full, "--%s", f->name);
            c->near = full;
            return RT_CLI_UNKNOWN;
        }
    }
    c->flag = f;
    c->value = optarg;
    c->seen[f - c->flags]++;
    return RT_CLI_FLAG;
}

int rt_cli_seen(const RtCli *c, const char *name) {
    for (int i = 0; !cli_is_end(&c->flags[i]); i++)
        if (cli_is_flag(&c->flags[i]) && c->flags[i].name && !strcmp(c->flags[i].name, name))
            return c->seen[i];
    return 0;
}

/* "--data FILE", "-o NAME", "-O0..3" (a value that must be attached is written attached). */
static void cli_left(const RtFlag *f, char *out, size_t len) {
    const char *v = f->value ? f->value : "";
    if (f->name)
        snprintf(out, len, "--%s%s%s", f->name, *v ? f->has_arg == RT_ARG_ATTACHED ? "=" : " " : "", v);
    else
        snprintf(out, len, "-%c%s%s", f->letter, *v && f->has_arg != RT_ARG_ATTACHED ? " " : "", v);
}

void rt_cli_help(FILE *out, const RtFlag *flags, int width) {
    for (int i = 0; !cli_is_end(&flags[i]); i++) {
        const RtFlag *f = &flags[i];
        if (!cli_is_flag(f)) {
            fprintf(out, "%s\n", f->help);
            continue;
        }
        if (!f->help) continue;   /* parsed, not listed */
        char left[64];
        cli_left(f, left, sizeof left);
        if ((int)strlen(left) < width) fprintf(out, "  %-*s", width, left);
        else fprintf(out, "  %s\n  %*s", left, width, "");
        for (const char *p = f->help;;) {   /* each line of the help under the first */
            size_t n = strcspn(p, "\n");
            fprintf(out, "%.*s\n", (int)n, p);
            if (!p[n]) break;
            p += n + 1;
            fprintf(out, "  %*s", width, "");
        }
    }
}

/* ---------------------------------------------------------------- values */

bool rt_cli_int(const char *text, int64_t *v) {
    errno = 0;
    const char *p = text + (text[0] == '-');
    if (!*p) return false;
    for (const char *q = p; *q; q++)
        if (*q < '0' || *q > '9') return false;
    *v = strtoll(text, NULL, 10);   /* beyond int64: INT64_MIN or INT64_MAX, errno ERANGE */
    return true;
}

bool rt_cli_real(const char *text, double *v) {
    if (!*text || strchr(" \t\n\v\f\r", text[0])) return false;
    char *end;
    errno = 0;
    double x = strtod(text, &end);
    if (*end) return false;
    *v = x;   /* out of range (errno ERANGE) is for the caller's range to refuse */
    return true;
}

/* A value of a typed row stored where the row says, or false after one rt_error line. The
 * real values are the training step's hyper-parameters, fed to it as f32: they must be finite
 * as an f32, not only as a double (--lr 1e308 would reach the update as infinity and --lr
 * 1e-50 as zero). */
bool rt_cli_store(const RtFlag *f, const char *value, void *base) {
    char *field = (char *)base + f->offset;
    char flag[CLI_NAME_LEN];
    if (f->name) snprintf(flag, sizeof flag, "--%s", f->name);
    else snprintf(flag, sizeof flag, "-%c", f->letter);
    switch (f->kind) {
    case RT_FLAG_TRUE:
        *(bool *)field = true;
        return true;
    case RT_FLAG_TEXT:
        if (!*value) {
            rt_error("%s: empty value", flag);
            return false;
        }
        *(const char **)field = value;
        return true;
    case RT_FLAG_INT:
    case RT_FLAG_INT32: {
        int64_t v;
        if (!rt_cli_int(value, &v)) {
            rt_error("%s: '%s' is not a whole number", flag, value);
            return false;
        }
        if (v < f->lo || v > f->hi || errno == ERANGE) {
            if (f->hi == INT64_MAX)
                rt_error("%s %s: expected an integer >= %lld", flag, value, (long long)f->lo);
            else
                rt_error("%s %s: expected an integer from %lld to %lld", flag, value,
                         (long long)f->lo, (long long)f->hi);
            return false;
        }
        if (f->kind == RT_FLAG_INT32) *(int *)field = (int)v;
        else *(int64_t *)field = v;
        return true;
    }
    case RT_FLAG_REAL: {
        bool positive = f->lo > 0;
        double v;
        if (!rt_cli_real(value, &v)) {
            rt_error("%s: '%s' is not a number", flag, value);
            return false;
        }
        if (!isfinite(v) || v < 0 || (positive && v == 0)) {
            rt_error("%s %s: expected a %s number", flag, value, positive ? "positive" : "non-negative");
            return false;
        }
        if (!isfinite((float)v) || (positive && (float)v == 0)) {
            rt_error("%s %s: expected a %s number within f32's range (%g to %g)", flag, value,
                     positive ? "positive" : "non-negative", (double)FLT_TRUE_MIN, (double)FLT_MAX);
            return false;
        }
        *(double *)field = v;
        return true;
    }
    case RT_FLAG_HEADING:
    case RT_FLAG_BY_ID:
        break;
    }
    abort();   /* a row the parser sets itself */
}
