"""The two files a benchmark compares: our PowerInfer GGUF and a plain llama.cpp GGUF of the same weights.

Both come from one source model at one quantization. The PowerInfer file is what `pi-tools convert`
writes. The llama.cpp file is made from it: every tensor llama.cpp reads is copied byte for byte
(embeddings, attention, gate, up, norms, output head), the predictors are dropped, and the one tensor
whose layout differs, `ffn_down_t` (row j = neuron j, for our axpy), becomes llama.cpp's `ffn_down`
(row i = output channel i) by quantizing the same float32 source matrix with the same gguf-py
quantizer. A quantized matrix cannot be transposed without requantizing (its 32-value blocks run
along rows), so ffn_down is the same weights quantized along the other axis: same type, same bytes,
values within that type's rounding of each other. A file whose neurons were reordered (neuron_order.py)
gets the source's down columns in the same order.

A benchmark point at a given FFN sparsity rewrites the per-layer thresholds of a working copy of the
PowerInfer file in place (fixed-size metadata arrays, see `set_thresholds`).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer_tools.core.digests import file_sha256
from powerinfer_tools.models import arch
from powerinfer_tools import models
from powerinfer_tools.formats import names, neuron_order
from powerinfer_tools.core.atomic import atomic_file
from powerinfer_tools.core.errors import UserError
from powerinfer_tools.formats.gguf_io import base_arch, field, open_reader

BENCH_OUTTYPES = ("q4_0", "q8_0", "f16", "f32")
ACTIVATION_THRESHOLDS = names.KEY_ACTIVATION_THRESHOLDS
PREDICTOR_THRESHOLDS = names.KEY_PREDICTOR_THRESHOLDS
# Metadata llama.cpp has no use for (ours) or that gguf-py's writer sets itself.
_SKIPPED_KEYS = ("GGUF.", "powerinfer.", "powerinfer_tools.", "general.architecture")
# our architectures whose tensors llama.cpp reads under its names (the mixtures: their experts as llama.cpp names them)
_LLAMACPP_ARCHES = ("llama", "qwen3", "qwen3moe", "olmoe")


@dataclass(frozen=True)
class BenchFiles:
    """Our file, llama.cpp's file of the same weights, and what they were built from."""

    powerinfer: Path
    llamacpp: Path
    manifest: dict


