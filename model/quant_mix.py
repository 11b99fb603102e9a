"""Quantisation mixes `convert --quant` writes (issue 34 item 5): which kind each weight field is
stored in.

  q4_0    fermijit's own (model/convert.py `quantisation`): Q4_0 matrices, the LM head Q6_K as
          llama.cpp's (`head_kind`: Q8_0 where its rows are not whole 256-blocks; `--lm-head`
          another), the embedding f16.
  q4_k_m  llama.cpp's Q4_K_M, as `llama-quantize` chooses it (src/llama-quant.cpp
          `llama_tensor_get_type`, the llama.cpp that llama-cpp-python 0.3.36 vendors: the one
          that made tests/model/data/gguf/wide-q4_k_m.gguf, which tests/model/test_quant_mix.py
          matches bit for bit), by llama.cpp's tensor names (model/gguf_io.py SOURCES):
          - every matrix Q4_K, the embedding (token_embd) included;
          - output (lm_head) Q6_K (Q8_0 where its rows are not whole 256-blocks; with tied
            embeddings token_embd is the output and takes its kind);
          - the attn_v-like tensors, attn_v (v_proj) and attn_qkv (the GDN's in_proj_qkv),
            counted in layer order (one per layer), and ffn_down (experts_down, shared_down) of
            layer i: Q6_K where use_more_bits(i, n) (the first and last eighth of the n layers
            and every third between);
          - models of 8 experts: attn_v-like and attn_k Q8_0, attn_output (o_proj) Q5_K;
          - a row that is not whole 256-blocks falls back: Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to
            Q8_0 (the default model, 384 wide, is mostly Q5_0 so).
          The MTP head is block n_layers (llama.cpp's nextn block after the layers: n counts it).
          One difference: llama.cpp quantises ssm_alpha/ssm_beta (in_proj_a/b) to Q4_K; fermijit
          keeps them fp32 in every model (they set the GDN's decay and update rate), as its GGUF
          import does; they are Hv x H (32 x 2048), 0.3 % of a layer's dense bytes.
Quantised as llama.cpp's reference quantisers round (ops/kquant_quantize.py), so such a model
is, tensor for tensor, the Q4_K_M llama.cpp writes from the same floats.
"""

from __future__ import annotations

from fermijit import FermijitError
from fermijit.ops.kquant import FORMATS, QK_K

MIXES = ("q4_0", "q4_k_m")
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}  # rows not whole 256-blocks
ATTN_V = ("v_proj", "in_proj_qkv")
FFN_DOWN = ("experts_down", "shared_down")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's: the first and last eighth of the layers, and every third between."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def _block(name: str, n_blocks: int) -> int:
    """A field's llama.cpp block: layers.<i>.* is i, the MTP head's (mtp.*) the last."""
    if name.startswith("layers."):
        return int(name.split(".")[1])
    if name.startswith("mtp."):
        return n_blocks - 1
    raise FermijitError(f"q4_k_m: {name} is in no layer")


def q4_k_m(name: str, shape: tuple[int, ...], base: str, n_blocks: int, n_experts: int,
           tied: bool) -> str:
    """The Q4_K_M kind of field `name` whose q4_0-mix kind is `base`; `n_blocks` llama.cpp's
    block count (the decoder layers, and the MTP head's), `tied` whether the LM head is the
    embedding."""
    if base in ("f32", "f16") and name != "embed_tokens":
        return base                                    # norms, gates, decays; the vision tower
    last = name.rsplit(".", 1)[-1]
    if name == "lm_head" or (name == "embed_tokens" and tied):
        return head_kind(shape)
    kind = "q4_k"
    if name != "embed_tokens":
        i = _block(name, n_blocks)
        if last in ATTN_V or last in FFN_DOWN:
            kind = "q6_k" if use_more_bits(i, n_blocks) else kind
        if n_experts == 8 and (last in ATTN_V or last == "k_proj"):
            kind = "q8_0"  # llama.cpp: "for the 8-expert model, bumping this to Q8_0 trades ~128MB"
        elif n_experts == 8 and last == "o_proj":
            kind = "q5_k"
    if kind in FORMATS and shape[-1] % FORMATS[kind].block_values:
        kind = FALLBACK[kind]
    return kind


def head_kind(shape: tuple[int, ...]) -> str:
    """The LM head's kind in either mix (llama.cpp's output.weight): Q6_K, Q8_0 where its rows
    are not whole 256-blocks. In the q4_0 mix (`convert --lm-head q8_0` keeps the Q8_0 head it
    had before): the full-size head, 28 % of a decode token's bytes in Q8_0, reads 0.77x the bytes
    in 0.67-0.75x the time (248320x2048, 2 threads, interleaved calls); the default model's
    held-out perplexity with its head in Q6_K +0.034 %, in Q4_0 +0.32 % (tests/model/
    head_report.py)."""
    return "q6_k" if shape[-1] % QK_K == 0 else "q8_0"


def quants(mix: str, shapes: dict[str, tuple[int, ...]], base: dict[str, str],
           n_layers: int, n_experts: int, tied: bool) -> dict[str, str]:
    """Every field's kind in `mix`, from the q4_0 mix's kinds `base`."""
    if mix not in MIXES:
        raise FermijitError(f"--quant must be one of {', '.join(MIXES)}, got {mix!r}")
    if mix == "q4_0":
        quants = dict(base)
        if "lm_head" in shapes:
            quants["lm_head"] = head_kind(shapes["lm_head"])
        return quants
    n_blocks = n_layers + any(name.startswith("mtp.") for name in shapes)
    return {name: q4_k_m(name, shape, base[name], n_blocks, n_experts, tied)
            for name, shape in shapes.items()}
