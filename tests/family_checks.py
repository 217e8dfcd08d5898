"""What every family's tests (tests/arch) do the same way: a file's logits and greedy tokens against transformers; a
context the engine caps; a checkpoint's tensors written under gguf-py's names for an architecture, as llama.cpp's
converter writes them; input sparsity from a profile through the CLI; a ReLU variant through every sparse mode; a
config field refused by convert and its dry run in one line."""
from __future__ import annotations

import json
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from cli_helpers import assert_one_line_error, profiled, run_cli
from engine_helpers import (auto_run, engine_prompt_then_decode, finish_gguf, hf_logits, hf_model, max_rel_err,
                            predictor_rule, write_gpuidx)
from tiny_models import training_text

from powerinfer_tools import models
from powerinfer_tools.formats import names
from powerinfer_tools.formats.gguf_io import open_reader
from powerinfer_tools.models import arch


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    model, _ = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_computes_transformers_model(src, files, tokens: list[int], n_prompt: int, n_greedy: int,
                                       **options) -> None:
    """Each of `files` (the checkpoint at src converted, or as llama.cpp writes it), opened with `options`: its f32
    logits over `tokens` (the first n_prompt as one batch, the rest one by one) within 1e-4 of transformers' at every
    position, and its n_greedy greedy tokens after the rest of `tokens` transformers' own."""
    import powerinfer_engine as engine

    ref = hf_logits(src, tokens)
    prompt = tokens[:len(tokens) - n_greedy]
    greedy = hf_greedy(src, prompt, n_greedy)
    for path in files:
        with engine.Model(path, threads=2, **options) as m:
            err = max_rel_err(engine_prompt_then_decode(m, tokens, n_prompt), ref)
        assert err <= 1e-4, f"{path.name} drifts from transformers: {err:.2e} relative"
        with engine.Model(path, threads=2, **options) as m:
            assert list(m.generate(prompt, n_greedy)) == greedy, path.name


def assert_context_capped(path, cap: int, needle: str) -> None:
    """The engine runs `path` in `cap` positions by default and refuses a longer ctx_size in one line naming
    `needle` (what caps it)."""
    import powerinfer_engine as engine

    with engine.Model(path, threads=1) as m:
        assert m.n_ctx == cap
    with pytest.raises(engine.EngineError) as exc:
        engine.Model(path, threads=1, ctx_size=2 * cap)
    line = str(exc.value)
    assert len(line.splitlines()) == 1 and f"ctx_size {2 * cap} is larger than" in line and needle in line, line


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


def assert_relu_sparse_modes(src, path, tokens: list[int], n_prompt: int, tmp_path, monkeypatch) -> None:
    """The ReLU model at src (a family's variant, as `pi-tools sparsify` writes it), converted at f32 with random
    predictors to `path`, through every sparse mode as tests/engine/test_engine_logits.py checks llama-relu: dense
    within 1e-4 of transformers at every position; oracle and gate dense's values bit for bit (a skipped neuron's
    activation is an exact zero) while skipping neurons; predictor mode and auto the model with the masks they define
    (predictor_rule); a random hot tier beside the cold one, oracle giving dense's values up to rounding and predictor
    mode the rule with every hot neuron on; the hot rows on a device (its host emulation) giving the CPU's logits."""
    import powerinfer_engine as engine

    def run(mode, **kw):
        with engine.Model(path, threads=2, sparse_mode=mode, **kw) as m:
            return engine_prompt_then_decode(m, tokens, n_prompt), m.stats()

    dims = arch.for_config(models.load_config(models.resolve(str(src)))).dims()
    fields = open_reader(path).fields
    assert fields[names.KEY_FFN_ACTIVATION].contents() == "relu"
    dense, _ = run("dense")
    assert max_rel_err(dense, hf_logits(src, tokens)) <= 1e-4
    for mode in ("oracle", "gate"):
        logits, stats = run(mode)
        assert np.array_equal(logits, dense), mode
        assert stats["density"] < 0.9, mode
    rule = predictor_rule(path)
    logits, stats = run("predictor", recall_check=True)
    assert max_rel_err(logits, hf_logits(src, tokens, mask_fn=rule)) <= 1e-4
    assert all(0.2 < layer["recall"] < 0.8 for layer in stats["layers"])  # random predictors
    auto, predicted = auto_run(path, tokens, n_prompt)
    chose = [torch.from_numpy(p)[:, None] for p in predicted]
    by_choice = hf_logits(src, tokens, mask_fn=lambda i, x, a: torch.where(chose[i], rule(i, x, a), a))
    assert max_rel_err(auto, by_choice) <= 1e-4
    hot = [np.random.default_rng(3 + i).random(dims.n_ff) < 0.3 for i in range(dims.n_layer)]
    gpuidx = write_gpuidx(tmp_path / "tiers.gpuidx", hot)
    assert max_rel_err(run("oracle", gpuidx=gpuidx, cpu_hot_tier=True)[0], dense) <= 1e-5
    hot_t = [torch.from_numpy(h) for h in hot]
    logits, stats = run("predictor", gpuidx=gpuidx, cpu_hot_tier=True)
    hot_on = hf_logits(src, tokens, mask_fn=lambda i, x, a: torch.where(hot_t[i], a, rule(i, x, a)))
    assert max_rel_err(logits, hot_on) <= 1e-4
    assert [layer["hot_neurons"] for layer in stats["layers"]] == [int(h.sum()) for h in hot]
    cpu, dev, info, _ = emulated_device_run(path, tokens[:40], 24, dims.n_layer, dims.n_ff, tmp_path, monkeypatch)
    assert info["gpu"]["device"]["layers_on_device"] == dims.n_layer  # the device computes ReLU neurons
    assert max_rel_err(dev, cpu) <= 1e-4
