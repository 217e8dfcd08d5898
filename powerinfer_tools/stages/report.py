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
from matplotlib.ticker import MaxNLocator

from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.stages.profiling.locality import COVERAGE_TARGETS, Locality, analyse, profile_verdict
from powerinfer_tools.stages.profiling import expert_profile
from powerinfer_tools.stages.profiling.expert_profile import ExpertProfile
from powerinfer_tools.stages.profiling.profiling import load_profile
from powerinfer_tools.stages.placement.placement import MIB, human_bytes

FIGSIZE = (7.5, 4.0)
HOT_PCTS = (10, 20, 50)
PLAN_FORMAT = "powerinfer-tools.plan/1"   # placement.Plan.summary()


# ---- figures ---------------------------------------------------------------------------------------

def _layer_axis(ax, n_layer: int) -> None:
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-0.6, n_layer - 0.4)
    ax.grid(True, alpha=0.3)


def _share_axis(ax, ylabel: str) -> None:
    """A 0..1 share axis with headroom above 1 for a legend that must not hide the data."""
    ax.set_ylim(0, 1.16)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_ylabel(ylabel)
    ax.legend(loc="upper center", ncols=3, fontsize="small")


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
    ax.set_title("Coverage of the hottest neurons (dotted: what a uniform model would give)")
    _layer_axis(ax, len(loc.layers))
    _share_axis(ax, "share of activations covered")
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
    ax.set_title(f"Sparsity per layer ({loc.profile['rule']} rule)")
    _layer_axis(ax, len(loc.layers))
    _share_axis(ax, "sparsity")
    return fig


def plot_predictor_quality(pred: dict) -> Figure:
    """Held-out recall and precision of each layer's predictor (report.json of train-predictor)."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    rows = pred["layers"]
    x = [row["layer"] for row in rows]
    ax.plot(x, [row["recall"] for row in rows], marker="o", ms=3, color="tab:blue", label="recall")
    ax.plot(x, [row["precision"] for row in rows], marker="s", ms=3, color="tab:purple", label="precision")
    target = pred.get("settings", {}).get("target_recall")
    if target:
        ax.axhline(target, color="tab:blue", ls=":", lw=1, label=f"target recall {target:g}")
    ax.set_title("Predictor quality per layer")
    _layer_axis(ax, max(x) + 1)
    _share_axis(ax, "held-out score")
    return fig


def plot_predictor_density(pred: dict) -> Figure:
    """Predicted vs true density per layer: the share of neurons the engine computes vs those it needs."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    rows = pred["layers"]
    x = np.array([row["layer"] for row in rows])
    ax.bar(x - 0.2, [row["true_density"] for row in rows], width=0.4, color="tab:green", label="true density")
    ax.bar(x + 0.2, [row["predicted_density"] for row in rows], width=0.4, color="tab:orange",
           label="predicted density")
    ax.set_title("Predicted vs true density per layer")
    _layer_axis(ax, int(x.max()) + 1)
    _share_axis(ax, "share of neurons active")
    return fig


def plot_gpu_share(plan: dict) -> Figure:
    """Share of each layer's neurons the placement puts on the GPU, and the activations they serve."""
    fig = Figure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    rows = plan["layers"]
    x = [row["layer"] for row in rows]
    ax.bar(x, [row["gpu_neurons"] / row["n_ff"] for row in rows], color="tab:olive", label="neurons on the GPU")
    ax.plot(x, [row["served_fraction"] for row in rows], marker="o", ms=3, color="tab:red",
            label="activations served by them")
    ax.set_title(f"GPU placement ({plan['gpu_neurons']}/{plan['neurons']} neurons, "
                 f"{plan['served_fraction']:.1%} of activations)")
    _layer_axis(ax, len(rows))
    _share_axis(ax, "share of the layer")
    return fig


