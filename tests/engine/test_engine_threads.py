"""One engine.Model shared by threads: ctypes releases the GIL, so without the Model's lock two threads
would run the engine on one KV cache at once (a hang in the thread pool, or a crash) and close() would free
it under a running eval. Each scenario runs in a subprocess, so that a crash or a hang fails the test instead
of taking pytest down."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from engine_helpers import converted  # noqa: F401

import powerinfer_engine as engine

SCENARIO = textwrap.dedent("""
    import sys, threading
    import powerinfer_engine as engine

    path, threads, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tokens = list(range(3, 67))

    def evaluate_until_closed(m, results):
        for _ in range(100_000):
            try:
                m.reset()
                results.append(m.eval(tokens, all_logits=False).sum())
            except engine.EngineError as exc:  # the context filled up (the other thread evaluated too) or closed
                if "closed" in str(exc):
                    results.append(str(exc))
                    return

    for r in range(rounds):
        m = engine.Model(path, threads=threads)
        # two threads on one model, then a close racing both of them
        results = [[], []]
        workers = [threading.Thread(target=evaluate_until_closed, args=(m, out), daemon=True) for out in results]
        for w in workers:
            w.start()
        threading.Event().wait(0.02 * (r % 5 + 1))
        m.close()
        for w in workers:
            w.join(timeout=30)
            assert not w.is_alive(), "an eval thread hangs"
        for out in results:
            assert out and out[-1] == "the model is closed", out[-1:]
    print("ok")
""")


@pytest.fixture(scope="module")
def model_file(converted):
    return converted("llama-relu")


@pytest.mark.parametrize("threads", [1, 2])
def test_two_threads_and_a_close_race(model_file, threads):
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(model_file), str(threads), "12"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


def test_calls_after_close_raise(model_file):
    m = engine.Model(model_file, threads=1)
    m.close()
    m.close()  # twice is harmless
    for call in (lambda: m.eval([1]), lambda: m.n_past, lambda: m.reset(), lambda: m.stats(), lambda: m.sample()):
        with pytest.raises(engine.EngineError, match="closed"):
            call()
