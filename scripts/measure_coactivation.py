"""Whether the neurons a layer's predictor selects together are correlated beyond their frequencies, and whether an
order of the neuron bundles by co-selection would bring a token's missing neurons into fewer reads than the
frequency order `convert --neuron-bundles` writes (docs/engine.md, "Models larger than memory").

For one layer: the predictor's selections for --tokens inputs (the synthetic model's FFN inputs, RMSNorm(n + sqrt(d)
u) for a fixed direction u, as scripts/synthetic_llama.py builds them), half to learn an order from (calibration),
half to evaluate it. Storage is by the profile's frequencies, hottest first; the hottest --resident share is in
memory. Printed (one JSON line): the lift of storage neighbours (P(both) / (P(a) P(b)): 1 is independence), the
strongest pairs' lift on held-out tokens, and the reads per token of the missing neurons (neighbours merged, and
across gaps of up to --gap bundles) under the frequency order and under a co-selection order (the non-resident
neurons within bands of --band neighbours sorted by their first principal component over the calibration
selections: an order learned from selections, as PowerInfer-2's clusters are).

With --write-order MODEL.gguf (a converted file whose sidecar exists beside it): the same co-selection order for
every layer, learned from MODEL's own predictors (fc1, fc2) on --tokens synthetic inputs, written as the sidecar of
--write-order-to (a link to MODEL under another name, so that the frequency-ordered sidecar stays), for decode runs
to compare (scripts/measure_disk_tier.py).

Examples:

  python scripts/measure_coactivation.py pred7b-s9 prof7b --layer 0
  python scripts/measure_coactivation.py pred7b-s9 prof7b --layer 5 --tokens 4000 --resident 0.036
  ln -s $PWD/relu7b.q4_0.powerinfer.gguf co/relu7b.gguf
  python scripts/measure_coactivation.py pred7b-s9 prof7b --write-order relu7b.q4_0.powerinfer.gguf \
      --write-order-to co/relu7b.gguf
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def selections(pred_dir: Path, layer: int, n_tok: int, seed: int) -> np.ndarray:
    """[n_tok, n_ff] bool: the predictor's selections for synthetic FFN inputs."""
    w = torch.load(pred_dir / f"model_{layer}.pt")
    fc1, fc2 = w["fc1.weight"].float().numpy(), w["fc2.weight"].float().numpy()
    h = np.maximum(synthetic_inputs(n_tok, fc1.shape[1], seed) @ fc1.T, 0)
    return (h @ fc2.T) > 0


def synthetic_inputs(n_tok: int, d: int, seed: int) -> np.ndarray:
    """RMSNorm(n + sqrt(d) u): the synthetic model's FFN inputs (a shared direction u in every token)."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    x = rng.standard_normal((n_tok, d)) + np.sqrt(d) * u
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True))


def coselection_order(calib: np.ndarray, freq_order: np.ndarray, n_resident: int, band: int) -> np.ndarray:
    """freq_order with the positions past the resident share sorted, band by band, by the first principal component
    of the calibration selections (power iteration on the centred [tokens, n_ff] matrix)."""
    centred = calib.astype(np.float32) - calib.mean(axis=0, dtype=np.float32)
    v = np.random.default_rng(0).standard_normal(calib.shape[1]).astype(np.float32)
    for _ in range(30):
        v = centred.T @ (centred @ v)
        v /= np.linalg.norm(v)
    order = freq_order.copy()
    for s in range(n_resident, order.size, band):
        b = order[s:s + band]
        order[s:s + band] = b[np.argsort(v[b], kind="stable")]
    return order


def write_order(args) -> None:
    """Every layer's co-selection order from the GGUF's own predictors, written as --write-order-to's sidecar."""
    from gguf.quants import dequantize

    from powerinfer_tools.formats import neuron_bundles
    from powerinfer_tools.formats.neuron_bundles import read_header

    model = Path(args.write_order)
    layout = neuron_bundles.read_layout(neuron_bundles.path_for(model))
    n_layer, n_ff = layout["n_layer"], layout["n_ff"]
    # the frequency order's index: the neuron and its frequency at each position
    with open(neuron_bundles.path_for(model), "rb") as f:
        f.seek(layout["index_offset"])
        raw = f.read(n_layer * n_ff * 8)
    neuron_at = np.frombuffer(raw[: n_layer * n_ff * 4], "<u4").reshape(n_layer, n_ff)
    freq_at = np.frombuffer(raw[n_layer * n_ff * 4:], "<f4").reshape(n_layer, n_ff)
    header = read_header(model)
    by_name = {t.name: t for t in header.tensors}
    mapped = np.memmap(model, np.uint8, "r")
    freqs, orders = [], []
    for il in range(n_layer):
        mats = []
        for name in ("fc1", "fc2"):
            t = by_name[f"blk.{il}.{name}.weight"]
            mats.append(dequantize(np.asarray(mapped[t.offset:t.offset + t.n_bytes]), t.type).reshape(t.shape))
        fc1, fc2 = mats
        x = synthetic_inputs(args.tokens, fc1.shape[1], args.seed + il)
        calib = (np.maximum(x @ fc1.T, 0) @ fc2.T) > 0
        freq = np.zeros(n_ff, np.float32)
        freq[neuron_at[il]] = freq_at[il]
        freqs.append(freq)
        orders.append(coselection_order(calib, neuron_at[il].astype(np.int64), int(args.resident * n_ff), args.band))
        print(f"layer {il}: ordered", flush=True)
    out = neuron_bundles.write(Path(args.write_order_to), frequencies=freqs, orders=orders)
    print(f"wrote {out}")


