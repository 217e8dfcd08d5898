// The forward pass of a batch, top to bottom: the token (and position) embedding; per layer attention (norm,
// q/k/v, RoPE, the KV cache, the heads, the output projection) and the FFN over its tiers' backends; the output
// norm and head. Every matrix read whole goes through matmul (engine/matmul.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "engine/engine.h"
#include "engine/work.h"
#include "runtime/common.h"

namespace pi {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const int64_t kHeadsPerTile = 4;  // query heads of a kv head whose outputs one gemm computes (its token tile)

}  // namespace

void Engine::forward(const int32_t *tokens, int64_t n_tok, float *logits, int64_t ld_logits, bool want_logits) {
    auto t0 = Clock::now();
    embed(tokens, n_tok);
    stats_.times.embed += seconds_since(t0);

    for (int64_t il = 0; il < hp_.n_layer; ++il) {
        // attention's output lands in tmp; a parallel block adds it after the FFN has read the layer input
        t0 = Clock::now();
        // attention leaves what it reads unchanged; a decode step of several sequences is n_tok decode steps
        const TierMode cold_mode = policy_.cold_mode(il, stepping() ? 1 : n_tok);
        const auto streams = [&](int64_t i) { return device_layer(i) || split_layer(i); };
        if (streams(il)) {
            // the whole layer on the device, or split with its cold tier here (its time counted as attention's);
            // the residual stream stays there from one such layer to the next, and for the head where it is there
            const bool in = il == 0 || !streams(il - 1);
            const bool out = il + 1 < hp_.n_layer ? !streams(il + 1) : !(want_logits && device_->heads());
            float *x = rs_->x.data();
            double cold_seconds = 0;  // a split layer's cold tier: its phases' own time
            if (device_layer(il)) {
                device_->layer(il, n_tok, rs_->seq().n_past, FfnPolicy::hot_mode(cold_mode) == TierMode::Dense,
                               in ? x : nullptr, out ? x : nullptr);
                if (n_tok == 1) stats_.layers[size_t(il)].kernel_changes += double(policy_.decode_step(il, cold_mode));
            } else {
                cold_seconds = split(il, n_tok, cold_mode, in, out);
            }
            device_layer_modes_[size_t(il)] = cold_mode;
            stream_on_device_ = !out;
            if (out) take_device_layers(n_tok);
            stats_.times.attention += seconds_since(t0) - cold_seconds;
            continue;
        }
        attention(il, n_tok, cold_mode);
        if (!hp_.parallel_block) add_residual(rs_->tmp.data(), n_tok);
        stats_.times.attention += seconds_since(t0);
        ffn(il, n_tok, cold_mode);
        if (hp_.parallel_block) add_residual(rs_->tmp.data(), n_tok);
    }
    if (stepping()) {
        for (int64_t t = 0; t < n_tok; ++t) {
            Sequence &sq = rs_->seqs[size_t(steps_[size_t(t)])];
            sq.history[size_t(sq.n_past++)] = tokens[t];
        }
    } else {
        for (int64_t t = 0; t < n_tok; ++t) rs_->seq().history[size_t(rs_->seq().n_past + t)] = tokens[t];
        rs_->seq().n_past += n_tok;
    }

    ran_ = true;
    if (!want_logits) return;
    t0 = Clock::now();
    output(n_tok, logits, ld_logits);
    stats_.times.output += seconds_since(t0);
}

void Engine::embed(const int32_t *tokens, int64_t n_tok) {
    const int64_t E = hp_.n_embd;
    float *x = rs_->x.data();
    const TypeKernels &ke = ks_->for_type(model_->tok_embd().type);
    for (int64_t t = 0; t < n_tok; ++t) ke.to_float(int(E), model_->tok_embd().row(tokens[t]), x + t * E);
    if (hp_.embd_scale) {  // gemma3: sqrt(n_embd) times the embedding
        const float scale = std::sqrt(float(E));
        for (int64_t i = 0; i < n_tok * E; ++i) x[i] *= scale;
    }
    if (!hp_.learned_pos) return;
    const Matrix &pe = model_->pos_embd();
    const TypeKernels &kp = ks_->for_type(pe.type);
    float *tmp = rs_->tmp.data();
    for (int64_t t = 0; t < n_tok; ++t) {
        const int64_t pos = stepping() ? rs_->seqs[size_t(steps_[size_t(t)])].n_past : rs_->seq().n_past + t;
        kp.to_float(int(E), pe.row(pos + hp_.pos_offset), tmp);
        for (int64_t i = 0; i < E; ++i) x[t * E + i] += tmp[i];
    }
}

