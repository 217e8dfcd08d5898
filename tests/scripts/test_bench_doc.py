"""docs/bench.md's commands run as written: each fenced block's commands, in order, in a folder of their own, at a
tiny size. Every flag stays as the section writes it, and pi-tools parses each command as written (placeholders
filled in, bench's KEY the entry an earlier command made); only the values that set a size change (SIZE: --shape 7b -> tiny, --repeats 1, ...), and a name that an
earlier section made (relu7b, pred7b-s9, PROF) is the tiny one (NAMES). A peer runs where PI_BENCH_PEER_PYTHON names
its Python; without it llama.cpp leaves --peers and the commands that need it are listed, not run. Steps by hand as
root (a cgroup v1 folder, dropping the page cache), installs and the GPU check are listed, not run; a command of any
other kind fails the test until it is mapped here. A limit (--memory-limit) runs where this machine makes cgroups."""
from __future__ import annotations

import os
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import typer

from cli_helpers import run_cli
from script_helpers import ROOT, TINY, build_synthetic
from tiny_models import DATA, make_tiny

from powerinfer_tools.cli import main
from powerinfer_tools.cli.app import app

BENCH_MD = ROOT / "docs" / "bench.md"
PEER = os.environ.get("PI_BENCH_PEER_PYTHON")
# The values that set a size, at the tiny one (the flag's own name: the same in pi-tools and in the scripts).
SIZE = {"--layers": str(TINY.n_layer), "--repeats": "1", "--n-prompt": "8", "--n-gen": "4",
        "--tokens": "1024", "--seq-len": "64", "--epochs": "1", "--chunks": "1", "-c": "128", "--ctx": "128",
        "-n": "16", "--rounds": "1", "--clients": "2", "--soak": "4", "--rank": "16", "--depth": "8",
        "--prefix": "12", "--parallel": "2"}
TINY_SHAPES = {"qwen3-30b-a3b": "tiny-moe"}   # --shape's tiny stand-in of the same kind; "tiny" for the others
# The section's placeholders, as the section's text says to fill them in (a peer's Python is PEER).
PLACEHOLDERS = {"--memory-limit": {"L": "0.5", "$L": "0.5"}, "--sparse-mode": {"MODE": "dense"}}
PEER_NAMES = ("PEER_PYTHON", "NOAMX_PYTHON", "~/bench-venv/bin/python")
INSTALL = re.compile(r"(^|/)pip$|^python3?$")   # python3 -m venv ..., ~/bench-venv/bin/pip install ...
OUTPUT_FLAGS = ("-o", "--out", "--work-dir", "--work")
MODEL_NAMES = ("smollm2",)   # -m's names of a model (not a path: the CLI resolves them), here the tiny stand-in


@dataclass(frozen=True)
class Command:
    line: int           # in docs/bench.md
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def kind(self) -> str:
        """pi-tools, script, install, root or device: how the test treats it."""
        argv = self.argv
        if argv[0] == "pi-tools":
            return "pi-tools"
        if argv[0] == "scripts/gpu_check.sh":
            return "device"
        if argv[0].startswith("scripts/") or (argv[0] in ("python", "python3") and argv[1].startswith("scripts/")):
            return "script"
        if any("/sys/" in a or "/proc/" in a for a in argv) or argv[0] in ("sync;", "sync"):
            return "root"
        if INSTALL.search(argv[0]) and ("venv" in argv or "install" in argv):
            return "install"
        raise AssertionError(f"docs/bench.md:{self.line}: {shlex.join(argv)}: a command this test does not know")


@dataclass(frozen=True)
class Block:
    line: int
    commands: tuple[Command, ...]


def doc_blocks(text: str) -> list[Block]:
    """The fenced blocks of `text` with their commands: continued lines joined, comments dropped, VAR=value
    prefixes kept apart, `a && b` split, a `for v in a b; do ... $v ...; done` loop's body once per distinct value."""
    blocks = []
    for m in re.finditer(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, m.start()) + 2
        commands, logical, start = [], "", first
        loop: tuple[str, list[str]] | None = None  # the loop's variable and its values, inside one
        for i, raw in enumerate(m.group(1).splitlines()):
            if not logical:
                start = first + i
            logical += raw.rstrip("\\").rstrip() + " " if raw.endswith("\\") else raw
            if raw.endswith("\\"):
                continue
            head = re.fullmatch(r"\s*for (\w+) in ([^;]+); do\s*", logical)
            if head:
                loop, logical = (head.group(1), list(dict.fromkeys(head.group(2).split()))), ""
                continue
            if loop and logical.strip() == "done":
                loop, logical = None, ""
                continue
            bodies = [logical.replace("$" + loop[0], v) for v in loop[1]] if loop else [logical]
            logical = ""
            for body in bodies:
                commands.extend(line_commands(body, start))
        blocks.append(Block(first, tuple(commands)))
    return blocks


