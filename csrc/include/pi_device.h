/* pi_device: the C ABI between the engine library and a device library that computes, for the layers it holds,
 * the attention block (with those layers' KV cache in the device's memory) and the FFN's hot tier
 * (docs/engine.md, "The GPU tier"). A device library is a shared object of its own, loaded with dlopen only
 * when a run asks for a device, so the engine never links a device runtime: the CUDA one (built where nvcc is
 * found at install time) and the host emulation the tests load in its place. It exports one symbol,
 * pi_device_api_get, returning a table of plain C functions.
 *
 * The protocol is the TierBackend's (backend/tier_backend.h): each layer's hot rows are uploaded once at load,
 * then per layer and batch a job is submitted (it may run while the caller computes the cold tier) and waited
 * for. A layer's attention weights are uploaded once too (attention_upload), with room for its KV cache; then
 * per layer and batch attention_run computes the block from the layer's input and returns its output. A layer
 * whose attention and hot rows are on the device but whose cold tier is on the host runs as a split layer
 * (split_begin, split_end): one crossing of the bus each way. A mixture of experts' layer keeps some of its experts
 * on the device (expert_upload, once each at load); per layer and batch the pairs (token, expert) routed to them are
 * submitted (experts_submit, running while the caller computes its other experts) and their weighted sum waited for
 * (experts_wait). Every call returns 0 on success, or non-zero with a one-line message in `err`.
 */
#ifndef PI_DEVICE_H
#define PI_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PI_DEVICE_API_VERSION 5

typedef enum { PI_DEVICE_ACT_RELU = 0, PI_DEVICE_ACT_SILU = 1, PI_DEVICE_ACT_DRELU = 2 } pi_device_activation;
typedef enum { PI_DEVICE_NORM_RMS = 0, PI_DEVICE_NORM_LAYER = 1 } pi_device_norm;
/* RoPE: none (learned positions), llama.cpp's "normal" (pairs 2i, 2i + 1), NeoX (pairs i, i + n_rot/2) */
typedef enum { PI_DEVICE_ROPE_NONE = 0, PI_DEVICE_ROPE_ADJACENT = 1, PI_DEVICE_ROPE_NEOX = 2 } pi_device_rope;

/* What every layer of one engine's hot tier shares. */
typedef struct {
    int32_t device;      /* the device's ordinal */
    int32_t n_embd;      /* the FFN's input and output width (a multiple of 32) */
    int32_t n_layer;
    int32_t n_batch;     /* the most tokens a job carries */
    int32_t activation;  /* pi_device_activation */
    int32_t gated;       /* 1: h = act(gate x) * (up x); 0: h = act(up x + b), the rows given as `gate` */
    /* attention's shape, read by attention_upload and attention_run only */
    int32_t n_head, n_head_kv, d_head, n_rot;
    int32_t rope;        /* pi_device_rope */
    int32_t norm;        /* pi_device_norm */
    float norm_eps;
    int32_t n_ctx;       /* positions a layer's KV cache holds */
    int32_t kv_f16;      /* 1: the cache's elements in f16 (rounded to nearest even), 0: in f32 */
    const float *rope_cos, *rope_sin; /* [n_ctx][n_rot / 2], copied by tier_create; NULL without RoPE */
    int32_t n_vocab;     /* the output head's rows, read by head_upload and head_run only */
    /* a mixture of experts' shape, read by expert_upload and experts_submit only (0 where the model has none): its
     * experts a layer, a token's experts, an expert's width (a multiple of 32) */
    int32_t n_expert, n_expert_used, n_ff_expert;
} pi_device_tier_desc;

/* One layer's hot rows in host memory, slot after slot, in the file's types (GGML ids: 0 f32, 1 f16, 2 q4_0,
 * 8 q8_0), each row n_embd elements. The caller may free them once tier_upload returns. */
typedef struct {
    int32_t n_rows;
    uint32_t gate_type, up_type, down_type;
    const void *gate, *up, *down_t; /* up: NULL when not gated */
    const float *gate_b, *up_b;     /* per slot, or NULL */
    float threshold;                /* the activation rule's (SiLU: |a| > t; ReLU, FATReLU: g > t) */
} pi_device_layer;