void Engine::attention(int64_t il, int64_t n_tok, TierMode cold_mode) {
    const Layer &L = model_->layers()[size_t(il)];
    RunState &s = *rs_;
    const int64_t E = hp_.n_embd, Q = hp_.n_head * hp_.d_head, KV = hp_.n_head_kv * hp_.d_head;
    if (device_ && device_->attends(il)) {  // the whole block on the device, its KV cache there too
        if (n_tok == 1 && cold_mode == TierMode::Predictor) prefetch_predictor(L);
        device_->attend(il, n_tok, s.seq().n_past, s.x.data(), s.tmp.data());
        return;
    }
    norm(s.x.data(), L.attn_norm, L.attn_norm_b, n_tok, s.xn.data());
    s.op_xn.q_ready = false;
    const MatmulTarget qkv[3] = {{&L.wq, s.q.data(), Q}, {&L.wk, s.k.data(), KV}, {&L.wv, s.v.data(), KV}};
    if (input_on()) input_qkv(L, il, n_tok);
    else matmul(qkv, 3, s.op_xn, n_tok);
    add_bias(s.q.data(), L.bq, n_tok, Q);
    add_bias(s.k.data(), L.bk, n_tok, KV);
    add_bias(s.v.data(), L.bv, n_tok, KV);
    if (L.q_norm.data) {  // queries and keys RMS-normed before RoPE: each head's (qwen3) or all of a token's (olmoe)
        head_norm(s.q.data(), L.q_norm, n_tok * Q / L.q_norm.cols);
        head_norm(s.k.data(), L.k_norm, n_tok * KV / L.k_norm.cols);
    }
    const int64_t window = hp_.swa_layer(il) ? hp_.n_swa : 0;
    if (stepping()) {  // each row its own sequence's decode step: its cache, its position
        for (int64_t t = 0; t < n_tok; ++t) {
            s.cur = steps_[size_t(t)];
            store_kv(il, 1, t);
            decode_heads(s.kv_layer(hp_, il, true, s.seq()), s.kv_layer(hp_, il, false, s.seq()), s.seq().n_past + 1,
                         window, t);
        }
    } else {
        store_kv(il, n_tok);
        // The predictor's weights come from DRAM every step (too little to stream at speed once the FFN asks
        // for them); asked for now, they arrive while the heads read the KV cache.
        if (n_tok == 1 && cold_mode == TierMode::Predictor) prefetch_predictor(L);
        const RunState::KvLayer kc = s.kv_layer(hp_, il, true, s.seq()), vc = s.kv_layer(hp_, il, false, s.seq());
        if (n_tok == 1) decode_heads(kc, vc, s.seq().n_past + 1, window);
        else batch_heads(kc, vc, n_tok, window);
    }
    s.op_att.q_ready = false;
    const MatmulTarget wo[1] = {{&L.wo, s.tmp.data(), E}};
    if (input_on()) input_output_projection(L, il, n_tok);
    else matmul(wo, 1, s.op_att, n_tok);
    add_bias(s.tmp.data(), L.bo, n_tok, E);
    post_norm(s.tmp.data(), L.attn_post_norm, n_tok);
}

