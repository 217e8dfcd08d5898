"""One module per `pi-tools` subcommand: argument parsing and printing only; the work lives in the library."""
from powerinfer_tools.cli.app import app, main  # noqa: F401
