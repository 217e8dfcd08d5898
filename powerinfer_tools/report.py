"""`pi-tools report`: one self-contained HTML page of the pictures that decide whether a model is worth
converting (activation locality, sparsity), whether its predictors are good (recall, precision,
predicted vs true density per layer) and how a placement spends the GPU budget.

Figures are matplotlib `Figure`s built without pyplot (so importing this module never changes the
caller's backend; PNGs render through Agg) and are the same functions the notebooks call. Every number
in a table is quoted from the input files (profile.json, the predictors' report.json, the plan's
JSON summary); only the curves, and the neuron shares for 80/90% coverage, are computed, from
the raw activation counts.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from powerinfer_tools.atomic import atomic_file
from powerinfer_tools.errors import UserError
from powerinfer_tools.locality import COVERAGE_TARGETS, Locality, analyse

FIGSIZE = (7.5, 4.0)
HOT_PCTS = (10, 20, 50)


# ---- figures ---------------------------------------------------------------------------------------

def _layer_axis(ax, n_layer: int) -> None:
    ax.set_xlabel("layer")
    ax.set_xlim(-0.6, n_layer - 0.4)
    ax.grid(True, alpha=0.3)


def plot_cumulative(loc: Locality) -> Figure:
    """Cumulative activation share vs neuron share (hottest first), one curve per layer."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    cmap, norm = colormaps["viridis"], Normalize(0, max(1, len(loc.layers) - 1))
    for layer in loc.layers:
        ax.plot(layer.neuron_share, layer.activation_share, color=cmap(norm(layer.layer)), lw=1.2)
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="no locality (uniform)")
    for pct in HOT_PCTS:
        ax.axvline(pct / 100, color="black", lw=0.6, alpha=0.4)
    ax.set(xlim=(0, 1), ylim=(0, 1.01), xlabel="share of neurons (hottest first)",
           ylabel="share of all activations", title="Activation locality per layer")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="layer")
    return fig


def plot_hot_coverage(loc: Locality) -> Figure:
    """Share of activations served by the hottest 10/20/50% of each layer's neurons."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    x = [layer.layer for layer in loc.layers]
    for pct, color in zip(HOT_PCTS, ("tab:red", "tab:orange", "tab:blue")):
        ax.plot(x, [layer.hot[f"hot{pct}"] for layer in loc.layers], marker="o", ms=3, color=color,
                label=f"hottest {pct}% of neurons")
        ax.axhline(pct / 100, color=color, ls=":", lw=1)
    ax.set(ylim=(0, 1.01), ylabel="share of activations covered",
           title="Coverage of the hottest neurons (dotted: what a uniform model would give)")
    _layer_axis(ax, len(loc.layers))
    ax.legend(loc="upper center", ncols=3, fontsize="small")
    return fig


def plot_sparsity(loc: Locality) -> Figure:
    """Per-layer sparsity (share of inactive token-neuron pairs), with the calibration target if any."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    x = [layer.layer for layer in loc.layers]
    ax.bar(x, [layer.sparsity for layer in loc.layers], color="tab:green", label="measured sparsity")
    targets = loc.profile.get("target_sparsity")
    if targets:
        ax.step(x, targets, where="mid", color="black", ls="--", lw=1, label="calibration target")
    ax.set(ylim=(0, 1), ylabel="sparsity", title=f"Sparsity per layer ({loc.profile['rule']} rule)")
    _layer_axis(ax, len(loc.layers))
    ax.legend(loc="upper right")
    return fig


