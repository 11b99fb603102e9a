"""Issue 32 item 4's parts: a 2-row verify step's parts against a 1-token step's, on a model
directory (the full-size synthetic reap128 on the GPU machine's host, or a slice of it here), each
part cold (every layer's weights in turn), rounds interleaved, medians of the rounds' ratios.

    python -m tests.verify_rows_probe MODEL THREADS [ROUNDS]   (from the project root)

Parts: the GDN layers (a token's gdn_step; the verify step's 2 rows, the last row left pending,
with the previous step's row pending or none), cold (30 layers' states) and in cache (one
layer's again and again: the compute alone);
the fused MoE (1 token; 2 tokens through the union launch, moe.rows_launch; 2 tokens through
decode's fused kernel given both tokens, as main ran them before it: each token's experts read
apart, the tokens' same blocks in turn), with
random routing (the synthetic model's: ~15.5 distinct experts of 2 x 8) and with routing that
shares half of the experts (real models' tokens overlap more); the residual step (1 row vs 2);
the few-token products (dense Q4_0 matrices, the Q8_0 LM head; 2 tokens vs the 1-token GEMV).
Prints a line a part: microseconds a call and the ratio."""

import sys
import time

import numpy as np

from fermijit.jit import cpu

cpu.configure_threads(int(sys.argv[2]))

from fermijit.model.forward import load_model  # noqa: E402 (after the thread count)
from fermijit.model.weights import QuantTensor  # noqa: E402
from fermijit.ops import gdn_rows, gdn_step, matvec, moe, residual_rows, residual_step  # noqa: E402

ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 15
_, model = load_model(sys.argv[1])
isa, H, k = cpu.decode_isa(), model.hidden, model.top_k
rng = np.random.default_rng(0)
f32 = np.float32


def act(T, K):
    return matvec.quantize_act(rng.standard_normal((T, K)).astype(f32), isa)


def timed(cases, rounds, before=None):
    """{case: [seconds of a round]}: each round every case's launches in turn."""
    res = {c: [] for c in cases}
    for _ in range(rounds):
        for c, launches in cases.items():
            if before:
                before(c)
            t = time.perf_counter()
            for fn, args in launches:
                fn(*args)
            res[c].append(time.perf_counter() - t)
    return res


def report(name, res, per):
    (c1, t1), *rest = res.items()
    line = f"{name}: {c1} {1e6 * np.median(t1) / per:.1f} us"
    for c2, t2 in rest:
        line += (f"; {c2} {1e6 * np.median(t2) / per:.1f} us, ratio "
                 f"{np.median(np.array(t2) / t1):.3f}")
    print(line + " (a call, medians)", flush=True)


# --- the fused MoE -----------------------------------------------------------------------------
w0 = model.layers[0].experts
per_expert = sum(a[0].nbytes for a in w0.routed)
shared_bytes = sum(a.nbytes for a in w0.shared)
x2 = rng.standard_normal((2, H)).astype(f32)
act2 = matvec.quantize_act(x2, isa)
acts1 = [matvec.quantize_act(x2[t:t + 1], isa) for t in range(2)]
ids2 = np.zeros((2, k), np.int32)
wts2 = np.full((2, k), 1 / k, f32)
out2 = np.empty((2, H), f32)
rows_scratch = moe.RowsScratch.make(w0, k, 2)
tok_scratch = [moe.Scratch.make(w0, k) for _ in range(2)]
cases = {
    "1 token": [moe.decode_launch(x2[:1], acts1[0], ids2[:1], wts2[:1], w.experts, out2[:1],
                                  tok_scratch[0]) for w in model.layers],
    "2 tokens (union)": [moe.rows_launch(x2, act2, ids2, wts2, w.experts, out2, rows_scratch)
                         for w in model.layers],
    "2 tokens (main's)": [],  # decode's kernel over both tokens, each token's experts apart
}
for w in model.layers:
    (kernel_, a0), (_, a1) = (moe.decode_launch(x2[t:t + 1], acts1[t], ids2[t:t + 1],
                                                wts2[t:t + 1], w.experts, out2[t:t + 1],
                                                tok_scratch[t]) for t in range(2))
    cases["2 tokens (main's)"].append((kernel_, tuple(p + q for p, q in zip(a0, a1))))
for overlap in (0.0, 0.5):
    distinct = []

    def route(case, overlap=overlap, distinct=distinct):
        ids2[0] = rng.choice(model.n_experts, k, replace=False)
        ids2[1] = rng.choice(model.n_experts, k, replace=False)
        n_same = int(overlap * k)
        if n_same:  # token 1 takes n_same of token 0's experts, the rest others
            rest = np.setdiff1d(np.arange(model.n_experts), ids2[0])
            ids2[1] = np.concatenate([rng.permutation(ids2[0])[:n_same],
                                      rng.choice(rest, k - n_same, replace=False)])
        if case != "1 token":
            distinct.append(len(np.unique(ids2)))

    res = timed(cases, ROUNDS, route)
    u = np.mean(distinct)
    print(f"moe, routing {'random' if not overlap else f'sharing {int(overlap * k)} of {k}'}: "
          f"union {u:.1f} distinct experts of 2 x {k} (+ the shared one; byte ratio "
          f"{(u * per_expert + shared_bytes) / (k * per_expert + shared_bytes):.2f})")
    report("  moe", res, len(model.layers))

