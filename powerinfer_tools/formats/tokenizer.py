"""The vocabulary inside a PowerInfer GGUF: written from a model's tokenizer, read back as a
transformers tokenizer.

Writing uses llama.cpp's `tokenizer.ggml.*` keys: SentencePiece models (`tokenizer.model`) as
`llama` (pieces, scores, token types), byte-level BPE (`tokenizer.json`) as `gpt2` (byte-level
spelled tokens and merges); special token ids, add-BOS/EOS flags and the chat template come from
gguf-py's SpecialVocab. A GGUF source (the default SmolLM2) has these keys already: they are copied.
Byte-level BPE models also get their `tokenizer.json` whole, as `tokenizer.huggingface.json`
(llama.cpp's key for it): tokens and merges do not say how text is split before merging (Falcon
splits off punctuation and groups digits in threes, GPT-2 does neither), the JSON does.

Reading (`tokenizer_from_file`) rebuilds the tokenizer from those keys alone, so `pi-tools run`
needs neither the original model directory nor the hub: from the stored JSON when there is one,
else with transformers' GGUF tokenizer builders. Rebuilding means parsing ~100k vocabulary strings
through gguf-py (~2 s for SmolLM2, most of a `pi-tools run` start), so the result is kept in the cache
(`cache_dir()/tokenizers`, the newest few files' tokenizers) as light_tokenizer saves it and loaded from
there with the `tokenizers` library alone: a start with a filled cache imports no transformers.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from powerinfer_tools.core.errors import UserError
from powerinfer_tools.models import ModelSource

if TYPE_CHECKING:
    from powerinfer_tools.formats.light_tokenizer import Tokenizer

HF_JSON_KEY = "tokenizer.huggingface.json"
CACHE_FORMAT = 2        # bump when what tokenizer_from_file builds changes, so older cached tokenizers are not used
CACHE_KEEP = 8          # tokenizers kept in the cache, the most recently used


def write_vocab(writer, source: ModelSource, n_vocab: int, gguf_reader=None) -> str:
    """Add the source's vocabulary (padded to the embedding's n_vocab rows); returns its kind.
    `gguf_reader`: an open reader of a GGUF source, to avoid parsing its metadata twice."""
    if source.gguf_file is not None:
        from powerinfer_tools.formats.gguf_io import open_reader

        return _copy_gguf_vocab(writer, gguf_reader or open_reader(source.path), source.path)
    directory = source.directory
    if (directory / "tokenizer.model").is_file():
        kind, tokens, scores, types = "llama", *_sentencepiece_tokens(directory)
    elif (directory / "tokenizer.json").is_file() or (directory / "vocab.json").is_file():
        kind, tokens, scores, types = "gpt2", *_byte_level_tokens(directory)
    else:
        raise UserError(f"{directory} has no tokenizer (tokenizer.model or tokenizer.json)")
    if len(tokens) > n_vocab:
        raise UserError(f"the tokenizer has {len(tokens)} tokens but the model's embedding only {n_vocab} rows")
    import gguf

    for i in range(len(tokens), n_vocab):  # embedding rows the tokenizer never produces
        tokens.append(f"[PAD{i}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    if kind == "llama":
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(directory, load_merges=kind == "gpt2", n_vocab=n_vocab)
    special.add_special_token.update(_added_special_tokens(directory))
    special.add_to_gguf(writer, quiet=True)
    if kind == "gpt2" and (directory / "tokenizer.json").is_file():
        writer.add_string(HF_JSON_KEY, (directory / "tokenizer.json").read_text(encoding="utf-8"))
    return kind


def _sentencepiece_tokens(directory: Path):
    import gguf

    vocab = gguf.SentencePieceVocab(directory)
    tokens, scores, types = [], [], []
    for text, score, token_type in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(token_type)
    return tokens, scores, types


def _byte_level_tokens(directory: Path):
    """Tokens in their byte-level spelling; added tokens CONTROL when special, else USER_DEFINED."""
    import gguf

    tok = _hf_tokenizer(directory)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        if i not in by_id:
            tokens.append(f"[PAD{i}]".encode())
            types.append(gguf.TokenType.USER_DEFINED)
            continue
        tokens.append(by_id[i].encode())
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    return tokens, [0.0] * len(tokens), types


def _hf_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot load the tokenizer of {directory}: {str(exc).splitlines()[0]}") from None


def _added_special_tokens(directory: Path) -> dict[str, bool]:
    """Whether the HF tokenizer adds BOS / EOS, observed rather than read from config defaults."""
    tok = _hf_tokenizer(directory)
    with_special = tok("a").input_ids
    plain = tok("a", add_special_tokens=False).input_ids
    flags = {}
    if tok.bos_token_id is not None:
        flags["bos"] = with_special[:1] == [tok.bos_token_id] and plain[:1] != [tok.bos_token_id]
    if tok.eos_token_id is not None:
        flags["eos"] = with_special[-1:] == [tok.eos_token_id] and plain[-1:] != [tok.eos_token_id]
    return flags


def _copy_gguf_vocab(writer, reader, path: Path) -> str:
    """Carry every `tokenizer.*` key of a GGUF source over unchanged."""
    from powerinfer_tools.formats.gguf_io import field

    for key, fld in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = fld.types[-1] if len(fld.types) > 1 else None
            writer.add_key_value(key, field(reader, key), fld.types[0], sub_type=sub_type)
    kind = field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise UserError(f"{path} has no vocabulary (tokenizer.ggml.model)")
    return kind


def tokenizer_from_file(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of the vocabulary stored in a GGUF or PowerInfer file: the one transformers builds from it, used
    through light_tokenizer (no transformers import); built before from the same file (same path, size and
    modification time; same transformers) when the cache still has it."""
    from powerinfer_tools.formats.light_tokenizer import Tokenizer

    entry = _cache_entry(Path(path))
    if entry is not None and entry.is_dir():
        cached = _load_cached(entry)
        if cached is not None:
            return cached
    tok = Tokenizer.from_transformers(_build_tokenizer(path))
    if entry is not None:
        _store_cached(tok, entry)
    return tok


