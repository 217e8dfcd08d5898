"""`pi-tools train-predictor`: per-layer activation predictors from a profile directory."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from powerinfer_tools.core.errors import UserError

REPORT_FORMAT = "powerinfer-tools.predictor-report/1"


def _parse_rank(rank: str) -> int | None:
    if rank == "auto":
        return None
    try:
        return int(rank)
    except ValueError:
        raise UserError(f"--rank must be 'auto' or a positive integer, not {rank!r}") from None


def _device(name: str) -> str:
    import torch

    if name == "cpu":
        return name
    if name.startswith("cuda") and torch.cuda.is_available():
        return name
    if name == "mps" and torch.backends.mps.is_available():
        return name
    raise UserError(f"device {name!r} is not available here (use cpu)")


def _layer_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, dynamic_ncols=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")


def _report(mode: str, profile, results, settings: dict) -> dict:
    from powerinfer_tools.stages.predictor_training import summarize

    params = sum(r.model.params() for r in results)
    ffn = profile.ffn_params() * len(results)
    return {"format": REPORT_FORMAT, "mode": mode, "profile": str(profile.path), "model": profile.model,
            "rule": profile.meta.get("rule"), "settings": settings,
            "predictor_params": params, "ffn_params": ffn, "predictor_fraction": params / ffn,
            "summary": summarize(results), "layers": [r.report() for r in results]}


def train_predictor(
    profile_dir: Path = typer.Argument(..., metavar="PROFILE_DIR", help="Profile directory written by 'pi-tools profile'."),
    out: Path = typer.Option(None, "--out", "-o",
                             help="Predictor directory to write [default: PROFILE_DIR-predictors]; "
                                  "with --evaluate, the existing predictor directory to measure."),
    rank: str = typer.Option("auto", "--rank",
                             help="'auto': per layer, the smallest rank that meets --target-recall, under "
                                  "--max-predictor-fraction; or one fixed rank N <= n_embd for every layer."),
    target_recall: float = typer.Option(None, "--target-recall",
                                        help="Held-out recall each layer's threshold is calibrated to "
                                             "[default: 0.99 for ReLU-family profiles, 0.95 for SiLU/GELU "
                                             "(thresholded) ones]."),
    max_density_ratio: float = typer.Option(1.3, "--max-density-ratio",
                                            help="Density budget: a rank is enough (--rank auto) when the target "
                                                 "recall is reached predicting at most this many times the true "
                                                 "density and leaving out at least 1/this of the inactive "
                                                 "neurons; also the budget of the rec@bud column."),
    max_predictor_fraction: float = typer.Option(0.10, "--max-predictor-fraction",
                                                 help="Cap on all predictors' parameters as a fraction of the FFN "
                                                      "weights of the trained layers (--rank auto)."),
    epochs: int = typer.Option(8, "--epochs", help="Most epochs per predictor (early stopping on held-out "
                                                   "recall usually ends sooner)."),
    device: str = typer.Option("cpu", "--device", help="Torch device for training: cpu, cuda, cuda:N, mps."),
    layers: str = typer.Option(None, "--layers", help="Layers to train or evaluate, e.g. '0-3,7' [default: all]."),
    evaluate: bool = typer.Option(False, "--evaluate",
                                  help="Do not train: measure the predictors in --out (ours or PowerInfer's "
                                       "published model_{i}.pt) on every row of PROFILE_DIR."),
    report: Path = typer.Option(None, "--report", help="With --evaluate, also write the metrics as JSON here."),
    held_out: float = typer.Option(0.2, "--held-out", help="Fraction of calibration sequences held out."),
    threads: int = typer.Option(max(1, (os.cpu_count() or 2) // 2), "--threads",
                                help="CPU threads for torch (small matrices: more threads than free cores "
                                     "only add contention)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split, initialisation and batch order."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output directory."),
):
    """Train PowerInfer activation predictors, one fc2(relu(fc1(x))) per layer, from a profile.

    Rows are split into train / held-out by calibration sequence; each predictor is trained with
    class-weighted BCE and AdamW, stopped early on held-out recall, and its logit threshold is
    calibrated on held-out rows to reach --target-recall. Writes OUT/model_{i}.pt (PowerInfer's
    state dict), OUT/config.json (thresholds, ranks) and OUT/report.json, and prints a table.

    Examples:

      pi-tools train-predictor smollm2-profile --out smollm2-predictors

      pi-tools train-predictor prof --rank 64 --layers 0-3 --target-recall 0.99

      pi-tools train-predictor test-profile --out smollm2-predictors --evaluate --report eval.json
    """
    import torch

    from powerinfer_tools.stages import predictor_training as tp
    from powerinfer_tools.core.atomic import atomic_dir, atomic_file, check_output_dir
    from powerinfer_tools.stages.predictor import model_file, read_predictor_dir, save_predictor, write_config

    profile = tp.read_profile(profile_dir)
    selected = tp.parse_layers(layers, profile.n_layer)
    if target_recall is None:
        target_recall = 0.95 if profile.thresholded else 0.99
    if not 0.0 < target_recall < 1.0:
        raise UserError(f"--target-recall must be in (0, 1), not {target_recall}")
    if epochs < 1 or threads < 1 or not 0.0 < held_out < 1.0 or max_density_ratio < 1.0 \
            or not 0.0 < max_predictor_fraction <= 1.0:
        raise UserError("need --epochs >= 1, --threads >= 1, 0 < --held-out < 1, --max-density-ratio >= 1 "
                        "and 0 < --max-predictor-fraction <= 1")
    torch.set_num_threads(threads)

    if evaluate:
        if out is None:
            raise UserError("--evaluate needs --out DIR: the predictor directory to measure")
        if report is not None and report.is_dir():
            raise UserError(f"--report {report} is a directory")
        predictors = read_predictor_dir(out)
        with _layer_bar(len(selected), "evaluate") as bar:
            results = tp.evaluate_layers(profile, predictors, selected, max_density_ratio, lambda *_: bar.update(1))
        typer.echo(tp.format_table(results))
        if (warning := tp.useless_warning(results, "evaluation")) is not None:
            typer.echo(warning, err=True)
        if profile.thresholded and predictors.activation_thresholds is not None \
                and list(predictors.activation_thresholds) != list(profile.meta.get("thresholds") or []):
            typer.echo("note: 'active' was measured with this profile's |a| thresholds, which differ from "
                       "those of the profile the predictors were trained on", err=True)
        if report is not None:
            with atomic_file(report) as tmp:
                _write_json(tmp, _report("evaluate", profile, results, {"predictors": str(out)}))
        return

    out = out or profile.path.with_name(profile.path.name + "-predictors")
    check_output_dir(out, force)   # before minutes of training, not after
    fixed_rank = _parse_rank(rank)
    tp.check_rank(fixed_rank, profile.n_embd)
    settings = tp.TrainSettings(target_recall=target_recall, max_density_ratio=max_density_ratio, epochs=epochs,
                                device=_device(device), seed=seed)
    with _layer_bar(len(selected), "train-predictor") as bar:
        def progress(layer, chosen, tried, growing):
            if growing:   # spending the byte cap left over: one more step on the bar
                bar.total += 1
            bar.set_postfix_str(f"layer {layer}: ranks tried {sorted(tried)}, picked {chosen.rank}, "
                                f"held-out recall@budget {chosen.recall_at_budget:.3f}")
            bar.update(1)

        results = tp.train_layers(profile, selected, fixed_rank, settings, max_predictor_fraction, held_out,
                                  progress)
    with atomic_dir(out, force) as tmp:
        for r in results:
            save_predictor(r.model, model_file(tmp, r.layer))
        write_config(tmp, profile.model, profile.meta.get("rule", "nonzero"), profile.meta.get("thresholds"),
                     [{"layer": r.layer, "rank": r.model.rank, "threshold": r.threshold,
                       "useful": r.metrics["useful"]} for r in results])
        _write_json(tmp / "report.json", _report("train", profile, results, {
            "rank": rank, "target_recall": target_recall, "max_density_ratio": max_density_ratio,
            "max_predictor_fraction": max_predictor_fraction, "epochs": epochs, "held_out": held_out,
            "seed": seed, "split": "by calibration sequence"}))
    typer.echo(tp.format_table(results))
    if (warning := tp.useless_warning(results)) is not None:
        typer.echo(warning, err=True)
    typer.echo(f"wrote {len(results)} predictors to {out}")
