"""`pi-tools serve --parallel N` driven by the real `openai` client on a loopback port: requests decoded together
(one engine step a token for each, a new one joining between steps) each get exactly the text they get alone,
greedy or seeded, in dense mode and in predictor mode; a client that leaves frees its slot; the prompt cache keeps a
prefix per slot."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from convert_helpers import write_predictors
from test_serve import Server, metrics
from tiny_models import HIDDEN, N_FF, N_LAYER

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are"]
N_TOKENS = 40
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
# two long system prompts a chat front end alternates between (a prefix each, over 300 tokens)
SYSTEMS = [("You are a terse assistant for a bakery. " * 30), ("You answer questions about astronomy only. " * 30)]


@pytest.fixture(scope="module")
def alone(smollm2_file):
    """What each request gets by itself, from the Python API's serial path (one request at a time)."""
    from powerinfer_tools import LLM

    with LLM(smollm2_file("q8_0"), threads=2, sparse_mode="dense", ctx_size=1024) as llm:
        greedy = [llm.complete(p, max_tokens=N_TOKENS, temperature=0).text for p in PROMPTS]
        seeded = llm.complete(PROMPTS[1], max_tokens=N_TOKENS, top_k=0, **SEEDED).text  # the server's top_k default
    return {"greedy": greedy, "seeded": seeded}


@pytest.fixture(scope="module")
def server(smollm2_file):
    s = Server(smollm2_file("q8_0"), "--parallel", "4")
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def streamed(client, prompt, max_tokens=N_TOKENS, **sampling) -> str:
    s = client.completions.create(model="any", prompt=prompt, max_tokens=max_tokens, stream=True, **sampling)
    return "".join(c.choices[0].text for c in s if c.choices)


def test_four_streams_together_each_get_their_text_alone(server, alone):
    """Four greedy streams started together and, in a second round, one after another 0.3 s apart (each joining
    the steps of those already running): every text is the one its request gets alone."""
    client = server.client()
    for stagger in (0.0, 0.3):
        def ask(i):
            time.sleep(stagger * i)
            return streamed(client, PROMPTS[i], temperature=0)

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == alone["greedy"], stagger


def test_seeded_sampling_does_not_depend_on_company(server, alone):
    """A seeded request draws the same text beside three others (seeded differently) as alone: its own generator,
    its own logits."""
    client = server.client()

    def ask(i):
        if i == 1:
            return streamed(client, PROMPTS[1], **SEEDED)
        return streamed(client, PROMPTS[i], temperature=1.0, seed=i)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, range(4)))
    assert texts[1] == alone["seeded"]


def test_a_client_that_leaves_frees_its_slot(server):
    """Four long streams fill the slots; each client leaves after one event. Their requests stop at the next step
    (far fewer tokens than asked) and a fifth request is then answered, and /metrics shows every slot idle."""
    before = metrics(server)["powerinfer_tokens_predicted_total"]

    def leave(_):
        conn = server.connection()
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps({"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True}))
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data:")
        conn.close()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(leave, range(4)))
    assert server.client().completions.create(model="any", prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    after = metrics(server)
    assert after["powerinfer_tokens_predicted_total"] - before - 1 < 4 * 899
    assert (after["powerinfer_slots_busy"], after["powerinfer_slots_idle"]) == (0, 4)


def test_the_prompt_cache_keeps_a_prefix_per_slot(server):
    """Two conversations alternate (each its long system prompt): with a slot each, every repeat reuses its own
    prefix from the KV cache (usage.prompt_tokens_details.cached_tokens), although the other ran in between."""
    client = server.client()

    def ask(system, question):
        r = client.chat.completions.create(model="any", max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    first = [ask(SYSTEMS[k], "Hello?") for k in (0, 1)]
    for round_ in range(2):
        for k in (0, 1):
            prompt_tokens, cached = ask(SYSTEMS[k], f"Question {round_}?")
            assert cached >= first[k][0] - 12, (k, cached, first[k])  # all but the user's turn
            assert cached < prompt_tokens


@pytest.fixture(scope="module")
def relu_with_predictors(tiny_model_dir, tmp_path_factory):
    """The tiny ReLU model (q8_0) with random predictors (threshold 0: about half the neurons selected a token)."""
    from powerinfer_tools.stages.conversion.conversion import convert_model

    root = tmp_path_factory.mktemp("relu_predictors")
    pred = write_predictors(root / "pred", N_LAYER, HIDDEN, N_FF, rank=32, thresholds=[0.0] * N_LAYER)
    convert_model(str(tiny_model_dir("llama-relu")), root / "relu.gguf", outtype="q8_0", predictors_dir=pred,
                  progress=False)
    return root / "relu.gguf"


def test_predictor_mode_streams_together_each_get_their_text_alone(relu_with_predictors):
    """--sparse-mode predictor with --parallel: a step reads the union of its requests' selected neurons once and
    each request computes its own (docs/engine.md, "Sequences"), so four greedy streams together (and one seeded
    beside three others) get the texts they get alone."""
    from powerinfer_tools import LLM

    with LLM(relu_with_predictors, threads=2, sparse_mode="predictor", ctx_size=256) as llm:
        greedy = [llm.complete(p, max_tokens=N_TOKENS, temperature=0).text for p in PROMPTS]
        seeded = llm.complete(PROMPTS[1], max_tokens=N_TOKENS, top_k=0, **SEEDED).text
    assert len(set(greedy)) == len(PROMPTS)  # four different texts: a row given another's would show
    s = Server(relu_with_predictors, "--parallel", "4", "--sparse-mode", "predictor", "-c", "256")
    try:
        client = s.client()
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda p: streamed(client, p, temperature=0), PROMPTS)) == greedy
            texts = list(pool.map(lambda i: streamed(client, PROMPTS[i], **(SEEDED if i == 1 else {"seed": i})),
                                  range(4)))
        assert texts[1] == seeded
    finally:
        s.proc.kill()


def test_parallel_refuses_the_modes_that_cannot_decode_together(relu_with_predictors):
    """Input sparsity reads each row's own inputs: --parallel with it is refused in one line before the model loads."""
    done = subprocess.run([sys.executable, "-m", "powerinfer_tools", "serve", "-m", str(relu_with_predictors),
                           "--parallel", "2", "--sparse-mode", "input"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "pi-tools: error: --parallel 2 decodes requests together in dense, gate, predictor, oracle mode only (each "
        "token the bits it gets alone): --sparse-mode input is refused"], done.stderr
