"""pi-tools run / perplexity on tiny converted models: streamed text equals the engine's greedy
tokens decoded, perplexity equals transformers' on the same windows (dense and thresholded), and
bad input gives one line and exit status 1."""
from __future__ import annotations

import json
import re

import pytest
from engine_helpers import converted  # noqa: F401
from cli_helpers import run_cli
from tiny_models import N_LAYER, training_text

import powerinfer_engine as engine
from powerinfer_tools.runtime import evaluate, inference
from powerinfer_tools import models
from powerinfer_tools.stages.profiling.calibration import sequences_from_text
from powerinfer_tools.formats.tokenizer import tokenizer_from_file

PROMPT = "ROMEO: But soft, what light"


def test_run_streams_the_greedy_continuation(converted, capsys):
    path = converted("llama-relu")
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "12", "--temp", "0", "-t", "2",
                             "--sparse-mode", "gate", "-v")
    assert code == 0, err
    tok = tokenizer_from_file(path)
    ids = tok(PROMPT)["input_ids"]
    with engine.Model(path, threads=2, kv_type="f16") as m:  # run's default cache
        gen = [t for t in m.generate(ids, 12)]
    gen = gen[:gen.index(tok.eos_token_id)] if tok.eos_token_id in gen else gen
    expect = tok.decode(ids + gen, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]
    assert out == PROMPT + expect + "\n"
    assert "prompt eval time" in err and "eval time" in err and "ffn: mode gate, density" in err
    assert len(gen) > 1  # decode steps ran: each layer took gate mode's kernels or the dense rule's
    kernels = re.search(r"layers' decode kernels: (.*)", err).group(1)
    assert sum(int(n) for n in re.findall(r"(?:gate|dense_rule) (\d+)", kernels)) == N_LAYER, kernels
    assert f"memory: file {path.stat().st_size / 2**20:.1f} MiB mapped, KV cache " in err and "(f16)" in err
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "4", "-t", "2", "-c", "256",
                           "--kv-type", "f32", "-v")
    with engine.Model(path, ctx_size=256, kv_type="f32") as m:
        kv = m.info["kv_cache_bytes"]
    assert code == 0 and f"KV cache {kv / 2**20:.1f} MiB (f32)" in err, err


def test_run_reads_the_prompt_from_a_file(converted, tmp_path, capsys):
    path = converted("llama-relu")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    args = ["run", "-m", path, "-n", "6", "--temp", "0", "-t", "1"]
    from_file, from_argv = run_cli(capsys, *args, "-f", prompt_file), run_cli(capsys, *args, "-p", PROMPT)
    assert from_file[0] == 0 and from_file[1] == from_argv[1] and from_file[1].startswith(PROMPT)
    code, _, err = run_cli(capsys, *args, "-f", tmp_path / "missing.txt")
    assert code == 1 and "cannot read the prompt" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, *args)
    assert code == 1 and "--prompt TEXT or --file PATH" in err


def test_run_says_when_the_context_cuts_the_generation_short(converted, capsys):
    path = converted("llama-relu")
    n_prompt = len(tokenizer_from_file(path)(PROMPT)["input_ids"])
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "50", "--temp", "0", "-c", str(n_prompt + 3))
    assert code == 0, err
    assert f"generating at most 3 of the 50 asked (raise --ctx-size" in err
    assert out.startswith(PROMPT)
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "3", "--temp", "0", "-c", str(n_prompt + 3))
    assert code == 0 and "raise --ctx-size" not in err


def test_run_chat_template_and_seeded_sampling(converted, capsys):
    path = converted("llama-silu")
    args = ["run", "-m", str(path), "-p", PROMPT, "-n", "10", "--temp", "1.0", "--seed", "3"]
    first, second = run_cli(capsys, *args), run_cli(capsys, *args)
    assert first[0] == 0 and first[1] == second[1]
    code, _, err = run_cli(capsys, *args + ["--chat"])  # the tiny SentencePiece vocabulary has no template
    assert code == 1 and "no chat template" in err


@pytest.mark.parametrize("args,message", [
    (["-m", "/no/such.gguf"], "model file not found"),
    (["--sparse-mode", "fast"], "unknown --sparse-mode"),
    (["--sparse-mode", "predictor"], "has no predictors"),
    (["-t", "0"], "--threads must be at least 1"),
    (["--gpuidx", "/no/such.gpuidx"], "GPU index not found"),
    (["--kv-type", "q4_0"], "unknown --kv-type"),
    (["--kv-type", "q8_0"], "kv_type q8_0 needs a head size that is a multiple of 32; this model's is 16"),
    (["-c", "4294967360"], "ctx_size = 4294967360 is out of range"),  # not a 64-token context
    (["-t", "4294967297"], "threads = 4294967297 is out of range"),  # not one thread
    (["--top-k", str(2**40)], "top_k = 1099511627776 is out of range"),
    (["-p", "abc\udcff\udcfe"], "--prompt is not valid UTF-8 text (byte 0xff at character 3)"),  # $'abc\xff\xfe'
])
def test_run_bad_input(args, message, converted, capsys):
    base = {"-m": str(converted("llama-relu"))}
    argv = ["run", "-p", "hi"] + (args if "-m" in args else ["-m", base["-m"]] + args)
    code, out, err = run_cli(capsys, *argv)
    assert code == 1
    assert message in err and len(err.strip().splitlines()) == 1, err


