"""Q8_0 rows of the KV cache: keys and values in blocks of 32 along the head dim,
as llama.cpp's `q8_0` cache type, rounded as the W4A8 products round activations (DESIGN.md,
Numerics; ops.matvec.quantize_act_reference):

    d = max|x_b| / 127 (fp32) per 32-block b of a row;  q = round-half-away(x · (1/d)) int8;
    x ~ q · d.

The scale is fp32, not llama.cpp's fp16: 36 bytes a block instead of 34 (6 % more), for no fp16
rounding in the Numba kernels (Westmere has no F16C; LLVM's `fptrunc half` libcall is not
resolvable in-process, notes/cpu-kernels.md pitfall 4) and the GPU's act_quant kernel making the
same bytes. The query is rounded the same way before its integer dot products with the keys
(ops/attention.py).

Letters: T tokens, Hkv kv heads, S positions, D head dim (whole 32-blocks), nb = D/32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array
from fermijit.jit import omp
from fermijit.jit.cpu import kernel
from fermijit.ops import matvec
from fermijit.ops.quant import BLOCK


@dataclasses.dataclass(frozen=True, eq=False)
class Q8Rows:
    """Rows of Q8_0 blocks, structure-of-arrays, indexed like the fp32 array they stand for on
    every axis but the last: a cache [Hkv, S, D] is qs [Hkv, S, D] and d [Hkv, S, nb], and
    `rows[:, a:b]` is positions a..b-1 of both."""

    qs: np.ndarray  # [..., D] int8
    d: np.ndarray   # [..., nb] float32

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the fp32 rows these stand for (qs's)."""
        return self.qs.shape

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes

    def __getitem__(self, index) -> "Q8Rows":
        """Both arrays indexed alike; `index` must leave the last axis whole."""
        return Q8Rows(self.qs[index], self.d[index])

    def __setitem__(self, index, rows: "Q8Rows") -> None:
        self.qs[index] = rows.qs
        self.d[index] = rows.d

    def copy(self) -> "Q8Rows":
        return Q8Rows(self.qs.copy(), self.d.copy())

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """[..., D] = q · d, in `dtype`."""
        nb = self.d.shape[-1]
        q = self.qs.reshape(*self.qs.shape[:-1], nb, BLOCK).astype(dtype)
        return (q * self.d.astype(dtype)[..., None]).reshape(self.qs.shape)


def empty(shape: tuple[int, ...], allocate=np.empty) -> Q8Rows:
    """Q8Rows for fp32 rows of `shape` (last axis whole blocks), from `allocate(shape, dtype)`."""
    if shape[-1] % BLOCK:
        raise FermijitError(f"a Q8_0 KV cache needs a head dim of whole {BLOCK}-blocks, got "
                            f"{shape[-1]}")
    return Q8Rows(allocate(shape, np.int8), allocate((*shape[:-1], shape[-1] // BLOCK),
                                                     np.float32))


def reference(x) -> Q8Rows:
    """x fp32 [..., D] -> Q8Rows: ops.matvec's rounding of activations, per row."""
    x = np.asarray(x, np.float32)
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise FermijitError(f"kv_quant: x has shape {list(x.shape)}; the last axis must be whole "
                            f"{BLOCK}-blocks")
    q, d = matvec.quantize_act_reference(x.reshape(-1, x.shape[-1]))    # [N, nb, 32], [N, nb]
    return Q8Rows(q.reshape(x.shape), d.reshape(*x.shape[:-1], x.shape[-1] // BLOCK))


@kernel(fastmath=False)
def quantize_row(x, qs, d, sums):
    """x [D] fp32 -> qs [D] int8, d [nb] (the rounding of matvec's quantiser: its own block
    kernels, the same bits); sums [nb] int32 the codes' sum per block (or an empty array: not
    kept). No fast-math: the rounding must be the reference's."""
    for b in range(d.shape[0]):
        xb = x[b * 32:b * 32 + 32]
        amax = matvec._block_amax(xb)
        db = amax / np.float32(127.0)
        inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
        total = matvec._round_half(xb, inv, qs[b * 32:b * 32 + 32])
        d[b] = db
        if sums.shape[0]:
            sums[b] = total


def _store_rows(x, qs, d, start, first, last):
    no_sums = np.empty(0, np.int32)
    for t in range(first, last):
        for h in range(x.shape[1]):
            quantize_row(x[t, h], qs[h, start + t], d[h, start + t], no_sums)


def _store_body(x, qs, d, start):
    fork((x, qs, d, start))


_store_one = kernel(_store_rows, fastmath=False)
# A prefill pass's tokens over the threads (512 tokens' keys or values: ~1.1 ms a layer on one
# thread). This ran 3x slower over 2 threads than on one while every view of a row counted a
# shared reference; a fork's arrays no longer carry one (jit/omp.py `_unowned`).
_store_threads = omp.forking_kernel(_store_body, fastmath=False,
                                    fork=omp.rows_share(_store_one, "kv-store"))


def store(x, rows: Q8Rows, start: int) -> None:
    """rows[:, start:start+T] = the Q8_0 rows of x [T, Hkv, D] (a prefill pass's keys or values,
    in the cache's [Hkv, S, D] layout); `reference` bit for bit."""
    op = "kv_quant"
    T, Hkv, D = check_array(op, "x", x, np.float32, ndim=3).shape
    S = check_array(op, "qs", rows.qs, np.int8, (Hkv, None, D)).shape[1]
    check_array(op, "d", rows.d, np.float32, (Hkv, S, D // BLOCK))
    if D % BLOCK:
        raise FermijitError(f"{op}: head dim {D} is not whole {BLOCK}-blocks")
    if not 0 <= start <= S - T:
        raise FermijitError(f"{op}: rows {start}..{start + T - 1} of a cache of {S}")
    if T >= omp.ROWS_MIN:
        _store_threads()(x, rows.qs, rows.d, int(start))
    else:
        _store_one(x, rows.qs, rows.d, int(start), 0, T)
