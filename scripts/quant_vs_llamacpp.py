"""Our quantizer against llama.cpp's on the same weights: perplexity (our engine, dense) and bytes of each file.

    python scripts/quant_vs_llamacpp.py --peer-python ~/llamacpp-venv/bin/python \
        --text ../shared/data/wikitext-2-raw-test.txt --work /tmp/quant-cmp

The source is the default model's GGUF (a llama.cpp Q4_1 file). Its tensors, dequantized, are written once as a
plain llama.cpp GGUF at --source-type (f32: the values `pi-tools convert` quantizes from, bit for bit; f16: what
llama.cpp's converter would hand its quantizer), which llama.cpp's quantizer (llama-cpp-python's low-level
`llama_model_quantize`, run by --peer-python) turns into Q4_0 and Q8_0. `pi-tools convert` writes ours from the
same source; every file is scored by `pi-tools perplexity --sparse-mode dense` on the same windows, and
llama.cpp's files (and the plain source) also by llama.cpp itself (the bench's worker, --peer-python), as a
cross-check of our engine on them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from powerinfer_tools import models
from powerinfer_tools.formats.gguf_io import open_reader

# llama.cpp's llama_ftype values (include/llama.h): what llama_model_quantize is asked to write
LLAMA_FTYPES = {"q4_0": 2, "q8_0": 7}

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def write_plain_source(src: Path, dst: Path, source_type: str) -> None:
    """`src` (any llama.cpp GGUF) with every matrix dequantized to `source_type`, vectors f32, metadata kept."""
    import gguf

    reader = open_reader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            ftype = gguf.LlamaFileType.ALL_F32 if source_type == "f32" else gguf.LlamaFileType.MOSTLY_F16
            writer.add_file_type(ftype)
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if data.ndim > 1 and source_type == "f16":
            data = data.astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_types(path: Path) -> str:
    """The types of a file's matrices, by kind (blk.N. prefixes merged): 'token_embd Q8_0, attn_q Q4_0, ...'."""
    kinds: dict[str, set[str]] = {}
    for t in open_reader(path).tensors:
        if len(t.shape) > 1:
            kinds.setdefault(t.name.split(".")[-2], set()).add(t.tensor_type.name)
    return ", ".join(f"{k} {'/'.join(sorted(v))}" for k, v in kinds.items())


def perplexity(path: Path, text: Path, chunks: int, ctx: int, threads: int) -> float:
    out = subprocess.run(["pi-tools", "perplexity", "-m", str(path), "-f", str(text), "-c", str(ctx),
                          "--chunks", str(chunks), "-t", str(threads), "--sparse-mode", "dense", "--json"],
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)["perplexity"])


def llamacpp_perplexity(peer_python: str, path: Path, windows: list[list[int]], threads: int) -> float:
    """llama.cpp's own perplexity of `path` on `windows` (the bench worker's nll op)."""
    from powerinfer_tools.bench.runners import Runner, Worker

    worker = Worker("llama.cpp", path, threads, len(windows[0]) + 8, python=peer_python)
    try:
        return Runner(worker, "llama.cpp").perplexity(windows)
    finally:
        worker.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-python", required=True, help="a Python with llama-cpp-python")
    ap.add_argument("--text", type=Path, required=True, help="evaluation text (wikitext-2 raw test)")
    ap.add_argument("--work", type=Path, required=True, help="folder for the files")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--source-type", default="f32", choices=("f32", "f16"))
    ap.add_argument("--types", default="q4_0,q8_0")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    src = models.resolve(args.model).path
    plain = args.work / f"source.{args.source_type}.gguf"
    if not plain.exists():
        write_plain_source(src, plain, args.source_type)
    rows = []
    for outtype in args.types.split(","):
        theirs = args.work / f"llamacpp.{outtype}.gguf"
        ours = args.work / f"ours.{outtype}.gguf"
        subprocess.run([args.peer_python, "-c", QUANTIZE, str(plain), str(theirs), str(LLAMA_FTYPES[outtype])],
                       check=True, capture_output=True)
        subprocess.run(["pi-tools", "convert", "-m", args.model, "--outtype", outtype, "-o", str(ours)],
                       check=True, capture_output=True)
        for who, path in (("llama.cpp", theirs), ("pi-tools", ours)):
            rows.append((outtype, who, perplexity(path, args.text, args.chunks, args.ctx, args.threads),
                         path.stat().st_size, tensor_types(path)))
    from powerinfer_tools.formats.tokenizer import tokenizer_from_file
    from powerinfer_tools.stages.profiling.calibration import read_text, sequences_from_text

    windows = sequences_from_text(tokenizer_from_file(plain), [read_text(args.text, role="evaluation")], args.ctx,
                                  args.ctx * args.chunks).tolist()
    own = {path: llamacpp_perplexity(args.peer_python, path, windows, args.threads)
           for path in [plain] + [args.work / f"llamacpp.{t}.gguf" for t in args.types.split(",")]}
    print(f"source: {src.name} -> {args.source_type}; {args.chunks} windows of {args.ctx} of {args.text.name}; "
          f"llama.cpp's own perplexity of the source {own[plain]:.4f}, ours of it "
          f"{perplexity(plain, args.text, args.chunks, args.ctx, args.threads):.4f}")
    print("| type | quantizer | perplexity (pi-tools) | perplexity (llama.cpp) | bytes | matrices |")
    print("|---|---|---|---|---|---|")
    for outtype, who, ppl, size, types in rows:
        theirs = own.get(args.work / f"llamacpp.{outtype}.gguf") if who == "llama.cpp" else None
        print(f"| {outtype} | {who} | {ppl:.4f} | {f'{theirs:.4f}' if theirs else '– (reads no PowerInfer file)'} "
              f"| {size:,} | {types} |")


if __name__ == "__main__":
    sys.exit(main())
