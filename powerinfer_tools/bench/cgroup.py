"""A memory cgroup for one benchmark worker (`bench --memory-limit`): the kernel holds the worker, and the page
cache it fills, to the limit, as a machine with that much memory would; the worker's peak and whether the kernel
killed it for memory are read back, and the cgroup is removed when the worker is done, on Ctrl-C too.

The cgroup is made a child of the one this process is in (/proc/self/cgroup), so it stays inside whatever already
limits the benchmark. cgroup v2 (the unified hierarchy) where its memory controller is available, else v1's memory
hierarchy. The files are the kernel's (Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/memory.rst):
  v2: memory.max, memory.swap.max, memory.peak, memory.events (oom_kill), cgroup.procs, cgroup.kill
  v1: memory.limit_in_bytes, memory.memsw.limit_in_bytes, memory.max_usage_in_bytes, memory.oom_control
      (oom_kill), cgroup.procs
v1 charges a page of the page cache to the cgroup that first read it: a file another process read before stays
cached outside the limit, which is why `drop_page_cache` runs before each engine starts.
"""
from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from powerinfer_tools.core.errors import UserError

ROOT = Path("/sys/fs/cgroup")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
PREFIX = "pi-bench-"   # the cgroups this module makes: <PREFIX><pid>-<random hex>


@dataclass
class Hierarchy:
    """Where this process's cgroup is, in the hierarchy whose memory controller the module uses."""
    version: int          # 1 or 2
    own: Path             # this process's cgroup directory: new cgroups are made under it


def _own_paths(proc_cgroup: Path) -> dict[str, str]:
    """controller (or '' for v2) -> this process's cgroup path, from /proc/self/cgroup's id:controllers:path."""
    paths = {}
    for line in proc_cgroup.read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def find_hierarchy(root: Path = ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Hierarchy:
    """The hierarchy to make memory cgroups in; a UserError of one line saying why there is none."""
    try:
        paths = _own_paths(proc_cgroup)
    except OSError as exc:
        raise UserError(f"--memory-limit: cannot read {proc_cgroup} ({exc.strerror})") from None
    for unified in (root, root / "unified"):  # v2 alone, or beside v1 (systemd's hybrid layout)
        controllers = unified / "cgroup.controllers"
        if "" in paths and controllers.is_file() and "memory" in controllers.read_text().split():
            return Hierarchy(2, unified / paths[""].lstrip("/"))
    if "memory" in paths and (root / "memory" / "memory.limit_in_bytes").is_file():
        return Hierarchy(1, root / "memory" / paths["memory"].lstrip("/"))
    raise UserError(f"--memory-limit needs a memory cgroup: neither cgroup v2 with the memory controller nor v1's "
                    f"memory hierarchy is mounted under {root}")


class MemoryCgroup:
    """One cgroup limited to `limit_bytes` (swap included: none), made on entry and removed on exit.
    `preexec` moves the calling process into it: pass it to subprocess as preexec_fn (or call it from one), so
    that everything the worker allocates after exec counts."""

    def __init__(self, limit_bytes: int, hierarchy: Hierarchy):
        self.limit_bytes, self.hierarchy = int(limit_bytes), hierarchy
        self.path = hierarchy.own / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"

    def _file(self, name: str) -> Path:
        return self.path / name

    def _write(self, name: str, value: str) -> None:
        self._file(name).write_text(value)

    def _read(self, name: str) -> str | None:
        try:
            return self._file(name).read_text()
        except OSError:
            return None

    def __enter__(self) -> "MemoryCgroup":
        v2 = self.hierarchy.version == 2
        try:
            if v2:
                _enable_memory_controller(self.hierarchy.own)
            self.path.mkdir()
        except OSError as exc:
            raise UserError(f"--memory-limit: cannot make a memory cgroup under {self.hierarchy.own} "
                            f"({exc.strerror}; it needs root, or a cgroup delegated to this user)") from None
        try:
            if v2:
                self._write("memory.max", str(self.limit_bytes))
                if self._file("memory.swap.max").exists():
                    self._write("memory.swap.max", "0")
            else:
                self._write("memory.limit_in_bytes", str(self.limit_bytes))
                if self._file("memory.memsw.limit_in_bytes").exists():  # swap accounting on: none beyond the limit
                    self._write("memory.memsw.limit_in_bytes", str(self.limit_bytes))
        except OSError as exc:
            self.remove()
            raise UserError(f"--memory-limit: cannot set {self.path}'s limit to {self.limit_bytes} bytes "
                            f"({exc.strerror})") from None
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def preexec(self) -> None:
        """Join the cgroup: for a child between fork and exec."""
        self._write("cgroup.procs", str(os.getpid()))

    def pids(self) -> list[int]:
        text = self._read("cgroup.procs")
        return [int(p) for p in text.split()] if text else []

    def peak_bytes(self) -> int | None:
        """The most memory (page cache included) the cgroup held; None where the kernel does not say (v2 before
        Linux 5.19 has no memory.peak)."""
        text = self._read("memory.peak" if self.hierarchy.version == 2 else "memory.max_usage_in_bytes")
        return int(text) if text and text.strip().isdigit() else None

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in this cgroup (v2 memory.events, v1 memory.oom_control)."""
        text = self._read("memory.events" if self.hierarchy.version == 2 else "memory.oom_control") or ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Kill what is left in the cgroup and remove it; the directory may take a moment to be free (a killed
        process leaves it when the kernel has reaped it)."""
        if not self.path.exists():
            return
        deadline = time.monotonic() + 10.0
        while True:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise UserError(f"--memory-limit: cannot remove the cgroup {self.path} ({exc.strerror})") from None
                time.sleep(0.05)


def _enable_memory_controller(parent: Path) -> None:
    """v2 gives a cgroup's children a controller only when the parent lists it in cgroup.subtree_control."""
    control = parent / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        control.write_text("+memory")


def drop_page_cache(path: Path = DROP_CACHES) -> None:
    """Write back and drop the clean page cache (and reclaimable slab), so that an engine's first read of its file
    comes from the disk, as on a machine that just booted. Needs root."""
    os.sync()
    try:
        path.write_text("3")
    except OSError as exc:
        raise UserError(f"--memory-limit drops the page cache before each engine: cannot write {path} "
                        f"({exc.strerror}; run as root)") from None

