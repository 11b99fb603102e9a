"""Copies of fp32 arrays on all threads, in one fork: a speculative verify step's GDN states
(model/batch.py), saved after each row but the last and put back on a rollback.

    dst[i][...] = src[i]      for each pair i

A numpy copy runs on one thread: a full-size verify step's saves (30 GDN layers' 2 MB
recurrent states, after its first row) and a rollback's copies back were ~60 MB each on the
calling thread while the others waited. Here each thread copies the same share of every pair as
gdn_step's heads (an even split of the flattened array: thread t of n takes [t·N/n, (t+1)·N/n),
which is its key heads' value heads' states where n divides Hk), so a save after a GDN step reads
what that thread just wrote, in its own cache.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit import omp


def reference(dsts, srcs):
    """dsts[i][...] = srcs[i] for each i (the arrays of a pair: one shape)."""
    for d, s in zip(dsts, srcs):
        d[...] = s
    return dsts


def _body(dsts, srcs):
    fork((dsts, srcs))


def _share(thread, n_threads, args):
    dsts, srcs = args
    for i in range(len(dsts)):
        d, s = dsts[i], srcs[i]
        n = d.shape[0]
        for j in range(thread * n // n_threads, (thread + 1) * n // n_threads):
            d[j] = s[j]


_kernel = omp.forking_kernel(_body, fork=_share)


def _flat(op: str, name: str, a: np.ndarray) -> np.ndarray:
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous):
        raise FermijitError(f"{op}: {name} must be a C-contiguous float32 array, got "
                            f"{getattr(a, 'dtype', type(a).__name__)} "
                            f"{list(getattr(a, 'shape', []))}")
    return a.reshape(-1)  # a view: contiguous


def launch(dsts, srcs):
    """`cpu`'s kernel and arguments, checked once, for a caller that repeats the copy (a verify
    step's plan, model/batch.py): (kernel, args). Pairs of C-contiguous float32 arrays of one
    shape; the destinations writable."""
    op = "state_copy"
    if len(dsts) != len(srcs) or not dsts:
        raise FermijitError(f"{op}: {len(dsts)} destinations for {len(srcs)} sources (need "
                            f"as many, at least one)")
    for d, s in zip(dsts, srcs):
        if d.shape != s.shape:
            raise FermijitError(f"{op}: destination {list(d.shape)} for source {list(s.shape)}")
        if not d.flags.writeable:
            raise FermijitError(f"{op}: a destination is read-only")
    return _kernel(), (tuple(_flat(op, "dst", d) for d in dsts),
                       tuple(_flat(op, "src", s) for s in srcs))


def cpu(dsts, srcs):
    """`reference` on all threads (one fork)."""
    kernel_, args = launch(dsts, srcs)
    kernel_(*args)
    return dsts
