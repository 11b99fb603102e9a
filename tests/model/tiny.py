"""Tiny random Qwen3.6 checkpoints, built with numpy alone (no torch), seeded.

The structure is the real model's (MODEL.md §2-3, §7) at toy sizes: 4 layers (linear, linear,
linear, full), 8 experts with top-2, a shared expert, partial RoPE with theta 1e7, a one-block
vision tower and an MTP tensor, saved under the published names (`model.language_model.*`,
`model.visual.*`, `mtp.*`, `lm_head.weight`) with the published config.json layout. Every
parameter is random, norm offsets included: zero offsets would hide a 1+w vs w mix-up
(MODEL.md §8). Matrix inner dims are multiples of 32 so every matrix quantises to Q4_0 blocks.

Variants: expert layout "fused" (hub: experts.gate_up_proj [E, 2I, H]) or "split" (what
transformers' save_pretrained writes: experts.{e}.{gate,up,down}_proj.weight); dtype F32, F16
or BF16 (BF16 keeps A_log in F32, as the published files do); one file or `n_shards` shards.

Two models (`Model`): UNIT, every matrix scaled for unit-variance outputs, which makes the
network chaotic: it amplifies 4-bit noise (its W4A8 logits are 64% off transformers' over the
prompt, 88% in decode); and HF_INIT, weights at the HF initialiser's scale (std 0.02, hidden 128,
8 layers, 16 experts, top-4) under unit-scale embeddings, so the residual stream dominates each
layer's update as in a trained model: its W4A8 logits are 1.05% off (tests/model/test_forward.py).
With the embeddings at std 0.02 too (pure HF init), the final norm magnifies the layers' noise
again: measured 16% off. HF_INIT's layers barely move its logits, though (removing every GDN
output: 0.65%; tests/model/ablation.py), so it cannot tell a model missing parts from the right
one at a loose tolerance. SENSITIVE can (each part 11-39%), with weights on the 4-bit grid so
that W4A8 is compared tightly with transformers as the W4A8 oracle (tests/model/oracle.py);
HF_INIT_LONG takes long prompts; REAL_SHAPES has the real model's head and expert shapes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from fermijit.model.safetensors_io import SafetensorsWriter, f32_to_bf16

ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}

TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attn_output_gate": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "rope_parameters": ROPE_PARAMETERS,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "dtype": "float32",
}

HF_INIT_TEXT_CONFIG = {
    **TEXT_CONFIG,
    "hidden_size": 128,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
}

VISION_CONFIG = {
    "model_type": "qwen3_5_moe",  # sic: the published file says this (MODEL.md §2)
    "depth": 1,
    "hidden_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
    "initializer_range": 0.02,
    "deepstack_visual_indexes": [],
}


@dataclasses.dataclass(frozen=True)
class Model:
    """A tiny model: its text config and the scales of its random weights."""

    name: str
    text_config: dict
    weight_std: float | None  # std of matrix entries; None: 1/sqrt(fan_in), unit-variance outputs
    embed_std: float
    router_gain: float        # router scale over weight_std: spread logits, no near-ties in top-k
    norm_offset_std: float    # zero-centred norm offsets (scale 1 + w)
    # Scales of the sublayers' output matrices (o_proj, out_proj; experts' and shared expert's
    # down_proj): how far each sublayer moves the residual stream.
    attention_gain: float = 1.0
    gdn_gain: float = 1.0
    moe_gain: float = 1.0
    qk_norm_mean: float = 0.0  # q/k norm offsets' mean: sharper attention, so RoPE matters
    # Every quantised matrix on its format's grid (Q4_0, the LM head Q8_0) and the embedding in
    # fp16: converting then loses nothing, and W4A8 differs from fp32 by the 8-bit activations
    # alone, which a tight tolerance can hold.
    on_grid: bool = False
    mtp: bool = False  # the whole MTP head, not the lone mtp.fc most of these models carry
    vision_config: dict = dataclasses.field(default_factory=lambda: VISION_CONFIG)


UNIT = Model("unit", TEXT_CONFIG, None, 1.0, 2.0, 0.2)
HF_INIT = Model("hf-init", HF_INIT_TEXT_CONFIG, 0.02, 1.0, 1.0, 0.1)
# Each part moves the logits by 10-60% when removed (tests/model/test_sensitivity.py), yet the
# network is not chaotic: an 8-bit rounding flip stays small. Two attention layers of four, q/k
# norm scales around 2 (peaked scores, so RoPE matters), a decisive router (no near-ties for
# rounding to flip), norm offsets of 0.4 (ignoring one moves its sublayer's input by ~40%).
# Long enough a context for a prompt past the 512-token prefill block.
SENSITIVE = Model("sensitive", {
    **HF_INIT_TEXT_CONFIG,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "full_attention_interval": 2,
    "max_position_embeddings": 2048,
}, weight_std=None, embed_std=1.0, router_gain=4.0, norm_offset_std=0.4, attention_gain=0.3,
    gdn_gain=0.3, moe_gain=0.3, qk_norm_mean=1.0, on_grid=True)
# HF_INIT with room for a prompt past the 512-token prefill block: smooth enough that 8-bit
# rounding flips, which over a thousand tokens are certain, stay far below the tolerances
# (SENSITIVE's add up to 1e-2 there: tests/model/test_long_prompt.py).
HF_INIT_LONG = dataclasses.replace(HF_INIT, name="hf-init-long", text_config={
    **HF_INIT_TEXT_CONFIG, "max_position_embeddings": 2048})
# SENSITIVE with a context of 40,960 (issue 31 item 6): against transformers at 4096 tokens, and a
# snapshot at 30,000 (tests/model/test_long_context.py).
LONG_CONTEXT = dataclasses.replace(SENSITIVE, name="long-context", text_config={
    **SENSITIVE.text_config, "max_position_embeddings": 40_960})
# The real model's shapes where they matter to the kernels and the oracle: head_dim 256 with
# 16 query and 2 KV heads, 32 value heads on 16 key heads of 128, 128 experts top-8, a vocabulary
# past 65,536, RoPE theta 1e7 at positions past 4096; hidden 64 and two layers to stay small.
# HF-init scale and on the grid: W4A8 against the W4A8 oracle too.
REAL_SHAPES = Model("real-shapes", {
    **TEXT_CONFIG,
    "vocab_size": 65_600,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4224,
}, weight_std=0.02, embed_std=1.0, router_gain=1.0, norm_offset_std=0.1, on_grid=True)

# HF_INIT with its whole MTP head (MODEL.md §10): the head's tests and speculative decoding's.
MTP = dataclasses.replace(HF_INIT, name="hf-init-mtp", mtp=True)

# SENSITIVE with a tower whose output fits its hidden size, two blocks, a 6×6 position grid (so
# the interpolation resamples both up and down): the oracle of prompts with images
# (tests/model/vision_oracle.py).
VISION = dataclasses.replace(SENSITIVE, name="vision", vision_config={
    **VISION_CONFIG, "depth": 2, "out_hidden_size": SENSITIVE.text_config["hidden_size"],
    "num_position_embeddings": 36})


def config_dict(model: Model = UNIT) -> dict:
    """config.json, laid out as the published Qwen3.6-35B-A3B file."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": model.text_config,
        "vision_config": model.vision_config,
        "image_token_id": 310,
        "video_token_id": 311,
        "vision_start_token_id": 312,
        "vision_end_token_id": 313,
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
    }


