"""The CPU forward (model/forward.py) against transformers and the float64 reference: issue 3
item 7 (a) the fp32 path, (b) the W4A8 path, (c) prefill then decode equals one prefill, with the
state copied, saved and restored on the way. Both tiny models (tests/model/tiny.py), both expert
layouts; transformers' outputs come from golden/ and, where importable, live.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numba
import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import convert, forward
from fermijit.model.forward import load_model
from fermijit.model.reference import Reference
from fermijit.model.state import KvKind, State
from fermijit.ops import matvec
from tests.model import flips, oracle, tiny
from tests.model.conftest import LAYOUTS
from tests.model.oracle import PROMPT, assert_rel, assert_rel_but_flips, rel_error

MODELS = {m.name: m for m in oracle.MODELS}

# Tolerances, max|diff| / max|expected| (issue 12: each from the error measured, and each at
# most a tenth of what removing any part of the model moves the logits: test_sensitivity.py).
# (a) fp32 vs transformers' fp32: summation order, and transformers' chunked GDN prefill against
# our recurrence. Measured (prompt, decode): UNIT 1.2e-6, 2.0e-6; HF_INIT 2.6e-7, 2.9e-7;
# SENSITIVE 3.4e-6, 6.1e-7.
FP32_VS_ORACLE = 2e-5
# (b) W4A8 vs the float64 reference over the same 4-bit weights with activations quantised per
# 32-block (Reference(quantize_activations=True), its own quantiser): fp32 rounding only, at
# every position once the reference rounds the engine's way the few 8-bit codes it sees at a
# rounding tie (tests/model/flips.py; issue 33). Measured on HF_INIT: 3.0e-7 (prompt), 2.1e-7
# (decode), no flip; on SENSITIVE one flip (decode step 21, a code 9.5e-7 from its tie, which
# moved that step's logits 5.45e-3 and persists in the state), the rest within 1e-7 of the flipped
# reference. The flips each comparison may need: what it measured (AVX-512, AVX2 and SSSE3 alike).
W4A8_VS_REFERENCE = 1e-5
HF_INIT_FLIPS = 0
# SENSITIVE: 2 since the Q8_0 cache's merge (attention's key ranges merged in order, tiles of
# queries: another summation order), the second at position 38, 3.8e-6 from its tie.
SENSITIVE_FLIPS = 2
# (b) W4A8 vs transformers as the W4A8 oracle (oracle.w4a8_activations) on SENSITIVE, whose
# weights are on the 4-bit grid: the same arithmetic in fp32 on both sides. Measured: every
# prompt position within 4.5e-7, 45 of the 48 positions within 3.4e-6; three decode steps off
# by an 8-bit rounding flip where the two fp32 orders round a code differently (steps 22 and 25:
# 3.0e-3 and 2.5e-3; step 31: 2.6e-5). W4A8_FLIP bounds those three, twice the largest flip
# measured (5.45e-3, above), 11x under SENSITIVE's smallest ablation (tests/model/ablation.py).
W4A8_VS_W4A8_ORACLE = 2e-5
SENSITIVE_ORACLE_FLIPS = 3
W4A8_FLIP = 1e-2
# (b) How far 4 bits move HF_INIT's logits from transformers' fp32 (random weights, not on the
# grid): a bound on quantisation noise, not a correctness test (removing GDN or q/k norms moves
# this model's logits less: tests/model/ablation.py). Measured: 1.05e-2 (prompt), 0.96e-2
# (decode); 0.65e-2 of it the 8-bit activations alone.
W4A8_NOISE = 1.5e-2
# (c) Prefill batches tokens (GEMM tiles, numpy matmuls over T rows) where decode runs GEMVs:
# the same sums in another order. fp32 path measured <= 1e-6.
FP32_STATE_REL = 1e-5
# (c) W4A8: the same, except that a reordered fp32 sum can move an activation across a Q8
# rounding boundary, changing one int8 by one; HF_INIT measured 7e-8. UNIT amplifies such flips
# (measured 1.3e-2), so it is checked with the fp32 path only (measured 1.3e-6).
W4A8_STATE_REL = 1e-4
# (d) The Q8_0 KV cache (issue 31; the default): the oracle tests above run the fp32 cache, as
# transformers does. With Q8_0 the float64 reference rounds q, k and v as the cache does
# (Reference(quantize_kv=True)), and the engine follows it to fp32 rounding (FP32_VS_ORACLE on
# fp32 weights, W4A8_VS_REFERENCE on W4A8), but for a key or value code that fp32 rounds to its
# neighbour (W4A8_FLIP). Measured, prompt / decode: fp32 weights UNIT 5.9e-7 / 1.4e-6, HF_INIT
# 3.9e-7 / 1.7e-7, SENSITIVE 4.8e-7 / 2.2e-7; W4A8 HF_INIT 2.0e-7 / 6.7e-6.
# How far the 8-bit cache moves the logits from transformers' fp32 (fp32 weights): measured UNIT
# 1.7e-3 / 1.5e-3, HF_INIT 3.0e-4 / 1.7e-4, SENSITIVE 5.9e-3 / 7.3e-3; a bound on the cache's
# noise, and it must be there (the cache rounded at all).
Q8_KV_NOISE = 1.5e-2

CONTEXT = 64


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    """converted(model, layout) -> a fermijit model directory, made once."""
    root = tmp_path_factory.mktemp("converted")
    made = {}

    def get(model: tiny.Model, layout: str = "fused"):
        key = (model.name, layout)
        if key not in made:
            made[key] = root / f"{model.name}-{layout}"
            convert.convert(tiny_dir(model, layout), made[key], show_progress=False)
        return made[key]

    return get


def run_greedy(model: forward.Model, n_decode: int = oracle.N_DECODE):
    """Prompt logits and our own greedy continuation: (prompt logits, tokens, their logits)."""
    state = model.new_state(CONTEXT)
    prompt_logits = model.prefill(PROMPT, state, all_logits=True)
    token, tokens, decode_logits = int(prompt_logits[-1].argmax()), [], []
    for _ in range(n_decode):
        tokens.append(token)
        decode_logits.append(model.decode(token, state).copy())
        token = int(decode_logits[-1].argmax())
    return oracle.Outputs(prompt_logits, np.array(tokens), np.stack(decode_logits))


def run_forced(model, tokens):
    """Prompt logits, then the logits after each of `tokens` fed in turn (teacher forcing)."""
    if isinstance(model, Reference):
        state = model.new_state()
        return (model.forward(PROMPT, state),
                np.stack([model.forward([t], state)[0] for t in tokens]))
    state = model.new_state(CONTEXT)
    return (model.prefill(PROMPT, state, all_logits=True),
            np.stack([model.decode(int(t), state).copy() for t in tokens]))


# --- (a) the unquantised fp32 path --------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_fp32_path_matches_the_oracle(tiny_dir, model, layout):
    golden = oracle.golden(MODELS[model])
    _, m = load_model(tiny_dir(MODELS[model], layout), kv=KvKind.F32)
    assert not m.is_quantized
    ours = run_greedy(m)
    np.testing.assert_array_equal(ours.tokens, golden.tokens, "greedy tokens differ")
    assert_rel("prompt logits", golden.prompt_logits, ours.prompt_logits, FP32_VS_ORACLE)
    assert_rel("decode logits", golden.decode_logits, ours.decode_logits, FP32_VS_ORACLE)


@pytest.mark.parametrize("model", MODELS)
def test_fp32_path_matches_the_live_oracle(live_oracle, tiny_dir, model):
    live = live_oracle(MODELS[model], "split-3shards")
    _, m = load_model(tiny_dir(MODELS[model], "split-3shards"), kv=KvKind.F32)
    ours = run_greedy(m)
    np.testing.assert_array_equal(ours.tokens, live.tokens, "greedy tokens differ")
    assert_rel("prompt logits", live.prompt_logits, ours.prompt_logits, FP32_VS_ORACLE)
    assert_rel("decode logits", live.decode_logits, ours.decode_logits, FP32_VS_ORACLE)


# --- (b) the W4A8 path --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_init_w4a8(converted):
    """The W4A8 run of HF_INIT on the oracle's tokens, from both expert layouts."""
    golden = oracle.golden(tiny.HF_INIT)
    runs = {}
    for layout in LAYOUTS:
        cfg, m = load_model(converted(tiny.HF_INIT, layout), kv=KvKind.F32)
        assert m.is_quantized
        runs[layout] = run_forced(m, golden.tokens)
    return cfg, runs


