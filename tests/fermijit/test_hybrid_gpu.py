"""The GPU prefill end to end (issue 10 item 3), on the default model and a tiny model with 128
experts: last-position logits against the float64 reference over the same 4-bit weights, the
hand-off to the CPU state against the reference's, 32 greedy tokens decoded on the CPU identical to
those decoded from the reference's state, and how many equal the all-CPU (W4A8) run's.
Chunked passes, a continued state, every expert source and the all-logits form (eval) too."""

import io
from pathlib import Path

import numpy as np
import pytest

from fermijit import engine, hybrid
from fermijit.model import convert
from fermijit.model.forward import load_model
from fermijit.model.reference import Reference
from fermijit.model.state import KvCache
from tests.fermijit.hybrid_models import tiny_e128
from tests.gpu import MARKS, report_error
from tests.model.oracle import assert_rel, rel_error

pytestmark = MARKS

# Issue 10 item 3: the GPU keeps activations in fp32, so its logits follow the float64 reference
# over the same 4-bit weights to fp32 rounding (<= 1e-4 of max|logit|).
GPU_VS_REFERENCE = 1e-4
# The CPU path quantises activations to 8 bits (W4A8): the two paths' logits differ by that
# (measured on the default model 1.24e-2; HF_INIT 0.65e-2, tests/model/test_forward.py). The
# handed-off state is checked against the reference's instead: W4A8 noise on a K head of small
# norm, amplified by its RMSNorm, put single cache entries 9% apart (measured on the H200).
GPU_VS_W4A8 = 5e-2
# Two GPU runs of the same tokens differ only in the order of the experts' atomic adds.
GPU_VS_GPU = 1e-5
N_PROMPT, N_GREEDY = 150, 32
# Greedy tokens after a GPU prefill that equal the all-CPU run's (issue 10 asks for 32). The GPU
# prefills with fp32 activations, the CPU in W4A8 (8-bit activations): two specifications, and a
# near tie in decode can go either way. On the default model from this prompt they part at step 1
# (notes/gpuprefill.md, item 3): all-CPU 314, 269, 200 with 269 ahead of 200 by 0.014 logits; the
# GPU's state decoded on the CPU 314, 200, 313 with 200 ahead by 0.059. Each path equals its
# float64 reference end to end (W4A8: 269 by 0.017; fp32 activations: 200 by 0.046), so neither is
# a bug. The tiny model must match all 32; where the default model parts, both paths' top two
# logits must be within NEAR_TIE there.
NEAR_TIE = 0.1
SAME_AS_CPU = {"default": 0, "tiny-e128": N_GREEDY}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {"default": engine.DEFAULT_MODEL, "tiny-e128": tiny_e128(root)}


@pytest.fixture(scope="module")
def loaded(models):
    made = {}

    def get(name):
        if name not in made:
            cfg, weights, _ = convert.load_converted(models[name])
            made[name] = (load_model(models[name])[1], Reference(cfg.text_config, weights))
        return made[name]

    return get


def prompt(model, n=N_PROMPT, seed=0):
    return np.random.default_rng(seed).integers(3, model.vocab_size, n).astype(np.int32)


def text_prompt(directory, n=N_PROMPT):
    """The first `n` tokens of held-out Python documentation: a trained model's greedy
    continuation of real text has margins that 8-bit activation noise does not flip, where a
    random prompt's (measured on the H200) flipped at token 26."""
    from fermijit.model.tokenizer import Tokenizer

    text = (Path(__file__).parents[1] / "model" / "data" / "heldout_sample.txt").read_text()
    tokens = Tokenizer(directory, None).encode(text)
    assert tokens.size >= n
    return tokens[:n].astype(np.int32)


def gpu_prefiller(model, **kwargs):
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, err=err, **kwargs)
    assert pf.prepare(), err.getvalue()
    return pf, err


def from_reference(model, ref_state):
    """The float64 reference's state as the engine's `State` (fp32, its layouts)."""
    state = model.new_state(N_PROMPT + N_GREEDY)
    for s, r in zip(state.layers, ref_state.layers):
        if isinstance(s, KvCache):
            s.k[:, :ref_state.position] = r.k.transpose(1, 0, 2)
            s.v[:, :ref_state.position] = r.v.transpose(1, 0, 2)
        else:
            s.conv[...], s.recurrent[...] = r.conv.T, r.recurrent
    state.position = ref_state.position
    return state


def greedy(model, logits, state, n=N_GREEDY, margins=None):
    """n greedy tokens; `margins` (a list) gets each step's top-1 minus top-2 logit."""
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        if margins is not None:
            top = np.sort(logits)[-2:]
            margins.append(float(top[1] - top[0]))
        logits = model.decode(tokens[-1], state)
    return tokens


