"""The GPU prefill end to end (issue 10 item 3), on the default model and a tiny model with 128
experts. By default it rounds the GEMMs' inputs to 8 bits as the CPU does (gpu_prefill's
numerics): every position's logits against the all-CPU run's and the float64 W4A8 reference's,
the LM head alone, the hand-off against the CPU's state, and 32 greedy tokens against the all-CPU
run's (all identical on the tiny model; on the default model every step but those whose margin
fp32 rounding decides). With fp32 activations: logits and hand-off against the float64
reference without activation rounding. Chunked passes, a continued state, every expert source
and the all-logits form (eval) too."""

import io
from pathlib import Path

import numpy as np
import pytest

from fermijit import engine
from fermijit.model import convert
from fermijit.model.forward import load_model
from fermijit.model.reference import Reference
from fermijit.model.state import KvCache, KvKind
from fermijit.prefill import hybrid
from tests.fermijit.prefill.hybrid_models import tiny_e128
from tests.gpu import MARKS, report_error
from tests.model.oracle import assert_rel, assert_rel_but_flips, rel_error

pytestmark = MARKS

# Issue 10 item 3, fp32 activations: the logits follow the float64 reference over the same 4-bit
# weights to fp32 rounding (<= 1e-4 of max|logit|).
GPU_VS_REFERENCE = 1e-4
# W4A8 (the default): the same codes and scales as the CPU (ops/act_quant.py), so the GPU, the CPU
# and the float64 W4A8 reference differ by fp32 rounding, except where a value computed in another
# order lands on the other side of an 8-bit rounding boundary: one int8 off by one moves its
# position's logits by up to ~1e-3 (tests/model/test_forward.py W4A8_FLIP, measured 1.4e-3 on
# ~2.5% of positions). The tiny model: 1e-4 on most positions, W4A8_FLIP on all (measured on the
# H200 against the all-CPU run: last position 9.3e-6, worst 1.9e-3).
GPU_W4A8 = 1e-4
W4A8_FLIP = 1e-2
# Positions of the N_PROMPT = 150 that may be off by more than GPU_W4A8: the share the test
# allowed before issue 33 asked for counts (10 %), not yet measured on a GPU; the GPU pass prints
# the count found (oracle.assert_rel_but_flips), to set this from.
GPU_W4A8_FLIPS = 15
# The default (trained) model cascades such flips: each moves a value by 1/254 of its block's
# largest, which flips more codes downstream (on the CPU, 68 codes of layer 1's MoE input, 16,661
# of 57,600 by layer 7), so by the last layer any two W4A8 computations that differ in fp32
# rounding differ by ~1e-2. Measured: the all-CPU run against itself with one ulp added to every
# n-th RMSNorm output (20 runs: n = 97 ... 16001, 4 offsets each) at most 1.1e-2 at the last
# position, 2.7e-2 at the worst, 3.6e-2 in the state (main 909c207 and 538b659); the all-CPU run
# against the float64 W4A8
# reference 5.5e-3 and 2.6e-2; the GPU (H200) against the all-CPU run 6.4e-3-7.9e-3 and
# 7.1e-3-1.4e-2, against the reference 7.4e-3 and 2.7e-2, its state 2.5e-2. So the default
# model's logits and state are held to the cascade's bounds only.
W4A8_CASCADE = 5e-2
# The handed-off state against the all-CPU run's: fp32 rounding plus flips (measured on the tiny
# model 1.5e-3 at most, in the attention caches), and the default model's cascade.
GPU_STATE_VS_CPU = {"default": 1e-1, "tiny-e128": 1e-2}
# Greedy decode from the GPU's state must take the all-CPU run's token at every step whose margin
# (top-1 minus top-2 logit) is above what the cascade moves the logits (~0.07 on the default model
# at the prompt's end). Tokens closer than that are decided by fp32 rounding, not by the model:
# the all-CPU run itself, with one ulp added to every n-th RMSNorm output (n = 97 ... 16001, 4
# offsets each), took another token at step 1 of the default model's text prompt in 7 of 20
# runs on main 909c207 (margins 0.018-0.056, the unnudged run's 0.028) and 12 of 20 on 538b659
# (margins 0.0035-0.043 against 0.0025); teacher-forced, no other step ever differed. The GPU's
# own runs differ from each other there (the expert GEMMs' atomic adds, then the cascade: 1.7e-3
# to 8e-3 apart): on the H200, of 12 runs 5 took the CPU's token at step 1 (32 of 32) and 7 the
# other (margins 0.012-0.039). The tiny model's continuation has no such tie within the GPU's
# error: all 32 tokens must be the CPU's.
NEAR_TIE = 0.1
# Two GPU runs of the same tokens (fp32 activations) differ only in the order of the experts'
# atomic adds.
GPU_VS_GPU = 1e-5
N_PROMPT, N_GREEDY = 150, 32


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
            # The fp32 KV cache: the tests below hold the GPU to the CPU's and the reference's
            # numbers, and the GPU attends over fp32 keys (Q8_0: test_q8_0_hand_off_...).
            made[name] = (load_model(models[name], kv=KvKind.F32)[1],
                          Reference(cfg.text_config, weights),
                          Reference(cfg.text_config, weights, quantize_activations=True))
        return made[name]

    return get


