"""numpy's OpenBLAS at one thread inside the quantised forward (fermijit/host/blas.py), then
restored."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.engine import DEFAULT_MODEL
from fermijit.host import blas
from fermijit.model.forward import load_model
from fermijit.ops import fp32_rows

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
    """The default model's prefill calls no numpy product (its fp32 products are ops.fp32_rows'),
    and the forward's kernels run with OpenBLAS at one thread all the same."""
    assert blas.threads() == 2
    _, model = load_model(DEFAULT_MODEL)
    matmuls, seen = [], []
    matmul, product = np.matmul, fp32_rows.cpu

    def spy_matmul(*args, **kwargs):
        matmuls.append(blas.threads())
        return matmul(*args, **kwargs)

    def spy_product(*args, **kwargs):
        seen.append(blas.threads())
        return product(*args, **kwargs)

    monkeypatch.setattr(np, "matmul", spy_matmul)
    monkeypatch.setattr(fp32_rows, "cpu", spy_product)
    model.prefill(np.arange(5, dtype=np.int32), model.new_state(8))
    assert matmuls == []
    assert seen and set(seen) == {1}
    assert blas.threads() == 2
