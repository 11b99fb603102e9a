"""The GPU prefill's arrays and sizes, computed on the host (no GPU needed): which weights stay
resident and in what form, the LM head split for the Q4_0 GEMM, the bytes a pass needs (what
fermijit/prefill/hybrid.py plans with), and the routing arrays the expert GEMMs read.

A projection is Q4_0 (`<name>_qs`, `<name>_d`, kernels_ptx/q4_gemm.ptx), or Q8_0 (`_qs`, `_d`)
or GGUF blocks as imported (`<name>_blocks`) for kernels_ptx/kquant_gemm.ptx (ops/kquant_gemm.py
GPU_FORMATS: what a Q4_K_M model holds, Q4_K and Q6_K, Q5_K_M's Q5_K, and the fallbacks Q5_0,
Q5_1, Q8_0);
`dense_kinds` says which, per layer (issue 34).

Dimension legend: as model/weights.py; T tokens in a pass, S = T·k routed slots.
"""

from __future__ import annotations

import numpy as np

from fermijit import FermijitError
from fermijit.model.forward import Model
from fermijit.model.reap import moe_layers
from fermijit.model.block_moe import BlockExperts
from fermijit.model.weights import BlockTensor, GatedDeltaNetWeights, QuantTensor
from fermijit.ops import (attention, conv1d, expert_matmul, gated_delta, kquant_gemm, matvec, moe,
                          router)

F32 = 4


MIXER = ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj")


def kind(a) -> str | None:
    """The GPU GEMM a projection takes: "q4_0" (q4_gemm.ptx), "q8_0" or a block kind of
    kquant_gemm.GPU_FORMATS in its own column order (kquant_gemm.ptx), or None (no kernel)."""
    if isinstance(a, matvec.Q4Matrix) or (isinstance(a, QuantTensor) and a.kind == "q4_0"):
        return "q4_0"
    if isinstance(a, QuantTensor) and a.kind == "q8_0":
        return "q8_0"
    if isinstance(a, BlockTensor) and a.kind in kquant_gemm.GPU_FORMATS and a.in_perm is None:
        return a.kind
    return None


def _label(a) -> str:
    """What a projection without a GPU kernel is, for the refusal."""
    if isinstance(a, BlockTensor):
        return a.kind.upper() + (" (columns permuted)" if a.in_perm is not None else "")
    if isinstance(a, QuantTensor):
        return a.kind.upper()
    return "fp32"


def _arrays(name: str, a) -> dict[str, np.ndarray]:
    """A projection's resident arrays: `<name>_qs`, `<name>_d` (Q4_0) or `<name>_blocks`."""
    k = kind(a)
    if k == "q4_0":
        if isinstance(a, matvec.Q4Matrix):
            return {f"{name}_qs": a.qs, f"{name}_d": a.d_bits.view(np.float16)}
        return {f"{name}_qs": a.qs, f"{name}_d": a.d}
    if k is None:
        raise FermijitError(f"the GPU prefill has no kernel for {_label(a)} weights ({name})")
    if k == "q8_0":
        return {f"{name}_qs": a.qs, f"{name}_d": a.d}
    return {f"{name}_blocks": a.blocks}


def expert_matrices(e) -> dict[str, object]:
    """A layer's expert matrices by name: routed gate_up, down, shared_gate_up, shared_down
    (QuantTensor or BlockTensor; ops/moe.py's Q4_0 MoeWeights as QuantTensors, the shared
    expert's [1, ...] arrays as they are)."""
    if isinstance(e, moe.MoeWeights):
        return {"gate_up": QuantTensor("q4_0", e.gate_up_qs, e.gate_up_d),
                "down": QuantTensor("q4_0", e.down_qs, e.down_d),
                "shared_gate_up": QuantTensor("q4_0", e.shared_gate_up_qs, e.shared_gate_up_d),
                "shared_down": QuantTensor("q4_0", e.shared_down_qs, e.shared_down_d)}
    if isinstance(e, BlockExperts):
        return {"gate_up": e.gate_up, "down": e.down, "shared_gate_up": e.shared_gate_up,
                "shared_down": e.shared_down}
    return {}


def expert_dims(e) -> tuple[int, int]:
    """(I, Is): the routed and the shared experts' intermediate widths."""
    m = expert_matrices(e)
    return m["down"].shape[-1], m["shared_down"].shape[-1]


def _projections(model: Model) -> list[tuple[str, object]]:
    """(name, matrix) of every projection the GPU prefill multiplies by, the experts' included."""
    mats = [("lm_head", model.lm_head)]
    for i, w in enumerate(moe_layers(model)):
        mats += [(f"layers.{i}.{name}", getattr(w.mixer, name)) for name in MIXER
                 if hasattr(w.mixer, name)]
        experts = expert_matrices(w.experts)
        if not experts:
            mats.append((f"layers.{i}.mlp", w.experts.gate_up))  # fp32 experts
        mats += [(f"layers.{i}.mlp.{name}", m) for name, m in experts.items()]
    if model.mtp is not None:
        mats.append(("mtp.fc", model.mtp.fc))
    return mats


def has_k_quants(model: Model) -> bool:
    """Whether some projection takes K-quant activations (Q8_K per 256: a second rounded copy
    of the layers' input)."""
    return any(kquant_gemm.act_kind(kind(m) or "") == "q8_k" for _, m in _projections(model))


