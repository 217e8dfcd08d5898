"""`pi-tools report`."""
from __future__ import annotations

from pathlib import Path

import typer


def report(
    profile_dir: Path = typer.Argument(..., help="Profile directory written by 'pi-tools profile'."),
    out: Path = typer.Option(..., "--out", "-o", help="HTML file to write (self-contained: images embedded)."),
):
    """Write one self-contained HTML page of pictures: per-layer activation locality (cumulative
    activation share vs neuron share, hottest 10/20/50% coverage) and sparsity.

    Examples:

      pi-tools report smollm2-profile -o report.html
    """
    from powerinfer_tools.report import write_report

    write_report(profile_dir, out)
    typer.echo(f"wrote {out}")
