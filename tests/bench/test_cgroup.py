"""bench --memory-limit's cgroups (powerinfer_tools/bench/cgroup.py): which hierarchy is used, a child that
allocates past the limit reported as OOM-killed, the cgroup gone afterwards, and one line where none can be made."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cgroup_helpers import cgroup_files, hierarchy_or_skip

from powerinfer_tools.bench import cgroup
from powerinfer_tools.bench.runners import Worker, WorkerDied
from powerinfer_tools.core.errors import UserError


def test_finds_v2_with_memory_then_v1(tmp_path):
    """v2 where its root lists the memory controller (alone or as systemd's hybrid 'unified'), else v1's memory
    hierarchy; the new cgroups go under this process's own cgroup in it."""
    v2 = cgroup_files(tmp_path / "v2", {"sys/cgroup.controllers": "cpu io memory pids\n", "proc": "0::/user.slice/a\n"})
    assert cgroup.find_hierarchy(v2 / "sys", v2 / "proc") == cgroup.Hierarchy(2, v2 / "sys/user.slice/a")

    hybrid = {"sys/unified/cgroup.controllers": "\n", "sys/memory/memory.limit_in_bytes": "9223372036854771712\n",
              "proc": "4:memory:/job/7\n3:cpu,cpuacct:/\n0::/\n"}
    h = cgroup_files(tmp_path / "hybrid", hybrid)  # the unified hierarchy without the memory controller: v1's
    assert cgroup.find_hierarchy(h / "sys", h / "proc") == cgroup.Hierarchy(1, h / "sys/memory/job/7")

    both = cgroup_files(tmp_path / "both", dict(hybrid, **{"sys/unified/cgroup.controllers": "memory\n"}))
    assert cgroup.find_hierarchy(both / "sys", both / "proc").version == 2

    none = cgroup_files(tmp_path / "none", {"sys/cpu/cpu.shares": "1024\n", "proc": "1:cpu:/\n"})
    with pytest.raises(UserError, match="needs a memory cgroup") as exc:
        cgroup.find_hierarchy(none / "sys", none / "proc")
    assert "\n" not in str(exc.value)


def test_a_hierarchy_that_cannot_be_written_is_refused_in_one_line():
    """sysfs takes no new directories, from root or anyone: where the cgroup cannot be made, one line says so."""
    with pytest.raises(UserError, match="cannot make a memory cgroup under /sys") as exc:
        with cgroup.MemoryCgroup(64 << 20, cgroup.Hierarchy(1, Path("/sys"))):
            pass
    assert "\n" not in str(exc.value)


def test_dropping_the_page_cache_without_root_is_refused_in_one_line(tmp_path):
    target = tmp_path / "no-such-dir" / "drop_caches"  # what a non-root write of /proc/sys/vm/drop_caches meets
    with pytest.raises(UserError, match="drops the page cache before each engine: cannot write") as exc:
        cgroup.drop_page_cache(target)
    assert "\n" not in str(exc.value)


ALLOCATE = "import sys; b = bytearray(b'x') * (int(sys.argv[1]) << 20); print('survived', flush=True)"


def test_a_child_past_the_limit_is_oom_killed_and_the_cgroup_removed():
    hierarchy = hierarchy_or_skip()
    limit = 64 << 20
    with cgroup.MemoryCgroup(limit, hierarchy) as group:
        path = group.path
        assert path.is_dir()
        small = subprocess.run([sys.executable, "-c", ALLOCATE, "8"], preexec_fn=group.preexec, capture_output=True,
                               text=True)
        assert small.returncode == 0 and "survived" in small.stdout
        assert group.oom_kills() == 0
        big = subprocess.run([sys.executable, "-c", ALLOCATE, "256"], preexec_fn=group.preexec, capture_output=True,
                             text=True)
        assert big.returncode == -9 and "survived" not in big.stdout  # SIGKILL: the OOM killer
        assert group.oom_kills() >= 1
        peak = group.peak_bytes()
        if peak is not None:  # v2 before Linux 5.19 has no memory.peak
            assert 8 << 20 < peak <= limit
    assert not path.exists()


def test_the_cgroup_is_removed_with_a_process_still_in_it():
    """Leaving the block on an exception (Ctrl-C included) kills what is still in the cgroup and removes it."""
    hierarchy = hierarchy_or_skip()
    with pytest.raises(KeyboardInterrupt):
        with cgroup.MemoryCgroup(64 << 20, hierarchy) as group:
            path = group.path
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=group.preexec)
            assert group.pids() == [child.pid]
            raise KeyboardInterrupt
    assert child.wait(timeout=10) == -9
    assert not path.exists()


def test_a_worker_killed_for_memory_is_named(tmp_path):
    """A bench worker started in the cgroup that takes more than the limit dies of SIGKILL: the harness sees
    WorkerDied naming the signal, and the cgroup counts the OOM kill. The 'Python' here allocates and nothing else."""
    hierarchy = hierarchy_or_skip()
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{ALLOCATE}\" 256\n")
    python.chmod(0o755)
    with cgroup.MemoryCgroup(64 << 20, hierarchy) as group:
        with pytest.raises(WorkerDied, match="killed by SIGKILL") as exc:
            Worker("llama.cpp", tmp_path / "model.gguf", 1, 16, python=str(python), cgroup=group)
        assert exc.value.signal == "SIGKILL" and group.oom_kills() >= 1
