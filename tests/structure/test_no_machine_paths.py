"""The product and its scripts name no path of the machines they were developed on: data comes from an argument,
an environment variable or a path relative to the checkout."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_PATH = re.compile(r"""["'\s(=](/work/|/root/|/home/\w+/|/tmp/[\w.-]+/[\w.-]+)""")


def test_no_absolute_machine_path_in_the_product_or_scripts():
    found = []
    for folder in ("powerinfer_tools", "engine", "scripts", "csrc"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh", ".cpp", ".h", ".cu", ".inc", ".json") or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if MACHINE_PATH.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