def png_base64(fig: Figure) -> str:
    """The figure as a base64 PNG (rendered by Agg), for embedding in a data: URL."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ---- HTML ------------------------------------------------------------------------------------------

@dataclass
class Table:
    id: str
    columns: list[str]
    rows: list[list]
    caption: str = ""


@dataclass
class Section:
    id: str
    title: str
    intro: str
    figures: list[tuple[str, str, Figure]] = field(default_factory=list)   # (id, caption, figure)
    tables: list[Table] = field(default_factory=list)


def fmt(value) -> str:
    """Table cell text: floats to 4 decimals, everything else as is."""
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.4f}"
    return html.escape(str(value))


def locality_section(loc: Locality) -> Section:
    p = loc.profile
    layers = p["layers"]
    mean = {key: float(np.mean([row[key] for row in layers])) for key in ("sparsity", "hot10", "hot20", "hot50")}
    intro = (f"{p['tokens']} tokens profiled ({p['sequences']} sequences of {p['seq_len']}). On average the "
             f"hottest 10% of a layer's neurons serve {mean['hot10']:.1%} of its activations, the hottest 20% "
             f"{mean['hot20']:.1%}, the hottest 50% {mean['hot50']:.1%}; mean sparsity {mean['sparsity']:.1%}.")
    columns = ["layer", "threshold", "sparsity", "hot10", "hot20", "hot50"] + \
        [f"neurons for {t:.0%}" for t in COVERAGE_TARGETS]
    rows = [[row["layer"], float(t), row["sparsity"], row["hot10"], row["hot20"], row["hot50"]]
            + [layer.neurons_for[s] for s in COVERAGE_TARGETS]
            for row, t, layer in zip(layers, p["thresholds"], loc.layers)]
    return Section("locality", "Activation locality", intro,
                   figures=[("fig-cumulative", "Cumulative activation share against neuron share, hottest "
                             "neurons first (the power-law curve). The dashed diagonal is a model without "
                             "locality.", plot_cumulative(loc)),
                            ("fig-hot-coverage", "Share of activations the hottest 10/20/50% of neurons cover.",
                             plot_hot_coverage(loc)),
                            ("fig-sparsity", "Per-layer sparsity: share of (token, neuron) pairs inactive.",
                             plot_sparsity(loc))],
                   tables=[Table("tbl-locality", columns, rows,
                                 "From profile.json; 'neurons for N%': share of neurons (hottest first) that "
                                 "serves N% of activations, from activation_{i}.pt.")])


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; } figcaption { color: #555; font-size: .9em; }
table { border-collapse: collapse; font-size: .85em; margin: 1em 0; }
th, td { border: 1px solid #ddd; padding: .2em .6em; text-align: right; } th { background: #f4f4f4; }
caption { caption-side: bottom; color: #555; text-align: left; padding-top: .3em; }
.missing { color: #a60; }
"""


def table_html(table: Table) -> str:
    """A Table as an HTML <table> (also displayable in a notebook with IPython.display.HTML)."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = "\n".join("<tr>" + "".join(f"<td>{fmt(v)}</td>" for v in row) + "</tr>" for row in table.rows)
    caption = f"<caption>{html.escape(table.caption)}</caption>" if table.caption else ""
    return f'<table id="{table.id}">{caption}<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody></table>'


def _render_section(section: Section) -> str:
    parts = [f'<section id="{section.id}"><h2>{html.escape(section.title)}</h2>',
             f"<p>{html.escape(section.intro)}</p>"]
    for fig_id, caption, fig in section.figures:
        parts.append(f'<figure><img id="{fig_id}" alt="{html.escape(caption)}" '
                     f'src="data:image/png;base64,{png_base64(fig)}"><figcaption>{html.escape(caption)}'
                     f"</figcaption></figure>")
    parts.extend(table_html(t) for t in section.tables)
    parts.append("</section>")
    return "\n".join(parts)


def _missing_section(section_id: str, title: str, how: str) -> Section:
    return Section(section_id, title, f"Not included: {how}")


def render_html(title: str, subtitle: str, sections: list[Section]) -> str:
    body = "\n".join(_render_section(s) for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head>\n<body><h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p>\n"
            f"{body}\n</body></html>\n")


def build_report(profile_dir: str | Path) -> str:
    """The whole HTML page for a profile directory."""
    loc = analyse(profile_dir)
    m = loc.profile["model"]
    subtitle = (f"{m['source']}: {m['arch']} ({m['activation']}), {m['n_layer']} layers x {m['n_ff']} FFN "
                f"neurons, n_embd {m['n_embd']}. Profile: {profile_dir}.")
    return render_html(f"PowerInfer report: {Path(str(m['source'])).name}", subtitle, [locality_section(loc)])


def write_report(profile_dir: str | Path, out: str | Path) -> Path:
    """Build the report and write it atomically to `out`."""
    page = build_report(profile_dir)
    with atomic_file(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return Path(out)
