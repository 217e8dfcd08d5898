"""bench --memory-limit (powerinfer_tools/bench/limited.py): the rows, the disk tier's counters per token and the
columns that show them, llama.cpp's repacking turned off, and a run of our engine on a tiny model under a cgroup
limit it fits in and one it does not (where this machine lets cgroups be made)."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from tiny_models import HIDDEN, N_FF, N_LAYER
from cgroup_helpers import hierarchy_or_skip
from convert_helpers import write_predictors

from powerinfer_tools.bench import cgroup, limited
from powerinfer_tools.bench import harness as bench
from powerinfer_tools.bench import report
from powerinfer_tools.bench.runners import WorkerDied
from powerinfer_tools.bench.worker import _io_counters, _without_extra_buffers
from powerinfer_tools.core.errors import UserError

DISK = {"tokens": 4, "bytes": 4 * 3 << 20, "reads": 40, "cache_hits": 30, "cache_misses": 10,
        "io_wait_seconds": 0.02, "resident_bytes": 100 << 20, "budget_bytes": 128 << 20}


def test_disk_counters_per_token():
    d = limited.disk_per_token({"decode_tokens": 4, "disk": DISK})
    assert d == {"bytes": 3 << 20, "reads": 10, "hit_rate": 0.75, "io_wait_seconds": 0.005,
                 "resident_bytes": 100 << 20, "budget_bytes": 128 << 20, "prefetch_hit_rate": None,
                 "pinned_hit_rate": None}
    experts = limited.disk_per_token({"disk": dict(DISK, kind="experts", prefetched=8, prefetch_used=6)})
    assert experts["prefetch_hit_rate"] == 0.75  # the lookahead's experts a step used
    planned = limited.disk_per_token({"disk": dict(DISK, kind="experts", tier_plan=True, pinned_hits=20)})
    assert planned["pinned_hit_rate"] == 0.5  # of the 40 lookups, 20 served by pinned experts
    assert "75% (50% pinned)" in "\n".join(limited.render(_record([_row("ours dense", planned)])))
    assert limited.disk_per_token({"decode_tokens": 4}) is None           # an engine without the disk tier
    assert limited.disk_per_token({"disk": dict(DISK, tokens=0)}) is None  # nothing generated through it
    assert limited.disk_per_token({"disk": dict(DISK, cache_hits=0, cache_misses=0)})["hit_rate"] is None


def _record(rows: list[dict]) -> dict:
    return {"settings": {"model": "m", "outtype": "q4_0", "threads": 2, "n_prompt": 16, "n_gen": 8, "repeats": 2},
            "machine": {"cpu": "cpu"},
            "memory_limit": {"limit_gib": 0.5, "budget_gib": None, "cgroup_version": 1, "file_gib": 1.25,
                             "peer_file_gib": 1.2, "rows": rows}}


def _row(label: str, disk: dict | None = None, **extra) -> dict:
    speeds = {"median": 2.0, "read_bytes": 5 << 20, "major_faults": 12}
    return dict({"label": label, "backend": "ours", "mode": "dense", "status": "ok", "pp": speeds, "tg": speeds,
                 "peak_bytes": 400 << 20, "oom_kills": 0, "disk": disk}, **extra)


def test_disk_tier_columns_only_where_a_row_has_them():
    plain = [_row("llama.cpp mmap only", backend="llama.cpp"), _row("ours dense")]
    table = "\n".join(limited.render(_record(plain)))
    assert "| engine | status | pp16 t/s | tg8 t/s | peak MiB (cgroup) | OOM kills | storage MiB/token |" in table
    assert "disk tier" not in table and "cache hit rate" not in table
    assert "| ours dense | ok | 2.00 | 2.00 | 400 | 0 | 5.0 | 12 |" in table

    killed = _row("llama.cpp repacked", backend="llama.cpp", status="OOM-killed", pp=None, tg=None, oom_kills=1,
                  message="the llama.cpp worker exited (killed by SIGKILL): no message")
    tiered = plain + [killed, _row("ours dense + disk tier", limited.disk_per_token({"disk": DISK}))]
    lines = limited.render(_record(tiered))
    table = "\n".join(lines)
    assert ("| disk tier MiB/token | reads/token | cache hit rate | prefetch hit rate | I/O wait ms/token | "
            "resident / budget MiB |") in table
    assert "| ours dense + disk tier | ok | 2.00 | 2.00 | 400 | 0 | 5.0 | 12 | 3.0 | 10 | 75% | – | 5.0 | 100 / 128 |" in table
    assert "| ours dense | ok | 2.00 | 2.00 | 400 | 0 | 5.0 | 12 | – | – | – | – | – | – |" in table
    assert "| llama.cpp repacked | OOM-killed | – | – | 400 | 1 | – | – |" in table
    assert "llama.cpp repacked: the llama.cpp worker exited (killed by SIGKILL)" in table
    header = next(line for line in lines if line.startswith("| engine"))
    assert all(line.count("|") == header.count("|") for line in lines if line.startswith("| "))
    summary = report.render_summary(dict(_record(tiered), runs=[]))
    assert "Under a 0.5 GiB memory cgroup" in summary and "ours dense + disk tier" in summary


def test_rows_with_and_without_the_disk_tier():
    rows = limited.contestants(["dense", "predictor"], {"gpu": "off"}, 0.75, llamacpp=True)
    assert [r.label for r in rows] == ["llama.cpp repacked", "llama.cpp mmap only", "ours dense",
                                       "ours dense + disk tier", "ours predictor", "ours predictor + disk tier"]
    assert rows[1].options == {"repack": False} and rows[3].options == {"gpu": "off", "memory_budget": 0.75}
    assert "memory_budget" not in rows[2].options
    assert [r.label for r in limited.contestants(["dense"], {}, None, llamacpp=False)] == ["ours dense"]
    moe = limited.contestants(["dense"], {}, None, llamacpp=False, experts=True)  # a mixture: the lookahead's worth
    assert [r.label for r in moe] == ["ours dense", "ours dense + lookahead"]
    assert moe[0].options == {} and moe[1].options == {"expert_lookahead": True}


def test_llamacpp_without_extra_buffers():
    """Llama builds its parameters from llama_model_default_params: repack off wraps it to clear use_extra_bufts,
    and a llama.cpp that predates the field is refused, not silently run repacked."""
    class Params(ctypes.Structure):
        _fields_ = [("use_mmap", ctypes.c_bool), ("use_extra_bufts", ctypes.c_bool)]

    def default():
        return Params(True, True)
    low = SimpleNamespace(llama_model_default_params=default)
    _without_extra_buffers(low)
    p = low.llama_model_default_params()
    assert p.use_extra_bufts is False and p.use_mmap is True

    class Old(ctypes.Structure):
        _fields_ = [("use_mmap", ctypes.c_bool)]
    with pytest.raises(ValueError, match="no llama_model_params.use_extra_bufts"):
        _without_extra_buffers(SimpleNamespace(llama_model_default_params=lambda: Old(True)))


class _Group:
    def __init__(self, kills: int):
        self.kills = kills

    def oom_kills(self) -> int:
        return self.kills

    def peak_bytes(self) -> int:
        return 64 << 20


@pytest.mark.parametrize("kills, signal, status", [(1, "SIGKILL", "OOM-killed"), (0, "SIGKILL", "OOM-killed"),
                                                   (0, "SIGSEGV", "died")])
def test_a_worker_that_dies_ends_its_row_not_the_bench(kills, signal, status):
    """Killed by the OOM killer (the cgroup counted it, or SIGKILL where its count is not kept): OOM-killed; another
    signal: died. Either way the row keeps the message and the cgroup's peak."""
    def start(c, group):
        raise WorkerDied(f"the llama.cpp worker exited (killed by {signal}): no message", signal)
    c = limited.Contestant("llama.cpp repacked", "llama.cpp", "dense", {"repack": True})
    row = limited._measure(c, _Group(kills), start, [1, 2], {"tokens": [3, 4]}, 2)
    assert row["status"] == status and signal in row["message"] and row["peak_bytes"] == 64 << 20
    assert row["oom_kills"] == kills and "tg" not in row


