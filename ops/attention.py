"""Causal GQA attention with the sigmoid output gate, MODEL.md §5 steps 5-6.

    o[t, h] = softmax_s(q[t, h] . k[h // G, s] / sqrt(D)) v[h // G, s]  over s <= start + t,
    then o *= sigmoid(gate).
One function serves prefill (T queries) and decode (T = 1): the queries are positions
start..start+T-1 and the KV cache holds positions 0..S-1 with S >= start + T.

The cache is fp32 or Q8_0 rows (ops/kv_quant.py; Q8_0 the default). With Q8_0 the
query is rounded to Q8_0 the same way and each score is integer dot products of the codes, block
by block (pmaddubsw on SSSE3 and AVX2, vpdpbusd on AVX-512 VNNI), times the two blocks' scales;
the values are converted from int8 and scaled in fp32 as they are accumulated.

Letters: T queries, Hq query heads, Hkv kv heads, G = Hq/Hkv queries per kv head, D head dim,
S cache length (the cache may be longer than the keys used), L = start + T keys used,
nb = D/32 blocks of a Q8_0 row.
"""

from __future__ import annotations

import numpy as np
import numba

from fermijit import FermijitError
from fermijit.jit.checks import check_array, output
from fermijit.jit import cpu as jit_cpu
from fermijit.jit import mathf, omp
from fermijit.jit.cpu import Isa, bind, kernel
from fermijit.ops import fp32_rows, kv_quant, quantize_rows
from fermijit.ops.attention_simd import (BLOCK_KEYS, SCORE_KEYS, dequantized_rows, exp_row,
                                         group_scores, make_q8_scores, make_q8_scores_by_key,
                                         merged_row, row_max, signed_transposed_keys,
                                         transposed_keys, weighted_q8_rows, weighted_rows,
                                         zeroed_rows)
from fermijit.ops.fp32_rows import LANES
from fermijit.ops.kv_quant import Q8Rows


def reference(q, k, v, gate, start):
    """q, gate [T, Hq, D]; k, v [Hkv, S, D] fp32, or both Q8Rows (then q is rounded to Q8_0
    first, and the arithmetic is float64); start >= 0 -> o [T, Hq, D], fp32 or wider."""
    if isinstance(k, Q8Rows):
        q = kv_quant.reference(q).dequantize(np.float64)
        k, v = k.dequantize(np.float64), v.dequantize(np.float64)
    dt = np.result_type(q, k, v, gate, np.float32)
    T, Hq, D = q.shape
    L = start + T
    kv_head = np.arange(Hq) // (Hq // k.shape[0])                     # query head h -> h // G
    keys = np.asarray(k, dtype=dt)[kv_head, :L]                       # [Hq, L, D]
    values = np.asarray(v, dtype=dt)[kv_head, :L]
    scores = np.einsum("thd,hsd->ths", np.asarray(q, dtype=dt), keys) / np.sqrt(D)  # [T, Hq, L]
    causal = np.arange(L)[None, :] <= start + np.arange(T)[:, None]   # [T, L]
    scores = np.where(causal[:, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    o = np.einsum("ths,hsd->thd", p, values)
    return o * np.exp(-np.logaddexp(0, -np.asarray(gate, dtype=dt)))  # sigmoid(gate)


# --- CPU ----------------------------------------------------------------------------------------

# Keys per online-softmax step: the [G, BLOCK] scores of one step stay in L1.
BLOCK = BLOCK_KEYS  # 64
# A query's keys are cut at multiples of RANGE_KEYS; each range's partial attention (the online
# softmax over its blocks) is computed alone, and the partials are merged in range order by
# `_merge_row`, one fixed way. So a query's output has the same bits in a pass of any length and
# in a decode step (a prompt split into passes, a prefix-cache resume), and decode can give a
# head's ranges to different threads (flash-decoding: with Hkv = 2 there are too few heads to
# occupy the cores otherwise). A range is also decode's unit of work over the threads: at 16k
# keys 16 threads take 8 ranges each, and the op's threads idled 12 % of it on the GPU machine's
# host (session 31: a thread that ran slower leaves the others a whole range to wait out). 128
# keys cost 1.3-2.6 % more a key-head here and on that host at 1 thread (the partials' merging;
# tests/longctx_attention_ranges.py), 64 keys 4 %; at 16 threads on that host (session 33, 16k
# keys) 128 keys took 5.83 ms a token, 512 keys 5.21, 256 keys 5.02.
RANGE_KEYS = 256
# Calls with fewer (query, kv head) pairs than this (decode, short passes) make every range an
# item of its own over the threads and merge afterwards; others take tiles of queries, whose
# ranges they compute in turn, merging as they go. Either way the same bits, whatever the thread
# count (issue 9 item 7).
SPLIT_ITEMS = 16
# Queries a prefill item takes together (issue 31 item 5): each block of keys, and its values
# made fp32 once, is read from L1 by all of them, not from memory by each; their running and
# range partials ([2, TILE, G, D] fp32, 256 KiB at full size) stay in L2. Fewer where the pass
# has too few tiles for ITEMS_PER_THREAD each.
TILE_QUERIES = 16
ITEMS_PER_THREAD = 4


@kernel
def n_ranges(n_keys):
    """Key ranges of a query that attends to n_keys keys."""
    return max(1, (n_keys + RANGE_KEYS - 1) // RANGE_KEYS)


@kernel
def _scores_f32(q, k, t, hkv, jb, n, p):
    """p[g, j] = q[t, hkv·G + g] · k[hkv, jb + j] for j < n: every head of the group against 4
    keys a tile (in L1) before the next ones; other head dims one score at a time. The fp32
    cache: k = (k,)."""
    G, D = p.shape[0], q.shape[2]
    h0 = hkv * G
    q_t, k_h = q[t], k[0][hkv]                                        # [Hq, D], [S, D]
    j = 0
    while j + SCORE_KEYS <= n and D % LANES == 0:
        group_scores(q_t, k_h, p, h0, G, jb + j, j)
        j += SCORE_KEYS
    for j in range(j, n):
        for g in range(G):
            fp32_rows.one(q_t, k_h, p, h0 + g, jb + j, g, j)


def _scores_q8_by_key(q, k, t, hkv, jb, n, p):
    """_scores_q8 from the block's keys transposed (_keys_transposed: k = (codes, scales,
    magnitudes) laid out for attention_simd.make_q8_scores_by_key's `q8_scores_by_key`, bound
    per ISA): 16 keys a register with AVX-512 VNNI, 8 on AVX2, no horizontal sums (4-5x fewer
    instructions than a key at a time with VNNI)."""
    G = p.shape[0]
    q8_scores_by_key(q[0][t], q[1][t], q[2][t], k[0], k[1], k[2], p, hkv * G, G)


@kernel
def _keys_as_stored(k, hkv, jb, n, buffers):
    """The keys scores read: the cache itself."""
    return k


def _keys_transposed(k, hkv, jb, n, buffers):
    """Keys jb..jb+n-1 of kv head hkv transposed into buffers (attention_simd's
    make_transposed_keys: `transposed_keys` bound per ISA), once for every query of a tile."""
    transposed_keys(k[0][hkv], k[1][hkv], buffers[0], buffers[1], buffers[2], jb, n)
    return buffers


def _scores_q8(q, k, t, hkv, jb, n, p):
    """_scores_f32 over a Q8_0 cache, k = (codes [Hkv, S, D] int8, scales [Hkv, S, nb]), for
    the query rounded to Q8_0: q = (codes [T, Hq, D], scales [T, Hq, nb], 128 · the codes' sum
    per block [T, Hq, nb]). `q8_scores` is bound per ISA (attention_simd.make_q8_scores)."""
    G = p.shape[0]
    qq, qd, qc = q[0][t], q[1][t], q[2][t]
    kq, kd = k[0][hkv], k[1][hkv]
    for j in range(n):
        q8_scores(qq, qd, qc, kq, kd, p, hkv * G, G, jb + j, j)


@kernel
def _staged_f32(v, hkv, jb, n, rows, tile):
    """(value rows, first row) of keys jb..jb+n-1: the fp32 cache's own."""
    return v[0][hkv], jb


@kernel
def _weighted_f32(p, v, v_rows, v0, hkv, jb, n, a, tile):
    """a += p · the value rows."""
    weighted_rows(p, v_rows, a, v0, n)


# Whether one query (decode) reads a Q8_0 cache's values as stored, made fp32 in registers
# (weighted_q8_rows), rather than staged: the same bits. Bound per ISA in _kernel. Full-size
# decode shapes (Hq 16, Hkv 2, D 256), the values' part of a key visit timed alone, 1 thread,
# this machine: AVX-512 43 ns vs 79 staged (the 64 KB of staged rows went through L2); AVX2 code
# (haswell target) 86 vs 118; SSE (westmere: 16 registers, no FMA) 219 vs 194, so staged there.
VALUES_IN_REGISTERS = True


def _staged_q8(v, hkv, jb, n, rows, tile):
    """(value rows, first row) of keys jb..jb+n-1 of a Q8_0 cache for a tile of queries: codes
    times scales, fp32 (the reference's values), into rows [BLOCK, D], once for every query that
    reads them. Nothing for one query where VALUES_IN_REGISTERS (_weighted_q8)."""
    if tile > 1 or not VALUES_IN_REGISTERS:
        dequantized_rows(v[0][hkv], v[1][hkv], rows, jb, n)
    return rows, 0


def _weighted_q8(p, v, v_rows, v0, hkv, jb, n, a, tile):
    """a += p · the values: from the staged rows, or for one query where VALUES_IN_REGISTERS
    from the codes (weighted_q8_rows: the same bits)."""
    if tile == 1 and VALUES_IN_REGISTERS:
        weighted_q8_rows(p, v[0][hkv], v[1][hkv], a, jb, n)
    else:
        weighted_rows(p, v_rows, a, v0, n)


@kernel
def _online_softmax(p, n, a, m_t, l_t):
    """The scores p[:, :n] of a block of keys (times 1/sqrt(D)) -> their weights e^(s - m), the
    running maxima m_t, sums l_t and accumulated rows a rescaled to the new maxima."""
    G, D = a.shape
    scale = np.float32(1 / np.sqrt(D))
    for g in range(G):
        for j in range(n):
            p[g, j] *= scale
    for g in range(G):
        m_old = m_t[g]
        m_new = row_max(p, g, n, m_old)
        rescale = np.exp(m_old - m_new)
        l_t[g] = l_t[g] * rescale + exp_row(p, g, n, m_new)
        m_t[g] = m_new
        if rescale != 1 and m_old != -np.inf:  # a range's first block: a is zeros, left so
            for d in range(D):
                a[g, d] *= rescale


def _tile_range(q, k, v, t0, t1, hkv, start, r, a, m, l, p, rows, key_buffers):
    """Key range r of queries t0..t1-1 of kv head hkv (query t0 + i at row i of a [., G, D],
    m, l [., G]: unnormalised Σ_s e^(score - m) v_s, the maximum and Σ e^(score - m) of its G
    heads over the range; an empty range leaves m = -inf, l = 0, a = 0). Block by block of keys,
    each block's values staged once (rows: scratch [BLOCK, D]); every query takes each of its
    blocks through the same three steps, so it has the same bits alone (decode: t1 = t0 + 1) as
    in any tile (one query's values, read by a path of its own, have the tile's bits). `_scores`,
    `_staged`, `_staged_keys` (key_buffers: its scratch) and `_weighted` are bound per cache type
    and ISA."""
    r0 = r * RANGE_KEYS
    r1 = min(r0 + RANGE_KEYS, start + t1)                  # the tile's last query's keys
    zeroed_rows(a, t1 - t0)
    for i in range(t1 - t0):
        m[i] = -np.inf
        l[i] = 0
    tile = t1 - t0
    for jb in range(r0, r1, BLOCK):
        v_rows, v0 = _staged(v, hkv, jb, min(BLOCK, r1 - jb), rows, tile)
        keys = _staged_keys(k, hkv, jb, min(BLOCK, r1 - jb), key_buffers)
        for i in range(tile):
            j1 = min(start + t0 + i + 1, r1)              # query t0 + i's last key + 1
            if j1 > jb:
                n = min(BLOCK, j1 - jb)
                _scores(q, keys, t0 + i, hkv, jb, n, p)
                _online_softmax(p, n, a[i], m[i], l[i])
                _weighted(p, v, v_rows, v0, hkv, jb, n, a[i], tile)


@kernel(fastmath=False)
def _merge_row(a, m, l, a_r, m_r, l_r):
    """A head's running partial (a [D], m, l) and the next range's (a_r, m_r, l_r), both scaled
    to their common maximum and added: a in place, returns (m, l). No fast-math: the same bits
    from every caller (decode merges after the ranges, prefill as they come)."""
    m_new = max(m, m_r)
    c, c_r = np.exp(m - m_new), np.exp(m_r - m_new)
    merged_row(a, a_r, c, c_r)
    return m_new, c * l + c_r * l_r


@kernel(fastmath=False)
def _finish_row(a, l, gate_row, o_row):
    """o_row = a / l · sigmoid(gate_row); a may be o_row itself (one key range: decode below
    RANGE_KEYS positions), then in a loop of its own: the vectoriser's overlap check sent the
    shared loop to its scalar path, sigmoid's exp a lane at a time (a query's 16 full-size heads
    14 us against 1.3; most of a token's attention at short contexts). The same operations."""
    w = np.float32(1) / l
    if a.ctypes.data == o_row.ctypes.data:
        for d in range(o_row.shape[0]):
            o_row[d] = w * o_row[d] * mathf.sigmoid(gate_row[d])
    else:
        for d in range(o_row.shape[0]):
            o_row[d] = w * a[d] * mathf.sigmoid(gate_row[d])


@kernel
def _query(item, T, Hkv, per):
    """The query (or tile) and kv head of an item: kv heads outermost, so a thread's run of
    items reads one head's keys and values (at full size 1 MB for 512 keys: L2), not both in
    turn; queries in pairs (t, T-1-t), so every contiguous run of items has the same causal work
    (each thread takes a contiguous run). `per` items a (query, kv head) pair (its ranges)."""
    hkv = (item // per) % Hkv
    rank = item // (per * Hkv)
    return (rank // 2 if rank % 2 == 0 else T - 1 - rank // 2), hkv


@kernel
def _n_items(R, T, Hkv, tile):
    """attend_share's items: (tile of `tile` queries, kv head, key range) triples with R
    ranges, else (tile, kv head) pairs."""
    return max(R, 1) * ((T + tile - 1) // tile) * Hkv


def attend_share(thread, n_threads, args, counter):
    """A thread's runs of items (jit.omp.fork, first_run / next_run: an equal static run of the
    first half, then runs claimed while any are left, so threads that run faster take more; each
    item's arithmetic whichever thread takes it). With ranges in acc [R, T, Hq, D]
    (R > 0; m, l [R, T, Hq]): the items are (tile of `tile` queries, kv head, key range)
    triples (a query a tile for a short pass, all of a verify step's rows: _decode_body), range
    r of each pair into acc[r] (none where the query has fewer keys), merged later
    (combine_head). With
    R = 0: the items are (tile of `tile` queries, kv head) pairs, each its ranges in turn, the
    first into a running partial and each next merged into it, then o. One call site of
    `_tile_range` either way, so the same code and bits (and one compile). A fork, not a prange:
    called from inside another compiled function (attention_step), a prange launch cost several
    times the work on 2 threads, and the parfors took 5 s of a first compile."""
    q, k, v, start, tile, acc, m, l, gate, o = args
    T, Hq, D = o.shape
    Hkv = k[0].shape[0]
    G = Hq // Hkv
    per_range = acc.shape[0] > 0
    width = tile
    run_a = np.empty((2, width, G, D), dtype=np.float32)          # running | range partials
    run_m = np.empty((2, width, G), dtype=np.float32)
    run_l = np.empty((2, width, G), dtype=np.float32)
    p = np.empty((G, BLOCK), dtype=np.float32)
    rows = np.empty((BLOCK, D), dtype=np.float32)
    # _keys_transposed's, every lane written before it is read: the codes' 32 KB not zeroed
    # every call (the scales are, for tests/longctx_attention_stages.py's arm that never
    # writes them: no stray subnormals)
    key_buffers = (np.empty((D // 32, 8, BLOCK), dtype=np.int32),
                   np.zeros((D // 32, BLOCK), dtype=np.float32),
                   np.empty((D // 32, 8, BLOCK), dtype=np.int32))
    n_tiles = (T + width - 1) // width
    per = acc.shape[0] if per_range else 1
    n_items = _n_items(acc.shape[0], T, Hkv, tile)
    run_first, run_last = omp.first_run(counter, thread, n_threads, n_items, 1, 1)
    while run_first < run_last:
        for item in range(run_first, run_last):
            first, hkv = _query(item, n_tiles, Hkv, per)
            t0 = first * width
            t1 = min(t0 + width, T)
            h0 = hkv * G
            r_lo, r_hi = (item % per, item % per + 1) if per_range else (0, n_ranges(start + t1))
            for r in range(r_lo, min(r_hi, n_ranges(start + t1))):
                # A range's maxima and sums in this thread's own rows while its blocks update
                # them, then stored once: the item of the other kv head over the same range
                # (taken at the same time, by another thread) has its rows in the same line.
                s = 1 if per_range else min(r, 1)
                da = acc[r, t0:t1, h0:h0 + G] if per_range else run_a[s, 0:t1 - t0, 0:G]
                dm, dl = run_m[s, 0:t1 - t0, 0:G], run_l[s, 0:t1 - t0, 0:G]
                _tile_range(q, k, v, t0, t1, hkv, start, r, da, dm, dl, p, rows, key_buffers)
                if per_range:
                    m[r, t0:t1, h0:h0 + G] = dm
                    l[r, t0:t1, h0:h0 + G] = dl
                for i in range(t1 - t0 if not per_range and r > 0 else 0):
                    if start + t0 + i + 1 > r * RANGE_KEYS:            # the query has keys in r
                        for g in range(G):
                            run_m[0, i, g], run_l[0, i, g] = _merge_row(
                                run_a[0, i, g], run_m[0, i, g], run_l[0, i, g], run_a[1, i, g],
                                run_m[1, i, g], run_l[1, i, g])
            for i in range(t1 - t0 if not per_range else 0):
                for g in range(G):
                    _finish_row(run_a[0, i, g], run_l[0, i, g], gate[t0 + i, h0 + g],
                                o[t0 + i, h0 + g])
        run_first, run_last = omp.next_run(counter, thread, n_threads, n_items, 1, 1)


@kernel
def combine_head(acc, m, l, start, gate, o, th):
    """o[t, h] for th = t·Hq + h from attend_share's ranges (the query's own: n_ranges of its
    keys), merged in range order into acc[0]. acc may be o itself, as [1, T, Hq, D] (one
    range)."""
    Hq = o.shape[1]
    t, h = th // Hq, th % Hq
    # The running maximum and sum in registers: m[0, t] and l[0, t] hold every head's in one
    # line, which a store a range by each of the merge's threads bounced between their cores.
    # On the GPU machine's host the merge of 16k keys took 0.75-0.9 ms of a token's 5.2-5.4 at
    # 16 threads, as much as at one; this sharing the likely cause (session 33, not measured
    # there since; here the merge alone on 2 threads 30-46 us against 36-90 as it was).
    m_t, l_t = m[0, t, h], l[0, t, h]
    for s in range(1, n_ranges(start + t + 1)):
        m_t, l_t = _merge_row(acc[0, t, h], m_t, l_t, acc[s, t, h], m[s, t, h], l[s, t, h])
    _finish_row(acc[0, t, h], l_t, gate[t, h], o[t, h])


def _combine_share(thread, n_threads, args):
    acc, m, l, start, gate, o = args
    n = o.shape[0] * o.shape[1]
    for th in range(thread * n // n_threads, (thread + 1) * n // n_threads):
        combine_head(acc, m, l, start, gate, o, th)


# Floats of range partials a thread of the merge takes at least: decode's merge at 64 positions
# (one range, 16 heads: 4k floats) is no work for 16 threads to be woken for; at 16k (64 ranges)
# all 16 threads take a head each.
MERGE_FLOATS = 16384


def _attention_body(q, k, v, start, tile, acc, m, l, gate, o):
    """The items over the threads (one fork, no more threads than items: decode at a few
    hundred positions has 2-4); with key ranges in acc, every (query, head) merged after them
    (another, threads by the floats to merge). The team's size never changes the bits."""
    T, Hq, D = o.shape
    Hkv = k[0].shape[0]
    R = acc.shape[0]
    fork(_n_items(R, T, Hkv, tile), (q, k, v, start, tile, acc, m, l, gate, o))
    if R > 0:
        fork_combine(R * T * Hq * D // MERGE_FLOATS, (acc, m, l, start, gate, o))


def _decode_body(q, k, v, positions, acc_all, m_all, l_all, gate, o):
    """`_attention_body` of the T queries at positions[0], ... (their cache start): the key
    ranges' scratch the first R of acc_all, m_all, l_all (R from the position, as `attend`
    chooses it; o itself where R = 1), the tile `tile_queries`'. For decode's plan, whose
    arguments are made once and stay the same every token (jit/sequence.py joins it)."""
    T, Hq, D = o.shape
    Hkv = k[0].shape[0]
    start = positions[0]
    R = 0 if T * Hkv >= SPLIT_ITEMS else n_ranges(start + T)
    acc = o.reshape(1, T, Hq, D) if R == 1 else acc_all[:R]
    m, l = m_all[:R], l_all[:R]
    # With key ranges (a verify step's few rows): a query an item while the team can run them
    # side by side (the rows' attention in a token's time on 16 threads); where the items
    # outnumber the threads, all T queries an item, each block of keys read once for the rows
    # (2 rows at 41 keys, 2 threads: 1.21 vs 1.23x a token's attention, 1.53 vs 1.56x at 4000;
    # an item of 2 queries takes ~1.8x a query's work, so never where threads would idle).
    if R > 0:
        tile = T if R * T * Hkv > omp.team_size() else 1
    else:
        tile = max(1, min(TILE_QUERIES, T * Hkv // (ITEMS_PER_THREAD * omp.team_size())))
    fork(_n_items(R, T, Hkv, tile), (q, k, v, start, tile, acc, m, l, gate, o))
    if R > 0:
        fork_combine(R * T * Hq * D // MERGE_FLOATS, (acc, m, l, start, gate, o))


_kernels: dict = {}


def q8_score_kernels(isa: Isa, label: str) -> tuple:
    """(scores, the keys they read) of a Q8_0 cache for `isa`, compiled under `label`: by keys in
    the lanes from each block's keys transposed once for a tile's queries (AVX-512 VNNI, AVX2),
    else a key row at a time (SSSE3: its 16 registers and no FMA)."""
    if isa is Isa.SSSE3:
        return kernel(_scores_q8, variant=label, q8_scores=make_q8_scores(isa)), _keys_as_stored
    keys = signed_transposed_keys if isa is Isa.AVX2 else transposed_keys
    return (kernel(_scores_q8_by_key, variant=label, q8_scores_by_key=make_q8_scores_by_key(isa)),
            kernel(_keys_transposed, variant=label, transposed_keys=keys))


def _kernel(isa: Isa | None, decode: bool = False):
    """The fp32 cache's kernel (isa None), or the Q8_0 cache's for `isa`: attend_share over
    _tile_range with the cache type's scores and value staging; `decode`: `_decode_body`'s."""
    if (isa, decode) not in _kernels:
        keys = _keys_as_stored
        if isa is None:
            label, scores, staged, weighted = "f32", _scores_f32, _staged_f32, _weighted_f32
        else:
            label = f"q8_{isa.label}"
            staged, weighted = (kernel(f, variant=label, VALUES_IN_REGISTERS=isa is not Isa.SSSE3)
                                for f in (_staged_q8, _weighted_q8))
            scores, keys = q8_score_kernels(isa, label)
        tile_range = kernel(_tile_range, variant=label, _scores=scores, _staged=staged,
                            _staged_keys=keys, _weighted=weighted)
        body = _attention_body
        if decode:
            body, label = _decode_body, label + "-decode"
        _kernels[isa, decode] = omp.forking_kernel(
            bind(body, label), fork=bind(attend_share, label, _tile_range=tile_range),
            fork_combine=_combine_share, capped=("fork", "fork_combine"), chunked=("fork",))
    return _kernels[isa, decode]()


def decode_launch(q, k, v, gate, positions, o, isa: Isa | None = None,
                  shared: dict | None = None) -> list:
    """`attend` of o's T queries at positions[0] (int64 [1]; read when called) as steps of decode's
    plan, (label, kernel, args), their scratch made once for the cache's S positions: the
    queries rounded (a Q8_0 cache), then attention. `shared`: scratch by shape, for a plan's
    layers, which run one after another and write it before they read it (one set, not one a
    layer: 16 MB of key ranges' partials a layer at the full context). The buffers' shapes are
    the caller's (decode's workspace): unchecked."""
    T, Hq, D = o.shape
    R = n_ranges(k.shape[1])
    nb = D // kv_quant.BLOCK
    f32 = np.float32

    def made(key, make):
        if shared is None:
            return make()
        if key not in shared:
            shared[key] = make()
        return shared[key]

    scratch = made(("ranges", R, T, Hq, D), lambda: (
        np.empty((R, T, Hq, D), f32), np.empty((R, T, Hq), f32), np.empty((R, T, Hq), f32)))
    if not isinstance(k, Q8Rows):
        return [("attention.decode", _kernel(None, True),
                 (q, (k,), (v,), positions, *scratch, gate, o))]
    rounded = made(("rounded", T, Hq, D), lambda: (
        np.empty((T, Hq, D), np.int8), np.empty((T, Hq, nb), f32), np.empty((T, Hq, nb), np.int32)))
    return [("attention.quantize_queries", _quantize_queries_one, (q, *rounded, 0, T)),
            ("attention.decode", _kernel(isa or jit_cpu.selected_isa(), True),
             (rounded, (k.qs, k.d), (v.qs, v.d), positions, *scratch, gate, o))]


def _quantize_query_rows(q, qq, qd, qc, first, last):
    """q [T, Hq, D] (C-contiguous) -> its Q8_0 codes, scales and 128 · the codes' sum per block
    (the keys' rounding, ops/kv_quant.py: the same operations), tokens [first, last). Through
    ops/quantize_rows.py's vector blocks: kv_quant's per-element loops stayed scalar here (a
    full-size token's 16 heads 5.3 us a layer on one thread)."""
    for t in range(first, last):
        x, codes, scales, sums = q[t], qq[t], qd[t], qc[t]
        for h in range(x.shape[0]):
            for b in range(scales.shape[1]):
                scales[h, b] = quantize_rows._block_amax(x, h, b) / np.float32(127.0)
            for b in range(scales.shape[1]):
                db = scales[h, b]
                inv = np.float32(1.0) / db if db != 0 else np.float32(0.0)
                quantize_rows._block_round(x, h, b, codes, b * 32, b * 32 + 16, inv, sums)
                sums[h, b] *= 16  # 8 · Σ codes -> 128 · Σ


def _quantize_queries_body(q, qq, qd, qc):
    fork((q, qq, qd, qc))


_quantize_queries_one = kernel(_quantize_query_rows, fastmath=False)
# A prefill pass's queries over the threads: 512 tokens' 8,192 rows were ~8 ms an attention layer
# on one thread (full-size heads), most of a 16-thread prefill's serial time in attention.
_quantize_queries_threads = omp.forking_kernel(
    _quantize_queries_body, fastmath=False,
    fork=omp.rows_share(_quantize_queries_one, "quantize-queries"))


def _quantize_queries(q, qq, qd, qc) -> None:
    if q.shape[0] >= omp.ROWS_MIN:
        _quantize_queries_threads()(q, qq, qd, qc)
    else:
        _quantize_queries_one(q, qq, qd, qc, 0, q.shape[0])


def _check_cache(op: str, k, v, D: int) -> tuple[int, int]:
    """(Hkv, S) of the caches k, v: fp32 [Hkv, S, D], or Q8Rows of that shape."""
    if not isinstance(k, Q8Rows):
        Hkv, S = check_array(op, "k", k, np.float32, (None, None, D)).shape[:2]
        check_array(op, "v", v, np.float32, (Hkv, S, D))
        return Hkv, S
    if not isinstance(v, Q8Rows):
        raise FermijitError(f"{op}: k is Q8_0 rows, v is not")
    if D % kv_quant.BLOCK:
        raise FermijitError(f"{op}: a Q8_0 cache needs a head dim of whole "
                            f"{kv_quant.BLOCK}-blocks, got {D}")
    Hkv, S = check_array(op, "k codes", k.qs, np.int8, (None, None, D)).shape[:2]
    for name, rows in (("k", k), ("v", v)):
        check_array(op, f"{name} codes", rows.qs, np.int8, (Hkv, S, D))
        check_array(op, f"{name} scales", rows.d, np.float32, (Hkv, S, D // kv_quant.BLOCK))
    return Hkv, S


def cpu(q, k, v, gate, start, out=None, isa: Isa | None = None):
    """`reference`, fp32 out. Allocates only scratch: per-head maxima and sums, the [G, BLOCK]
    scores, the partial outputs of key ranges ([R, T, Hq, D] for short passes, a tile's for
    others) and, for a Q8_0 cache, the rounded queries and a block of values. `isa`: the Q8_0
    kernel's variant (the process's by default); the fp32 kernel has one."""
    op = "attention"
    T, Hq, D = check_array(op, "q", q, np.float32, ndim=3).shape
    Hkv, S = _check_cache(op, k, v, D)
    check_array(op, "gate", gate, np.float32, (T, Hq, D))
    if Hkv == 0 or Hq % Hkv:
        raise FermijitError(f"{op}: {Hq} query heads is not a multiple of {Hkv} kv heads")
    if not isinstance(start, (int, np.integer)) or start < 0 or start + T > S:
        raise FermijitError(f"{op}: start {start!r} with {T} queries needs a cache of "
                            f"start + T positions, have {S}")
    o = output(op, out, (T, Hq, D))
    attend(q, k, v, gate, int(start), o, isa)
    return o


def tile_queries(n_queries: int, n_kv_heads: int) -> int:
    """Queries a prefill item takes: TILE_QUERIES, fewer where that leaves a thread fewer than
    ITEMS_PER_THREAD items (the bits are the same for any)."""
    n_items = n_queries * n_kv_heads // (ITEMS_PER_THREAD * numba.get_num_threads())
    return max(1, min(TILE_QUERIES, n_items))


def attend(q, k, v, gate, start: int, o, isa: Isa | None = None) -> None:
    """`cpu` into o without its checks, for callers whose buffers were made right once (decode's
    ops/attention_step.py). The one compiled kernel of prefill and decode (per cache type): a
    second kernel holding the same attention code took ~3 s more of a first run's
    compile."""
    T, Hq, D = o.shape
    Hkv = k.shape[0]
    R = 0 if T * Hkv >= SPLIT_ITEMS else n_ranges(start + T)
    if R == 1:
        acc = o.reshape(1, T, Hq, D)                                  # accumulate in place
    else:
        acc = np.empty((R, T, Hq, D), dtype=np.float32)
    m = np.empty((R, T, Hq), dtype=np.float32)
    l = np.empty((R, T, Hq), dtype=np.float32)
    tile = 1 if R > 0 else tile_queries(T, Hkv)  # a short pass's ranges: a query an item
    if not isinstance(k, Q8Rows):
        _kernel(None)(q, (k,), (v,), start, tile, acc, m, l, gate, o)
        return
    nb = D // kv_quant.BLOCK
    rounded = (np.empty((T, Hq, D), np.int8), np.empty((T, Hq, nb), np.float32),
               np.empty((T, Hq, nb), np.int32))
    _quantize_queries(q, *rounded)
    _kernel(isa or jit_cpu.selected_isa())(rounded, (k.qs, k.d), (v.qs, v.d), start, tile, acc,
                                           m, l, gate, o)


# --- GPU ---------------------------------------------------------------------------------------
# kernels_ptx/attention.ptx: a block per 16 queries of one head, 16-key tiles (the GPU prefill's).
# kernels_ptx/flash_attention.ptx (issue 31 item 4, `flash_gpu`): 32 rows of GQA heads x queries a
# block sharing each 64-key tile, register tiles for QK (4 x 4 scores a thread over half of each
# 64-dim chunk) and PV (HEAD_DIM / 32 rows x 4 dims, P^T and V by 128-bit loads), blocks longest
# first; written for long prompts, to be measured on a GPU before the prefill takes it. Its
# arrays must be 16-byte aligned (device allocations are; views start at whole rows).

GPU_HEAD_DIMS = (32, 64, 128, 256)   # the D attention.ptx is rendered for
FLASH_HEAD_DIMS = (64, 128, 256)     # flash_attention.ptx's
FLASH_ROWS = 32                      # rows (query heads x positions) a flash block


def _gpu_args(op, q, k, v, gate, start, out, head_dims):
    """The checked shapes (T, Hq, Hkv, S, D), the device output and on_device."""
    from fermijit.jit import gpu as g

    on_device = g.is_device(q) or g.is_device(out)
    T, Hq, D = g.check_array(op, "q", q, np.float32, ndim=3).shape
    Hkv, S = g.check_array(op, "k", k, np.float32, (None, None, D)).shape[:2]
    g.check_array(op, "v", v, np.float32, (Hkv, S, D))
    g.check_array(op, "gate", gate, np.float32, (T, Hq, D))
    if Hkv == 0 or Hq % Hkv:
        raise FermijitError(f"{op}: {Hq} query heads is not a multiple of {Hkv} kv heads")
    if D not in head_dims:
        raise FermijitError(f"{op}: the GPU kernel takes head dims {head_dims}, got {D}")
    if not isinstance(start, (int, np.integer)) or start < 0 or start + T > S:
        raise FermijitError(f"{op}: start {start!r} with {T} queries needs a cache of "
                            f"start + T positions, have {S}")
    return (T, Hq, Hkv, S, D), g.output(op, out, (T, Hq, D)), on_device


def gpu(q, k, v, gate, start, out=None):
    """As `cpu` over an fp32 cache; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    op = "attention"
    (T, Hq, Hkv, S, D), o, on_device = _gpu_args(op, q, k, v, gate, start, out, GPU_HEAD_DIMS)
    if T and Hq:
        g.kernel("attention", HEAD_DIM=D)(
            (-(-T // 16), Hq), (256,), *(g.to_device(op, name, a, np.float32) for name, a in
                                         (("q", q), ("k", k), ("v", v), ("gate", gate))),
            o, T, Hq, Hkv, S, int(start), float(1 / np.sqrt(D)))
    return g.result(op, o, out, on_device)


def flash_gpu(q, k, v, gate, start, out=None):
    """As `gpu`, by flash_attention.ptx: a block takes the largest power of 2 of a kv head's G
    query heads (at most FLASH_ROWS) and FLASH_ROWS / that many queries."""
    from fermijit.jit import gpu as g

    op = "attention"
    (T, Hq, Hkv, S, D), o, on_device = _gpu_args(op, q, k, v, gate, start, out, FLASH_HEAD_DIMS)
    G = Hq // Hkv
    group_heads = next(h for h in (32, 16, 8, 4, 2, 1) if G % h == 0)
    positions = FLASH_ROWS // group_heads
    if T and Hq:
        g.kernel("flash_attention", HEAD_DIM=D)(
            (-(-T // positions), Hkv * (G // group_heads)), (256,),
            *(g.to_device(op, name, a, np.float32) for name, a in
              (("q", q), ("k", k), ("v", v), ("gate", gate))),
            o, T, Hq, Hkv, S, int(start), float(1 / np.sqrt(D)), group_heads)
    return g.result(op, o, out, on_device)