def _fingerprint(paths: list[Path]) -> str:
    """Identity of input files/directories by name, size and modification time (cheap, no hashing of GBs)."""
    h = hashlib.sha256()
    for p in paths:
        entries = sorted(p.rglob("*")) if p.is_dir() else [p]
        for e in entries:
            if e.is_file():
                st = e.stat()
                h.update(f"{e.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# The modules that write the two files' bytes: the converter, and this module (the llama.cpp copy).
WRITER_MODULES = ("powerinfer_tools.stages.conversion.conversion", "powerinfer_tools.bench.files")
# Libraries whose arithmetic or layout is in those bytes (gguf-py's writer and quantizers, numpy's, torch's casts).
WRITER_LIBRARIES = ("gguf", "numpy", "torch", "safetensors")


def _module_file(package: Path, name: str) -> Path | None:
    """The source of module `name` (powerinfer_tools.x.y) under `package`, None outside the toolkit."""
    parts = name.split(".")
    if parts[0] != package.name:
        return None
    base = package.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(package: Path, path: Path, name: str, top_level_only: bool) -> set[tuple[str, bool]]:
    """(module, wholly) for each module that `path` (module `name`) imports: everywhere in it, or with
    `top_level_only` only what runs when it is imported (not inside functions, nor under `if TYPE_CHECKING:`).
    `wholly`: a function of it may be called, so its own imports inside functions count; `from A import B`
    takes module A.B wholly and package A only as loaded, or, B being a name defined in A, A wholly."""
    import ast

    package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[tuple[str, bool]] = set()

    def visit(node) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.update((alias.name, True) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package_of.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    module = f"{base}.{alias.name}"
                    found.add((module, True) if _module_file(package, module) else (base, True))
                found.add((base, False))
            visit(child)

    visit(ast.parse(path.read_bytes(), str(path)))
    return found


def converter_sources(package: Path | None = None, roots: tuple[str, ...] = WRITER_MODULES) -> list[Path]:
    """The toolkit's source files that can run while the bench files are written: `roots` and every toolkit
    module they import, at any depth, imports inside the functions they may call included (the converter
    imports most of its helpers where it uses them); a package only loaded on the way to a module counts with
    what it imports when loaded, not what its functions import when called."""
    package = package or Path(__file__).resolve().parents[1]
    seen: dict[Path, bool] = {}  # file -> followed wholly
    pending = [(name, True) for name in roots]
    while pending:
        name, wholly = pending.pop()
        parts = name.split(".")
        for depth in range(1, len(parts)):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            pending.append((".".join(parts[:depth]), False))
        path = _module_file(package, name)
        if path is None or (path in seen and (seen[path] or not wholly)):
            continue  # not the toolkit's, or already followed as far as this import asks
        seen[path] = wholly
        pending.extend(_imports(package, path, name, not wholly))
    return sorted(seen)


def converter_fingerprint(package: Path | None = None) -> str:
    """What decides the bytes of a converted file besides its inputs: the sources converter_sources finds (a
    file converted by another version, predictors in f16 before they took the weight type say, is not this
    version's file) and the versions of WRITER_LIBRARIES. An edit anywhere else leaves cached files valid."""
    from importlib import metadata

    package = package or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in converter_sources(package):
        h.update(f"{path.relative_to(package)}\n".encode())
        h.update(path.read_bytes())
    for lib in WRITER_LIBRARIES:
        try:
            h.update(f"{lib}=={metadata.version(lib)}\n".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib} absent\n".encode())
    return h.hexdigest()[:16]


class _Damaged(Exception):
    """Why the files cached in a directory cannot be reused (one line)."""


def _record(path: Path) -> dict:
    """What the manifest keeps of a file it names, to know it again: its size and SHA-256."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def _cached(directory: Path) -> BenchFiles | None:
    """The files cached in `directory`, each as the manifest recorded it (size, then digest); None where there
    is no manifest (nothing built yet); _Damaged saying what is wrong otherwise (a file cut short or
    overwritten, a manifest edited or damaged)."""
    path = directory / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise _Damaged(f"manifest.json is not readable JSON: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise _Damaged("manifest.json is not an object recording its files' sizes and digests")
    found = []
    for role in ("powerinfer", "llamacpp"):
        name, records = manifest.get(role), manifest["files"]
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise _Damaged(f"manifest.json names no {role} file in the directory")
        record = records.get(name)
        if not isinstance(record, dict) or not isinstance(record.get("size"), int) \
                or not isinstance(record.get("sha256"), str):
            raise _Damaged(f"manifest.json records no size and digest for {name}")
        file = directory / name
        if not file.is_file():
            raise _Damaged(f"{name} is missing")
        if file.stat().st_size != record["size"]:
            raise _Damaged(f"{name} has {file.stat().st_size:,} bytes, not the {record['size']:,} recorded")
        if file_sha256(file) != record["sha256"]:
            raise _Damaged(f"{name} is not the file that was built (its SHA-256 differs from the recorded one)")
        found.append(file)
    return BenchFiles(found[0], found[1], manifest)


def bench_files(model: str, outtype: str, work_dir: Path, predictors: Path | None = None,
                profile: Path | None = None, progress: bool = True, input_sparsity: bool = False) -> BenchFiles:
    """Build (or reuse from `work_dir`) the PowerInfer and llama.cpp files of `model` at `outtype`; with
    input_sparsity, ours with the profile's input thresholds and the transposed matrices they need."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

    if outtype not in BENCH_OUTTYPES:
        raise UserError(f"unknown --outtype '{outtype}' (choose from {', '.join(BENCH_OUTTYPES)})")
    source = models.resolve(model)
    inputs = [source.path] + [p for p in (predictors, profile) if p is not None]
    extra = ":input" if input_sparsity else ""
    key = hashlib.sha256(f"{_fingerprint(inputs)}:{outtype}{extra}:{converter_fingerprint()}".encode()).hexdigest()[:16]
    stem = source.path.stem.replace(".", "_")
    directory = Path(work_dir) / f"{stem}-{outtype}-{key}"
    manifest_path = directory / "manifest.json"
    try:
        cached = _cached(directory)
    except _Damaged as exc:
        print(f"pi-tools bench: the files cached in {directory} cannot be reused ({exc}): building them again",
              file=sys.stderr)
        cached = None
    if cached is not None:
        return cached
    directory.mkdir(parents=True, exist_ok=True)
    pwri, plain = directory / "model.powerinfer.gguf", directory / "model.llamacpp.gguf"
    # every tensor in the outtype, as the llama.cpp copy has it (PowerInfer's f16 down projection would differ)
    summary = convert_model(model, pwri, outtype=outtype, predictors_dir=predictors, profile_dir=profile,
                            progress=progress, powerinfer_compatible=False, input_sparsity=input_sparsity)
    copied = write_llamacpp_gguf(pwri, model, plain)
    manifest = {"model": model, "source": str(source.path), "outtype": outtype,
                "predictors": str(predictors) if predictors else None, "profile": str(profile) if profile else None,
                "powerinfer": pwri.name, "llamacpp": plain.name, "convert": summary, "llamacpp_file": copied,
                "files": {p.name: _record(p) for p in (pwri, plain)}}
    with atomic_file(manifest_path) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))
    return BenchFiles(pwri, plain, manifest)


