"""Prefill GEMMs over GGUF blocks on the GPU (issue 34): y = x · Wᵀ with W a BlockTensor as
imported (ops/kquant.py: the K-quants Q4_K and Q6_K, a Q4_K_M model's, Q5_K, a Q5_K_M's or an
8-expert Q4_K_M's, and the 32-value fallbacks Q5_0 and Q5_1 narrow rows take), or Q8_0 as
fermijit stores it ((qs, d)), dense or per expert, as ops/matmul.py and ops/expert_matmul.py
are for Q4_0.

Letters: T tokens (or slots), N output rows, K inputs (whole blocks of Q values); blocks uint8
[N, K/Q·S] (S the format's block bytes), experts [E, N, K/Q·S].

`reference` is the spec: x (fp32, as given) times ops/kquant.py's `dequantize` (llama.cpp's
dequantize_row_*; `dequantize` here adds Q8_0's) in float64. `gpu`, `gate_up_gpu` and
`down_gpu` are that in PTX (kernels_ptx/kquant_gemm.ptx, q4_gemm.ptx's tiles, modes and
epilogues): every weight dequantised in registers to the spec's fp32 value bit for bit, products
and sums in fp32. The GPU prefill
feeds them x already rounded as the CPU's product of the format rounds it (`act_kind`: Q8_K per
256 for the K-quants, ops/act_quant.py q8_k_gpu), so they then equal ops/kquant.py `reference`
(the CPU's integer sums) to fp32 rounding.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.jit.checks import check_array
from fermijit.ops import kquant
from fermijit.ops.expert_matmul import DOWN_TILE_COLS, GATE_UP_TILE_COLS, Routing
from fermijit.ops.matmul import TILE_COLS, TILE_ROWS

GPU_FORMATS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q8_0")  # the FORMATs kquant_gemm.ptx takes
# Q8_0 as fermijit stores it: qs int8 [..., K] and d fp16 [..., K/32], passed as (qs, d);
# its Format counts qs' bytes (32 a block).
Q8_0 = kquant.Format("q8_0", 32, 32, ())
FORMATS = {**kquant.FORMATS, "q8_0": Q8_0}
# Where an array of blocks must start: Q4_K's and Q5_K's rows are read 8 bytes at a time (144-
# and 176-byte blocks keep 16-byte alignment), Q5_1's and Q8_0's qs 8 (24, 32), Q6_K's and
# Q5_0's 2 (210, 22).
ALIGN = {"q4_k": 16, "q5_k": 16, "q6_k": 2, "q5_0": 2, "q5_1": 8, "q8_0": 8}


def _parts(w) -> tuple:
    """A weight as the kernel's (p_w, p_d): blocks or (blocks,) -> (blocks, None); Q8_0's (qs,
    d) as given."""
    if not isinstance(w, tuple):
        return w, None
    return (w[0], w[1]) if len(w) == 2 else (w[0], None)


def dequantize(kind, w) -> np.ndarray:
    """fp32 weights: ops/kquant.py's dequantize of blocks, or Q8_0's q·d of w = (qs, d)."""
    fmt = FORMATS[kind] if isinstance(kind, str) else kind
    if fmt is Q8_0:
        qs, d = w
        return (np.asarray(qs).astype(np.float32).reshape(*d.shape, 32)
                * np.asarray(d, np.float16).astype(np.float32)[..., None]).reshape(qs.shape)
    return kquant.dequantize(fmt, np.asarray(w))


def act_kind(kind: str) -> str:
    """How the CPU's product of weights of `kind` rounds its input: "q8_k" (the K-quants: 256-
    blocks, ops/kquant_matvec.quantize_act) or "q8_0" (Q4_0, Q8_0, Q5_0, Q5_1: 32-blocks)."""
    return "q8_k" if kind in ("q4_k", "q5_k", "q6_k") else "q8_0"


def _format(kind) -> kquant.Format:
    fmt = FORMATS[kind] if isinstance(kind, str) else kind
    if fmt.name not in GPU_FORMATS:
        raise FermijitError(f"kquant_gemm: no GPU kernel for {fmt.name} weights (it has "
                            f"{', '.join(GPU_FORMATS)})")
    return fmt


def reference(kind, x, w):
    """x [T, K] fp32 -> x · dequantize(w)ᵀ [T, N] fp32 (float64 inside); w blocks, or Q8_0's
    (qs, d)."""
    w = dequantize(kind, w).astype(np.float64)
    return (np.asarray(x, np.float64) @ w.T).astype(np.float32)


def expert_reference(gu_kind, dn_kind, x, ids, weights, gate_up, down):
    """ops/expert_matmul.py `reference` with K-quant experts: gate_up [E, 2I, ...] (rows gate I |
    up I), down [E, H, ...] -> y [T, H] fp32 (float64 inside)."""
    expert = lambda w, e: tuple(a[e] for a in w) if isinstance(w, tuple) else w[e]  # noqa: E731
    n_inter = _parts(gate_up)[0].shape[1] // 2
    y = np.zeros(x.shape, np.float64)
    for e in np.unique(ids):
        t, k = np.nonzero(ids == e)
        gu = x[t].astype(np.float64) @ dequantize(gu_kind, expert(gate_up, e)).astype(
            np.float64).T
        g, u = gu[:, :n_inter], gu[:, n_inter:]
        h = g / (1.0 + np.exp(-g)) * u
        np.add.at(y, t, weights[t, k, None]
                  * (h @ dequantize(dn_kind, expert(down, e)).astype(np.float64).T))
    return y.astype(np.float32)


def _device(op, fmt, name, w, rows: tuple, k: int) -> tuple:
    """w (blocks, or Q8_0's (qs, d); numpy or on the device) checked against rows x k inputs and
    on the device: (p_w, p_d)."""
    from fermijit.jit import gpu as g

    w, d = _parts(w)
    if fmt is Q8_0:
        g.check_array(op, f"{name} qs", w, np.int8, (*rows, k))
        g.check_array(op, f"{name} d", d, np.float16, (*rows, k // 32))
        d = g.to_device(op, f"{name} d", d, np.float16)
    else:
        g.check_array(op, name, w, np.uint8, (*rows, fmt.n_bytes(k)))
    w = g.to_device(op, name, w, w.dtype)
    if int(w.gpudata) % ALIGN[fmt.name]:
        raise FermijitError(f"{op}: {name} must start on a {ALIGN[fmt.name]}-byte boundary")
    return w, d


def _rows(w) -> int:
    return _parts(w)[0].shape[0] if len(getattr(_parts(w)[0], "shape", ())) == 2 else 0


def gpu(kind, x, w, out=None):
    """`reference` on the GPU; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    fmt = _format(kind)
    op = f"kquant_gemm {fmt.name}"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, k = x.shape
    if k % fmt.block_values or k == 0:
        raise FermijitError(f"{op}: x has {k} inputs, not whole {fmt.block_values}-blocks")
    n = _rows(w)
    p_w, p_d = _device(op, fmt, "w", w, (n,), k)
    y = g.output(op, out, (n_tokens, n))
    if n_tokens and n:
        g.kernel("kquant_gemm", MODE="dense", FORMAT=fmt.name)(
            (-(-n // TILE_COLS), -(-n_tokens // TILE_ROWS)), (256,),
            g.to_device(op, "x", x, np.float32), p_w, p_d, y, None, None, None, n_tokens, n, k)
    return g.result(op, y, out, on_device)


def _addresses(fmt, w) -> tuple:
    """Device arrays or addresses (an expert buffer's regions) as (p_w, p_d), alignment checked."""
    p_w, p_d = _parts(w)
    at = p_w if isinstance(p_w, int) else int(p_w.gpudata)
    if at % ALIGN[fmt.name]:
        raise FermijitError(f"kquant_gemm: {fmt.name} weights at a misaligned address")
    return p_w, p_d


def gate_up_gpu(kind, x, routing: Routing, gate_up, h) -> None:
    """h [S, I] = silu(x[rows] Wgᵀ) ⊙ (x[rows] Wuᵀ) per expert (ops/expert_matmul.gate_up_gpu);
    device arrays, or addresses (an expert buffer's regions); gate_up blocks or Q8_0's (qs, d)."""
    from fermijit.jit import gpu as g

    fmt = _format(kind)
    n_inter, hidden = h.shape[1], x.shape[1]
    if hidden % fmt.block_values:
        raise FermijitError(f"kquant_gemm: {hidden} inputs are not whole "
                            f"{fmt.block_values}-blocks")
    p_w, p_d = _addresses(fmt, gate_up)
    g.kernel("kquant_gemm", MODE="expert_gate_up", FORMAT=fmt.name)(
        (-(-n_inter // GATE_UP_TILE_COLS), routing.n_tiles), (256,),
        x, p_w, p_d, h, routing.tiles, routing.rows, None, 0, n_inter, hidden)


def down_gpu(kind, h, routing: Routing, down, y) -> None:
    """y[rows] += slot_weights · (h Wdᵀ) per expert (ops/expert_matmul.down_gpu); device arrays
    or addresses; down blocks or Q8_0's (qs, d)."""
    from fermijit.jit import gpu as g

    fmt = _format(kind)
    n_inter, hidden = h.shape[1], y.shape[1]
    if n_inter % fmt.block_values:
        raise FermijitError(f"kquant_gemm: {n_inter} inputs are not whole "
                            f"{fmt.block_values}-blocks")
    p_w, p_d = _addresses(fmt, down)
    g.kernel("kquant_gemm", MODE="expert_down", FORMAT=fmt.name)(
        (-(-hidden // DOWN_TILE_COLS), routing.n_tiles), (256,),
        h, p_w, p_d, y, routing.tiles, routing.rows, routing.slot_weights, 0, hidden, n_inter)


def experts_gpu(gu_kind, dn_kind, x, ids, weights, gate_up, down, out=None):
    """`expert_reference` on the GPU (ops/expert_matmul.gpu's steps: the slots sorted on the
    host, gate_up with the SwiGLU, down's scatter-add into zeros); x and the experts (blocks
    [E, ...], or Q8_0's (qs, d)) numpy or on the device, ids and weights on the host."""
    from fermijit.jit import gpu as g
    from fermijit.ops import expert_matmul

    op = "kquant_gemm experts"
    gu_fmt, dn_fmt = _format(gu_kind), _format(dn_kind)
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, hidden = x.shape
    first = _parts(gate_up)[0]
    if len(getattr(first, "shape", ())) != 3:
        raise FermijitError(f"{op}: gate_up must be [E, 2I, ...]")
    n_experts, n_inter = first.shape[0], first.shape[1] // 2
    if hidden % gu_fmt.block_values or n_inter % dn_fmt.block_values or n_inter == 0:
        raise FermijitError(f"{op}: H={hidden} and I={n_inter} must be non-zero multiples of "
                            f"their formats' blocks")
    gate_up = _device(op, gu_fmt, "gate_up", gate_up, (n_experts, 2 * n_inter), hidden)
    down = _device(op, dn_fmt, "down", down, (n_experts, hidden), n_inter)
    check_array(op, "ids", ids, np.int32, (n_tokens, None))
    check_array(op, "weights", weights, np.float32, ids.shape)
    if ids.size and (ids.min() < 0 or ids.max() >= n_experts):
        raise FermijitError(f"{op}: expert ids must be in [0, {n_experts})")
    y = g.output(op, out, (n_tokens, hidden))
    with g.check(f"{op}: zeroing y"):
        g.driver().memset_d32(y.gpudata, 0, y.size)
    if n_tokens:
        routing = expert_matmul.route(ids, weights, n_experts)
        h = g.empty((ids.size, n_inter), np.float32)
        gate_up_gpu(gu_fmt.name, g.to_device(op, "x", x, np.float32), routing, gate_up, h)
        down_gpu(dn_fmt.name, h, routing, down, y)
    return g.result(op, y, out, on_device)