/* One layer's hot tier over a batch. The operand is the FFN's normed input, f32 rows; the library quantizes them
 * to q8_0 (the CPU kernels' quantizer) where its weights are quantized. x and y stay untouched by the caller
 * until tier_wait returns. */
typedef struct {
    int32_t layer;
    int32_t n_tok;
    int32_t dense;       /* 1: every neuron's down row, the rule not applied; 0: only neurons the rule passes */
    const float *x;      /* [n_tok][n_embd] */
    float *y;            /* [n_tok][n_embd], written whole */
} pi_device_job;

/* A matrix in its file's type (GGML ids as above): `rows` rows of `cols` elements, row after row, and its bias
 * (NULL when the layer has none). */
typedef struct {
    uint32_t type;
    int32_t rows, cols;
    const void *data;
    const float *bias;
} pi_device_matrix;

/* One layer's attention block in host memory: its input norm (f32, n_embd each; norm_b NULL for RMSNorm), the
 * q (n_head * d_head rows), k and v (n_head_kv * d_head rows each) projections of the normed input, and the
 * output projection o (n_embd rows of n_head * d_head); and the FFN's norm (likewise), which layer_run applies
 * (NULL where the layer's FFN reads attention's norm: a parallel block). The caller may free them once
 * attention_upload returns. */
typedef struct {
    const float *norm_w, *norm_b;
    pi_device_matrix q, k, v, o;
    const float *ffn_norm_w, *ffn_norm_b;
} pi_device_attention;

/* One layer's attention over a batch at positions n_past .. n_past + n_tok - 1: the batch's keys and values go
 * into the layer's cache at those positions (positions past them are never read: a truncated context is
 * overwritten as it grows again), each token attends to positions 0 .. its own, and `out` receives the output
 * projection (with its bias) of the heads' outputs. Returns when out is written. */
typedef struct {
    int32_t layer;
    int32_t n_tok;
    int32_t n_past;
    const float *x;      /* [n_tok][n_embd], the layer's input (the residual stream) */
    float *out;          /* [n_tok][n_embd], written whole */
} pi_device_attention_job;

/* The output head in host memory: the output norm (as an attention block's) and the head (n_vocab rows of
 * n_embd, no bias). */
typedef struct {
    const float *norm_w, *norm_b;
    pi_device_matrix out;
} pi_device_head;

/* What a job counted, and the traffic and time it took. */
typedef struct {
    double active;      /* neurons passing the rule, summed over tokens */
    double computed;    /* neurons whose down row was used */
    double h2d_bytes, d2h_bytes;
    double seconds;     /* from submit until the job's output was back in host memory */
    double launches;    /* kernels launched (tier_math.h's and attention_math.h's *_launches) */
    double device_bytes; /* bytes the kernels read from device memory: weights and KV cache (*_bytes, likewise) */
} pi_device_counts;

/* The head over n_tok rows of the last layer's output: logits[t * ld_logits + v], written for v < n_vocab. */
typedef struct {
    int32_t n_tok;
    const float *x;      /* [n_tok][n_embd]; NULL: rows first .. first + n_tok - 1 of the stream layer_run left */
    float *logits;
    int64_t ld_logits;
    int32_t first;
} pi_device_head_job;

/* A whole layer on the device (its attention block, its FFN's norm, and its hot rows, which are all its neurons:
 * no cold tier): x += attention(x), then x += ffn(ffn_norm(x)), for n_tok tokens at positions n_past ..; the
 * FFN's bias-free down projection over the neurons its rule passes (all of them where dense). The residual stream x
 * stays in the device's memory between such calls: x_in NULL continues from the previous call's stream, x_out
 * NULL leaves it there (the call may then return before the device is done). `counts` (active and computed
 * neurons, traffic, launches, bytes) is written by the time a call with x_out, or a head_run, returns. */
