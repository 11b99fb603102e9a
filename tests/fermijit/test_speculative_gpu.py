"""The GPU prefill of a state with the MTP layer (fermijit/prefill/hybrid.py, issues 32 and 28): the
model's layers and then the head's rows on the GPU, in the same pass (gpu_prefill.Pass.head), so a
speculative decode can follow a GPU prefill. On a tiny model with a random head: the head's cache
rows and waiting hidden state against an all-CPU prefill's, one pass, chunked and continued; the
REAP calibration's count of the head's rows; greedy text after it equal to plain decoding's from
the same handed-off state."""

import numpy as np
import pytest

import dataclasses
import io

from fermijit import engine, speculative
from fermijit.model import convert, mtp, reap
from fermijit.model.forward import load_model
from fermijit.model.state import KvKind
from fermijit.ops.sampling import Sampler
from fermijit.prefill import hybrid
from tests.fermijit.prefill.hybrid_models import E128
from tests.gpu import MARKS, report_error
from tests.model import tiny

pytestmark = MARKS

# The handed-off state against the all-CPU run's on a tiny model: fp32 rounding and 8-bit flips
# (tests/fermijit/prefill/test_hybrid_gpu.py GPU_STATE_VS_CPU["tiny-e128"]); the head reads those
# states.
GPU_STATE_VS_CPU = 1e-2
N_PROMPT = 60
# Two GPU runs of the same tokens with fp32 activations differ only in the order of the experts'
# atomic adds (tests/fermijit/prefill/test_hybrid_gpu.py GPU_VS_GPU).
GPU_VS_GPU = 1e-5
CALIBRATION_CONTEXT = 64
# Routed slots of the head that the GPU's calibration may route elsewhere than the CPU's (router
# logits that nearly tie, moved by the states' rounding): as tests/model/test_reap_gpu.py.
MOVED_SLOTS = 0.05


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # the tiny 128-expert model the GPU kernels take (tiny.MTP's key dim 32 they do not), with
    # the whole MTP head; fp32 caches: the rows are compared in values
    root = tmp_path_factory.mktemp("spec-gpu")
    head = dataclasses.replace(E128, name="e128-mtp", mtp=True)
    convert.convert(tiny.write_checkpoint(root / "hf", model=head), root / "fj",
                    show_progress=False)
    return load_model(root / "fj", kv=KvKind.F32)[1]


def rel(expected, actual):
    return float(np.abs(expected - actual).max() / np.abs(expected).max())


@pytest.mark.parametrize("how", ["one pass", "chunked", "continued"])
def test_head_rows_follow_the_cpus(model, how, monkeypatch):
    """The head's rows run on the GPU, in the pass (the CPU's head made to fail): its cache rows,
    waiting hidden state and the logits against an all-CPU prefill's; chunked (the waiting row
    carried from pass to pass on the device) and continued (a state that had seen tokens, as
    after a restored prefix: its waiting row pairs with the first new token)."""
    n_prompt = 200 if how == "chunked" else N_PROMPT  # chunks: half the activations of 200
    n_seen = 17 if how == "continued" else 0
    tokens = np.random.default_rng(0).integers(0, 300, n_prompt).astype(np.int32)
    cpu_state = model.new_state(n_prompt + 8, mtp=True)
    cpu_logits = model.prefill(tokens, cpu_state)
    gpu_state = model.new_state(n_prompt + 8, mtp=True)
    if n_seen:
        model.prefill(tokens[:n_seen], gpu_state)
    budget = None
    if how == "chunked":
        plan = hybrid.plan(model, n_prompt, 0, 1 << 40, 1 << 40, with_head=True)
        budget = plan.total - plan.activations // 2
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, gpu_mem=budget, err=err)
    assert pf.prepare(), err.getvalue()

    def on_the_cpu(*args, **kwargs):
        raise AssertionError("the MTP head ran on the CPU")

    monkeypatch.setattr(mtp, "forward_rows", on_the_cpu)
    logits = pf.prefill(tokens[n_seen:], gpu_state)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    assert (how == "chunked") == (pf.last_plan.n_chunks > 1)
    n = n_prompt - 1
    a, b = mtp.cache(model, cpu_state), mtp.cache(model, gpu_state)
    for what, x, y in (("k", a.k[:, :n], b.k[:, :n]), ("v", a.v[:, :n], b.v[:, :n]),
                       ("hidden", cpu_state.hidden, gpu_state.hidden), ("logits", cpu_logits,
                                                                        logits)):
        report_error(f"gpu mtp head {what} vs all-CPU ({how})", x, y)
        assert rel(x, y) < GPU_STATE_VS_CPU, what
    assert gpu_state.hidden.shape == (1, model.hidden) and gpu_state.position == n_prompt


