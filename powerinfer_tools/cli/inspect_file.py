"""`pi-tools inspect`."""
from __future__ import annotations

import json
from pathlib import Path

import typer


def inspect(
    file: Path = typer.Argument(..., metavar="FILE", help="A GGUF, PowerInfer (.powerinfer.gguf) or .gpuidx file."),
    items: int = typer.Option(6, "--items", help="Array values shown per metadata key."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (full arrays)."),
):
    """Print a GGUF/PowerInfer file's metadata, tensor table (name, shape, type, bytes) and, for a
    gpuidx file, the share of each layer's neurons placed on the GPU.

    Examples:

      pi-tools inspect smollm2.q8_0.powerinfer.gguf

      pi-tools inspect smollm2.q8_0.powerinfer.gguf.generated.gpuidx

      pi-tools inspect model.gguf --json | jq '.tensors[] | select(.type=="F16")'
    """
    from powerinfer_tools.formats.describe import describe, render

    info = describe(file)
    if as_json:
        typer.echo(json.dumps(info, default=str))
    else:
        typer.echo(render(info, max_items=items))
