"""What `pi-tools run` and bench's worker import, before the engine opens and after: a low-memory run cannot afford
a library it does not use (torch alone is over 100 MiB resident, scipy's solver some 30 MiB), so neither may come
back into the run path through a module-level import, nor into the closing lines once the engine has sized its
memory against the limit. transformers (about a second of a start) is imported only by the run that first builds a
file's tokenizer, not by the runs that find it in the tokenizer cache."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from cgroup_helpers import hierarchy_or_skip
from engine_helpers import converted  # noqa: F401
from tiny_models import N_FF, N_LAYER

import powerinfer_engine as engine
from powerinfer_tools.bench import cgroup
from powerinfer_tools.formats import neuron_bundles

UNUSED = ("torch", "scipy", "sklearn", "safetensors", "matplotlib")

# stops the process at engine.Model(), printing what it had imported by then and what the tokenizer loading meanwhile
# (inference.open_with_tokenizer's thread) imports
STOP_AT_MODEL = """
import json, os, sys, threading
import powerinfer_engine as engine
def stop(self, *args, **kwargs):
    for t in threading.enumerate():
        if t is not threading.current_thread():
            t.join()
    print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), flush=True)
    os._exit(0)
engine.Model.__init__ = stop
sys.argv = ["pi-tools"] + sys.argv[1:]
from powerinfer_tools.__main__ import main
main()
"""


# runs the command to its end, then prints (on stderr, after everything the run wrote) what it had imported
AT_EXIT = """
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr))
sys.argv = ["pi-tools"] + sys.argv[1:]
from powerinfer_tools.__main__ import main
main()
"""


def _imported(script: str, *args, env: dict | None = None) -> tuple[set[str], str]:
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout if script is STOP_AT_MODEL else r.stderr
    return set(json.loads(out.strip().splitlines()[-1])), r.stderr


def _imported_before_model(*args) -> set[str]:
    return _imported(STOP_AT_MODEL, *args)[0]


def test_run_imports_no_library_it_does_not_use(converted):
    path = converted("llama-relu")
    for mode in ("dense", "gate"):
        imported = _imported_before_model("run", "-m", path, "-p", "Hello", "-n", "2", "-t", "1", "--sparse-mode", mode)
        assert "powerinfer_engine" in imported and "tokenizers" in imported  # the stop is where the run opens
        assert not imported & set(UNUSED), imported & set(UNUSED)


def test_run_imports_no_library_it_does_not_use_to_its_end(converted):
    """The closing lines (timings, the sparsity note) come after the engine sized its budget: they import nothing
    heavy either. Gate mode on the tiny ReLU model prints the note, the branch that once imported torch."""
    path = converted("llama-relu")
    for mode in ("dense", "gate"):
        imported, stderr = _imported(AT_EXIT, "run", "-m", path, "-p", "Hello", "-n", "2", "-t", "1", "--sparse-mode",
                                     mode)
        assert "generated at" in stderr  # the run reached its timing line
        assert not imported & set(UNUSED), imported & set(UNUSED)


def test_run_on_a_warm_tokenizer_cache_imports_no_transformers(converted, tmp_path):
    """The first run on a file builds its tokenizer with transformers (and gguf-py's vocabulary reader) and caches it;
    the next ones read it from the cache without importing either, to their end, nor tqdm (issue 65: tens of
    milliseconds of a fresh process's first token), which the run path's modules import only to draw a bar."""
    path = converted("llama-relu")
    env = {**os.environ, "POWERINFER_TOOLS_CACHE": str(tmp_path / "cache")}
    args = ("run", "-m", path, "-p", "Hello", "-n", "2", "-t", "1")
    cold, _ = _imported(AT_EXIT, *args, env=env)
    assert {"transformers", "gguf"} <= cold  # what the check below would see
    warm, stderr = _imported(AT_EXIT, *args, env=env)
    assert "generated at" in stderr
    assert not warm & {"transformers", "gguf", "tqdm"} and "tokenizers" in warm  # tqdm: only where a bar is drawn


# what `chat` and `serve` start with: the LLM on the file, its chat template (with tools), a chat reply drawn under
# a JSON schema (llguidance's view of the vocabulary) and the server's application
LLM_AND_SERVER = """
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), file=sys.stderr))
from powerinfer_tools import LLM
from powerinfer_tools.server.app import create_app
tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
with LLM(sys.argv[1], threads=1, ctx_size=128) as llm:
    llm.chat_prompt([{"role": "user", "content": "Hi"}], tools=[tool] if llm.supports_tools else None)
    llm.chat([{"role": "user", "content": "Hi"}], max_tokens=4, response_format={"type": "json_object"})
    create_app(llm, "m").state.worker.shutdown()
