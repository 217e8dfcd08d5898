"""The real SmolLM2-135M (a Q4_1 llama.cpp GGUF, q/k already in llama.cpp's row order) converted with
predictors at q8_0 and q4_0: the expected tensors with the formats' sizes (predictors in the weight
type), values equal to the weights transformers loads and to the predictors (dequantized, q/k back in HF order) after the documented transform,
and the carried-over vocabulary tokenizes like transformers' own GGUF tokenizer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from convert_helpers import read_fields, read_tensors, write_predictors
from test_convert import block_bound, rope_rows
from test_inspect import BYTES_PER_32

from powerinfer_tools import models
from powerinfer_tools.stages.conversion.conversion import convert_model
from powerinfer_tools.formats.gguf_io import open_reader

pytestmark = pytest.mark.slow
N_LAYER, N_EMBD, N_FF, N_HEAD, N_KV, VOCAB, RANK = 30, 576, 1536, 9, 3, 49152, 32


@pytest.fixture(scope="module")
def predictors(tmp_path_factory):
    return write_predictors(tmp_path_factory.mktemp("pred"), N_LAYER, N_EMBD, N_FF, rank=RANK)


@pytest.fixture(scope="module")
def converted(predictors, tmp_path_factory):
    """converted(outtype) -> (path, summary), each outtype converted once for the module."""
    cache = {}

    def get(outtype):
        if outtype not in cache:
            out = tmp_path_factory.mktemp(outtype) / f"smollm2.{outtype}.powerinfer.gguf"
            cache[outtype] = out, convert_model("smollm2", out, outtype, predictors_dir=predictors, progress=False)
        return cache[outtype]

    return get


@pytest.fixture(scope="module")
def hf_weights():
    model, _ = models.load_model(models.resolve("smollm2"))
    return {k: v.numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0"])
def test_smollm2(outtype, converted, hf_weights, predictors):
    out, summary = converted(outtype)
    assert summary["arch"] == "llama-silu" and summary["bytes_out"] == out.stat().st_size

    reader = open_reader(out)
    assert reader.fields["general.name"].contents() == "SmolLM2-135M-Instruct"  # not the source's ...Q4_1
    table = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name, int(t.n_bytes))
             for t in reader.tensors}
    per_layer = {"attn_norm": (N_EMBD,), "ffn_norm": (N_EMBD,), "attn_q": (N_EMBD, N_EMBD),
                 "attn_k": (N_KV * 64, N_EMBD), "attn_v": (N_KV * 64, N_EMBD), "attn_output": (N_EMBD, N_EMBD),
                 "ffn_gate": (N_FF, N_EMBD), "ffn_up": (N_FF, N_EMBD), "ffn_down_t": (N_FF, N_EMBD),
                 "fc1": (RANK, N_EMBD), "fc2": (N_FF, RANK)}
    # the head is tied: a SiLU file (one PowerInfer refuses) stores it once, as token_embd (conversion.tie_head)
    expected = {"token_embd.weight": (VOCAB, N_EMBD), "output_norm.weight": (N_EMBD,)}
    expected.update({f"blk.{i}.{k}.weight": s for i in range(N_LAYER) for k, s in per_layer.items()})
    assert {k: v[0] for k, v in table.items()} == expected
    for name, (shape, qtype, nbytes) in table.items():
        # predictors take the weight type too (rank 32: whole blocks), but a 4-bit file's fc1 and head are q8_0;
        # the down projection keeps the outtype: SmolLM2 is SiLU, a file PowerInfer refuses, so nothing to keep f16 for
        eight = ".fc1." in name or name == "token_embd.weight"
        want_type = "F32" if len(shape) == 1 else "Q8_0" if eight else outtype.upper()
        assert qtype == want_type, name
        assert nbytes == int(np.prod(shape)) // 32 * BYTES_PER_32[qtype], name

    fields = read_fields(out)
    assert fields["general.architecture"] == "llama-silu"  # PowerInfer refuses it (docs/formats.md)
    assert fields["llama-silu.attention.head_count"] == N_HEAD and fields["llama-silu.attention.head_count_kv"] == N_KV
    assert fields["llama-silu.context_length"] == 8192 and fields["llama-silu.rope.freq_base"] == 100000.0
    assert fields["powerinfer.ffn_activation"] == "silu" and len(fields["powerinfer.predictor_thresholds"]) == N_LAYER

    got = read_tensors(out)
    hf = hf_weights
    for i in (0, N_LAYER - 1):
        p = f"model.layers.{i}."
        checks = {f"blk.{i}.attn_q.weight": rope_rows(hf[p + "self_attn.q_proj.weight"], N_HEAD),
                  f"blk.{i}.attn_k.weight": rope_rows(hf[p + "self_attn.k_proj.weight"], N_KV),
                  f"blk.{i}.ffn_down_t.weight": hf[p + "mlp.down_proj.weight"].T,
                  f"blk.{i}.ffn_gate.weight": hf[p + "mlp.gate_proj.weight"]}
        for name, want in checks.items():
            if table[name][1] == "F16":
                np.testing.assert_allclose(got[name][1], want, rtol=1e-3, atol=1e-7, err_msg=name)
                continue
            err = np.abs(got[name][1] - want)
            assert np.all(err <= block_bound(np.ascontiguousarray(want), outtype.upper())), name
        np.testing.assert_array_equal(got[f"blk.{i}.attn_norm.weight"][1], hf[p + "input_layernorm.weight"])
        trained = torch.load(predictors / f"model_{i}.pt", weights_only=True)
        for key in ("fc1", "fc2"):
            want = trained[f"{key}.weight"].numpy()
            err = np.abs(got[f"blk.{i}.{key}.weight"][1] - want)
            assert np.all(err <= block_bound(want, "Q8_0" if key == "fc1" else outtype.upper())), key
    err = np.abs(got["token_embd.weight"][1] - hf["model.embed_tokens.weight"])
    assert np.all(err <= block_bound(hf["model.embed_tokens.weight"], "Q8_0"))


def test_smollm2_vocabulary_round_trip(converted):
    from transformers import AutoTokenizer

    from powerinfer_tools.formats.tokenizer import tokenizer_from_file

    out, _ = converted("q4_0")
    source = models.resolve("smollm2")
    ref = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    tok = tokenizer_from_file(out)
    text = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "  Indentation, numbers 1234567, ünïcödé and 日本語 — all here.\n")
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.decode(ref(text).input_ids) == ref.decode(ref(text).input_ids)
    assert tok.chat_template == ref.chat_template and tok.chat_template
