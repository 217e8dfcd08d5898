/* pi_engine: the C API of the bundled PowerInfer-style inference engine.
 *
 * Opaque handles, status codes and a thread-local error string. No call aborts or exits the
 * process on bad input: every failure returns a non-zero pi_status and leaves a one-line message
 * readable with pi_last_error(). pi_engine_testing.h declares the library's other entry points: single
 * kernels, the machine's read probe and a second tier backend, for tests and measurements.
 */
#ifndef PI_ENGINE_H
#define PI_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with hidden visibility and a version script (docs/engine.md, "Linking: what the libraries
 * export"): it exports the functions declared here and nothing else. */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

#define PI_ENGINE_API_VERSION 20

typedef enum {
    PI_OK = 0,
    PI_ERR_IO = 1,          /* file missing, unreadable, mmap failed */
    PI_ERR_FORMAT = 2,      /* the file contradicts the GGUF/PowerInfer format or itself */
    PI_ERR_UNSUPPORTED = 3, /* valid file, but an architecture/type/feature this build cannot run */
    PI_ERR_ARGUMENT = 4,    /* bad argument (token id out of range, context full, ...) */
    PI_ERR_MEMORY = 5,      /* allocation failed */
    PI_ERR_INTERNAL = 6
} pi_status;

/* How the FFN of each layer is computed (see docs: dense is the exact reference). */
typedef enum {
    PI_FFN_DENSE = 0,     /* every neuron, no threshold */
    PI_FFN_GATE = 1,      /* gate exactly, then up/down only for neurons passing the activation rule */
    PI_FFN_PREDICTOR = 2, /* predictor logits above the layer threshold select neurons (PowerInfer) */
    PI_FFN_AUTO = 3,      /* per layer, the cheapest of the above by the cost model at measured density */
    PI_FFN_ORACLE = 4     /* predictor path with the predictor replaced by the true mask (testing) */
} pi_ffn_mode;

/* The KV cache's element type. f32 keeps the engine's logits within float rounding of the reference;
 * f16 (llama.cpp's default) halves the cache's memory and what a decode step reads of it; q8_0 (llama.cpp's
 * --cache-type-k/v q8_0: blocks of 32 int8 with an f16 scale, 1.0625 bytes an element) about halves them again
 * (CPU attention only: with a device tier, the device runs the FFN and the CPU attention). */
typedef enum {
    PI_KV_F32 = 0,
    PI_KV_F16 = 1,
    PI_KV_Q8_0 = 2
} pi_kv_type;

/* Where the hot tier (the gpuidx's neurons) runs. auto: on a device when a device library, a device and a hot
 * tier are all there (pi_info_json's "gpu" says why not); on: the same, or the open fails saying what is missing.
 * Without a device the gpuidx is checked and otherwise ignored: every neuron is computed by the FFN mode, as
 * without one (a placement is for a device; pi_options.cpu_hot_tier keeps it as a tier on the CPU). */
typedef enum {
    PI_GPU_OFF = 0,
    PI_GPU_AUTO = 1,
    PI_GPU_ON = 2
} pi_gpu_mode;

typedef struct pi_engine pi_engine;

typedef struct {
    int32_t threads;         /* worker threads including the caller; <= 0: hardware concurrency */
    int32_t ctx_size;        /* KV cache length; <= 0: min(training context, 4096) */
    int32_t batch_size;      /* tokens per forward batch (prompt processing); <= 0: 64 */
    int32_t ffn_mode;        /* pi_ffn_mode */
    int32_t recall_check;    /* != 0: also compute the true mask to measure predictor recall */
    const char *gpuidx_path; /* optional PowerInfer .gpuidx file: its neurons form the hot tier */
    const char *isa;         /* optional kernel set: "scalar", "avx2", "avx512"; NULL: best available */
    int32_t kv_type;         /* pi_kv_type */
    int32_t gpu;             /* pi_gpu_mode (default auto) */
    int32_t gpu_device;      /* the device's ordinal */
    int64_t vram_budget;     /* bytes of device memory the device may take (docs/engine.md, "The GPU tier": the
                                layers' attention and KV cache, then their hot rows, in layer order; the layers past
                                it keep those on the CPU); <= 0: the device's free memory less a reserve; more than
                                is free: the open fails */
    const char *gpu_library; /* the device library (pi_device.h); NULL: the environment's PI_GPU_LIBRARY */
    int32_t gpu_ffn_only;    /* != 0: only the hot tier goes to the device; 0 (PowerInfer's placement): the
                                attention blocks and KV caches of as many layers as the budget holds go first */
    float input_sparsity;    /* input sparsity's model-wide share of inputs zeroed (0: off; at most the file's largest
                                powerinfer.input_sparsity_levels): every matrix's inputs at or below its calibrated
                                threshold are zeroed, and a decode step skips the rows they multiply */
    int32_t cpu_hot_tier;    /* != 0: where no device takes the gpuidx's hot tier, it stays a tier of its own on the
                                CPU (every hot neuron computed whole, the FFN mode for the rest: testing the tiers);
                                0: every neuron goes to the cold tier there */
    const char *decode_cache; /* optional file for the weights decoded at load (llama.cpp's K-quants, q4_1, q5_x,
                                bf16, its ffn_down layout): read instead of decoding when it is whole and made from
                                this model file, else written for the next load; NULL: decode every time */
    int64_t memory_budget;   /* bytes the engine may hold (docs/engine.md, "Models larger than memory"): > 0, the cold
                                FFN neurons that do not fit are read on demand from the neuron bundles beside the model
                                (path + ".neurons"); 0: the same, under the machine's memory or its cgroup's limit,
                                where those bundles are there and the model's FFN would not fit it; < 0: off. A mixture
                                of experts: its experts are read from the model file into a cache of whole experts
                                (docs/engine.md, "The expert tier"), at 0 where they would not fit the limit */
    int32_t n_seq;           /* sequences the engine holds (the slots of a server's parallel requests), each with its
                                own KV cache of ctx_size positions (counted by the memory check), sharing the weights
                                and work buffers; <= 0: 1 */
    int32_t expert_lookahead; /* the expert tier's lookahead (the next layer's router on this layer's input names
                                 experts to read ahead): 1 on, 0 off (the default: on the synthetic Qwen3-30B-A3B
                                 shape its guesses cost more reads than they save, docs/bench.md); the same logits */
} pi_options;

