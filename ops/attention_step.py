"""One decode token of the gated attention mixer between its projections (MODEL.md §5), as one
call: the query/gate split, the per-head q and k RMSNorms, RoPE on both, the new key and value
into the cache, attention over the cache with the sigmoid output gate, and the output quantised
for o_proj.

Every stage is an existing op's kernel (ops.rmsnorm, rope, attention, the activation
quantiser: ops/quantize_rows.py's, matvec.quantize_act's bits), called in the same order, so the result is the ops' one by one, bit for bit
(tests/ops/test_attention_step.py): the stages before attention from one compiled function, then
attention's own compiled kernel and the quantiser's, without argument checks: three dispatches
instead of ~9 checked calls (~120 us of Python an attention layer on the profile of the full-size
model, 1.2 ms a token over its 10 attention layers). Attention is not compiled into the step:
the step's kernel held a second copy of it, ~3 s of a first run's compile.

The cache is fp32 or Q8_0 rows (ops/kv_quant.py): the new key and value are stored quantised by
the step's kernel, then attention reads the codes (one kernel variant per cache type).

Letters: Hq query heads, Hkv kv heads, D head dim, S cache positions, R rotary dims.
"""

from __future__ import annotations

import numpy as np

from fermijit.jit.cpu import kernel
from fermijit.ops import attention, gemm, kv_quant, quantize_rows, rmsnorm, rope
from fermijit.ops.kv_quant import Q8Rows
from fermijit.ops.matvec import Q8Act