def corpus(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(training_text()[:60_000])
    return path


@pytest.mark.parametrize("mode,thresholds", [("dense", None), ("gate", (0.05, 0.08))])
def test_perplexity_equals_transformers_on_the_same_windows(mode, thresholds, tmp_path, converted, tiny_model_dir,
                                                            capsys):
    path = converted("llama-silu", thresholds=thresholds)
    text = corpus(tmp_path)
    code, out, err = run_cli(capsys, "perplexity", "-m", path, "-f", text, "--ctx-size", "64", "--chunks", "6",
                             "--sparse-mode", mode, "--json", "-q")
    assert code == 0, err
    result = json.loads(out)
    assert result["windows"] == 6 and result["tokens"] == 6 * 63
    source = models.resolve(str(tiny_model_dir("llama-silu")))
    model, adapter = models.load_model(source)
    seqs = sequences_from_text(tokenizer_from_file(path), [text.read_text()], 64, 64 * 6)
    ref = evaluate.perplexity(model, adapter, seqs, thresholds=list(thresholds) if thresholds else None)
    assert result["perplexity"] == pytest.approx(ref, rel=1e-4)
    if thresholds:
        assert result["perplexity"] != pytest.approx(evaluate.perplexity(model, adapter, seqs), rel=1e-3)
        assert 0 < result["density"] < 1


def test_perplexity_with_an_f16_kv_cache(tmp_path, converted, capsys):
    """--kv-type f16: the same windows scored through a half-precision cache; the rounding of the cached keys
    and values moves the perplexity a little, never a lot."""
    path, text = converted("llama-silu"), corpus(tmp_path)
    results = {}
    for kv_type in ("f32", "f16"):
        code, out, err = run_cli(capsys, "perplexity", "-m", path, "-f", text, "--ctx-size", "64", "--chunks", "4",
                                 "--sparse-mode", "dense", "--kv-type", kv_type, "--json", "-q")
        assert code == 0, err
        results[kv_type] = json.loads(out)
    assert results["f16"]["kv_type"] == "f16"
    assert results["f16"]["perplexity"] != results["f32"]["perplexity"]
    assert results["f16"]["perplexity"] == pytest.approx(results["f32"]["perplexity"], rel=1e-2)


def test_perplexity_bad_input(tmp_path, converted, capsys):
    path = converted("llama-relu")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, message in [(["-f", str(empty)], "evaluation file"), (["-f", str(tmp_path / "none.txt")], "not found"),
                          (["-f", str(corpus(tmp_path)), "--ctx-size", "1"], "--ctx"),
                          (["-f", str(corpus(tmp_path)), "--ctx-size", "100000"], "shorter than one sequence")]:
        code, _, err = run_cli(capsys, "perplexity", "-m", path, *args)
        assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err


def test_run_finds_the_plan_that_plan_cached(converted, tmp_path, capsys):
    """`plan --vram-budget B` then `run --vram-budget B`, both at their default context: run reuses the plan (no
    --profile needed); at another context it says which plan is cached and for what."""
    import shutil

    from placement_fixtures import power_law_counts, write_profile

    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu"), model)
    profile = write_profile(tmp_path / "prof", power_law_counts(N_LAYER, 256, tokens=4096), tokens=4096)
    code, _, err = run_cli(capsys, "plan", "--profile", profile, "-m", model, "--vram-budget", "0.3")
    assert code == 0, err
    code, _, err = run_cli(capsys, "run", "-m", model, "-p", PROMPT, "-n", "2", "-t", "2", "--vram-budget", "0.3")
    assert code == 0, err
    code, _, err = run_cli(capsys, "run", "-m", model, "-p", PROMPT, "-n", "2", "--vram-budget", "0.3", "-c", "128")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    # the tiny models' trained context, 256, is their default
    assert "solved for 0.3 GiB and --ctx-size 256; this run asks for --ctx-size 128" in err


def test_run_ends_with_one_line_unless_verbose(converted, capsys):
    """Without -v a run's stderr is one line (load, prompt and generation rates, the FFN's mode and kernels), as
    the README's first run shows; -v gives llama.cpp's timings and the rest."""
    path = converted("llama-relu")
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "5", "--temp", "0", "-t", "2",
                             "--sparse-mode", "dense")
    assert code == 0 and out.startswith(PROMPT), err
    assert re.fullmatch(r"pi-tools: load [\d.]+ s, prompt \d+ tokens at [\d.]+ tokens/s, 5 generated at [\d.]+ "
                        r"tokens/s; ffn dense \(dense \d+ layers\)\n", err), err


