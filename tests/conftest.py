import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: fresh inputs per test, reproducible per test."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
