"""Hostile files through the command line, not only the engine: every file of tests/hostile_files.py goes
through `pi-tools inspect` and `pi-tools run`, each in a forked child with a bound on its time and on its
memory. A traceback, a signal (a crash, or the time bound running out), or an exit status other than 0 or 1
fails; a refusal is one line. The children fork from one process that imported the toolkit once, so each
costs milliseconds rather than an interpreter start (the first two jobs, valid files, run in it first to warm
it up)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from hostile_files import seeds, structured, write_corpus

ROOT = Path(__file__).resolve().parents[2]
SECONDS_PER_FILE = 20  # generous on a loaded machine: a good file takes well under a second
MEMORY_PER_FILE = 1 << 30  # address space a child may add to what the parent had mapped

RUNNER = r"""
import json, os, resource, signal, sys, time, traceback
sys.path.insert(0, sys.argv[1])
from powerinfer_tools.cli import main
import powerinfer_tools.runtime.inference, powerinfer_tools.formats.describe, powerinfer_tools.formats.tokenizer  # imported once, here
import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401
from transformers import PreTrainedTokenizerFast  # noqa: F401

seconds, memory, work = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jobs = json.loads(sys.stdin.read())
saved = os.dup(2)
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
for argv in jobs[:2]:  # warm up: a command's first call in a process costs ~0.1 s more (typer, lazy imports)
    try:
        main(argv)
    except SystemExit:
        pass
os.dup2(saved, 2)
mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
results = []
for k, argv in enumerate(jobs):
    err_path = os.path.join(work, f"{k}.err")
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        resource.setrlimit(resource.RLIMIT_AS, (mapped + memory, mapped + memory))
        signal.alarm(seconds)  # its default action ends the child: a hang shows as SIGALRM
        err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    results.append({"argv": argv, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                    "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                    "stderr": open(err_path, errors="replace").read()[-3000:],
                    "seconds": time.monotonic() - started})
print(json.dumps(results))
"""


def run_all(jobs: list[list[str]], work: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               POWERINFER_TOOLS_CACHE=str(work / "cache"))
    done = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT), str(SECONDS_PER_FILE), str(MEMORY_PER_FILE),
                           str(work)], input=json.dumps(jobs), capture_output=True, text=True, env=env,
                          timeout=SECONDS_PER_FILE * len(jobs) + 120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def verdict(result: dict) -> str | None:
    """What is wrong with one run, or None."""
    err = result["stderr"]
    if result["signal"] is not None:
        return f"killed by signal {result['signal']} (14 = the time bound)"
    if "Traceback" in err or result["code"] not in (0, 1):
        return f"exit {result['code']}: {err.strip()[-600:]}"
    if result["code"] == 1:
        lines = err.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("pi-tools: error: "):
            return f"not one line: {err[-600:]}"
    return None


def test_hostile_corpus_through_inspect_and_run(tmp_path):
    cases = write_corpus(tmp_path / "corpus")
    jobs = []
    for path, model in cases:
        jobs.append(["inspect", str(path)])
        run_args = ["-m", str(path)] if model is None else ["-m", str(model), "--gpuidx", str(path)]
        jobs.append(["run", *run_args, "-p", "hi", "-n", "2", "-t", "1", "-c", "32", "--temp", "0"])
    results = run_all(jobs, tmp_path)
    bad = {" ".join(r["argv"][:2] + [Path(r["argv"][2]).name]): v for r in results if (v := verdict(r))}
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())
    # the valid seeds load and run; most hostile files are refused (with one line, checked above)
    seed = str(tmp_path / "corpus" / "relu-f32.gguf")
    assert [r["code"] for r in results if seed in r["argv"]] == [0, 0]
    refused = sum(r["code"] == 1 for r in results)
    assert refused > len(results) // 3, refused


@pytest.fixture(scope="module")
def relu_variants(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    files = {}
    for label, data in structured(seeds()["relu-f32"][0]).items():
        files[label] = out / f"{label}.gguf"
        files[label].write_bytes(data)
    return files


def test_array_of_2_62_is_refused_before_gguf_py_reads_it(relu_variants, capsys):
    code, _, err = run_cli(capsys, "inspect", relu_variants["array-of-2^62"])
    assert_one_line_error(code, err, "array hostile.array of 4611686018427387904 elements runs past the end")


def test_name_that_is_not_utf8_is_shown_replaced(relu_variants, capsys):
    code, out, err = run_cli(capsys, "inspect", relu_variants["name-not-utf8"])
    assert code == 0, err
    assert "general.name" in out and "\ufffd" in out


def test_bos_past_the_vocabulary_is_one_line_in_run(relu_variants, capsys):
    code, _, err = run_cli(capsys, "run", "-m", relu_variants["bos-past-vocabulary"], "-p", "hi", "-n", "1")
    assert_one_line_error(code, err, "tokenizer.ggml.bos_token_id = 1000000 is not a token of its 32-token vocabulary")


def test_token_that_is_not_utf8_is_one_line_in_run(relu_variants, capsys):
    code, _, err = run_cli(capsys, "run", "-m", relu_variants["token-not-utf8"], "-p", "hi", "-n", "1")
    assert_one_line_error(code, err, "metadata key tokenizer.ggml.tokens holds text that is not UTF-8")
