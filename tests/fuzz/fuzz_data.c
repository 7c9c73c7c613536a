/* fuzz_data.c — token data files: rt_data_open on a file holding the input (llm.c shards of
 * either header, or text), then the checks, the validation split and a batch of each kind. */
#include "rt.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > FUZZ_MAX_INPUT) return -1;
    rt_set_error_stream(fuzz_null());
    const char *path = fuzz_write("fuzz.bin", data, size);
    TokenData d;
    if (rt_data_open(&d, path)) {
        enum { B = 2, T = 4 };
        if (rt_data_check(&d, "the training data", T + 1, B * (T + 1), 1 << 17)) {
            int32_t tokens[B * T], targets[B * T];
            rt_data_train_batch(&d, 1, 0, 0, B, T, tokens, targets);
            rt_data_val_batch(&d, 3, B, T, tokens, targets);
            TokenData val;
            if (rt_data_split_tail(&d, &val, 0.5)) rt_data_free(&val);
        }
        rt_data_free(&d);
    }
    rt_clear_error();
    return 0;
}
