"""Flags as llama.cpp spells them (-t threads, -p prompt, -c/--ctx-size) on every command they apply to, one
meaning per spelling across commands, the old spellings of version 0.1.0's first days gone (refused as unknown),
and one default FFN mode, thread count and context."""
from __future__ import annotations

import typing
from collections import defaultdict
from pathlib import Path

import gguf
import pytest
import typer.main

from cli_helpers import run_cli
from engine_helpers import converted, rewrite  # noqa: F401
from powerinfer_tools.cli import app
from powerinfer_tools.stages import options


def _params(command: str) -> dict:
    click_command = typer.main.get_command(app).commands[command]
    return {p.name: p for p in click_command.params}


# every command that computes takes its thread count the same way
COMPUTING = ("profile", "train-predictor", "run", "chat", "serve", "perplexity", "bench")


@pytest.mark.parametrize("command", COMPUTING)
def test_threads_are_t_everywhere(command):
    threads = _params(command)["threads"]
    assert sorted(threads.opts) == ["--threads", "-t"]


def test_one_default_ffn_mode_and_thread_count():
    run, perplexity, bench = _params("run"), _params("perplexity"), _params("bench")
    assert run["sparse_mode"].default == perplexity["sparse_mode"].default == _params("chat")["sparse_mode"].default \
        == _params("serve")["sparse_mode"].default == "auto"
    assert run["threads"].default is perplexity["threads"].default is bench["threads"].default is None
    assert "-p" in run["prompt"].opts and "-p" not in bench["n_prompt"].opts
    assert "-c" in perplexity["ctx"].opts and "--ctx-size" in perplexity["ctx"].opts


@pytest.mark.parametrize("args", [["convert", "--dry-run", "-m", "relullama-70b", "-t", "q4_0"],
                                  ["plan", "--dry-run", "-m", "bamboo-7b", "--vram-budget", "8", "-t", "q4_0"],
                                  ["report", ".", "-p", "pred"],
                                  ["perplexity", "-m", "x.gguf", "-f", "t.txt", "--ctx", "8"],
                                  ["bench", "-m", "smollm2", "-t", "q8_0"]])
def test_the_old_spellings_are_refused(args, capsys):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and ("No such option" in err or "valid integer" in err), err


def _value_type(param) -> str:
    """An option's value type, None stripped from Optional[...]; 'switch' for a flag."""
    if getattr(param, "is_flag", False):
        return "switch"
    annotation = param.type_descriptor.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return getattr(args[0] if args else annotation, "__name__", str(annotation))


def _every_option():
    """(command, long spellings, short spellings, value type) of every option of every command."""
    for name, command in typer.main.get_command(app).commands.items():
        for p in command.params:
            if p.param_type_name == "option":
                spellings = [*p.opts, *p.secondary_opts]
                yield (name, tuple(sorted(o for o in spellings if o.startswith("--"))),
                       tuple(o for o in spellings if not o.startswith("--")), _value_type(p))


# one idea whose value is written otherwise in one command: profile's --target-sparsity is sparsify's share, or
# one share per layer (comma-separated text)
ONE_IDEA_TWO_FORMS = {("--target-sparsity", "profile")}


def test_one_meaning_per_spelling_across_commands():
    """A short flag names one long option everywhere, and a long option takes one kind of value everywhere (a
    switch in one command and a number in another is two ideas under one name)."""
    longs_of_short, types_of_long = defaultdict(set), defaultdict(set)
    for command, longs, shorts, value in _every_option():
        for short in shorts:
            longs_of_short[short].add((longs, command))
        for spelling in longs:
            if (spelling, command) not in ONE_IDEA_TWO_FORMS:
                types_of_long[spelling].add((value, command))
    clashes = [f"{short}: {sorted(uses)}" for short, uses in longs_of_short.items() if len({u for u, _ in uses}) > 1]
    clashes += [f"{spelling}: {sorted(uses)}" for spelling, uses in types_of_long.items()
                if len({t for t, _ in uses}) > 1]
    assert not clashes, "\n".join(clashes)