def _source_down_matrices(model: str):
    """layer -> float32 HF down_proj weight [n_embd, n_ff] of the source model, loaded on demand."""
    from powerinfer_tools.models.source_weights import open_weights

    source = models.resolve(model)
    config = models.load_config(source)
    adapter = arch.for_config(config)
    weights = open_weights(source, config)
    maps = {m.name: m for m in adapter.tensor_maps(weights.names_with_prefixes())}

    def load(layer: int) -> np.ndarray:
        tmap = maps[f"blk.{layer}.ffn_down_t.weight"]
        stored = weights.find(tmap.source)
        if stored is None:
            raise UserError(f"the model has no tensor {tmap.source}")
        data = weights.load(stored)
        return data if tmap.reorder is None else tmap.reorder(data)

    return load


def _add_field(writer, f, key: str) -> None:
    import gguf

    vtype = f.types[0]
    sub_type = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, f.contents(), vtype, sub_type=sub_type)


def write_llamacpp_gguf(powerinfer_file: Path, model: str, out: Path) -> dict:
    """Plain GGUF (magic GGUF, `ffn_down`, no predictors) of the weights in `powerinfer_file`.

    `model` is the source the PowerInfer file was converted from (for ffn_down's float32 data).
    Returns {"copied": n, "requantized": n} tensor counts.
    """
    import gguf

    from powerinfer_tools.stages.conversion.conversion import encode, is_input_transposed

    reader = open_reader(powerinfer_file)
    arch_name = field(reader, "general.architecture")
    llamacpp_arch = base_arch(arch_name)  # llama-silu's keys go back under llama's name
    if llamacpp_arch not in _LLAMACPP_ARCHES:
        raise UserError(f"{powerinfer_file}: llama.cpp comparison supports {', '.join(_LLAMACPP_ARCHES)} files, "
                        f"not '{arch_name}'")
    down = _source_down_matrices(model)
    n_ff = [int(t.shape[1]) for t in reader.tensors if t.name.endswith(".ffn_down_t.weight")]
    orders = neuron_order.read(powerinfer_file, n_ff, reader)  # the source's down columns follow the file's neurons
    copied = requantized = 0
    with atomic_file(out) as tmp:
        writer = gguf.GGUFWriter(tmp, llamacpp_arch)
        try:
            for f in reader.fields.values():
                if not f.name.startswith(_SKIPPED_KEYS):
                    key = f.name
                    if key.startswith(f"{arch_name}."):
                        key = llamacpp_arch + key[len(arch_name):]
                    _add_field(writer, f, key)
            for t in reader.tensors:
                name = t.name
                # the predictors and input sparsity's transposed copies are ours: llama.cpp refuses a file that
                # holds tensors it does not know ("wrong number of tensors")
                if name.endswith((".fc1.weight", ".fc2.weight")) or is_input_transposed(name):
                    continue
                data, qtype = t.data, t.tensor_type
                if name.endswith(".ffn_down_t.weight"):
                    layer = int(name.split(".")[1])
                    source = down(layer)
                    if orders is not None:
                        source = source[:, orders[layer]]
                    expected = tuple(int(n) for n in t.shape)  # GGUF ne of ffn_down_t = numpy (n_embd, n_ff)
                    if source.shape != expected:
                        raise UserError(f"source down projection of layer {layer} has shape {source.shape}, "
                                        f"expected {expected} from {name}")
                    data = encode(source, qtype)
                    name = name.replace(".ffn_down_t.", ".ffn_down.")
                    requantized += 1
                else:
                    copied += 1
                if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                    writer.add_tensor(name, np.asarray(data))
                else:
                    writer.add_tensor(name, np.asarray(data), raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return {"copied": copied, "requantized": requantized}


def thresholds(path: Path) -> dict[str, list[float] | None]:
    """Per-layer activation and predictor thresholds stored in a PowerInfer file (None when absent)."""
    reader = open_reader(path)
    return {"activation": _floats(field(reader, ACTIVATION_THRESHOLDS)),
            "predictor": _floats(field(reader, PREDICTOR_THRESHOLDS))}


def _floats(value) -> list[float] | None:
    return None if value is None else [float(v) for v in value]


def working_copy(path: Path, work_dir: Path) -> Path:
    """A copy of `path` whose thresholds a sweep may rewrite (the original stays untouched)."""
    out = Path(work_dir) / f"{Path(path).stem}.sweep.gguf"
    with atomic_file(out) as tmp:
        shutil.copyfile(path, tmp)
    return out


def set_thresholds(path: Path, activation: list[float] | None = None, predictor: list[float] | None = None) -> None:
    """Overwrite the per-layer threshold arrays of a PowerInfer file in place (same length, same type)."""
    reader = open_reader(path, writable=True)
    for key, values in ((ACTIVATION_THRESHOLDS, activation), (PREDICTOR_THRESHOLDS, predictor)):
        if values is None:
            continue
        f = reader.fields.get(key)
        if f is None:
            raise UserError(f"{path}: no {key} to overwrite")
        if len(f.data) != len(values):
            raise UserError(f"{path}: {key} has {len(f.data)} entries, got {len(values)}")
        for index, value in zip(f.data, values):
            f.parts[index][0] = value
    reader.data.flush()
