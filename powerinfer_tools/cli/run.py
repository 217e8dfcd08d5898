"""`pi-tools run`."""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.stages import options as limits
from powerinfer_tools.stages import placement
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.runtime.inference import KV_TYPE_HELP


def run(
    model: str = typer.Option(..., "--model", "-m", help="Model file written by 'pi-tools convert', or 'smollm2' "
                              "(the embedded default, built through the pipeline on first use)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (or --file)."),
    prompt_file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read the prompt from this UTF-8 text "
                                               "file, as llama.cpp's -f: for a prompt longer than a command "
                                               "line takes."),
    n_predict: int = typer.Option(128, "--n-predict", "-n", help="Tokens to generate (stops early at end of text)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help=flags.THREADS_HELP),
    sparse_mode: str = typer.Option(flags.DEFAULT_SPARSE_MODE, "--sparse-mode", help="FFN mode: dense (exact), gate (gate exactly, "
                                    "then only active neurons), predictor (PowerInfer), auto (cheapest per layer), "
                                    "oracle (true mask; for testing)."),
    gpuidx: Optional[Path] = typer.Option(None, "--gpuidx", help="GPU index (.gpuidx from 'pi-tools plan'): its "
                                          "neurons form the hot tier, computed densely without the predictor."),
    vram_budget: Optional[float] = flags.vram_budget_option(),
    gpu: str = flags.gpu_option(),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Profile directory, to solve a plan for "
                                           "--vram-budget (known for 'smollm2')."),
    ctx_size: int = typer.Option(placement.DEFAULT_CTX_SIZE, "--ctx-size", "-c",
                                 help="Context length (KV cache), as 'plan' sizes it for (so run finds its plans)."),
    kv_type: str = typer.Option("f32", "--kv-type", help=KV_TYPE_HELP),
    temp: float = typer.Option(0.8, "--temp", callback=flags.within(limits.NON_NEGATIVE), help="Sampling temperature; 0 = greedy."),
    top_k: int = typer.Option(40, "--top-k", help="Keep the k most likely tokens; 0 = off."),
    top_p: float = typer.Option(0.95, "--top-p", callback=flags.within(limits.FRACTION), help="Nucleus sampling mass; 1 = off."),
    repeat_penalty: float = typer.Option(1.1, "--repeat-penalty", callback=flags.within(limits.POSITIVE), help="Penalty for recent tokens; 1 = off."),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", help="How many recent tokens the penalty sees."),
    seed: int = typer.Option(-1, "--seed", "-s", help="Sampling seed; -1 = random."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template (one user turn)."),
):
    """Generate text from a prompt with the bundled C++ engine, streaming it, then print llama.cpp-style
    timings (prompt and generation tokens/s) and the FFN density to stderr.

    The tokenizer is rebuilt from the vocabulary stored in the file (no model directory or hub access) and
    cached, so later runs of the same file start faster.

    Examples:

      pi-tools run -m smollm2 -p "The capital of France is" -n 32 --temp 0   # builds it once, then cached

      pi-tools run -m smollm2.powerinfer.gguf -p "The capital of France is" -n 32 --temp 0

      pi-tools run -m smollm2 --vram-budget 0.3 -p "Hello"   # hot/cold split solved for 0.3 GiB

      pi-tools run -m smollm2 -c 8192 --kv-type f16 -p "Once upon a time" -n 4000   # a long text, half the cache

      pi-tools run -m smollm2.powerinfer.gguf -p "Write a haiku about the sea" --chat --sparse-mode gate -t 2

      pi-tools run -m smollm2 -f chapter1.txt -c 8192 -n 256   # a long prompt from a file

      pi-tools run -m relullama.q4_0.powerinfer.gguf --gpuidx relullama.generated.gpuidx -p "Hello" --seed 1

      pi-tools run -m relu7b.q4_0.powerinfer.gguf --vram-budget 4 --profile prof --gpu on -p "Hello"   # hot tier on the GPU
    """
    from powerinfer_tools.runtime import inference

    if n_predict < 0:
        raise UserError("--n-predict must be >= 0")
    prompt = prompt_text(prompt, prompt_file)
    check_utf8(prompt)
    target = inference.resolve_model_file(model, gpuidx, vram_budget, profile, ctx_size)
    started = time.perf_counter()
    tokenizer = inference.load_tokenizer(target.model)
    llm = inference.open_engine(target, threads=threads, sparse_mode=sparse_mode, ctx_size=ctx_size, kv_type=kv_type,
                                gpu=gpu, vram_budget_gib=vram_budget)
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
        seed = seed if seed >= 0 else random.SystemRandom().randrange(2**32)
        for token in llm.generate(ids, n_predict, temperature=temp, top_k=top_k, top_p=top_p,
                                  repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=stops):
            if token in stops:
                break
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        for line in inference.timing_lines(llm.stats(), load_seconds, llm.info):
            typer.echo(line, err=True)


def prompt_text(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt given by exactly one of --prompt and --file."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give the prompt with --prompt TEXT or --file PATH (one of them)")
    if prompt_file is None:
        return prompt
    try:
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
