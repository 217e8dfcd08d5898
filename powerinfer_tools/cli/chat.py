"""`pi-tools chat`: a conversation in the terminal, as llama.cpp's `llama-cli -cnv`."""
from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import typer

from powerinfer_tools.cli import flags
from powerinfer_tools.core.errors import RequestError, UserError

COMMANDS = "/exit (or Ctrl-D) leaves, /clear starts over, /help shows this; Ctrl-C stops a reply"


@flags.engine_options
@flags.sampling_options
def chat(
    model: str = flags.model_option(),
    system: Optional[str] = typer.Option(None, "--system", "-sys", help="System prompt: who the assistant is. "
                                         "Default: the chat template's own (if it has one)."),
    n_predict: int = typer.Option(512, "--n-predict", "-n", help="Most tokens in one reply."),
    ctx_size: Optional[int] = flags.ctx_size_option("The conversation's room: the oldest turns are dropped when it "
                                                    "is full."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="After each reply, its token counts (how many "
                                 "of the prompt came from the cache) and speed, on stderr."),
    engine: flags.EngineArgs = None,
    sampling: flags.SamplingArgs = None,
):
    """Chat with a model in the terminal: the model's chat template, a system prompt, replies streamed as they
    are generated. The conversation stays in the KV cache, so each turn evaluates only its new tokens.

    /exit or Ctrl-D leaves, /clear starts a new conversation, Ctrl-C stops a reply without leaving. Input that
    is not UTF-8 is read with U+FFFD in place of its bad bytes; a message the chat template refuses is one line,
    and the conversation goes on without it.

    Examples:

      pi-tools chat -m smollm2

      pi-tools chat -m smollm2.q4_0.powerinfer.gguf --system "You are a terse assistant." -t 4

      pi-tools chat -m relu7b.q4_0.powerinfer.gguf --vram-budget 4 --profile prof --sparse-mode predictor -v
    """
    start(model, engine, ctx_size, system, n_predict, sampling.sampling(), verbose)


def start(model: str, engine: flags.EngineArgs, ctx_size: int | None, system: str | None, n_predict: int, sampling,
          verbose: bool) -> None:
    """Open the model and converse (`chat`, and `run -cnv`)."""
    from powerinfer_tools.runtime.llm import LLM

    sampling.check()
    if n_predict < 1:
        raise UserError("--n-predict must be at least 1")
    tolerant_stdin()
    with CtrlC() as ctrl_c, LLM(model, ctx_size=ctx_size, **engine.llm_options()) as llm:
        ctrl_c.armed = True  # from here to the end: opening the model (maybe a first build) stays interruptible
        converse(llm, system, n_predict, sampling, verbose, ctrl_c)


def tolerant_stdin() -> None:
    """Bytes that are not UTF-8 (a paste from a Latin-1 file, a stray byte) reach the chat as U+FFFD instead of
    ending it: input() decodes a line as stdin's errors setting says, whether from a terminal or a pipe."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="replace")


class CtrlC:
    """Ctrl-C in a chat, once `armed`, as a request rather than an exception wherever it lands: at the prompt it
    raises KeyboardInterrupt out of input() (a fresh line, as in a shell); anywhere else (a reply, the model's
    close) it only sets `stop`, which the reply loop reads between tokens. A burst of them then never raises
    inside a finalizer or Python's own hooks, where an exception can only be printed. Before it is armed, the
    handler it replaced handles Ctrl-C. Installed in the main thread only (where signal handlers can be set)."""

    def __init__(self):
        self.armed = False
        self.reading = False
        self.stop = False
        self._previous = None

    def __call__(self, signum, frame):
        if not self.armed:
            self._previous(signum, frame)
        elif self.reading:
            # Python's own handler (C): input() may call this again with the first KeyboardInterrupt still set,
            # where raising from Python code would be a SystemError
            signal.default_int_handler(signum, frame)
        else:
            self.stop = True

    def read(self, prompt: str) -> str:
        self.stop = False
        self.reading = True
        try:
            return input(prompt)
        finally:
            self.reading = False

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # not when the process ignores Ctrl-C
                self._previous = previous
                signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def converse(llm, system: str | None, n_predict: int, sampling, verbose: bool, ctrl_c: CtrlC) -> None:
    """The read-reply loop: each turn's prompt is the whole conversation through the template, of which the
    cache already holds all but the new turn. A message the model refuses (the template's own refusal, text that
    is not UTF-8) is one line, and the conversation goes on without it."""
    if not llm.chat_template:
        raise UserError(f"{llm.name} stores no chat template: use 'pi-tools run' with a prompt")
    try:
        import readline  # noqa: F401  (line editing and history for input(), where the platform has it)
    except ImportError:
        pass
    first = [{"role": "system", "content": system}] if system else []
    history = list(first)
    print(f"pi-tools chat: {llm.name}, context {llm.n_ctx} tokens. {COMMANDS}.", file=sys.stderr)
    while True:
        try:
            line = ctrl_c.read("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        except KeyboardInterrupt:  # at the prompt, as in a shell: a fresh line
            print(file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return
        if text == "/clear":
            history = list(first)
            print("(a new conversation)", file=sys.stderr)
            continue
        if text == "/help":
            print(COMMANDS, file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        reply, completion = "", None
        try:
            if not fit(llm, history, len(first), n_predict):
                history.pop()
                print("(that message alone does not fit the context: raise --ctx-size or write less)", file=sys.stderr)
                continue
            with llm.chat(history, max_tokens=n_predict, stream=True, sampling=sampling) as chunks:
                for chunk in chunks:
                    reply += chunk.text
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    completion = chunk.completion
                    if ctrl_c.stop:  # the reply so far stays in the conversation, as in llama-cli
                        print("\n(stopped)", file=sys.stderr)
                        break
        except RequestError as exc:
            history.pop()
            print(f"(not sent: {exc})", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
        if verbose and completion is not None:
            print(turn_line(completion), file=sys.stderr)


def fit(llm, history: list[dict], keep: int, n_predict: int) -> bool:
    """Drop the oldest turns after the first `keep` messages until the prompt leaves room for a reply (at
    least a quarter of n_predict); False when even the newest message alone does not fit."""
    room = max(1, n_predict // 4)
    dropped = 0
    while llm.count_tokens(llm.chat_prompt(history), chat=True) + room > llm.n_ctx:
        if len(history) - keep <= 1:
            return False
        del history[keep:keep + 2]  # a user turn and its reply
        dropped += 1
    if dropped:
        print(f"(the context is full: the oldest {dropped} exchange(s) left it)", file=sys.stderr)
    return True


def turn_line(c) -> str:
    t = c.timings
    rate = f", {t.generated_tokens_per_second:.1f} tokens/s" if t.generated_tokens_per_second else ""
    return (f"[prompt {c.usage.prompt_tokens} tokens: {c.usage.cached_tokens} from the cache, {t.prompt_tokens} "
            f"evaluated in {1000 * t.prompt_seconds:.0f} ms; reply {c.usage.completion_tokens} tokens{rate}; "
            f"{c.finish_reason}]")
