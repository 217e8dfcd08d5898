// Every buffer the forward pass works in, allocated once at open for the batch size, context and thread count:
// the residual stream and its normed copy, attention's projections and scores, the KV cache and its RoPE tables,
// the tiers' partial FFN outputs and the last logits (the tiers' own scratch belongs to their backends).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/matmul.h"
#include "model/model.h"
#include "runtime/page_memory.h"

namespace pi {

const int64_t kAttnTile = 64;  // tokens of a batch whose attention scores are computed together
const int64_t kKeyTile = 64;   // cached positions per tile of a kv head's keys ([d_head][kKeyTile] floats)

struct RunState {
    RunState(const HParams &hp, int64_t n_ctx, int64_t n_batch, int64_t threads, bool kv_f16);
    // Bytes of the KV cache, and of every other buffer (in doubles: no overflow for a hostile file's sizes).
    static double kv_cache_bytes(const HParams &hp, int64_t n_ctx, bool kv_f16);
    static double buffer_bytes(const HParams &hp, int64_t n_ctx, int64_t n_batch, int64_t threads);
    static int64_t key_slots(int64_t n_ctx) { return (n_ctx + kKeyTile - 1) / kKeyTile * kKeyTile; }

    const int64_t n_ctx;
    // KV cache, a kv head's positions together (each head reads one stream): keys
    // [layer][kv head][pos / kKeyTile][d_head][pos % kKeyTile] (a query's scores over a tile are a gemm over
    // contiguous rows), values [layer][kv head][pos][d_head]; elements in f16 or f32
    const bool kv_f16;
    PageMemory k_cache, v_cache;
    int64_t kv_bytes() const { return kv_f16 ? 2 : 4; }  // bytes of one cache element
    int64_t n_past = 0;
    std::vector<int32_t> history;           // [n_ctx] the tokens in the cache
    std::vector<float> rope_cos, rope_sin;  // [pos][n_rot/2]

    // [batch, ...]
    std::vector<float> x, xn, q, k, v, att, tmp, y_hot, y_cold, last_logits;
    std::vector<float> scores;  // [threads][attention tile][n_ctx], or a decode step's [head][n_ctx]
    std::vector<BlockQ8_0> q_x, q_xn, q_att;
    Operand op_x, op_xn, op_att;  // x (the predictor's input), xn (the normed input of attention and the FFN), att
};

}  // namespace pi