def plot_budget(plan: dict) -> Figure:
    """Where the VRAM budget goes: one stacked bar of the plan's breakdown."""
    fig = Figure(figsize=(FIGSIZE[0], 3.0), layout="constrained")
    ax = fig.subplots()
    unit, size = next(((u, b) for u, b in (("GiB", 1 << 30), ("MiB", MIB)) if plan["vram_budget"] >= b),
                      ("KiB", 1024))
    left = 0.0
    cmap = colormaps["tab10"]
    for i, (part, nbytes) in enumerate(plan["breakdown_bytes"].items()):
        free = part == "free"
        ax.barh([0], [nbytes / size], left=left, color="white" if free else cmap(i), edgecolor="grey",
                hatch="//" if free else None, label=f"{_part_label(part)}: {human_bytes(nbytes)}")
        left += nbytes / size
    ax.set(yticks=[], xlim=(0, max(left, plan["vram_budget"] / size) or 1), xlabel=unit,
           title=f"VRAM budget {human_bytes(plan['vram_budget'])} (context {plan['ctx_size']})")
    fig.legend(loc="outside lower center", ncols=4, fontsize="small", frameon=False)
    return fig


def _part_label(part: str) -> str:
    return part.replace("_", " ")


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
             f"{mean['hot20']:.1%}, the hottest 50% {mean['hot50']:.1%}; mean sparsity {mean['sparsity']:.1%}. "
             + profile_verdict(p))
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


def plot_expert_locality(p: ExpertProfile) -> Figure:
    """Per layer, for each kept size C: a fixed hot set's share of selections (dashed) against an LRU's hit rate."""
    fig = Figure(figsize=FIGSIZE)
    ax = fig.add_subplot()
    layers = p.routed_layers()
    cmap = colormaps["viridis"]
    sizes = expert_profile.lru_sizes(p.n_expert, p.top_k)
    for j, c in enumerate(sizes):
        color = cmap(j / max(1, len(sizes) - 1))
        ax.plot(layers, p.lru_hit_rate(c)[layers], color=color, marker="o", ms=3, label=f"LRU of {c}")
        ax.plot(layers, p.hot_set_share(c)[layers], color=color, ls="--", label=f"hot set of {c}")
    _layer_axis(ax, p.n_layer)
    _share_axis(ax, "share of selections served")
    ax.set_title("Experts kept per layer: a cache of recent ones against a fixed hot set")
    return fig


def expert_section(p: ExpertProfile, profile: dict) -> Section:
    """An expert profile's static skew against its temporal locality (stages/expert_profile.py)."""
    hot = max(1, round(expert_profile.HOT_SHARE * p.n_expert))
    sizes = expert_profile.lru_sizes(p.n_expert, p.top_k)
    layers = p.routed_layers()
    intro = (f"{profile['tokens']} tokens profiled ({profile['sequences']} sequences of {profile['seq_len']}), "
             f"{p.n_expert} experts, top-{p.top_k}, as the engine routes them. On average the top 10% of a layer's "
             f"experts ({hot}) take {p.hot_set_share(hot)[layers].mean():.1%} of its selections (uniform routing: "
             f"{hot / p.n_expert:.1%}); an LRU of as many hits {p.lru_hit_rate(hot)[layers].mean():.1%}. "
             + expert_profile.verdict(p))
    columns = ["layer", f"top 10% ({hot})", f"LRU of {hot}"] + \
        [c for size in sizes for c in (f"hot set of {size}", f"LRU of {size}")] + ["median reuse (tokens)"]
    med = p.median_reuse()
    rows = [[int(il), float(p.hot_set_share(hot)[il]), float(p.lru_hit_rate(hot)[il])]
            + [float(v) for size in sizes for v in (p.hot_set_share(size)[il], p.lru_hit_rate(size)[il])]
            + [int(med[il])] for il in layers]
    return Section("experts", "Expert locality", intro,
                   figures=[("fig-experts", "Per layer: the share of selections an LRU cache of C experts would hit "
                             "(solid) and a fixed hot set of the C most selected serves (dashed).",
                             plot_expert_locality(p))],
                   tables=[Table("tbl-experts", columns, rows,
                                 "From experts.npz: hot set of C = share of the layer's selections its C most "
                                 "selected experts take (chosen on the same tokens); LRU of C = hit rate of a "
                                 "least-recently-used cache of C experts, from the selections' stack distances.")])


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


