"""Copies of fp32 state arrays on every thread (a verify step's GDN saves and rollbacks): each
destination the numpy reference's copy, bit for bit (NaN payloads and signed zeros included),
whatever the thread count and however the sizes split over the threads."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import state_copy
from tests.numerics import poisoned


def _sources(rng, shapes):
    out = []
    for shape in shapes:
        a = rng.standard_normal(shape).astype(np.float32)
        flat = a.reshape(-1)
        flat[::7] = -0.0
        flat[3::11] = np.float32(1e-41)  # subnormals copy as they are
        out.append(a)
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_matches_reference_on_ragged_pairs(rng, threads):
    shapes = [(1,), (5, 3), (32, 7, 9), (8192, 3), (2, 13, 5, 4), (17,)]
    srcs = _sources(rng, shapes)
    dsts = [poisoned(s) for s in shapes]
    want = state_copy.reference([np.empty_like(s) for s in srcs], srcs)
    threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(threads)
        got = state_copy.cpu(dsts, srcs)
    finally:
        numba.set_num_threads(before)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_launch_copies_into_views_of_a_stack(rng):
    """A step's saves are views of one stacked buffer ([rows, layers, ...]): each its own."""
    stack = poisoned((2, 3, 4, 5))
    srcs = _sources(rng, [(4, 5)] * 3)
    kernel, args = state_copy.launch([stack[1, g] for g in range(3)], srcs)
    kernel(*args)
    for g in range(3):
        np.testing.assert_array_equal(stack[1, g], srcs[g])
    assert np.isnan(stack[0]).all()


def test_refuses_what_it_cannot_copy_in_place():
    a = np.zeros((4, 6), np.float32)
    with pytest.raises(FermijitError, match="C-contiguous"):
        state_copy.launch([a[:, :3]], [np.zeros((4, 3), np.float32)])
    with pytest.raises(FermijitError, match="float32"):
        state_copy.launch([a], [np.zeros((4, 6), np.float64)])
    with pytest.raises(FermijitError, match="destination"):
        state_copy.launch([a], [np.zeros((6, 4), np.float32)])
    with pytest.raises(FermijitError, match="as many"):
        state_copy.launch([a], [])
    b = np.zeros((4, 6), np.float32)
    b.flags.writeable = False
    with pytest.raises(FermijitError, match="read-only"):
        state_copy.launch([b], [a])
