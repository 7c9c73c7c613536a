/* module_set.c — several cubins in the one blob a training binary carries.
 *
 * NVRTC compiles a module on one thread; a graph's kernels compile in CUDA_MODULE_PARTS
 * modules at the same time (nvrtc.c), so a cold `fp8c build` on a few cores waits for the
 * longest part instead of the sum. The binary still embeds one blob (emit.c) and the executor
 * loads every cubin in it (exec.c). The format is the smallest that says what it holds:
 *
 *   "FP8CMODS"  u32 version (1)  u32 count  u64 size[count]  then each cubin, 16-byte aligned
 *
 * A blob without the magic is one cubin (an ELF file), as the kernel IR's modules
 * (exec_cg.c) and binaries of one module are: split gives it back as it is. Sizes are checked
 * against the blob, so a truncated one is refused, not read past its end. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

static const char set_magic[8] = {'F', 'P', '8', 'C', 'M', 'O', 'D', 'S'};
enum { SET_VERSION = 1 };

static size_t set_header(int n) { return (8 + 4 + 4 + 8 * (size_t)n + 15) & ~(size_t)15; }

void *cuda_module_set_pack(const void *const *cubins, const size_t *sizes, int n, size_t *size) {
    size_t total = set_header(n);
    for (int k = 0; k < n; k++) total += (sizes[k] + 15) & ~(size_t)15;
    unsigned char *b = calloc(1, total ? total : 1);
    if (!b) return NULL;
    uint32_t version = SET_VERSION, count = (uint32_t)n;
    memcpy(b, set_magic, 8);
    memcpy(b + 8, &version, 4);
    memcpy(b + 12, &count, 4);
    size_t at = set_header(n);
    for (int k = 0; k < n; k++) {
        uint64_t s = sizes[k];
        memcpy(b + 16 + 8 * (size_t)k, &s, 8);
        memcpy(b + at, cubins[k], sizes[k]);
        at += (sizes[k] + 15) & ~(size_t)15;
    }
    *size = total;
    return b;
}

int cuda_module_set_split(const void *blob, size_t size, const void **cubins, size_t *sizes, int max) {
    const unsigned char *b = blob;
    if (size < 8 || memcmp(b, set_magic, 8)) {
        if (max < 1) return -1;
        cubins[0] = blob, sizes[0] = size;
        return 1;
    }
    uint32_t version, count;
    if (size < 16) return -1;
    memcpy(&version, b + 8, 4);
    memcpy(&count, b + 12, 4);
    if (version != SET_VERSION || count < 1 || count > (uint32_t)max || size < set_header((int)count)) return -1;
    size_t at = set_header((int)count);
    for (uint32_t k = 0; k < count; k++) {
        uint64_t s;
        memcpy(&s, b + 16 + 8 * (size_t)k, 8);
        if (at > size || s == 0 || s > size - at) return -1;
        cubins[k] = b + at, sizes[k] = (size_t)s;
        at += ((size_t)s + 15) & ~(size_t)15;
    }
    return (int)count;
}