def test_w4a8_layouts_agree_exactly(hf_init_w4a8):
    """Fused and split sources convert to the same bytes, so they run to the same bits."""
    _, runs = hf_init_w4a8
    for a, b in zip(runs["fused"], runs["split-3shards"]):
        np.testing.assert_array_equal(a, b)


def test_w4a8_matches_the_reference_over_the_same_weights(hf_init_w4a8, converted):
    _, runs = hf_init_w4a8
    cfg, weights, _ = convert.load_converted(converted(tiny.HF_INIT))
    reference = Reference(cfg.text_config, weights, quantize_activations=True)
    tokens = oracle.golden(tiny.HF_INIT).tokens
    flips.follow("HF_INIT logits", reference, np.concatenate([PROMPT, tokens]),
                 np.concatenate(runs["fused"]), W4A8_VS_REFERENCE, HF_INIT_FLIPS)


def test_w4a8_sensitive_matches_the_reference_but_its_flip(sensitive_w4a8, converted):
    cfg, weights, _ = convert.load_converted(converted(tiny.SENSITIVE))
    reference = Reference(cfg.text_config, weights, quantize_activations=True)
    tokens = oracle.golden(tiny.SENSITIVE, w4a8=True).tokens
    found = flips.follow("SENSITIVE logits", reference, np.concatenate([PROMPT, tokens]),
                         np.concatenate(run_forced(sensitive_w4a8, tokens)), W4A8_VS_REFERENCE,
                         SENSITIVE_FLIPS)
    print(f"\nSENSITIVE W4A8 vs the float64 reference: flips {found}")


