"""One LLM shared by threads (the tiny chat model, greedy): calls hammering it from three threads each get the
answer the same call gets alone; a stream holds the LLM until it is exhausted, closed or dropped, and another
thread's call waits for it; in the stream's own thread a later call ends it."""
from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from powerinfer_tools import LLM

GREEDY = {"temperature": 0.0, "max_tokens": 12}
PROMPTS = ("ROMEO: But soft", "JULIET: O Romeo", "First Citizen: Before we proceed")
THREADS, CALLS = 3, 25


@pytest.fixture
def llm(tiny_chat_file):
    with LLM(tiny_chat_file, threads=1, ctx_size=256) as model:
        yield model


def call(llm: LLM, kind: str, prompt: str) -> str:
    """One call of `kind` (whole or streamed, complete or chat) on prompt; its text."""
    if kind == "complete":
        return llm.complete(prompt, **GREEDY).text
    if kind == "chat":
        return llm.chat([{"role": "user", "content": prompt}], **GREEDY).text
    if kind == "complete-stream":
        return "".join(c.text for c in llm.complete(prompt, stream=True, **GREEDY))
    return "".join(c.text for c in llm.chat([{"role": "user", "content": prompt}], stream=True, **GREEDY))


KINDS = ("complete", "chat", "complete-stream", "chat-stream")


def test_threads_hammering_one_llm_get_their_own_answers(llm):
    alone = {(kind, p): call(llm, kind, p) for kind in KINDS for p in PROMPTS}
    assert len({alone[("complete", p)] for p in PROMPTS}) == len(PROMPTS)  # another's answer would show
    assert len({alone[("chat", p)] for p in PROMPTS}) == len(PROMPTS)
    start = threading.Barrier(THREADS)
    got: list[list[tuple[tuple[str, str], str]]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        start.wait()
        try:
            for n in range(CALLS):
                key = (KINDS[(n + i) % len(KINDS)], PROMPTS[i])
                got[i].append((key, call(llm, *key)))
                llm.tokenize(PROMPTS[i])  # the tokenizer is used, unguarded, beside another thread's generation
        except BaseException as exc:  # noqa: BLE001  (reported below, with every thread's)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [len(g) for g in got] == [CALLS] * THREADS
    for answers in got:
        for key, text in answers:
            assert text == alone[key], key


def waiting_call(llm: LLM, prompt: str) -> tuple[threading.Thread, threading.Event, list[str]]:
    """A complete() on another thread: its thread, set when it returned, and its text."""
    done, out = threading.Event(), []

    def run() -> None:
        out.append(llm.complete(prompt, **GREEDY).text)
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done, out


@contextmanager
def another_thread_waits(llm: LLM, prompt: str, theirs: str) -> Iterator[None]:
    """A complete() on another thread that waits while the block has not yet run, and answers `theirs` after."""
    thread, done, out = waiting_call(llm, prompt)
    assert not done.wait(0.3)
    yield
    assert done.wait(60) and out == [theirs]
    thread.join(60)


def test_a_stream_holds_the_llm_until_exhausted_and_another_thread_waits(llm):
    mine, theirs = (llm.complete(p, **GREEDY).text for p in PROMPTS[:2])
    stream = llm.complete(PROMPTS[0], stream=True, **GREEDY)
    text = next(stream).text
    thread, done, out = waiting_call(llm, PROMPTS[1])
    assert not done.wait(0.5)  # waiting for the stream, not ending it
    text += "".join(c.text for c in stream)
    assert text == mine
    thread.join(60)
    assert out == [theirs]


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_a_stream_closed_or_dropped_lets_the_waiting_call_run(llm, how):
    theirs = llm.complete(PROMPTS[1], **GREEDY).text
    stream = llm.chat([{"role": "user", "content": PROMPTS[0]}], stream=True, **GREEDY)
    next(stream)
    with another_thread_waits(llm, PROMPTS[1], theirs):
        if how == "close":
            stream.close()
        elif how == "with":
            with stream:
                next(stream)
        else:
            del stream
            gc.collect()


def test_an_unstarted_stream_holds_the_llm_too(llm):
    theirs = llm.complete(PROMPTS[1], **GREEDY).text
    stream = llm.complete(PROMPTS[0], stream=True, **GREEDY)
    with another_thread_waits(llm, PROMPTS[1], theirs):
        stream.close()


def test_a_later_call_in_the_streams_own_thread_ends_it(llm):
    alone = llm.complete(PROMPTS[2], **GREEDY).text
    stream = llm.complete(PROMPTS[0], stream=True, **GREEDY)
    next(stream)
    assert llm.complete(PROMPTS[2], **GREEDY).text == alone  # no wait on itself; the answer is its own
    with pytest.raises(RuntimeError, match="ended by a later call"):
        next(stream)
    unstarted = llm.complete(PROMPTS[0], stream=True, **GREEDY)
    assert llm.count_tokens(PROMPTS[1]) > 0  # tokenizing never waits on the stream
    assert llm.complete(PROMPTS[2], **GREEDY).text == alone
    with pytest.raises(RuntimeError, match="ended by a later call"):
        next(unstarted)  # never evaluates its prompt into the engine the later call used:
    again = llm.complete(PROMPTS[2], **GREEDY)
    # its cache is whole: all but the last two tokens reused, which a batch evaluates as in a fresh call
    assert again.text == alone and again.usage.cached_tokens == again.usage.prompt_tokens - 2
    thread, done, out = waiting_call(llm, PROMPTS[2])  # and the LLM is free for others
    assert done.wait(60) and out == [alone]
    thread.join(60)
