"""Gated DeltaNet: gates and the recurrence (cpu) against the numpy reference, the chunked UT/WY
form against the recurrence, and both references against transformers' torch implementations."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.jit import cpu as cpu_isa
from fermijit.jit import omp
from fermijit.ops import gated_delta
from tests import hf as tests_hf
from tests.numerics import assert_close, poisoned

# fp32 kernel vs float64 reference. The state is a sum of bounded terms (|k| = 1, beta < 1,
# alpha < 1) of size ~|v|, so rounding stays near fp32 epsilon: measured max abs error 1.7e-7 on
# |state| <= 2 and 6e-8 on |o| <= 0.4 (T up to 150, dk = dv = 128); 10x margin.
STATE_ATOL, STATE_RTOL = 1e-6, 1e-5
OUT_ATOL, OUT_RTOL = 1e-6, 1e-5
# Gates are one exp/log1p each in fp32: a few ulp.
GATES_ATOL, GATES_RTOL = 1e-6, 1e-5
# Chunked vs recurrent: the same sums in another order plus a 64x64 triangular solve. Measured
# relative error: 6e-16 in float64 (so the two forms are algebraically equal), 1.2e-6 in fp32.
CHUNK_F64_TOL = 1e-10
CHUNK_F32_TOL = 1e-5
# Our references vs transformers' torch functions, which compute in fp32 whatever the input.
ORACLE_ATOL, ORACLE_RTOL = 1e-5, 1e-4

# (T, Hk, Hv, dk, dv): decode at the real shape, grouped and ungrouped, ragged head dims.
SHAPES = {
    "T1-Hk16-Hv32-D128": (1, 16, 32, 128, 128),
    "T1-Hk2-Hv4-dk60-dv100": (1, 2, 4, 60, 100),
    "T63-Hk2-Hv4-dk60-dv100": (63, 2, 4, 60, 100),
    "T150-Hk3-Hv3-dk32-dv48": (150, 3, 3, 32, 48),
    "T17-Hk1-Hv8-dk16-dv24": (17, 1, 8, 16, 24),
}


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def make_inputs(rng, T, Hk, Hv, dk, dv):
    """fp32 inputs as MODEL.md §6 makes them: unit keys, queries scaled by 1/sqrt(dk), gates
    from random projections, a nonzero initial state."""
    q = _l2norm(rng.standard_normal((T, Hk, dk))) / np.sqrt(dk)
    k = _l2norm(rng.standard_normal((T, Hk, dk)))
    v = rng.standard_normal((T, Hv, dv))
    g, beta = gated_delta.gates_reference(rng.standard_normal((T, Hv)) * 2,
                                          rng.standard_normal((T, Hv)) * 2,
                                          rng.uniform(-2, 1, Hv), rng.standard_normal(Hv))
    state = rng.standard_normal((Hv, dk, dv)) * 0.5
    return [np.ascontiguousarray(x, dtype=np.float32) for x in (q, k, v, g, beta, state)]


def _f64(xs):
    return [x.astype(np.float64) for x in xs]


# --- gates ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,Hv", [(1, 32), (63, 7), (150, 4), (131, 32)],
                         ids=["T1-H32", "T63-H7", "T150-H4", "T131-H32"])
def test_gates_cpu_matches_reference(rng, T, Hv):
    a = (rng.standard_normal((T, Hv)) * 10).astype(np.float32)     # softplus far into both tails
    b = (rng.standard_normal((T, Hv)) * 30).astype(np.float32)     # sigmoid saturating, no overflow
    A_log = rng.uniform(-3, 2, Hv).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    g_ref, beta_ref = gated_delta.gates_reference(*_f64([a, b, A_log, dt_bias]))
    out = (poisoned((T, Hv)), poisoned((T, Hv)))
    g, beta = gated_delta.gates_cpu(a, b, A_log, dt_bias, out=out)
    assert g is out[0] and beta is out[1]
    assert_close("g", g_ref, g, GATES_ATOL, GATES_RTOL)
    assert_close("beta", beta_ref, beta, GATES_ATOL, GATES_RTOL)
    assert (g < 0).all() and ((beta >= 0) & (beta <= 1)).all()


def test_gates_cpu_takes_the_halves_of_one_buffer_bit_for_bit(rng):
    """Prefill's b and a are row views of one [T, 2Hv] product (model/forward.py)."""
    T, Hv = 37, 8
    ba = (rng.standard_normal((T, 2 * Hv)) * 10).astype(np.float32)
    A_log = rng.uniform(-3, 2, Hv).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    want = gated_delta.gates_cpu(ba[:, Hv:].copy(), ba[:, :Hv].copy(), A_log, dt_bias)
    got = gated_delta.gates_cpu(ba[:, Hv:], ba[:, :Hv], A_log, dt_bias,
                                out=(poisoned((T, Hv)), poisoned((T, Hv))))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