def line_commands(logical: str, start: int) -> list[Command]:
    """The commands of one logical line (`a && b` split, VAR=value prefixes kept apart)."""
    commands = []
    words = shlex.split(logical, comments=True)
    while words:
        part, words = (words[:words.index("&&")], words[words.index("&&") + 1:]) if "&&" in words else (words, [])
        n_env = next((i for i, w in enumerate(part) if not re.match(r"^[A-Z_]+=", w)), len(part))
        if part[n_env:]:
            commands.append(Command(start, tuple(part[n_env:]), tuple(tuple(w.split("=", 1)) for w in part[:n_env])))
    return commands


BLOCKS = [b for b in doc_blocks(BENCH_MD.read_text()) if b.commands]


def option_values(argv: tuple[str, ...]) -> list[tuple[int, str]]:
    """(index of the value, flag) for every `--flag value` in argv."""
    return [(i + 1, a) for i, a in enumerate(argv[:-1]) if a.startswith("-") and not argv[i + 1].startswith("-")]


def as_written(cmd: Command, names: dict[str, str]) -> list[str]:
    """The command with its placeholders filled in, each `a|b` alternative's first, a text file named as the test
    data's, a model named as a tiny one: what runs before the size changes."""
    argv = list(cmd.argv)
    for i, flag in option_values(cmd.argv):
        argv[i] = PLACEHOLDERS.get(flag, {}).get(argv[i], argv[i])
    argv = [a.split("|")[0] if re.fullmatch(r"[a-z]+(\|[a-z]+)+", a) else a for a in argv]
    argv = [PEER or "python3" if a in PEER_NAMES else str(DATA / a) if (DATA / a).is_file() else a for a in argv]
    argv = [bench_entry(a) if "-KEY/" in a else a for a in argv]
    return [names[a] if i and argv[i - 1] == "-m" and a in MODEL_NAMES else a for i, a in enumerate(argv)]


def bench_entry(path: str) -> str:
    """DIR/NAME-TYPE-KEY/FILE: the file in the one entry an earlier bench of the block made in DIR (KEY is the hash
    of its inputs, bench/files.py)."""
    found = sorted(Path().glob(path.replace("-KEY/", "-*/")))
    assert len(found) == 1, f"{path}: {len(found)} bench entries match (an earlier command of the block makes one)"
    return str(found[0])


def alternatives(cmd: Command) -> list[Command]:
    """`--sparse-mode dense|predictor`: one command per mode."""
    for i, a in enumerate(cmd.argv):
        if re.fullmatch(r"[a-z]+(\|[a-z]+)+", a):
            return [replace(cmd, argv=cmd.argv[:i] + (alt,) + cmd.argv[i + 1:]) for alt in a.split("|")]
    return [cmd]


def tiny(argv: list[str]) -> list[str]:
    """The size-setting values at the tiny size; without a peer, llama.cpp out of --peers and its own flags out."""
    argv = list(argv)
    for i, flag in option_values(tuple(argv)):
        argv[i] = TINY_SHAPES.get(argv[i], "tiny") if flag == "--shape" else SIZE.get(flag, argv[i])
    if PEER:
        return argv
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a in ("--peer-python", "--llamacpp-wait"):
            skip = True
        elif i and argv[i - 1] == "--peers":
            out.append(",".join(p for p in a.split(",") if p != "llama.cpp"))
        else:
            out.append(a)
    return out


def needs_peer(cmd: Command) -> bool:
    """A command that only compares with llama.cpp: a script whose --peer-python is required, bench --first-token."""
    return (cmd.kind == "script" and "--peer-python" in cmd.argv) or "--first-token" in cmd.argv


def parse_pi_tools(argv: list[str]) -> None:
    """pi-tools' own parser on argv: every flag exists and every value parses (nothing runs)."""
    group = typer.main.get_command(app)
    parent = group.context_class(group, info_name="pi-tools")
    sub = group.get_command(parent, argv[1])
    assert sub is not None, f"pi-tools has no command {argv[1]}"
    sub.make_context(argv[1], list(argv[2:]), parent=parent).close()


def can_limit() -> bool:
    from powerinfer_tools.bench import cgroup
    from powerinfer_tools.core.errors import UserError

    try:
        return os.geteuid() == 0 and os.access(cgroup.find_hierarchy().own, os.W_OK)
    except UserError:
        return False