def prompt(model, n=N_PROMPT, seed=0):
    return np.random.default_rng(seed).integers(3, model.vocab_size, n).astype(np.int32)


def text_prompt(directory, n=N_PROMPT):
    """The first `n` tokens of held-out Python documentation: a trained model's greedy
    continuation of real text has margins that 8-bit activation noise does not flip, where a
    random prompt's (measured on the H200) flipped at token 26."""
    from fermijit.model.tokenizer import Tokenizer

    text = (Path(__file__).parents[2] / "model" / "data" / "heldout_sample.txt").read_text()
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


def forced(model, logits, state, tokens):
    """Greedy decode fed `tokens` instead of its own (teacher forcing): its choice and its top-2
    margin at each step, so that every step compares with the run that chose `tokens`."""
    chosen, margins = [], []
    for token in tokens:
        chosen.append(int(np.argmax(logits)))
        top = np.sort(logits)[-2:]
        margins.append(float(top[1] - top[0]))
        logits = model.decode(token, state)
    return chosen, margins


def handed_off_pairs(state, spec_state, transposed: bool):
    """(ours, spec) per state array up to N_PROMPT; `transposed`: spec is the reference's layout."""
    for s, r in zip(state.layers, spec_state.layers):
        if isinstance(s, KvCache):
            t = (lambda a: a.transpose(1, 0, 2)) if transposed else (lambda a: a[:, :N_PROMPT])
            yield s.k[:, :N_PROMPT], t(r.k)
            yield s.v[:, :N_PROMPT], t(r.v)
        else:
            yield s.conv, r.conv.T if transposed else r.conv
            yield s.recurrent, r.recurrent


def name_prompt(models, model, name):
    return text_prompt(models[name]) if name == "default" else prompt(model)


def test_the_starts_pass_over_a_layer_of_each_kind_launches_every_kernel(loaded, monkeypatch):
    """prepare()'s 2-token pass runs on DeviceModel.sample (a layer of each kind: the default
    model's 8 layers -> 2): every kernel (template, parameters, entry) a 2-token prefill of the
    whole model launches, it launched too, so no module is loaded after the start."""
    from fermijit.jit import gpu

    model = loaded("default")[0]
    launched: list[set] = [set()]
    call = gpu.Kernel.__call__

    def spy(self, *args, **kwargs):
        launched[-1].add((self.rendered.template, self.rendered.params, self.entry.name))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(gpu.Kernel, "__call__", spy)
    pf, err = gpu_prefiller(model)
    assert len(pf.device.sample().layers) == 2 < len(model.layers)
    launched.append(set())
    pf.run(np.zeros(2, np.int32), model.new_state(2))
    assert launched[0] and launched[1] <= launched[0], launched[1] - launched[0]


@pytest.mark.parametrize("name", ["default", "tiny-e128"])
def test_w4a8_logits_hand_off_and_greedy_tokens_equal_the_cpus(models, loaded, name):
    """Issue 10 item 3: the GPU prefill (W4A8) then CPU decode gives the all-CPU run's tokens."""
    model, _, reference = loaded(name)
    tokens = name_prompt(models, model, name)
    pf, err = gpu_prefiller(model)
    state = model.new_state(N_PROMPT + N_GREEDY)
    logits = pf.prefill(tokens, state, all_logits=True)
    assert pf.broken is None, err.getvalue()
    cpu_state = model.new_state(N_PROMPT + N_GREEDY)
    cpu_logits = model.prefill(tokens, cpu_state, all_logits=True)
    expected = reference.forward(tokens, reference.new_state())
    # The LM head alone: the CPU's W4A8 head on the GPU's last hidden states.
    head = model.logits(pf.last_pass.x.get(), np.empty_like(logits))
    compared = (("all-CPU", cpu_logits), ("W4A8 reference", expected), ("CPU head", head))
    for what, spec in compared:
        print(f"rel err gpu w4a8 vs {what} logits ({name}): last position "
              f"{rel_error(spec[-1], logits[-1]):.3g}, worst position {rel_error(spec, logits):.3g}")
    for what, spec in compared:
        if name == "default" and what != "CPU head":
            assert_rel(f"gpu vs {what} logits", spec, logits, W4A8_CASCADE)
        else:
            assert_rel_but_flips(f"gpu vs {what} logits", spec, logits, GPU_W4A8, W4A8_FLIP,
                                 GPU_W4A8_FLIPS)
    assert state.position == N_PROMPT
    errors = []
    for ours, cpu in handed_off_pairs(state, cpu_state, transposed=False):
        report_error(f"handed-off state vs all-CPU ({name})", cpu, ours)
        errors.append(rel_error(cpu, ours))
    assert max(errors) <= GPU_STATE_VS_CPU[name], errors
    cpu_margins = []
    cpu = greedy(model, cpu_logits[-1], cpu_state, margins=cpu_margins)
    ours, our_margins = forced(model, logits[-1], state, cpu)
    differ = [n for n in range(N_GREEDY) if ours[n] != cpu[n]]
    print(f"greedy tokens identical to the all-CPU run ({name}): "
          f"{differ[0] if differ else N_GREEDY} of {N_GREEDY}; steps whose token differs, fed the "
          f"CPU's tokens: {differ}; margins there (all-CPU, gpu prefill): "
          f"{[(round(cpu_margins[n], 4), round(our_margins[n], 4)) for n in differ]}")
    if name == "tiny-e128":
        assert not differ
    for n in differ:
        assert max(cpu_margins[n], our_margins[n]) < NEAR_TIE, f"step {n} parted off a near tie"


@pytest.mark.parametrize("name", ["default", "tiny-e128"])
def test_fp32_logits_hand_off_and_greedy_tokens_follow_the_reference(models, loaded, name):
    """fp32 activations: the float64 reference without activation rounding, to fp32 rounding."""
    model, reference, _ = loaded(name)
    tokens = name_prompt(models, model, name)
    pf, err = gpu_prefiller(model, w4a8=False)
    state = model.new_state(N_PROMPT + N_GREEDY)
    logits = pf.prefill(tokens, state)
    assert pf.broken is None, err.getvalue()
    ref_state = reference.new_state()
    expected = reference.forward(tokens, ref_state)[-1]
    report_error(f"gpu prefill logits ({name})", expected, logits)
    cpu_logits = model.prefill(tokens, model.new_state(N_PROMPT))
    print(f"rel err gpu fp32 vs all-CPU logits ({name}): {rel_error(cpu_logits, logits):.3g}")
    assert_rel("gpu prefill logits", expected, logits, GPU_VS_REFERENCE)
    assert state.position == N_PROMPT
    for i, (ours, spec) in enumerate(handed_off_pairs(state, ref_state, transposed=True)):
        report_error(f"handed-off state ({name})", spec, ours)
        assert_rel(f"state array {i}", spec, ours, GPU_VS_REFERENCE)
    # Decoded on the CPU from the reference's own state: what the hand-off should give.
    ours = greedy(model, logits, state)
    assert ours == greedy(model, expected.astype(np.float32), from_reference(model, ref_state))


# The mechanics below run with fp32 activations, where two ways of computing the same logits agree
# to fp32 rounding everywhere (no 8-bit rounding flips), so a tight tolerance finds any slip.