// RoPE on the batch's queries and keys, then its keys and values into layer il's cache: each position into its
// kv heads' tiles of kKeyTile positions (RunState's layout), keys [D][kKeyTile] (a query's scores over a tile are
// a gemm over contiguous rows), values [kKeyTile][D]; a q8_0 cache's each 32 of a head's elements one block.
void Engine::store_kv(int64_t il, int64_t n_tok, int64_t row) {
    RunState &s = *rs_;
    const int64_t D = hp_.d_head, H = hp_.n_head, HKV = hp_.n_head_kv, Q = H * D, KV = HKV * D, half = hp_.n_rot / 2;
    // llama.cpp "normal" mode rotates adjacent pairs (the converter permuted llama's q/k rows to match), NeoX
    // mode (falcon) pairs i with i + n_rot/2; the first n_rot dims of each head
    const bool neox = hp_.rope == RopeKind::NeoX;
    const bool local = hp_.swa_layer(il);  // a sliding-window layer's RoPE has a base of its own
    const float *cos_table = (local ? s.rope_cos_swa : s.rope_cos).data();
    const float *sin_table = (local ? s.rope_sin_swa : s.rope_sin).data();
    auto rope = [&](float *vec, int64_t n_heads, int64_t pos) {
        if (hp_.rope == RopeKind::None) return;
        const float *c = cos_table + pos * half, *sn = sin_table + pos * half;
        for (int64_t h = 0; h < n_heads; ++h) {
            float *v = vec + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                const float x0 = v[i0], x1 = v[i1];
                v[i0] = x0 * c[i] - x1 * sn[i];
                v[i1] = x0 * sn[i] + x1 * c[i];
            }
        }
    };
    const RunState::KvLayer kc = s.kv_layer(hp_, il, true, s.seq()), vc = s.kv_layer(hp_, il, false, s.seq());
    // element i of a layer's cache set to v (rounded to the nearest half in an f16 cache)
    auto put = [&](uint8_t *cache, int64_t i, float v) {
        if (s.kv_type == PI_KV_F16) reinterpret_cast<uint16_t *>(cache)[i] = f32_to_f16(v);
        else reinterpret_cast<float *>(cache)[i] = v;
    };
    // a q8_0 cache: a head's D elements as D / 32 blocks (quantize_q8_0's), their quants and scales apart
    std::vector<BlockQ8_0> blocks(size_t(s.kv_type == PI_KV_Q8_0 ? D / QK : 0));
    for (int64_t t = 0; t < n_tok; ++t) {
        const int64_t pos = s.seq().n_past + t, col = pos % kKeyTile, r = row + t;
        rope(s.q.data() + r * Q, H, pos);
        rope(s.k.data() + r * KV, HKV, pos);
        for (int64_t kvh = 0; kvh < HKV; ++kvh) {
            const float *k = s.k.data() + r * KV + kvh * D, *v = s.v.data() + r * KV + kvh * D;
            const int64_t tile = rs_->kv_tile(HKV, D, kvh, pos), kt = tile + col, vt = tile + col * D;
            if (s.kv_type == PI_KV_Q8_0) {
                ks_->quantize_q8_0(int(D), k, blocks.data());
                for (int64_t b = 0; b < D / QK; ++b) {  // keys: down the column, the tile's scales [D / 32][kKeyTile]
                    for (int64_t i = 0; i < QK; ++i) kc.data[kt + (b * QK + i) * kKeyTile] = uint8_t(blocks[b].qs[i]);
                    kc.scales[(tile + b * QK * kKeyTile) / QK + col] = blocks[b].d;
                }
                ks_->quantize_q8_0(int(D), v, blocks.data());
                for (int64_t b = 0; b < D / QK; ++b) {  // values: along the row, a block's scale at its index / 32
                    std::memcpy(vc.data + vt + b * QK, blocks[b].qs, QK);
                    vc.scales[(vt + b * QK) / QK] = blocks[b].d;
                }
                continue;
            }
            for (int64_t d = 0; d < D; ++d) {
                put(kc.data, kt + d * kKeyTile, k[d]);
                put(vc.data, vt + d, v[d]);
            }
        }
    }
}

void Engine::gemm_cache(int n_tok, int n_rows, int n_cols, const float *h, int ldh, RunState::KvLayer cache,
                        bool keys, int64_t at, int ldw, float *y, int ldy) const {
    switch (rs_->kv_type) {
        case PI_KV_F16:
            return ks_->gemm_f16(n_tok, n_rows, n_cols, h, ldh, reinterpret_cast<const uint16_t *>(cache.data) + at, ldw,
                                 y, ldy);
        case PI_KV_Q8_0: {
            const int8_t *q = reinterpret_cast<const int8_t *>(cache.data) + at;
            const uint16_t *s = cache.scales + at / QK;  // a tile's scales (kernels/kv_q8.h)
            if (keys) return ks_->gemm_q8_columns(n_tok, n_rows, n_cols, h, ldh, Q8Columns{q, s}, ldw, y, ldy);
            return ks_->gemm_q8_rows(n_tok, n_rows, n_cols, h, ldh, Q8Rows{q, s}, ldw, y, ldy);
        }
        default:
            return ks_->gemm_f32(n_tok, n_rows, n_cols, h, ldh, reinterpret_cast<const float *>(cache.data) + at, ldw, y,
                                 ldy);
    }
}

// Bytes asked for ahead at the start of the next run of a kv head's cache (a block's tiles lie together, blocks
// apart), while the current one is read.
constexpr size_t kRunPrefetch = 4096;