def test_a_position_off_without_a_tie_is_no_flip(hf_init_w4a8, converted):
    """The flip allowance admits only flips: one decode step moved by 2e-4 of the largest logit
    (20x under the old allowance of 1e-2 on 10 % of positions) is refused."""
    _, runs = hf_init_w4a8
    cfg, weights, _ = convert.load_converted(converted(tiny.HF_INIT))
    reference = Reference(cfg.text_config, weights, quantize_activations=True)
    tokens = oracle.golden(tiny.HF_INIT).tokens
    actual = np.concatenate(runs["fused"])
    actual[len(PROMPT) + 5, 7] += 2e-4 * np.abs(actual).max()
    with pytest.raises(AssertionError, match=f"position {len(PROMPT) + 5} .* not a flip"):
        flips.follow("HF_INIT logits", reference, np.concatenate([PROMPT, tokens]), actual,
                     W4A8_VS_REFERENCE, 5)


def test_w4a8_quantisation_noise_is_bounded(hf_init_w4a8):
    golden = oracle.golden(tiny.HF_INIT)
    prompt, decode = hf_init_w4a8[1]["fused"]
    assert_rel("prompt logits", golden.prompt_logits, prompt, W4A8_NOISE)
    assert_rel("decode logits", golden.decode_logits, decode, W4A8_NOISE)
    # The 4-bit error must be there at all: without it the weights were not quantised.
    assert rel_error(golden.prompt_logits, prompt) > 1e-3, "4-bit weights yet fp32 accuracy?"


def test_w4a8_quantisation_noise_against_the_live_oracle(live_oracle, hf_init_w4a8):
    live = live_oracle(tiny.HF_INIT, "fused")
    prompt, decode = run_forced_from(hf_init_w4a8, live.tokens)
    assert_rel("prompt logits", live.prompt_logits, prompt, W4A8_NOISE)
    assert_rel("decode logits", live.decode_logits, decode, W4A8_NOISE)