def test_chunked_passes_equal_one_pass(loaded):
    model, _, _ = loaded("tiny-e128")
    tokens = prompt(model, 200)
    one, _ = gpu_prefiller(model, w4a8=False)
    expected = one.prefill(tokens, model.new_state(200))
    plan = hybrid.plan(model, 200, 0, 1 << 40, 1 << 40)
    budget = plan.total - plan.activations // 2          # half the activations: chunks
    chunked, err = gpu_prefiller(model, gpu_mem=budget, w4a8=False)
    logits = chunked.prefill(tokens, model.new_state(200))
    assert chunked.last_plan.n_chunks > 1 and "passes of" in err.getvalue()
    assert_rel("chunked logits", expected, logits, GPU_VS_GPU)


def test_a_state_continues(loaded):
    """Prefill in two calls (as after a restored prefix) equals one call."""
    model, reference, _ = loaded("default")
    tokens = prompt(model, 120)
    pf, _ = gpu_prefiller(model, w4a8=False)
    state = model.new_state(130)
    pf.prefill(tokens[:70], state)
    logits = pf.prefill(tokens[70:], state)
    expected = reference.forward(tokens, reference.new_state())[-1]
    assert_rel("continued logits", expected, logits, GPU_VS_REFERENCE)


@pytest.mark.parametrize("source", ["ring", "pageable"])
def test_expert_sources_agree(loaded, source):
    model, _, _ = loaded("tiny-e128")
    tokens = prompt(model, 90)
    pinned, _ = gpu_prefiller(model, source="pinned", w4a8=False)
    other, _ = gpu_prefiller(model, source=source, pin_budget=3 << 20, w4a8=False)  # ring: 1 MiB
    a = pinned.prefill(tokens, model.new_state(90))
    b = other.prefill(tokens, model.new_state(90))
    assert other.device.streamer.source == source
    assert_rel(f"{source} logits", a, b, GPU_VS_GPU)


def test_only_routed_or_predicted_experts_are_copied(loaded):
    """3 tokens route to at most 24 of 128 experts per layer; a layer's copies are those plus
    at most 24 predicted (gpu_prefill.Pass.predict), and every byte is accounted for."""
    model, _, _ = loaded("tiny-e128")
    pf, _ = gpu_prefiller(model)
    before = pf.device.streamer.bytes_copied
    pf.prefill(np.array([5, 6, 7], np.int32), model.new_state(3))
    stats = pf.last_pass.layer_stats
    (expert_bytes,) = {lay.expert_bytes for lay in pf.device.streamer.layouts}  # all Q4_0 here
    for s in stats:
        copied = s["bytes"] // expert_bytes
        assert s["bytes"] % expert_bytes == 0 and s["experts"] <= 24
        assert s["experts"] <= copied <= s["experts"] + 24
        assert s["unused_experts"] == copied - s["experts"]
    assert pf.device.streamer.bytes_copied - before == sum(s["bytes"] for s in stats)


def test_all_logits_for_eval(loaded):
    model, reference, _ = loaded("default")
    tokens = prompt(model, 80)
    pf, _ = gpu_prefiller(model, w4a8=False)
    logits = pf.prefill(tokens, model.new_state(80), all_logits=True)
    expected = reference.forward(tokens, reference.new_state())
    assert logits.shape == expected.shape
    assert_rel("all logits", expected, logits, GPU_VS_REFERENCE)


def test_too_little_gpu_memory_falls_back(loaded):
    model, _, _ = loaded("default")
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, gpu_mem=1 << 20, err=err)
    tokens = prompt(model, 40)
    logits = pf.prefill(tokens, model.new_state(40))
    np.testing.assert_array_equal(logits, model.prefill(tokens, model.new_state(40)))
    assert "prefilling on the CPU" in err.getvalue() and "GPU memory" in err.getvalue()


def test_the_experts_are_in_host_ram_once(models, monkeypatch):
    """Issue 28 item 3: a driver that registers read-only memory page-locks the model file's own
    pages (nothing copied: decode and the DMA read the same bytes); where registration is refused
    (Fermi's drivers) the pool is a copy that decode then reads instead of the file: its expert
    arrays are views of the pool, and its logits are bit for bit the file's."""
    import pycuda.driver as cuda

    from fermijit.jit import gpu

    model = load_model(models["tiny-e128"])[1]
    tokens = prompt(model, 40)
    state = model.new_state(42)
    model.prefill(tokens, state)
    expected = model.decode(5, state.copy())
    if cuda.get_driver_version() >= 11010:
        mapped, _ = gpu_prefiller(model, source="pinned")
        assert mapped.device.streamer.source == "mapped"
        assert mapped.device.streamer.pool == []
    copy = load_model(models["tiny-e128"])[1]
    monkeypatch.setattr(gpu, "register", lambda address, nbytes: None)
    pinned, _ = gpu_prefiller(copy, source="pinned")
    streamer = pinned.device.streamer
    assert streamer.source == "pinned"
    for i, w in enumerate(copy.layers):
        assert all(np.shares_memory(a, streamer.pool[i]) for a in w.experts.routed)
    np.testing.assert_array_equal(copy.decode(5, state.copy()), expected)