def check_supported(model: Model) -> None:
    """FermijitError unless the PTX kernels take this model's shapes."""
    if not model.is_quantized:
        raise FermijitError("the GPU prefill needs a 4-bit model (convert it first); this one is "
                            "an fp32 checkpoint")
    # What has CPU kernels only so far (blocks read in a permuted column order):
    # refused here, so the CPU prefills such a model rather than the GPU computing it wrong.
    # (The MTP head's layer is layer L, after the model's L: model/reap.py moe_layers.)
    refused = [(name, _label(m)) for name, m in _projections(model) if kind(m) is None]
    if refused:
        kinds = "/".join(sorted({k for _, k in refused}))
        raise FermijitError(f"the GPU prefill has no kernels for {kinds} weights yet "
                            f"({len(refused)} tensors of this model, e.g. {refused[0][0]})")
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
        experts = expert_matrices(e)
        a = {"input_norm": w.input_norm, "post_norm": w.post_norm, "router": w.router,
             "shared_gate": e.shared_gate[None]}
        for name in ("shared_gate_up", "shared_down"):
            a.update(_arrays(name, experts[name]))
        if isinstance(m, GatedDeltaNetWeights):
            for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
                a.update(_arrays(name, getattr(m, name)))
            a["w_ba"] = np.concatenate([np.asarray(m.in_proj_b, np.float32),
                                        np.asarray(m.in_proj_a, np.float32)])
            a.update(conv1d=m.conv1d, A_log=m.A_log, dt_bias=m.dt_bias, norm=m.norm)
        else:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                a.update(_arrays(name, getattr(m, name)))
            a.update(q_norm=m.q_norm, k_norm=m.k_norm)
        layers.append(a)
    if model.mtp is not None:
        h = model.mtp
        layers[-1].update(_arrays("fc", h.fc))
        layers[-1].update(pre_fc_norm_embedding=h.pre_fc_norm_embedding,
                          pre_fc_norm_hidden=h.pre_fc_norm_hidden)
    return layers


def dense_kinds(model: Model) -> list[dict[str, str]]:
    """Per layer (as `dense_arrays`), the GEMM kind of each projection by name (`kind`), the
    experts' as "gate_up", "down", "shared_gate_up", "shared_down"."""
    out = []
    for w in moe_layers(model):
        kinds = {name: kind(getattr(w.mixer, name)) for name in MIXER if hasattr(w.mixer, name)}
        kinds.update({name: kind(m) for name, m in expert_matrices(w.experts).items()})
        out.append(kinds)
    if model.mtp is not None:
        out[-1]["fc"] = kind(model.mtp.fc)
    return out


def head_arrays(model: Model) -> dict[str, np.ndarray]:
    """The LM head as the GPU runs it, as stored: Q4_0 ("qs", "d": ops/matmul.py), Q8_0 ("qs",
    "d": kquant_gemm.ptx's Q8_0 GEMM), or GGUF blocks ("blocks", issue 34). (A Q8_0 head was
    split into two Q4_0 matrices on the CPU at every start: 0.15-0.85 s of the server's start,
    issue 28 item 4.)"""
    w = model.lm_head
    if isinstance(w, matvec.Q4Matrix):
        return {"qs": w.qs, "d": w.d_bits.view(np.float16)}
    if isinstance(w, BlockTensor) and kind(w) is not None:  # GGUF blocks as they are (issue 34)
        return {"blocks": w.blocks}
    if not (isinstance(w, QuantTensor) and w.kind == "q8_0"):
        raise FermijitError("the GPU prefill needs a Q4_0 or Q8_0 LM head")
    return {"qs": w.qs, "d": np.asarray(w.d, np.float16)}


def head_kind(model: Model) -> str:
    """The GEMM kind of `head_arrays(model)` (q4_0, q8_0, or the blocks' format)."""
    w = model.lm_head
    return "q4_0" if isinstance(w, matvec.Q4Matrix) else w.kind


def head_bytes(model: Model) -> int:
    """Device bytes of `head_arrays(model)`, without making them."""
    w = model.lm_head
    if isinstance(w, matvec.Q4Matrix):
        return w.qs.nbytes + w.d_bits.nbytes
    if isinstance(w, BlockTensor):
        return w.blocks.nbytes
    return w.qs.nbytes + w.d.size * 2


def activation_bytes(model: Model, n_tokens: int, with_head: bool = False) -> int:
    """Device bytes of one pass's intermediates over `n_tokens` (what `Workspace` holds, plus the
    GDN chunk scratch, the routed slots, xn rounded to 8 bits and the final norm's output);
    `with_head`: the MTP head's rows too (its hidden input and fc's [T, 2H] input)."""
    H, Hq, Hkv, D = model.hidden, model.n_heads, model.n_kv_heads, model.head_dim
    Hk, Hv, dk, dv = model.n_key_heads, model.n_value_heads, model.key_dim, model.value_dim
    inter, shared_inter = expert_dims(model.layers[0].experts)
    per_token = (4 * H + 4 * Hq * D + 2 * Hkv * D + 2 * model.conv_dim + 2 * Hv * dv
                 + 2 * Hk * dk + 2 * Hv * dv + 4 * Hv + model.n_experts
                 + model.top_k * (2 + inter + 2) + shared_inter + 3 + H
                 + (3 * H if with_head else 0)
                 + (H if has_k_quants(model) else 0))     # xn rounded to Q8_K too
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
