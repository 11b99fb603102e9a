"""The GPU prefill's arrays and sizes, computed on the host (no GPU needed): which weights stay
resident and in what form, the LM head split for the Q4_0 GEMM, the bytes a pass needs (what
fermijit/prefill/hybrid.py plans with), and the routing arrays the expert GEMMs read.

Dimension legend: as model/weights.py; T tokens in a pass, S = T·k routed slots.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.model.forward import Model
from fermijit.model.reap import moe_layers
from fermijit.model.weights import BlockTensor, GatedDeltaNetWeights, QuantTensor
from fermijit.ops import (attention, conv1d, expert_matmul, gated_delta, matvec, moe, quant,
                          router)

F32 = 4


def _q4(a) -> tuple[np.ndarray, np.ndarray]:
    """(qs, d) of a Q4_0 projection (Q4Matrix or QuantTensor)."""
    if isinstance(a, matvec.Q4Matrix):
        return a.qs, a.d_bits.view(np.float16)
    if isinstance(a, QuantTensor) and a.kind == "q4_0":
        return a.qs, a.d
    raise FermijitError("the GPU prefill needs a 4-bit (Q4_0) model")


def check_supported(model: Model) -> None:
    """FermijitError unless the PTX kernels take this model's shapes."""
    if not model.is_quantized:
        raise FermijitError("the GPU prefill needs a 4-bit model (convert it first); this one is "
                            "an fp32 checkpoint")
    # GGUF block kinds kept as imported (K-quants, Q5_0/Q5_1: issue 34) have CPU kernels only
    # so far: refused here, so the CPU prefills such a model rather than the GPU computing it
    # wrong.
    # (the MTP head's layer is layer L, after the model's L: model/reap.py moe_layers)
    mats = [("lm_head", model.lm_head)] + [
        (f"layers.{i}.{name}", getattr(w.mixer, name)) for i, w in enumerate(moe_layers(model))
        for name in ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj",
                     "o_proj") if hasattr(w.mixer, name)]
    if model.mtp is not None:
        mats.append(("mtp.fc", model.mtp.fc))
    blocks = [(name, m.kind.upper()) for name, m in mats if isinstance(m, BlockTensor)]
    blocks += [(f"layers.{i}.mlp", "non-Q4_0 expert") for i, w in enumerate(moe_layers(model))
               if not isinstance(w.experts, moe.MoeWeights)]
    if blocks:
        kinds = "/".join(sorted({kind for _, kind in blocks}))
        raise FermijitError(f"the GPU prefill has no kernels for {kinds} weights yet "
                            f"({len(blocks)} tensors of this model, e.g. {blocks[0][0]})")
    limits = [(model.head_dim in attention.GPU_HEAD_DIMS, f"head_dim {model.head_dim}",
               attention.GPU_HEAD_DIMS),
              (model.key_dim in gated_delta.GPU_KEY_DIMS, f"linear key dim {model.key_dim}",
               gated_delta.GPU_KEY_DIMS),
              (model.value_dim % gated_delta.GPU_VALUE_BLOCK == 0,
               f"linear value dim {model.value_dim}",
               f"multiples of {gated_delta.GPU_VALUE_BLOCK}"),
              (model.conv_taps in conv1d.GPU_TAPS, f"conv width {model.conv_taps}",
               conv1d.GPU_TAPS),
              (model.top_k <= router.GPU_MAX_TOP_K, f"top-{model.top_k} routing",
               f"at most {router.GPU_MAX_TOP_K}")]
    for ok, what, allowed in limits:
        if not ok:
            raise FermijitError(f"the GPU kernels do not take this model's {what} "
                                f"(they take {allowed})")


def dense_arrays(model: Model) -> list[dict[str, np.ndarray]]:
    """Per layer, the host arrays that stay resident on the GPU (names -> arrays); the MTP
    head's layer last where the model has one, with the head's fc and pre-fc norms."""
    check_supported(model)
    layers = []
    for w in moe_layers(model):
        m, e = w.mixer, w.experts
        a = {"input_norm": w.input_norm, "post_norm": w.post_norm, "router": w.router,
             "shared_gate": e.shared_gate[None],
             "shared_gate_up_qs": e.shared_gate_up_qs, "shared_gate_up_d": e.shared_gate_up_d,
             "shared_down_qs": e.shared_down_qs, "shared_down_d": e.shared_down_d}
        if isinstance(m, GatedDeltaNetWeights):
            for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
                a[f"{name}_qs"], a[f"{name}_d"] = _q4(getattr(m, name))
            a["w_ba"] = np.concatenate([np.asarray(m.in_proj_b, np.float32),
                                        np.asarray(m.in_proj_a, np.float32)])
            a.update(conv1d=m.conv1d, A_log=m.A_log, dt_bias=m.dt_bias, norm=m.norm)
        else:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                a[f"{name}_qs"], a[f"{name}_d"] = _q4(getattr(m, name))
            a.update(q_norm=m.q_norm, k_norm=m.k_norm)
        layers.append(a)
    if model.mtp is not None:
        h = model.mtp
        layers[-1]["fc_qs"], layers[-1]["fc_d"] = _q4(h.fc)
        layers[-1].update(pre_fc_norm_embedding=h.pre_fc_norm_embedding,
                          pre_fc_norm_hidden=h.pre_fc_norm_hidden)
    return layers


