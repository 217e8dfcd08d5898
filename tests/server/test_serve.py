"""`pi-tools serve` driven by the real `openai` client (and raw HTTP for what a client library never sends),
against a server the test starts on a free loopback port: chat and text completions, whole and streamed, stop
sequences, usage counts, the prompt cache, clients that leave (streaming or not), concurrent clients, bad
requests as OpenAI-style 4xx errors, the body size limit and timeout, prompts far past the context refused without
keeping memory, /metrics, the API key, SIGTERM with requests in flight."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import http.client
import urllib.parse

import openai
import pytest

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "seed": 1}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name a fruit."}]
CHAT_TOKENS = 80  # room for the whole reply: it ends at the end token


class Server:
    """`pi-tools serve` in a child process on a free port (port 0: it prints the one it got)."""

    def __init__(self, model, *args):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "powerinfer_tools", "serve", "-m", str(model), "--port",
                                      "0", "-t", "2", "--sparse-mode", "dense", "-c", "1024", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                if "listening on" in line:
                    found.set()
        threading.Thread(target=read, daemon=True).start()
        if not found.wait(120):
            self.proc.kill()
            raise AssertionError("the server did not start: " + "".join(self.log))
        line = next(line for line in self.log if "listening on" in line)
        self.url = re.search(r"http://[\d.]+:\d+", line).group(0)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        """Raw HTTP (what no client library sends: broken JSON, bytes that are not UTF-8): status and JSON."""
        conn = self.connection()
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            conn.close()

    def connection(self) -> http.client.HTTPConnection:
        where = urllib.parse.urlsplit(self.url)
        return http.client.HTTPConnection(where.hostname, where.port, timeout=60)

    def client(self, key="unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1])

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def reference(smollm2_file):
    """The same answers from the Python API, for what the server must reproduce."""
    from powerinfer_tools import LLM

    with LLM(smollm2_file("q8_0"), threads=2, sparse_mode="dense", ctx_size=1024) as llm:
        yield {"chat": llm.chat(MESSAGES, max_tokens=CHAT_TOKENS, temperature=0).text,
               "text": llm.complete("The capital of France is", max_tokens=20, temperature=0).text}


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == ["smollm2.q8_0.powerinfer.gguf"]
    assert server.request("GET", "/health") == (200, {"status": "ok"})


def test_chat_whole_and_streamed(server, reference):
    client = server.client()
    r = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=CHAT_TOKENS, **GREEDY)
    assert r.choices[0].message.content == reference["chat"] and r.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in r.choices[0].message.content
    assert r.usage.prompt_tokens > 20 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == r.usage.completion_tokens and 0 < timings["ffn_density"] <= 1

    stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=CHAT_TOKENS, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the same conversation again: all of it comes from the cache but its last two tokens, which a batch
    # evaluates as in a fresh request (the engine's decode path would round the last one otherwise)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 2


def test_completion_stop_sequences_and_echo(server, reference):
    client = server.client()
    whole = reference["text"]
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=20, **GREEDY)
    assert r.choices[0].text == whole and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    stop = whole.strip().split()[2]
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=20, stop=[stop],
                                  **GREEDY)
    assert r.choices[0].text == whole[:whole.index(stop)] and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="any", prompt="The capital of France is", max_tokens=20, stop=stop, stream=True, **GREEDY)]
    assert "".join(pieces) == whole[:whole.index(stop)] and all(stop not in p for p in pieces)
    r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=3, echo=True,
                                  **GREEDY)
    assert r.choices[0].text.startswith("The capital of France is")


COUNTING = "1, 2, 3, 4, 5,"  # greedy, the model counts on: no end of its own before max_tokens


def metrics(server) -> dict[str, float]:
    """/metrics read with prometheus_client's own parser: each sample's value by its name."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = server.connection()
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
        text = response.read().decode()
    finally:
        conn.close()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_the_server_did(server):
    """Prometheus' text format (as llama-server's /metrics): the counters move by exactly one request's tokens."""
    before = metrics(server)
    r = server.client().completions.create(model="any", prompt=COUNTING, max_tokens=12, **GREEDY)
    after = metrics(server)
    assert after["powerinfer_requests_total"] - before["powerinfer_requests_total"] == 1
    assert after["powerinfer_tokens_predicted_total"] - before["powerinfer_tokens_predicted_total"] == 12
    assert after["powerinfer_prompt_tokens_total"] - before["powerinfer_prompt_tokens_total"] == r.usage.prompt_tokens
    assert (after["powerinfer_requests_processing"], after["powerinfer_requests_waiting"]) == (0, 0)
    assert after["powerinfer_kv_cache_capacity_tokens"] == 1024
    assert r.usage.prompt_tokens + 11 <= after["powerinfer_kv_cache_tokens"] <= r.usage.prompt_tokens + 12


