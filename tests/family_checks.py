"""What every family's tests (tests/arch) do the same way: a checkpoint's tensors written under gguf-py's names for
an architecture, as llama.cpp's converter writes them; input sparsity from a profile through the CLI; a config field
refused by convert and its dry run in one line."""
from __future__ import annotations

import json
import re
import shutil

import gguf
import numpy as np
from safetensors.numpy import load_file

from cli_helpers import assert_one_line_error, profiled, run_cli
from engine_helpers import finish_gguf
from tiny_models import training_text

from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader


def add_checkpoint_tensors(writer: gguf.GGUFWriter, model_dir, arch: gguf.MODEL_ARCH, n_layer: int,
                           norm_offset: float = 0.0, qk_heads: tuple[int, int] | None = None) -> None:
    """model_dir's model.safetensors under gguf-py's tensor names for `arch` (f32; norm_offset added to every norm
    weight, Gemma's 1 + w), then the file written and closed. Experts saved one module each (`...experts.N.w1`) are
    stacked in expert order into one 3-D tensor, as llama.cpp's converter merges them; qk_heads (query heads, kv
    heads): q and k rows permuted to adjacent RoPE pairs, as its llama converter does."""
    from powerinfer_tools.models.arch.llama_family import rope_to_adjacent

    name_map = gguf.get_tensor_name_map(arch, n_layer)
    tensors, experts = {}, {}
    for hf_name, data in load_file(model_dir / "model.safetensors").items():
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+\.weight)", hf_name)
        if expert:
            experts.setdefault(f"{expert[1]}.{expert[3]}", {})[int(expert[2])] = data
        else:
            tensors[hf_name] = data
    tensors.update({merged: np.stack([parts[e] for e in range(len(parts))]) for merged, parts in experts.items()})
    for hf_name, data in tensors.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        heads = {"blk": None} if qk_heads is None else {"attn_q": qk_heads[0], "attn_k": qk_heads[1]}
        heads = heads.get(name.split(".")[-2])
        data = rope_to_adjacent(data, heads) if heads else data
        writer.add_tensor(name, data.astype(np.float32) + (norm_offset if name.endswith("norm.weight") else 0.0))
    finish_gguf(writer)


def llama_cpp_writer(model_dir, dst, arch: gguf.MODEL_ARCH) -> tuple[gguf.GGUFWriter, dict]:
    """A gguf-py writer of `arch` at dst with the keys llama.cpp's TextModel writes from model_dir's config.json for
    every family (the context, widths, layer and head counts, RMSNorm epsilon; head_dim as key/value_length where the
    config has one: the family writes its RoPE), and the config."""
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    return writer, config


