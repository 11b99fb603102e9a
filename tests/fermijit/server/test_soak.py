"""Defects the soak of the real server found (tests/fermijit/server/soak.py: many clients for
minutes, overlapping, leaving at every moment), each reproduced small. The scheduler is driven
on the test's thread where the order of its steps matters."""

from __future__ import annotations

import numpy as np

from fermijit.server.protocol import Failed, Finished, Job, Text

N_TOKENS = 4


def job(prompt, seed: int = 7) -> tuple[Job, list]:
    events: list = []
    return Job(is_chat=False, prompt=prompt, max_tokens=N_TOKENS, temperature=0.8, top_p=None,
               top_k=None, seed=seed, stop=(), stream=False, include_usage=False,
               ids=np.asarray(prompt, np.int32), emit=events.append), events


def answer(events: list) -> str:
    assert not any(isinstance(e, Failed) for e in events), events
    assert isinstance(events[-1], Finished), events
    return "".join(e.text for e in events if isinstance(e, Text))


def run(scheduler) -> None:
    while scheduler.prefilling or scheduler.active or scheduler.waiting.qsize():
        scheduler._admit()
        if scheduler.prefilling:
            scheduler._prefill_chunk()
        if scheduler.active:
            scheduler._step()


def test_identical_requests_prefilled_together_both_answer(engine):
    """The same seeded request twice at once (a client's retry, a benchmark's fixed seed): the
    second resumed from the snapshot the first took mid-prompt and both ended in one chunk,
    second first. Removing it from the prompts prefilling compared Sequences by value (the
    dataclass's ==), through their equal Jobs down to their token arrays: a ValueError, a 500
    for every prompt of that chunk. A sequence is itself: compared by identity."""
    from fermijit.cache.prefix_cache import PrefixCache
    from fermijit.engine import Engine
    from fermijit.prefill.hybrid import CPU_CHUNK_TOKENS
    from fermijit.server.scheduler import Scheduler

    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 8000, CPU_CHUNK_TOKENS + 40)]
    alone_engine = Engine(engine.model, engine.tokenizer, None)
    alone = Scheduler(alone_engine, max_batch=4)
    first, events = job(prompt)
    alone.submit(first)
    run(alone)
    want = answer(events)

    own = Engine(engine.model, engine.tokenizer, PrefixCache("test", mem_bytes=1 << 30,
                                                              snapshot_every=CPU_CHUNK_TOKENS))
    scheduler = Scheduler(own, max_batch=4)
    (a, a_events), (b, b_events) = job(prompt), job(prompt)
    scheduler.submit(a)
    scheduler._admit()
    scheduler._prefill_chunk()  # its first CPU_CHUNK_TOKENS, snapshotted at their end
    scheduler.submit(b)
    scheduler._admit()          # resumed from that snapshot: its rest is a's
    assert scheduler.prefilling[1].n_cached == CPU_CHUNK_TOKENS
    run(scheduler)
    assert answer(a_events) == answer(b_events) == want
