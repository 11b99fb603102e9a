"""The server's speculative steps (fermijit/server/scheduler.py `_speculative_step`, issue 32
item 2): at temperature 0 every answer is the one plain decoding gives, whether a request runs
alone (draft-and-verify steps) or beside others (batched steps, its head catching up after),
ends by eos, length or a stop string inside a step; and a chat's next turn resumes from the
snapshot of a speculative one. The scheduler is driven on the test's thread."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.engine import Engine, Settings
from fermijit.model import convert
from fermijit.server import prompts
from fermijit.server.protocol import Finished, Job, Started, Text
from fermijit.server.scheduler import Scheduler
from fermijit.speculative import Drafts
from tests.model import tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-server")
    convert.convert(tiny.write_checkpoint(root / "hf", model=tiny.MTP), root / "fj",
                    show_progress=False)
    return root / "fj"


def job(prompt, max_tokens, stop=()):
    events = []
    return Job(is_chat=False, prompt=prompt, max_tokens=max_tokens, temperature=0, top_p=None,
               top_k=None, seed=0, stop=tuple(stop), stream=True, include_usage=False,
               emit=events.append), events


def answers(scheduler, requests):
    """Submit every (prompt, max_tokens, stop) at once, step until all are done: their texts,
    finish reasons and cached prompt tokens."""
    jobs = [job(*r) for r in requests]
    for j, _ in jobs:
        prompts.prepare(scheduler.engine, j)  # tokenised, as the request's handler does
        scheduler.submit(j)
    while any(not any(isinstance(e, Finished) for e in events) for _, events in jobs):
        scheduler._admit()
        if scheduler.prefilling:  # prompts in chunks, as the serving loop runs them
            scheduler._prefill_chunk()
        if scheduler.active:
            scheduler._step()
    out = []
    for _, events in jobs:
        text = "".join(e.text for e in events if isinstance(e, Text))
        finished = [e for e in events if isinstance(e, Finished)][0]
        started = [e for e in events if isinstance(e, Started)][0]
        out.append((text, finished.reason, started.n_cached))
    return out


def test_answers_are_plain_decodings(model_dir, rng):
    plain = Scheduler(Engine.load(model_dir), max_batch=4)
    spec_engine = Engine.load(model_dir, speculative=True)
    assert spec_engine.speculative
    # auto: off, a tiny model's token reads far fewer bytes than speculation needs to pay
    assert not Engine.load(model_dir, speculative=None).speculative
    prompts = [[int(t) for t in rng.integers(3, 300, n)] for n in (5, 12, 3, 20)]
    requests = [(p, int(n), ()) for p, n in zip(prompts, (9, 17, 4, 30))]
    want = [a[:2] for a in answers(plain, requests)]
    # a stop string inside a later answer: it ends there, in the middle of a step
    text = want[3][0]
    requests.append((prompts[3], 30, (text[len(text) // 2:len(text) // 2 + 3],)))
    want += [a[:2] for a in answers(plain, requests[4:])]
    for n_draft in (1, 3):
        spec = Scheduler(spec_engine, max_batch=4, drafts=Drafts(n_draft))
        for i, r in enumerate(requests):                     # alone: speculative steps
            assert answers(spec, [r])[0][:2] == want[i], (n_draft, i)
        together = answers(spec, requests[:4])               # together: batched, then alone
        assert [a[:2] for a in together] == want[:4], n_draft
    assert spec.n_steps > 0


def test_next_turn_resumes_from_a_speculative_snapshot(model_dir, rng):
    engine, plain = Engine.load(model_dir, speculative=True), Engine.load(model_dir)
    spec = Scheduler(engine, max_batch=2, drafts=Drafts(2, vocab=200))

    def greedy(ids, n):
        return plain.generate(np.asarray(ids, np.int32), Settings(max_tokens=n, temperature=0),
                              lambda t: None)[0]

    prompt = [int(t) for t in rng.integers(3, 300, 14)]
    answer = greedy(prompt, 10)
    assert answers(spec, [(prompt, 10, ())])[0][0] == plain.tokenizer.decode(answer)
    # The snapshot holds the prompt and the answer's fed tokens (all but the last): a prompt
    # extending them resumes from there, and its answer is still plain decoding's.
    longer = prompt + answer[:-1] + [int(t) for t in rng.integers(3, 300, 3)]
    text, _, n_cached = answers(spec, [(longer, 8, ())])[0]
    assert n_cached == len(prompt) + len(answer) - 1
    assert text == plain.tokenizer.decode(greedy(longer, 8))