def test_the_walk_sees_a_second_meaning():
    """The test above would fail on the clashes it was written for (bench's -p, convert's --input-sparsity)."""
    seen = {(c, longs, shorts, v) for c, longs, shorts, v in _every_option()}
    assert ("run", ("--prompt",), ("-p",), "str") in seen
    assert ("run", ("--input-sparsity",), (), "float") in seen
    assert ("convert", ("--input-thresholds", "--no-input-thresholds"), (), "switch") in seen


CONTEXT_COMMANDS = ("run", "chat", "serve", "plan")


@pytest.mark.parametrize("command", CONTEXT_COMMANDS)
def test_one_default_context(command, capsys):
    """run, chat, serve and plan leave -c to the model (options.default_ctx_size), and say so in --help;
    perplexity's -c is its window."""
    assert _params(command)["ctx_size"].default is None
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and f"at most {options.CTX_CAP}" in " ".join(out.split())
    assert _params("perplexity")["ctx"].default == options.PERPLEXITY_WINDOW


def test_default_context_is_the_trained_one_capped():
    assert options.default_ctx_size(8192) == options.CTX_CAP == 4096
    assert options.default_ctx_size(1024) == 1024
    assert options.default_ctx_size(None) == options.TRAINED_CTX_UNKNOWN


@pytest.mark.parametrize("command", ["run", "perplexity", "chat", "serve"])
def test_model_help_names_every_input(command, capsys):
    code, out, _ = run_cli(capsys, command, "--help")
    text = " ".join(out.split())
    for kind in ("pi-tools convert", "llama.cpp GGUF", "q2_K to q6_K", "bf16", "q5_1",
                 "'smollm2'"):
        assert kind in text, kind


def _with_context(src: Path, dst: Path, trained: int) -> Path:
    """A copy of the converted file `src` trained, its metadata says, for `trained` tokens."""
    from powerinfer_tools.formats.gguf_header import read_header

    arch = read_header(src).get("general.architecture")
    return rewrite(src, dst, fields={f"{arch}.context_length": (trained, gguf.GGUFValueType.UINT32)})


@pytest.mark.parametrize("trained, want", [(8192, 4096), (1024, 1024)])
def test_the_engine_opens_the_default_context(converted, tmp_path, trained, want):
    """The context run opens a file with is the policy's, and the engine's own default (ctx_size 0) agrees."""
    import powerinfer_engine as engine

    from powerinfer_tools.runtime import inference

    path = _with_context(converted("llama-silu"), tmp_path / "m.gguf", trained)
    with inference.open_engine(inference.EngineTarget(path), threads=1) as ours, \
            engine.Model(path, threads=1) as engines:
        assert ours.n_ctx == engines.n_ctx == want


def test_a_600_token_prompt_runs_at_the_default_context(converted, tmp_path, capsys):
    """At 512 tokens, run's old default, this prompt failed ("--ctx-size 512 leaves no room")."""
    from powerinfer_tools.runtime import inference

    path = _with_context(converted("llama-silu"), tmp_path / "m.gguf", 8192)
    tokenizer = inference.load_tokenizer(path)
    prompt = "the history of the kingdom "
    while len(tokenizer(prompt)["input_ids"]) < 600:
        prompt += "the history of the kingdom "
    assert len(tokenizer(prompt)["input_ids"]) < 700
    code, out, err = run_cli(capsys, "run", "-m", path, "-p", prompt, "-n", "4", "--temp", "0", "-t", "1")
    assert code == 0, err
    assert out.startswith(prompt) and "no room" not in err
    code, _, err = run_cli(capsys, "run", "-m", path, "-p", prompt, "-n", "4", "-c", "512", "-t", "1")
    assert code == 1 and "leaves no room" in err
