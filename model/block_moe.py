"""The MoE block (MODEL.md §4) over experts kept in the GGUF's own block formats (a
Q4_K_M file's Q4_K gate/up, Q5_0/Q6_K/Q8_0 down projections), for the models ops/moe.py's fused
Q4_0 kernels cannot take.

    y = Σ_k w_k · down_e(silu(g) ⊙ u),  [g; u] = gate_up_e · x,   + σ(x · w_sg) · shared(x)

One product per expert that some token chose (ops/kquant_matvec.py for the block kinds, ops/matvec.py
for Q4_0/Q8_0), each on the tokens that chose it; the input is quantised once per format for all
the experts that read it. Decode (one token, routed experts in block kinds) runs each projection's
routed experts in one gathered launch (kquant_matvec.gathered) and the shared expert's in its
own: 4 launches a layer, where ops/moe.py's fused Q4_0 path also folds the SwiGLU and the sum.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit.model.weights import BlockTensor, QuantTensor
from fermijit.ops import kquant, kquant_matvec, matvec, moe


@dataclasses.dataclass(frozen=True)
class BlockExperts:
    """A layer's experts as loaded: each matrix a BlockTensor or a Q4_0/Q8_0 QuantTensor."""

    gate_up: BlockTensor | QuantTensor         # [E, 2I, H]  rows: gate I | up I
    down: BlockTensor | QuantTensor            # [E, H, I]
    shared_gate_up: BlockTensor | QuantTensor  # [2Is, H]
    shared_down: BlockTensor | QuantTensor     # [H, Is]
    shared_gate: np.ndarray                    # [H] fp32


def expert(w, e: int):
    """Expert e's matrix of a stacked [E, ...] weight."""
    if isinstance(w, BlockTensor):
        return BlockTensor(w.kind, w.blocks[e])
    return QuantTensor(w.kind, w.qs[e], w.d[e])


def _act_key(w) -> str:
    """Which activation rounding a matrix's product takes (kquant_matvec.quantize_for)."""
    if isinstance(w, BlockTensor):
        return "q8_k" if kquant_matvec.is_k_quant(kquant.FORMATS[w.kind]) else "q8_0"
    return "q8_0-" + matvec.default_isa(1).label  # matvec's own layout


class _Inputs:
    """x quantised once per activation kind, for every product that reads it."""

    def __init__(self, x: np.ndarray):
        self.x, self.made = x, {}

    def of(self, w):
        key = _act_key(w)
        if key not in self.made:
            if isinstance(w, BlockTensor):
                self.made[key] = kquant_matvec.quantize_for(kquant.FORMATS[w.kind], self.x)
            else:
                self.made[key] = matvec.quantize_act(self.x)
        return self.made[key]


def product(inputs: _Inputs, w) -> np.ndarray:
    """fp32 [T, R] = x · wᵀ for one expert matrix."""
    act = inputs.of(w)
    out = np.empty((inputs.x.shape[0], w.shape[0]), np.float32)
    if isinstance(w, BlockTensor):
        return kquant_matvec.cpu(kquant.FORMATS[w.kind], w.blocks, act, out=out)
    if w.kind == "q8_0":
        return matvec.q8_cpu(w.qs, w.d, act, out=out)
    return matvec.cpu(w.qs, w.d, act, out=out)


def _swiglu(inputs: _Inputs, gate_up, down) -> np.ndarray:
    return product(_Inputs(_silu_mul(product(inputs, gate_up))), down)


def _silu_mul(gu: np.ndarray) -> np.ndarray:
    """silu(g) ⊙ u of gu [n, 2I] = [g | u] -> [n, I], as ops/moe.py's kernels (decode's fused
    launch included) compute it."""
    h = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
    moe._swiglu_rows(np.ascontiguousarray(gu, dtype=np.float32), h)
    return h


# --- decode's fused launch ----------------------------------------------------------------------