def _cache_entry(path: Path) -> Path | None:
    """The cache directory of this file's tokenizer; None when the file cannot be looked at (the build says why).
    The key holds transformers' version, read from its installed metadata (importing it would cost what the cache
    saves): an upgrade builds anew."""
    from importlib.metadata import version

    try:
        path = path.resolve()
        st = path.stat()
    except OSError:
        return None
    key = json.dumps([CACHE_FORMAT, str(path), st.st_size, st.st_mtime_ns, version("transformers")])
    return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:24]


def cache_root() -> Path:
    """Where rebuilt tokenizers are kept, one directory each (the test suite points it at its own)."""
    from powerinfer_tools.models.default_model import cache_dir

    return cache_dir() / "tokenizers"


def _load_cached(entry: Path) -> Tokenizer | None:
    """The tokenizer saved in entry, or None when it does not load (then it is built again and replaces it)."""
    from powerinfer_tools.formats.light_tokenizer import Tokenizer

    try:
        tok = Tokenizer.load(entry)
    except Exception:  # a damaged entry raises whatever its reader does (JSON, tokenizers, OSError): build anew
        return None
    with contextlib.suppress(OSError):
        os.utime(entry)  # most recently used: kept by the pruning below
    return tok


def _store_cached(tok: Tokenizer, entry: Path) -> None:
    """Save the tokenizer under entry (atomically) and keep only the CACHE_KEEP most recently used ones. A cache
    that cannot be written costs the next start its rebuild, nothing else."""
    from powerinfer_tools.core.atomic import atomic_dir

    with contextlib.suppress(OSError, UserError):
        with atomic_dir(entry, force=True) as tmp:
            tok.save(tmp)
        entries = sorted((e for e in entry.parent.iterdir() if e.is_dir() and not e.name.startswith(".")),
                         key=lambda e: e.stat().st_mtime, reverse=True)
        for old in entries[CACHE_KEEP:]:
            shutil.rmtree(old, ignore_errors=True)


def _build_tokenizer(path: str | os.PathLike):
    """transformers' tokenizer of the file's vocabulary: what tokenizer_from_file's tokenizer is made from."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from powerinfer_tools.formats.gguf_io import base_arch, field, open_reader

    reader = open_reader(path)
    meta = {key: field(reader, key) for key in reader.fields if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in meta:
        raise UserError(f"{path} stores no vocabulary (tokenizer.ggml.tokens)")
    if HF_JSON_KEY in meta:
        return _from_hf_json(path, meta)
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, init_kwargs = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        init_kwargs.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece vocabularies
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not isinstance(token_id, int) or not 0 <= token_id < n_tokens:
            raise UserError(f"{path}: tokenizer.ggml.{key} = {token_id!r} is not a token of its {n_tokens}-token "
                            "vocabulary")
        init_kwargs[name] = tokenizer_dict["tokens"][token_id]
    try:
        backend, extra = convert_gguf_tokenizer(base_arch(field(reader, "general.architecture", "")), tokenizer_dict)
    except (ValueError, KeyError) as exc:
        raise UserError(f"{path}: cannot build a tokenizer from its vocabulary ({exc})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs, **extra)


def _from_hf_json(path, meta: dict):
    """The tokenizer stored whole; the GGUF's special token ids name its bos/eos/unk/pad where the JSON
    has that token as a special one (a config's pad id can point at an ordinary token)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _SPECIAL_TOKENS

    text = meta[HF_JSON_KEY]
    try:
        backend = Tokenizer.from_str(text if isinstance(text, str) else "")
    except Exception as exc:  # the tokenizers library raises its own exception type for a bad JSON
        raise UserError(f"{path}: its {HF_JSON_KEY} does not load ({str(exc).splitlines()[0][:200]})") from None
    special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    tokens = meta["tokenizer.ggml.tokens"]
    kwargs = {}
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens) and tokens[token_id] in special:
            kwargs[name] = tokens[token_id]
    if "tokenizer.chat_template" in meta:
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
