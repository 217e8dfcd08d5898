"""Flags as llama.cpp spells them (-t threads, -p prompt, -c/--ctx-size), the old spellings kept as deprecated
aliases that still work and say so in one line, and one default FFN mode and thread count for run, perplexity
and bench."""
from __future__ import annotations

import functools
import re

import pytest
import typer.main

from cli_helpers import run_cli
from powerinfer_tools.cli import app

NOTE = "is deprecated: use"


def deprecation_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if NOTE in line]


@pytest.mark.parametrize("command", [["convert", "--dry-run", "-m", "relullama-70b"],
                                     ["plan", "--dry-run", "-m", "bamboo-7b", "--vram-budget", "8"]])
def test_t_for_the_weight_type_still_works_and_says_so(command, capsys):
    code, new_out, new_err = run_cli(capsys, *command, "--outtype", "q4_0")
    assert code == 0 and not deprecation_lines(new_err)
    code, old_out, old_err = run_cli(capsys, *command, "-t", "q4_0")
    untimed = functools.partial(re.sub, r"[\d.]+ s\b", "")   # the solver's seconds vary from run to run
    assert code == 0 and untimed(old_out) == untimed(new_out)
    assert deprecation_lines(old_err) == ["pi-tools: -t is deprecated: use --outtype"]


@pytest.mark.parametrize("command", ["convert", "report"])
def test_p_for_the_predictors_still_works_and_says_so(command, tmp_path, monkeypatch, capsys):
    from powerinfer_tools import stages
    from powerinfer_tools.stages import report

    seen = []

    def convert(opts):  # stands in for the conversion: only the options it gets matter here
        seen.append(opts.predictors)
        raise SystemExit(0)

    monkeypatch.setattr(stages, "convert", convert)
    monkeypatch.setattr(report, "write_report", lambda profile, out, predictors, plan: seen.append(predictors))
    args = {"convert": ["convert", "-m", "model", "-o", tmp_path / "m.gguf"],
            "report": ["report", tmp_path, "-o", tmp_path / "r.html"]}[command]
    code, _, err = run_cli(capsys, *args, "-p", tmp_path / "pred")
    assert code == 0 and seen == [tmp_path / "pred"]
    assert deprecation_lines(err) == ["pi-tools: -p is deprecated: use --predictors"]
    code, _, err = run_cli(capsys, *args, "--predictors", tmp_path / "pred")
    assert code == 0 and seen[-1] == tmp_path / "pred" and not deprecation_lines(err)


def test_perplexity_ctx_is_ctx_size_now(capsys):
    code, _, err = run_cli(capsys, "perplexity", "-m", "x.gguf", "-f", "t.txt", "--ctx", "1")
    assert code == 1
    assert err.splitlines() == ["pi-tools: --ctx is deprecated: use --ctx-size",
                                "pi-tools: error: --ctx-size must be at least 2"]
    for spelling in ("--ctx-size", "-c"):
        code, _, err = run_cli(capsys, "perplexity", "-m", "x.gguf", "-f", "t.txt", spelling, "1")
        assert code == 1 and err.splitlines() == ["pi-tools: error: --ctx-size must be at least 2"]


def test_bench_takes_llama_bench_letters_and_the_old_meanings_with_a_note():
    from powerinfer_tools.bench.command import _number_or_old_meaning

    assert _number_or_old_meaning("4", "-t", "--outtype") == (4, None)
    assert _number_or_old_meaning(None, "-t", "--outtype") == (None, None)
    assert _number_or_old_meaning("q8_0", "-t", "--outtype") == (None, "q8_0")
    assert _number_or_old_meaning("preds", "-p", "--predictors") == (None, "preds")


def test_bench_old_t_reaches_the_weight_type(capsys):
    code, _, err = run_cli(capsys, "bench", "-m", "/nonexistent/model", "-t", "q8_0", "--peers", "")
    assert code == 1
    assert deprecation_lines(err) == ["pi-tools: -t q8_0 is deprecated: use --outtype q8_0"]


def _params(command: str) -> dict:
    click_command = typer.main.get_command(app).commands[command]
    return {p.name: p for p in click_command.params}


def test_one_default_ffn_mode_and_thread_count():
    run, perplexity, bench = _params("run"), _params("perplexity"), _params("bench")
    assert run["sparse_mode"].default == perplexity["sparse_mode"].default == "auto"
    assert run["threads"].default is perplexity["threads"].default is bench["threads"].default is None
    for params in (run, perplexity, bench):
        assert "-t" in params["threads"].opts
    assert "-p" in run["prompt"].opts and "-p" in bench["n_prompt"].opts
    assert "-c" in perplexity["ctx"].opts and "--ctx-size" in perplexity["ctx"].opts


@pytest.mark.parametrize("command,hidden", [("convert", "-t"), ("convert", "-p"), ("plan", "-t"), ("report", "-p"),
                                            ("perplexity", "--ctx")])
def test_help_shows_only_the_new_spellings(command, hidden, capsys):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert f" {hidden} " not in out and f" {hidden}," not in out and f"{hidden}\n" not in out
