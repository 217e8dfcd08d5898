"""Test-only: a tiny PowerInfer model file (tensor names and types as docs/formats.md specifies, random
weights) and a profile directory of activation counts, without running the converter or the profiler."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

N_EMBD, N_HEAD, N_KV, N_VOCAB = 64, 4, 2, 96


def write_model(path: Path, n_layer: int = 3, n_ff: int = 128, qtype: str = "Q8_0", n_vocab: int = N_VOCAB,
                n_embd: int = N_EMBD, n_head: int = N_HEAD, n_kv: int = N_KV, vocabulary: bool = False,
                data: bool = True, neuron_order: bool = False) -> Path:
    """Llama-family layout: weights at `qtype`, norms f32, predictors f16 (as a quantized conversion writes).
    `vocabulary`: the n_vocab-token SentencePiece vocabulary a converted file carries (tokens, scores, token
    types). `neuron_order`: the key a conversion with a profile writes (here each layer's neurons reversed).
    `data` False: the tensor table alone, the data zeros the file holds without writing them (a sparse
    file: a 7B model's table costs no disk)."""
    import gguf

    from powerinfer_tools.formats.gguf_io import set_pwri_magic

    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType[qtype]
    d_head = n_embd // n_head
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    if vocabulary:
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"<0x{i:02X}>" if i < 256 else f"\u2581tok{i}" for i in range(n_vocab)])
        writer.add_token_scores([-float(i) for i in range(n_vocab)])
        writer.add_token_types([6 if i < 256 else 1 for i in range(n_vocab)])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    if neuron_order:
        from powerinfer_tools.formats import neuron_order as order

        writer.add_string(order.ORDER_KEY, order.encode([np.arange(n_ff)[::-1]] * n_layer))

    def weight(name, rows, cols, as_type=kind):
        if not data:
            block, size = gguf.GGML_QUANT_SIZES[as_type]
            writer.add_tensor_info(name, (rows, cols), np.float32, rows * cols // block * size, raw_dtype=as_type)
            return
        data_ = rng.standard_normal((rows, cols)).astype(np.float32)
        if as_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data_)
        elif as_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, data_.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data_, as_type), raw_dtype=as_type)

    def norm(name):
        if data:
            writer.add_tensor(name, np.ones(n_embd, np.float32))
        else:
            writer.add_tensor_info(name, (n_embd,), np.float32, 4 * n_embd)

    weight("token_embd.weight", n_vocab, n_embd)
    norm("output_norm.weight")
    weight("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        weight(f"blk.{i}.attn_q.weight", n_head * d_head, n_embd)
        weight(f"blk.{i}.attn_k.weight", n_kv * d_head, n_embd)
        weight(f"blk.{i}.attn_v.weight", n_kv * d_head, n_embd)
        weight(f"blk.{i}.attn_output.weight", n_embd, n_head * d_head)
        norm(f"blk.{i}.ffn_norm.weight")
        for part in ("ffn_gate", "ffn_up", "ffn_down_t"):
            weight(f"blk.{i}.{part}.weight", n_ff, n_embd)
        weight(f"blk.{i}.fc1.weight", 16, n_embd, gguf.GGMLQuantizationType.F16)
        weight(f"blk.{i}.fc2.weight", n_ff, 16, gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    if data:
        writer.write_tensors_to_file()
    else:
        writer.write_ti_data_to_file()
        writer.fout[0].write(bytes(-writer.fout[0].tell() % writer.data_alignment))
        writer.fout[0].truncate(writer.fout[0].tell() + sum(
            gguf.GGUFWriter.ggml_pad(ti.nbytes, writer.data_alignment) for ti in writer.tensors[0].values()))
    writer.close()
    set_pwri_magic(path)
    return path


def write_profile(folder: Path, counts: list[np.ndarray], tokens: int | None = None) -> Path:
    """DIR/activation/activation_{i}.pt as the profiler writes them (int64), and profile.json's token count
    and (ReLU-family) zero thresholds."""
    (folder / "activation").mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(counts):
        torch.save(torch.as_tensor(c), folder / "activation" / f"activation_{i}.pt")
    if tokens is not None:
        (folder / "profile.json").write_text(json.dumps({"format": "powerinfer-tools.profile/1", "tokens": tokens,
                                                         "rule": "nonzero", "thresholds": [0.0] * len(counts)}))
    return folder


def power_law_counts(n_layer: int, n_ff: int, tokens: int = 4096, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_layer):
        rate = np.minimum(1.0, 0.8 * (np.arange(1, n_ff + 1) / 4.0) ** -rng.uniform(0.6, 1.2))
        out.append(rng.permutation(rng.binomial(tokens, rate)).astype(np.int64))
    return out