# ---- the other inputs ----------------------------------------------------------------------------------

def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: no such {what}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc})") from None


def load_predictor_report(path: str | Path, profile: dict) -> dict:
    """train-predictor's report.json (a predictor directory, or the JSON file --evaluate --report writes),
    checked to be about the profiled model."""
    from powerinfer_tools.stages.predictors.predictor_training import REPORT_FORMAT

    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    pred = _read_json(path, "predictor report (train-predictor writes DIR/report.json)")
    if pred.get("format") != REPORT_FORMAT:
        raise UserError(f"{path}: not a predictor report (format {pred.get('format')!r}, expected {REPORT_FORMAT})")
    ours, theirs = profile["model"].get("config_hash"), pred.get("model", {}).get("config_hash")
    if ours and theirs and ours != theirs:
        raise UserError(f"{path} is about model {pred['model'].get('source', '?')} (config hash {theirs[:12]}), "
                        f"not the profiled {profile['model'].get('source', '?')} (config hash {ours[:12]})")
    n_layer = int(profile["model"]["n_layer"])
    if not pred.get("layers") or any(not 0 <= row["layer"] < n_layer for row in pred["layers"]):
        raise UserError(f"{path}: layers do not fit the profiled model's {n_layer} layers")
    return pred


def load_plan_summary(path: str | Path, profile: dict) -> dict:
    """pi-tools plan's JSON summary (given itself, or the .gpuidx it sits beside), checked against the
    profile's layer count and width."""
    path = Path(path)
    if path.suffix != ".json":
        path = Path(f"{path}.json")
    plan = _read_json(path, "plan summary (pi-tools plan writes OUT.json beside the gpu index)")
    if plan.get("format") != PLAN_FORMAT:
        raise UserError(f"{path}: not a plan summary (format {plan.get('format')!r}, expected {PLAN_FORMAT})")
    m = profile["model"]
    shape = [(row["layer"], row["n_ff"]) for row in plan.get("layers", [])]
    if shape != [(i, int(m["n_ff"])) for i in range(int(m["n_layer"]))]:
        raise UserError(f"{path}: the plan's layers do not match the profiled model ({m['n_layer']} layers of "
                        f"{m['n_ff']} neurons)")
    return plan


# ---- sections of other inputs --------------------------------------------------------------------------

PREDICTOR_COLUMNS = ("layer", "rank", "threshold", "recall", "precision", "true_density", "predicted_density", "auc",
                     "useful")


def predictor_section(pred: dict) -> Section:
    s = pred.get("summary", {})
    intro = (f"{len(pred['layers'])} predictors ({pred.get('mode', '?')} report, held-out rows): mean recall "
             f"{s.get('mean_recall', float('nan')):.4f}, mean precision {s.get('mean_precision', float('nan')):.4f}; "
             f"they mark {s.get('mean_predicted_density', float('nan')):.1%} of neurons for computation where "
             f"{s.get('mean_true_density', float('nan')):.1%} are active.")
    if "predictor_fraction" in pred:
        intro += f" Predictor weights: {pred['predictor_fraction']:.1%} of the FFN weights."
    useless = [str(row["layer"]) for row in pred["layers"] if row.get("useful") is False]
    if useless:
        intro += (f" The predictors of layer(s) {', '.join(useless)} predict nothing useful (held-out AUC near "
                  "chance, 0.5, or more than half the neurons marked active, where a sparse step saves less than "
                  "choosing them costs): their recall is bought by marking neurons active, not by predicting "
                  "them; auto mode leaves them out.")
    columns = [c for c in PREDICTOR_COLUMNS if all(c in row for row in pred["layers"])]
    return Section("predictors", "Predictors", intro,
                   figures=[("fig-predictor-quality", "Held-out recall and precision of each layer's predictor.",
                             plot_predictor_quality(pred)),
                            ("fig-predictor-density", "Share of neurons the predictor marks active (computed by "
                             "the engine) against the share truly active.", plot_predictor_density(pred))],
                   tables=[Table("tbl-predictors", [c.replace("_", " ") for c in columns],
                                 [[row[c] for c in columns] for row in pred["layers"]], "From report.json.")])


