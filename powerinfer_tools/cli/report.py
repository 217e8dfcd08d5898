"""`pi-tools report`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer



def report(
    profile_dir: Path = typer.Argument(..., metavar="PROFILE_DIR", help="Profile directory written by 'pi-tools profile'."),
    out: Path = typer.Option(..., "--out", "-o", help="HTML file to write (self-contained: images embedded)."),
    predictors: Optional[Path] = typer.Option(
        None, "--predictors", help="Predictor directory from 'pi-tools train-predictor' (reads its "
                                         "report.json), or the JSON file of 'train-predictor --evaluate --report'."),
    plan: Optional[Path] = typer.Option(
        None, "--plan", help="The .gpuidx file 'pi-tools plan' wrote (its OUT.json summary is read), or that "
                             "summary itself."),
):
    """Write one self-contained HTML page of pictures and tables: per-layer activation locality
    (cumulative activation share vs neuron share, hottest 10/20/50% coverage) and sparsity from the
    profile; predictor recall, precision and predicted vs true density with --predictors; the GPU share
    per layer and the VRAM budget breakdown with --plan. Sections whose input is not given say so. An expert profile
    (a mixture of experts'): per layer a fixed hot set's share of the selections against an LRU cache's hit rate.

    Examples:

      pi-tools report smollm2-profile -o report.html

      pi-tools report smollm2-profile --predictors smollm2-profile-predictors -o report.html

      pi-tools report prof --predictors pred --plan smollm2.powerinfer.gguf.generated.gpuidx -o report.html

      pi-tools report moe-prof -o moe-report.html   # an expert profile
    """
    from powerinfer_tools.stages.report import write_report

    write_report(profile_dir, out, predictors=predictors, plan=plan)
    typer.echo(f"wrote {out}")
