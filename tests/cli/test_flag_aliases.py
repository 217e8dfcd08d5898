"""Flags as llama.cpp spells them (-t threads, -p prompt, -c/--ctx-size) on every command they apply to, the old
spellings of version 0.1.0's first days gone (refused as unknown), and one default FFN mode and thread count."""
from __future__ import annotations

import pytest
import typer.main

from cli_helpers import run_cli
from powerinfer_tools.cli import app


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
    assert "-p" in run["prompt"].opts and "-p" in bench["n_prompt"].opts
    assert "-c" in perplexity["ctx"].opts and "--ctx-size" in perplexity["ctx"].opts


@pytest.mark.parametrize("args", [["convert", "--dry-run", "-m", "relullama-70b", "-t", "q4_0"],
                                  ["plan", "--dry-run", "-m", "bamboo-7b", "--vram-budget", "8", "-t", "q4_0"],
                                  ["report", ".", "-p", "pred"],
                                  ["perplexity", "-m", "x.gguf", "-f", "t.txt", "--ctx", "8"],
                                  ["bench", "-m", "smollm2", "-t", "q8_0"]])
def test_the_old_spellings_are_refused(args, capsys):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and ("No such option" in err or "valid integer" in err), err