def run_forced_from(hf_init_w4a8, tokens):
    """The stored W4A8 run, valid when the live oracle's greedy tokens are the golden ones."""
    np.testing.assert_array_equal(tokens, oracle.golden(tiny.HF_INIT).tokens,
                                  "transformers' greedy tokens moved: regenerate the golden files")
    return hf_init_w4a8[1]["fused"]


@pytest.fixture(scope="module")
def sensitive_w4a8(converted):
    """SENSITIVE's W4A8 model: the converted weights are the checkpoint's, bit for bit."""
    return load_model(converted(tiny.SENSITIVE), kv=KvKind.F32)[1]


def assert_matches_w4a8_oracle(model, expected: oracle.Outputs):
    assert_rel_but_flips("logits", np.concatenate([expected.prompt_logits,
                                                   expected.decode_logits]),
                         np.concatenate(run_forced(model, expected.tokens)), W4A8_VS_W4A8_ORACLE,
                         W4A8_FLIP, SENSITIVE_ORACLE_FLIPS)


def test_w4a8_matches_the_w4a8_oracle(sensitive_w4a8):
    assert_matches_w4a8_oracle(sensitive_w4a8, oracle.golden(tiny.SENSITIVE, w4a8=True))


def test_w4a8_matches_the_live_w4a8_oracle(sensitive_w4a8, tiny_dir):
    if not oracle.has_transformers():
        pytest.skip("torch and transformers >= 5.24 are not importable: goldens stand in")
    assert_matches_w4a8_oracle(sensitive_w4a8,
                               oracle.live(tiny_dir(tiny.SENSITIVE), w4a8=True))


def test_sensitive_weights_convert_losslessly(converted, tiny_dir):
    """On the grid, the converter stores the checkpoint's values exactly: the W4A8 oracle runs
    on the weights the engine runs on."""
    from fermijit.model.config import load_config
    from fermijit.model.reference import dense
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import load_text_weights

    cfg, quantised, _ = convert.load_converted(converted(tiny.SENSITIVE))
    src = tiny_dir(tiny.SENSITIVE)
    fp32 = load_text_weights(load_config(src).text_config, Checkpoint(src), np.float32)
    for a, b in zip(leaves(quantised), leaves(fp32)):
        np.testing.assert_array_equal(dense(a), dense(b))


def leaves(tree):
    if dataclasses.is_dataclass(tree) and not hasattr(tree, "qs"):
        for f in dataclasses.fields(tree):
            yield from leaves(getattr(tree, f.name))
    elif isinstance(tree, tuple):
        for t in tree:
            yield from leaves(t)
    else:
        yield tree


# --- (d) the Q8_0 KV cache ----------------------------------------------------------------------

def _fp32_reference(directory, **kwargs) -> Reference:
    from fermijit.model.config import load_config
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import load_text_weights

    cfg = load_config(directory).text_config
    return Reference(cfg, load_text_weights(cfg, Checkpoint(directory), np.float32), **kwargs)


@pytest.mark.parametrize("model", MODELS)
def test_q8_cache_fp32_path_matches_the_reference_and_stays_near_the_oracle(tiny_dir, model):
    golden = oracle.golden(MODELS[model])
    _, m = load_model(tiny_dir(MODELS[model]))
    assert m.kv_kind is KvKind.Q8_0                                   # the default
    prompt, decode = run_forced(m, golden.tokens)
    ref_prompt, ref_decode = run_forced(_fp32_reference(tiny_dir(MODELS[model]),
                                                        quantize_kv=True), golden.tokens)
    assert_rel_but_flips("prompt logits", ref_prompt, prompt, FP32_VS_ORACLE, W4A8_FLIP, 0)
    assert_rel_but_flips("decode logits", ref_decode, decode, FP32_VS_ORACLE, W4A8_FLIP, 0)
    assert_rel("prompt logits vs oracle", golden.prompt_logits, prompt, Q8_KV_NOISE)
    assert_rel("decode logits vs oracle", golden.decode_logits, decode, Q8_KV_NOISE)
    assert rel_error(golden.prompt_logits, prompt) > 1e-5, "a Q8_0 cache yet fp32 accuracy?"


