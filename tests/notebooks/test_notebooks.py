"""The notebooks run end to end on the embedded default model and real text, on a small token budget,
and show their figures: they are documentation that cannot rot."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_models import DATA

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
TOKENS = 512                       # 8 sequences of 64 tokens: enough for a held-out split
# notebook -> how many figures it must display
FIGURES = {"activation_locality.ipynb": 3, "predictor_quality.ipynb": 2, "placement.ipynb": 2, "python_api.ipynb": 0}


@pytest.fixture(scope="module")
def notebook_env(tmp_path_factory, smollm2_file):
    """Environment for the kernels: the budget, the data, one work dir shared by all notebooks (the
    profile is made once), and this checkout first on the path."""
    if not (DATA / "wikitext-2-valid.txt").is_file():
        pytest.skip("shared data (../shared/data) not present")
    env = {"PI_NB_TOKENS": str(TOKENS), "PI_NB_RANK": "16", "PI_NB_DATA": str(DATA),
           "PI_NB_CONVERTED": str(smollm2_file("q8_0")),  # python_api.ipynb: the default model, converted once
           "PI_NB_WORK": str(tmp_path_factory.mktemp("notebooks")),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_executes(name, notebook_env):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert not any(cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), \
        f"{name} is committed with outputs; clear them"
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == FIGURES[name], f"{name} displayed {len(images)} figures, expected {FIGURES[name]}"
