"""The memory limits the engine checks a model against, read from files a test wrote (engine.memory.memory_limits
stands them in for /proc/self and /sys/fs/cgroup): v2's memory.max and v1's memory.limit_in_bytes lower the machine's
memory where they hold a number, and whatever else they hold, or their absence, leaves it as it was. The reading was
iostreams, where every open crashed on a machine with another libstdc++ (issue 53); it is C stdio now."""
from __future__ import annotations

from pathlib import Path

import pytest
from cgroup_helpers import cgroup_files

from powerinfer_engine.memory import memory_limits

MACHINE = float(64 << 30)


def proc_dir(tmp_path: Path, cgroup: str, status: str | None = "Name:\tpython\nRssAnon:\t  123456 kB\n") -> Path:
    """A stand-in for /proc/self: its cgroup file (`cgroup`) and its status file (none where `status` is None)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    if status is not None:
        (proc / "status").write_text(status)
    return proc


@pytest.mark.parametrize("memory_max,usable", [
    ("max\n", MACHINE),
    ("268435456\n", 268435456.0),
    ("268435456", 268435456.0),
    ("garbage\n", MACHINE),
    ("12abc\n", MACHINE),
    ("-1\n", MACHINE),
    ("0\n", MACHINE),
    ("", MACHINE),
    ("99999999999999999999999\n", MACHINE),  # past 64 bits
    (None, MACHINE),  # no memory.max
])
def test_v2_memory_max(tmp_path, memory_max, usable):
    files = {} if memory_max is None else {"app.slice/run.scope/memory.max": memory_max}
    root = cgroup_files(tmp_path / "cgroup", files)
    assert memory_limits(proc_dir(tmp_path, "0::/app.slice/run.scope\n"), root, MACHINE)[0] == usable


def test_v2_the_lowest_limit_up_the_tree_counts(tmp_path):
    root = cgroup_files(tmp_path / "cgroup", {"memory.max": "max\n", "a/memory.max": "1000000\n",
                                              "a/b/memory.max": "max\n", "a/b/c/memory.max": "2000000\n"})
    proc = proc_dir(tmp_path, "0::/a/b/c\n")
    assert memory_limits(proc, root, MACHINE)[0] == 1000000.0
    assert memory_limits(proc, root, 500000.0)[0] == 500000.0  # the machine's memory, lower still


@pytest.mark.parametrize("line", ["4:memory:/docker/abc\n", "3:cpu,memory,pids:/docker/abc\n"])
@pytest.mark.parametrize("limit,usable", [
    ("536870912\n", 536870912.0),
    ("9223372036854771712\n", MACHINE),  # v1's "no limit": the largest page multiple, above the machine's memory
    ("garbage\n", MACHINE),
    (None, MACHINE),
])
def test_v1_memory_limit_in_bytes(tmp_path, line, limit, usable):
    files = {} if limit is None else {"memory/docker/abc/memory.limit_in_bytes": limit}
    root = cgroup_files(tmp_path / "cgroup", files)
    cgroup = "12:pids:/docker/abc\n" + line + "1:name=systemd:/docker/abc\n0::/\n"
    assert memory_limits(proc_dir(tmp_path, cgroup), root, MACHINE)[0] == usable


@pytest.mark.parametrize("cgroup", ["", "garbage\n", "0::garbage\n", "0:\n", "::::\n", "0::" + "/x" * 3000 + "\n"])
def test_a_cgroup_file_the_kernel_would_not_write_leaves_the_machine_memory(tmp_path, cgroup):
    root = cgroup_files(tmp_path / "cgroup", {"memory.max": "max\n"})
    assert memory_limits(proc_dir(tmp_path, cgroup), root, MACHINE)[0] == MACHINE


def test_missing_files_leave_the_machine_memory_and_no_anonymous_bytes(tmp_path):
    assert memory_limits(tmp_path / "none", tmp_path / "none", MACHINE) == (MACHINE, 0.0)


@pytest.mark.parametrize("status,anonymous", [
    ("Name:\tpython\nRssAnon:\t  123456 kB\nRssFile:\t  99 kB\n", 123456 * 1024.0),
    ("Groups:\t" + "1000 " * 20000 + "\nRssAnon:\t  8 kB\n", 8 * 1024.0),  # a line longer than any buffer
    ("Name:\tpython\n", 0.0),
    ("RssAnon:\tgarbage\n", 0.0),
])
def test_anonymous_bytes_are_rss_anon(tmp_path, status, anonymous):
    assert memory_limits(proc_dir(tmp_path, "0::/\n", status), tmp_path, MACHINE)[1] == anonymous


def test_this_process_under_this_machine():
    usable, anonymous = memory_limits("/proc/self", "/sys/fs/cgroup", MACHINE)
    assert 0 < usable <= MACHINE and 1 << 20 < anonymous < MACHINE
