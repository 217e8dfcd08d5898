"""The tokenizer `run`, `chat`, `serve` and `perplexity` use: the transformers tokenizer formats/tokenizer.py builds
from a model file, kept as what it runs on (the `tokenizers` library's JSON of its backend, as transformers left it:
special tokens added, BOS/EOS post-processor set) and the few settings transformers applies around that backend, and
used through `tokenizers` and jinja2 alone. Importing transformers takes about a second, the most of a run's start;
this gives the same ids, text and chat prompts (tests/formats/test_light_tokenizer.py) without it.

What transformers' TokenizersBackend does around the backend (transformers/tokenization_utils_tokenizers.py):
encoding is the backend's encode (no padding, no truncation; special tokens in the text matched unless
split_special_tokens); decoding the backend's decode, then transformers' clean_up_tokenization where
clean_up_tokenization_spaces says so (never for BPE models); a named special token's id is the backend's id of its
text (the unknown token's id for text it does not know); chat templates render with the named special tokens as
variables and are tokenized without special tokens added (formats/chat_template.py).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as Backend

BACKEND_FILE = "tokenizer.json"
SETTINGS_FILE = "pi_tokenizer.json"


@dataclass(frozen=True)
class Settings:
    """What transformers applies around the backend, as it was for the tokenizer this one was made from."""
    # transformers' special_tokens_map: name (bos_token, eos_token, ...) -> its text, those set; a template's variables
    special_tokens: dict[str, str] = field(default_factory=dict)
    clean_up_tokenization_spaces: bool = False  # decode cleans spaces before punctuation (already False for BPE)
    split_special_tokens: bool = False          # special tokens' text in the input is encoded as plain text
    chat_template: str | None = None


@dataclass(frozen=True)
class Encoding:
    """A text's ids; `enc["input_ids"]` works as on transformers' BatchEncoding, for code that takes either."""
    input_ids: list[int]
    attention_mask: list[int]

    def __getitem__(self, key: str) -> list[int]:
        return getattr(self, key)


class Tokenizer:
    """transformers' PreTrainedTokenizerFast interface, the part the toolkit uses."""

    def __init__(self, backend: Backend, settings: Settings):
        backend.no_padding()
        backend.no_truncation()
        backend.encode_special_tokens = settings.split_special_tokens
        self.backend = backend
        self.settings = settings

    @classmethod
    def from_transformers(cls, tok) -> Tokenizer:
        """The same tokenizer as transformers' `tok` (a PreTrainedTokenizerFast), which it does not import."""
        clean_up = bool(tok.clean_up_tokenization_spaces) and (
            type(tok.backend_tokenizer.model).__name__ != "BPE"
            or bool(tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output))
        template = tok.chat_template
        if template is not None and not isinstance(template, str):
            raise ValueError("a tokenizer with several named chat templates")  # a GGUF stores one
        settings = Settings(special_tokens=dict(tok.special_tokens_map), clean_up_tokenization_spaces=clean_up,
                            split_special_tokens=bool(tok.split_special_tokens), chat_template=template)
        return cls(Backend.from_str(tok.backend_tokenizer.to_str()), settings)

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        """The tokenizer save() wrote in directory; whatever a damaged one raises (OSError, ValueError, the
        tokenizers library's own exception, TypeError for settings of another shape) is the caller's to handle."""
        fields = json.loads((directory / SETTINGS_FILE).read_text(encoding="utf-8"))
        if not isinstance(fields, dict):
            raise TypeError(f"{directory / SETTINGS_FILE} is not an object")
        settings = Settings(**fields)
        special = settings.special_tokens
        if not (isinstance(special, dict) and all(isinstance(v, str) for v in special.values())
                and isinstance(settings.clean_up_tokenization_spaces, bool)
                and isinstance(settings.split_special_tokens, bool)
                and isinstance(settings.chat_template, (str, type(None)))):
            raise TypeError(f"{directory / SETTINGS_FILE} holds settings of another shape")
        return cls(Backend.from_file(str(directory / BACKEND_FILE)), settings)

    def save(self, directory: Path) -> None:
        self.backend.save(str(directory / BACKEND_FILE))
        (directory / SETTINGS_FILE).write_text(json.dumps(asdict(self.settings)), encoding="utf-8")

    # ---- text <-> ids -------------------------------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(enc.ids, enc.attention_mask)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of one id or of a sequence of them (numpy's integers too)."""
        text = self.backend.decode([int(i) for i in ids] if isinstance(ids, Iterable) else [int(ids)],
                                   skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.settings.clean_up_tokenization_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict:
        """id -> tokenizers.AddedToken, as transformers gives it."""
        return self.backend.get_added_tokens_decoder()

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- special tokens -----------------------------------------------------------------------------
    def _token(self, name: str) -> str | None:
        return self.settings.special_tokens.get(name)

    def _id(self, name: str) -> int | None:
        token = self._token(name)
        if token is None:
            return None
        found = self.backend.token_to_id(token)
        if found is None and name != "unk_token":
            return self._id("unk_token")
        return found

    bos_token = property(lambda self: self._token("bos_token"))
    eos_token = property(lambda self: self._token("eos_token"))
    unk_token = property(lambda self: self._token("unk_token"))
    pad_token = property(lambda self: self._token("pad_token"))
    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))

    # ---- chat ---------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.settings.chat_template

    def apply_chat_template(self, conversation: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True) -> str | list[int] | Encoding:
        """The conversation under the model's template: its text (tokenize=False), else its ids without special
        tokens added (what the template writes is all), as an Encoding (return_dict) or a list."""
        from powerinfer_tools.formats.chat_template import render_chat

        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        text = render_chat(self.chat_template, conversation, tools, add_generation_prompt,
                           self.settings.special_tokens)
        if not tokenize:
            return text
        enc = self(text, add_special_tokens=False)
        return enc if return_dict else enc.input_ids


def _clean_up_tokenization(text: str) -> str:
    """transformers' PreTrainedTokenizerBase.clean_up_tokenization (spaces before punctuation and contractions)."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))
