/* fuzz_ckpt.c — safetensors files: rt_st_open (any file given to --init) and rt_ckpt_load
 * into a fixed set of tensors (a checkpoint given to --resume), the header parser and the
 * checks of every name, dtype, shape and offset. The input is written to a file in a private
 * temporary directory: both entries read a file. */
#include "rt.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > FUZZ_MAX_INPUT) return -1;
    rt_set_error_stream(fuzz_null());
    const char *path = fuzz_write("fuzz.safetensors", data, size);

    RtStFile s;
    if (rt_st_open(&s, path)) {
        uint8_t buf[4096];
        for (int k = 0; k < s.n_entries; k++)
            if (s.entries[k].end - s.entries[k].begin <= (int64_t)sizeof buf)
                rt_st_read(&s, &s.entries[k], buf);
        rt_st_close(&s);
    }

    /* the names and shapes of tests/fuzz/corpus/ckpt's seeds */
    float w[12], sc;
    uint16_t b[4];
    uint8_t q[8];
    Tensor t[4] = {
        {.name = "w", .rank = 2, .dims = {3, 4}, .fmt = fmt_plain(FMT_F32), .data = w},
        {.name = "b", .rank = 1, .dims = {4}, .fmt = fmt_plain(FMT_BF16), .data = b},
        {.name = "q", .rank = 1, .dims = {8}, .fmt = fmt_plain(FMT_E4M3), .data = q},
        {.name = "s", .rank = 0, .fmt = fmt_plain(FMT_F32), .data = &sc},
    };
    Tensor *ts[4] = {&t[0], &t[1], &t[2], &t[3]};
    CkptMeta meta[4];
    int n_meta;
    rt_ckpt_load(path, ts, 4, meta, 4, &n_meta);
    rt_clear_error();
    return 0;
}
