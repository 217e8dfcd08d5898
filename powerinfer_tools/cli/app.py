"""The `pi-tools` command line. Every subcommand lives in powerinfer_tools.cli.<name>."""
from __future__ import annotations

import errno
import os
import signal
import sys

import typer

from powerinfer_tools import __version__
from powerinfer_tools.core.errors import UserError, write_failure

app = typer.Typer(
    name="pi-tools",
    help="Make and run sparsity-aware (PowerInfer) LLMs: [sparsify ->] profile -> train-predictor -> convert -> run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # help as click writes it: rich markup would take '[default: ...]' in a help text for a tag and drop it, and
    # name a flag's value type (<bool>) it does not take
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"powerinfer-tools {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                       callback=_print_version, expose_value=False)):
    # --version is eager: it answers before typer asks for a subcommand ("Missing command" otherwise)
    ...


def _register() -> None:
    from powerinfer_tools.bench import command as bench
    from powerinfer_tools.cli import (chat, convert, perplexity, plan, profile, report, run, serve, sparsify,
                                      train_predictor)
    from powerinfer_tools.cli import inspect_file as inspect

    app.command("sparsify", no_args_is_help=True)(sparsify.sparsify)
    app.command("profile", no_args_is_help=True)(profile.profile)
    app.command("train-predictor", no_args_is_help=True)(train_predictor.train_predictor)
    app.command("convert", no_args_is_help=True)(convert.convert)
    app.command("plan", no_args_is_help=True)(plan.plan)
    app.command("run", no_args_is_help=True)(run.run)
    app.command("chat", no_args_is_help=True)(chat.chat)
    app.command("serve", no_args_is_help=True)(serve.serve)
    app.command("perplexity", no_args_is_help=True)(perplexity.perplexity)
    app.command("bench", no_args_is_help=True)(bench.bench)
    app.command("inspect", no_args_is_help=True)(inspect.inspect)
    app.command("report", no_args_is_help=True)(report.report)


_register()


class _CtrlC:
    """Remembers that Ctrl-C came: native code it lands in (torch inside safetensors' get_tensor) may turn the
    KeyboardInterrupt into another exception ("could not determine the shape of object type
    'torch.storage.UntypedStorage'"), which must still end as an interruption, not a traceback. Once the command
    is `over`, Ctrl-C is only remembered: raised into the exit (the error's line, an atexit hook, a __del__ at
    shutdown) it could only turn that end into a traceback."""

    def __init__(self):
        self.seen = False
        self.over = False

    def __call__(self, signum, frame):
        self.seen = True
        if not self.over:
            signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as without this handler


def _unraisable_but_ctrl_c(default):
    """sys.unraisablehook for a process of ours: Ctrl-C landing in a finalizer (a __del__, a generator's cleanup)
    interrupts nothing there, so it is dropped instead of printed as a traceback, as is Python's notice of one that
    came as the exit set it ignored; the rest as `default` does."""
    raced = f"Signal {int(signal.SIGINT)} ignored due to race condition"

    def hook(info) -> None:
        exc = info.exc_value
        if not isinstance(exc, KeyboardInterrupt) and not (isinstance(exc, OSError) and str(exc) == raced):
            default(info)

    return hook


def _interrupted() -> None:
    print("pi-tools: interrupted", file=sys.stderr)
    sys.exit(130)


def _is_usage_error(exc: BaseException) -> bool:
    """click's ClickException, or its twin in the copy of click that typer >= 0.2x carries (a TyperException).
    click is looked up, not imported: when typer does not use it, no click exception can come."""
    click = sys.modules.get("click")
    kinds = tuple(k for k in (getattr(typer, "TyperException", None), getattr(click, "ClickException", None)) if k)
    return isinstance(exc, kinds) and callable(getattr(exc, "show", None))


# A place that cannot be written (a read-only or full disk, no permission): the user's to fix, not a bug
_UNWRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _exit_for(exc: BaseException, ctrl_c_seen: bool) -> None:
    """The exit a command's exception calls for: Ctrl-C 130 (whatever it became on its way out), bad input or a
    path that cannot be written one line and 1, usage errors click's message; anything else is a bug and keeps
    its traceback."""
    if ctrl_c_seen or isinstance(exc, KeyboardInterrupt):
        _interrupted()
    if isinstance(exc, UserError):
        print(f"pi-tools: error: {exc}", file=sys.stderr)
        sys.exit(1)
    if write_failure(exc):
        print(f"pi-tools: error: {write_failure(exc)}", file=sys.stderr)
        sys.exit(1)
    if isinstance(exc, OSError) and exc.errno in _UNWRITABLE and exc.filename is not None:
        print(f"pi-tools: error: cannot write {os.fsdecode(exc.filename)}: {exc.strerror}", file=sys.stderr)
        sys.exit(1)
    if isinstance(exc, typer.Exit):
        sys.exit(exc.exit_code)
    if isinstance(exc, typer.Abort):
        sys.exit(1)
    if _is_usage_error(exc):
        exc.show()
        sys.exit(exc.exit_code)
    raise exc


def main(argv: list[str] | None = None, process: bool = False) -> None:
    """Entry point: bad input becomes one line on stderr and exit status 1, never a traceback. process: the
    command is the whole process (`pi-tools`), whose exit then ignores Ctrl-C; an in-process caller gets Python's
    handler back."""
    ctrl_c = _CtrlC()
    installed = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not when started with it ignored
    if installed:
        signal.signal(signal.SIGINT, ctrl_c)
        if process:
            sys.unraisablehook = _unraisable_but_ctrl_c(sys.unraisablehook)
    try:
        code = app(args=argv, standalone_mode=False)  # returns the exit code of an Exit (Ctrl-C: 130)
    except SystemExit:
        raise
    except BaseException as exc:
        ctrl_c.over = True  # first: another Ctrl-C must not break the handling of this one (a burst of them)
        _exit_for(exc, ctrl_c.seen)
    finally:
        ctrl_c.over = True
        if installed and signal.getsignal(signal.SIGINT) is ctrl_c:
            # the process's exit ignores Ctrl-C (Python's finalization would put back its default, death by SIGINT)
            signal.signal(signal.SIGINT, signal.SIG_IGN if process else signal.default_int_handler)
    if isinstance(code, int) and code:
        if code == 130:
            print("pi-tools: interrupted", file=sys.stderr)
        sys.exit(code)