def random_weights(seed: int = 0, model: Model = UNIT) -> dict[str, np.ndarray]:
    """fp32 tensors under the hub names (fused experts), at `model`'s scales."""
    t, v = model.text_config, model.vision_config
    rng = np.random.default_rng(seed)
    H, V, E = t["hidden_size"], t["vocab_size"], t["num_experts"]
    I, Is = t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    D, Hq, Hkv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    Hk, Hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, Kc = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    C = 2 * Hk * dk + Hv * dv

    def linear(*shape):  # [..., out, in]
        if model.weight_std is None:  # unit-variance outputs for unit-variance inputs
            return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(model.weight_std)

    def offset(n):  # zero-centred norm weights: effective scale 1 + w
        return np.float32(model.norm_offset_std) * rng.standard_normal(n, dtype=np.float32)

    w: dict[str, np.ndarray] = {}
    p = "model.language_model."
    w[p + "embed_tokens.weight"] = (np.float32(model.embed_std)
                                    * rng.standard_normal((V, H), dtype=np.float32))

    def layer(q: str, kind: str) -> None:  # decoder layer weights under prefix q
        w[q + "input_layernorm.weight"] = offset(H)
        w[q + "post_attention_layernorm.weight"] = offset(H)
        if kind == "full_attention":
            a = q + "self_attn."
            w[a + "q_proj.weight"] = linear(Hq * 2 * D, H)
            w[a + "k_proj.weight"] = linear(Hkv * D, H)
            w[a + "v_proj.weight"] = linear(Hkv * D, H)
            w[a + "o_proj.weight"] = np.float32(model.attention_gain) * linear(H, Hq * D)
            w[a + "q_norm.weight"] = offset(D) + np.float32(model.qk_norm_mean)
            w[a + "k_norm.weight"] = offset(D) + np.float32(model.qk_norm_mean)
        else:
            a = q + "linear_attn."
            w[a + "in_proj_qkv.weight"] = linear(C, H)
            w[a + "in_proj_z.weight"] = linear(Hv * dv, H)
            w[a + "in_proj_b.weight"] = linear(Hv, H)
            w[a + "in_proj_a.weight"] = linear(Hv, H)
            w[a + "conv1d.weight"] = linear(C, 1, Kc)
            w[a + "A_log"] = np.log(rng.uniform(1, 16, Hv)).astype(np.float32)  # HF's A range
            w[a + "dt_bias"] = rng.uniform(-1, 1, Hv).astype(np.float32)
            w[a + "norm.weight"] = 1 + offset(dv)  # a plain weight around 1
            w[a + "out_proj.weight"] = np.float32(model.gdn_gain) * linear(H, Hv * dv)
        m = q + "mlp."
        w[m + "gate.weight"] = np.float32(model.router_gain) * linear(E, H)
        w[m + "experts.gate_up_proj"] = linear(E, 2 * I, H)
        w[m + "experts.down_proj"] = np.float32(model.moe_gain) * linear(E, H, I)
        w[m + "shared_expert.gate_proj.weight"] = linear(Is, H)
        w[m + "shared_expert.up_proj.weight"] = linear(Is, H)
        w[m + "shared_expert.down_proj.weight"] = np.float32(model.moe_gain) * linear(H, Is)
        w[m + "shared_expert_gate.weight"] = linear(1, H)
    for i, kind in enumerate(t["layer_types"]):
        layer(f"{p}layers.{i}.", kind)
    w[p + "norm.weight"] = offset(H)
    w["lm_head.weight"] = linear(V, H)

    Hvis, Ivis, P = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged, out = Hvis * v["spatial_merge_size"] ** 2, v["out_hidden_size"]
    s = "model.visual."
    w[s + "patch_embed.proj.weight"] = linear(Hvis, v["in_channels"], v["temporal_patch_size"],
                                              P, P)
    w[s + "patch_embed.proj.bias"] = offset(Hvis)
    w[s + "pos_embed.weight"] = rng.standard_normal((v["num_position_embeddings"], Hvis),
                                                    dtype=np.float32)
    for b in range(v["depth"]):
        k = f"{s}blocks.{b}."
        for name, shape in (("norm1", (Hvis,)), ("norm2", (Hvis,))):
            w[k + name + ".weight"], w[k + name + ".bias"] = 1 + offset(shape), offset(shape)
        for name, (o, i_) in (("attn.qkv", (3 * Hvis, Hvis)), ("attn.proj", (Hvis, Hvis)),
                              ("mlp.linear_fc1", (Ivis, Hvis)), ("mlp.linear_fc2", (Hvis, Ivis))):
            w[k + name + ".weight"], w[k + name + ".bias"] = linear(o, i_), offset(o)
    w[s + "merger.norm.weight"], w[s + "merger.norm.bias"] = 1 + offset(Hvis), offset(Hvis)
    w[s + "merger.linear_fc1.weight"], w[s + "merger.linear_fc1.bias"] = (linear(merged, merged),
                                                                          offset(merged))
    w[s + "merger.linear_fc2.weight"], w[s + "merger.linear_fc2.bias"] = (linear(out, merged),
                                                                          offset(out))
    # One MTP tensor: present in published files, ignored by transformers; the whole head
    # (MODEL.md §10) with `mtp`, drawn after the rest, which keeps the rest's values.
    w["mtp.fc.weight"] = linear(H, 2 * H)
    if model.mtp:
        w["mtp.pre_fc_norm_embedding.weight"] = offset(H)
        w["mtp.pre_fc_norm_hidden.weight"] = offset(H)
        layer("mtp.layers.0.", "full_attention")
        w["mtp.norm.weight"] = offset(H)
    return on_grid(w) if model.on_grid else w


