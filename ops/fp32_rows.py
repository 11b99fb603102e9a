"""The forward's fp32 products on the CPU: out [T, R] = x [T, K] · w [R, K]ᵀ, every output the same
bits whatever T, the row it sits in and the thread count (MODEL.md §4, §6.3: the MoE router
logits [T, E] and the GDN gates [b; a] [T, 2Hv] of a 4-bit model, whose weights stay fp32).

Why a kernel of its own: numpy's OpenBLAS rounds a row of a product differently depending on how
many rows it is given, so prefill passes of 300 tokens and one pass of 1100 gave router logits
2.4e-6 apart, enough to flip 8-bit codes downstream (tests/model/test_long_prompt.py), and a
prompt's logits in prefill were not decode's for the same input row. Here each output is one
fixed sequence of fp32 operations: lane j of a 16-float accumulator sums x[16i + j]·w[16i + j]
over i (a multiply, then an add: no FMA, no reassociation: the kernels are not fastmath), the 16
lanes are added by halving (simd.hsum), then the K mod 16 leftover products one by one. A tile of
tokens x rows shares its loads (`tile`) but keeps an accumulator per output, so the tile shape,
the ISA (a 16-float vector is 1 zmm, 2 ymm or 4 xmm) and the thread are free choices that never
change a bit. Decode (ops/residual_step.py, T = 1) forks `rows_share` over the threads; prefill
calls `cpu`, its tiles over the threads (one fork: `_product_share`).

Letters: T tokens, R outputs (rows of w), K inputs.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fermijit.jit import cpu as jit_cpu
from fermijit.jit import omp, simd
from fermijit.jit.checks import check_array, output
from fermijit.jit.cpu import Isa, kernel
from fermijit.jit.simd import F32, I64, vec

LANES = 16  # floats per accumulator: part of every output's rounding, whatever the ISA


def reference(x, w):
    """x [T, K], w [R, K] fp32 -> x · wᵀ [T, R] in float64."""
    return x.astype(np.float64) @ w.astype(np.float64).T


def tile(n_tok: int, n_rows: int):
    """An intrinsic tile(x, w, out, t0, r0, o0, c0): out[o0 + a, c0 + b] = x[t0 + a] · w[r0 + b]
    for a < n_tok, b < n_rows, each summed as the module docstring says (also attention's scores,
    ops/attention.py). Rows of unit stride (C-contiguous arrays: checked by callers)."""

    @intrinsic
    def tile_(typingctx, x, w, out, t0, r0, o0, c0):
        sig = types.none(x, w, out, t0, r0, o0, c0)

        def codegen(context, builder, sig, args):
            xa, wa, oa = (context.make_array(sig.args[i])(context, builder, args[i])
                          for i in range(3))
            emit_tile(builder, xa, wa, oa, *args[3:7], n_tok, n_rows)
            return context.get_dummy_value()

        return sig, codegen

    return tile_


def emit_tile(builder, xa, wa, oa, t0v, r0v, o0v, c0v, n_tok: int, n_rows: int,
              ragged: bool = True):
    """`tile`'s code, for intrinsics that place tiles themselves (attention's scores): xa, wa,
    oa are Numba array structs, the rest i64 values. ragged=False: the caller guarantees K a
    multiple of 16, and the leftover products' code is not emitted (less to compile)."""
    c = lambda n: ir.Constant(I64, n)  # noqa: E731
    vf = vec(F32, LANES)
    k = builder.extract_value(xa.shape, 1)
    row = lambda arr, i: builder.mul(i, builder.extract_value(arr.strides, 0))  # noqa
    x_rows = [row(xa, builder.add(t0v, c(a))) for a in range(n_tok)]
    w_rows = [row(wa, builder.add(r0v, c(b))) for b in range(n_rows)]
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, None))
             for _ in range(n_rows)] for _ in range(n_tok)]
    n_vec = builder.udiv(k, c(LANES))
    with cgutils.for_range(builder, n_vec) as loop:
        off = builder.mul(loop.index, c(LANES * 4))
        xs = [simd.load(builder, xa.data, builder.add(r, off), vf) for r in x_rows]
        ws = [simd.load(builder, wa.data, builder.add(r, off), vf) for r in w_rows]
        for a in range(n_tok):
            for b in range(n_rows):
                acc = accs[a][b]
                builder.store(builder.fadd(builder.load(acc), builder.fmul(xs[a], ws[b])), acc)
    o_row = builder.extract_value(oa.strides, 0)
    cell = lambda a, b: builder.add(builder.mul(builder.add(o0v, c(a)), o_row),  # noqa: E731
                                    builder.mul(builder.add(c0v, c(b)), c(4)))
    tail = builder.sub(k, builder.mul(n_vec, c(LANES)))
    row_sums = [_lane_sums(builder, [builder.load(acc) for acc in row_accs]) for row_accs in accs]

    def store_whole():  # K a multiple of 16 (attention's head dims): a token's sums in one store
        for a, sums in enumerate(row_sums):
            builder.store(sums, builder.bitcast(simd.byte_ptr(builder, oa.data, cell(a, 0)),
                                                sums.type.as_pointer()), align=4)

    if not ragged:
        store_whole()
        return
    with builder.if_else(builder.icmp_unsigned("==", tail, c(0))) as (whole, leftover):
        with whole:
            store_whole()
        with leftover:
            _leftover(builder, xa, wa, x_rows, w_rows, n_vec, tail, row_sums, cell, oa)


