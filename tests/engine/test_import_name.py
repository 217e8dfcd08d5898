"""The binding's import name is powerinfer_engine (the folder is engine/); the old name, `engine`, is the same
package for one release and says so with a DeprecationWarning, from the checkout and from anywhere else."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import warnings
warnings.simplefilter("error", DeprecationWarning)
import powerinfer_engine
assert powerinfer_engine.__name__ == "powerinfer_engine" and powerinfer_engine.Model
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    import engine
    from engine.model import Model
    from engine._lib import EngineError
assert engine is powerinfer_engine and Model is powerinfer_engine.Model
assert EngineError is powerinfer_engine.EngineError
assert any("powerinfer_engine" in str(w.message) and w.category is DeprecationWarning for w in seen), seen
print("ok")
"""


@pytest.mark.parametrize("where", ["checkout", "elsewhere"])
def test_the_new_name_and_the_old_one_are_one_package(where, tmp_path):
    cwd = ROOT if where == "checkout" else tmp_path
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
