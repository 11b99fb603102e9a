"""ops.residual_step for R rows of one call (a speculative verify step's rows, model/batch.py):
row r bit for bit residual_step on row r (its kernel, whose row loop takes R rows), with the fp32
product's rows of w forked over the threads once for all R rows (each thread's rows of w read once
from memory, then from its cache for the other rows), not once per row: a verify step of 2 rows
made 4 calls (and 4 forks) of this step a layer, each reading the 1 MB router (0.5 MB GDN gates)
of a full-size layer.

    x[r] += y[r], xn[r] = rmsnorm(x[r]), act[r] = quantise(xn[r]), p[r] = w · xn[r]
    ids[r], weights[r] = router(p[r], k)                      (k > 0)

Letters: as ops/residual_step.py; R rows.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.ops import residual_step
from fermijit.ops.matvec import Q8Act


def reference(x, y, norm_w, eps, w, top_k=0):
    """residual_step.reference row by row: x, y [R, H] (y None: no add) -> (new x, xn, p [R, R']
    float64, or (ids, weights) with top_k > 0)."""
    rows = [residual_step.reference(x[r:r + 1], None if y is None else y[r:r + 1], norm_w, eps,
                                    w, top_k) for r in range(x.shape[0])]
    x_new, xn = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
    if top_k:
        return x_new, xn, tuple(np.concatenate([r[2][i] for r in rows]) for i in (0, 1))
    return x_new, xn, np.concatenate([r[2] for r in rows])


def launch(x, y, norm_w, eps, xn, act: Q8Act, w, p, ids, weights):
    """The call's kernel and arguments, for a caller that repeats it (a verify step's plan): x
    [R, H] updated in place (y None: left as it is), xn [R, H], act a Q8Act of [R, H], p [R, R']
    the product (R' = 0 with w [0, H]: none), ids, weights [R, k] (k = 0: not routed). Every
    array C-contiguous, made once by the caller; only the kernel's signature checks dtypes."""
    R = x.shape[0]
    for name, a in (("xn", xn), ("act", act.xq), ("p", p), ("ids", ids), ("weights", weights)):
        if a.shape[0] != R:
            raise FermijitError(f"residual_rows: {name} has {a.shape[0]} rows for x's {R}")
    return residual_step.launch(x, y, norm_w, eps, xn, act, w, p, ids, weights)


def cpu(x, y, norm_w, eps, xn, act: Q8Act, w, p, ids, weights):
    """`launch`'s call, run once."""
    kernel_, args = launch(x, y, norm_w, eps, xn, act, w, p, ids, weights)
    kernel_(*args)
    return act