typedef struct {
    int32_t layer;
    int32_t n_tok;
    int32_t n_past;
    int32_t dense;
    const float *x_in;   /* [n_tok][n_embd], or NULL */
    float *x_out;        /* [n_tok][n_embd], or NULL */
    pi_device_counts *counts;
} pi_device_layer_job;

/* One layer's predictor as its hot rows need it (PowerInfer's: neuron j selected when fc2_j . relu(fc1 x) >
 * threshold, x the residual stream entering the FFN block): fc1 (rank rows of n_embd, its bias NULL) and fc2's
 * rows of the layer's hot slots (n_rows rows of rank, in slot order), in their file types. rank: a multiple of
 * 32. The caller may free them once predictor_upload returns. */
typedef struct {
    pi_device_matrix fc1, fc2;
    float threshold;
} pi_device_predictor;

/* Which hot neurons a split layer computes: every one (no rule), those the activation rule passes, or those the
 * layer's predictor (predictor_upload) selects, then the rule on them. */
typedef enum { PI_DEVICE_HOT_DENSE = 0, PI_DEVICE_HOT_RULE = 1, PI_DEVICE_HOT_PREDICTOR = 2 } pi_device_hot_mode;

/* A split layer (docs/engine.md, "A split layer"): its attention and hot rows on the device, its cold tier on the
 * host. split_begin runs x += attention(x) and the FFN's norm on the residual stream in device memory, and copies
 * the stream and its norm down in one copy (x_mid, xn: what the host's cold tier and predictor read; x_mid may be
 * x_in); it returns once they are written, the hot rows (by hot_mode) then running on the device while the host
 * computes the cold tier. split_end copies the cold tier's output y_cold ([n_tok][n_embd]) up (one copy) and adds
 * both tiers' outputs to the stream: x += y_hot + y_cold. The stream stays in device memory as layer_run's (x_in
 * NULL continues it; split_end's x_out NULL leaves it there, split_end then returning before the device is done,
 * else the stream's n_tok rows land there); `counts` is written by the time a split_end with x_out, or a
 * head_run, returns. No other job runs between a split_begin and its split_end. */
typedef struct {
    int32_t layer;
    int32_t n_tok;
    int32_t n_past;
    int32_t hot_mode;     /* pi_device_hot_mode */
    const float *x_in;    /* [n_tok][n_embd], or NULL */
    float *x_mid;         /* [n_tok][n_embd]: the stream after attention, written by split_begin */
    float *xn;            /* [n_tok][n_embd]: its FFN norm, written by split_begin */
    pi_device_counts *counts;
} pi_device_split_job;

/* One expert of a mixture's layer in host memory, in its file's types (GGML ids as above; no biases): gate and up
 * (n_ff_expert rows of n_embd) and down (n_embd rows of n_ff_expert, a row per output, the file's layout). The
 * expert computes SiLU's gated FFN: h = silu(gate x) * (up x), out = down h, h quantized to q8_0 (the CPU kernels'
 * quantizer) where down is quantized. The caller may free it once expert_upload returns. */
typedef struct {
    pi_device_matrix gate, up, down;
} pi_device_expert;

/* A layer's device experts over a batch: n_pairs pairs (token, expert, weight), each expert's pairs one after the
 * other, every expert uploaded for the layer. y[t] = the sum over token t's pairs, in pair order, of weight * the
 * expert's output on x[t] (0 for a token without a pair): what the host adds to its own experts' sum. x, the pair
 * arrays and y stay untouched by the caller until experts_wait returns. */
typedef struct {
    int32_t layer;
    int32_t n_tok;         /* at most n_batch */
    int32_t n_pairs;       /* at most n_batch * n_expert_used */
    const float *x;        /* [n_tok][n_embd]: the FFN's normed input */
    const int32_t *pair_token, *pair_expert; /* [n_pairs] */
    const float *pair_weight;                /* [n_pairs] */
    float *y;              /* [n_tok][n_embd], written whole */
} pi_device_experts_job;

typedef struct pi_device_tier pi_device_tier;

