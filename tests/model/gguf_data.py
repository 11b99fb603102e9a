"""The GGUF test data (tests/model/data/gguf/, README there): a tiny random Qwen3.6 checkpoint,
converted by llama.cpp's own `convert_hf_to_gguf.py` (F32) and quantised by its quantizer,
libllama's `llama_model_quantize` (Q4_0, Q8_0; tests/model/llama_quantize.py). Run once, by hand:

    python -m tests.model.gguf_data LLAMA_CPP_DIR LIBLLAMA_SO

The checkpoint is `tiny.UNIT` (seed 0), converted with `--no-mtp` (its lone `mtp.fc` tensor is
not a loadable MTP layer), with a tokenizer trained here whose pre-tokenizer is Qwen3.5's (the
`qwen35` split regex). llama.cpp identifies a BPE pre-tokenizer by hashing how a tokenizer splits
a fixed text, a hash only the published tokenizers have; the conversion is run with that lookup
answering `qwen35`, which is true of this tokenizer's pre-tokenizer. Nothing else of the
converter is touched.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.model import tiny

DATA = Path(__file__).parent / "data" / "gguf"
F32, Q4_0, Q8_0 = DATA / "tiny-f32.gguf", DATA / "tiny-q4_0.gguf", DATA / "tiny-q8_0.gguf"
# K-quants need rows of 256: the tiny model 256 wide, in Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 by tensor).
Q4_K_M = DATA / "wide-q4_k_m.gguf"
WIDE = dataclasses.replace(tiny.UNIT, name="wide",
                           text_config={**tiny.TEXT_CONFIG, "hidden_size": 256})
# Qwen3.5's split regex, as its tokenizer.json writes it (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35).
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
                r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONVERT_PINNED = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def write_tokenizer(directory: Path) -> None:
    """tiny's tokenizer (its corpus, special tokens, chat template), pre-tokenized as Qwen3.5."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=tiny.TOKENIZER_VOCAB,
                                  special_tokens=tiny.SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(tiny.CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "chat_template": tiny.CHAT_TEMPLATE}, indent=2))


def write_checkpoint(directory: Path, model: tiny.Model = tiny.UNIT) -> Path:
    """The HF checkpoint the GGUF files were made from (deterministic: seeded numpy)."""
    tiny.write_checkpoint(directory, model=model)
    write_tokenizer(directory)
    return directory


def _to_gguf(llama_cpp: Path, hf: Path, out: Path) -> None:
    subprocess.run([sys.executable, "-c", _CONVERT_PINNED, str(llama_cpp), str(hf),
                    "--outfile", str(out), "--outtype", "f32", "--no-mtp"], check=True)


def main(argv: list[str]) -> None:
    from tests.model.llama_quantize import quantize

    llama_cpp, libllama = Path(argv[0]).resolve(), Path(argv[1]).resolve()
    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _to_gguf(llama_cpp, write_checkpoint(Path(tmp) / "tiny-hf"), F32)
        for out, kind in ((Q4_0, "Q4_0"), (Q8_0, "Q8_0")):
            quantize(str(libllama), str(F32), str(out), kind)
        wide_f32 = Path(tmp) / "wide-f32.gguf"
        _to_gguf(llama_cpp, write_checkpoint(Path(tmp) / "wide-hf", WIDE), wide_f32)
        quantize(str(libllama), str(wide_f32), str(Q4_K_M), "Q4_K_M")
    for path in (F32, Q4_0, Q8_0, Q4_K_M):
        print(f"{path.name}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
