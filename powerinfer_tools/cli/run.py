"""`pi-tools run`."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.core.errors import UserError


@flags.engine_options
@flags.sampling_options
def run(
    model: str = flags.model_option(),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (or --file)."),
    prompt_file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from this UTF-8 text "
                                               "file, as llama.cpp's -f: for a prompt longer than a command "
                                               "line takes; '-' reads it from stdin."),
    n_predict: int = typer.Option(128, "--n-predict", "-n", help="Tokens to generate (stops early at end of text)."),
    ctx_size: Optional[int] = flags.ctx_size_option("Plans (--vram-budget) are sized and cached for it, as 'plan' "
                                                    "sizes them."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template (one user turn)."),
    conversation: bool = typer.Option(False, "--conversation", "-cnv", "--interactive", "-i", help="Chat instead, "
                                      "as 'pi-tools chat' (llama.cpp's -cnv / -i): -p is then the system prompt."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="End with llama.cpp's timings, the FFN's density "
                                 "and kernels, where the time went and what the process holds (several lines), "
                                 "instead of one line."),
    engine: flags.EngineArgs = None,
    sampling: flags.SamplingArgs = None,
):
    """Generate text from a prompt with the bundled C++ engine, streaming it, then one line on stderr: load time,
    prompt and generation tokens/s, the FFN's mode (-v: llama.cpp-style timings and more).

    The tokenizer is rebuilt from the vocabulary stored in the file (no model directory or hub access) and
    cached, so later runs of the same file start faster.

    Examples:

      pi-tools run -m smollm2 -p "The capital of France is" -n 32 --temp 0   # builds it once, then cached

      pi-tools run -m smollm2.powerinfer.gguf -p "The capital of France is" -n 32 --temp 0 -v   # all timings

      pi-tools run -m smollm2 --vram-budget 0.3 -p "Hello"   # hot/cold split solved for 0.3 GiB

      pi-tools run -m smollm2 -c 8192 --kv-type f16 -p "Once upon a time" -n 4000   # a long text, half the cache

      pi-tools run -m smollm2.powerinfer.gguf -p "Write a haiku about the sea" --chat --sparse-mode gate -t 2

      pi-tools run -m smollm2 -f chapter1.txt -c 8192 -n 256   # a long prompt from a file

      pi-tools run -m relullama.q4_0.powerinfer.gguf --gpuidx relullama.generated.gpuidx -p "Hello" --seed 1

      pi-tools run -m relu7b.q4_0.powerinfer.gguf --vram-budget 4 --profile prof --gpu on -p "Hello"   # hot tier on the GPU

      pi-tools run -m smollm2 -cnv -p "You are a pirate."   # a conversation, as llama-cli -cnv

      pi-tools run -m smollm2.q8_0.powerinfer.gguf -p "Hello" --sparse-mode input --input-sparsity 0.25
    """
    from powerinfer_tools.runtime import inference

    if n_predict < 0:
        raise UserError("--n-predict must be >= 0")
    if conversation:
        from powerinfer_tools.cli import chat as chat_cli

        system = prompt_text(prompt, prompt_file) if prompt is not None or prompt_file is not None else None
        return chat_cli.start(model, engine, ctx_size, system, n_predict or 512, sampling.sampling(), verbose=False)
    prompt = prompt_text(prompt, prompt_file)
    check_utf8(prompt)
    target = inference.resolve_model_file(model, engine.gpuidx, engine.vram_budget, engine.profile, ctx_size)
    started = time.perf_counter()
    tokenizer, llm = inference.open_with_tokenizer(
        target, threads=engine.threads, sparse_mode=engine.sparse_mode, ctx_size=ctx_size, kv_type=engine.kv_type,
        gpu=engine.gpu, vram_budget_gib=engine.vram_budget, input_sparsity=engine.input_sparsity,
        memory_budget_gib=engine.memory_budget)
    load_seconds = time.perf_counter() - started
    with llm, inference.engine_errors():
        ids = prompt_ids(tokenizer, prompt, chat)
        if len(ids) + 1 > llm.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens; --ctx-size {llm.n_ctx} leaves no room to generate")
        room = llm.n_ctx - len(ids)
        if n_predict > room:
            typer.echo(f"pi-tools: the context holds {llm.n_ctx} tokens and the prompt takes {len(ids)}: generating "
                       f"at most {room} of the {n_predict} asked (raise --ctx-size for more)", err=True)
            n_predict = room
        stops = {t for t in (tokenizer.eos_token_id, llm.info["eos"]) if t is not None and t >= 0}
        decoder = inference.StreamDecoder(tokenizer, ids)
        sys.stdout.write(prompt + ("\n" if chat else ""))  # a chat's answer starts on a line of its own
        sys.stdout.flush()
        s = sampling.sampling()
        for token in llm.generate(ids, n_predict, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                  repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n, seed=s.seed,
                                  stop=stops):
            if token in stops:
                break
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        stats = llm.stats()
        lines = (inference.timing_lines(stats, load_seconds, llm.info) if verbose else
                 [inference.timing_line(stats, load_seconds)])
        for line in lines:
            typer.echo(line, err=True)
        note = inference.sparsity_note(stats, llm.info["activation"])
        if note:
            typer.echo(f"pi-tools: {note}", err=True)


def prompt_text(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt given by exactly one of --prompt and --file."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give the prompt with --prompt TEXT or --file PATH (one of them)")
    if prompt_file is None:
        return prompt
    try:
        if str(prompt_file) == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        return prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise UserError(f"--file {prompt_file}: cannot read the prompt ({reason})") from None


def check_utf8(prompt: str) -> None:
    """A prompt whose bytes are not UTF-8 reaches Python with its bad bytes as lone surrogates (PEP 383),
    which neither the tokenizer nor stdout can take."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(prompt[exc.start])
        byte = f"byte 0x{bad - 0xDC00:02x}" if 0xDC80 <= bad <= 0xDCFF else f"character U+{bad:04X}"
        raise UserError(f"--prompt is not valid UTF-8 text ({byte} at character {exc.start})") from None


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat: this model file stores no chat template")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise UserError("the prompt is empty and the model has no BOS token to start from")
    return list(ids)
