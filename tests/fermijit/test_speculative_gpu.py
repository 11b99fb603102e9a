"""The GPU prefill of a state with the MTP layer (fermijit/hybrid.py, issue 32): the model's layers
on the GPU, the head's rows on the CPU from each pass's last hidden states, so a speculative
decode can follow a GPU prefill. On a tiny model with a random head: the head's cache rows and
waiting hidden state against an all-CPU prefill's, one pass and chunked; greedy text after it
equal to plain decoding's from the same handed-off state."""

import numpy as np
import pytest

import dataclasses
import io

from fermijit import engine, hybrid, speculative
from fermijit.model import convert, mtp
from fermijit.model.forward import load_model
from fermijit.model.state import KvKind
from fermijit.ops.sampling import Sampler
from tests.fermijit.hybrid_models import E128
from tests.gpu import MARKS
from tests.model import tiny

pytestmark = MARKS

# The handed-off state against the all-CPU run's on a tiny model: fp32 rounding and 8-bit flips
# (tests/fermijit/test_hybrid_gpu.py GPU_STATE_VS_CPU["tiny-e128"]); the head reads those states.
GPU_STATE_VS_CPU = 1e-2
N_PROMPT = 60


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


@pytest.mark.parametrize("chunked", [False, True])
def test_head_rows_follow_the_cpus(model, chunked):
    n_prompt = 200 if chunked else N_PROMPT  # chunks: a budget of half the activations of 200
    tokens = np.random.default_rng(0).integers(0, 300, n_prompt).astype(np.int32)
    cpu_state = model.new_state(n_prompt + 8, mtp=True)
    model.prefill(tokens, cpu_state)
    budget = None
    if chunked:
        plan = hybrid.plan(model, n_prompt, 0, 1 << 40, 1 << 40)
        budget = plan.total - plan.activations // 2
    err = io.StringIO()
    pf = hybrid.GpuPrefiller(model, gpu_mem=budget, err=err)
    assert pf.prepare(), err.getvalue()
    gpu_state = model.new_state(n_prompt + 8, mtp=True)
    pf.prefill(tokens, gpu_state)
    assert "on the CPU" not in err.getvalue(), err.getvalue()
    assert not chunked or pf.last_plan.n_chunks > 1
    n = n_prompt - 1
    a, b = mtp.cache(model, cpu_state), mtp.cache(model, gpu_state)
    assert rel(a.k[:, :n], b.k[:, :n]) < GPU_STATE_VS_CPU
    assert rel(a.v[:, :n], b.v[:, :n]) < GPU_STATE_VS_CPU
    assert gpu_state.hidden.shape == (1, model.hidden)
    assert rel(cpu_state.hidden, gpu_state.hidden) < GPU_STATE_VS_CPU


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