# --- the GDN layers ---------------------------------------------------------------------------
C, Hk, Hv = model.conv_dim, model.n_key_heads, model.n_value_heads
dk, dv, L2 = model.key_dim, model.value_dim, 1e-6
gdn = [w.mixer for w, att in zip(model.layers, model.is_attention) if not att]
gdn = (gdn * (30 // len(gdn) + 1))[:max(30, len(gdn))]  # a slice: the full size's 30 states
proj0 = rng.standard_normal((2, C + Hv * dv)).astype(f32)
gates0 = rng.standard_normal((2, 2 * Hv)).astype(f32)
proj, gates = proj0.copy(), gates0.copy()
o2 = np.empty((2, Hv, dv), f32)
a2 = matvec.quantize_act(np.zeros((2, Hv * dv), f32), isa)
a2_rows = [matvec.Q8Act(a2.xq[r:r + 1], a2.dx[r:r + 1], a2.xsum8[r:r + 1], a2.vec)
           for r in range(2)]
one = [np.empty(s_, f32) for s_ in ((1, Hk, dk), (1, Hk, dk), (1, Hv, dv), (1, Hv), (1, Hv))]
scratch2 = gdn_rows.Scratch(2, Hk, Hv, dk, dv)


def gdn_state():
    conv = np.zeros((C, model.conv_taps - 1), f32)
    rec = matvec.aligned_empty((Hv, dk, dv))
    rec[:] = 0.01 * rng.standard_normal((Hv, dk, dv))
    return conv, rec


pendings = {"2 rows": [], "2 rows, 1 pending": []}  # each case's layers' lazy rows


def gdn_launches(case, layers=gdn):
    out = []
    for m in layers:
        conv, rec = gdn_state()
        rows = [(proj[r:r + 1, :C], proj[r:r + 1, C:].reshape(1, Hv, dv), gates[r:r + 1, Hv:],
                 gates[r:r + 1, :Hv]) for r in range(2)]
        if case == "1 token":
            out.append(gdn_step.launch(*rows[0], m.conv1d, conv, m.A_log, m.dt_bias, m.norm,
                                       model.eps, L2, rec, *one, o2[:1], a2_rows[0]))
            continue
        save_conv, pending = np.empty_like(conv), gdn_rows.Pending(Hk, Hv, dk, dv)
        pending.alpha[:], pending.k[:], pending.d[:] = 0.9, 0.01, 0.01
        pendings[case].append(pending)
        out.append(gdn_rows.launch(
            *[list(x) for x in zip(*rows)], m.conv1d, [conv, save_conv], [save_conv, conv],
            m.A_log, m.dt_bias, m.norm, model.eps, L2, [rec], [rec], scratch2,
            [o2[:1], o2[1:]], a2_rows, pending))
    return out


def fresh_inputs(case):  # each call's conv overwrote its rows' inputs; the rows' pending row
    proj[:] = proj0
    gates[:] = gates0
    for p in pendings.get(case, ()):
        p.is_set[0] = case.endswith("pending")


gdn_cases = {c: gdn_launches(c) for c in ("1 token", "2 rows", "2 rows, 1 pending")}
report(f"gdn ({len(gdn)} layers' states)", timed(gdn_cases, ROUNDS, fresh_inputs), len(gdn))
# one layer's states again and again (in the cache): the rows' compute against a token's, apart
# from the memory traffic that the cold figure above adds to it
# (the rows' calls after the first find the row the one before left pending)
hot = {c: gdn_launches(c, gdn[:1]) * 30 for c in ("1 token", "2 rows, 1 pending")}
report("gdn (1 layer's state, in cache)", timed(hot, ROUNDS, fresh_inputs), 30)

# --- residual steps: every layer's router (post-norm) and a no-product step (input norm) -------


def res_launches(R, routed):
    x = matvec.aligned_empty((R, H))
    x[:] = rng.standard_normal((R, H))
    y = matvec.aligned_empty((R, H))
    y[:] = 0.01 * rng.standard_normal((R, H))
    xn, a = matvec.aligned_empty((R, H)), act(R, H)
    mod = residual_step if R == 1 else residual_rows
    out = []
    for w in model.layers:
        if routed:
            p = np.empty((R, w.router.shape[0]), f32)
            out.append(mod.launch(x, y, w.post_norm, model.eps, xn, a, w.router, p,
                                  np.empty((R, k), np.int32), np.empty((R, k), f32)))
        else:
            out.append(mod.launch(x, y, w.input_norm, model.eps, xn, a, np.empty((0, H), f32),
                                  np.empty((R, 0), f32), np.empty((R, 0), np.int32),
                                  np.empty((R, 0), f32)))
    return out


for routed in (False, True):
    report(f"residual {'router' if routed else 'no product'}",
           timed({"1 row": res_launches(1, routed), "2 rows": res_launches(2, routed)}, ROUNDS),
           len(model.layers))

# --- the products: the mixers' Q4_0 matrices, then the LM head ----------------------------------
mats = []
for w in model.layers:
    m = w.mixer
    mats += [w.joined_in] + [getattr(m, n) for n in ("o_proj", "out_proj") if hasattr(m, n)]
mats = [m for m in mats if isinstance(m, matvec.Q4Matrix)]


def prod_launches(T, head):
    if not head:
        return [matvec.launch(m, act(T, m.qs.shape[1] * 2), np.empty((T, m.qs.shape[0]), f32),
                              like_gemv=T > 1) for m in mats]
    h = model.lm_head
    return [matvec.q8_launch(h.qs, h.d, act(T, H), np.empty((T, h.qs.shape[0]), f32))]


report("products (dense Q4_0)", timed({"1 token": prod_launches(1, False),
                                       "2 tokens": prod_launches(2, False)}, ROUNDS), len(mats))
if isinstance(model.lm_head, QuantTensor):
    report("LM head (Q8_0)", timed({"1 token": prod_launches(1, True),
                                    "2 tokens": prod_launches(2, True)}, ROUNDS), 1)
