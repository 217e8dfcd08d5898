// libFuzzer target for the engine's file readers (GGUF/PWRI model files and .gpuidx GPU indexes).
//
// An input is a model file, optionally followed by kSplit and a GPU index file. Both are handed to the
// public C API (pi_open reads paths, so they go into memfd files named /proc/self/fd/N); a file that
// loads is also run for a token in every FFN mode, so the bound tensors are read, not only checked.
// Build and run with scripts/fuzz_engine.sh; the seed corpus is tests/fuzz_corpus/.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "pi_engine.h"

namespace {

const char kSplit[] = "\n--pi-fuzz-gpuidx--\n";

// A memfd holding `size` bytes; its /proc path names it for pi_open. -1 when the kernel refuses.
int memory_file(const uint8_t *data, size_t size, std::string *path) {
    const int fd = memfd_create("pi-fuzz", MFD_CLOEXEC);
    if (fd < 0) return -1;
    size_t done = 0;
    while (done < size) {
        const ssize_t n = write(fd, data + done, size - done);
        if (n <= 0) {
            close(fd);
            return -1;
        }
        done += size_t(n);
    }
    *path = "/proc/self/fd/" + std::to_string(fd);
    return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *split = static_cast<const uint8_t *>(memmem(data, size, kSplit, sizeof kSplit - 1));
    const size_t model_size = split ? size_t(split - data) : size;
    std::string model_path, index_path;
    const int model_fd = memory_file(data, model_size, &model_path);
    if (model_fd < 0) return 0;
    int index_fd = -1;
    if (split) {
        const uint8_t *index = split + sizeof kSplit - 1;
        index_fd = memory_file(index, size_t(data + size - index), &index_path);
    }

    pi_options opts;
    pi_options_default(&opts);
    opts.threads = 1;
    opts.batch_size = 4;
    opts.gpuidx_path = index_fd >= 0 ? index_path.c_str() : nullptr;
    pi_engine *engine = nullptr;
    if (pi_open(model_path.c_str(), &opts, &engine) == PI_OK) {
        const int32_t tokens[2] = {0, 0};
        for (int32_t mode : {PI_FFN_DENSE, PI_FFN_GATE, PI_FFN_PREDICTOR, PI_FFN_AUTO, PI_FFN_ORACLE}) {
            if (pi_set_ffn_mode(engine, mode) != PI_OK) continue;
            pi_truncate(engine, 0);
            pi_eval(engine, tokens, 2, nullptr, 0);
        }
        const char *json = nullptr;
        pi_info_json(engine, &json);
        pi_close(engine);
    } else if (pi_last_error()[0] == '\0') {
        std::fprintf(stderr, "pi_open failed without a message\n");
        __builtin_trap();
    }
    if (index_fd >= 0) close(index_fd);
    close(model_fd);
    return 0;
}