def test_gates_rows_over_threads_give_each_rows_own_bits(rng):
    """A prefill call (rows over the threads: T >= omp.ROWS_MIN) gives every row the bits of a
    one-row call (decode's), whatever the thread count."""
    T, Hv = 131, 32
    assert T >= omp.ROWS_MIN
    a = (rng.standard_normal((T, Hv)) * 10).astype(np.float32)
    b = (rng.standard_normal((T, Hv)) * 30).astype(np.float32)
    A_log = rng.uniform(-3, 2, Hv).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    results = []
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            results.append(gated_delta.gates_cpu(a, b, A_log, dt_bias,
                                                 out=(poisoned((T, Hv)), poisoned((T, Hv)))))
    finally:
        numba.set_num_threads(before)
    for x, y in zip(*results):
        np.testing.assert_array_equal(x, y)
    for t in range(T):
        for x, y in zip(gated_delta.gates_cpu(a[t:t + 1], b[t:t + 1], A_log, dt_bias),
                        results[0]):
            np.testing.assert_array_equal(x[0], y[t])


def test_gates_reference_formula():
    g, beta = gated_delta.gates_reference(np.array([[0.0, 50.0]]), np.array([[0.0, -800.0]]),
                                          np.array([np.log(2.0), 0.0]), np.array([0.0, -10.0]))
    np.testing.assert_allclose(g, [[-2 * np.log(2.0), -40.0]], rtol=1e-12)
    np.testing.assert_allclose(beta, [[0.5, 0.0]], atol=1e-300)


def test_gates_bad_inputs():
    a = np.zeros((3, 4), np.float32)
    w = np.zeros(4, np.float32)
    with pytest.raises(FermijitError, match="dtype"):
        gated_delta.gates_cpu(a.astype(np.float64), a, w, w)
    with pytest.raises(FermijitError, match="A_log"):
        gated_delta.gates_cpu(a, a, np.zeros(5, np.float32), w)
    with pytest.raises(FermijitError, match="contiguous"):
        gated_delta.gates_cpu(np.zeros((4, 3), np.float32).T, a, w, w)
    with pytest.raises(FermijitError, match="apart"):  # rows overlapping: strides (4, 4)
        gated_delta.gates_cpu(np.lib.stride_tricks.as_strided(a, (3, 4), (4, 4)), a, w, w)
    with pytest.raises(FermijitError, match="shape"):
        gated_delta.gates_cpu(a, a[:2], w, w)
    with pytest.raises(FermijitError, match="out"):
        gated_delta.gates_cpu(a, a, w, w, out=(poisoned((3, 5)), poisoned((3, 4))))


# --- the recurrence -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cpu_matches_reference(rng, shape):
    q, k, v, g, beta, state = make_inputs(rng, *shape)
    o_ref, state_ref = gated_delta.reference(*_f64([q, k, v, g, beta, state]))
    out = poisoned(v.shape)
    o, new_state = gated_delta.cpu(q, k, v, g, beta, state, out=out)
    assert o is out and new_state is state
    assert_close("o", o_ref, o, OUT_ATOL, OUT_RTOL)
    assert_close("state", state_ref, state, STATE_ATOL, STATE_RTOL)


def test_decode_steps_continue_prefill(rng):
    """Prefill 40 tokens, then decode 3 one at a time: the same as one pass over 43."""
    q, k, v, g, beta, state = make_inputs(rng, 43, 2, 4, 32, 40)
    o_ref, state_ref = gated_delta.reference(*_f64([q, k, v, g, beta, state]))
    o = poisoned(v.shape)
    gated_delta.cpu(q[:40], k[:40], v[:40], g[:40], beta[:40], state, out=o[:40])
    for t in range(40, 43):
        step = slice(t, t + 1)
        gated_delta.cpu(q[step], k[step], v[step], g[step], beta[step], state, out=o[step])
    assert_close("o", o_ref, o, OUT_ATOL, OUT_RTOL)
    assert_close("state", state_ref, state, STATE_ATOL, STATE_RTOL)