@pytest.mark.parametrize("name", ["default", "tiny-e128"])
def test_logits_hand_off_and_greedy_tokens(models, loaded, name):
    model, reference = loaded(name)
    tokens = text_prompt(models[name]) if name == "default" else prompt(model)
    pf, err = gpu_prefiller(model)
    state = model.new_state(N_PROMPT + N_GREEDY)
    logits = pf.prefill(tokens, state)
    assert pf.broken is None, err.getvalue()
    ref_state = reference.new_state()
    expected = reference.forward(tokens, ref_state)[-1]
    report_error(f"gpu prefill logits ({name})", expected, logits)
    assert_rel("gpu prefill logits", expected, logits, GPU_VS_REFERENCE)
    assert state.position == N_PROMPT
    for i, (s, r) in enumerate(zip(state.layers, ref_state.layers)):   # the hand-off
        if isinstance(s, KvCache):
            pairs = ((s.k[:, :N_PROMPT], r.k.transpose(1, 0, 2)),
                     (s.v[:, :N_PROMPT], r.v.transpose(1, 0, 2)))
        else:
            pairs = ((s.conv, r.conv.T), (s.recurrent, r.recurrent))
        for ours, spec in pairs:
            report_error(f"handed-off state ({name})", spec, ours)
            assert_rel(f"layer {i} state", spec, ours, GPU_VS_REFERENCE)
    our_margins, cpu_margins = [], []
    ours = greedy(model, logits, state, margins=our_margins)
    # Decoded on the CPU from the reference's own state: what the hand-off should give.
    spec = greedy(model, expected.astype(np.float32), from_reference(model, ref_state))
    assert ours == spec
    cpu_state = model.new_state(N_PROMPT + N_GREEDY)
    cpu_logits = model.prefill(tokens, cpu_state)
    print(f"rel err gpu vs w4a8 logits ({name}): {rel_error(cpu_logits, logits):.3g}")
    assert_rel("gpu vs cpu logits", cpu_logits, logits, GPU_VS_W4A8)
    cpu = greedy(model, cpu_logits, cpu_state, margins=cpu_margins)
    same = next((n for n, (a, b) in enumerate(zip(ours, cpu)) if a != b), N_GREEDY)
    print(f"greedy tokens identical to the all-CPU run ({name}): {same} of {N_GREEDY}")
    assert same >= SAME_AS_CPU[name]
    if same < N_GREEDY:                      # parted only at a near tie of both paths
        print(f"  at step {same}: margins {our_margins[same]:.4f} (gpu prefill), "
              f"{cpu_margins[same]:.4f} (all-CPU)")
        assert max(our_margins[same], cpu_margins[same]) < NEAR_TIE


def test_chunked_passes_equal_one_pass(loaded):
    model, _ = loaded("tiny-e128")
    tokens = prompt(model, 200)
    one, _ = gpu_prefiller(model)
    expected = one.prefill(tokens, model.new_state(200))
    plan = hybrid.plan(model, 200, 0, 1 << 40, 1 << 40)
    budget = plan.total - plan.activations // 2          # half the activations: chunks
    chunked, err = gpu_prefiller(model, gpu_mem=budget)
    logits = chunked.prefill(tokens, model.new_state(200))
    assert chunked.last_plan.n_chunks > 1 and "passes of" in err.getvalue()
    assert_rel("chunked logits", expected, logits, GPU_VS_GPU)


def test_a_state_continues(loaded):
    """Prefill in two calls (as after a restored prefix) equals one call."""
    model, reference = loaded("default")
    tokens = prompt(model, 120)
    pf, _ = gpu_prefiller(model)
    state = model.new_state(130)
    pf.prefill(tokens[:70], state)
    logits = pf.prefill(tokens[70:], state)
    expected = reference.forward(tokens, reference.new_state())[-1]
    assert_rel("continued logits", expected, logits, GPU_VS_REFERENCE)


@pytest.mark.parametrize("source", ["ring", "pageable"])
def test_expert_sources_agree(loaded, source):
    model, _ = loaded("tiny-e128")
    tokens = prompt(model, 90)
    pinned, _ = gpu_prefiller(model, source="pinned")
    other, _ = gpu_prefiller(model, source=source, pin_budget=3 << 20)  # ring: 1 MiB slots
    a = pinned.prefill(tokens, model.new_state(90))
    b = other.prefill(tokens, model.new_state(90))
    assert other.device.streamer.source == source
    assert_rel(f"{source} logits", a, b, GPU_VS_GPU)


def test_only_routed_or_predicted_experts_are_copied(loaded):
    """3 tokens route to at most 24 of 128 experts per layer; a layer's copies are those plus
    at most 24 predicted (gpu_prefill.Pass.predict), and every byte is accounted for."""
    model, _ = loaded("tiny-e128")
    pf, _ = gpu_prefiller(model)
    before = pf.device.streamer.bytes_copied
    pf.prefill(np.array([5, 6, 7], np.int32), model.new_state(3))
    stats, expert_bytes = pf.last_pass.layer_stats, pf.device.streamer.layout.expert_bytes
    for s in stats:
        copied = s["bytes"] // expert_bytes
        assert s["bytes"] % expert_bytes == 0 and s["experts"] <= 24
        assert s["experts"] <= copied <= s["experts"] + 24
        assert s["unused_experts"] == copied - s["experts"]
    assert pf.device.streamer.bytes_copied - before == sum(s["bytes"] for s in stats)


def test_all_logits_for_eval(loaded):
    model, reference = loaded("default")
    tokens = prompt(model, 80)
    pf, _ = gpu_prefiller(model)
    logits = pf.prefill(tokens, model.new_state(80), all_logits=True)
    expected = reference.forward(tokens, reference.new_state())
    assert logits.shape == expected.shape
    assert_rel("all logits", expected, logits, GPU_VS_REFERENCE)


def test_too_little_gpu_memory_falls_back(loaded):
    model, _ = loaded("default")
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, gpu_mem=1 << 20, err=err)
    tokens = prompt(model, 40)
    logits = pf.prefill(tokens, model.new_state(40))
    np.testing.assert_array_equal(logits, model.prefill(tokens, model.new_state(40)))
    assert "prefilling on the CPU" in err.getvalue() and "GPU memory" in err.getvalue()
