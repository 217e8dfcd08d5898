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
from engine_helpers import converted, smollm2_q8_0  # noqa: F401
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
import powerinfer_engine as engine
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
import numpy as np
import powerinfer_engine as engine

def anonymous_bytes():
    line = next(l for l in open("/proc/self/status") if l.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024

path, ctx, fill = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "fill"
if ctx == 0:  # the largest context the check accepts, to the nearest 64 positions
    lo, hi = 64, 1 << 17
    while hi - lo > 64:
        mid = (lo + hi) // 2
        try:
            engine.Model(path, threads=2, ctx_size=mid).close()
            lo = mid
        except engine.EngineError:
            hi = mid
    ctx = lo
try:
    with engine.Model(path, threads=2, ctx_size=ctx) as m:
        tokens = np.random.default_rng(0).integers(3, m.n_vocab, size=m.n_ctx).tolist()
        for at in range(0, m.n_ctx if fill else 0, 512):
            m.eval(tokens[at:at + 512], all_logits=False)
        print("opened", ctx, m.n_past, anonymous_bytes())
except engine.EngineError as exc:
    print("refused", exc)
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """open_with(path, ctx, limit_mib, fill=False): CGROUP_PROBE's line from a child process held to a memory
    limit of limit_mib: its cgroup's memory.max, a directory bind-mounted over /sys/fs/cgroup in a private user
    and mount namespace (unshare -rm). ctx 0: the largest the engine accepts; fill: evaluate it to the end."""
    import shlex
    import shutil

    empty = tmp_path_factory.mktemp("empty")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {empty} /sys/fs/cgroup"], capture_output=True)
    if not shutil.which("unshare") or probe.returncode != 0:
        pytest.skip("no user+mount namespace here (unshare -rm) to stand in a cgroup limit")

    def open_with(path: Path, ctx: int, limit_mib: float, fill: bool = False) -> list[str]:
        fake = tmp_path_factory.mktemp("cgroup")
        (fake / "memory.max").write_text(f"{int(limit_mib * 2**20)}\n")
        script = (f"mount --bind {fake} /sys/fs/cgroup && exec {shlex.quote(sys.executable)} -c "
                  f"{shlex.quote(CGROUP_PROBE)} {path} {ctx} {'fill' if fill else 'open'}")
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=600,
                              env=os.environ)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().split(" ", 4 if done.stdout.startswith("opened") else 1)

    return open_with


def test_context_is_checked_against_the_cgroup_limit(converted, limited):
    """A context that fits the machine's memory but not the container's (its cgroup's memory.max) is refused
    with a message, where it was an out-of-memory kill."""
    path = converted("llama-relu")
    small = limited(path, 256, 256)
    assert small[0] == "opened", small
    big = limited(path, 1 << 20, 256)
    assert big[0] == "refused" and "of the 0.250000 GiB this process may use" in big[1] and "cgroup" in big[1], big


def test_the_check_counts_the_weights_and_the_process(smollm2_q8_0, limited):
    """The default model's q8_0 file at ctx_size 12000 under 700 MiB: the KV cache and work buffers alone fit
    (0.589 GiB), so the check passed and the process was killed as the context filled; with the weights the
    engine copies out of the file and what the process already holds, it is refused at open."""
    refused = limited(smollm2_q8_0, 12000, 700)
    assert refused[0] == "refused" and "it holds" in refused[1] and "lower ctx_size" in refused[1], refused


def test_a_context_the_check_accepts_fills_within_the_limit(smollm2_q8_0, limited):
    """The largest context accepted under 400 MiB, evaluated to its last position: the anonymous memory the
    process then holds is within the limit (the kernel would have killed it past the limit)."""
    _, ctx, n_past, held = limited(smollm2_q8_0, 0, 400, fill=True)
    assert int(n_past) == int(ctx) > 1024, (ctx, n_past)
    assert int(held) <= 400 << 20, f"ctx_size {ctx}: {int(held) / 2**20:.0f} MiB held under a 400 MiB limit"


def test_weights_decoded_at_load_are_checked_against_the_cgroup_limit(tmp_path, limited):
    """A k-quant file whose weights, decoded to q8_0 at load, would pass the container's memory (a 256 KiB
    memory.max) is refused with a message before the allocation that would pass it."""
    rng = np.random.default_rng(0)
    path = write_llama(tmp_path / "k.gguf", {n: (random_blocks(Q.Q4_K, *shape, rng), Q.Q4_K)
                                             for n, shape in SHAPES.items()})
    out = limited(path, 16, 0.25)
    assert out[0] == "refused" and "the weights decoded at load (q4_K to q8_0 at tensor" in out[1], out
    assert "GiB this process may use" in out[1] and "0.000244 GiB" in out[1] and "convert --outtype q4_0" in out[1], out
