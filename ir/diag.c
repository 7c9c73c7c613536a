/* diag.c — user-facing diagnostics.
 *
 * Errors in a model file (or a textual IR file) are the user's, not the compiler's: they are
 * collected, not fatal, so one run can report several. Each is printed as
 *     file:line:col: error: message
 *         source line
 *                ^
 * which editors and terminals understand. The source text of every file is registered when it
 * is read so that the offending line can be shown; a location with line 0 (the command line)
 * prints without a source line. Compiler bugs do not come here: they go to ir_die. */
#include "ir.h"

#include <stdlib.h>
#include <string.h>

typedef struct Source {
    struct Source *next;
    char *file, *text;
} Source;

static Source *sources;
static int error_count;
static FILE *diag_out;

void diag_register_source(const char *file, const char *text)
{
    for (Source *s = sources; s; s = s->next)
        if (strcmp(s->file, file) == 0) {
            free(s->text);
            s->text = strdup(text);
            return;
        }
    Source *s = calloc(1, sizeof *s);
    if (!s) ir_die(__FILE__, __LINE__, "out of memory");
    s->file = strdup(file);
    s->text = strdup(text);
    s->next = sources;
    sources = s;
}

void diag_set_stream(FILE *out) { diag_out = out; }
int diag_error_count(void) { return error_count; }
void diag_reset(void) { error_count = 0; }

static const char *source_line(const char *file, int line, int *len)
{
    for (Source *s = sources; s; s = s->next) {
        if (strcmp(s->file, file) != 0) continue;
        const char *p = s->text;
        for (int l = 1; l < line && p; l++) {
            p = strchr(p, '\n');
            if (p) p++;
        }
        if (!p) return NULL;
        const char *e = strchr(p, '\n');
        *len = e ? (int)(e - p) : (int)strlen(p);
        return p;
    }
    return NULL;
}

static void diag_vprint(SrcLoc loc, const char *kind, const char *fmt, va_list ap)
{
    FILE *out = diag_out ? diag_out : stderr;
    if (loc.file && loc.line > 0)
        fprintf(out, "%s:%d:%d: %s: ", loc.file, loc.line, loc.col, kind);
    else if (loc.file)
        fprintf(out, "%s: %s: ", loc.file, kind);
    else
        fprintf(out, "fp8c: %s: ", kind);
    vfprintf(out, fmt, ap);
    fputc('\n', out);
    int len = 0;
    const char *line = loc.file && loc.line > 0 ? source_line(loc.file, loc.line, &len) : NULL;
    if (line) {
        fprintf(out, "    %.*s\n    ", len, line);
        /* keep tabs so that the caret lines up under the same text */
        for (int i = 0; i < loc.col - 1 && i < len; i++) fputc(line[i] == '\t' ? '\t' : ' ', out);
        fputs("^\n", out);
    }
    fflush(out);
}

void diag_error(SrcLoc loc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    diag_vprint(loc, "error", fmt, ap);
    va_end(ap);
    error_count++;
}

void diag_note(SrcLoc loc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    diag_vprint(loc, "note", fmt, ap);
    va_end(ap);
}

_Noreturn void ir_die(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fp8c: internal error at %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}