def test_run_timings_without_nan_and_the_dense_ffn_line(converted, capsys):
    """-n 0 generates nothing and a one-token prompt (BOS alone) runs as a decode step, so the engine counts no
    prompt tokens: no rate to give for either, not nan; dense mode computes every neuron, which its ffn line says
    rather than a density."""
    path = converted("llama-relu")
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "0", "-t", "2", "--sparse-mode", "dense", "-v")
    assert code == 0, err
    assert not re.search(r"\bnan\b", err) and re.search(r"eval time = +[\d.]+ ms / +0 runs\n", err), err
    assert "ffn: mode dense, every neuron computed (" in err and "of them pass the activation rule)" in err
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", "", "-n", "3", "-t", "2", "--temp", "0", "-v")
    assert code == 0, err
    assert not re.search(r"\bnan\b", err) and "prompt eval time = (a one-token prompt runs as one of the eval" in err


def test_run_says_when_the_sparse_modes_cannot_pay(converted, capsys):
    """A sparse mode the user asked for that finds most neurons active is told so in one line on stderr, with what
    to do; dense mode, a really sparse run and auto (which chose its kernels itself) are not, unless auto's choice
    is not the exact model (sparse kernels on a SiLU model apply its thresholds)."""
    stats = {"ffn_mode": "gate", "density": 0.78, "layers": [{"decode_mode": "gate"}] * 30}
    assert "78% of the FFN neurons were active" in inference.sparsity_note(stats) and \
        "pi-tools sparsify" in inference.sparsity_note(stats)
    assert inference.sparsity_note(stats | {"density": 0.3}) is None
    assert inference.sparsity_note(stats | {"ffn_mode": "dense"}) is None
    auto = {"ffn_mode": "auto", "density": 0.78, "layers": [{"decode_mode": "dense"}] * 30}
    assert inference.sparsity_note(auto, "silu") is None and inference.sparsity_note(auto, "relu") is None
    mixed = auto | {"layers": [{"decode_mode": "dense"}] * 28 + [{"decode_mode": "gate"}] * 2}
    assert ("'auto' ran 28 of 30 layers dense; the other 2 through sparse kernels, at the file's activation "
            "thresholds: not the exact model") in inference.sparsity_note(mixed, "silu")
    assert inference.sparsity_note(mixed, "relu") is None  # a ReLU model's sparse kernels are exact
    path = converted("llama-relu")
    for mode in ("gate", "dense"):
        code, out, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "6", "-t", "2", "--sparse-mode", mode,
                               "-v")
        density = float(re.search(r"(?:density |computed \()([\d.]+)", err).group(1))
        noted = "too many for the sparse modes to save time" in err
        assert code == 0 and noted == (mode == "gate" and density > 0.5) and "note" not in out


def test_run_chat_answer_starts_on_its_own_line(converted, tmp_path, capsys):
    import gguf

    from engine_helpers import rewrite

    template = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    path = rewrite(converted("llama-relu"), tmp_path / "chat.gguf",
                   fields={"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)})
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", PROMPT, "-n", "4", "-t", "2", "--chat", "--temp", "0")
    assert code == 0, err
    assert out.startswith(PROMPT + "\n")


@pytest.mark.parametrize("args,message", [
    (["-c", "0"], "--ctx-size must be a number in [1, inf) tokens, not 0"),
    # one wording for every value out of range, in GiB and under the flag's name
    (["--vram-budget", "-1"], "--vram-budget must be a number in (0, 1048576] GiB, not -1"),
    (["--vram-budget", "0"], "--vram-budget must be a number in (0, 1048576] GiB, not 0"),
    (["--vram-budget", "nan"], "--vram-budget must be a number in (0, 1048576] GiB, not nan"),
    (["--vram-budget", "1e30"], "--vram-budget must be a number in (0, 1048576] GiB, not 1e+30"),
])
def test_run_bad_sizes_are_named_as_given(args, message, converted, capsys):
    code, _, err = run_cli(capsys, "run", "-m", converted("llama-relu"), "-p", "hi", *args)
    assert code == 1 and len(err.strip().splitlines()) == 1 and message in err, err


def test_run_on_a_directory_says_it_is_one(tiny_model_dir, capsys):
    model = tiny_model_dir("llama-relu")
    code, _, err = run_cli(capsys, "run", "-m", model, "-p", "hi")
    assert code == 1 and f"{model} is a directory, not a model file" in err and "not found" not in err, err
