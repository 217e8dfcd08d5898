"""The engine's logits, bit for bit, against a digest stored from an earlier build (tests/fixtures/
logits_digest.json): a restructure of csrc/ that means to change nothing is held to the same bits in every
mode, weight type and architecture, for prompt batches and decode steps, with and without a hot tier.

The digest also holds each input file's SHA-256: where a file differs (the converter or the tiny models
changed), the test says so instead of blaming the engine. Record a new digest, from a build known to be right,
with PI_RECORD_DIGEST=1 (the test then writes the fixture and skips).

The digest is of one kernel set, ISA, forced (engine option isa): the best one available differs between
machines, and so would the bits. Skipped on a CPU without it."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_helpers import converted, random_tokens, rewrite, write_gpuidx  # noqa: F401
from tiny_models import KINDS, N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_engine import kernels

FIXTURE = Path(__file__).parent / "fixtures" / "logits_digest.json"
N_PROMPT, N_DECODE, BATCH = 24, 6, 16  # a prompt in two batches (16 + 8), then decode steps
TOKENS = random_tokens(N_PROMPT + N_DECODE, 384, seed=7)
MODES = ("dense", "gate", "predictor", "auto", "oracle")
SPARSE_THRESHOLD = 6.0  # random predictors select 5-25 % of the neurons above it (the gathered paths)
ISA = "avx2"  # the kernel set the digest is of: nearly every x86-64 CPU has it (avx512 gives the same bits today)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def logits_digest(path: Path, mode: str, **kw) -> str:
    with engine.Model(path, threads=2, sparse_mode=mode, batch_size=BATCH, ctx_size=64, isa=ISA, **kw) as m:
        rows = [m.eval(TOKENS[:N_PROMPT])] + [m.eval([t])[None, 0] for t in TOKENS[N_PROMPT:]]
    return sha256(np.ascontiguousarray(np.concatenate(rows), dtype=np.float32).tobytes())


def cases(converted, tmp: Path):
    """(name, file name, file, mode, options) over every architecture and weight type, plus a hot tier, a sparse
    predictor, the recall check's staged path and an f16 KV cache."""
    hot = [np.random.default_rng(11 + i).random(N_FF) < 0.3 for i in range(N_LAYER)]
    gpuidx = write_gpuidx(tmp / "hot.gpuidx", hot)
    for kind in KINDS:
        for outtype in ("f32", "f16", "q8_0", "q4_0"):
            path = converted(kind, outtype, predictors=True)
            for mode in MODES:
                yield f"{kind}/{outtype}/{mode}", f"{kind}/{outtype}", path, mode, {}
            for mode in ("dense", "gate", "predictor"):
                yield f"{kind}/{outtype}/{mode}/hot", f"{kind}/{outtype}", path, mode, {"gpuidx": gpuidx, "cpu_hot_tier": True}
    for outtype in ("f32", "q4_0"):
        sparse = rewrite(converted("llama-relu", outtype, predictors=True), tmp / f"sparse.{outtype}.gguf", fields={
            "powerinfer.predictor_thresholds": ([SPARSE_THRESHOLD] * N_LAYER, gguf.GGUFValueType.ARRAY)})
        name = f"llama-relu/{outtype}/sparse"
        for mode in ("predictor", "auto"):
            yield f"{name}/{mode}", name, sparse, mode, {}
        yield f"{name}/predictor/hot", name, sparse, "predictor", {"gpuidx": gpuidx, "cpu_hot_tier": True}
        yield f"{name}/predictor/recall", name, sparse, "predictor", {"recall_check": True}
    yield "bamboo/q8_0/gate/kv_f16", "bamboo/q8_0", converted("bamboo", "q8_0", predictors=True), "gate", {"kv_type": "f16"}


def measure(converted, tmp: Path) -> dict:
    files, digests = {}, {}
    for name, file_name, path, mode, kw in cases(converted, tmp):
        files.setdefault(file_name, sha256(Path(path).read_bytes()))
        digests[name] = logits_digest(path, mode, **kw)
    return {"isa": ISA, "files": files, "logits": digests}


def test_logits_match_the_stored_digest(converted, tmp_path):
    if not kernels.available(ISA):
        pytest.skip(f"the digest is of the {ISA} kernels, which this CPU lacks")
    got = measure(converted, tmp_path)
    if os.environ.get("PI_RECORD_DIGEST") == "1":
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"recorded {len(got['logits'])} digests into {FIXTURE}")
    stored = json.loads(FIXTURE.read_text())
    assert stored["isa"] == ISA, f"the digest was recorded with the {stored['isa']} kernels"
    changed_inputs = sorted(k for k in stored["files"] if got["files"].get(k) != stored["files"][k])
    assert not changed_inputs, f"input files differ from the recorded ones (re-record the digest): {changed_inputs}"
    assert got["logits"].keys() == stored["logits"].keys()
    differ = sorted(k for k in stored["logits"] if got["logits"][k] != stored["logits"][k])
    assert not differ, f"{len(differ)} of {len(stored['logits'])} cases changed their logits: {differ}"
