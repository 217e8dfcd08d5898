"""`pi-tools chat` on the tiny chat model keeps the conversation through what a terminal or a pipe throws at it:
lines that are not UTF-8 (real stdin bytes, whatever stdin's error handler), a message the template refuses
(one line, then the next turn), and bursts of Ctrl-C at any rate, during a reply, at the prompt or as it exits
(the chat goes on, or ends with status 130; never a traceback, never a crash)."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import gguf
import pexpect
import pytest

from cli_helpers import assert_whole_output_clean, recorded
from engine_helpers import rewrite

TURN = re.compile(r"\[prompt (\d+) tokens: (\d+) from the cache, (\d+) evaluated in \d+ ms; reply (\d+) tokens")
ARGS = ["-m", "powerinfer_tools", "chat", "-t", "1", "-c", "256", "--temp", "0", "-v"]


def chat_run(model, stdin: bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *ARGS, "-m", str(model), "-n", "16"], input=stdin, capture_output=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("errors", ["", "utf-8:strict", "utf-8:surrogateescape"])
def test_a_line_that_is_not_utf8_does_not_end_the_chat(tiny_chat_file, errors):
    done = chat_run(tiny_chat_file, b"Hi there\n\xff\xfe hello\nSay hello.\n", {"PYTHONIOENCODING": errors})
    err = done.stderr.decode()
    assert done.returncode == 0, err
    turns = [tuple(map(int, t)) for t in TURN.findall(err)]
    assert len(turns) == 3 and "error" not in err, err
    assert all(cached > 0 for _, cached, _, _ in turns[1:])  # one conversation, each turn on the cache


def test_a_message_the_template_refuses_is_one_line_and_the_chat_goes_on(tiny_chat_file, tmp_path):
    refusing = ("{% for m in messages %}{% if 'secret' in m['content'] %}{{ raise_exception('no secrets here') }}"
                "{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}<s>assistant:")
    model = rewrite(tiny_chat_file, tmp_path / "refusing.gguf",
                    fields={"tokenizer.chat_template": (refusing, gguf.GGUFValueType.STRING)})
    done = chat_run(model, b"Hi there\nthe secret is 42\nSay hello.\n")
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert err.count("(not sent: the chat template refused the messages: no secrets here)") == 1, err
    turns = [tuple(map(int, t)) for t in TURN.findall(err)]
    assert len(turns) == 2 and turns[1][1] > 0, err  # the refused message left no trace in the conversation


def spawn(model) -> pexpect.spawn:
    return recorded(pexpect.spawn(sys.executable, [*ARGS, "-m", str(model), "-n", "200"], encoding="utf-8", timeout=60,
                                  dimensions=(40, 200), env=dict(os.environ, PYTHONFAULTHANDLER="1")))


def ended_cleanly(chat: pexpect.spawn) -> None:
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.signalstatus is None and chat.exitstatus in (0, 130), (chat.exitstatus, chat.signalstatus)
    assert_whole_output_clean(chat)  # the burst's own output included, which the expects after it consumed


@pytest.mark.parametrize("count, gap", [(60, 1e-4), (30, 1e-3), (10, 1e-2)])
def test_ctrl_c_bursts_leave_the_chat_alive_or_end_it_with_130(tiny_chat_file, count, gap):
    chat = spawn(tiny_chat_file)
    chat.expect_exact("> ")
    chat.sendline("Tell me a long story.")  # the burst lands in the reply, between turns and at the prompt
    for _ in range(count):
        chat.kill(signal.SIGINT)
        time.sleep(gap)
    time.sleep(0.5)  # the signals are handled
    if chat.isalive():
        chat.sendline("Say hello.")
        if chat.expect([TURN, pexpect.EOF]) == 0:  # alive: a whole turn more, then a normal exit
            chat.expect_exact("> ")
            chat.sendline("/exit")
    ended_cleanly(chat)


@pytest.mark.parametrize("run", range(6))
def test_hundreds_of_ctrl_c_stop_the_reply_and_the_chat_goes_on(tiny_chat_file, run):
    """300-1000 signals 0-2 ms apart, from the reply's first tokens on: each one only asks the reply to stop (or,
    at the prompt, starts a fresh line), so none lands as an exception in a generator's cleanup, a finalizer or
    the code between two turns. The chat stays, answers the next message whole, and exits 0."""
    rng = random.Random(run)
    chat = spawn(tiny_chat_file)
    chat.expect_exact("> ")
    chat.sendline("Tell me a long story.")
    for _ in range(rng.randint(300, 1000)):
        chat.kill(signal.SIGINT)
        time.sleep(rng.uniform(0, 2e-3))
    time.sleep(0.3)
    assert chat.isalive(), chat.before
    chat.sendline("Say hello.")
    chat.expect(TURN)
    chat.expect_exact("> ")
    chat.sendline("/exit")
    ended_cleanly(chat)
    assert chat.exitstatus == 0


def test_ctrl_c_while_the_chat_exits_is_no_traceback(tiny_chat_file):
    chat = spawn(tiny_chat_file)
    chat.expect_exact("> ")
    chat.sendline("Say hello.")
    chat.expect(TURN)
    chat.expect_exact("> ")
    chat.sendline("/exit")
    chat.expect_exact("/exit\r\n")  # read: a Ctrl-C now can no longer take the line back
    deadline = time.monotonic() + 60
    while chat.isalive() and time.monotonic() < deadline:  # the engine's close, atexit hooks, finalization
        chat.kill(signal.SIGINT)
        time.sleep(1e-3)
    ended_cleanly(chat)
