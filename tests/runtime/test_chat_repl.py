"""`pi-tools chat` driven through a pseudo-terminal as a person would: two turns (the second evaluating only its
new tokens), Ctrl-C stopping a reply without leaving, /clear, /exit; and `run -f -` reading the prompt from
stdin."""
from __future__ import annotations

import re
import subprocess
import sys

import pexpect
import pytest

from cli_helpers import assert_whole_output_clean, recorded

pytestmark = pytest.mark.slow

TURN = re.compile(r"\[prompt (\d+) tokens: (\d+) from the cache, (\d+) evaluated in \d+ ms; reply (\d+) tokens")


def spawn(model, *args) -> pexpect.spawn:
    return recorded(pexpect.spawn(sys.executable, ["-m", "powerinfer_tools", "chat", "-m", str(model), "-t", "2",
                                                   "-c", "1024", "--sparse-mode", "dense", "--temp", "0", "-v", *args],
                                  encoding="utf-8", timeout=120, dimensions=(40, 200)))


def turn(chat: pexpect.spawn, text: str) -> tuple[int, int, int, int]:
    chat.expect_exact("> ")
    chat.sendline(text)
    chat.expect(TURN)
    return tuple(int(g) for g in chat.match.groups())


def test_two_turns_reuse_the_cache_then_exit(smollm2_file):
    chat = spawn(smollm2_file("q8_0"), "--system", "You are a helpful assistant.", "-n", "48")
    prompt1, cached1, new1, reply1 = turn(chat, "Name a fruit.")
    assert cached1 == 0 and new1 == prompt1
    prompt2, cached2, new2, _ = turn(chat, "And a vegetable?")
    # turn one's prompt comes from the cache; its reply, computed by decode steps, is evaluated again in a batch
    # as a fresh chat would (the answer never depends on what the cache held)
    assert cached2 == prompt1 and new2 == prompt2 - cached2 and new2 >= reply1
    chat.expect_exact("> ")
    chat.sendline("/clear")
    chat.expect_exact("(a new conversation)")
    prompt3, cached3, _, _ = turn(chat, "Name a fruit.")
    assert prompt3 == prompt1 and cached3 < prompt3
    chat.expect_exact("> ")
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
    assert_whole_output_clean(chat)


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(smollm2_file):
    chat = spawn(smollm2_file("q8_0"), "-n", "900")
    chat.expect_exact("> ")
    question = "Write a very long essay about the history of Rome."  # 900 tokens here: ~10 s of streaming
    chat.sendline(question)
    chat.expect_exact(question + "\r\n")  # the terminal's echo
    chat.expect(r"\w+ \w+ \w+ ")  # the reply is streaming
    chat.sendintr()
    chat.expect_exact("(stopped)")
    _, cached, _, _ = turn(chat, "Thanks!")
    assert cached > 0  # the conversation's first prompt is still in the cache
    chat.expect_exact("> ")
    chat.sendeof()  # Ctrl-D leaves too
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
    assert_whole_output_clean(chat)  # what Ctrl-C printed too, which the expects since consumed


def one_reply(model, *command: str) -> str:
    """stdout of `pi-tools COMMAND` (a chat) told "Say hello." on stdin, greedy: the reply, deterministic."""
    done = subprocess.run([sys.executable, "-m", "powerinfer_tools", *command, "-m", str(model), "-n", "24", "--temp",
                           "0", "-t", "2", "--sparse-mode", "dense"], input="Say hello.\n", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_run_cnv_is_the_chat_with_p_as_the_system_prompt(smollm2_file):
    """-p under -cnv reaches the model as the system prompt: the reply is the chat's under that --system, and not
    the one without it (SmolLM2's template then puts its own system prompt), so a -p dropped or sent as a user
    turn would not pass."""
    model, pirate = smollm2_file("q8_0"), "You are a pirate. Every answer starts with 'Arr, matey'."
    cnv = one_reply(model, "run", "-cnv", "-p", pirate)
    assert cnv == one_reply(model, "chat", "--system", pirate)
    assert "matey" in cnv and cnv != one_reply(model, "chat"), cnv


def test_run_reads_the_prompt_from_stdin(smollm2_file):
    done = subprocess.run([sys.executable, "-m", "powerinfer_tools", "run", "-m", str(smollm2_file("q8_0")), "-f", "-",
                           "-n", "4", "--temp", "0", "-t", "2", "--sparse-mode", "dense"],
                          input="The capital of France is", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is") and len(done.stdout) > len("The capital of France is")