# Ragged prompts (issue 28 item 5: prompts that arrive together), after states that had seen
# tokens before (a restored prefix) or none; auto's 31-token one goes to the CPU.
BATCH_LENGTHS, BATCH_SEEN = (90, 3, 40, hybrid.AUTO_MIN_TOKENS - 1, 64), (0, 0, 17, 5, 33)


def batch_items(model, lengths=BATCH_LENGTHS, seen=BATCH_SEEN, context=200):
    """PrefillItems of prompts `lengths` long after states that had seen `seen` tokens, each
    item's on_block into its list of `fed`; (items, fed)."""
    fed = [[] for _ in lengths]
    items = []
    for k, (n, n_seen) in enumerate(zip(lengths, seen)):
        state = model.new_state(context)
        if n_seen:
            model.prefill(prompt(model, n_seen, seed=10 + k), state)
        items.append(hybrid.PrefillItem(prompt(model, n, seed=k), state, fed[k].append))
    return items, fed


@pytest.mark.parametrize("mode", ["gpu", "auto", "split"])
def test_prefill_batch_is_each_prefill_alone(loaded, mode):
    """The contract of GpuPrefiller.prefill_batch (the server's multi-sequence prefill): one
    pass over all the items' rows (auto: those of at least AUTO_MIN_TOKENS tokens), each item's
    logits and state as its prefill alone on the GPU (to the GPU's own rounding; auto's short
    item on the CPU, bit for bit), states that had seen tokens continue, on_block sums each
    item's tokens. split: a budget of half the batch's activations, so the rows run in several
    passes that cut sequences (their states carried on the device from pass to pass)."""
    model, _, _ = loaded("tiny-e128")
    items, fed = batch_items(model)
    ends = [i.state.position + i.tokens.size for i in items]
    whole = hybrid.plan(model, sum(i.tokens.size for i in items), 0, 1 << 40, 1 << 40,
                        ends=ends)
    budget = whole.total - whole.activations // 2 if mode == "split" else None
    pf, err = gpu_prefiller(model, w4a8=False, gpu_mem=budget)
    one = pf
    if mode == "auto":
        pf = hybrid.AutoPrefiller(pf)
    got = pf.prefill_batch(items, align=32)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    on_gpu = [mode != "auto" or i.tokens.size >= hybrid.AUTO_MIN_TOKENS for i in items]
    if mode == "split":
        assert one.last_plan.n_chunks > 1 and one.last_pass.T <= one.last_plan.chunk
    else:
        assert one.last_pass.T == sum(i.tokens.size for i, g in zip(items, on_gpu) if g)
    alone_pf, _ = gpu_prefiller(model, w4a8=False)
    alone_items, _ = batch_items(model)
    for k, (item, alone) in enumerate(zip(items, alone_items)):
        want = alone_pf.prefill(alone.tokens, alone.state) if on_gpu[k] else \
            model.prefill(alone.tokens, alone.state, align=32)
        assert sum(fed[k]) == item.tokens.size and item.state.position == alone.state.position
        if not on_gpu[k]:
            np.testing.assert_array_equal(got[k], want)
        assert_rel(f"item {k} logits", want, got[k], GPU_VS_GPU)
        for a, b in handed_off_pairs(item.state, alone.state, transposed=False):
            assert_rel(f"item {k} state", b, a, GPU_VS_GPU)


