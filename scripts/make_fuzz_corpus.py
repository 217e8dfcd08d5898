"""Write the engine fuzzer's seed corpus (tests/fuzz_corpus/): small valid files from the real writers.

A micro Llama (1 layer, n_embd 32, n_ff 32, a 32-token SentencePiece vocabulary) is saved as a Hugging
Face checkpoint and converted by `convert_model` in each tensor type, with and without predictors, as
ReLU, SiLU (per-layer thresholds) and bamboo, and as mixtures of 4 experts (a ReLU Mixtral, a Qwen3-MoE); a GPU index from `placement.write_gpuidx` is appended to
some after the fuzz target's separator (see csrc/fuzz/fuzz_load.cpp). Beside them, llama.cpp's layout (magic
GGUF, ffn_down) in the types the engine decodes at load: random valid blocks, n_ff 256 so that ffn_down's rows
take each k-quant. Each file is a few tens of KB at most.

With --regressions it writes instead the inputs of the fuzzer's past findings, remade from the seeds, into
tests/fuzz_regressions/ (tests/engine/test_fuzz_inputs.py loads them; each must be refused with a message):
    alignment-{1,2,4}  relu-f32 laid out at general.alignment 1, 2, 4: f32 tensors loaded misaligned (UBSan), until
                       the loader refused an alignment below the GGUF spec's 8

    python scripts/make_fuzz_corpus.py [OUT_DIR]
    python scripts/make_fuzz_corpus.py --regressions [OUT_DIR]
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from convert_helpers import write_predictors  # noqa: E402
from engine_helpers import rewrite  # noqa: E402
from kquants import Q, random_bf16, random_blocks  # noqa: E402

from powerinfer_tools.stages.conversion.conversion import convert_model  # noqa: E402
from powerinfer_tools.stages.placement.placement import Plan, write_gpuidx  # noqa: E402

SPLIT = b"\n--pi-fuzz-gpuidx--\n"  # fuzz_load.cpp's kSplit
N_EMBD, N_FF, N_HEAD, N_KV, VOCAB = 32, 32, 2, 1, 32


def micro_model(out: Path, kind: str) -> Path:
    """A 1-layer Llama/Mistral(bamboo)/Mixtral/Qwen3-MoE checkpoint with a 32-piece SentencePiece tokenizer."""
    import sentencepiece as spm
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                              MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    out.mkdir(parents=True)
    rng = random.Random(0)
    text = "\n".join(" ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 4))) for _ in range(10))
                     for _ in range(200))
    (out / "text.txt").write_text(text)
    spm.SentencePieceTrainer.train(input=str(out / "text.txt"), model_prefix=str(out / "sp"), vocab_size=VOCAB,
                                   model_type="bpe", byte_fallback=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    (out / "sp.model").rename(out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False}))
    common = dict(vocab_size=VOCAB, hidden_size=N_EMBD, intermediate_size=N_FF, num_hidden_layers=1,
                  num_attention_heads=N_HEAD, num_key_value_heads=N_KV, max_position_embeddings=64,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, hidden_act="relu" if kind != "silu" else "silu")
    torch.manual_seed(0)
    if kind == "bamboo":
        model = MistralForCausalLM._from_config(MistralConfig(**common, sliding_window=None,
                                                              architectures=["BambooForCausalLM"]))
    elif kind == "mixtral-relu":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen3moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**common, "hidden_act": "silu"}, num_experts=4,
                                                   num_experts_per_tok=2, moe_intermediate_size=N_FF))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=kind == "silu"))
    model.save_pretrained(out, safe_serialization=True)
    if kind == "bamboo":
        cfg = json.loads((out / "config.json").read_text())
        cfg["architectures"] = ["BambooForCausalLM"]
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def llama_cpp_file(path: Path, down: Q, others: list[Q]) -> None:
    """A 1-layer llama.cpp SiLU llama (n_embd 32, n_ff 256): ffn_down in `down`, the other matrices in `others`
    in turn, the embedding q8_0; random weights."""
    import gguf

    rng = np.random.default_rng(int(down))
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_embedding_length(N_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(256)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(64)
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        w.add_tensor(f"{name}.weight", np.ones(N_EMBD, np.float32))
    kv = N_EMBD // N_HEAD * N_KV
    shapes = {"token_embd": (VOCAB, N_EMBD), "blk.0.attn_q": (N_EMBD, N_EMBD), "blk.0.attn_k": (kv, N_EMBD),
              "blk.0.attn_v": (kv, N_EMBD), "blk.0.attn_output": (N_EMBD, N_EMBD), "blk.0.ffn_gate": (256, N_EMBD),
              "blk.0.ffn_up": (256, N_EMBD), "blk.0.ffn_down": (N_EMBD, 256)}
    for k, (name, shape) in enumerate(shapes.items()):
        qtype = Q.Q8_0 if name == "token_embd" else down if name == "blk.0.ffn_down" else others[k % len(others)]
        data = random_bf16(*shape, rng) if qtype == Q.BF16 else random_blocks(qtype, *shape, rng)
        w.add_tensor(f"{name}.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gpuidx_bytes(work: Path, hot: np.ndarray) -> bytes:
    idx = np.flatnonzero(hot).astype(np.int64)
    one = np.ones(1, np.int64)
    plan = Plan(model="micro", vram_budget=0, ctx_size=64, dense="cpu", offload_output=False, n_ff=np.array([N_FF]),
                gpu_neurons=np.array([len(idx)]), gpu_index=[idx], min_neurons=one, served=one, total=one,
                breakdown={"ffn": 4096})
    path = work / "plan.gpuidx"
    write_gpuidx(plan, path)
    return path.read_bytes()


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        preds = write_predictors(work / "pred", 1, N_EMBD, N_FF, rank=8, thresholds=[0.0])
        profile = work / "profile"
        profile.mkdir()
        (profile / "profile.json").write_text(json.dumps({"thresholds": [0.05]}))
        hot = np.zeros(N_FF, bool)
        hot[::3] = True
        index = gpuidx_bytes(work, hot)
        cases = [("relu", "f32", None, None, False), ("relu", "q8_0", preds, None, True),
                 ("relu", "q4_0", preds, None, False), ("silu", "f16", None, profile, True),
                 ("silu", "q4_0", preds, profile, False), ("bamboo", "q8_0", preds, None, True),
                 ("mixtral-relu", "q8_0", None, None, False), ("qwen3moe", "q8_0", None, None, False)]
        sources = {}
        for kind, outtype, pred, prof, with_index in cases:
            if kind not in sources:
                sources[kind] = micro_model(work / kind, kind)
            name = f"{kind}-{outtype}{'-pred' if pred else ''}"
            target = work / f"{name}.gguf"
            convert_model(str(sources[kind]), target, outtype=outtype, predictors_dir=pred, profile_dir=prof,
                          progress=False)
            data = target.read_bytes() + (SPLIT + index if with_index else b"")
            (out_dir / (name + ("+gpuidx" if with_index else ""))).write_bytes(data)
        shutil.copy(work / "plan.gpuidx", out_dir / "gpuidx-alone")  # a GPU index where a model belongs
        others = [Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16]
        for down in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            llama_cpp_file(out_dir / f"llama-cpp-{down.name.lower()}", down, others)
            others = others[1:] + others[:1]
    for p in sorted(out_dir.iterdir()):
        print(f"{p.stat().st_size:7d}  {p.name}")


def regressions(out_dir: Path) -> None:
    """The fuzzer's past findings, remade from the seed corpus (see the module's docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    seed = ROOT / "tests" / "fuzz_corpus" / "relu-f32"
    for alignment in (1, 2, 4):
        rewrite(seed, out_dir / f"alignment-{alignment}", alignment=alignment)
    for p in sorted(out_dir.iterdir()):
        print(f"{p.stat().st_size:7d}  {p.name}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--regressions"]:
        regressions(Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests" / "fuzz_regressions")
    else:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "fuzz_corpus")