void Engine::value_sum(int n_tok, int64_t n_keys, const float *p, int ldp, RunState::KvLayer cache, int64_t kvh, float *y,
                       int ldy, int64_t first) const {
    // A block of positions at a time (its rows contiguous): the same fma chain per output element as one gemm
    // over all the rows, since gemm continues from y (the same bits); blocks before first's are all 0 and skipped.
    const int64_t D = hp_.d_head, block = rs_->kv_block;
    for (int64_t c = first / block * block; c < n_keys; c += block) {
        if (c + block < n_keys)  // the next block's start: another run of the cache
            prefetch_row(cache.data + rs_->kv_tile(hp_.n_head_kv, D, kvh, c + block) * rs_->kv_bytes(), kRunPrefetch);
        gemm_cache(n_tok, int(std::min(block, n_keys - c)), int(D), p + c, ldp, cache, false,
                   rs_->kv_tile(hp_.n_head_kv, D, kvh, c), int(D), y, ldy);
    }
}

void Engine::batch_heads(RunState::KvLayer kc, RunState::KvLayer vc, int64_t n_tok, int64_t window) {
    // Per query head and tile of kAttnTile tokens, two gemms: scores = q K^T over the keys the tile's last token
    // sees (earlier tokens' later keys get probability 0), out = p V.
    const int64_t D = hp_.d_head, H = hp_.n_head, HKV = hp_.n_head_kv, group = H / HKV, Q = H * D;
    const int64_t n_past = rs_->seq().n_past;
    const int64_t n_tiles = (n_tok + kAttnTile - 1) / kAttnTile, n_all = n_past + n_tok;
    const float scale = hp_.score_scale();
    const float *q = rs_->q.data();
    auto job = [&](int chunk, int n_chunks, int thread) {
        float *sc = rs_->scores.data() + int64_t(thread) * kAttnTile * n_ctx_;
        int64_t w0, w1;
        split_range(n_tiles * H, chunk, n_chunks, &w0, &w1);
        for (int64_t w = w0; w < w1; ++w) {
            const int64_t t0 = w / H * kAttnTile, h = w % H, kvh = h / group;
            const int64_t nt = std::min(kAttnTile, n_tok - t0), n_keys = n_past + t0 + nt;
            // the first key the tile's first token sees: no token of the tile sees one before it
            const int64_t first0 = window ? std::max<int64_t>(0, n_past + t0 + 1 - window) : 0;
            std::fill(sc, sc + nt * n_keys, 0.0f);
            for (int64_t c = first0 / kKeyTile * kKeyTile; c < n_keys; c += kKeyTile)
                gemm_cache(int(nt), int(D), int(std::min(kKeyTile, n_keys - c)), q + t0 * Q + h * D, int(Q), kc, true,
                           rs_->kv_tile(HKV, D, kvh, c), int(kKeyTile), sc + c, int(n_keys));
            for (int64_t t = 0; t < nt; ++t) {  // softmax over the keys token t sees, 0 for the others
                const int64_t n_valid = n_past + t0 + t + 1, first = window ? std::max<int64_t>(0, n_valid - window) : 0;
                std::fill(sc + t * n_keys, sc + t * n_keys + first, 0.0f);
                ks_->softmax(int(n_valid - first), scale, sc + t * n_keys + first);
                std::fill(sc + t * n_keys + n_valid, sc + (t + 1) * n_keys, 0.0f);
            }
            float *out = rs_->att.data() + t0 * Q + h * D;
            for (int64_t t = 0; t < nt; ++t) std::fill(out + t * Q, out + t * Q + D, 0.0f);
            value_sum(int(nt), n_keys, sc, int(n_keys), vc, kvh, out, int(Q), first0);
        }
    };
    // A head's keys and values come from the cache (memory-bound, not multiply-bound): its work is counted as
    // kCacheReadCost multiply-adds per float read.
    pool_->run(int(std::min<int64_t>(n_tiles * H, pool_->chunks_for(n_tok * H * n_all * D * 2 * kCacheReadCost, kGrain))), job);
}

