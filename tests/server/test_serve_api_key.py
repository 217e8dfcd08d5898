"""`pi-tools serve --api-key` (or PI_API_KEY) takes only what an HTTP header can carry: a key that no client could
send (non-ASCII, control characters, a space at either end) is one line at startup, before the model loads; a key
it takes (punctuation, a space inside) is the one a real client gets in with."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import openai
import pytest

from cli_helpers import assert_one_line_error, run_cli


@pytest.mark.parametrize("key, message", [
    ("clé", "has a non-ASCII character at position 3"),
    ("s3cret\u200b", "has a non-ASCII character at position 7"),
    ("ab\tc", "has a control character at position 3"),
    ("abc\n", "has a control character at position 4"),
    (" abc", "starts or ends with a space"),
    ("   ", "--api-key is empty"),
])
@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_key_no_header_can_carry_is_refused_at_startup(capsys, monkeypatch, tmp_path, key, message, given):
    missing = tmp_path / "never-opened.gguf"  # the key is refused before the model is looked for
    args = ["serve", "-m", missing]
    if given == "flag":
        args += ["--api-key", key]
    else:
        monkeypatch.setenv("PI_API_KEY", key)
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, message)
    assert key.strip() not in err or not key.strip()  # the secret is not echoed


def test_a_printable_key_with_a_space_inside_lets_a_real_client_in(tiny_chat_file):
    key = "a b~!{}"
    proc = subprocess.Popen([sys.executable, "-m", "powerinfer_tools", "serve", "-m", str(tiny_chat_file), "--port",
                             "0", "-t", "1", "-c", "256", "--api-key", key],
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        found, log = threading.Event(), []

        def read() -> None:
            for line in proc.stderr:
                log.append(line)
                if "listening on" in line:
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        assert found.wait(120), "".join(log)
        url = re.search(r"http://[\d.]+:\d+", "".join(log)).group(0) + "/v1"
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        r = client.completions.create(model="any", prompt="ROMEO: But soft", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="a b~!", max_retries=0, timeout=60).models.list()
    finally:
        proc.kill()
        proc.wait(60)
