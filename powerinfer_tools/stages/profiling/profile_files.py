"""The files of a profile and their digests: the checkpoints an interrupted profile continues from (each with the
digest of its contents), the sample shards' names, and what a finished profile's profile.json recorded of its files.
Everything a resume or a later stage reads is compared with the digest written with it (core/digests.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.digests import bytes_sha256, check_file, tree_sha256
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.core.safe_load import load_pt


def shard_name(layer: int, k: int) -> str:
    return f"layer_{layer}/shard_{k:04d}.safetensors"


RESTART = "start over: rerun with --force instead of --resume"


def save_checkpoint(path: Path, blob: dict) -> None:
    """`blob` (the recorder's state and the pass's position) with the digest checked_checkpoint compares."""
    with atomic_file(path) as tmp:
        torch.save({**blob, "digest": tree_sha256(blob)}, tmp)


def checked_checkpoint(path: Path, n_layer: int, n_ff: int, position: tuple[str, ...]) -> dict:
    """The checkpoint at `path` if its digest holds and every field is of its kind and shape for this model;
    `position` names the pass's own fields beside the recorder's state. One line naming the file otherwise."""
    try:
        blob = load_pt(path, "profile checkpoint")
    except UserError as exc:
        raise UserError(f"{exc}: {RESTART}") from None
    fields = {"counts", "magnitude", "rows", "shards", "sha256", "digest", *position}
    if not isinstance(blob, dict) or set(blob) != fields:
        raise UserError(f"{path} is not a checkpoint of this version's profile: {RESTART}")
    if blob.pop("digest") != tree_sha256(blob):
        raise UserError(f"{path} is damaged (its contents do not match the checksum it was saved with): {RESTART}")

    def table(name, dtype, shape):
        value = blob[name]
        return isinstance(value, torch.Tensor) and value.dtype == dtype and tuple(value.shape) == shape \
            and bool((value >= 0).all()) and (not value.is_floating_point() or bool(torch.isfinite(value).all()))
    sha = blob["sha256"]
    if not (table("counts", torch.int64, (n_layer, n_ff)) and table("magnitude", torch.float64, (n_layer, n_ff))
            and table("rows", torch.int64, (n_layer,)) and table("shards", torch.int64, (n_layer,))
            and isinstance(sha, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in sha.items())):
        raise UserError(f"{path} does not hold this model's counts, magnitudes and shards: {RESTART}")
    return blob


def is_position(value, lo: int, hi: int) -> bool:
    """A pass's position as a checkpoint stores it: a 0-d integer tensor from lo to hi."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
        and lo <= int(value) <= hi


def is_thresholds(value, n_layer: int) -> bool:
    """Per-layer thresholds as the work files store them: n_layer finite, non-negative floating-point values."""
    return isinstance(value, torch.Tensor) and value.shape == (n_layer,) and value.is_floating_point() \
        and bool(torch.isfinite(value).all()) and not bool((value < 0).any())


def checked_shards(checkpoint: Path, state: dict, layers: range) -> None:
    """Every shard the checkpoint counts for `layers`, each with the digest it was written with."""
    for i in layers:
        for k in range(int(state["shards"][i])):
            name = shard_name(i, k)
            if name not in state["sha256"]:
                raise UserError(f"{checkpoint} records no checksum for samples/{name}: {RESTART}")
            check_file(checkpoint.parent / "samples" / name, state["sha256"][name], RESTART)


def recorded_digests(directory: Path) -> dict[str, str]:
    """profile.json's digests of the profile's files; {} where there are none to compare: a profile made before
    profiles recorded them, a bare directory of activation files (PowerInfer's). The readers that need profile.json
    itself refuse a damaged one (load_profile)."""
    try:
        meta = json.loads((Path(directory) / "profile.json").read_text())
    except (OSError, ValueError):
        return {}
    digests = meta.get("sha256") if isinstance(meta, dict) else None
    return digests if isinstance(digests, dict) else {}


def check_recorded(directory: Path, name: str, digests: dict[str, str] | None = None,
                   data: bytes | None = None) -> None:
    """The profile file `name` (a path under `directory`; `data`, its bytes where already read) against the digest
    profile.json recorded when the profile wrote it (`digests`, or read from it): damage is one line, not a different
    result."""
    if digests is None:
        digests = recorded_digests(directory)
    if not digests:
        return
    if name not in digests:
        raise UserError(f"{directory / name}: profile.json records no checksum for it (not a file the profile "
                        "wrote); profile again")
    check_file(directory / name, digests[name], "profile again", data)


def profile_digest(meta: dict) -> str:
    """SHA-256 of profile.json's contents but its own `digest` field, keys sorted: what `profile` records in
    `digest`, so that an edited file (a threshold changed by hand) is refused rather than converted."""
    return bytes_sha256(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True).encode())


def check_profile_digest(meta: dict, source) -> None:
    """UserError where profile.json records a digest that its contents no longer match (a profile made before
    profiles recorded one has none to compare)."""
    if "digest" in meta and meta["digest"] != profile_digest(meta):
        raise UserError(f"{source} was changed after 'pi-tools profile' wrote it (its contents do not match the "
                        "digest recorded in it): profile again")


def check_thresholds(values, source, n_layer: int | None = None) -> list[float]:
    """A profile's per-layer |a| thresholds: finite, non-negative numbers (n_layer of them, when given)."""
    if not isinstance(values, list) or (n_layer is not None and len(values) != n_layer) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values):
        count = f"{n_layer} " if n_layer is not None else ""
        raise UserError(f"{source}: 'thresholds' must be {count}per-layer values, finite and non-negative")
    return [float(v) for v in values]