def add_bpe_vocab(writer: gguf.GGUFWriter, model_dir, n_vocab: int, pre: str = "qwen2") -> None:
    """The checkpoint's byte-level BPE vocabulary as llama.cpp's _set_vocab_gpt2 writes it: its tokens (special ones
    CONTROL), pre-tokenizer `pre`, merges, special tokens and chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    types = [gguf.TokenType.CONTROL if i in added and added[i].special else gguf.TokenType.NORMAL
             for i in range(n_vocab)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([by_id[i] for i in range(n_vocab)])
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, model_dir, n_vocab: int) -> None:
    """The checkpoint's SentencePiece vocabulary as llama.cpp's _set_vocab_sentencepiece writes it: tokens, scores,
    types, the special tokens and the chat template."""
    from powerinfer_tools.formats.tokenizer import _sentencepiece_tokens

    tokens, scores, types = _sentencepiece_tokens(model_dir)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=False, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)


def assert_input_sparsity_runs(src, tmp_path, capsys) -> None:
    """profile --input-allocation, convert with its thresholds, run --sparse-mode input: each exit 0 (the logits
    against transformers with the same inputs zeroed: tests/engine/test_engine_input_sparsity.py)."""
    calib = tmp_path / "calib.txt"
    calib.write_text(training_text()[:40_000])
    prof = profiled(src, tmp_path / "prof", calib, 1024, 128, "--input-allocation", "uniform")
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(capsys, "convert", "-m", src, "--profile", prof, "--outtype", "f32", "-o", out, "-q",
                           "--input-thresholds")
    assert code == 0, err
    assert names.KEY_INPUT_THRESHOLDS in open_reader(out).fields
    code, _, err = run_cli(capsys, "run", "-m", out, "-p", "To be", "-n", "4", "--sparse-mode", "input")
    assert code == 0, err


def refused_fields(cases: list[tuple[str, dict, str]]):
    """pytest's parametrize of a family's (kind, config.json fields, what the line names) cases for
    assert_convert_refuses, each named by its kind and field."""
    import pytest

    return pytest.mark.parametrize("kind,fields,needle", cases, ids=[f"{k}-{n.split(' =')[0]}" for k, _, n in cases])


def convert_refusal_test(cases: list[tuple[str, dict, str]]):
    """A family module's test of its refused config fields (refused_fields' cases), through its `family(kind)` fixture
    (-> its model directory first)."""
    @refused_fields(cases)
    def test_unsupported_field_is_refused_by_convert_and_its_dry_run(kind, fields, needle, family, tmp_path, capsys):
        assert_convert_refuses(family(kind)[0], fields, needle, tmp_path, capsys)

    return test_unsupported_field_is_refused_by_convert_and_its_dry_run


def assert_convert_refuses(src, fields: dict, needle: str, tmp_path, capsys) -> None:
    """A copy of the checkpoint at src with `fields` set in its config.json: convert and convert --dry-run each
    refuse it in one line naming `needle`, and convert leaves no file."""
    model = tmp_path / "model"
    shutil.copytree(src, model)
    cfg = json.loads((model / "config.json").read_text())
    if "rope_scaling" in fields:
        cfg.pop("rope_parameters", None)
    (model / "config.json").write_text(json.dumps({**cfg, **fields}))
    out = tmp_path / "m.gguf"
    code, _, err = run_cli(capsys, "convert", "-m", model, "-o", out)
    assert_one_line_error(code, err, needle)
    assert not out.exists()
    code, _, err = run_cli(capsys, "convert", "--dry-run", "-m", model / "config.json")
    assert_one_line_error(code, err, needle)


def assert_same_tokenizer_and_template(src, gguf_file) -> str:
    """The tokenizer and chat template rebuilt from gguf_file encode and render as the checkpoint's own; the rendered
    chat, for a family's own checks."""
    from transformers import AutoTokenizer

    from powerinfer_tools.formats.tokenizer import tokenizer_from_file

    hf, rebuilt = AutoTokenizer.from_pretrained(src), tokenizer_from_file(gguf_file)
    text = training_text()[:2000] + " 12345, it's 3.14!!\n\n  done"
    assert rebuilt(text).input_ids == hf(text).input_ids
    chat = [{"role": "user", "content": "Who art thou?"}]
    rendered = rebuilt.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rebuilt.eos_token == hf.eos_token
    return rendered


def emulated_device_run(path, tokens: list[int], n_prompt: int, n_layer: int, n_ff: int, tmp_path, monkeypatch):
    """The logits of `path` with a random hot tier (30 % of each layer) computed on the CPU and through the host
    emulation of a device library (tests/engine/test_engine_device.py): (cpu, device, the device run's info and
    stats)."""
    import powerinfer_engine as engine

    from engine_helpers import engine_prompt_then_decode, write_gpuidx

    monkeypatch.setenv("PI_EMULATED_DEVICE_MIB", "512")
    monkeypatch.delenv("PI_EMULATED_DEVICES", raising=False)
    hot = write_gpuidx(tmp_path / "hot.gpuidx",
                       [np.random.default_rng(31 + i).random(n_ff) < 0.3 for i in range(n_layer)])

    def run(**kw):
        with engine.Model(path, threads=2, sparse_mode="dense", batch_size=16, gpuidx=hot, **kw) as m:
            return engine_prompt_then_decode(m, tokens, n_prompt), m.info, m.stats()

    cpu, _, _ = run(gpu="off", cpu_hot_tier=True)
    dev, info, stats = run(gpu="on", gpu_library=engine.device_library_path("emulated"))
    return cpu, dev, info, stats