void Engine::decode_heads(RunState::KvLayer kc, RunState::KvLayer vc, int64_t n_keys, int64_t window, int64_t row) {
    // The query heads that share a kv head read its keys and values once, as the rows of one gemm (up to
    // kHeadsPerTile of them), in three jobs: the scores by (kv head, key tile), so that any head counts split
    // evenly; each head's softmax; the outputs by (kv head, tile of its heads). The same fma chains, so the
    // same bits, as one head at a time.
    const int64_t D = hp_.d_head, H = hp_.n_head, HKV = hp_.n_head_kv, group = H / HKV;
    // the first key within the window, and the key tiles from it on (the scores of keys before it are never read)
    const int64_t first = window ? std::max<int64_t>(0, n_keys - window) : 0, tile0 = first / kKeyTile;
    const int64_t n_key_tiles = (n_keys + kKeyTile - 1) / kKeyTile - tile0;
    const int64_t n_head_tiles = (group + kHeadsPerTile - 1) / kHeadsPerTile;
    float *sc = rs_->scores.data();  // [head][n_keys]
    const float scale = hp_.score_scale();
    const int64_t reads = H * n_keys * D * kCacheReadCost;  // the keys, or the values
    auto scores = [&](int chunk, int n_chunks, int) {
        int64_t u0, u1;
        split_range(HKV * n_key_tiles, chunk, n_chunks, &u0, &u1);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t kvh = u / n_key_tiles, c = (tile0 + u % n_key_tiles) * kKeyTile;
            const int64_t cols = std::min(kKeyTile, n_keys - c);
            float *y = sc + kvh * group * n_keys + c;
            for (int64_t i = 0; i < group; ++i) std::fill(y + i * n_keys, y + i * n_keys + cols, 0.0f);
            if (u + 1 < u1) {  // the next tile's start, where it begins a run of its own (another block or head)
                const int64_t next = u + 1, nc = (tile0 + next % n_key_tiles) * kKeyTile;
                if (nc % rs_->kv_block == 0)
                    prefetch_row(kc.data + rs_->kv_tile(HKV, D, next / n_key_tiles, nc) * rs_->kv_bytes(), kRunPrefetch);
            }
            gemm_cache(int(group), int(D), int(cols), rs_->q.data() + row * H * D + kvh * group * D, int(D), kc, true,
                       rs_->kv_tile(HKV, D, kvh, c), int(kKeyTile), y, int(n_keys));
        }
    };
    pool_->run(int(std::min<int64_t>(HKV * n_key_tiles, pool_->chunks_for(reads, kGrain))), scores);
    auto softmax = [&](int chunk, int n_chunks, int) {
        int64_t h0, h1;
        split_range(H, chunk, n_chunks, &h0, &h1);
        for (int64_t h = h0; h < h1; ++h) {  // 0 from value_sum's first block to the window's first key
            std::fill(sc + h * n_keys + first / rs_->kv_block * rs_->kv_block, sc + h * n_keys + first, 0.0f);
            ks_->softmax(int(n_keys - first), scale, sc + h * n_keys + first);
        }
    };
    pool_->run(int(std::min<int64_t>(H, pool_->chunks_for(H * n_keys * kCacheReadCost, kGrain))), softmax);
    auto values = [&](int chunk, int n_chunks, int) {
        int64_t u0, u1;
        split_range(HKV * n_head_tiles, chunk, n_chunks, &u0, &u1);
        for (int64_t u = u0; u < u1; ++u) {
            const int64_t kvh = u / n_head_tiles, h0 = kvh * group + u % n_head_tiles * kHeadsPerTile;
            const int64_t nh = std::min(kHeadsPerTile, (kvh + 1) * group - h0);
            float *out = rs_->att.data() + row * H * D + h0 * D;
            std::fill(out, out + nh * D, 0.0f);
            value_sum(int(nh), n_keys, sc + h0 * n_keys, int(n_keys), vc, kvh, out, int(D), first);
        }
    };
    pool_->run(int(std::min<int64_t>(HKV * n_head_tiles, pool_->chunks_for(reads, kGrain))), values);
}

void Engine::prefetch_predictor(const Layer &L) const {
    const Matrix &fc1 = L.fc1;
    if (fc1.groups) prefetch_row(fc1.groups, size_t(fc1.n_groups * fc1.group_bytes()));
    const int64_t loose = fc1.rows - fc1.n_groups * kPackRows;  // rows outside the groups (all of an f16 fc1)
    if (loose > 0) prefetch_row(fc1.row(fc1.n_groups * kPackRows), size_t(loose) * fc1.row_bytes);
    prefetch_row(L.cold.fc2_storage.data(), L.cold.fc2_storage.size());  // transposed tiles or 8-row groups
}

