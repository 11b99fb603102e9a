"""numpy's OpenBLAS at one thread inside the quantised forward (fermijit/blas.py), restored after."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit import blas
from fermijit.engine import DEFAULT_MODEL
from fermijit.model.forward import load_model

needs_openblas = pytest.mark.skipif(blas.threads() is None, reason="numpy's BLAS is not OpenBLAS")


@pytest.fixture
def two_blas_threads():
    """OpenBLAS at 2 threads for the test (whatever the machine's count), restored after."""
    lib = blas._openblas()
    before = lib[1]()
    lib[0](2)
    yield
    lib[0](before)


@needs_openblas
def test_single_threaded_restores_the_count(two_blas_threads):
    with blas.single_threaded():
        assert blas.threads() == 1
        with blas.single_threaded():  # nested: nothing to change, nothing to restore
            assert blas.threads() == 1
        assert blas.threads() == 1
    assert blas.threads() == 2
    with pytest.raises(ZeroDivisionError), blas.single_threaded():
        1 / 0
    assert blas.threads() == 2


@needs_openblas
def test_quantised_prefill_runs_blas_on_one_thread(two_blas_threads, monkeypatch):
    """Every fp32 product of the default model's prefill sees one BLAS thread."""
    _, model = load_model(DEFAULT_MODEL)
    seen = []
    matmul = np.matmul

    def spy(*args, **kwargs):
        seen.append(blas.threads())
        return matmul(*args, **kwargs)

    monkeypatch.setattr(np, "matmul", spy)
    model.prefill(np.arange(5, dtype=np.int32), model.new_state(8))
    assert seen and set(seen) == {1}
    assert blas.threads() == 2
