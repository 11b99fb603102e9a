"""A verify step's GDN rows in one call (ops.gdn_rows): row r bit for bit ops.gdn_step on the state
row r-1 left, every row's output, quantisation and states (those saved after each row but the
last, the live one after the last), at 1 and 2 threads; and close to the references."""

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import gdn_rows, gdn_step, matvec
from tests.numerics import assert_close, poisoned

EPS, L2_EPS = 1e-6, 1e-6
RTOL = 1e-5


def _inputs(rng, R, Hk, Hv, dk, dv, taps=4):
    C = 2 * Hk * dk + Hv * dv
    f = np.float32
    # One buffer per row as the verify step's (qkv | z, then b | a), the views cut from it.
    proj = rng.standard_normal((R, C + Hv * dv)).astype(f)
    gates = rng.standard_normal((R, 2 * Hv)).astype(f)
    return dict(
        proj=proj, gates=gates, conv_w=(rng.standard_normal((C, taps)) * 0.5).astype(f),
        conv_state=rng.standard_normal((C, taps - 1)).astype(f),
        A_log=rng.uniform(0, 2, Hv).astype(f), dt_bias=rng.standard_normal(Hv).astype(f),
        norm_w=rng.uniform(0.5, 1.5, dv).astype(f),
        state=(rng.standard_normal((Hv, dk, dv)) * 0.1).astype(f), C=C)


def _views(x, r, Hv, dv):
    C, proj, gates = x["C"], x["proj"], x["gates"]
    row = proj[r:r + 1]
    return (row[:, :C], row[:, C:].reshape(1, Hv, dv), gates[r:r + 1, Hv:],
            gates[r:r + 1, :Hv])


def _one_by_one(x, R, Hk, Hv, dk, dv):
    x = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in x.items()}
    conv, state = x["conv_state"], x["state"]
    outs, convs, states, acts = [], [], [], []
    for r in range(R):
        mixed, z, a, b = _views(x, r, Hv, dv)
        scratch = [poisoned(s) for s in ((1, Hk, dk), (1, Hk, dk), (1, Hv, dv), (1, Hv),
                                         (1, Hv))]
        o = poisoned((1, Hv, dv))
        act = matvec.quantize_act(np.zeros((1, Hv * dv), np.float32))
        gdn_step.cpu(mixed, z, a, b, x["conv_w"], conv, x["A_log"], x["dt_bias"], x["norm_w"],
                     EPS, L2_EPS, state, *scratch, o, act)
        outs.append(o)
        convs.append(conv.copy())
        states.append(state.copy())
        acts.append(act)
    return outs, convs, states, acts


def _rows(x, R, Hk, Hv, dk, dv, in_place=True):
    """gdn_rows.cpu over x's rows: the last row's state into the live one (in_place) or an array
    of its own."""
    x = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in x.items()}
    live_conv, live_state = x["conv_state"], x["state"]
    save_conv = poisoned((R - 1, *live_conv.shape))
    save_state = poisoned((R - 1, *live_state.shape))
    conv_dst = [save_conv[r] for r in range(R - 1)] + [live_conv]
    rec_dst = [save_state[r] for r in range(R - 1)] + [live_state if in_place
                                                       else poisoned(live_state.shape)]
    views = [_views(x, r, Hv, dv) for r in range(R)]
    o = poisoned((R, Hv, dv))
    acts = matvec.quantize_act(np.zeros((R, Hv * dv), np.float32))
    act_rows = [matvec.Q8Act(acts.xq[r:r + 1], acts.dx[r:r + 1], acts.xsum8[r:r + 1], acts.vec)
                for r in range(R)]
    scratch = gdn_rows.Scratch(R, Hk, Hv, dk, dv)
    for a in vars(scratch).values():
        a[...] = np.nan
    gdn_rows.cpu([v[0] for v in views], [v[1] for v in views], [v[2] for v in views],
                 [v[3] for v in views], x["conv_w"], [live_conv] + conv_dst[:-1], conv_dst,
                 x["A_log"], x["dt_bias"], x["norm_w"], EPS, L2_EPS,
                 [live_state] + rec_dst[:-1], rec_dst, scratch, [o[r:r + 1] for r in range(R)],
                 act_rows)
    return [o[r:r + 1] for r in range(R)], conv_dst, rec_dst, act_rows


SHAPES = {"R2-Hk2-Hv4-d32": (2, 2, 4, 32, 32), "R3-Hk3-Hv6-dk32-dv64": (3, 3, 6, 32, 64),
          "R2-Hk1-Hv2-dk64-dv32": (2, 1, 2, 64, 32), "R1-Hk2-Hv2": (1, 2, 2, 32, 32),
          "R2-Hk1-Hv2-dk32-dv48": (2, 1, 2, 32, 48)}  # a 32-block across heads


# Where the last row's state goes: into the live state or apart.
PLACES = {"in-place": True, "apart": False}