def test_calibration_counts_the_heads_rows_once(model):
    """REAP calibration through the GPU prefill observes the head's MoE as layer L, its rows
    that predict nothing yet (a window's last: gpu_prefill.Pass.head) not counted: the slots
    per layer as the CPU's calibration, and nearly the same routing."""
    tokens = np.random.default_rng(5).integers(0, 300, 2 * CALIBRATION_CONTEXT)
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, err=err)
    assert pf.prepare(), err.getvalue()
    gpu = reap.calibrate(model, tokens, CALIBRATION_CONTEXT, "random tokens", prefiller=pf)
    assert pf.broken is None, err.getvalue()
    cpu = reap.calibrate(model, tokens, CALIBRATION_CONTEXT, "random tokens")
    L = len(model.layers)
    assert gpu.counts.shape == cpu.counts.shape == (L + 1, model.n_experts)
    np.testing.assert_array_equal(gpu.counts.sum(axis=1), cpu.counts.sum(axis=1))
    assert cpu.counts[L].sum() == 2 * (CALIBRATION_CONTEXT - 1) * model.top_k
    moved = np.abs(gpu.counts[L] - cpu.counts[L]).sum() / 2 / cpu.counts[L].sum()
    print(f"gpu vs cpu calibration, the MTP head: {moved:.4f} of the routed slots moved")
    assert moved <= MOVED_SLOTS


def head_items(model, lengths=(60, 2, 33, 45), seen=(0, 0, 9, 21)):
    """PrefillItems of ragged prompts after states with the head that had seen `seen` tokens
    (prefilled on the CPU: their waiting hidden states set) or none."""
    items = []
    for k, (n, n_seen) in enumerate(zip(lengths, seen)):
        rng = np.random.default_rng(20 + k)
        state = model.new_state(n + n_seen + 8, mtp=True)
        if n_seen:
            model.prefill(rng.integers(0, 300, n_seen).astype(np.int32), state)
        items.append(hybrid.PrefillItem(rng.integers(0, 300, n).astype(np.int32), state))
    return items


def head_arrays(model, state):
    """The head's handed-off rows (its cache up to position - 1) and waiting hidden state."""
    kv, n = mtp.cache(model, state), state.position - 1
    return [kv.k[:, :n], kv.v[:, :n], state.hidden]


@pytest.mark.parametrize("against", ["alone", "split", "cpu"])
def test_a_batch_with_the_head_is_each_prefill_alone(model, against):
    """prefill_batch over states with the head (one pass over all their rows, each sequence's
    head rows lagging its own way: fresh or continued): the head's rows, waiting hidden state and
    logits against each prompt's prefill alone on the GPU (fp32 activations: to the GPU's own
    rounding); split: a budget of half the batch's activations, so passes cut the sequences
    (their waiting rows carried on the device); cpu: W4A8 against Model.prefill_batch."""
    w4a8 = against == "cpu"
    items = head_items(model)
    n_rows = sum(i.tokens.size for i in items)
    budget = None
    if against == "split":
        whole = hybrid.plan(model, n_rows, 0, 1 << 40, 1 << 40, with_head=True,
                            ends=[i.state.position + i.tokens.size for i in items])
        budget = whole.total - whole.activations // 2
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, gpu_mem=budget, err=err, w4a8=w4a8)
    assert pf.prepare(), err.getvalue()
    got = pf.prefill_batch(items)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    assert (pf.last_plan.n_chunks > 1) == (against == "split")
    if against != "split":
        assert pf.last_pass.T == n_rows
    others = head_items(model)
    if against == "cpu":
        want = model.prefill_batch([i.tokens for i in others], [i.state for i in others])
        bound = GPU_STATE_VS_CPU
    else:
        alone = hybrid.GpuPrefiller(model, err=err, w4a8=False)
        want = [alone.prefill(i.tokens, i.state) for i in others]
        bound = GPU_VS_GPU
    for k, (item, other) in enumerate(zip(items, others)):
        assert item.state.position == other.state.position
        pairs = zip(("k", "v", "hidden"), head_arrays(model, other.state),
                    head_arrays(model, item.state))
        for what, x, y in [*pairs, ("logits", want[k], got[k])]:
            report_error(f"gpu batch mtp {what} vs {against}", x, y)
            assert rel(x, y) <= bound, (k, what)


def test_speculative_decode_after_a_gpu_prefill(model):
    prompt = np.random.default_rng(1).integers(0, 300, N_PROMPT).astype(np.int32)
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, err=err)
    assert pf.prepare(), err.getvalue()
    texts = []
    for n_draft in (0, 2):
        sampler = Sampler(model.vocab_size, temperature=0, top_k=0, top_p=1.0, seed=0)
        tokens, _ = engine.generate(model, prompt, sampler, 24, N_PROMPT + 30, frozenset(),
                                    lambda t: None, prefiller=pf,
                                    drafts=speculative.Drafts(n_draft) if n_draft else None)
        texts.append(tokens)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    assert texts[0] == texts[1]