// The layer's FFN: its hot and cold tiers submitted to their backends (the hot one first, so that a backend on
// another thread or device runs it while the cold one runs here), their partial outputs summed, hot then cold.
// The cold tier's gates and ups are held as the layer's decode steps read them: in 8-row groups where read whole,
// else as the mapped rows. A batch groups what every decode step of this mode reads whole and drops nothing: it
// packs what it needs as it goes, and the mapped rows its kernels read by index are handed back after it where
// groups hold them.
void Engine::ffn(int64_t il, int64_t n_tok, TierMode cold_mode) {
    const Layer &L = model_->layers()[size_t(il)];
    RunState &s = *rs_;
    const int64_t E = hp_.n_embd;
    // falcon 7B: attention's norm output is the FFN's too, where attention ran here
    if (L.ffn_norm.data != L.attn_norm.data || (device_ && device_->attends(il))) {
        norm(s.x.data(), L.ffn_norm, L.ffn_norm_b, n_tok, s.xn.data());
        s.op_xn.q_ready = false;
    }
    if (L.experts.present()) {  // a mixture of experts (engine/moe.h); ReLU experts gate first but in dense mode
        const Experts *next = il + 1 < hp_.n_layer ? &model_->layers()[size_t(il + 1)].experts : nullptr;
        const TierCounts c = moe_->run(L.experts, s.op_xn, n_tok, cold_mode == TierMode::Dense, s.y_cold.data(), il,
                                       next && next->present() ? next : nullptr);
        if (expert_trace_) {
            const int64_t k = hp_.n_expert_used;
            for (int64_t t = 0; t < n_tok; ++t)
                std::copy_n(moe_->choices() + t * k, k, trace_.data() + ((trace_at_ + t) * hp_.n_layer + il) * k);
        }
        add_residual(s.y_cold.data(), n_tok);
        stats_.take_ffn(il, n_tok, cold_mode, true, TierCounts{}, c);
        return;
    }
    // a decode step of several sequences: each row a decode step of its own (their kernels, their layout)
    const bool has_hot = L.hot.size() > 0, has_cold = L.cold.size() > 0, batch = n_tok > 1 && !stepping();
    float down_zero_at = -1.0f;
    if (input_ffn_on()) {
        if (disk_) fail(PI_ERR_UNSUPPORTED, "input sparsity's dense FFN reads the mapped FFN rows: with a memory budget, "
                                            "run it in predictor, gate or auto mode");
        // A decode step reads its kept inputs' weights; a batch, whose tokens together keep nearly every input, runs
        // the dense tier's batch kernels on the zeroed inputs (where the CPU's backend holds every neuron: a hot
        // tier's backend zeroes nothing).
        if (!batch || has_hot) return input_ffn(il, n_tok);
        zero_small(s.xn.data(), E, n_tok, input_thr(il, kSiteGateUp), s.xn.data());
        s.op_xn.q_ready = false;
        down_zero_at = input_thr(il, kSiteDown);
    }
    const TierJob cold_work = cold_job(il, n_tok, cold_mode, down_zero_at);
    TierJob hot_job{il, n_tok, FfnPolicy::hot_mode(cold_mode), &s.op_xn, &s.op_x, false, 0, s.y_hot.data()};
    hot_job.steps = stepping();
    if (has_hot) hot_->submit(hot_job);
    if (has_cold) cold_->submit(cold_work);
    const TierCounts hot = has_hot ? hot_->wait() : TierCounts{}, cold = has_cold ? cold_->wait() : TierCounts{};
    if (!has_cold) std::fill(s.y_cold.begin(), s.y_cold.begin() + n_tok * E, 0.0f);
    if (has_cold && batch) model_->release_grouped_rows(il, !reads_gate_whole(cold_mode), !reads_up_whole(cold_mode));
    if (has_hot)
        for (int64_t i = 0; i < n_tok * E; ++i) s.y_cold[size_t(i)] += s.y_hot[size_t(i)];
    add_bias(s.y_cold.data(), L.down_b, n_tok, E);
    post_norm(s.y_cold.data(), L.ffn_post_norm, n_tok);
    add_residual(s.y_cold.data(), n_tok);
    stats_.take_ffn(il, n_tok, cold_mode, has_cold, hot, cold);
    stats_.input.inputs += cold.down_inputs;
    stats_.input.zeroed += cold.down_zeroed;
    policy_.take(il, n_tok, cold_mode, hot, cold, has_cold ? cold_work.n_probe : 0);
}

