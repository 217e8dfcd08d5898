"""What `pi-tools run` and bench's worker import before the engine opens: a low-memory run cannot afford a library
it does not use (torch alone is over 100 MiB resident, scipy's solver some 30 MiB), so neither may come back
into the run path through a module-level import."""
from __future__ import annotations

import json
import subprocess
import sys

from engine_helpers import converted  # noqa: F401

UNUSED = ("torch", "scipy", "sklearn", "safetensors", "matplotlib")

# stops the process at engine.Model(), printing what it had imported by then
STOP_AT_MODEL = """
import json, os, sys
import powerinfer_engine as engine
def stop(self, *args, **kwargs):
    print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})), flush=True)
    os._exit(0)
engine.Model.__init__ = stop
sys.argv = ["pi-tools"] + sys.argv[1:]
from powerinfer_tools.__main__ import main
main()
"""


def _imported_before_model(*args) -> set[str]:
    r = subprocess.run([sys.executable, "-c", STOP_AT_MODEL, *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_run_imports_no_library_it_does_not_use(converted):
    path = converted("llama-relu")
    for mode in ("dense", "gate"):
        imported = _imported_before_model("run", "-m", path, "-p", "Hello", "-n", "2", "-t", "1", "--sparse-mode", mode)
        assert "powerinfer_engine" in imported and "transformers" in imported  # the stop is where the run opens
        assert not imported & set(UNUSED), imported & set(UNUSED)


def test_bench_worker_imports_only_the_engine():
    code = ("import sys, powerinfer_engine, powerinfer_tools.bench.worker; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    imported = set(r.stdout.split())
    assert not imported & (set(UNUSED) | {"transformers", "tokenizers"}), imported
