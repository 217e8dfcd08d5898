"""Hostile GGUF / PowerInfer / gpuidx files for the command line, made from the engine fuzzer's seed corpus
(tests/fuzz_corpus/): each header field a reader trusts set to what a hostile writer would put there (counts
and lengths of 2**62, text that is not UTF-8, token ids past the vocabulary, unknown type ids, truncations),
plus seeded random byte changes inside each header. Deterministic, a few KB each."""
from __future__ import annotations

import random
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fuzz_corpus"
SPLIT = b"\n--pi-fuzz-gpuidx--\n"  # csrc/fuzz/fuzz_load.cpp's kSplit: model bytes, then a GPU index


STRUCTURED_SEEDS = ("relu-f32", "bamboo-q8_0-pred+gpuidx")  # every hostile header value on these; random on all


def seeds() -> dict[str, tuple[bytes, bytes | None]]:
    """name -> (bytes where the engine expects a model, GPU index bytes or None) of each seed."""
    out = {}
    for path in sorted(CORPUS.iterdir()):
        model, found, index = path.read_bytes().partition(SPLIT)
        out[path.name] = (model, index if found else None)
    return out


def _fields(data: bytes) -> dict[str, tuple[int, list[int]]]:
    """key -> (offset of its entry, byte sizes of its parts) as gguf-py lays a valid file out; the tensor
    infos are keyed "tensor:NAME"."""
    import tempfile

    from powerinfer_tools.formats.gguf_io import open_reader

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        reader = open_reader(f.name)
        out = {key: (fld.offset, [p.nbytes for p in fld.parts]) for key, fld in reader.fields.items()}
        for t in reader.tensors:
            out[f"tensor:{t.name}"] = (t.field.offset, [p.nbytes for p in t.field.parts])
        return out


def _put(data: bytes, at: int, raw: bytes) -> bytes:
    return data[:at] + raw + data[at + len(raw):]


def _part_offset(fields, key: str, part: int) -> int:
    offset, sizes = fields[key]
    return offset + sum(sizes[:part])


def structured(model: bytes) -> dict[str, bytes]:
    """One file per hostile header value, each from a valid `model`."""
    f = _fields(model)
    u64, u32 = (lambda v: struct.pack("<Q", v)), (lambda v: struct.pack("<I", v))
    name_at, name_len = _part_offset(f, "general.name", 4), f["general.name"][1][4]
    first_token = _part_offset(f, "tokenizer.ggml.tokens", 5)  # length of the first token string
    tensor = next(k for k in f if k.startswith("tensor:"))
    kv_count = struct.unpack_from("<Q", model, 16)[0]
    key = b"hostile.array"
    extra = u64(len(key)) + key + u32(9) + u32(0) + u64(2**62)  # an array of 2**62 u8 values, holding none
    out = {
        "array-of-2^62": model[:16] + u64(kv_count + 1) + model[24:f["general.architecture"][0]] + extra
        + model[f["general.architecture"][0]:],
        "string-of-2^62": _put(model, _part_offset(f, "general.name", 3), u64(2**62)),
        "key-of-2^62": _put(model, f["general.name"][0], u64(2**62)),
        "metadata-count-2^60": _put(model, 16, u64(2**60)),
        "tensor-count-2^60": _put(model, 8, u64(2**60)),
        "version-1": _put(model, 4, u32(1)),
        "version-max": _put(model, 4, u32(2**32 - 1)),
        "name-not-utf8": _put(model, name_at, b"\xff\xfe\xc3" * (name_len // 3) + b"\x80" * (name_len % 3)),
        "token-not-utf8": _put(model, first_token + 8, b"\xff"),
        "token-count-2^62": _put(model, _part_offset(f, "tokenizer.ggml.tokens", 4), u64(2**62)),
        "bos-past-vocabulary": _put(model, _part_offset(f, "tokenizer.ggml.bos_token_id", 3), u32(10**6)),
        "eos-past-vocabulary": _put(model, _part_offset(f, "tokenizer.ggml.eos_token_id", 3), u32(2**32 - 1)),
        "bos-as-string-type": _put(model, _part_offset(f, "tokenizer.ggml.bos_token_id", 2), u32(8)),
        "unknown-value-type": _put(model, _part_offset(f, "general.name", 2), u32(99)),
        "nested-array": _put(model, _part_offset(f, "tokenizer.ggml.tokens", 3), u32(9)),
        "unknown-element-type": _put(model, _part_offset(f, "tokenizer.ggml.scores", 3), u32(77)),
        "architecture-with-nul": _put(model, _part_offset(f, "general.architecture", 4), b"ll\0ma"),
        "tensor-dims-2^40": _put(model, _part_offset(f, tensor, 3), u64(2**40 + 1)),
        "tensor-type-unknown": _put(model, _part_offset(f, tensor, 4), u32(1000)),
        "tensor-offset-2^62": _put(model, _part_offset(f, tensor, 5), u64(2**62)),
        "tensor-dimension-count-0": _put(model, _part_offset(f, tensor, 2), u32(0)),
        "empty": b"",
        "magic-only": model[:4],
    }
    for cut in (12, 24, 100, len(model) // 2, len(model) - 1):
        out[f"cut-at-{cut}"] = model[:cut]
    return out


def random_changes(data: bytes, n: int, seed: int, header: int) -> dict[str, bytes]:
    """n copies of `data`, each with 1 to 8 random bytes of its first `header` bytes set at random."""
    rng = random.Random(seed)
    out = {}
    for k in range(n):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(min(header, len(b)))] = rng.randrange(256)
        out[f"random-{k}"] = bytes(b)
    return out


def header_size(model: bytes) -> int:
    """Where the tensor data starts (the end of the last tensor info, rounded to the alignment)."""
    f = _fields(model)
    return max(offset + sum(sizes) for offset, sizes in f.values())


def write_corpus(out: Path, random_per_seed: int = 12) -> list[tuple[Path, Path | None]]:
    """Writes the corpus: (file, None) for a file in a model's place, (file, model) for a GPU index to run
    with that model."""
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for s, (name, (model, index)) in enumerate(seeds().items()):
        seed_model = out / f"{name}.gguf"
        seed_model.write_bytes(model)
        cases.append((seed_model, None))
        variants = structured(model) if name in STRUCTURED_SEEDS else {}
        variants.update(random_changes(model, random_per_seed, s, header_size(model)))
        for label, data in variants.items():
            path = out / f"{name}.{label}.gguf"
            path.write_bytes(data)
            cases.append((path, None))
        if index is not None:
            seed_index = out / f"{name}.gpuidx"
            seed_index.write_bytes(index)
            cases.append((seed_index, seed_model))
            for label, data in random_changes(index, random_per_seed // 2, 100 + s, header_size(index)).items():
                path = out / f"{name}.{label}.gpuidx"
                path.write_bytes(data)
                cases.append((path, seed_model))
    return cases