def test_w4a8_q8_cache_matches_the_reference(converted):
    golden = oracle.golden(tiny.HF_INIT)
    _, m = load_model(converted(tiny.HF_INIT))
    prompt, decode = run_forced(m, golden.tokens)
    cfg, weights, _ = convert.load_converted(converted(tiny.HF_INIT))
    reference = Reference(cfg.text_config, weights, quantize_activations=True, quantize_kv=True)
    ref_prompt, ref_decode = run_forced(reference, golden.tokens)
    assert_rel_but_flips("prompt logits", ref_prompt, prompt, W4A8_VS_REFERENCE, W4A8_FLIP, 0)
    assert_rel_but_flips("decode logits", ref_decode, decode, W4A8_VS_REFERENCE, W4A8_FLIP, 0)


# --- (c) state: prefill(n) + decode(m) == prefill(n + m), across a snapshot ----------------------

PATHS = {"fp32": FP32_STATE_REL, "w4a8": W4A8_STATE_REL}


@pytest.mark.parametrize("path, model", [("fp32", "unit"), ("fp32", "hf-init"),
                                         ("w4a8", "hf-init")])
def test_prefill_then_decode_equals_one_prefill(tiny_dir, converted, tmp_path, path, model):
    source = converted if path == "w4a8" else tiny_dir
    _, m = load_model(source(MODELS[model]))
    tokens = np.concatenate([PROMPT, oracle.golden(MODELS[model]).tokens[:12]])   # 28
    whole = m.prefill(tokens, m.new_state(CONTEXT), all_logits=True)
    n, split = 9, 17

    state = m.new_state(CONTEXT)
    head = [m.prefill(tokens[:n], state, all_logits=True)]
    head += [m.decode(int(t), state)[None].copy() for t in tokens[n:split]]
    assert state.position == split
    # Three ways on from here: a copy (into a longer context), a saved and restored file, and
    # the original, each decoding the rest; the original also prefills it on a fresh copy.
    copied = state.copy(CONTEXT + 8)
    state.save(tmp_path / "state.npz")
    restored = State.load(tmp_path / "state.npz")
    m.check_state(restored)
    assert restored.position == split and restored.context == CONTEXT
    prefilled = m.prefill(tokens[split:], state.copy(), all_logits=True)
    for name, s in (("copied", copied), ("restored", restored), ("original", state)):
        tail = np.stack([m.decode(int(t), s).copy() for t in tokens[split:]])
        assert_rel(f"{name}: logits", whole, np.concatenate(head + [tail]), PATHS[path])
    assert_rel("prefill after decode: logits", whole[split:], prefilled, PATHS[path])


def test_prefill_in_blocks_equals_one_block(converted, monkeypatch):
    _, m = load_model(converted(tiny.HF_INIT))
    whole = m.prefill(PROMPT, m.new_state(CONTEXT), all_logits=True)
    monkeypatch.setattr(forward, "PREFILL_BLOCK", 5)  # blocks of 5, 5, 4, 2 (pass_size)
    blocks = m.prefill(PROMPT, m.new_state(CONTEXT), all_logits=True)
    assert_rel("logits", whole, blocks, W4A8_STATE_REL)
    last = m.prefill(PROMPT, m.new_state(CONTEXT))
    np.testing.assert_array_equal(last, blocks[-1])


def test_prefill_keeps_its_workspaces(converted, monkeypatch):
    """Model._prefill_workspace: the pass's buffers reused by the next call (the same bits), one
    set per pass size, only the two largest sizes kept."""
    _, m = load_model(converted(tiny.HF_INIT))
    first = m.prefill(PROMPT, m.new_state(CONTEXT), all_logits=True)
    ws = m._prefill_ws[PROMPT.size]
    np.testing.assert_array_equal(m.prefill(PROMPT, m.new_state(CONTEXT), all_logits=True), first)
    assert m._prefill_ws[PROMPT.size] is ws
    monkeypatch.setattr(forward, "PREFILL_BLOCK", 5)  # blocks of 5, 5, 4, 2 (pass_size)
    m.prefill(PROMPT, m.new_state(CONTEXT))
    assert sorted(m._prefill_ws) == [5, PROMPT.size]
    m.prefill(PROMPT[:3], m.new_state(CONTEXT))
    assert sorted(m._prefill_ws) == [5, PROMPT.size]


