// Every buffer the forward pass works in, allocated once at open for the batch size, context and thread count:
// the residual stream and its normed copy, attention's projections and scores, the KV cache and its RoPE tables,
// the tiers' partial FFN outputs and the last logits (the tiers' own scratch belongs to their backends).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/matmul.h"
#include "engine/sampler.h"
#include "kernels/kv_q8.h"
#include "model/model.h"
#include "pi_engine.h"
#include "runtime/page_memory.h"

namespace pi {

const int64_t kAttnTile = 64;  // tokens of a batch whose attention scores are computed together
const int64_t kKeyTile = kKvKeyTile;  // cached positions per tile of a kv head's keys ([d_head][kKeyTile] elements)

// One sequence the engine holds (a slot of `serve --parallel`; docs/engine.md, "Sequences"): its KV cache (the layout
// RunState describes), the tokens in it, the logits of its last evaluated token and its sampling generator. Every
// sequence shares the weights and RunState's work buffers.
struct Sequence {
    PageMemory k_cache, v_cache, k_scales, v_scales;  // the scales: a q8_0 cache's only
    int64_t n_past = 0;
    std::vector<int32_t> history;  // [n_ctx] the tokens in the cache
    std::vector<float> last_logits;
    bool logits_current = true;    // last_logits are the last evaluated token's (eval_hidden makes none)
    Rng rng;
};

struct RunState {
    RunState(const HParams &hp, int64_t n_ctx, int64_t n_batch, int64_t threads, pi_kv_type kv_type, int64_t n_seq);
    // Bytes of the KV caches of n_seq sequences, and of every other buffer (in doubles: no overflow for a hostile
    // file's sizes).
    static double kv_cache_bytes(const HParams &hp, int64_t n_ctx, pi_kv_type kv_type, int64_t n_seq);
    static double buffer_bytes(const HParams &hp, int64_t n_ctx, int64_t n_batch, int64_t threads, int64_t n_seq);
    static int64_t key_slots(int64_t n_ctx) { return (n_ctx + kKeyTile - 1) / kKeyTile * kKeyTile; }

    const int64_t n_ctx;
    // KV cache of each layer in blocks of kv_block positions, each block its kv heads one after the other, a
    // head's positions in tiles of kKeyTile: [layer][pos / kv_block][kv head] then keys
    // [pos % kv_block / kKeyTile][d_head][pos % kKeyTile] (a query's scores over a tile are a gemm over
    // contiguous rows), values [pos % kv_block][d_head] (a head reads each block's values as one stream);
    // elements in f32, f16 or q8_0 (int8 here, each 32 of a position's elements with an f16 scale in k_scales /
    // v_scales at the element's index / 32 for values; for keys the tile's scales [d_head / 32][kKeyTile] from the
    // tile's first element's index / 32: kernels/kv_q8.h). A block of all heads fills one 2 MiB page where its size allows (kv_block_for),
    // and a layer's cache fills from its start, so its pages (2 MiB where granted, faulted in by their first
    // write, never populated ahead) come in with the context: a short context never touches the rest, and
    // nothing reads a position at or past n_past + the batch being evaluated.
    const pi_kv_type kv_type;
    const int64_t kv_block;
    std::vector<Sequence> seqs;  // each with its own cache, as above
    int64_t cur = 0;             // the sequence the calls evaluate into and sample from (pi_set_sequence)
    Sequence &seq() { return seqs[size_t(cur)]; }
    int64_t kv_bytes() const { return element_bytes(kv_type); }  // bytes of one cache element (a q8_0's scales apart)
    static int64_t element_bytes(pi_kv_type t) { return t == PI_KV_F32 ? 4 : t == PI_KV_F16 ? 2 : 1; }
    static double bytes_per_element(pi_kv_type t) { return t == PI_KV_Q8_0 ? 1.0 + 2.0 / QK : double(element_bytes(t)); }
    static const char *kv_type_name(int32_t t) { return t == PI_KV_F32 ? "f32" : t == PI_KV_F16 ? "f16" : "q8_0"; }
    // positions per block: as many whole tiles as fill a 2 MiB page across the kv heads (one tile at least),
    // at most the context's tiles; and the positions a layer's cache holds (whole blocks)
    static int64_t kv_block_for(const HParams &hp, int64_t n_ctx, pi_kv_type kv_type);
    static int64_t kv_slots(const HParams &hp, int64_t n_ctx, pi_kv_type kv_type);
    // elements from a layer's cache to the tile of kv head `kvh` that holds position `pos` (keys or values)
    int64_t kv_tile(int64_t n_head_kv, int64_t d_head, int64_t kvh, int64_t pos) const {
        return (pos / kv_block * n_head_kv + kvh) * kv_block * d_head + pos % kv_block / kKeyTile * kKeyTile * d_head;
    }
    int64_t kv_layer_elements(const HParams &hp) const {
        return kv_slots(hp, n_ctx, kv_type) * hp.n_head_kv * hp.d_head;
    }
    // layer il's keys or values in sequence sq: its elements, and a q8_0 cache's scales (else nullptr)
    struct KvLayer {
        uint8_t *data;
        uint16_t *scales;
    };
    KvLayer kv_layer(const HParams &hp, int64_t il, bool keys, Sequence &sq) {
        const int64_t n = kv_layer_elements(hp);
        PageMemory &c = keys ? sq.k_cache : sq.v_cache, &s = keys ? sq.k_scales : sq.v_scales;
        return {c.data() + il * n * kv_bytes(),
                kv_type == PI_KV_Q8_0 ? reinterpret_cast<uint16_t *>(s.data()) + il * n / QK : nullptr};
    }
    std::vector<float> rope_cos, rope_sin;  // [pos][n_rot/2]
    std::vector<float> rope_cos_swa, rope_sin_swa;  // the same for sliding-window layers (HParams::swa_layer), or empty

    // [batch, ...]
    std::vector<float> x, xn, q, k, v, att, tmp, y_hot, y_cold;
    std::vector<float> step_logits;  // [n_seq][n_vocab]: a decode step's logits, one row per sequence
    std::vector<float> scores;  // [threads][attention tile][n_ctx], or a decode step's [head][n_ctx]
    std::vector<BlockQ8_0> q_x, q_xn, q_att;
    Operand op_x, op_xn, op_att;  // x (the predictor's input), xn (the normed input of attention and the FFN), att
};

}  // namespace pi