@pytest.mark.parametrize("place", PLACES.values(), ids=PLACES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_rows_are_gdn_step_one_by_one(rng, shape, place):
    R, Hk, Hv, dk, dv = shape
    x = _inputs(rng, R, Hk, Hv, dk, dv)
    want = _one_by_one(x, R, Hk, Hv, dk, dv)
    before = numba.get_num_threads()
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            got = _rows(x, R, Hk, Hv, dk, dv, place)
            for r in range(R):
                for name, w, g in (("o", want[0][r], got[0][r]), ("conv", want[1][r], got[1][r]),
                                   ("state", want[2][r], got[2][r]),
                                   ("xq", want[3][r].xq, got[3][r].xq),
                                   ("dx", want[3][r].dx, got[3][r].dx),
                                   ("xsum8", want[3][r].xsum8, got[3][r].xsum8)):
                    assert np.array_equal(w, g), f"{name} of row {r} at {n} threads"
    finally:
        numba.set_num_threads(before)
    C = x["C"]
    ref_o, ref_conv, ref_state = gdn_rows.reference(
        x["proj"][:, :C], x["proj"][:, C:].reshape(R, Hv, dv), x["gates"][:, Hv:],
        x["gates"][:, :Hv], x["conv_w"], x["conv_state"], x["A_log"], x["dt_bias"],
        x["norm_w"], EPS, L2_EPS, x["state"])
    got_o = np.concatenate(got[0])
    assert_close("o", ref_o, got_o, RTOL * np.abs(ref_o).max(), RTOL)
    assert_close("conv", ref_conv, np.stack(got[1]), 0, 0)
    assert_close("state", ref_state, np.stack(got[2]), RTOL * np.abs(ref_state).max(), RTOL)


def _settled(held, pending):
    """numpy's pending row on a copy of `held` (each element alpha S + k d, two rounded products
    and a rounded sum: the kernel's operations), pending left as it is."""
    Hv, Hk = held.shape[0], pending.k.shape[0]
    k = np.repeat(pending.k, Hv // Hk, axis=0)                                  # [Hv, dk]
    return pending.alpha[:, None, None] * held + k[:, :, None] * pending.d[:, None, :]


LAZY_SHAPES = {"Hk2-Hv4-d32": (2, 4, 32, 32), "Hk1-Hv2-dk64-dv32": (1, 2, 64, 32),
               "Hk3-Hv6-dk32-dv64": (3, 6, 32, 64), "Hk1-Hv2-dk32-dv48": (1, 2, 32, 48)}


@pytest.mark.parametrize("shape", LAZY_SHAPES.values(), ids=LAZY_SHAPES.keys())
def test_lazy_row_steps_are_gdn_step_token_by_token(rng, shape):
    # Verify steps of 2 rows with the last row left pending (as model/batch.py runs them), each
    # step's rows kept or the last dropped (a rollback), against gdn_step token by token over
    # the kept tokens: every output and quantisation, the state after the first row in place,
    # after the second once settled (numpy's settle and Pending.settle), at 1 and 2 threads.
    Hk, Hv, dk, dv = shape
    R, kept = 2, (2, 2, 1, 2, 1, 1, 2, 2)
    base = _inputs(rng, R, Hk, Hv, dk, dv)
    steps = [_inputs(rng, R, Hk, Hv, dk, dv) for _ in kept]
    before = numba.get_num_threads()
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            conv, held = base["conv_state"].copy(), matvec.aligned_empty(base["state"].shape)
            held[...] = base["state"]
            save_conv = poisoned(conv.shape)
            pending = gdn_rows.Pending(Hk, Hv, dk, dv)
            scratch = gdn_rows.Scratch(R, Hk, Hv, dk, dv)
            truth = dict(conv_state=base["conv_state"].copy(), state=base["state"].copy())
            for t, (step, n_kept) in enumerate(zip(steps, kept)):
                x = {**base, **{k: step[k] for k in ("proj", "gates")}, **truth}
                want = _one_by_one(x, R, Hk, Hv, dk, dv)
                views = [_views({**x, "proj": x["proj"].copy()}, r, Hv, dv) for r in range(R)]
                o = poisoned((R, Hv, dv))
                acts = matvec.quantize_act(np.zeros((R, Hv * dv), np.float32))
                act_rows = [matvec.Q8Act(acts.xq[r:r + 1], acts.dx[r:r + 1],
                                         acts.xsum8[r:r + 1], acts.vec) for r in range(R)]
                gdn_rows.cpu([v[0] for v in views], [v[1] for v in views],
                             [v[2] for v in views], [v[3] for v in views], base["conv_w"],
                             [conv, save_conv], [save_conv, conv], base["A_log"],
                             base["dt_bias"], base["norm_w"], EPS, L2_EPS, [held], [held],
                             scratch, [o[r:r + 1] for r in range(R)], act_rows, pending)
                what = f"step {t} at {n} threads"
                for r in range(R):
                    for name, w, g in (("o", want[0][r], o[r:r + 1]),
                                       ("xq", want[3][r].xq, act_rows[r].xq),
                                       ("dx", want[3][r].dx, act_rows[r].dx),
                                       ("xsum8", want[3][r].xsum8, act_rows[r].xsum8)):
                        assert np.array_equal(w, g), f"{name} of row {r}, {what}"
                assert np.array_equal(save_conv, want[1][0]) and np.array_equal(conv, want[1][1])
                assert np.array_equal(held, want[2][0]), f"state after row 0, {what}"
                assert pending.is_set[0] == 1
                assert np.array_equal(_settled(held, pending), want[2][1]), f"settled, {what}"
                if n_kept == 1:  # the rollback: the state after row 0, its conv swapped in
                    pending.is_set[0] = 0
                    conv, save_conv = save_conv, conv
                truth = dict(conv_state=want[1][n_kept - 1].copy(),
                             state=want[2][n_kept - 1].copy())
            pending.settle(held)
            assert pending.is_set[0] == 0 and np.array_equal(held, truth["state"])
            pending.settle(held)  # once: nothing pending now
            assert np.array_equal(held, truth["state"])
    finally:
        numba.set_num_threads(before)


def test_a_lazy_row_takes_two_rows():
    scratch = gdn_rows.Scratch(3, 1, 2, 32, 32)
    x = [np.zeros((1, 4), np.float32)] * 3
    with pytest.raises(FermijitError, match="a lazy row"):
        gdn_rows.launch(x, x, x, x, None, x, x, None, None, None, EPS, L2_EPS, x[:1], x[:1],
                        scratch, x, x, gdn_rows.Pending(1, 2, 32, 32))