@pytest.mark.parametrize("T", [1, 5, 67], ids=["T1", "T5", "T67-threads"])
def test_split_heads_copies_each_half(rng, T):
    """Prefill's query | gate split (67 tokens: past omp.ROWS_MIN, over the threads), against
    numpy's slices, outputs NaN-poisoned."""
    qg = rng.standard_normal((T, 3, 2 * 40)).astype(np.float32)
    q, gate = np.full((T, 3, 40), np.nan, np.float32), np.full((T, 3, 40), np.nan, np.float32)
    forward.split_heads(qg, q, gate)
    np.testing.assert_array_equal(q, qg[..., :40])
    np.testing.assert_array_equal(gate, qg[..., 40:])


def test_prefill_buffers_start_on_cache_lines(converted):
    """Every fp32 buffer of a prefill pass (its Workspace's and the MoE's) starts on a cache line:
    numpy's own start 16 or 48 bytes into one, which splits each 64-byte GEMM store."""
    _, m = load_model(converted(tiny.HF_INIT))
    m.prefill(PROMPT, m.new_state(CONTEXT))
    ws = m._prefill_ws[PROMPT.size]
    moe_buffers = ws.moe_scratch.prefill.routed, ws.moe_scratch.prefill.shared
    candidates = [a for name, a in vars(ws).items() if name != "a"]  # a: ws.ba's second half
    candidates += [a for b in moe_buffers for a in vars(b).values()]
    arrays = [a for a in candidates if isinstance(a, np.ndarray) and a.dtype == np.float32]
    assert len(arrays) > 20
    assert [a.ctypes.data % matvec.LINE for a in arrays] == [0] * len(arrays)


def test_state_copies_are_independent_and_checked(converted, tmp_path):
    _, m = load_model(converted(tiny.HF_INIT))
    state = m.new_state(CONTEXT)
    m.prefill(PROMPT, state)
    copied = state.copy()
    before = [a.copy() for s in copied.layers for a in s.arrays]
    m.decode(3, state)
    after = [a for s in copied.layers for a in s.arrays]
    assert all(np.array_equal(a, b) for a, b in zip(before, after)) and copied.position == 16
    assert state.position == 17
    with pytest.raises(FermijitError, match="cannot hold"):
        state.copy(8)
    state.save(tmp_path / "s.npz")
    assert State.load(tmp_path / "s.npz", context=20).context == 20
    other = load_model(converted(tiny.UNIT))[1].new_state(CONTEXT)
    with pytest.raises(FermijitError, match="state has 4 layers, the model 8"):
        m.check_state(other)
    bad = state.copy()
    bad.layers[0].recurrent = np.zeros((4, 32, 31), np.float32)
    with pytest.raises(FermijitError, match=r"state layer 0 recurrent is float32 \[4, 32, 31\], "
                                            r"the model needs float32 \[4, 32, 32\]"):
        m.check_state(bad)
    bad.layers[0] = bad.layers[3]
    with pytest.raises(FermijitError, match="state layer 0 is a KvCache, the model's a GdnState"):
        m.check_state(bad)
    (tmp_path / "bad.npz").write_bytes(b"not a state")
    with pytest.raises(FermijitError, match="not a readable state file"):
        State.load(tmp_path / "bad.npz")


