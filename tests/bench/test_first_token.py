"""`pi-tools bench --first-token` (bench/first_token.py): fresh processes timed to their first token. The timings
mean nothing here; what is checked is that each command is the one a user runs, that its first token is read past
what it echoes, and that the rounds alternate."""
from __future__ import annotations

import sys

import pytest
from engine_helpers import converted  # noqa: F401

from powerinfer_tools.bench import first_token
from powerinfer_tools.core.errors import UserError


def test_ours_is_timed_to_the_text_past_its_echoed_prompt(converted):
    path = converted("llama-silu", "q8_0")
    ours, peer = first_token.contestants(path, path, threads=1, peer_python=None, llamacpp_wait="passive")
    assert ours.command[1:5] == ["-m", "powerinfer_tools", "run", "-m"] and ours.skip == len(first_token.PROMPT)
    assert peer.env["OMP_WAIT_POLICY"] == "PASSIVE" and peer.skip == 0
    seconds, text = first_token.first_token(ours)
    assert seconds > 0 and text and not text.startswith(first_token.PROMPT)


def test_rounds_alternate_and_pair(monkeypatch):
    """Each contestant once untimed, then rounds in alternating order; medians and the per-round ratio."""
    order = []
    rows = [first_token.Contestant(label, [sys.executable, "-c", f"print('{label}', flush=True)"], {}, 0)
            for label in ("a", "b")]
    timed = first_token.first_token
    monkeypatch.setattr(first_token, "first_token", lambda c: (order.append(c.label), timed(c))[1])
    record = first_token.measure(rows, rounds=3, progress=False)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert record["texts"] == {"a": ["a"], "b": ["b"]} and len(record["seconds"]["a"]) == 3 and record["ratio"] > 0


def test_a_command_that_writes_no_token_is_one_line():
    dead = first_token.Contestant("ours", [sys.executable, "-c", "import sys; sys.exit('no model')"], {}, 0)
    with pytest.raises(UserError, match="ours wrote no token .exit status 1.: no model"):
        first_token.first_token(dead)