def assert_abandoned_request_stops(server, leave) -> None:
    """`leave(body)` sends `body` (counting, 900 tokens) and goes away before its end: the engine must stop that
    request's tokens, which /metrics counts. A one-token request after it runs once the engine is free (one request
    at a time), so by its answer the left request has ended: it generated far fewer than its 900."""
    before = metrics(server)["powerinfer_tokens_predicted_total"]
    leave({"prompt": COUNTING, "max_tokens": 900, "temperature": 0})
    assert server.client().completions.create(model="any", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    generated = metrics(server)["powerinfer_tokens_predicted_total"] - before - 1
    assert generated < 899, generated


def test_a_client_that_leaves_mid_stream_frees_the_engine(server):
    def leave(body):
        conn = server.connection()
        conn.request("POST", "/v1/completions", body=json.dumps(body | {"stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data:")
        conn.close()  # gone after one event

    assert_abandoned_request_stops(server, leave)


def test_concurrent_clients_are_all_answered_in_full(server, reference):
    client = server.client()

    def ask(i):
        if i % 2:
            s = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=CHAT_TOKENS, stream=True,
                                               **GREEDY)
            return "chat", "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        r = client.completions.create(model="any", prompt="The capital of France is", max_tokens=20, **GREEDY)
        return "text", r.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    assert all(text == reference[kind] for kind, text in answers)


@pytest.mark.parametrize("body, status, message", [
    (b'{"prompt": "x", ', 400, "not valid JSON"),
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, "not valid JSON"),
    (json.dumps({"prompt": "x", "bogus": 1}).encode(), 400, "unrecognized request argument: bogus"),
    (json.dumps({"prompt": "x", "max_tokens": 5000}).encode(), 400, "context holds 1024"),
    (json.dumps({"prompt": "word " * 1100}).encode(), 400, "context holds 1024"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (b'{"prompt": "x", "top_p": NaN}', 400, "top_p"),
    (json.dumps({"prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": "8"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": True}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"prompt": ["a", "b"]}).encode(), 400, "one prompt per request"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n"),
])
def test_bad_completion_requests_are_openai_errors(server, body, status, message):
    got, answer = server.request("POST", "/v1/completions", body)
    assert got == status
    error = answer["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_bad_chat_requests_through_the_client(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="any", messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="any", messages=[])
    with pytest.raises(openai.BadRequestError, match="context holds"):
        client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=4000)
    assert server.request("GET", "/v1/nowhere")[0] == 404
    assert client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2


def test_server_memory_stays_flat_under_repeated_streams(server):
    client = server.client()

    def stream(_):
        s = client.completions.create(model="any", prompt="Tell me a story.", max_tokens=24, stream=True,
                                      temperature=0.7)
        return sum(1 for _ in s)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(stream, range(8)))  # warm: allocator pools and caches settle
        before = server.rss_kib()
        list(pool.map(stream, range(24)))
    assert server.rss_kib() - before < 16 * 1024


def test_api_key_and_sigterm(smollm2_file):
    s = Server(smollm2_file("q8_0"), "--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.request("GET", "/health")[0] == 200  # probes need no key
        assert s.client("s3cret").completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        assert s.stop() == 0
    assert not any("Traceback" in line for line in s.log)


def raw_socket(server: Server) -> socket.socket:
    """A bare connection, for requests http.client cannot leave unfinished."""
    where = urllib.parse.urlsplit(server.url)
    return socket.create_connection((where.hostname, where.port), timeout=15)


def raw_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response that comes on a bare connection."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # a 50 MB Content-Length, of which only the first bytes come: the answer cannot wait for the rest
    with raw_socket(server) as sock:
        sock.sendall(f"{head}Content-Length: {50 * 2**20}\r\n\r\n".encode() + b'{"prompt": "')
        status, answer = raw_answer(sock)
    assert status == 413 and answer["error"]["type"] == "invalid_request_error"
    assert "larger than this server's limit of 4 MiB" in answer["error"]["message"]
    # a chunked body, which says no length: refused once what came passes the limit, the end never sent
    with raw_socket(server) as sock:
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        piece = b"x" * 2**18
        for _ in range(17):  # 4.25 MiB
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, answer = raw_answer(sock)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    # the real client, sending all of a prompt over the limit, reads the 413 too
    with pytest.raises(openai.APIStatusError, match="limit of 4 MiB") as caught:
        server.client().completions.create(model="any", prompt="word " * (5 * 2**20 // 5), max_tokens=1)
    assert caught.value.status_code == 413
    assert server.client().completions.create(model="any", prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_a_body_that_stops_coming_is_a_408_and_its_connection_closes(smollm2_file):
    """A client that sends part of its body and then nothing holds no connection past --body-timeout: a 408, then
    the server closes it; the server answers others meanwhile and after."""
    s = Server(smollm2_file("q8_0"), "--body-timeout", "2")
    try:
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with raw_socket(s) as sock:
            sock.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"prompt": "')
            assert s.client().completions.create(model="any", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
            status, answer = raw_answer(sock)
            assert status == 408 and answer["error"]["code"] == "request_timeout"
            assert "--body-timeout" in answer["error"]["message"]
            assert sock.recv(1) == b""  # closed by the server
        assert s.client().completions.create(model="any", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    finally:
        assert s.stop() == 0
    assert not any("Traceback" in line for line in s.log)


def test_prompts_far_past_the_context_are_refused_and_give_back_their_memory(server):
    """Prompts of 3.5 MiB (under the body limit, far past the context), chat and text: each a 400 naming the
    context, and the server holds no more memory after ten of them than before (a tokenizer's peak for the whole
    prompt once stayed behind, some 200 MiB a request)."""
    word = "word " * (7 * 2**20 // 10)
    bodies = [("/v1/completions", {"prompt": word, "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": word}], "max_tokens": 1})]

    def refuse(path, body):
        status, answer = server.request("POST", path, json.dumps(body).encode())
        assert status == 400 and "context holds 1024" in answer["error"]["message"], answer
        assert answer["error"]["code"] == "context_length_exceeded"

    for path, body in bodies:  # warm: the allocator's pools settle
        refuse(path, body)
    before = server.rss_kib()
    for i in range(10):
        refuse(*bodies[i % 2])
    assert server.rss_kib() - before < 32 * 1024
    assert server.client().completions.create(model="any", prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_a_client_that_leaves_before_a_whole_answer_frees_the_engine(server):
    def leave(body):
        conn = server.connection()
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        time.sleep(0.5)  # generating (not streamed: nothing comes before the end)
        conn.close()  # gone before its answer

    assert_abandoned_request_stops(server, leave)


def test_sigterm_ends_every_request_in_flight_and_exits_0(smollm2_file):
    s = Server(smollm2_file("q8_0"))
    try:
        stream = s.connection()
        stream.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                       body=json.dumps({"prompt": "1, 2, 3, 4, 5,", "max_tokens": 900, "stream": True,
                                        "temperature": 0}))  # counts on: no end of its own
        response = stream.getresponse()
        assert response.status == 200
        events = [response.readline() for _ in range(6)]  # three events in: it is generating
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(s.client().completions.create, model="any", prompt="Hi", max_tokens=4)
            half = raw_socket(s)  # a body still coming
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
            with pytest.raises(openai.InternalServerError, match="shutting down") as caught:
                queued.result()
        assert caught.value.status_code == 503
        with half:
            status, answer = raw_answer(half)
        assert status == 503 and answer["error"]["code"] == "server_shutting_down"
        events += response.read().splitlines(keepends=True)
        data = [e[len(b"data: "):].strip() for e in events if e.startswith(b"data: ")]
        assert data[-1] == b"[DONE]"
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
        assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data[:-2])
        assert len(data) - 2 < 900  # cut by the SIGTERM: fewer token events than its max_tokens
        assert s.proc.wait(60) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert not any("Traceback" in line or "Exception in ASGI" in line for line in s.log), "".join(s.log)
