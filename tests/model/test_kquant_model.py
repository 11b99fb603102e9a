"""A Q4_K_M GGUF run natively (issue 34): llama.cpp's Q4_K_M of the 256-wide tiny model, its
K-quant and Q5 blocks kept as imported, through fermijit's prefill and decode against the float64
reference over the same blocks with the same activation rounding (model/reference.py BlockA8:
Q8_K per 256 for the K-quants, Q8_0 per 32 otherwise)."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import convert
from fermijit.model.forward import load_model
from fermijit.model.reference import Reference
from tests.model import gguf_data
from tests.model.oracle import assert_rel_but_flips

# fp32 rounding only (the integer block sums are exact on both sides): measured 2.5e-7 of the
# largest |logit| in prefill, 1.8e-7 in decode, at most positions; the rest an 8-bit rounding
# flip (tests/model/test_forward.py W4A8_FLIP; 3.5e-3 measured in one prefill position).
VS_REFERENCE = 1e-5
FLIP = 1e-2


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("kquant") / "wide-q4_k_m"
    convert.convert(gguf_data.Q4_K_M, out, show_progress=False)
    return out


def test_prefill_and_decode_match_the_reference(imported, rng):
    cfg, weights, manifest = convert.load_converted(imported)
    kinds = {e.quant for e in manifest.tensors.values()}
    assert {"q4_k", "q6_k"} <= kinds   # the file's K-quants run as they are
    _, model = load_model(imported)
    tokens = rng.integers(0, cfg.text_config.vocab_size, 24).astype(np.int32)
    state = model.new_state(32)
    got = [model.prefill(tokens[:20], state, all_logits=True)]
    got += [np.array(model.decode(int(t), state))[None] for t in tokens[20:]]
    reference = Reference(cfg.text_config, weights, quantize_activations=True)
    expected = reference.forward(tokens, reference.new_state())
    assert_rel_but_flips("logits", expected, np.concatenate(got), VS_REFERENCE, FLIP)


def test_gpu_prefill_refuses_k_quant_weights_in_one_line(imported):
    from fermijit import gpu_layout

    _, model = load_model(imported)
    with pytest.raises(FermijitError, match=r"no kernels for Q4_K/Q5_0/Q5_1/Q6_K weights yet \(\d+ "
                                            r"matrices of this model, e\.g\. lm_head\)"):
        gpu_layout.check_supported(model)