"""


def test_llm_and_server_on_a_warm_tokenizer_cache_import_no_transformers(tiny_chat_file, tmp_path):
    env = {**os.environ, "POWERINFER_TOOLS_CACHE": str(tmp_path / "cache")}
    cold, _ = _imported(LLM_AND_SERVER, tiny_chat_file, env=env)
    assert "transformers" in cold
    warm, _ = _imported(LLM_AND_SERVER, tiny_chat_file, env=env)
    assert {"jinja2", "llguidance", "fastapi"} <= warm and "transformers" not in warm


RUN_LIMIT = 128 << 20  # the tiny model's run holds about 60 MiB; torch alone would add over 100 MiB


def test_run_under_a_memory_cgroup_ends_with_exit_0(converted):
    """`pi-tools run` in a real memory cgroup of 128 MiB: it prints its answer and its timing line and exits 0,
    with no OOM kill (a heavy import after the answer once took it over the limit: exit 137)."""
    hierarchy = hierarchy_or_skip()
    path = converted("llama-relu", "q8_0")
    with cgroup.MemoryCgroup(RUN_LIMIT, hierarchy) as cg:
        r = subprocess.run([sys.executable, "-m", "powerinfer_tools", "run", "-m", str(path), "-p", "Hello world",
                            "-n", "4", "-t", "1", "--sparse-mode", "gate"], preexec_fn=cg.preexec,
                           capture_output=True, text=True, timeout=300)
        kills = cg.oom_kills()
    assert (r.returncode, kills) == (0, 0), (r.returncode, kills, r.stderr[-2000:])
    assert "generated at" in r.stderr


def test_run_from_the_disk_tier_under_a_memory_cgroup_ends_with_exit_0(converted, tmp_path):
    """The case the disk tier exists for, through the CLI: a model whose FFN the budget does not hold, bundles read
    from the disk, in a real 128 MiB memory cgroup: the answer, the disk tier's line (it read) and exit 0."""
    hierarchy = hierarchy_or_skip()
    model = tmp_path / "m.gguf"
    shutil.copy(converted("llama-relu", "q8_0", predictors=True), model)
    sidecar = neuron_bundles.write(model, progress=False)
    with engine.Model(model, threads=1, sparse_mode="predictor", ctx_size=128, memory_budget=64) as m:
        held = m.stats()["disk"]["resident_bytes"]  # the fixed part and every bundle cached
    budget = held - N_LAYER * N_FF * neuron_bundles.read_layout(sidecar)["bundle_bytes"] // 2  # half the FFN
    with cgroup.MemoryCgroup(RUN_LIMIT, hierarchy) as cg:
        r = subprocess.run([sys.executable, "-m", "powerinfer_tools", "run", "-m", str(model), "-p", "Hello world",
                            "-n", "8", "-t", "1", "-c", "128", "--sparse-mode", "predictor", "--memory-budget",
                            str(budget / 2**30), "-v"], preexec_fn=cg.preexec, capture_output=True, text=True,
                           timeout=300)
        kills = cg.oom_kills()
    assert (r.returncode, kills) == (0, 0), (r.returncode, kills, r.stderr[-2000:])
    reads = re.search(r"disk tier: (\d+) reads", r.stderr)
    assert reads and int(reads.group(1)) > 0, r.stderr


def _imported_by(*modules: str) -> set[str]:
    """The top-level packages a fresh process holds after importing `modules`."""
    code = f"import sys, {', '.join(modules)}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_bench_worker_imports_only_the_engine():
    imported = _imported_by("powerinfer_engine", "powerinfer_tools.bench.worker")
    assert not imported & (set(UNUSED) | {"transformers", "tokenizers"}), imported


def test_cli_imports_only_typer_before_a_command():
    """What every command pays before it starts (`pi-tools run --help` as much): typer and the standard library;
    numpy, the engine, the tokenizer and the server come with the commands that use them."""
    imported = _imported_by("powerinfer_tools.cli")
    assert "typer" in imported
    heavy = set(UNUSED) | {"numpy", "transformers", "tokenizers", "powerinfer_engine", "gguf", "fastapi", "asyncio"}
    assert not imported & heavy, imported & heavy
