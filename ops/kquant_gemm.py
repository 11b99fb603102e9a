"""Prefill GEMMs over GGUF K-quant blocks on the GPU (issue 34): y = x · Wᵀ with W a BlockTensor
in Q4_K or Q6_K as imported (ops/kquant.py), dense or per expert, as ops/matmul.py and
ops/expert_matmul.py are for Q4_0.

Letters: T tokens (or slots), N output rows, K inputs (whole 256-blocks); blocks uint8
[N, K/256·S] (S the format's block bytes), experts [E, N, K/256·S].

`reference` is the spec: x (fp32, as given) times ops/kquant.py's `dequantize` (llama.cpp's
dequantize_row_*) in float64. `gpu`, `gate_up_gpu` and `down_gpu` are that in PTX
(kernels_ptx/kquant_gemm.ptx, q4_gemm.ptx's tiles, modes and epilogues): every weight dequantised
in registers to the spec's fp32 value bit for bit, products and sums in fp32. The GPU prefill
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

GPU_FORMATS = ("q4_k", "q6_k")  # the FORMATs kquant_gemm.ptx is rendered for
# Where a block array must start: Q4_K's rows are read 8 bytes at a time (a 144-byte block keeps
# 16-byte alignment), Q6_K's 2 (210 = 2·105).
ALIGN = {"q4_k": 16, "q6_k": 2}


def act_kind(kind: str) -> str:
    """How the CPU's product of weights of `kind` rounds its input: "q8_k" (the K-quants: 256-
    blocks, ops/kquant_matvec.quantize_act) or "q8_0" (Q4_0, Q8_0, Q5_0, Q5_1: 32-blocks)."""
    return "q8_k" if kind in ("q4_k", "q5_k", "q6_k") else "q8_0"


def _format(kind) -> kquant.Format:
    fmt = kquant.FORMATS[kind] if isinstance(kind, str) else kind
    if fmt.name not in GPU_FORMATS:
        raise FermijitError(f"kquant_gemm: no GPU kernel for {fmt.name} weights (it has "
                            f"{', '.join(GPU_FORMATS)})")
    return fmt


def reference(kind, x, blocks):
    """x [T, K] fp32 -> x · dequantize(blocks)ᵀ [T, N] fp32 (float64 inside)."""
    fmt = kquant.FORMATS[kind] if isinstance(kind, str) else kind
    w = kquant.dequantize(fmt, np.asarray(blocks)).astype(np.float64)
    return (np.asarray(x, np.float64) @ w.T).astype(np.float32)


def expert_reference(gu_kind, dn_kind, x, ids, weights, gate_up, down):
    """ops/expert_matmul.py `reference` with K-quant experts: gate_up [E, 2I, ...] (rows gate I |
    up I), down [E, H, ...] -> y [T, H] fp32 (float64 inside)."""
    gu_fmt, dn_fmt = (kquant.FORMATS[k] if isinstance(k, str) else k for k in (gu_kind, dn_kind))
    n_inter = gate_up.shape[1] // 2
    y = np.zeros(x.shape, np.float64)
    for e in np.unique(ids):
        t, k = np.nonzero(ids == e)
        gu = x[t].astype(np.float64) @ kquant.dequantize(gu_fmt, gate_up[e]).astype(np.float64).T
        g, u = gu[:, :n_inter], gu[:, n_inter:]
        h = g / (1.0 + np.exp(-g)) * u
        np.add.at(y, t, weights[t, k, None]
                  * (h @ kquant.dequantize(dn_fmt, down[e]).astype(np.float64).T))
    return y.astype(np.float32)


def _check_blocks(op, fmt, name, blocks, shape):
    from fermijit.jit import gpu as g

    g.check_array(op, name, blocks, np.uint8, shape)
    if g.is_device(blocks) and int(blocks.gpudata) % ALIGN[fmt.name]:
        raise FermijitError(f"{op}: {name} must start on a {ALIGN[fmt.name]}-byte boundary")


def gpu(kind, x, blocks, out=None):
    """`reference` on the GPU; arrays numpy or on the device (fermijit.jit.gpu)."""
    from fermijit.jit import gpu as g

    fmt = _format(kind)
    op = f"kquant_gemm {fmt.name}"
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, k = x.shape
    if k % kquant.QK_K or k == 0:
        raise FermijitError(f"{op}: x has {k} inputs, not whole {kquant.QK_K}-blocks")
    n = blocks.shape[0] if len(getattr(blocks, "shape", ())) == 2 else 0
    _check_blocks(op, fmt, "blocks", blocks, (n, fmt.n_bytes(k)))
    y = g.output(op, out, (n_tokens, n))
    if n_tokens and n:
        g.kernel("kquant_gemm", MODE="dense", FORMAT=fmt.name)(
            (-(-n // TILE_COLS), -(-n_tokens // TILE_ROWS)), (256,),
            g.to_device(op, "x", x, np.float32), g.to_device(op, "blocks", blocks, np.uint8), y,
            None, None, None, n_tokens, n, k)
    return g.result(op, y, out, on_device)


def gate_up_gpu(kind, x, routing: Routing, gate_up, h) -> None:
    """h [S, I] = silu(x[rows] Wgᵀ) ⊙ (x[rows] Wuᵀ) per expert (ops/expert_matmul.gate_up_gpu);
    device arrays (`gate_up` may be an address: an expert buffer's region)."""
    from fermijit.jit import gpu as g

    fmt = _format(kind)
    n_inter, hidden = h.shape[1], x.shape[1]
    if hidden % kquant.QK_K:
        raise FermijitError(f"kquant_gemm: {hidden} inputs are not whole {kquant.QK_K}-blocks")
    if isinstance(gate_up, int) and gate_up % ALIGN[fmt.name]:
        raise FermijitError(f"kquant_gemm: {fmt.name} experts at a misaligned address")
    g.kernel("kquant_gemm", MODE="expert_gate_up", FORMAT=fmt.name)(
        (-(-n_inter // GATE_UP_TILE_COLS), routing.n_tiles), (256,),
        x, gate_up, h, routing.tiles, routing.rows, None, 0, n_inter, hidden)


def down_gpu(kind, h, routing: Routing, down, y) -> None:
    """y[rows] += slot_weights · (h Wdᵀ) per expert (ops/expert_matmul.down_gpu); device arrays
    (`down` may be an address)."""
    from fermijit.jit import gpu as g

    fmt = _format(kind)
    n_inter, hidden = h.shape[1], y.shape[1]
    if n_inter % kquant.QK_K:
        raise FermijitError(f"kquant_gemm: {n_inter} inputs are not whole {kquant.QK_K}-blocks")
    if isinstance(down, int) and down % ALIGN[fmt.name]:
        raise FermijitError(f"kquant_gemm: {fmt.name} experts at a misaligned address")
    g.kernel("kquant_gemm", MODE="expert_down", FORMAT=fmt.name)(
        (-(-hidden // DOWN_TILE_COLS), routing.n_tiles), (256,),
        h, down, y, routing.tiles, routing.rows, routing.slot_weights, 0, hidden, n_inter)


def experts_gpu(gu_kind, dn_kind, x, ids, weights, gate_up, down, out=None):
    """`expert_reference` on the GPU (ops/expert_matmul.gpu's steps: the slots sorted on the
    host, gate_up with the SwiGLU, down's scatter-add into zeros); x, gate_up, down numpy or on
    the device, ids and weights on the host."""
    from fermijit.jit import gpu as g
    from fermijit.ops import expert_matmul

    op = "kquant_gemm experts"
    gu_fmt, dn_fmt = _format(gu_kind), _format(dn_kind)
    on_device = g.is_device(x) or g.is_device(out)
    g.check_array(op, "x", x, np.float32, ndim=2)
    n_tokens, hidden = x.shape
    if len(getattr(gate_up, "shape", ())) != 3:
        raise FermijitError(f"{op}: gate_up must be [E, 2I, bytes]")
    n_experts = gate_up.shape[0]
    n_inter = gate_up.shape[1] // 2
    if hidden % kquant.QK_K or n_inter % kquant.QK_K or n_inter == 0:
        raise FermijitError(f"{op}: H={hidden} and I={n_inter} must be non-zero multiples of "
                            f"{kquant.QK_K}")
    _check_blocks(op, gu_fmt, "gate_up", gate_up, (n_experts, 2 * n_inter,
                                                   gu_fmt.n_bytes(hidden)))
    _check_blocks(op, dn_fmt, "down", down, (n_experts, hidden, dn_fmt.n_bytes(n_inter)))
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
        gate_up_gpu(gu_fmt.name, g.to_device(op, "x", x, np.float32), routing,
                    g.to_device(op, "gate_up", gate_up, np.uint8), h)
        down_gpu(dn_fmt.name, h, routing, g.to_device(op, "down", down, np.uint8), y)
    return g.result(op, y, out, on_device)