def test_reference_closed_form(rng):
    """One step equals MODEL.md §6.7's closed form S' = alpha (I - beta k k^T) S + beta k v^T."""
    q, k, v, g, beta, state = _f64(make_inputs(rng, 1, 2, 2, 8, 5))
    _, new_state = gated_delta.reference(q, k, v, g, beta, state)
    for h in range(2):
        kh = k[0, h]
        expected = (np.exp(g[0, h]) * (np.eye(8) - beta[0, h] * np.outer(kh, kh)) @ state[h]
                    + beta[0, h] * np.outer(kh, v[0, h]))
        np.testing.assert_allclose(new_state[h], expected, rtol=1e-12, atol=1e-12)


def test_cpu_bad_inputs(rng):
    q, k, v, g, beta, state = make_inputs(rng, 3, 2, 4, 8, 6)
    with pytest.raises(FermijitError, match="dtype"):
        gated_delta.cpu(q, k, v.astype(np.float64), g, beta, state)
    with pytest.raises(FermijitError, match="k has shape"):
        gated_delta.cpu(q, k[:, :, :7].copy(), v, g, beta, state)
    with pytest.raises(FermijitError, match="state has shape"):
        gated_delta.cpu(q, k, v, g, beta, state[:3].copy())
    with pytest.raises(FermijitError, match="multiple"):
        gated_delta.cpu(*make_inputs(rng, 3, 3, 4, 8, 6))
    with pytest.raises(FermijitError, match="contiguous"):
        gated_delta.cpu(q, k, v, np.asfortranarray(g), beta, state)
    with pytest.raises(FermijitError, match="out"):
        gated_delta.cpu(q, k, v, g, beta, state, out=poisoned((3, 4, 5)))
    state.flags.writeable = False
    with pytest.raises(FermijitError, match="read-only"):
        gated_delta.cpu(q, k, v, g, beta, state)


# --- the chunked form -----------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("dtype,tol", [(np.float64, CHUNK_F64_TOL), (np.float32, CHUNK_F32_TOL)],
                         ids=["f64", "f32"])
def test_chunked_matches_recurrent(rng, T, dtype, tol):
    inputs = [x.astype(dtype) for x in make_inputs(rng, T, 2, 4, 32, 24)]
    o_rec, state_rec = gated_delta.reference(*inputs)
    o_chunk, state_chunk = gated_delta.chunked_reference(*inputs, chunk=64)
    assert o_chunk.dtype == dtype and o_chunk.shape == o_rec.shape
    assert_close("o", o_rec, o_chunk, tol, tol)
    assert_close("state", state_rec, state_chunk, tol, tol)


# --- the transformers oracle (MODEL.md §8) --------------------------------------------------------

def test_references_match_transformers(rng):
    torch = pytest.importorskip("torch")
    hf = tests_hf.qwen_modeling()
    T, Hk, Hv, dk, dv = 70, 2, 4, 16, 24
    q, k, v, g, beta, state = make_inputs(rng, T, Hk, Hv, dk, dv)
    # transformers scales q by 1/sqrt(dk) itself; ours arrives scaled.
    args = [torch.from_numpy(x)[None] for x in (q * np.float32(np.sqrt(dk)), k, v, g, beta)]
    initial = torch.from_numpy(state)[None]
    o_hf, state_hf = hf.torch_recurrent_gated_delta_rule(*args, initial_state=initial,
                                                         output_final_state=True)
    o_ref, state_ref = gated_delta.reference(*_f64([q, k, v, g, beta, state]))
    assert_close("o recurrent", o_ref, o_hf[0].numpy(), ORACLE_ATOL, ORACLE_RTOL)
    assert_close("state recurrent", state_ref, state_hf[0].numpy(), ORACLE_ATOL, ORACLE_RTOL)
    o_hf, state_hf = hf.torch_chunk_gated_delta_rule(*args, initial_state=initial,
                                                     output_final_state=True)
    o_chunk, state_chunk = gated_delta.chunked_reference(*_f64([q, k, v, g, beta, state]))
    assert_close("o chunked", o_chunk, o_hf[0].numpy(), ORACLE_ATOL, ORACLE_RTOL)
    assert_close("state chunked", state_chunk, state_hf[0].numpy(), ORACLE_ATOL, ORACLE_RTOL)


