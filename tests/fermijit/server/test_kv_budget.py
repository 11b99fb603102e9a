"""The server's KV memory budget (--kv-mem, issue 31 item 2): a request whose state can never fit
is a 400, one that does not fit beside the running ones a 503, both with a message that says so;
what fits runs."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import pytest

from fermijit.server import kv_budget
from fermijit.server.protocol import ApiError


def test_admit_counts_prompt_plus_max_tokens(engine):
    model = engine.model
    need = model.state_nbytes
    budget = need(100) + need(150)
    assert kv_budget.admit(model, 100, [150], budget) == need(100)
    too_long = (budget - need(0)) // (need(1) - need(0)) + 1          # alone past the budget
    with pytest.raises(ApiError, match=f"{too_long} positions .* more than the server's "
                                       f"--kv-mem") as e:
        kv_budget.admit(model, too_long, [], budget)
    assert e.value.status == 400 and e.value.code == "kv_memory_exceeded"
    with pytest.raises(ApiError, match="in use .* by 2 running requests.*retry later") as e:
        kv_budget.admit(model, 100, [150, 60], budget)
    assert e.value.status == 503 and e.value.code == "kv_memory_full"


def test_admit_counts_the_mtp_layers_cache(engine):
    """Speculative decoding's states hold the MTP layer's KV cache too: one attention layer's
    more (it was left out of --kv-mem's count)."""
    model = engine.model
    assert model.mtp is not None
    need = model.state_nbytes
    per_layer = (need(100) - need(0)) // sum(model.is_attention)  # one attention layer's cache
    assert need(100, mtp=True) - need(100) == per_layer > 0
    assert kv_budget.admit(model, 100, [150], need(100, True) + need(150, True),
                           mtp=True) == need(100, True)
    with pytest.raises(ApiError, match="in use"):
        kv_budget.admit(model, 100, [150], need(100) + need(150), mtp=True)


@contextmanager
def serving(engine, kv_mem):
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=4, queue_size=8, kv_mem=kv_mem)
    scheduler.start()
    server = ServerThread(make_app(scheduler, "m"))
    try:
        yield f"{server.url}/v1/completions"
    finally:
        server.stop()
        scheduler.stop()


def test_server_refuses_what_does_not_fit(engine):
    need = engine.model.state_nbytes
    prompt = "a b"
    n_prompt = engine.tokenizer.encode(prompt).size
    with serving(engine, need(n_prompt + 100)) as url:
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": 101}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "kv_memory_exceeded"
        assert "--kv-mem" in r.json()["error"]["message"]
    with serving(engine, need(n_prompt + 700) + need(n_prompt + 100)) as url:
        with httpx.stream("POST", url, timeout=60, json={
                "prompt": prompt, "max_tokens": 700, "stream": True, "ignore_eos": True}) as first:
            lines = first.iter_lines()
            data = next(line for line in lines if line.startswith("data: "))
            assert json.loads(data[6:])["choices"]                     # it runs, holding 700+
            r = httpx.post(url, json={"prompt": prompt, "max_tokens": 101}, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "kv_memory_full"
            r = httpx.post(url, json={"prompt": prompt, "max_tokens": 100}, timeout=60)
            assert r.status_code == 200                                 # this one fits beside


def test_prompts_still_prefilling_count(engine):
    """Requests that arrive together are admitted before any has decoded a token: only the
    decoding sequences were counted, so three 1400-token prompts, each alone within --kv-mem but
    not two together, all ran (5.2 MB of states held under a 3 MiB --kv-mem)."""
    from fermijit.server import prompts
    from fermijit.server.protocol import Failed, Job
    from fermijit.server.scheduler import Scheduler

    need = engine.model.state_nbytes
    scheduler = Scheduler(engine, max_batch=4, queue_size=8, kv_mem=need(300) * 3 // 2)
    events = []
    for k in range(3):
        job = Job(is_chat=False, prompt=f"{k} " + "a " * 200, max_tokens=50, temperature=0,
                  top_p=None, top_k=None, seed=0, stop=(), stream=False, include_usage=False,
                  emit=events.append)
        prompts.prepare(engine, job)
        assert job.ids.size + 50 <= 300
        scheduler.submit(job)
    scheduler._admit()  # the three together, as an idle scheduler gathers them
    assert len(scheduler.prefilling) + len(scheduler.active) == 1
    failed = [e.error for e in events if isinstance(e, Failed)]
    assert [(e.status, e.code) for e in failed] == [(503, "kv_memory_full")] * 2


@pytest.mark.skipif(not __import__("fermijit.jit.omp", fromlist=["x"]).available(),
                    reason="a prefill beside decode needs the omp threading layer")
def test_a_prompt_cancelled_on_the_gpu_counts_until_its_call_ends(engine):
    """A prompt whose client goes away while the GPU prefills it (scheduler.GpuJob) still holds
    its state (the GPU's thread writes it) until that call ends: it was dropped from the count at
    the next chunk, so a request that did not fit beside it was admitted meanwhile."""
    import threading

    from fermijit.engine import Engine
    from fermijit.prefill.hybrid import CpuPrefiller
    from fermijit.server import prompts
    from fermijit.server.protocol import Failed, Job
    from fermijit.server.scheduler import Scheduler

    gate = threading.Event()

    class Blocked(CpuPrefiller):  # the GPU's: whole prompts beside decode, held until `gate`
        chunk_tokens, runs_beside_decode = None, True

        def prefill_batch(self, items, align=None):
            gate.wait(60)
            return super().prefill_batch(items, align)

    need = engine.model.state_nbytes
    events = []

    def submit(text, max_tokens):
        job = Job(is_chat=False, prompt=text, max_tokens=max_tokens, temperature=0, top_p=None,
                  top_k=None, seed=0, stop=(), stream=False, include_usage=False,
                  emit=events.append)
        prompts.prepare(engine, job)
        scheduler.submit(job)
        scheduler._admit()
        return job

    big, small = ("a " * 100, 400), ("b", 4)
    n_big = engine.tokenizer.encode(big[0]).size + big[1]
    n_small = engine.tokenizer.encode(small[0]).size + small[1]
    own = Engine(engine.model, engine.tokenizer, None, Blocked(engine.model))
    # room for one big and one small request, not for two big ones
    scheduler = Scheduler(own, max_batch=4, queue_size=8, kv_mem=need(n_big) + need(n_small))
    try:
        on_gpu = submit(*big)
        scheduler._prefill_chunk()  # its prompt to the GPU's thread, which holds it
        assert scheduler._gpu_job is not None
        on_gpu.cancelled.set()      # its client gone meanwhile
        submit(*small)              # fits beside it
        scheduler._prefill_chunk()  # the small one waits for the GPU; the cancelled one is there
        submit(*big)                # does not fit while the GPU writes the cancelled one's state
        failed = [e.error for e in events if isinstance(e, Failed)]
        assert [(e.status, e.code) for e in failed] == [(503, "kv_memory_full")]
    finally:
        gate.set()  # the GPU call ends, whatever the test found
    scheduler._gpu_job.done.wait(60)
    n_cancelled = scheduler.n_cancelled
    scheduler._collect_gpu_job()  # the call over: now the cancelled one is gone
    assert scheduler.n_cancelled == n_cancelled + 1
    assert on_gpu not in [s.job for s in scheduler.prefilling + scheduler.active]
    submit(*big)
    assert len([e for e in events if isinstance(e, Failed)]) == 1  # now it fits
