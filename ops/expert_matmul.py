"""Routed experts of the MoE block as one grouped Q4_0 GEMM (MODEL.md §4, "Expert (SwiGLU)").

    y[t] = sum_k  w[t, k] · Wd[e] · (silu(Wg[e] · x[t]) ⊙ (Wu[e] · x[t])),   e = ids[t, k]

Dimensions: T tokens, K experts per token (top-k, 8), E experts (256, or 128 after REAP), H hidden
(2048), I expert intermediate (512), S = T·K slots (one per token and chosen expert).
Weights are Q4_0 structure-of-arrays (DESIGN.md): gate_up_qs uint8 [E, 2I, H/2] and gate_up_d
fp16 [E, 2I, H/32], rows 0..I-1 gate and I..2I-1 up (the hub's fused `gate_up_proj` layout);
down_qs uint8 [E, H, I/2], down_d fp16 [E, H, I/32].

The GPU path, in stages named after the math:
  `sort_slots`: slots ordered by expert (stable), so each expert's tokens are one contiguous run;
  gate_up: h[s] = silu(Wg[e] x[rows[s]]) ⊙ (Wu[e] x[rows[s]]), rows of x gathered by index, the
           SwiGLU fused into the GEMM's epilogue (gate and up of an output sit in one thread);
  down:    y[rows[s]] += w[s] · Wd[e] h[s], the routing weight applied on a scatter-add.
The shared expert is this op with E = 1, every token routed to it with weight σ(w_sg · x).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array
from fermijit.ops.quant import BLOCK, dequantize_q4_0

# Rows of A per GPU tile (kernels_ptx/q4_gemm.ptx); W columns per tile in each stage.
TILE_ROWS = 64
GATE_UP_TILE_COLS = 64
DOWN_TILE_COLS = 128


def reference(x, ids, weights, gate_up_qs, gate_up_d, down_qs, down_d, out=None):
    """x [T, H] fp32, ids [T, K] int32, weights [T, K] fp32, Q4_0 experts -> y [T, H] fp32."""
    n_inter = gate_up_d.shape[1] // 2
    y = np.zeros(x.shape, np.float64)
    for e in np.unique(ids):
        t, k = np.nonzero(ids == e)
        gu = x[t].astype(np.float64) @ dequantize_q4_0(gate_up_qs[e], gate_up_d[e]).T
        g, u = gu[:, :n_inter], gu[:, n_inter:]
        h = g / (1.0 + np.exp(-g)) * u
        down = h @ dequantize_q4_0(down_qs[e], down_d[e]).T.astype(np.float64)
        np.add.at(y, t, weights[t, k, None] * down)
    if out is None:
        return y.astype(np.float32)
    out[...] = y
    return out


def sort_slots(ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [T, K] -> (order [S] slot indices t*K+k sorted by expert (stable), offsets [E+1]
    where expert e owns sorted slots offsets[e]:offsets[e+1], tiles [n, 4] int32 (expert,
    first, end, 0): each expert's run cut into TILE_ROWS pieces, one per GPU block row)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=n_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    tiles = [(e, s, min(s + TILE_ROWS, offsets[e + 1]), 0)
             for e in np.nonzero(counts)[0] for s in range(offsets[e], offsets[e + 1], TILE_ROWS)]
    return order, offsets, np.array(tiles, np.int32).reshape(-1, 4)


def _check(op, x, ids, weights, gate_up_qs, gate_up_d, down_qs, down_d, check):
    """Shapes (T, H, K, E, I) after checking every argument with `check(op, name, a, dtype,
    shape)`; `ids` must already be on the host."""
    if len(getattr(x, "shape", ())) != 2:
        raise FermijitError(f"{op}: x must be [T, H], got shape {list(x.shape)}")
    n_tokens, hidden = x.shape
    check(op, "x", x, np.float32, (None, None))
    check_array(op, "ids", ids, np.int32, (n_tokens, None))
    top_k = ids.shape[1]
    check(op, "weights", weights, np.float32, (n_tokens, top_k))
    is_3d = len(getattr(gate_up_qs, "shape", ())) == 3
    n_experts = gate_up_qs.shape[0] if is_3d else 0
    n_inter = gate_up_qs.shape[1] // 2 if is_3d else 0
    if hidden % BLOCK or n_inter % BLOCK or n_inter == 0 or n_experts == 0:
        raise FermijitError(f"{op}: H={hidden} and I={n_inter} must be non-zero multiples of "
                            f"{BLOCK} (gate_up_qs shape {list(gate_up_qs.shape)})")
    check(op, "gate_up_qs", gate_up_qs, np.uint8, (n_experts, 2 * n_inter, hidden // 2))
    check(op, "gate_up_d", gate_up_d, np.float16, (n_experts, 2 * n_inter, hidden // BLOCK))
    check(op, "down_qs", down_qs, np.uint8, (n_experts, hidden, n_inter // 2))
    check(op, "down_d", down_d, np.float16, (n_experts, hidden, n_inter // BLOCK))
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise FermijitError(f"{op}: expert ids must be in [0, {n_experts}), got "
                            f"[{ids.min()}, {ids.max()}]")
    return n_tokens, hidden, top_k, n_experts, n_inter


@dataclass(frozen=True)
class Routing:
    """The sorted slots on the device, shared by both GEMMs (and reusable across calls)."""

    rows: object          # int32 [S]: the token of each sorted slot
    slot_weights: object  # fp32 [S]: its routing weight
    tiles: object         # int32 [n_tiles, 4], see sort_slots
    n_tiles: int


def route(ids: np.ndarray, weights: np.ndarray, n_experts: int) -> Routing:
    """Host sort of ids [T, K] (S = T·K ints: 32 KB at T = 1024), then the results copied in."""
    from fermijit.jit import gpu as g

    op = "expert_matmul"
    order, _, tiles = sort_slots(ids, n_experts)
    slot_weights = np.ascontiguousarray(weights.reshape(-1)[order])
    return Routing(g.to_device(op, "rows", (order // ids.shape[1]).astype(np.int32), np.int32),
                   g.to_device(op, "slot weights", slot_weights, np.float32),
                   g.to_device(op, "tiles", tiles, np.int32), len(tiles))


def gate_up_gpu(x, routing: Routing, gate_up_qs, gate_up_d, h) -> None:
    """h [S, I] = silu(x[rows] Wg^T) * (x[rows] Wu^T) per expert; device arrays, checked."""
    from fermijit.jit import gpu as g

    n_inter, hidden = h.shape[1], x.shape[1]
    g.kernel("q4_gemm", MODE="expert_gate_up")(
        (-(-n_inter // GATE_UP_TILE_COLS), routing.n_tiles), (256,),
        x, gate_up_qs, gate_up_d, h, routing.tiles, routing.rows, None, 0, n_inter, hidden)


def down_gpu(h, routing: Routing, down_qs, down_d, y) -> None:
    """y[rows] += slot_weights * (h Wd^T) per expert; y must hold zeros (or a sum to add to)."""
    from fermijit.jit import gpu as g

    n_inter, hidden = h.shape[1], y.shape[1]
    g.kernel("q4_gemm", MODE="expert_down")(
        (-(-hidden // DOWN_TILE_COLS), routing.n_tiles), (256,),
        h, down_qs, down_d, y, routing.tiles, routing.rows, routing.slot_weights, 0, hidden,
        n_inter)


def gpu(x, ids, weights, gate_up_qs, gate_up_d, down_qs, down_d, out=None):
    """As `reference`; arrays numpy or on the device (see fermijit.jit.gpu). The slots are sorted
    on the host (`route`), so device `ids` and `weights` are copied back first."""
    from fermijit.jit import gpu as g

    op = "expert_matmul"
    on_device = g.is_device(x) or g.is_device(out)
    ids = ids.get() if g.is_device(ids) else ids
    n_tokens, hidden, top_k, n_experts, n_inter = _check(
        op, x, ids, weights, gate_up_qs, gate_up_d, down_qs, down_d, g.check_array)
    y = g.output(op, out, (n_tokens, hidden))
    with g.check(f"{op}: zeroing y"):
        g.driver().memset_d32(y.gpudata, 0, y.size)
    if n_tokens == 0:
        return g.result(op, y, out, on_device)
    routing = route(ids, weights.get() if g.is_device(weights) else weights, n_experts)
    h = g.empty((n_tokens * top_k, n_inter), np.float32)  # sorted slot order
    gate_up_gpu(g.to_device(op, "x", x, np.float32), routing,
                g.to_device(op, "gate_up_qs", gate_up_qs, np.uint8),
                g.to_device(op, "gate_up_d", gate_up_d, np.float16), h)
    down_gpu(h, routing, g.to_device(op, "down_qs", down_qs, np.uint8),
             g.to_device(op, "down_d", down_d, np.float16), y)
    return g.result(op, y, out, on_device)
