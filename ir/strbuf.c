/* strbuf.c — a growable string: text built a piece at a time.
 *
 * Three writers build text whose length they cannot know in advance: the safetensors header
 * (runtime/checkpoint.c) and the two CUDA renderers (cuda/render.c, cuda/cg_render.c, whose
 * modules run to hundreds of kilobytes). They share this one buffer. It lives on the heap,
 * not in an arena, because the runtime writes checkpoints without one and a renderer copies
 * its finished text where it belongs. The text is always NUL-terminated. Running out of memory
 * does not abort: the buffer marks itself failed, ignores what follows, and the caller decides
 * what that means (the checkpoint writer reports it; the renderers treat it as a bug). A
 * formatted piece is never truncated, however long. */
#include "ir.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

void strbuf_addn(StrBuf *b, const char *s, size_t n)
{
    if (b->failed) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap) cap *= 2;
        char *grown = realloc(b->buf, cap);
        if (!grown) {
            b->failed = true;
            return;
        }
        b->buf = grown;
        b->cap = cap;
    }
    memcpy(b->buf + b->len, s, n);
    b->len += n;
    b->buf[b->len] = 0;
}

void strbuf_add(StrBuf *b, const char *s) { strbuf_addn(b, s, strlen(s)); }

void strbuf_vprintf(StrBuf *b, const char *fmt, va_list ap)
{
    char small[512];
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    if (n < 0) {
        b->failed = true;
    } else if ((size_t)n < sizeof small) {
        strbuf_addn(b, small, (size_t)n);
    } else {
        char *big = malloc((size_t)n + 1);
        if (big) {
            vsnprintf(big, (size_t)n + 1, fmt, again);
            strbuf_addn(b, big, (size_t)n);
            free(big);
        } else {
            b->failed = true;
        }
    }
    va_end(again);
}

void strbuf_printf(StrBuf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    strbuf_vprintf(b, fmt, ap);
    va_end(ap);
}

const char *strbuf_text(const StrBuf *b) { return b->buf ? b->buf : ""; }

void strbuf_free(StrBuf *b)
{
    free(b->buf);
    *b = (StrBuf){0};
}