def head_arrays(model: Model) -> dict[str, np.ndarray]:
    """The LM head as the GPU runs it: Q4_0 as it is ("qs", "d"); Q8_0 split exactly into two
    Q4_0 matrices and a bias, as the PTX has Q4_0 GEMMs only. With u = q + 128 = 16 hi + lo
    (hi, lo nibbles), q d = (hi - 8)(16 d) + (lo - 8) d + 8 d, so
        head · x = Q4(hi, 16 d) · x + Q4(lo, d) · x + 8 Σ_b d_b Σ_{k in b} x_k,
    the last term a product of the scales (fp32 [V, K/32]) with x's block sums."""
    w = model.lm_head
    if isinstance(w, matvec.Q4Matrix):
        return {"qs": w.qs, "d": w.d_bits.view(np.float16)}
    if not (isinstance(w, QuantTensor) and w.kind == "q8_0"):
        raise FermijitError("the GPU prefill needs a Q4_0 or Q8_0 LM head")
    out = dict(zip(("hi_qs", "lo_qs"), quant.q8_0_nibbles_cpu(np.asarray(w.qs))))
    d = np.asarray(w.d, np.float16)
    out["hi_d"], out["lo_d"] = (d * np.float16(16)).astype(np.float16), d
    out["d32"] = d.astype(np.float32)
    k = w.qs.shape[1]
    blocks = np.zeros((k // quant.BLOCK, k), np.float32)                   # block sums of x
    blocks[np.arange(k) // quant.BLOCK, np.arange(k)] = 1
    out["block_sums"] = blocks
    return out


def head_bytes(model: Model) -> int:
    """Device bytes of `head_arrays(model)`, without making them."""
    w = model.lm_head
    if isinstance(w, matvec.Q4Matrix):
        return w.qs.nbytes + w.d_bits.nbytes
    rows, k = w.qs.shape
    nb = k // quant.BLOCK
    return rows * k + rows * nb * (2 + 2 + 4) + nb * k * 4


def activation_bytes(model: Model, n_tokens: int, with_head: bool = False) -> int:
    """Device bytes of one pass's intermediates over `n_tokens` (what `Workspace` holds, plus the
    GDN chunk scratch, the routed slots, xn rounded to 8 bits and the final norm's output);
    `with_head`: the MTP head's rows too (its hidden input and fc's [T, 2H] input)."""
    H, Hq, Hkv, D = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim
    Hk, Hv, dk, dv = model.n_key_heads, model.n_value_heads, model.key_dim, model.value_dim
    experts = model.layers[0].experts
    inter = experts.down_qs.shape[2] * 2
    shared_inter = experts.shared_down_qs.shape[2] * 2
    per_token = (4 * H + 4 * Hq * D + 2 * Hkv * D + 2 * model.conv_dim + 2 * Hv * dv
                 + 2 * Hk * dk + 2 * Hv * dv + 4 * Hv + model.n_experts
                 + model.top_k * (2 + inter + 2) + shared_inter + 3 + H
                 + (3 * H if with_head else 0))
    chunks = -(-n_tokens // gated_delta.GPU_CHUNK)
    gdn_scratch = Hv * chunks * gated_delta.GPU_CHUNK * (1 + 2 * gated_delta.GPU_CHUNK)
    rope_tables = n_tokens * model.rotary_dim
    return F32 * (n_tokens * per_token + gdn_scratch + rope_tables)


def state_bytes(model: Model, n_positions: int, with_head: bool = False) -> int:
    """Device bytes of the KV caches (for `n_positions`) and the GDN states; `with_head`: the
    MTP head's cache too (a full-attention layer's)."""
    total = 0
    for is_attention in model.is_attention + ((True,) if with_head else ()):
        if is_attention:
            total += 2 * model.n_kv_heads * n_positions * model.head_dim
        else:
            total += (model.conv_dim * (model.conv_taps - 1)
                      + model.n_value_heads * model.key_dim * model.value_dim)
    return F32 * total


def route_slots(ids: np.ndarray, weights: np.ndarray, n_experts: int):
    """expert_matmul.route's arrays, vectorised: (rows int32 [S] the token of each slot in
    expert order, slot weights fp32 [S], tiles int32 [n, 4] as expert_matmul.sort_slots)."""
    flat = ids.reshape(-1)
    # A stable sort of 16-bit keys is numpy's radix sort: 0.09 ms against 0.54 for int32 keys
    # (7,576 slots, REAP-128 at 947 tokens), on the routing's host path once per layer.
    order = np.argsort(flat.astype(np.int16) if n_experts <= 1 << 15 else flat, kind="stable")
    counts = np.bincount(flat, minlength=n_experts)
    ends = np.cumsum(counts)
    per_expert = -(-counts // expert_matmul.TILE_ROWS)                   # tiles per expert
    expert = np.repeat(np.arange(n_experts), per_expert)
    index = np.arange(expert.size) - np.repeat(np.cumsum(per_expert) - per_expert, per_expert)
    first = ends[expert] - counts[expert] + index * expert_matmul.TILE_ROWS
    tiles = np.stack([expert, first, np.minimum(first + expert_matmul.TILE_ROWS, ends[expert]),
                      np.zeros_like(expert)], axis=1).astype(np.int32)
    rows = (order // ids.shape[1]).astype(np.int32)
    return rows, weights.reshape(-1)[order].astype(np.float32), tiles