TierJob Engine::cold_job(int64_t il, int64_t n_tok, TierMode cold_mode, float down_zero_at) {
    // auto's choice of a mode that reads a down row per neuron, on a file whose ffn_down is kept as stored
    if (cold_mode != TierMode::Dense && model_->layers()[size_t(il)].down.data) model_->transpose_down();
    const Layer &L = model_->layers()[size_t(il)];
    RunState &s = *rs_;
    // both tiers read the same operand: made once, here, before either starts
    prepare(*ks_, s.op_xn, n_tok, L.gate.type);
    prepare(*ks_, s.op_xn, n_tok, L.up.type);
    // The predictor's input, x as it stands: the residual entering the FFN block (llama family, opt), or the
    // layer's input in a parallel block (falcon), as PowerInfer feeds them.
    s.op_x.q_ready = false;
    if (n_tok == 1 || stepping()) {
        model_->arrange_cold_tier(il, reads_gate_whole(cold_mode), reads_up_whole(cold_mode), down_quads_for(cold_mode),
                                  true);
        stats_.layers[size_t(il)].kernel_changes += double(policy_.decode_step(il, cold_mode));
    } else if (ran_) {
        // the first batch after open arranges nothing: it packs each pass's groups in its scratch (docs/engine.md,
        // "Two layouts of a weight row"), and the first decode step arranges the layer; grouping every layer
        // serially, with the down quads no batch reads, would come before a fresh process's first token
        model_->arrange_cold_tier(il, policy_.batch_reads_gates_whole(il), policy_.mode() == PI_FFN_DENSE,
                                  down_quads_for(cold_mode), false);
    }
    TierJob job{il, n_tok, cold_mode, &s.op_xn, &s.op_x, recall_check_,
                policy_.probe_tokens(il, n_tok, cold_mode, s.seq().n_past), s.y_cold.data(), down_zero_at};
    job.steps = stepping();
    return job;
}

// A split layer: one device call runs attention and the FFN's norm on the stream there and sends the stream and
// its norm down (the cold tier's operand, the predictor's input) while its hot rows start; the cold tier runs here
// meanwhile; its output goes up and the device adds both tiers' to the stream. In predictor mode the device's
// hot rows are the ones the layer's predictor selects (PowerInfer's split), as every neuron is on the CPU alone.
double Engine::split(int64_t il, int64_t n_tok, TierMode cold_mode, bool in, bool out) {
    const Layer &L = model_->layers()[size_t(il)];
    RunState &s = *rs_;
    const TierMode hot = FfnPolicy::hot_mode(cold_mode);
    const bool predicted = policy_.mode() == PI_FFN_PREDICTOR && cold_mode == TierMode::Predictor && device_->predicts(il);
    const int32_t hot_mode = hot == TierMode::Dense ? PI_DEVICE_HOT_DENSE : predicted ? PI_DEVICE_HOT_PREDICTOR : PI_DEVICE_HOT_RULE;
    if (n_tok == 1 && cold_mode == TierMode::Predictor) prefetch_predictor(L);
    float *x = s.x.data();
    device_->split_begin(il, n_tok, s.seq().n_past, hot_mode, in ? x : nullptr, x, s.xn.data());
    s.op_xn.q_ready = false;
    const auto t0 = Clock::now();
    const TierJob job = cold_job(il, n_tok, cold_mode, -1.0f);
    const TierCounts cold = cold_->run(job);
    if (n_tok > 1) model_->release_grouped_rows(il, !reads_gate_whole(cold_mode), !reads_up_whole(cold_mode));
    const double cold_seconds = seconds_since(t0);
    device_->split_end(s.y_cold.data(), out ? x : nullptr);
    split_cold_[size_t(il)] = SplitCold{true, cold, job.n_probe};
    return cold_seconds;
}

bool Engine::split_layer(int64_t il) const {
    const Layer &L = model_->layers()[size_t(il)];
    return device_ && device_->splits(il) && L.hot.size() > 0 && L.cold.size() > 0 && !L.down_b.data &&
           !L.ffn_post_norm.data && L.ffn_norm.data && !input_on();
}

bool Engine::device_layer(int64_t il) const {
    const Layer &L = model_->layers()[size_t(il)];
    return device_ && device_->runs_layer(il) && L.hot.size() > 0 && L.cold.size() == 0 && !L.down_b.data &&
           L.ffn_norm.data && !input_on();
}

void Engine::take_device_layers(int64_t n_tok) {
    for (const auto &[il, hot] : device_->take_layers()) {
        const TierMode mode = device_layer_modes_[size_t(il)];
        SplitCold &c = split_cold_[size_t(il)];  // none for a whole layer
        stats_.take_ffn(il, n_tok, mode, c.has_cold, hot, c.counts);
        policy_.take(il, n_tok, mode, hot, c.counts, c.n_probe);
        c = SplitCold{};
    }
}