@pytest.fixture(scope="module")
def names(tmp_path_factory, tiny_chat_file) -> dict[str, str]:
    """What earlier sections made, by the names the later ones read them by, at the tiny size: synthetic_llama.py's
    model, predictors, profile (with the input thresholds `pi-tools profile` places beside it, as the input sparsity
    section does) and its q4_0 file; SmolLM2 as the tiny SiLU Llama with heads 32 wide (a q8_0 KV cache's blocks),
    with its profile (PROF); the served file as the tiny one with a chat template."""
    root = tmp_path_factory.mktemp("bench_doc_names")
    syn = build_synthetic(root)
    silu = str(make_tiny("llama-silu", root / "smollm2", num_attention_heads=2, num_key_value_heads=2))
    for model, out in ((silu, root / "PROF"), (str(syn.model), root / "prof-in")):
        main(["profile", "-m", model, "--calib", str(DATA / "wikitext-2-valid.txt"), "--tokens", "256",
              "--seq-len", "64", "--input-allocation", "uniform", "-o", str(out)])
    merged = root / "prof-merged"
    shutil.copytree(syn.profile, merged)
    shutil.copy(root / "prof-in" / "input_sparsity.json", merged)
    found = {"smollm2": silu, "PROF": root / "PROF", "FILE": syn.gguf, "smollm2.q8_0.powerinfer.gguf": tiny_chat_file}
    for name in ("relu7b", "relu7b-4", "relu7b-8", "relu7b8"):
        found[name] = syn.model
    for name in ("pred", "pred7b", "pred7b-s9", "pred7b-4", "pred7b-8", "pred7b8"):
        found[name] = syn.predictors
    for name in ("prof", "prof7b", "prof7b-4", "prof7b-8", "prof7b8", "prof7b-merged"):
        found[name] = merged
    found["cache"] = root / "cache"
    return {k: str(v) for k, v in found.items()}


def link_inputs(block: Block, names: dict[str, str], cwd: Path) -> None:
    """The names the block reads but none of its commands writes, linked into its folder (a model's neuron bundles
    beside it, where the engine looks for them)."""
    from powerinfer_tools.formats import neuron_bundles

    written = {c.argv[i] for c in block.commands for i, flag in option_values(c.argv) if flag in OUTPUT_FLAGS}
    for name, path in names.items():
        if name not in written and name not in MODEL_NAMES + ("cache",) and not (cwd / name).exists():
            (cwd / name).symlink_to(path)
            if neuron_bundles.path_for(path).is_file():
                neuron_bundles.path_for(cwd / name).symlink_to(neuron_bundles.path_for(path))


def run(cmd: Command, argv: list[str], capsys, monkeypatch) -> None:
    """One command, in this process (the imports paid once for every command), from the block's folder: pi-tools
    through its main, a script as `python scripts/NAME.py` runs it."""
    if cmd.kind == "pi-tools":
        code, out, err = run_cli(capsys, *argv[1:])
    else:
        script = argv[1:] if argv[0].startswith("python") else argv
        path = str(ROOT / script[0])
        monkeypatch.setattr(sys, "argv", [path, *script[1:]])
        capsys.readouterr()
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
    assert code == 0, f"docs/bench.md:{cmd.line}: {shlex.join(argv)} exited {code}:\n{out[-2000:]}\n{err[-4000:]}"


def test_every_block_of_the_page_is_read():
    """The parser finds the page's blocks and knows each command's kind (kind raises on one it does not)."""
    kinds = {c.kind for b in BLOCKS for c in b.commands}
    assert {"pi-tools", "script", "install", "root", "device"} == kinds
    assert sum(c.argv[0] == "pi-tools" for b in BLOCKS for c in b.commands) >= 20


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_block_runs_as_written_at_a_tiny_size(block, names, tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("POWERINFER_TOOLS_CACHE", names["cache"])   # bench's files, built once for every block
    monkeypatch.setenv("PI_DATA", str(DATA))   # where synthetic_llama.py reads its text
    link_inputs(block, names, tmp_path)
    limit = can_limit()
    for cmd in (alt for c in block.commands for alt in alternatives(c)):
        if cmd.kind in ("install", "root", "device") or (needs_peer(cmd) and not PEER):
            continue
        argv = as_written(cmd, names)
        if cmd.kind == "pi-tools":
            parse_pi_tools(argv)
            if "--memory-limit" in argv and not limit:
                continue
        run(cmd, tiny(argv), capsys, monkeypatch)
        ran.append(cmd.line)
    if not ran:
        pytest.skip("nothing here runs on this machine (installs, the GPU check, or a peer not given)")
