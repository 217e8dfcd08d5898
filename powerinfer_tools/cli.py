"""The `pi-tools` command line. Every subcommand lives in powerinfer_tools.commands.<name>."""
from __future__ import annotations

import sys

import typer

from powerinfer_tools import __version__
from powerinfer_tools.errors import UserError

app = typer.Typer(
    name="pi-tools",
    help="Make and run sparsity-aware (PowerInfer) LLMs: profile -> train-predictor -> convert -> run.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.")):
    if version:
        typer.echo(f"powerinfer-tools {__version__}")
        raise typer.Exit()


def _register() -> None:
    from powerinfer_tools.commands import (bench, convert, inspect, perplexity, plan, profile, report, run,
                                           train_predictor)

    app.command("profile", no_args_is_help=True)(profile.profile)
    app.command("train-predictor", no_args_is_help=True)(train_predictor.train_predictor)
    app.command("convert", no_args_is_help=True)(convert.convert)
    app.command("plan", no_args_is_help=True)(plan.plan)
    app.command("run", no_args_is_help=True)(run.run)
    app.command("perplexity", no_args_is_help=True)(perplexity.perplexity)
    app.command("bench", no_args_is_help=True)(bench.bench)
    app.command("inspect", no_args_is_help=True)(inspect.inspect)
    app.command("report", no_args_is_help=True)(report.report)


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point: bad input becomes one line on stderr and exit status 1, never a traceback."""
    try:
        code = app(args=argv, standalone_mode=False)  # returns the exit code of an Exit (Ctrl-C: 130)
    except UserError as exc:
        print(f"pi-tools: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("pi-tools: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # usage errors carry their own formatting: click's, or typer's own copy of it
        import click

        if isinstance(exc, (click.ClickException, getattr(typer, "TyperException", click.ClickException))) \
                and callable(getattr(exc, "show", None)):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    if isinstance(code, int) and code:
        if code == 130:
            print("pi-tools: interrupted", file=sys.stderr)
        sys.exit(code)
