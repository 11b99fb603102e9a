"""`convert --quant q4_k_m` (model/quant_mix.py, ops/kquant_quantize.py): the 256-wide tiny
checkpoint converted to Q4_K_M by fermijit is the Q4_K_M llama.cpp made of it
(tests/model/data/gguf/wide-q4_k_m.gguf: its converter to F32, then `llama-quantize`), kind for
kind and byte for byte; and the real model's mix, counted from llama.cpp's rule by hand."""

import pytest

from fermijit.model import convert, quant_mix, synth
from fermijit.model.config import parse_config
from fermijit.model.weights import text_weight_shapes
from tests.cli import run_cli
from tests.model import gguf_data


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant_mix")
    hf = gguf_data.write_checkpoint(tmp / "wide-hf", gguf_data.WIDE)
    ours = convert.convert(hf, tmp / "ours", mix="q4_k_m", show_progress=False)
    theirs = convert.convert(gguf_data.Q4_K_M, tmp / "theirs", show_progress=False)
    return ours, theirs


def test_q4_k_m_is_llama_cpps_file(both):
    ours, theirs = both
    assert ours.mix == "q4_k_m" and theirs.mix is None
    floats = {"f32", "f16"}
    kinds = {}
    for name, entry in ours.tensors.items():
        other = theirs.tensors[name]
        assert entry.quant == other.quant, name
        kinds[entry.quant] = kinds.get(entry.quant, 0) + 1
        if entry.quant not in floats:  # the GGUF's floats went through its F32 file, some
            assert entry.checksum == other.checksum, name  # dequantised: compared no further
    # 8 experts: attn_v-like and ffn_down of the later layers Q8_0, attn_output Q5_K -> Q5_1;
    # 32-wide down projections Q4_K -> Q5_0, the head Q6_K.
    assert {k: n for k, n in kinds.items() if k not in floats} == {
        "q4_k": 13, "q5_0": 7, "q5_1": 1, "q6_k": 1, "q8_0": 9}


def test_real_models_mix():
    """Qwen3.6-35B-A3B with its MTP head: 41 llama.cpp blocks; use_more_bits(i, 41) holds for
    blocks 0-4, 7, 10, ..., 34 and 35-40 (21), each with one attn_v-like tensor (v_proj or the
    GDN's in_proj_qkv) and two down projections in Q6_K; the head Q6_K; every other matrix Q4_K;
    the decays and gates fp32 as in every fermijit model."""
    t = parse_config(synth.config_for("qwen3.6-35b-a3b")).text_config
    shapes = text_weight_shapes(t, mtp=True)
    quants = convert.mix_quants(t, shapes, "q4_k_m")
    more = [i for i in range(41) if quant_mix.use_more_bits(i, 41)]
    assert more == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39, 40]
    q6 = sorted(n for n, q in quants.items() if q == "q6_k")
    assert len(q6) == 3 * 21 + 1 and "lm_head" in q6 and "mtp.layers.0.self_attn.v_proj" in q6
    assert quants["layers.3.self_attn.v_proj"] == "q6_k"       # attention layer 3: block 3
    assert quants["layers.5.linear_attn.in_proj_qkv"] == "q4_k"
    assert quants["layers.7.mlp.experts_down"] == "q6_k"
    assert quants["embed_tokens"] == "q4_k" and quants["mtp.fc"] == "q4_k"
    assert quants["layers.0.linear_attn.in_proj_a"] == quants["layers.0.mlp.gate"] == "f32"
    assert {q for n, q in quants.items() if q not in ("q6_k", "f32")} == {"q4_k"}
    q4_0 = convert.mix_quants(t, shapes, "q4_0")  # fermijit's, with llama.cpp's Q6_K head
    assert q4_0 == {n: convert.quantisation(n, "q6_k") for n in shapes}


def test_gguf_takes_no_mix(monkeypatch, capsys, tmp_path):
    code, _, err = run_cli(monkeypatch, capsys, "convert", gguf_data.Q4_K_M, tmp_path / "m",
                           "--quant", "q4_k_m")
    assert code == 2 and "a GGUF file is imported in the kinds it holds" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_lm_head_option_replaces_the_mixs():
    t = parse_config(synth.config_for("qwen3.6-35b-a3b", layers=1)).text_config
    shapes = text_weight_shapes(t)
    assert convert.mix_quants(t, shapes, "q4_k_m")["lm_head"] == "q6_k"
    assert convert.mix_quants(t, shapes, "q4_k_m", lm_head="q8_0")["lm_head"] == "q8_0"
    assert convert.mix_quants(t, shapes, "q4_0")["lm_head"] == "q6_k"
    assert convert.mix_quants(t, shapes, "q4_0", lm_head="q8_0")["lm_head"] == "q8_0"
    narrow = {**shapes, "lm_head": shapes["lm_head"][:-1] + (384,)}  # rows not 256-blocks
    assert convert.mix_quants(t, narrow, "q4_0")["lm_head"] == "q8_0"
