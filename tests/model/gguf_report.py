"""Issue 16 item 5, by hand: the default model through llama.cpp (GGUF, Q4_K_M) and back.

    python -m tests.model.gguf_report LLAMA_CPP_DIR LIBLLAMA_SO WORKDIR

The default model's HF checkpoint is not kept (fermijit/default_model is its 4-bit conversion),
so the checkpoint exported is the one the shipped weights dequantise to (fp32; Q4_0 and Q8_0
blocks are exact in fp32). From it: llama.cpp's converter (F32 GGUF), its quantizer (Q4_K_M and
Q4_0; tests/model/llama_quantize.py), fermijit's import of each, and fermijit's direct
conversion of the checkpoint; then `eval` of each on the held-out sample (a table on stdout).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from fermijit.engine import DEFAULT_MODEL
from fermijit.model import convert
from fermijit.model.config import FULL_ATTENTION
from fermijit.model.safetensors_io import save_file
from fermijit.model.weights import QuantTensor
from fermijit.ops import quant
from tests.model.gguf_data import _CONVERT_PINNED

SAMPLE = Path(__file__).parent / "data" / "heldout_sample.txt"


def dense(a) -> np.ndarray:
    if isinstance(a, QuantTensor):
        deq = quant.dequantize_q4_0 if a.kind == "q4_0" else quant.dequantize_q8_0
        return deq(np.asarray(a.qs), np.asarray(a.d)).astype(np.float32)
    return np.asarray(a, dtype=np.float32)


def export_hf(dst: Path) -> Path:
    """The default model as the fp32 HF checkpoint its weights dequantise to (text-only names)."""
    cfg, w, _ = convert.load_converted(DEFAULT_MODEL)
    t = cfg.text_config
    out = {"model.embed_tokens.weight": dense(w.embed_tokens), "model.norm.weight": dense(w.norm),
           "lm_head.weight": dense(w.lm_head)}
    for i, (layer, kind) in enumerate(zip(w.layers, t.layer_types)):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = dense(layer.input_layernorm)
        out[p + "post_attention_layernorm.weight"] = dense(layer.post_attention_layernorm)
        mixer = layer.mixer
        if kind == FULL_ATTENTION:
            for f in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                out[f"{p}self_attn.{f}.weight"] = dense(getattr(mixer, f))
        else:
            a = p + "linear_attn."
            for f in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"):
                out[f"{a}{f}.weight"] = dense(getattr(mixer, f))
            out[a + "conv1d.weight"] = dense(mixer.conv1d)[:, None, :]
            out[a + "A_log"], out[a + "dt_bias"] = dense(mixer.A_log), dense(mixer.dt_bias)
        m, Is = p + "mlp.", t.shared_expert_intermediate_size
        out[m + "gate.weight"] = dense(layer.mlp.gate)
        out[m + "experts.gate_up_proj"] = dense(layer.mlp.experts_gate_up)
        out[m + "experts.down_proj"] = dense(layer.mlp.experts_down)
        shared = dense(layer.mlp.shared_gate_up)
        out[m + "shared_expert.gate_proj.weight"] = shared[:Is]
        out[m + "shared_expert.up_proj.weight"] = shared[Is:]
        out[m + "shared_expert.down_proj.weight"] = dense(layer.mlp.shared_down)
        out[m + "shared_expert_gate.weight"] = dense(layer.mlp.shared_expert_gate)
    dst.mkdir(parents=True)
    save_file(dst / "model.safetensors", {k: np.ascontiguousarray(v) for k, v in out.items()},
              {"format": "pt"})
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(DEFAULT_MODEL / f, dst / f)
    return dst


def evaluate(model: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "fermijit", "eval", "--model", str(model),
                        "--text", str(SAMPLE), "--json"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout)


def main(argv: list[str]) -> None:
    from tests.model.llama_quantize import quantize

    llama_cpp, libllama, work = (Path(a).resolve() for a in argv)
    hf = export_hf(work / "default-hf")
    f32 = work / "default-f32.gguf"
    # The default tokenizer's split regex is Qwen2's: llama.cpp's `qwen2` pre-tokenizer.
    pinned = _CONVERT_PINNED.replace('"qwen35"', '"qwen2"')
    subprocess.run([sys.executable, "-c", pinned, str(llama_cpp), str(hf), "--outfile", str(f32),
                    "--outtype", "f32", "--no-mtp"], check=True)
    ggufs = {"F32": f32}
    for kind in ("Q4_K_M", "Q4_0"):
        ggufs[kind] = work / f"default-{kind.lower()}.gguf"
        quantize(str(libllama), str(f32), str(ggufs[kind]), kind, n_threads=2)
    models = {"fermijit convert (HF)": work / "fj-direct"}
    convert.convert(hf, models["fermijit convert (HF)"])
    for kind, path in ggufs.items():
        models[f"GGUF {kind} import"] = work / f"fj-{kind.lower()}"
        convert.convert(path, models[f"GGUF {kind} import"])
    rows = {name: evaluate(path) for name, path in models.items()}
    print(f"{'model':<24} {'GGUF MiB':>9} {'tokens':>7} {'mean NLL':>9} {'perplexity':>11}")
    for (name, r), path in zip(rows.items(), [None, *ggufs.values()]):
        size = f"{path.stat().st_size / 2**20:.2f}" if path else "-"
        print(f"{name:<24} {size:>9} {r['n_scored']:>7} {r['mean_nll']:>9.4f} "
              f"{r['perplexity']:>11.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
