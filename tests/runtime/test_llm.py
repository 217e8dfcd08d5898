"""The text-level Python API (powerinfer_tools.LLM) on the real SmolLM2 q8_0 file: its text is the engine's
greedy tokens decoded, streaming and stop strings agree with the whole answer, the chat's end token never shows,
a chat's next turn reuses its earlier prompt and answers as a fresh model would, any call answers as it would
alone, the penalties reach the engine's sampler, and bad requests are one RequestError."""
from __future__ import annotations

import math

import pytest

import powerinfer_engine as engine
from powerinfer_tools import LLM
from powerinfer_tools.runtime.llm import RequestError, Sampling

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}
PROMPT = "The history of the city of Paris begins"


@pytest.fixture(scope="module")
def llm(smollm2_file):
    with LLM(smollm2_file("q8_0"), threads=2, sparse_mode="dense", ctx_size=512) as model:
        yield model


def test_complete_is_the_engines_greedy_tokens_decoded(llm, smollm2_file):
    ids = llm.tokenize(PROMPT)
    with engine.Model(smollm2_file("q8_0"), threads=2, ctx_size=512) as raw:
        tokens = list(raw.generate(ids, 24))
    c = llm.complete(PROMPT, max_tokens=24, **GREEDY)
    assert c.text == llm.detokenize(tokens)
    assert c.finish_reason == "length"
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ids), 24)
    assert c.timings.generated_tokens == 24 and c.timings.generated_tokens_per_second > 0


def test_stream_and_stop_strings_agree_with_the_whole_answer(llm):
    whole = llm.complete(PROMPT, max_tokens=24, **GREEDY).text
    chunks = list(llm.complete(PROMPT, max_tokens=24, stream=True, **GREEDY))
    assert "".join(c.text for c in chunks) == whole
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].completion.text == whole and chunks[-1].finish_reason == "length"
    # a stop string spanning tokens, in the middle of the text: everything before it, itself never streamed
    words = whole.split(" ")
    stop = " ".join(words[3:5])
    assert stop and stop in whole
    cut = list(llm.complete(PROMPT, max_tokens=24, stop=["@@never@@", stop], stream=True, **GREEDY))
    assert "".join(c.text for c in cut) == whole[:whole.index(stop)]
    assert cut[-1].finish_reason == "stop" and all(stop not in c.text for c in cut)


def test_chat_turns_reuse_the_cache_and_answer_as_a_fresh_model(llm, smollm2_file):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Name a fruit."}]
    first = llm.chat(messages, max_tokens=48, **GREEDY)
    assert first.finish_reason == "stop" and first.text and "<|im_end|>" not in first.text
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a vegetable?"}]
    second = llm.chat(messages, max_tokens=48, **GREEDY)
    # turn one's prompt is reused; its reply, which decode steps computed, is evaluated again as a fresh call would
    assert second.usage.cached_tokens == first.usage.prompt_tokens
    assert second.timings.prompt_tokens == second.usage.prompt_tokens - second.usage.cached_tokens
    with LLM(smollm2_file("q8_0"), threads=2, sparse_mode="dense", ctx_size=512) as fresh:
        again = fresh.chat(messages, max_tokens=48, **GREEDY)
    assert again.usage.cached_tokens == 0 and again.text == second.text


HISTORY_PROMPTS = ("The planets of the solar system are Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and",
                   "The history of the city of Paris begins with", "The history of the city of Rome begins with")


def test_a_calls_answer_does_not_depend_on_the_calls_before_it(llm, smollm2_file):
    """Greedy answers of one LLM after other calls equal a fresh LLM's for the same prompts: the same prompt twice
    (all but its last token cached), a prompt sharing another's start, a prompt continuing an earlier answer
    (whose tokens the decode path computed), and prompts whose last token is alone in its batch. The engine's
    batch and decode paths round differently, so reusing a decode-computed token, or evaluating alone a token a
    fresh call evaluates in a batch, changed greedy answers."""
    def alone(prompt: str) -> str:
        with LLM(smollm2_file("q8_0"), threads=2, sparse_mode="dense", ctx_size=512) as fresh:
            return fresh.complete(prompt, max_tokens=40, **GREEDY).text

    n_batch = llm.model.info["n_batch"]
    long_ids = llm.tokenize(" ".join(HISTORY_PROMPTS * 8))
    alone_last = [llm.detokenize(long_ids[:n_batch + 1]), llm.detokenize(long_ids[:n_batch + 2])]
    prompts = [*HISTORY_PROMPTS, HISTORY_PROMPTS[0] + alone(HISTORY_PROMPTS[0]), *alone_last]
    wanted = {p: alone(p) for p in prompts}
    assert any(len(llm.tokenize(p)) % n_batch == 1 for p in alone_last)
    for order in (prompts, prompts[::-1], [p for p in prompts for _ in range(2)]):
        for p in order:
            got = llm.complete(p, max_tokens=40, **GREEDY)
            assert got.text == wanted[p], (p, got.usage)


def test_presence_penalty_reaches_the_sampler(llm):
    c = llm.complete("one one one one one one", max_tokens=16, presence_penalty=1e6, repeat_last_n=64, **GREEDY)
    window = llm.tokenize("one one one one one one")
    generated = llm.tokenize(c.text, add_special=False)
    # greedy with an overwhelming presence penalty: no token of the window (prompt and reply) is chosen twice
    assert len(set(generated)) == len(generated) and not set(generated) & set(window)
    plain = llm.complete("one one one one one one", max_tokens=16, **GREEDY)
    assert plain.text != c.text


@pytest.mark.parametrize("call, message", [
    (lambda m: m.complete(b"bytes"), "expected text"),
    (lambda m: m.complete("hi", temperature=math.nan), "temperature must be a finite number"),
    (lambda m: m.complete("hi", top_p=0), "top_p must be in"),
    (lambda m: m.complete("hi", max_tokens=-1), "max_tokens"),
    (lambda m: m.complete("word " * 600), "context holds 512"),
    (lambda m: m.chat([]), "messages is empty"),
    (lambda m: m.chat([{"role": "user"}]), "'content'"),
    (lambda m: m.complete("\udcff"), "not valid UTF-8"),
])
def test_bad_requests_are_one_error(llm, call, message):
    with pytest.raises(RequestError, match=message):
        call(llm)
    assert llm.complete("Hello", max_tokens=2, **GREEDY).usage.completion_tokens == 2  # still serving


def test_sampling_with_a_seed_repeats(llm):
    """The same seed and the same cache state give the same text (here both calls follow another prompt, so each
    evaluates the whole prompt: a prompt evaluated in another split can differ by float rounding)."""
    s = Sampling(temperature=1.0, seed=7)
    texts = []
    for _ in range(2):
        llm.complete("Hello", max_tokens=1, **GREEDY)
        texts.append(llm.complete(PROMPT, max_tokens=12, sampling=s).text)
    assert texts[0] == texts[1]
    llm.complete("Hello", max_tokens=1, **GREEDY)
    assert llm.complete(PROMPT, max_tokens=12, sampling=Sampling(temperature=1.0, seed=8)).text != texts[0]