def _leftover(builder, xa, wa, x_rows, w_rows, n_vec, tail, row_sums, cell, oa):
    """emit_tile's K mod 16 leftover products, added one by one to the lane sums, then stored."""
    c = lambda n: ir.Constant(I64, n)  # noqa: E731
    i32 = lambda n: ir.Constant(ir.IntType(32), n)  # noqa: E731
    sums = [[cgutils.alloca_once_value(builder, builder.extract_element(row, i32(b))
                                       if isinstance(row.type, ir.VectorType) else row)
             for b in range(len(w_rows))] for row in row_sums]
    with cgutils.for_range(builder, tail) as loop:
        off = builder.mul(builder.add(builder.mul(n_vec, c(LANES)), loop.index), c(4))
        xs = [simd.load_scalar(builder, xa.data, builder.add(r, off), F32) for r in x_rows]
        ws = [simd.load_scalar(builder, wa.data, builder.add(r, off), F32) for r in w_rows]
        for a, row in enumerate(sums):
            for b, s in enumerate(row):
                builder.store(builder.fadd(builder.load(s), builder.fmul(xs[a], ws[b])), s)
    for a, row in enumerate(sums):
        for b, s in enumerate(row):
            builder.store(builder.load(s), builder.bitcast(
                simd.byte_ptr(builder, oa.data, cell(a, b)), F32.as_pointer()), align=4)


def _lane_sums(builder, vectors):
    """simd.hsum of each vector (the bits the module docstring promises): for a power-of-2
    count, one vector of the sums through simd.hsums, which shares the shuffles (attention's
    score tiles); for one vector, its scalar sum."""
    n = len(vectors)
    if n == 1:
        return simd.hsum(builder, vectors[0])
    if n & (n - 1) or n > LANES:
        raise ValueError(f"a tile of {n} rows: a power of 2 up to {LANES} (or 1)")
    return simd.hsums(builder, vectors)


one = tile(1, 1)
# Rows of one token read side by side (decode): 4 accumulators in flight, one load of x for 4
# rows; each output the same bits as `one`'s. A verify step's few tokens go in pairs: each load
# of w serves both (one pass over the rows; the second token's pass from cache cost its compute
# again, ~30 us of a full-size router on one thread).
ROWS_SIDE_BY_SIDE = 4
four = tile(1, ROWS_SIDE_BY_SIDE)
pair = tile(2, ROWS_SIDE_BY_SIDE)


@kernel(fastmath=False)
def rows_range(x, w, out, first, last):
    """Decode's product out [T, R] = x [T, K] · wᵀ for rows [first, last) (T = 1, or a verify
    step's few tokens), 4 side by side for a token or a pair of tokens, the rest one by one:
    each output `one`'s, whatever the range and the tokens (module docstring)."""
    whole = first + (last - first) // ROWS_SIDE_BY_SIDE * ROWS_SIDE_BY_SIDE
    n_tok = x.shape[0]
    for t in range(0, n_tok - 1, 2):
        for r in range(first, whole, ROWS_SIDE_BY_SIDE):
            pair(x, w, out, t, r, t, r)
    if n_tok % 2:
        for r in range(first, whole, ROWS_SIDE_BY_SIDE):
            four(x, w, out, n_tok - 1, r, n_tok - 1, r)
    for t in range(n_tok):
        for r in range(whole, last):
            one(x, w, out, t, r, t, r)


