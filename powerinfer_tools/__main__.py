"""`python -m powerinfer_tools` and the `pi-tools` script. Ctrl-C while the toolkit is still importing (typer,
the commands: before cli.main can install its handler) ends as any interruption does: one line, status 130,
no traceback; once a command is over, the process's exit ignores Ctrl-C."""
import sys


def main() -> None:
    try:
        from powerinfer_tools.cli import main as run
    except KeyboardInterrupt:
        print("pi-tools: interrupted", file=sys.stderr)
        sys.exit(130)
    run(process=True)


if __name__ == "__main__":
    main()