# --- prompts: one sweep of the state per token (ops/gated_delta_prefill.py) ----------------------

# (T, Hk, Hv, dk, dv): dv of whole 4-vector blocks for AVX-512 (64, 128), AVX2 and SSE only (32,
# 48), and with a remainder of single columns for every width (100, 24, 8).
SWEEP_SHAPES = {"T2-Hk1-Hv2-dk16-dv8": (2, 1, 2, 16, 8),
                "T63-Hk2-Hv4-dk60-dv100": (63, 2, 4, 60, 100),
                "T40-Hk3-Hv3-dk32-dv48": (40, 3, 3, 32, 48),
                "T33-Hk4-Hv8-D64": (33, 4, 8, 64, 64),
                "T17-Hk2-Hv4-D128": (17, 2, 4, 128, 128),
                "T9-Hk1-Hv8-dk16-dv24": (9, 1, 8, 16, 24)}
SWEEP_ISAS = cpu_isa.variants_up_to(cpu_isa.selected_isa())
# The outputs: the token loop's k·q is summed as its compiler chose (unrolled and reassociated),
# this one's in order: measured max abs difference 3e-8 on |o| <= 0.4.
SWEEP_O_ATOL = 1e-7


@pytest.mark.parametrize("isa", SWEEP_ISAS, ids=[i.label for i in SWEEP_ISAS])
@pytest.mark.parametrize("shape", SWEEP_SHAPES.values(), ids=SWEEP_SHAPES.keys())
def test_prompt_sweep_is_the_token_loop(rng, isa, shape):
    """The state bit for bit the token loop's (decode continues from it), the outputs within
    SWEEP_O_ATOL of it (test_cpu_matches_reference holds both to float64)."""
    from fermijit.ops import gated_delta_prefill

    q, k, v, g, beta, state = make_inputs(rng, *shape)
    state[0, 0, 0] = -0.0
    loop_state, loop_o = state.copy(), np.empty_like(v)
    gated_delta._recurrent(q, k, v, g, beta, loop_state, loop_o)
    o = poisoned(v.shape)
    gated_delta_prefill.run(q, k, v, g, beta, state, o, isa)
    np.testing.assert_array_equal(state.view(np.int32), loop_state.view(np.int32))
    assert_close("o vs the token loop", loop_o, o, SWEEP_O_ATOL, 0)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
def test_prompt_sweep_same_bits_for_any_thread_count(rng):
    q, k, v, g, beta, state = make_inputs(rng, 20, 2, 6, 32, 64)
    results = []
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            s = state.copy()
            results.append((gated_delta.cpu(q, k, v, g, beta, s)[0], s))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(results[0], results[1]):
        np.testing.assert_array_equal(a, b)


# --- long prompts (issue 31 item 6) --------------------------------------------------------------

# The state after 32k tokens in fp32 (passes of 512, as prefill runs them, then decode steps)
# against float64: with slow decays (alpha up to 0.9995, a memory of ~2000 tokens) rounding
# errors are remembered as long, not summed over all 32k. Measured max abs error 1.6e-7 on
# |state| <= 1.6, 1.0e-7 on |o|; the short tests' bounds hold.
LONG_T = 32768


def test_state_after_32k_tokens_is_finite_and_near_the_reference(rng):
    Hk, Hv, dk, dv = 1, 2, 32, 32
    q, k, v, g, beta, state = make_inputs(rng, LONG_T, Hk, Hv, dk, dv)
    g[:, 0] = np.log(rng.uniform(0.99, 0.9995, LONG_T)).astype(np.float32)  # slow decay
    start = state.copy()
    o = poisoned(v.shape)
    for t0 in range(0, LONG_T - 3, 512):
        t1 = min(t0 + 512, LONG_T - 3)
        gated_delta.cpu(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1], state,
                        out=o[t0:t1])
    for t in range(LONG_T - 3, LONG_T):
        step = slice(t, t + 1)
        gated_delta.cpu(q[step], k[step], v[step], g[step], beta[step], state, out=o[step])
    assert np.isfinite(state).all() and np.isfinite(o).all()
    o_ref, state_ref = gated_delta.reference(*_f64([q, k, v, g, beta, start]))
    assert_close("state after 32k", state_ref, state, STATE_ATOL, STATE_RTOL)
    assert_close("o over 32k", o_ref, o, OUT_ATOL, OUT_RTOL)
