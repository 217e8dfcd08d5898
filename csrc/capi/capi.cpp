// The C API (pi_engine.h): every entry point catches everything, so no call aborts the process on bad input.
#include <cstring>
#include <string>

#include "capi/guarded.h"
#include "format/gguf.h"
#include "pi_engine.h"

using pi::guarded;
using pi::need;

namespace {

// f(the engine behind handle e), guarded, e checked first
template <class F>
pi_status with_engine(pi_engine *e, F &&f) {
    return guarded([&] {
        need(e, "engine");
        f(e->engine);
    });
}

}  // namespace

std::string &pi::last_error() {
    thread_local std::string message;
    return message;
}

pi_status pi::open_engine(const char *path, const pi_options *opts, const char *hot_backend, pi_engine **out) {
    return guarded([&] {
        need(path, "path");
        need(hot_backend, "hot_backend");
        need(out, "out");
        *out = nullptr;
        pi_options o;
        pi_options_default(&o);
        if (opts) o = *opts;
        *out = new pi_engine(path, o, hot_backend);
    });
}

extern "C" {
const char *pi_last_error(void) { return pi::last_error().c_str(); }
int32_t pi_api_version(void) { return PI_ENGINE_API_VERSION; }

void pi_options_default(pi_options *o) {
    if (!o) return;
    std::memset(o, 0, sizeof *o);
    o->ffn_mode = PI_FFN_DENSE;
    o->gpu = PI_GPU_AUTO;
}

void pi_sampling_default(pi_sampling *p) {
    if (!p) return;
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->repeat_penalty = 1.0f;
    p->repeat_last_n = 64;
    p->frequency_penalty = 0.0f;
    p->presence_penalty = 0.0f;
}

pi_status pi_open(const char *path, const pi_options *opts, pi_engine **out) {
    return pi::open_engine(path, opts, "cpu", out);
}

void pi_close(pi_engine *e) { delete e; }

pi_status pi_check_gguf(const char *path) {
    return guarded([&] {
        need(path, "path");
        pi::GgufFile file(path);
    });
}

pi_status pi_info_json(pi_engine *e, const char **json) {
    return with_engine(e, [&](pi::Engine &engine) {
        need(json, "json");
        *json = engine.info_json().c_str();
    });
}

pi_status pi_set_ffn_mode(pi_engine *e, int32_t mode) {
    return with_engine(e, [&](pi::Engine &engine) { engine.set_ffn_mode(mode); });
}

pi_status pi_set_recall_check(pi_engine *e, int32_t enabled) {
    return with_engine(e, [&](pi::Engine &engine) { engine.set_recall_check(enabled != 0); });
}

pi_status pi_set_expert_trace(pi_engine *e, int32_t enabled) {
    return with_engine(e, [&](pi::Engine &engine) { engine.set_expert_trace(enabled != 0); });
}

pi_status pi_expert_choices(pi_engine *e, int32_t *choices, int32_t n) {
    return with_engine(e, [&](pi::Engine &engine) { engine.expert_choices(choices, n); });
}

pi_status pi_set_input_sparsity(pi_engine *e, float share) {
    return with_engine(e, [&](pi::Engine &engine) { engine.set_input_sparsity(share); });
}

pi_status pi_eval(pi_engine *e, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits) {
    return with_engine(e, [&](pi::Engine &engine) { engine.eval(tokens, n, logits, all_logits != 0); });
}

pi_status pi_eval_hidden(pi_engine *e, const int32_t *tokens, int32_t n, float *hidden) {
    return with_engine(e, [&](pi::Engine &engine) { engine.eval_hidden(tokens, n, hidden); });
}

int32_t pi_n_past(const pi_engine *e) { return e ? e->engine.n_past() : -1; }

pi_status pi_truncate(pi_engine *e, int32_t n_keep) {
    return with_engine(e, [&](pi::Engine &engine) { engine.truncate(n_keep); });
}

pi_status pi_set_sequence(pi_engine *e, int32_t seq) {
    return with_engine(e, [&](pi::Engine &engine) { engine.select(seq); });
}

pi_status pi_decode_step(pi_engine *e, const int32_t *seqs, const int32_t *tokens, int32_t n, float *logits) {
    return with_engine(e, [&](pi::Engine &engine) { engine.decode_step(seqs, tokens, n, logits); });
}

pi_status pi_sample(pi_engine *e, const pi_sampling *params, int32_t *token) {
    return with_engine(e, [&](pi::Engine &engine) {
        need(params, "params");
        need(token, "token");
        *token = engine.sample(*params);
    });
}

pi_status pi_sample_masked(pi_engine *e, const pi_sampling *params, const uint32_t *allowed, int32_t n_words,
                           int32_t *token) {
    return with_engine(e, [&](pi::Engine &engine) {
        need(params, "params");
        need(allowed, "allowed");
        need(token, "token");
        *token = engine.sample(*params, allowed, n_words);
    });
}

pi_status pi_set_seed(pi_engine *e, uint64_t seed) {
    return with_engine(e, [&](pi::Engine &engine) { engine.set_seed(seed); });
}

pi_status pi_stats_json(pi_engine *e, const char **json) {
    return with_engine(e, [&](pi::Engine &engine) {
        need(json, "json");
        *json = engine.stats_json().c_str();
    });
}

pi_status pi_stats_reset(pi_engine *e) {
    return with_engine(e, [&](pi::Engine &engine) { engine.reset_stats(); });
}

}  // extern "C"
