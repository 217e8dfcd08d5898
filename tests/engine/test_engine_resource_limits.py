"""Files that declare absurd sizes are refused from the header, before anything is allocated: each is
loaded in a subprocess whose address space is capped at 1 GiB (under scripts/sanitize_engine.sh, whose
ASan shadow needs more: ASan's own 1 GiB allocation cap), so an allocation of the declared size would
surface as an out-of-memory error (or a crash) instead of the format error asserted here."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_helpers import converted  # noqa: F401
from kquants import Q, random_blocks
from test_engine_bad_input import rewrite
from test_engine_gguf_types import SHAPES, write_llama

ROOT = Path(__file__).resolve().parents[2]
STR, ARR = 8, 9  # GGUF metadata value types


def gguf_bytes(kv: list[bytes], tensors: list[bytes], n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A raw GGUF v3 file (PWRI magic) from encoded metadata entries and tensor infos: counts may lie."""
    head = b"PWRI" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kv) if n_kv is None else n_kv)
    body = head + b"".join(kv) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + b"\0" * 256


def s(text: str, length: int | None = None) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def kv_str(key: str, value: str, length: int | None = None) -> bytes:
    return s(key) + struct.pack("<I", STR) + s(value, length)


def tensor_info(name: str, ne: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    dims = struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
    return s(name) + dims + struct.pack("<IQ", ggml_type, offset)


ARCH = kv_str("general.architecture", "llama")
CASES = {
    "tensor of 2^60 elements": (gguf_bytes([ARCH], [tensor_info("token_embd.weight", [1 << 30, 1 << 30])]),
                                "implausibly large"),
    "tensor dimension of 2^60": (gguf_bytes([ARCH], [tensor_info("token_embd.weight", [1 << 60])]),
                                 "implausible dimension"),
    "string of 2^40 bytes": (gguf_bytes([kv_str("general.name", "x", length=1 << 40)], []), "implausible"),
    "key of 2^40 bytes": (gguf_bytes([s("k", 1 << 40)], []), "implausible"),
    "2^60 metadata entries": (gguf_bytes([ARCH], [], n_kv=1 << 60), "metadata count"),
    "2^60 tensors": (gguf_bytes([ARCH], [], n_tensors=1 << 60), "tensor count"),
    "array of 2^40 strings (n_vocab)": (
        gguf_bytes([s("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARR, STR, 1 << 40)], []), "runs past the end"),
    "array of 2^50 floats": (
        gguf_bytes([s("powerinfer.activation_thresholds") + struct.pack("<IIQ", ARR, 6, 1 << 50)], []),
        "runs past the end"),
    "tensors overlapping": (gguf_bytes([ARCH], [tensor_info("a", [16]), tensor_info("b", [16], offset=32),
                                                tensor_info("c", [16], offset=32)]), "overlap"),
}


def load_capped(paths: list[Path]) -> list[str]:
    """Open each file with the engine in a child process limited to 1 GiB of address space."""
    script = f"""
import json, os, resource, sys
sys.path.insert(0, {str(ROOT)!r})
if "libasan" not in os.environ.get("LD_PRELOAD", ""):
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
import engine
out = []
for p in sys.argv[1:]:
    try:
        engine.Model(p, threads=1).close()
        out.append("loaded")
    except engine.EngineError as e:
        out.append(f"{{e.status}}:{{e}}")
print(json.dumps(out))
"""
    env = dict(os.environ)
    if "libasan" in env.get("LD_PRELOAD", ""):
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":max_allocation_size_mb=1024"
    done = subprocess.run([sys.executable, "-c", script, *map(str, paths)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_absurd_sizes_are_refused_before_allocation(tmp_path):
    paths = []
    for i, (data, _) in enumerate(CASES.values()):
        paths.append(tmp_path / f"case{i}.gguf")
        paths[-1].write_bytes(data)
    for (what, (_, expected)), message in zip(CASES.items(), load_capped(paths)):
        assert message.startswith("2:"), f"{what}: {message}"  # PI_ERR_FORMAT, not PI_ERR_MEMORY
        assert expected in message, f"{what}: {message}"


@pytest.mark.parametrize("key,value", [("llama.block_count", 10**9), ("llama.embedding_length", 1 << 40),
                                       ("llama.feed_forward_length", 1 << 40), ("llama.context_length", 1 << 40)])
def test_absurd_hyperparameters_are_refused(converted, tmp_path, key, value):
    path = rewrite(converted("llama-relu"), tmp_path / "m.gguf", fields={key: (value, gguf.GGUFValueType.UINT64)})
    [message] = load_capped([path])
    assert message.startswith("2:") and key in message and "out of range" in message, message


CGROUP_PROBE = """
import sys
import engine

path, ctx = sys.argv[1], int(sys.argv[2])
try:
    with engine.Model(path, threads=1, ctx_size=ctx) as m:
        print("opened", m.info["kv_cache_bytes"])
except engine.EngineError as exc:
    print("refused", exc)
"""


def test_context_is_checked_against_the_cgroup_limit(converted, tmp_path):
    """A context that fits the machine's memory but not the container's (its cgroup's memory.max) is refused
    with a message, where it was an out-of-memory kill. The cgroup is a directory bind-mounted over
    /sys/fs/cgroup in a private user and mount namespace (unshare -rm)."""
    import shlex
    import shutil

    path = converted("llama-relu")
    fake = tmp_path / "cgroup"
    fake.mkdir()
    (fake / "memory.max").write_text(f"{16 << 20}\n")  # 16 MiB
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {fake} /sys/fs/cgroup"], capture_output=True)
    if not shutil.which("unshare") or probe.returncode != 0:
        pytest.skip("no user+mount namespace here (unshare -rm) to stand in a cgroup limit")

    def open_with(ctx: int) -> str:
        script = (f"mount --bind {fake} /sys/fs/cgroup && exec {shlex.quote(sys.executable)} -c "
                  f"{shlex.quote(CGROUP_PROBE)} {path} {ctx}")
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                              env=os.environ)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    small = open_with(256)
    assert small.startswith("opened"), small
    assert int(small.split()[1]) * (65536 // 256) > 16 << 20  # so 65536 tokens need more than the limit
    big = open_with(65536)
    assert big.startswith("refused") and "GiB this process may use" in big and "cgroup" in big, big
    assert "0.015625 GiB" in big  # the limit it was held to: 16 MiB


def test_weights_decoded_at_load_are_checked_against_the_cgroup_limit(tmp_path):
    """A k-quant file whose weights, decoded to q8_0 at load, would pass the container's memory (a 256 KiB
    memory.max, as above) is refused with a message before the allocation that would pass it."""
    import shlex
    import shutil

    rng = np.random.default_rng(0)
    path = write_llama(tmp_path / "k.gguf", {n: (random_blocks(Q.Q4_K, *shape, rng), Q.Q4_K)
                                             for n, shape in SHAPES.items()})
    fake = tmp_path / "cgroup"
    fake.mkdir()
    (fake / "memory.max").write_text(f"{256 << 10}\n")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {fake} /sys/fs/cgroup"], capture_output=True)
    if not shutil.which("unshare") or probe.returncode != 0:
        pytest.skip("no user+mount namespace here (unshare -rm) to stand in a cgroup limit")
    script = (f"mount --bind {fake} /sys/fs/cgroup && exec {shlex.quote(sys.executable)} -c "
              f"{shlex.quote(CGROUP_PROBE)} {path} 16")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip()
    assert out.startswith("refused") and "the weights decoded at load (q4_K to q8_0 at tensor" in out, out
    assert "GiB this process may use" in out and "0.000244 GiB" in out and "convert --outtype q4_0" in out, out
