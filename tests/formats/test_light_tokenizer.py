"""The tokenizer a run uses (formats/light_tokenizer.py: the `tokenizers` library and jinja2, no transformers) gives
exactly what transformers' tokenizer of the same file gives (formats/tokenizer.py's _build_tokenizer, what runs used
before): ids with and without special tokens, text with and without them, each token's text, the special tokens,
the vocabulary, chat prompts as text and as ids; built from transformers' (a cache miss) and loaded from the cache.
Files: the default SmolLM2 GGUF (byte-level BPE rebuilt by transformers' GGUF builder) and the tiny models of each
tokenizer kind converted (SentencePiece; byte-level BPE from its stored tokenizer.json with GPT-2's, Falcon's and
Qwen's pre-tokenizers; Qwen's, Gemma's and Phi-3's chat templates)."""
from __future__ import annotations

import pytest
from engine_helpers import converted  # noqa: F401
from tiny_models import DATA, training_text

from powerinfer_tools.formats import tokenizer
from powerinfer_tools.formats.light_tokenizer import Tokenizer
from powerinfer_tools.models import default_model

TINY_KINDS = ("llama-relu", "opt", "falcon", "qwen2", "gemma3", "phi3")
N_LINES = 300

CHATS = [
    [{"role": "user", "content": "Who art thou?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "A joke,\n  with ünïcödé, 日本語 and 🙂 please"}],
]


def lines(name: str) -> list[str]:
    """N_LINES non-empty lines of a shared data file (the tiny models' training text where it is absent)."""
    path = DATA / name
    text = path.read_text(encoding="utf-8") if path.is_file() else training_text()
    return [line for line in text.splitlines() if line.strip()][1000:1000 + N_LINES]


@pytest.fixture(scope="module", params=("smollm2", *TINY_KINDS))
def pair(request, converted):
    """(transformers' tokenizer of the file, [ours made from it (a cache miss), ours loaded from the cache])."""
    path = default_model.default_gguf() if request.param == "smollm2" else converted(request.param)
    ref = tokenizer._build_tokenizer(path)
    tokenizer.tokenizer_from_file(path)  # fills the cache
    cached = tokenizer._load_cached(tokenizer._cache_entry(path))
    assert cached is not None
    return ref, [Tokenizer.from_transformers(ref), cached]


def special_text(ref) -> list[str]:
    """Lines holding every added token's text (ChatML's markers, BOS, EOS): matched as tokens, or not."""
    added = [t.content for t in ref.added_tokens_decoder.values()]
    return [f"x{a}y {a} z{a}" for a in added] + ["".join(added), "<|im_start|>user\nhi<|im_end|>\n"]


def outcome(call, *args, **kwargs):
    """What call(*args, **kwargs) gives, or the type and message of what it raises: a refusal must match too."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:  # the template's own refusal, jinja's sandbox
        return type(exc).__name__, str(exc)


def test_encode_and_decode_as_transformers(pair):
    ref, ours = pair
    texts = lines("wikitext-2-raw-test.txt") + lines("tinyshakespeare.txt") + special_text(ref)
    whole = "\n".join(texts)
    for tok in ours:
        for text in (*texts, whole, "", " ", "\n\n  \t"):
            for special in (True, False):
                want = ref(text, add_special_tokens=special).input_ids
                assert tok(text, add_special_tokens=special).input_ids == want, text
                assert tok(text, add_special_tokens=special)["input_ids"] == want
                assert tok.encode(text, add_special_tokens=special) == want
        ids = ref(whole).input_ids + [i for i in (ref.eos_token_id, ref.pad_token_id) if i is not None]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
            for text in texts:
                line_ids = ref(text).input_ids
                assert tok.decode(line_ids, skip_special_tokens=skip) == ref.decode(line_ids,
                                                                                    skip_special_tokens=skip)
        assert [tok.decode(i) for i in range(len(ref))] == [ref.decode(i) for i in range(len(ref))]
        assert tok.decode([]) == ref.decode([])


def test_special_tokens_and_vocabulary_as_transformers(pair):
    ref, ours = pair
    for tok in ours:
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            assert getattr(tok, name) == getattr(ref, name), name
            assert getattr(tok, f"{name}_id") == getattr(ref, f"{name}_id"), name
        assert tok.get_vocab() == ref.get_vocab()
        assert tok.added_tokens_decoder == ref.added_tokens_decoder
        assert len(tok) == len(ref)
        assert tok.chat_template == ref.chat_template


def test_chat_template_as_transformers(pair):
    ref, ours = pair
    if ref.chat_template is None:
        pytest.skip("the file stores no chat template")
    for tok in ours:
        for chat in CHATS:
            for gen in (True, False):
                for tokenize in (True, False):
                    kwargs = {"add_generation_prompt": gen, "tokenize": tokenize, "return_dict": False}
                    want = outcome(ref.apply_chat_template, chat, **kwargs)
                    assert outcome(tok.apply_chat_template, chat, **kwargs) == want
                got = tok.apply_chat_template(chat, add_generation_prompt=gen)  # the default: ids as an Encoding
                assert got.input_ids == ref.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"]


# templates that use what transformers' environment gives: tools, tojson (no HTML escaping), namespace, loop
# controls, {% generation %}, dict(), raise_exception, strftime_now, the special tokens, trim/lstrip of blocks
TOOLS_TEMPLATE = """{%- if tools %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You help.{% endif %}
# Tools
{% for tool in tools %}
    {{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=-1, seen=dict(n=0)) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
    {%- if loop.index0 > 6 %}{% break %}{% endif %}
    {%- if message.role == 'system' and tools %}{% continue %}{% endif %}
    {%- if message.role == 'assistant' and message.tool_calls is defined %}
<|im_start|>assistant{% if message.content is defined %} {{ message.content }}{% endif %}
        {%- for call in message.tool_calls %}
<tool_call>{{ call.function | tojson(indent=1) }}</tool_call>
        {%- endfor %}<|im_end|>
    {%- elif message.role == 'tool' %}
<|im_start|>user <tool_response>{{ message.content }}</tool_response><|im_end|>
    {%- else %}
<|im_start|>{{ message.role }}{% if loop.index0 == ns.last_user %} (last){% endif %}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}|{{ message.thinking }}</think>
{% endif %}{% generation %}{{ message.content }}{% endgeneration %}<|im_end|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}{{ bos_token ~ '|' ~ eos_token ~ '|' ~ ({'b': '<&>', 'a': 1} | tojson) }}"""
REFUSING_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                     "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
UNDERSCORE_TEMPLATE = "{% set ns = namespace(_hidden=1) %}{{ messages[0]['content'] }}"
DATE_TEMPLATE = "{{ strftime_now('%Y') }} {{ messages | length }} {{ messages[0] | tojson }}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city <b>&</b>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 °C"},
             {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said so."},
             {"role": "user", "content": "Thanks"}]


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, REFUSING_TEMPLATE, UNDERSCORE_TEMPLATE, DATE_TEMPLATE],
                         ids=["tools", "raise_exception", "namespace-underscore", "strftime"])
def test_template_environment_as_transformers(template, converted):
    ref = tokenizer._build_tokenizer(converted("qwen2"))
    ref.chat_template = template
    tok = Tokenizer.from_transformers(ref)
    for chat in (*CHATS, TOOL_CHAT):
        for tools in (None, TOOLS):
            for gen in (True, False):
                for tokenize in (True, False):
                    kwargs = {"tools": tools, "add_generation_prompt": gen, "tokenize": tokenize, "return_dict": False}
                    want = outcome(ref.apply_chat_template, chat, **kwargs)
                    assert outcome(tok.apply_chat_template, chat, **kwargs) == want, (chat, tools, gen)
    if template is TOOLS_TEMPLATE:  # the template took every path it has
        text = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        for needle in ("<tool_call>", "<tool_response>", '"<&>"', "<think>The tool said so.|The tool said so.",
                       "(last)", "<b>&</b>"):
            assert needle in text, needle


def test_without_a_chat_template_apply_is_refused(converted):
    tok = tokenizer.tokenizer_from_file(converted("llama-relu"))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat_template is not set"):
        tok.apply_chat_template(CHATS[0])


def test_clean_up_tokenization_spaces_as_transformers(converted):
    """Where the saved config asks for it, decode cleans spaces before punctuation as transformers does; transformers
    skips that for BPE models (every vocabulary a GGUF holds rebuilds as one), and so does ours: a word-level model
    shows the cleaning, the byte-level BPE one its absence."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = "Hello , world . Isn 't it ? Yes !"
    words = Backend(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *dict.fromkeys(text.split())])},
                                     unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    refs = {"word-level": PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]"),
            "opt": tokenizer._build_tokenizer(converted("opt"))}
    for name, ref in refs.items():
        ref.clean_up_tokenization_spaces = True
        tok = Tokenizer.from_transformers(ref)
        ids = ref(text).input_ids
        got = tok.decode(ids)
        assert got == ref.decode(ids)
        assert (got != tok.backend.decode(ids)) == (name == "word-level"), got


def test_llguidance_vocabulary_as_from_tokenizer(converted):
    """LLM.vocabulary builds llguidance's tokenizer from our backend: the same as llguidance.hf.from_tokenizer gives
    for transformers' tokenizer."""
    from llguidance import LLTokenizer
    from llguidance.hf import from_tokenizer

    for kind in ("llama-relu", "qwen2"):
        ref = tokenizer._build_tokenizer(converted(kind))
        tok = tokenizer.tokenizer_from_file(converted(kind))
        theirs = from_tokenizer(ref, n_vocab=len(ref), eos_token=[ref.eos_token_id])
        ours = LLTokenizer(tok.backend.to_str(), n_vocab=len(tok), eos_token=[tok.eos_token_id])
        assert ours.vocab_size == theirs.vocab_size and ours.eos_tokens == theirs.eos_tokens
        assert [ours.decode_bytes([i]) for i in range(len(tok))] == [theirs.decode_bytes([i]) for i in range(len(ref))]
        text = "\n".join(lines("tinyshakespeare.txt")[:50])
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)
