"""The server the tests of a module share: `pi-tools serve` on the real SmolLM2 q8_0, on a free loopback port."""
from __future__ import annotations

import pytest

from test_serve import Server


@pytest.fixture(scope="module")
def server(smollm2_file):
    s = Server(smollm2_file("q8_0"))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