def test_prefill_batch_follows_the_cpus(loaded):
    """W4A8 (the default): the batch on the GPU against Model.prefill_batch on the CPU, to the
    tolerances the GPU prefill holds to the CPU's (a prompt's last logits, the handed-off
    state)."""
    model, _, _ = loaded("tiny-e128")
    items, _ = batch_items(model)
    pf, err = gpu_prefiller(model)
    got = pf.prefill_batch(items)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    cpu_items, _ = batch_items(model)
    want = model.prefill_batch([i.tokens for i in cpu_items], [i.state for i in cpu_items])
    for k, (item, cpu) in enumerate(zip(items, cpu_items)):
        report_error(f"batch item {k} logits vs all-CPU", want[k], got[k])
        assert_rel(f"item {k} logits", want[k], got[k], W4A8_FLIP)
        for a, b in handed_off_pairs(item.state, cpu.state, transposed=False):
            report_error(f"batch item {k} handed-off state vs all-CPU", b, a)
            assert rel_error(b, a) <= GPU_STATE_VS_CPU["tiny-e128"]


def test_a_failed_batch_falls_back_from_the_states_before(loaded, monkeypatch):
    """A GPU fault (here: the hand-off raising after the passes ran) leaves every state as it
    was, and the CPU prefills the items from there: the CPU's own prefill_batch, bit for bit;
    on_block counts each token once."""
    from fermijit.prefill import gpu_state

    model, _, _ = loaded("tiny-e128")
    items, fed = batch_items(model)
    pf, err = gpu_prefiller(model)

    def fault(*args):
        raise RuntimeError("an injected fault")

    monkeypatch.setattr(gpu_state, "hand_off", fault)
    got = pf.prefill_batch(items)
    assert "prefilling on the CPU: RuntimeError: an injected fault" in err.getvalue()
    cpu_items, _ = batch_items(model)
    want = model.prefill_batch([i.tokens for i in cpu_items], [i.state for i in cpu_items])
    for k, (item, cpu) in enumerate(zip(items, cpu_items)):
        np.testing.assert_array_equal(got[k], want[k])
        assert sum(fed[k]) == item.tokens.size
        for a, b in handed_off_pairs(item.state, cpu.state, transposed=False):
            np.testing.assert_array_equal(a, b)


def test_q8_0_hand_off_rounds_the_gpus_rows(models):
    """Issue 31: with a Q8_0 cache the GPU prefill still attends over fp32 keys and values, and
    rounds its rows to Q8_0 on the GPU before the hand-off (ops/act_quant.py, the CPU's
    rounding). So the same tokens through an fp32-cache model's prefill hand off the rows
    whose Q8_0 codes the Q8_0 model received: equal but where the two runs' fp32 values differ
    (the expert GEMMs' atomic adds: GPU_VS_GPU) across a rounding boundary, one code step; the
    logits and GDN states as two runs'."""
    from fermijit.ops import kv_quant

    f32 = load_model(models["tiny-e128"], kv=KvKind.F32)[1]
    q8 = load_model(models["tiny-e128"], kv=KvKind.Q8_0)[1]
    tokens = prompt(f32)
    states, logits = {}, {}
    for m in (f32, q8):
        pf, _ = gpu_prefiller(m)
        states[m.kv_kind] = m.new_state(N_PROMPT + 1)
        logits[m.kv_kind] = pf.prefill(tokens, states[m.kv_kind])
    assert_rel("logits", logits[KvKind.F32], logits[KvKind.Q8_0], GPU_VS_GPU)
    n_codes = n_equal = 0
    for a, b in zip(states[KvKind.F32].layers, states[KvKind.Q8_0].layers):
        if not isinstance(a, KvCache):
            for x, y in zip(a.arrays, b.arrays):
                assert_rel("gdn state", x, y, GPU_VS_GPU)
            continue
        assert b.kind is KvKind.Q8_0
        for rows, got in ((a.k[:, :N_PROMPT], b.k[:, :N_PROMPT]),
                          (a.v[:, :N_PROMPT], b.v[:, :N_PROMPT])):
            want = kv_quant.reference(rows)
            assert np.abs(want.qs.astype(int) - got.qs).max() <= 1
            np.testing.assert_allclose(got.d, want.d, rtol=GPU_VS_GPU * 10)
            n_codes += want.qs.size
            n_equal += int((want.qs == got.qs).sum())
    assert n_equal >= 0.99 * n_codes, (n_equal, n_codes)
    # and decode goes on from it (the CPU reads the codes)
    assert np.isfinite(q8.decode(int(np.argmax(logits[KvKind.Q8_0])), states[KvKind.Q8_0])).all()