void Engine::output(int64_t n_tok, float *logits, int64_t ld_logits) {
    // Only the rows whose logits are wanted go through the head: all of them, or the last one.
    RunState &s = *rs_;
    const int64_t E = hp_.n_embd, V = hp_.n_vocab, first = logits ? 0 : n_tok - 1;
    if (device_ && device_->heads()) {  // the output norm and head on the device
        float *out = logits ? logits : s.seq().last_logits.data();
        device_->head(n_tok - first, stream_on_device_ ? nullptr : s.x.data() + first * E, first, out,
                      logits ? ld_logits : V);
        if (stream_on_device_) take_device_layers(n_tok);
        stream_on_device_ = false;
        if (logits) std::memcpy(s.seq().last_logits.data(), logits + (n_tok - 1) * ld_logits, size_t(V) * sizeof(float));
        return;
    }
    norm(s.x.data() + first * E, model_->output_norm(), model_->output_norm_b(), n_tok - first, s.xn.data());
    s.op_xn.q_ready = false;
    float *out = logits ? logits : s.seq().last_logits.data();
    const MatmulTarget head[1] = {{&model_->output(), out, ld_logits}};
    matmul(head, 1, s.op_xn, n_tok - first);
    if (stepping()) {  // each row is its sequence's last token
        for (int64_t t = 0; t < n_tok; ++t) {
            Sequence &sq = s.seqs[size_t(steps_[size_t(t)])];
            std::memcpy(sq.last_logits.data(), logits + t * ld_logits, size_t(V) * sizeof(float));
            sq.logits_current = true;
        }
    } else if (logits) {
        std::memcpy(s.seq().last_logits.data(), logits + (n_tok - 1) * ld_logits, size_t(V) * sizeof(float));
    }
}

void Engine::norm(const float *x, const Matrix &w, const Matrix &b, int64_t n_tok, float *out) const {
    const int64_t E = hp_.n_embd;
    const float *wv = w.floats(), *bv = b.floats();
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *xt = x + t * E;
        float *ot = out + t * E;
        if (hp_.norm == NormKind::Rms) {
            double ss = 0.0;
            for (int64_t i = 0; i < E; ++i) ss += double(xt[i]) * double(xt[i]);
            const float scale = 1.0f / std::sqrt(float(ss / double(E)) + hp_.norm_eps);
            for (int64_t i = 0; i < E; ++i) ot[i] = wv[i] * (xt[i] * scale);
        } else {  // LayerNorm: (x - mean) / sqrt(var + eps) * w + b
            double sum = 0.0;
            for (int64_t i = 0; i < E; ++i) sum += double(xt[i]);
            const double mean = sum / double(E);
            double ss = 0.0;
            for (int64_t i = 0; i < E; ++i) ss += (double(xt[i]) - mean) * (double(xt[i]) - mean);
            const float scale = 1.0f / std::sqrt(float(ss / double(E)) + hp_.norm_eps);
            for (int64_t i = 0; i < E; ++i) ot[i] = wv[i] * (float(double(xt[i]) - mean) * scale) + (bv ? bv[i] : 0.0f);
        }
    }
}

void Engine::head_norm(float *x, const Matrix &w, int64_t n_heads) const {
    const int64_t D = w.cols;
    const float *wv = w.floats();
    for (int64_t h = 0; h < n_heads; ++h) {
        float *v = x + h * D;
        double ss = 0.0;
        for (int64_t i = 0; i < D; ++i) ss += double(v[i]) * double(v[i]);
        const float scale = 1.0f / std::sqrt(float(ss / double(D)) + hp_.norm_eps);
        for (int64_t i = 0; i < D; ++i) v[i] = wv[i] * (v[i] * scale);
    }
}

void Engine::post_norm(float *y, const Matrix &w, int64_t n_tok) const {
    if (w.data) norm(y, w, Matrix{}, n_tok, y);  // in place: each element is read before it is written
}

void Engine::add_bias(float *y, const Matrix &b, int64_t n_tok, int64_t ld) const {
    const float *bv = b.floats();
    if (!bv) return;
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t i = 0; i < b.cols; ++i) y[t * ld + i] += bv[i];
}

void Engine::add_residual(const float *y, int64_t n_tok) {
    for (int64_t i = 0; i < n_tok * hp_.n_embd; ++i) rs_->x[size_t(i)] += y[i];
}

}  // namespace pi
