"""Fixtures of the sparsify tests."""
from __future__ import annotations

import pytest

from tiny_models import training_text


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    """A calibration text of about 60k characters."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(training_text()[:60_000])
    return path
