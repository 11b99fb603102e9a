"""`convert --quant q4_k_m` against llama.cpp on a model whose mix the test data cannot show
(tests/model/test_quant_mix.py's file has 8 experts, where llama.cpp's 8-expert rules apply, and
32-wide experts, where Q4_K falls back): 16 experts, 12 layers, everything 256 wide, so the
attn_v-like and ffn_down rules (use_more_bits over 12 blocks) pick Q6_K natively. The checkpoint
goes through llama.cpp's own converter (F32 GGUF) and `llama-quantize` Q4_K_M; fermijit converts
the same checkpoint with --quant q4_k_m and imports the GGUF; kinds and bytes compared per
tensor. Run by hand (as tests/model/gguf_data.py):

    python -m tests.model.quant_mix_check LLAMA_CPP_DIR LIBLLAMA_SO
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

from fermijit.model import convert
from tests.model import gguf_data, tiny
from tests.model.llama_quantize import quantize

WIDE16 = dataclasses.replace(tiny.UNIT, name="wide16", text_config={
    **tiny.TEXT_CONFIG, "hidden_size": 256, "num_hidden_layers": 12,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3, "num_experts": 16,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256})


def main(argv: list[str]) -> int:
    llama_cpp, libllama = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = gguf_data.write_checkpoint(tmp / "hf", WIDE16)
        gguf_data._to_gguf(llama_cpp, hf, tmp / "f32.gguf")
        quantize(str(libllama), str(tmp / "f32.gguf"), str(tmp / "q4_k_m.gguf"), "Q4_K_M")
        ours = convert.convert(hf, tmp / "ours", mix="q4_k_m", show_progress=False)
        theirs = convert.convert(tmp / "q4_k_m.gguf", tmp / "theirs", show_progress=False)
    bad = 0
    for name, entry in ours.tensors.items():
        other = theirs.tensors[name]
        same_bytes = entry.quant in ("f32", "f16") or entry.checksum == other.checksum
        if entry.quant != other.quant or not same_bytes:
            bad += 1
            print(f"{name}: ours {entry.quant}, llama.cpp's {other.quant}"
                  f"{'' if same_bytes else ', bytes differ'}")
    print(f"ours: {convert.describe(ours)}\nllama.cpp's: {convert.describe(theirs)}")
    print(f"{len(ours.tensors) - bad} of {len(ours.tensors)} tensors the same kind and bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