def placement_section(plan: dict) -> Section:
    intro = (f"Model file {plan['model']}, VRAM budget {human_bytes(plan['vram_budget'])}, context "
             f"{plan['ctx_size']}: {plan['gpu_neurons']} of {plan['neurons']} FFN neurons on the GPU serve "
             f"{plan['served_fraction']:.1%} of the profiled activations.")
    layer_rows = [[row["layer"], row["n_ff"], row["gpu_neurons"], row["gpu_neurons"] / row["n_ff"],
                   row["min_neurons"], row["served_fraction"]] for row in plan["layers"]]
    budget = plan["vram_budget"]
    budget_rows = [[_part_label(part), nbytes, nbytes / MIB, nbytes / budget if budget else 0.0]
                   for part, nbytes in plan["breakdown_bytes"].items()]
    return Section("placement", "Placement", intro,
                   figures=[("fig-gpu-share", "Share of each layer's neurons on the GPU (bars) and the share of "
                             "the layer's activations they serve (line).", plot_gpu_share(plan)),
                            ("fig-budget", "The VRAM budget breakdown.", plot_budget(plan))],
                   tables=[Table("tbl-placement", ["layer", "n_ff", "gpu neurons", "gpu share", "min neurons",
                                                   "served fraction"], layer_rows, "From the plan's JSON summary."),
                           Table("tbl-budget", ["part", "bytes", "MiB", "share of budget"], budget_rows,
                                 "From the plan's breakdown_bytes.")])


# ---- the page ------------------------------------------------------------------------------------------

def render_html(title: str, subtitle: str, sections: list[Section]) -> str:
    body = "\n".join(_render_section(s) for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head>\n<body><h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p>\n"
            f"{body}\n</body></html>\n")


def build_report(profile_dir: str | Path, predictors: str | Path | None = None,
                 plan: str | Path | None = None) -> str:
    """The whole HTML page: locality from the profile, plus predictors and placement when given; an expert profile's
    expert locality."""
    profile = load_profile(profile_dir)
    if profile.get("rule") == "experts":
        if predictors is not None or plan is not None:
            raise UserError(f"{profile_dir} is an expert profile: --predictors and --plan are for the neurons of dense "
                            "FFNs (leave them out)")
        m = profile["model"]
        subtitle = (f"{m['source']}: {m['arch']}, {m['n_layer']} layers of {profile['experts']['n_expert']} experts. "
                    f"Profile: {profile_dir}.")
        section = expert_section(expert_profile.load(Path(profile_dir), profile), profile)
        return render_html(f"PowerInfer report: {Path(str(m['source'])).name}", subtitle, [section])
    loc = analyse(profile_dir)
    sections = [locality_section(loc)]
    if predictors is not None:
        sections.append(predictor_section(load_predictor_report(predictors, loc.profile)))
    else:
        sections.append(_missing_section("predictors", "Predictors", "no --predictors given (train them with "
                                         "'pi-tools train-predictor PROFILE_DIR -o DIR', then pass --predictors DIR)."))
    if plan is not None:
        sections.append(placement_section(load_plan_summary(plan, loc.profile)))
    else:
        sections.append(_missing_section("placement", "Placement", "no --plan given (make one with 'pi-tools plan', "
                                         "then pass --plan MODEL.generated.gpuidx or its .json summary)."))
    m = loc.profile["model"]
    subtitle = (f"{m['source']}: {m['arch']} ({m['activation']}), {m['n_layer']} layers x {m['n_ff']} FFN "
                f"neurons, n_embd {m['n_embd']}. Profile: {profile_dir}.")
    return render_html(f"PowerInfer report: {Path(str(m['source'])).name}", subtitle, sections)


def write_report(profile_dir: str | Path, out: str | Path, predictors: str | Path | None = None,
                 plan: str | Path | None = None) -> Path:
    """Build the report and write it atomically to `out`."""
    page = build_report(profile_dir, predictors, plan)
    with atomic_file(out) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return Path(out)