def on_grid(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights the converter stores, as fp32: each quantised matrix quantised and dequantised
    (on its grid, quantising it again is exact), the embedding through fp16."""
    from fermijit.ops import quant

    def snap(a, kind):
        if kind == "q8_0":
            return quant.dequantize_q8_0(*quant.quantize_q8_0(a))
        return quant.dequantize_q4_0(*quant.quantize_q4_0(a))

    # model/convert.py's Q4_0_FIELDS under their checkpoint names
    hf_q4 = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
             "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj",
             "shared_expert.up_proj", "shared_expert.down_proj")
    out = {}
    for name, a in w.items():
        if not name.startswith("model.language_model.") and name != "lm_head.weight":
            out[name] = a
        elif name == "lm_head.weight":
            out[name] = snap(a, "q8_0")
        elif name.endswith("embed_tokens.weight"):
            out[name] = a.astype(np.float16).astype(np.float32)
        elif any(f".{k}" in name for k in hf_q4):
            out[name] = snap(a, "q4_0")
        else:
            out[name] = a
    return out


def split_experts(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-expert layout that transformers' save_pretrained writes (MODEL.md §3)."""
    out = {}
    for name, a in w.items():
        if name.endswith("experts.gate_up_proj"):
            base, half = name[:-len("gate_up_proj")], a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = a[e, :half]
                out[f"{base}{e}.up_proj.weight"] = a[e, half:]
        elif name.endswith("experts.down_proj"):
            base = name[:-len("down_proj")]
            for e in range(a.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = a[e]
        else:
            out[name] = a
    return out


def stored_dtype(name: str, dtype: str) -> str:
    """BF16 files keep A_log in F32, as the published checkpoint does (MODEL.md §3)."""
    return "F32" if dtype == "BF16" and name.endswith("A_log") else dtype


def as_stored(a: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 values rounded as `dtype` storage would round them, back in fp32."""
    if dtype == "BF16":
        return (f32_to_bf16(a).astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float16).astype(np.float32) if dtype == "F16" else a


# The tokenizer: byte-level BPE (as Qwen's), trained here since nothing can be downloaded. The
# special tokens' ids match the config: bos 1, eos 2 (config) and [2, 3] (generation_config).
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"]
TOKENIZER_VOCAB = 300  # <= vocab_size: the model's vocabulary is padded, as the real one's is
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for a tiny model.",
    "In the beginning was the word, and the word was a token.",
    "fermijit runs Qwen on old hardware: a Westmere CPU and a Fermi GPU.",
    "the cat sat on the mat; the dog sat on the log.",
] * 4
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tokenizer(directory: str | Path) -> None:
    """tokenizer.json and tokenizer_config.json (with a small ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    directory = Path(directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))


def write_checkpoint(directory: str | Path, expert_layout: str = "fused", dtype: str = "F32",
                     n_shards: int = 1, seed: int = 0, model: Model = UNIT,
                     weights: dict[str, np.ndarray] | None = None) -> Path:
    """A checkpoint directory (config.json, generation_config.json, tokenizer files,
    safetensors); returns it. `weights` (fused hub names, fp32) replace the random ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    w = random_weights(seed, model) if weights is None else weights
    if expert_layout == "split":
        w = split_experts(w)
    elif expert_layout != "fused":
        raise ValueError(expert_layout)
    (directory / "config.json").write_text(json.dumps(config_dict(model), indent=2))
    write_tokenizer(directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 2}, indent=2))
    names = sorted(w)
    shards = [names[k::n_shards] for k in range(n_shards)]  # round-robin: layers straddle files
    files = (["model.safetensors"] if n_shards == 1 else
             [f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors" for k in range(n_shards)])
    for shard, file in zip(shards, files):
        specs = [(n, stored_dtype(n, dtype), w[n].shape) for n in shard]
        with SafetensorsWriter(directory / file, specs, {"format": "pt"}) as out:
            for n, st_dtype, _ in specs:
                a = w[n]
                out.write(n, f32_to_bf16(a) if st_dtype == "BF16" else a.astype(
                    np.float16 if st_dtype == "F16" else np.float32))
    if n_shards > 1:
        total = sum(a.nbytes for a in w.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for shard, f in zip(shards, files) for n in shard}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory

