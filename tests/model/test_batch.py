"""Batched decode (model/batch.py, issue 14 item 3) against B separate `Model.decode` calls: bit
for bit, so that at temperature 0 a request's tokens do not depend on what else is in the batch
(the server's load test compares them with sequential runs)."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.engine import DEFAULT_MODEL
from fermijit.jit import cpu
from fermijit.model.batch import BatchWorkspace, decode_batch
from fermijit.model.forward import load_model

CONTEXT = 48


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL)[1]


def _prefilled(model, prompts):
    """A state and the greedy next token per prompt."""
    out = []
    for p in prompts:
        s = model.new_state(CONTEXT)
        out.append((s, int(model.prefill(p, s).argmax())))
    return out


@pytest.fixture(scope="module")
def same_width_model(tmp_path_factory):
    """A small synthetic reap128 whose shared expert has the routed experts' width (as the real
    model's; the default model's is wider)."""
    from fermijit.model import synth
    from tests.model.test_synth import SMALL

    dst = tmp_path_factory.mktemp("batch") / "m"
    synth.synth("qwen3.6-35b-a3b-reap128", dst, layers=4, show_progress=False,
                overrides=dict(SMALL, moe_intermediate_size=128,
                               shared_expert_intermediate_size=128))
    return load_model(dst)[1]


@pytest.fixture(params=["default", "ssse3", "same-width"])
def decode_model(request, model, monkeypatch):
    """The model, decoding in jit.cpu.decode_isa's variant: the default one, or SSSE3 where that
    is not the process's (a fresh model: its decode workspace is laid out on first use); or a
    model whose shared expert has the routed experts' width."""
    if request.param == "default":
        return model
    if request.param == "same-width":
        return request.getfixturevalue("same_width_model")
    if cpu.selected_isa() is cpu.Isa.SSSE3:
        pytest.skip("the process's variant is SSSE3 already")
    monkeypatch.setattr(cpu, "_decode", cpu.Isa.SSSE3)
    return load_model(DEFAULT_MODEL)[1]


def test_rows_are_separate_decodes_exactly(decode_model, rng):
    # Ragged positions (3 to 30 tokens seen), a sequence joining and one leaving between steps;
    # batches of up to ROW_MOE_MAX_ROWS through a plan, larger ones op by op (model/batch.py).
    model = decode_model
    prompts = [rng.integers(0, model.vocab_size, n) for n in (5, 17, 3, 30, 9)]
    batched, single = _prefilled(model, prompts), _prefilled(model, prompts)
    for active in ([0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3, 4],
                   [4, 2], [0, 1, 2, 3]):
        tokens = [batched[i][1] for i in active]
        ws = BatchWorkspace(model, len(active))
        ws.logits[:] = np.nan
        got = decode_batch(model, tokens, [batched[i][0] for i in active], ws)
        for row, i in enumerate(active):
            want = model.decode(single[i][1], single[i][0])
            np.testing.assert_array_equal(got[row], want, err_msg=f"{active}, sequence {i}")
            token = int(want.argmax())
            batched[i], single[i] = (batched[i][0], token), (single[i][0], token)
    # Every one-token product ran decode's variant, the batch's rows too.
    assert {a.vec.isa for a in (model._decode_ws.act, model._decode_ws.act_gdn, ws.act,
                                ws.act_gdn)} == {cpu.decode_isa()}
    for (a, _), (b, _) in zip(batched, single):
        assert a.position == b.position
        for la, lb in zip(a.layers, b.layers):
            for x, y in zip(la.arrays, lb.arrays, strict=True):
                np.testing.assert_array_equal(x, y)


def test_bad_calls_are_refused(model):
    s = model.new_state(2)
    with pytest.raises(FermijitError, match="one each"):
        decode_batch(model, [1, 2], [s])
    with pytest.raises(FermijitError, match="twice"):
        decode_batch(model, [1, 2], [s, s])
    with pytest.raises(FermijitError, match="token ids"):
        decode_batch(model, [model.vocab_size], [s])
    decode_batch(model, [1], [s])
    decode_batch(model, [1], [s])
    with pytest.raises(FermijitError, match="context full"):
        decode_batch(model, [1], [s])