def reference(qkv, q_norm, k_norm, eps, position, rotary_dim, theta, cache_k, cache_v):
    """The stages' references in order -> (o [1, Hq, D] gated, new cache_k, new cache_v); the
    inputs are left untouched. qkv [1, Hq·2D + 2·Hkv·D]: per head query | gate, then k, then v;
    cache_k, cache_v [Hkv, S, D] (fp32 or Q8Rows) hold positions < `position`."""
    Hkv, _, D = cache_k.shape
    Hq = (qkv.shape[1] - 2 * Hkv * D) // (2 * D)
    qg = qkv[:, :Hq * 2 * D].reshape(1, Hq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = qkv[:, Hq * 2 * D:Hq * 2 * D + Hkv * D].reshape(1, Hkv, D)
    v = qkv[:, Hq * 2 * D + Hkv * D:].reshape(1, Hkv, D)
    pos = np.array([position], np.int64)
    q = rope.reference(rmsnorm.reference(q, q_norm, eps), pos, rotary_dim, theta)
    k = rope.reference(rmsnorm.reference(k, k_norm, eps), pos, rotary_dim, theta)
    new_k, new_v = cache_k.copy(), cache_v.copy()
    is_q8 = isinstance(cache_k, Q8Rows)
    new_k[:, position] = kv_quant.reference(k[0]) if is_q8 else k[0]
    new_v[:, position] = kv_quant.reference(v[0]) if is_q8 else v[0]
    return attention.reference(q, new_k, new_v, gate, position), new_k, new_v


def _step_body(qkv, q_norm, k_norm, eps, positions, inv_freq, cache_k, cache_v, q, gate):
    _, Hq, D = q.shape
    Hkv = cache_k[0].shape[0]
    start = positions[0]
    for h in range(Hq):
        for d in range(D):
            q[0, h, d] = qkv[0, h * 2 * D + d]
            gate[0, h, d] = qkv[0, h * 2 * D + D + d]
    k = qkv[0, Hq * 2 * D:Hq * 2 * D + Hkv * D].reshape(1, Hkv, D)
    v = qkv[0, Hq * 2 * D + Hkv * D:].reshape(1, Hkv, D)
    q2, k2 = q.reshape(Hq, D), k.reshape(Hkv, D)
    rmsnorm._rmsnorm_serial(q2, q_norm, eps, q2)               # per head, before RoPE
    rmsnorm._rmsnorm_serial(k2, k_norm, eps, k2)
    in_place = Hq > 0  # True, as a run-time bool: a literal True compiled rope a second time
    rope._rope_serial(q, positions, inv_freq, q, in_place)
    rope._rope_serial(k, positions, inv_freq, k, in_place)
    for h in range(Hkv):
        _store_row(cache_k, h, start, k[0, h])
        _store_row(cache_v, h, start, v[0, h])


@kernel
def _store_f32(cache, h, position, row):
    """cache = (rows [Hkv, S, D],): row h, position <- row."""
    for d in range(row.shape[0]):
        cache[0][h, position, d] = row[d]


@kernel(fastmath=False)
def _store_q8(cache, h, position, row):
    """cache = (codes [Hkv, S, D], scales [Hkv, S, nb]): row h, position <- row, quantised."""
    kv_quant.quantize_row(row, cache[0][h, position], cache[1][h, position],
                          np.empty(0, np.int32))


_step_kernels = {False: kernel(_step_body, variant="f32", _store_row=_store_f32),
                 True: kernel(_step_body, variant="q8_0", _store_row=_store_q8)}


def _caches(cache_k, cache_v) -> tuple:
    """(is_q8, k, v): the caches as the step kernel takes them, (codes, scales) or (fp32,)."""
    if isinstance(cache_k, Q8Rows):
        return True, (cache_k.qs, cache_k.d), (cache_v.qs, cache_v.d)
    return False, (cache_k,), (cache_v,)


def _quantize_step(o2, act: Q8Act) -> tuple:
    """(kernel, args) quantising the rows o2 [R, Hq·D] into `act` on the calling thread
    (ops/quantize_rows.py: matvec.quantize_act's bits, ~4x its scalar kernel)."""
    return quantize_rows.rows_serial, (o2, gemm.x_offsets(act.vec.isa, o2.shape[1] // 32),
                                       act.xq, act.dx, act.xsum8)


def cpu(qkv, q_norm, k_norm, eps, positions, rotary_dim, theta, cache_k, cache_v, q, gate, o,
        act: Q8Act) -> Q8Act:
    """`reference` for decode, into preallocated buffers: the token at positions[0] (int64 [1]);
    qkv [1, ...] is overwritten (k's norm and rotation, in place); the cache gets its key and
    value; o [1, Hq, D] and its quantisation `act` (a Q8Act of [1, Hq·D]). q, gate [1, Hq, D]
    are scratch. The caller (model/forward.py's decode) made every buffer once, of the right
    shapes and dtypes: only the kernels' signatures check them."""
    is_q8, ck, cv = _caches(cache_k, cache_v)
    _step_kernels[is_q8](qkv, q_norm, k_norm, float(eps), positions,
                         rope._inv_freq(int(rotary_dim), float(theta)), ck, cv, q, gate)
    attention.attend(q, cache_k, cache_v, gate, int(positions[0]), o)
    quantize, args = _quantize_step(o.reshape(1, -1), act)
    quantize(*args)
    return act


def launch(qkv, q_norm, k_norm, eps, positions, rotary_dim, theta, cache_k, cache_v, q, gate, o,
           act: Q8Act, shared: dict | None = None) -> list:
    """`cpu`'s calls as steps of decode's plan, (label, kernel, args), every argument made once
    (the position read from positions[0] by the kernels, the key ranges' scratch sized for the
    cache: attention.decode_launch): kernels only, so the plan joins them with the projections
    around them into one dispatch (jit/sequence.py). Python and the dispatches of `cpu` were
    ~120 us an attention layer between the kernels (cold caches, this machine). `shared`: the
    plan's attention scratch, one set for its layers (attention.decode_launch)."""
    is_q8, ck, cv = _caches(cache_k, cache_v)
    inv_freq = rope._inv_freq(int(rotary_dim), float(theta))
    return ([("attention_step.cpu", _step_kernels[is_q8],
              (qkv, q_norm, k_norm, float(eps), positions, inv_freq, ck, cv, q, gate))]
            + attention.decode_launch(q, cache_k, cache_v, gate, positions, o, shared=shared)
            + [("matvec.quantize_act", *_quantize_step(o.reshape(1, -1), act))])


def rows_launch(qkv, q_norm, k_norm, eps, positions, rotary_dim, theta, cache_k, cache_v, q,
                gate, o, act: Q8Act, shared: dict | None = None) -> list:
    """`rows` as steps of a verify step's plan (model/batch.py, the MTP head's rows: model/mtp.py),
    as `launch` is decode's: each row's stages before attention (the step kernel on the row's
    views, its position read from positions[r] when called), then one attention launch over the
    R queries at positions[0] (attention.decode_launch: each query's bits a decode step's, its
    scratch made once, `shared` as `launch`'s) and one quantisation of the R rows. Kernels only,
    so the plan joins them with the products around them (jit/sequence.py); `rows` went through
    Python between its kernels and allocated attention's scratch every call."""
    is_q8, ck, cv = _caches(cache_k, cache_v)
    inv_freq = rope._inv_freq(int(rotary_dim), float(theta))
    R = qkv.shape[0]
    return ([("attention_step.cpu", _step_kernels[is_q8],
              (qkv[r:r + 1], q_norm, k_norm, float(eps), positions[r:r + 1], inv_freq, ck, cv,
               q[r:r + 1], gate[r:r + 1])) for r in range(R)]
            + attention.decode_launch(q, cache_k, cache_v, gate, positions, o, shared=shared)
            + [("matvec.quantize_act", *_quantize_step(o.reshape(R, -1), act))])


def rows(qkv, q_norm, k_norm, eps, positions, rotary_dim, theta, cache_k, cache_v, q, gate, o,
         act: Q8Act) -> Q8Act:
    """`cpu` of R consecutive tokens of one sequence (a verify step's rows, model/batch.py):
    qkv [R, ...], positions int64 [R] (consecutive), q, gate, o [R, Hq, D], act a Q8Act of
    [R, Hq·D]. Each row's stages before attention in turn, then one attention pass over the R
    queries (each query's bits are a decode step's: ops/attention.py) and one quantisation:
    one fork for the rows, not one a row. `rows_launch`'s steps, run once."""
    for _, fn, args in rows_launch(qkv, q_norm, k_norm, eps, positions, rotary_dim, theta,
                                   cache_k, cache_v, q, gate, o, act):
        fn(*args)
    return act