def fused_formats(w: BlockExperts) -> tuple[kquant.Format, kquant.Format] | None:
    """(gate_up's, down's format) where decode's fused launch takes `w`: K-quant blocks in their
    own column order, the shared expert in the routed ones' kinds and shapes (a Q4_K_M file's
    are: one llama.cpp rule covers ffn_gate/up/down_exps and _shexp alike); else None."""
    mats = (w.gate_up, w.down, w.shared_gate_up, w.shared_down)
    if not all(isinstance(m, BlockTensor) and m.in_perm is None for m in mats):
        return None
    gu, dn = kquant.FORMATS[w.gate_up.kind], kquant.FORMATS[w.down.kind]
    if not (kquant_matvec.is_k_quant(gu) and kquant_matvec.is_k_quant(dn)):
        return None
    same = (w.shared_gate_up.kind == w.gate_up.kind and w.shared_down.kind == w.down.kind
            and w.shared_gate_up.blocks.shape == w.gate_up.blocks.shape[1:]
            and w.shared_down.blocks.shape == w.down.blocks.shape[1:])
    return (gu, dn) if same else None


@dataclasses.dataclass
class DecodeScratch:
    """The fused launch's buffers, one set for every layer: k routed experts and the shared."""

    gu: np.ndarray                       # [k + 1, 2I]
    h: np.ndarray                        # [k + 1, I]
    act_h: kquant_matvec.Q8KAct          # h in Q8_K
    routed: np.ndarray                   # [k + 1, H]

    @classmethod
    def make(cls, w: BlockExperts, top_k: int) -> "DecodeScratch":
        two_i, hidden = w.gate_up.shape[1], w.down.shape[1]
        h = np.zeros((top_k + 1, two_i // 2), np.float32)
        return cls(np.empty((top_k + 1, two_i), np.float32), h, kquant_matvec.quantize_act(h),
                   np.empty((top_k + 1, hidden), np.float32))


def decode_launch(x, act: kquant_matvec.Q8KAct, ids, weights, w: BlockExperts, out,
                  s: DecodeScratch):
    """The fused MoE of one token (kquant_matvec.moe_kernel), x [1, H] already in Q8_K (`act`),
    into out [1, H], for a caller that repeats it every token (model/forward.py's decode plan):
    (kernel, args). `fused_formats(w)` must hold."""
    gu_fmt, dn_fmt = fused_formats(w)
    kernel_ = kquant_matvec.moe_kernel(gu_fmt, dn_fmt, kquant_matvec.decode_isa())
    h = s.act_h
    return kernel_, (x, act.xq, act.d, act.bsums, ids, weights, w.gate_up.blocks,
                     w.shared_gate_up.blocks[None], w.down.blocks, w.shared_down.blocks[None],
                     w.shared_gate, s.gu, s.h, h.xq, h.d, h.bsums, s.routed, out)


def _routed_one_token(every: _Inputs, ids: np.ndarray, weights: np.ndarray, w: BlockExperts,
                      out: np.ndarray) -> None:
    """out[0] += Σ_k weights[k] · expert ids[k] of x[0]: each projection one gathered launch."""
    idx = np.ascontiguousarray(ids[0], dtype=np.int32)
    gu_fmt, down_fmt = kquant.FORMATS[w.gate_up.kind], kquant.FORMATS[w.down.kind]
    gu = kquant_matvec.gathered(gu_fmt, w.gate_up.blocks, idx, every.of(w.gate_up))  # [k, 2I]
    h = _silu_mul(gu)                                                                # [k, I]
    y = kquant_matvec.gathered(down_fmt, w.down.blocks, idx,
                               kquant_matvec.quantize_for(down_fmt, h))              # [k, H]
    out[0] += weights[0] @ y


def run(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, w: BlockExperts,
        out: np.ndarray) -> np.ndarray:
    """out [T, H] = the MoE block of x [T, H] fp32, routed by ids/weights [T, k]."""
    every = _Inputs(x)
    gate = np.float32(1) / (np.float32(1) + np.exp(-(x.astype(np.float64) @ w.shared_gate)))
    out[...] = gate.astype(np.float32)[:, None] * _swiglu(every, w.shared_gate_up, w.shared_down)
    if x.shape[0] == 1 and isinstance(w.gate_up, BlockTensor) and isinstance(w.down, BlockTensor):
        _routed_one_token(every, ids, weights, w, out)
        return out
    for e in np.unique(ids):
        t, k = np.nonzero(ids == e)                                       # a token picks e once
        # Every token (decode's one): its activations as quantised for the shared expert.
        inputs = every if t.size == x.shape[0] else _Inputs(np.ascontiguousarray(x[t]))
        y = _swiglu(inputs, expert(w.gate_up, e), expert(w.down, e))
        out[t] += weights[t, k, None] * y
    return out