def rows_share(thread, n_threads, args, counter):
    """A thread's runs of rows of decode's product (jit.omp.fork, chunked: runs claimed while any
    are left, jit.omp.first_run; `rows_range`) for every token of x (a verify step's few:
    ops/residual_rows.py), its rows of w read from memory once. The router's 1 MB a layer read
    by one thread was ~40 MB of a full-size token that 16 threads waited on."""
    x, w, out = args
    n_rows = w.shape[0]
    least = omp.least_units(4 * w.shape[1])
    first, last = omp.first_run(counter, thread, n_threads, n_rows, least, ROWS_SIDE_BY_SIDE)
    while first < last:
        rows_range(x, w, out, first, last)
        first, last = omp.next_run(counter, thread, n_threads, n_rows, least, ROWS_SIDE_BY_SIDE)


def _rows_body(x, w, out):
    fork((x, w, out))


# Decode's product alone (residual_step forks `rows_share` inside its own kernel); no fast-math:
# the share's sums keep their order.
decode_rows = omp.forking_kernel(_rows_body, fastmath=False, chunked=("fork",), fork=rows_share)


def _product_share(thread, n_threads, args):
    """The prefill product's share of a thread (jit.omp.fork): an equal run of the tiles of TOK
    tokens x ROWS rows, token tiles outermost (a thread's run of tiles reuses its tokens from L1
    and w from L2: 1 MB at full size), then an equal run of the edges' tokens, one output at a
    time. `full`, TOK and ROWS are bound per ISA (TILES). A fork, not a prange, so that `bench
    decode --profile` splits its time (16 threads: 53 ms of a 512-token prefill, ~3x one
    thread's, with no split to say why)."""
    x, w, out = args
    n_tok, n_rows = x.shape[0], w.shape[0]
    n_t, n_r = n_tok // TOK, n_rows // ROWS
    n_jobs = n_t * n_r
    for job in range(thread * n_jobs // n_threads, (thread + 1) * n_jobs // n_threads):
        t0, r0 = job // n_r * TOK, job % n_r * ROWS
        full(x, w, out, t0, r0, t0, r0)
    for t in range(thread * n_tok // n_threads, (thread + 1) * n_tok // n_threads):
        for r in range(n_r * ROWS if t < n_t * TOK else 0, n_rows):  # the last tokens' every row
            one(x, w, out, t, r, t, r)


def _product_body(x, w, out):
    fork((x, w, out))


# Tokens x rows per tile: as many 16-float accumulators as the ISA's registers hold beside the
# tile's loads (AVX-512: 20 + 9 of 32 zmm; AVX2: 4 x 2 + 4 x 2 of 16 ymm; SSE: 2 x 4 + 3 x 4 of 16
# xmm). AVX-512, 1 thread, [512, 2048] x [128, 2048] (tiles tried in one run, load 0.5): 4x2
# 4.20 ms, 4x4 3.07-3.37, 3x6 2.89, 4x5 2.73, 5x4 2.66; numpy's OpenBLAS sgemm (FMA) 2.91.
TILES = {Isa.AVX512VNNI: (5, 4), Isa.AVX2: (2, 2), Isa.SSSE3: (2, 1)}
_kernels = {isa: omp.forking_kernel(
    jit_cpu.bind(_product_body, isa.label), fastmath=False,
    fork=jit_cpu.bind(_product_share, isa.label, full=tile(*shape), TOK=shape[0], ROWS=shape[1]))
    for isa, shape in TILES.items()}


def cpu(x, w, out=None, isa: Isa | None = None):
    """out [T, R] = x [T, K] · w [R, K]ᵀ, fp32, C-contiguous; `isa` picks the tile (the process's
    variant by default): the same bits whichever."""
    op = "fp32_rows"
    check_array(op, "x", x, np.float32, ndim=2)
    check_array(op, "w", w, np.float32, (None, x.shape[1]))
    out = output(op, out, (x.shape[0], w.shape[0]), np.float32)
    _kernels[isa or jit_cpu.selected_isa()]()(x, w, out)
    return out