def test_reserve_makes_the_hand_off_room_for_a_batch_before_it(loaded):
    """`reserve(n)` (the server, once ready) page-locks the hand-off buffer for n prompts
    together: a batch of n prompts then copies its states back through that buffer, not a new,
    larger one page-locked inside the pass; its logits are those of the batch without it."""
    model, _, _ = loaded("tiny-e128")
    items, _ = batch_items(model)
    pf, err = gpu_prefiller(model)
    pf.reserve(len(items))
    buf = pf.device._host["state"]
    assert buf.nbytes >= len(items) * model.state_nbytes(hybrid.RESERVE_TOKENS)
    got = pf.prefill_batch(items)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    assert pf.device._host["state"] is buf
    plain, _ = gpu_prefiller(model)
    plain_items, _ = batch_items(model)
    for k, want in enumerate(plain.prefill_batch(plain_items)):
        assert_rel(f"item {k} logits", want, got[k], GPU_VS_GPU)


def pooled_batch_items(model, pf):
    """batch_items, the new states' (position 0) GDN arrays from a pool in the prefiller's
    page-locked memory (the server's: fermijit/server/state_pool.py)."""
    from fermijit.server.state_pool import GdnPool

    pool = GdnPool(model, len(BATCH_LENGTHS))
    pool.fill(len(BATCH_LENGTHS), pf.host_memory)
    items, _ = batch_items(model)
    for item in items:
        pool.take(item.state)
    return items


def test_pooled_page_locked_states_take_the_hand_off_in_place(loaded, monkeypatch):
    """Issue 28 item 5: a batch whose new states' GDN arrays are page-locked (the server's pool)
    gets them by DMA in place (gpu_state.hand_off), the others through the hand-off buffer: the
    logits and states of the same batch on ordinary states. A copy back that fails there leaves
    those arrays zeros again: the CPU then prefills the batch bit for bit as its own
    prefill_batch from ordinary states."""
    from fermijit.jit import gpu
    from fermijit.model.state import GdnState

    model, _, _ = loaded("tiny-e128")
    pf, err = gpu_prefiller(model)
    items = pooled_batch_items(model, pf)
    pooled = [a for i in items if i.state.position == 0 for s in i.state.layers
              if isinstance(s, GdnState) for a in s.arrays]
    assert pooled and all(gpu.is_pinned(a) for a in pooled)
    got = pf.prefill_batch(items)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    plain, _ = batch_items(model)
    want = gpu_prefiller(model)[0].prefill_batch(plain)
    for k, (item, other) in enumerate(zip(items, plain)):
        assert_rel(f"item {k} logits", want[k], got[k], GPU_VS_GPU)
        for a, b in handed_off_pairs(item.state, other.state, transposed=False):
            assert_rel(f"item {k} state", b, a, GPU_VS_GPU)

    real = gpu.driver

    class Faulty:
        """The driver, but the second copy into one of `targets` (host addresses) raises."""

        def __init__(self, targets):
            self.n, self.targets = 0, targets

        def __getattr__(self, name):
            return getattr(real(), name)

        def memcpy_dtoh_async(self, dest, src, stream=None):
            if dest.ctypes.data in self.targets:
                self.n += 1
                if self.n == 2:
                    raise RuntimeError("an injected copy fault")
            return real().memcpy_dtoh_async(dest, src, stream)

    pf, err = gpu_prefiller(model)
    items = pooled_batch_items(model, pf)
    faulty = Faulty({a.ctypes.data for i in items if i.state.position == 0
                     for s in i.state.layers if isinstance(s, GdnState) for a in s.arrays})
    monkeypatch.setattr(gpu, "driver", lambda: (real(), faulty)[1])
    got = pf.prefill_batch(items)
    monkeypatch.setattr(gpu, "driver", real)
    assert faulty.n == 2 and "an injected copy fault" in err.getvalue(), err.getvalue()
    cpu_items, _ = batch_items(model)
    want = model.prefill_batch([i.tokens for i in cpu_items], [i.state for i in cpu_items])
    for k, (item, cpu) in enumerate(zip(items, cpu_items)):
        np.testing.assert_array_equal(got[k], want[k])
        for a, b in handed_off_pairs(item.state, cpu.state, transposed=False):
            np.testing.assert_array_equal(a, b)