def test_io_counters_count_reads_from_storage():
    io = _io_counters()
    assert set(io) == {"read_bytes", "major_faults"} and all(v >= 0 for v in io.values())


def test_memory_limit_refuses_what_it_does_not_time(tiny_model_dir):
    opts = bench.BenchOptions(model=str(tiny_model_dir("llama-silu")), memory_limit=1.0, sweep=True, modes=("gate",),
                              peers=())
    with pytest.raises(UserError, match="--memory-limit times llama.cpp and our modes only"):
        bench.run_bench(opts)
    with pytest.raises(UserError, match="above 0"):
        bench.run_bench(bench.BenchOptions(model="m", memory_limit=-1.0, peers=()))


def test_bench_under_a_memory_limit(tiny_model_dir, tmp_path, monkeypatch):
    """Our engine on the tiny model in a cgroup it fits in (times, peak, no OOM), then in one too small for it
    (the engine refuses to open, the row says why, the bench goes on); the page cache is dropped before each engine (counted
    here, not dropped: the machine is shared), and no cgroup is left behind."""
    pytest.importorskip("powerinfer_engine")
    hierarchy = hierarchy_or_skip()
    drops = []
    monkeypatch.setattr(cgroup, "drop_page_cache", lambda *a: drops.append(a))
    model = str(tiny_model_dir("llama-silu"))
    pred = write_predictors(tmp_path / "pred", N_LAYER, HIDDEN, N_FF)
    common = dict(model=model, outtype="q8_0", threads=1, repeats=2, n_prompt=16, n_gen=6, batch=16, peers=(),
                  modes=("dense", "predictor"), predictors=pred, work_dir=tmp_path / "work", progress=False,
                  text=tmp_path / "text.txt")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    rec = bench.run_bench(bench.BenchOptions(memory_limit=1.0, **common))
    rows = rec["memory_limit"]["rows"]
    assert [r["label"] for r in rows][:1] == ["ours dense"] and "ours predictor" in [r["label"] for r in rows]
    assert len(drops) == len(rows)
    for r in rows:
        if r.get("disk_tier"):
            continue
        assert r["status"] == "ok" and r["oom_kills"] == 0, r
        assert r["tg"]["median"] > 0 and len(r["tg"]["tps"]) == 2 and r["tg"]["read_bytes"] >= 0
        assert 0 < r["peak_bytes"] <= 1 << 30
    small = bench.run_bench(bench.BenchOptions(memory_limit=24 / 1024, **dict(common, modes=("dense",))))
    row = small["memory_limit"]["rows"][0]  # the engine's own memory check reads the cgroup's limit
    assert row["status"] == "refused" and "cgroup's limit" in row["message"] and row["oom_kills"] == 0
    assert "refused" in report.render_markdown(small)
    assert not [p for p in hierarchy.own.iterdir() if p.name.startswith(cgroup.PREFIX)]


def test_memory_limit_without_a_page_cache_to_drop_is_refused_in_one_line(tmp_path, monkeypatch):
    """Checked before the files are built: where the page cache cannot be dropped (not root), or no memory cgroup
    can be made, one line says so."""
    monkeypatch.setattr(cgroup, "DROP_CACHES", tmp_path / "missing" / "drop_caches")
    with pytest.raises(UserError) as exc:
        limited.check_can_run()
    assert "\n" not in str(exc.value) and ("drop_caches is not writable (run as root)" in str(exc.value)
                                           or "needs a memory cgroup" in str(exc.value))