typedef struct {
    float temperature;     /* <= 0: greedy */
    int32_t top_k;         /* <= 0: no top-k cut */
    float top_p;           /* >= 1: no nucleus cut */
    float repeat_penalty;  /* 1: off (llama.cpp rule: divide positive logits, multiply negative ones) */
    int32_t repeat_last_n; /* how many of the latest tokens the penalties look at */
    float frequency_penalty; /* 0: off; subtracted from a logit once per occurrence in that window (OpenAI's rule) */
    float presence_penalty;  /* 0: off; subtracted once from the logit of every token in that window */
} pi_sampling;

/* Thread-local message of the last failing call in this thread ("" when none). */
const char *pi_last_error(void);
int32_t pi_api_version(void);

void pi_options_default(pi_options *opts);
void pi_sampling_default(pi_sampling *params);

pi_status pi_open(const char *path, const pi_options *opts, pi_engine **out);
void pi_close(pi_engine *engine);

/* The checks pi_open makes of a GGUF/PowerInfer file's structure (magic, version, every count, length, type
 * and tensor offset against the file's size), without loading a model: for readers of the file that trust
 * what its header declares. */
pi_status pi_check_gguf(const char *path);

/* JSON object describing the model and the run settings (owned by the engine, valid until the next
 * pi_info/pi_stats_json call on it). */
pi_status pi_info_json(pi_engine *engine, const char **json);

pi_status pi_set_ffn_mode(pi_engine *engine, int32_t mode);
pi_status pi_set_recall_check(pi_engine *engine, int32_t enabled);
/* A mixture of experts: enabled != 0 makes every later pi_eval/pi_eval_hidden record the experts each token's router
 * chose in each layer (what `pi-tools profile` counts); refused for a model without experts. */
pi_status pi_set_expert_trace(pi_engine *engine, int32_t enabled);
/* The last evaluation's routing: n (its token count) * n_layer * n_expert_used ids, token-major, each layer's
 * experts most probable first, -1 in a layer without experts. */
pi_status pi_expert_choices(pi_engine *engine, int32_t *choices, int32_t n);
/* pi_options.input_sparsity for the next calls (0: off). */
pi_status pi_set_input_sparsity(pi_engine *engine, float share);

/* Run `n` tokens after the `pi_n_past` already in the cache. `logits` receives n * n_vocab floats
 * when all_logits != 0, else the n_vocab logits of the last token; it may be NULL. */
pi_status pi_eval(pi_engine *engine, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits);
/* The same, writing each token's last hidden state through the output norm (n * n_embd floats: what the head
 * reads, the input of an embedding's pooling) instead of logits; pi_sample is refused until a pi_eval. */
pi_status pi_eval_hidden(pi_engine *engine, const int32_t *tokens, int32_t n, float *hidden);
int32_t pi_n_past(const pi_engine *engine);
/* Keep only the first n_keep cached tokens. */
pi_status pi_truncate(pi_engine *engine, int32_t n_keep);

/* The sequence that pi_eval, pi_eval_hidden, pi_n_past, pi_truncate, pi_sample, pi_sample_masked and pi_set_seed act
 * on from here on (0 at open; at most pi_options.n_seq - 1): each has its own cache, tokens, last logits and seed. */
pi_status pi_set_sequence(pi_engine *engine, int32_t seq);
/* One decode step of n distinct sequences (each evaluated before, n at most batch_size): tokens[t] is evaluated as
 * the next token of sequence seqs[t], all n in one pass over the weights, each attending to its own cache at its own
 * position. `logits` (may be NULL) receives n * n_vocab floats, row t sequence seqs[t]'s, and pi_sample on a
 * sequence draws from its row. Each row is the bits the sequence's own single-token pi_eval would give, whatever the
 * other sequences (docs/engine.md, "Sequences"): in the sparse modes (gate, predictor, oracle) a step reads the union
 * of its rows' selections once and each row computes its own. Several sequences are refused in auto mode, with
 * input sparsity, a hot tier on a device, the disk tier or a mixture of experts. The selected sequence stays
 * selected. */
pi_status pi_decode_step(pi_engine *engine, const int32_t *seqs, const int32_t *tokens, int32_t n, float *logits);

/* Sample the next token from the logits of the last evaluated token. */
pi_status pi_sample(pi_engine *engine, const pi_sampling *params, int32_t *token);
/* The same, drawn only from the tokens `allowed` sets (bit i % 32 of word i / 32, as llguidance's bitmask; n_words
 * at least (n_vocab + 31) / 32): a grammar's constraint applied before the penalties, top-k, top-p and temperature,
 * so a constrained request keeps every sampling setting. An error where no token is allowed. */
pi_status pi_sample_masked(pi_engine *engine, const pi_sampling *params, const uint32_t *allowed, int32_t n_words,
                           int32_t *token);
pi_status pi_set_seed(pi_engine *engine, uint64_t seed);

/* Statistics since open or the last pi_stats_reset, as JSON (owned by the engine). */
pi_status pi_stats_json(pi_engine *engine, const char **json);
pi_status pi_stats_reset(pi_engine *engine);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif

#endif /* PI_ENGINE_H */