def reads(mask: np.ndarray, order: np.ndarray, resident: np.ndarray, gap: int) -> float:
    """Mean reads per token: the missing selected neurons at their positions in `order`, runs merged across gaps of
    up to `gap` positions."""
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size)
    total = 0
    for row in mask:
        p = np.sort(pos[row & ~resident])
        if p.size:
            total += 1 + int(np.count_nonzero(np.diff(p) > gap + 1))
    return total / len(mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("predictors", type=Path, help="synthetic_llama.py's predictors directory")
    ap.add_argument("profile", type=Path, help="its profile directory (activation_L.pt: counts per neuron)")
    ap.add_argument("--layer", type=int, default=0, help="default: 0")
    ap.add_argument("--tokens", type=int, default=4000, help="inputs, half for calibration (default: 4000)")
    ap.add_argument("--resident", type=float, default=0.036,
                    help="share of the layer in memory, hottest (default: 0.036)")
    ap.add_argument("--band", type=int, default=512, help="co-selection order: positions per band (default: 512)")
    ap.add_argument("--gap", type=int, default=1, help="bundles a read may span between two missing ones (default: 1)")
    ap.add_argument("--seed", type=int, default=0, help="default: 0")
    ap.add_argument("--write-order", metavar="MODEL", help="write every layer's co-selection order (see above)")
    ap.add_argument("--write-order-to", metavar="LINK", help="with --write-order: the sidecar goes beside this name")
    args = ap.parse_args()
    if args.write_order:
        if not args.write_order_to:
            ap.error("--write-order needs --write-order-to")
        write_order(args)
        return

    mask = selections(args.predictors, args.layer, args.tokens, args.seed)
    calib, held = mask[: len(mask) // 2], mask[len(mask) // 2:]
    counts = torch.load(args.profile / "activation" / f"activation_{args.layer}.pt").float().numpy()
    freq_order = np.argsort(-counts, kind="stable")  # convert's storage order, hottest first
    n_ff = counts.size
    resident = np.zeros(n_ff, bool)
    resident[freq_order[: int(args.resident * n_ff)]] = True

    # storage neighbours' co-selection against independence (held-out tokens)
    p = held.mean(axis=0)
    a, b = freq_order[:-1], freq_order[1:]
    both = (held[:, a] & held[:, b]).mean(axis=0)
    ok = (p[a] * p[b]) > 0
    lift_neighbours = float(both[ok].sum() / (p[a] * p[b])[ok].sum())
    # the strongest pairs found on calibration tokens, their lift on held-out ones (cold neurons only)
    cold = np.flatnonzero(~resident & (calib.mean(axis=0) > 0.005))[:3000]
    c = calib[:, cold].astype(np.float32)
    pc = c.mean(axis=0)
    lift_cal = (c.T @ c / len(c)) / np.maximum(np.outer(pc, pc), 1e-9)
    np.fill_diagonal(lift_cal, 0)
    top = np.dstack(np.unravel_index(np.argsort(-lift_cal, axis=None)[:2000], lift_cal.shape))[0]
    h = held[:, cold].astype(np.float32)
    ph = h.mean(axis=0)
    i, j = top[:, 0], top[:, 1]
    lift_top = float((h[:, i] * h[:, j]).mean(axis=0).sum() / (ph[i] * ph[j]).sum())

    # a co-selection order: within bands of the frequency order, by the first principal component of the
    # calibration selections
    co_order = coselection_order(calib, freq_order, int(args.resident * n_ff), args.band)
    out = {"layer": args.layer, "tokens": len(mask), "selected_per_token": float(mask.sum(axis=1).mean()),
           "missing_per_token": float((held & ~resident).sum(axis=1).mean()),
           "lift_storage_neighbours": round(lift_neighbours, 4),
           "lift_strongest_2000_pairs_calibration": round(float(lift_cal[i, j].mean()), 3),
           "lift_strongest_2000_pairs_held_out": round(lift_top, 4)}
    for g in (0, args.gap):
        out[f"reads_per_token_frequency_order_gap{g}"] = round(reads(held, freq_order, resident, g), 1)
        out[f"reads_per_token_coselection_order_gap{g}"] = round(reads(held, co_order, resident, g), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