def test_weights_are_views_of_the_file(converted):
    """No copies of the big tensors: the model's arrays are views of the loader's memory map,
    the shared expert included (as [1, ...] views)."""
    cfg, weights, _ = convert.load_converted(converted(tiny.HF_INIT))
    m = forward.Model(cfg.text_config, weights)
    layer, mapped = m.layers[1], weights.layers[1]
    for ours, theirs in ((layer.experts.gate_up_qs, mapped.mlp.experts_gate_up.qs),
                         (layer.experts.down_d, mapped.mlp.experts_down.d),
                         (layer.experts.shared_gate_up_qs, mapped.mlp.shared_gate_up.qs),
                         (layer.mixer.in_proj_qkv.qs, mapped.mixer.in_proj_qkv.qs),
                         (m.embed, weights.embed_tokens), (m.lm_head.qs, weights.lm_head.qs)):
        assert isinstance(theirs, np.memmap) and np.shares_memory(ours, theirs)
    assert layer.experts.shared_gate_up_qs.shape == (1,) + mapped.mlp.shared_gate_up.qs.shape


def test_hf_checkpoint_too_big_for_ram_is_refused(tiny_dir, monkeypatch):
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 64}  # a machine of 256 KiB
    monkeypatch.setattr("os.sysconf", pages.__getitem__)
    with pytest.raises(FermijitError, match=r"fp32 weights take .* GiB, more than this "
                                            r"machine's 0.0 GiB of RAM; convert it first"):
        load_model(tiny_dir(tiny.HF_INIT))


def test_context_and_tokens_are_checked(converted):
    _, m = load_model(converted(tiny.HF_INIT))
    state = m.new_state(len(PROMPT))
    m.prefill(PROMPT, state)
    with pytest.raises(FermijitError, match="context full"):
        m.decode(3, state)
    with pytest.raises(FermijitError, match=r"token ids must be in \[0, 320\)"):
        m.prefill([5, 320], m.new_state(4))
    with pytest.raises(FermijitError, match="context must be between 1 and 256"):
        m.new_state(257)


def test_decode_allocates_nothing_big(converted):
    """After the first token, a decode step's numpy allocations are a few small op scratch
    arrays (Q8 activations of H values, the LM head's normed input, attention's per-head
    maxima; with the Q8_0 cache, the default, the query's Q8_0 rows and the values made fp32 a
    block at a time), not workspace or state: measured 4.2 KiB at peak on HF_INIT with the fp32
    cache, 25.1 KiB with the Q8_0 one, whose state is 248 KiB (fp32). On one thread: the
    kernels' per-thread scratch (Numba's allocations, which tracemalloc counts) adds up where
    the threads' runs overlap (46 KiB at peak on 2 threads when they did, 24 when not)."""
    _, m = load_model(converted(tiny.HF_INIT))
    state = m.new_state(CONTEXT)
    m.prefill(PROMPT, state)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        m.decode(3, state)
        tracemalloc.start()
        for t in (4, 5, 6):
            m.decode(t, state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        numba.set_num_threads(threads)
    assert peak < 32 * 1024, f"decode allocated {peak} B at peak"


# --- the fused decode path (Model._decode_fused) against the ops one by one ---------------------

# The fused path computes the fp32 router and GDN gate products in a Numba kernel, not numpy's
# matmul: the same sums in another order (ops/residual_step.py), everything else bit for bit.
# Measured on HF_INIT over 12 tokens: 0 (bitwise equal here, joined or apart); on the 8-layer
# full-size synthetic model the order moves logits ~1e-2 (Q8 rounding flips, amplified).
FUSED_VS_OPS_REL = 1e-5


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "apart"])
def test_fused_decode_equals_the_ops_one_by_one(converted, joined):
    _, m = load_model(converted(tiny.HF_INIT))
    assert m.fused_decode
    if not joined:  # the mixers' input projections as separate launches (a file not in order)
        m.layers = tuple(dataclasses.replace(w, joined_in=None) for w in m.layers)
    state = m.new_state(CONTEXT)
    m.prefill(PROMPT, state)
    tokens = oracle.golden(tiny.HF_INIT).tokens[:12]
    runs = {}
    for fused in (False, True):
        m.fused_decode = fused
        s = state.copy()
        runs[fused] = np.stack([m.decode(int(t), s).copy() for t in tokens])
        assert s.position == state.position + tokens.size
    assert_rel("fused decode: logits", runs[False], runs[True], FUSED_VS_OPS_REL)
    assert np.array_equal(runs[False].argmax(-1), runs[True].argmax(-1))