typedef struct {
    int32_t api_version; /* PI_DEVICE_API_VERSION */
    const char *name;    /* "cuda", "emulated" */
    /* Devices present (0 when none, or no driver); err says why there are none. */
    int32_t (*device_count)(char *err, size_t err_len);
    /* Free and total bytes of a device's memory, and its name. */
    int32_t (*device_memory)(int32_t device, uint64_t *free_bytes, uint64_t *total_bytes, char *name, size_t name_len,
                             char *err, size_t err_len);
    pi_device_tier *(*tier_create)(const pi_device_tier_desc *desc, char *err, size_t err_len);
    int32_t (*tier_upload)(pi_device_tier *tier, const pi_device_layer *layer_rows, int32_t layer, char *err,
                           size_t err_len);
    int32_t (*tier_submit)(pi_device_tier *tier, const pi_device_job *job, char *err, size_t err_len);
    int32_t (*tier_wait)(pi_device_tier *tier, pi_device_counts *counts, char *err, size_t err_len);
    /* A layer's attention weights, and the memory for its KV cache (n_ctx positions). */
    int32_t (*attention_upload)(pi_device_tier *tier, const pi_device_attention *attention, int32_t layer, char *err,
                                size_t err_len);
    /* Runs a layer's attention block (synchronously: its output is the FFN's input); counts: traffic and time
     * (active and computed are 0). */
    int32_t (*attention_run)(pi_device_tier *tier, const pi_device_attention_job *job, pi_device_counts *counts,
                             char *err, size_t err_len);
    /* The output head's weights (and its scratch), and running it (synchronously). */
    int32_t (*head_upload)(pi_device_tier *tier, const pi_device_head *head, char *err, size_t err_len);
    int32_t (*head_run)(pi_device_tier *tier, const pi_device_head_job *job, pi_device_counts *counts, char *err,
                        size_t err_len);
    /* A whole layer (pi_device_layer_job), for a layer whose attention (with its FFN norm) and hot rows were
     * uploaded. */
    int32_t (*layer_run)(pi_device_tier *tier, const pi_device_layer_job *job, char *err, size_t err_len);
    /* A layer's predictor for its hot rows (pi_device_predictor), after its hot rows were uploaded. */
    int32_t (*predictor_upload)(pi_device_tier *tier, const pi_device_predictor *predictor, int32_t layer, char *err,
                                size_t err_len);
    /* A split layer (pi_device_split_job), for a layer whose attention (with its FFN norm) and hot rows were
     * uploaded (and its predictor, for PI_DEVICE_HOT_PREDICTOR): its first half, then its second. */
    int32_t (*split_begin)(pi_device_tier *tier, const pi_device_split_job *job, char *err, size_t err_len);
    int32_t (*split_end)(pi_device_tier *tier, const float *y_cold, float *x_out, char *err, size_t err_len);
    /* The device's own copy rate (bytes read plus written per second, a device-to-device copy): what a job's
     * device_bytes are measured against. */
    int32_t (*copy_rate)(int32_t device, double *bytes_per_second, char *err, size_t err_len);
    /* Bytes of device memory the tier holds (weights, KV caches and scratch). */
    uint64_t (*tier_bytes)(const pi_device_tier *tier);
    void (*tier_destroy)(pi_device_tier *tier);
    /* One expert of a layer (pi_device_expert), with the experts' scratch at the first upload. */
    int32_t (*expert_upload)(pi_device_tier *tier, const pi_device_expert *expert, int32_t layer, int32_t expert_id,
                             char *err, size_t err_len);
    /* A layer's device experts over a batch (pi_device_experts_job): started, then waited for; counts: active and
     * computed are the pairs' neurons, traffic, time from submit until y was back, launches and bytes read. No other
     * job runs between the two. */
    int32_t (*experts_submit)(pi_device_tier *tier, const pi_device_experts_job *job, char *err, size_t err_len);
    int32_t (*experts_wait)(pi_device_tier *tier, pi_device_counts *counts, char *err, size_t err_len);
} pi_device_api;

typedef const pi_device_api *(*pi_device_api_get_fn)(void);
const pi_device_api *pi_device_api_get(void);

#ifdef __cplusplus
}
#endif

#endif /* PI_DEVICE_H */
