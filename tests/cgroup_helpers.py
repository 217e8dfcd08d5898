"""Cgroup trees for the tests: fake ones written under tmp_path, and the machine's own where root may use it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from powerinfer_tools.bench import cgroup
from powerinfer_tools.core.errors import UserError


def cgroup_files(root: Path, files: dict[str, str]) -> Path:
    """`root` with each relative path in `files` written with its text (a fake /sys/fs/cgroup or /proc)."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def hierarchy_or_skip() -> cgroup.Hierarchy:
    """The machine's memory cgroup hierarchy, where this process may make cgroups in it; the test skips otherwise."""
    if os.geteuid() != 0:
        pytest.skip("making memory cgroups needs root")
    try:
        hierarchy = cgroup.find_hierarchy()
    except UserError as exc:
        pytest.skip(str(exc))
    if not os.access(hierarchy.own, os.W_OK):
        pytest.skip(f"{hierarchy.own} is not writable here")
    return hierarchy
