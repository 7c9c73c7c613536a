/* arena.c — one allocation region per compilation.
 *
 * The compiler builds thousands of nodes, names and small arrays and never frees any of them
 * before the compilation ends, so they all come from one bump allocator and are released
 * together (chibicc and QBE do the same). Chunks grow geometrically; a request larger than a
 * chunk gets a chunk of its own. Memory is zeroed, so a fresh Node is all defaults. */
#include "ir.h"

#include <stdlib.h>
#include <string.h>

typedef struct Chunk {
    struct Chunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
} Chunk;

struct Arena {
    Chunk *head;
    size_t next_size;
};

Arena *arena_new(void)
{
    Arena *a = calloc(1, sizeof *a);
    if (!a) ir_die(__FILE__, __LINE__, "out of memory");
    a->next_size = 64 * 1024;
    return a;
}

void arena_free(Arena *a)
{
    if (!a) return;
    for (Chunk *c = a->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    free(a);
}

void *arena_alloc(Arena *a, size_t bytes)
{
    bytes = (bytes + 15) & ~(size_t)15;
    Chunk *c = a->head;
    if (!c || c->size - c->used < bytes) {
        size_t size = a->next_size > bytes ? a->next_size : bytes;
        c = malloc(sizeof *c + size);
        if (!c) ir_die(__FILE__, __LINE__, "out of memory (%zu bytes)", size);
        c->size = size;
        c->used = 0;
        c->next = a->head;
        a->head = c;
        if (a->next_size < (64u << 20)) a->next_size *= 2;
    }
    void *p = c->data + c->used;
    c->used += bytes;
    memset(p, 0, bytes);
    return p;
}

char *arena_strdup(Arena *a, const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = arena_alloc(a, n);
    memcpy(p, s, n);
    return p;
}

char *arena_printf(Arena *a, const char *fmt, ...)
{
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *p = arena_alloc(a, (size_t)n + 1);
    vsnprintf(p, (size_t)n + 1, fmt, ap2);
    va_end(ap2);
    return p;
}
