"""The server at its limits (issue 33 item 2), through HTTP on the embedded model (context 2048):
`usage` on cache hits and misses, streamed and not; `max_tokens` absent, 1, exactly filling the
context and one past it; stop strings twice in one piece, spanning pieces, at the very start,
equal to a whole token; the batch bound and the queue bound, each exactly.

Each limit was a planted bug no server test caught before (issue 33): `total_tokens` short by the
cached tokens on a hit, one token short of the context without `max_tokens`, a request that just
fits refused, a stop string matched at its last occurrence in a piece, `max_batch + 1` admitted."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

from tests.fermijit.server.test_scheduler import _run as run_stops

MAX_CONTEXT = 2048          # the embedded model's max_position_embeddings
N_TOKENS = 6
LONG = 2000                 # tokens a sequence may run while a test looks at the others
TIMEOUT_S = 120


@pytest.fixture(scope="module", autouse=True)
def the_embedded_model_context(engine):
    assert engine.model.max_context == MAX_CONTEXT


def ids(seed: int, n: int) -> list[int]:
    """n token ids, none an end id (the embedded model's bos and eos are 0)."""
    return [int(t) for t in np.random.default_rng(seed).integers(1, 8192, n)]


def complete(url: str, **body) -> httpx.Response:
    body = {"temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)


def streamed(url: str, path: str = "/v1/completions", **body) -> tuple[str, list[dict]]:
    """(the text, every chunk) of a streamed request with its usage chunk."""
    body = {"temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    texts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
             or "" for c in chunks if c["choices"]]
    return "".join(texts), chunks


def usage_of(chunks: list[dict]) -> dict:
    last = chunks[-1]
    assert not last["choices"] and "usage" in last, last
    return last["usage"]


def assert_usage(usage: dict, n_prompt: int, n_completion: int, n_cached: int) -> None:
    assert usage == {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                     "total_tokens": n_prompt + n_completion,
                     "prompt_tokens_details": {"cached_tokens": n_cached}}, usage


# --- usage --------------------------------------------------------------------------------------

def test_usage_on_a_miss_and_a_hit(server):
    """total = prompt + completion whatever came from the cache; cached = the prompt on a repeat."""
    url = server[0]
    prompt = ids(1, 40)
    r = complete(url, prompt=prompt, max_tokens=N_TOKENS)
    assert r.status_code == 200, r.text
    assert_usage(r.json()["usage"], 40, N_TOKENS, 0)
    r = complete(url, prompt=prompt, max_tokens=N_TOKENS)
    assert_usage(r.json()["usage"], 40, N_TOKENS, 40)


def test_usage_streamed_on_a_miss_and_a_hit(server):
    url = server[0]
    prompt = ids(2, 33)
    _, chunks = streamed(url, prompt=prompt, max_tokens=N_TOKENS)
    assert_usage(usage_of(chunks), 33, N_TOKENS, 0)
    _, chunks = streamed(url, prompt=prompt, max_tokens=N_TOKENS)
    assert_usage(usage_of(chunks), 33, N_TOKENS, 33)


def test_usage_of_a_chat_turn_and_its_repeat(server, engine):
    url = server[0]
    messages = [{"role": "user", "content": "What does issue 33 of the limits test say?"}]
    body = {"model": "m", "messages": messages, "max_tokens": N_TOKENS, "temperature": 0,
            "ignore_eos": True}
    first = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S).json()
    n_prompt = first["usage"]["prompt_tokens"]
    text = engine.tokenizer.render_chat(messages)
    assert n_prompt == engine.tokenizer.encode(text, add_special_tokens=False).size
    assert_usage(first["usage"], n_prompt, N_TOKENS, first["usage"]["prompt_tokens_details"]
                 ["cached_tokens"])
    _, chunks = streamed(url, "/v1/chat/completions", **body)
    assert_usage(usage_of(chunks), n_prompt, N_TOKENS, n_prompt)


def test_usage_after_a_partial_hit(server):
    """A prompt extending an earlier one (not by its answer): cached is the earlier prompt."""
    url = server[0]
    prompt = ids(3, 25)
    assert_usage(complete(url, prompt=prompt, max_tokens=N_TOKENS).json()["usage"], 25,
                 N_TOKENS, 0)
    _, chunks = streamed(url, prompt=prompt + ids(4, 10), max_tokens=N_TOKENS)
    assert_usage(usage_of(chunks), 35, N_TOKENS, 25)


# --- max_tokens and the context -----------------------------------------------------------------

@pytest.fixture(scope="module")
def long_ids():
    """A prompt of the whole context: requests take its prefixes (the cache serves most of each)."""
    return ids(5, MAX_CONTEXT)


@pytest.mark.parametrize("n_prompt, max_tokens, n_completion", [
    (MAX_CONTEXT - N_TOKENS, None, N_TOKENS),       # absent: to the end of the context
    (MAX_CONTEXT - 1, None, 1),
    (MAX_CONTEXT - 100, 1, 1),
    (MAX_CONTEXT - N_TOKENS, N_TOKENS, N_TOKENS),   # n_prompt + max_tokens == context
    (MAX_CONTEXT - 1, 1, 1),
], ids=["absent", "absent-room-for-one", "one", "exactly-filling", "exactly-filling-one"])
def test_max_tokens_up_to_the_context(server, long_ids, n_prompt, max_tokens, n_completion):
    body = {"prompt": long_ids[:n_prompt]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    r = complete(server[0], **body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    usage = r.json()["usage"]
    assert_usage(usage, n_prompt, n_completion, usage["prompt_tokens_details"]["cached_tokens"])


def test_exactly_filling_the_context_streamed(server, long_ids):
    _, chunks = streamed(server[0], prompt=long_ids[:MAX_CONTEXT - 3], max_tokens=3)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert usage_of(chunks)["completion_tokens"] == 3


@pytest.mark.parametrize("n_prompt, max_tokens", [
    (MAX_CONTEXT - N_TOKENS, N_TOKENS + 1),         # one past the context
    (MAX_CONTEXT - 1, 2),
    (MAX_CONTEXT, 1),
    (MAX_CONTEXT, None),                            # no room for any token
    (MAX_CONTEXT + 1, None),
], ids=["one-past", "one-past-by-two", "full-prompt-one", "full-prompt-absent", "over-absent"])
def test_past_the_context_is_400(server, long_ids, n_prompt, max_tokens):
    body = {"prompt": (long_ids + ids(6, 1))[:n_prompt]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    r = complete(server[0], **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"maximum context length is {MAX_CONTEXT}" in error["message"]


# --- stop strings -------------------------------------------------------------------------------

STOP_PROMPT = "def main():\n"   # the greedy answer opens with indentation, and a piece "()\n\n"
N_STOP_TOKENS = 24


@pytest.fixture(scope="module")
def greedy_pieces(server, engine):
    """The text of each token of the greedy answer to STOP_PROMPT, checked to be the server's."""
    from fermijit.engine import Settings

    prompt = engine.tokenizer.encode(STOP_PROMPT)
    tokens, _ = engine.generate(prompt, Settings(max_tokens=N_STOP_TOKENS, temperature=0.0),
                                lambda t: None)
    decoder = engine.tokenizer.stream()
    pieces = [decoder.push(t) for t in tokens]
    r = complete(server[0], prompt=STOP_PROMPT, max_tokens=N_STOP_TOKENS, ignore_eos=False)
    assert r.json()["choices"][0]["text"] == "".join(pieces) + decoder.flush()
    assert len(pieces) == N_STOP_TOKENS and all(pieces), pieces
    return pieces


def stop_cases(pieces: list[str]) -> dict[str, tuple[str, int]]:
    """{case: (stop string, index of the piece completing its first occurrence)}, chosen from the
    answer's pieces; each case must occur in it."""
    text = "".join(pieces)
    starts = np.cumsum([0] + [len(p) for p in pieces])

    def piece_at(offset: int) -> int:
        return int(np.searchsorted(starts, offset, side="right")) - 1

    cases = {}
    for i, p in enumerate(pieces):   # a character twice in one piece, first met in that piece
        for c in p:
            if "twice-in-one-piece" not in cases and i > 0 and p.count(c) >= 2 \
                    and piece_at(text.find(c)) == i:
                cases["twice-in-one-piece"] = (c, i)
    first = pieces[0]
    cases["at-the-very-start"] = (first[:2], 0)
    cases["whole-first-token"] = (first, 0)
    for i, p in enumerate(pieces[1:], 1):
        if "whole-token" not in cases and text.find(p) == starts[i]:
            cases["whole-token"] = (p, i)
        nxt = pieces[i + 1] if i + 1 < len(pieces) else ""
        span = p[-2:] + nxt[:2]
        if "spanning-pieces" not in cases and len(p) >= 2 and len(nxt) >= 2 \
                and text.find(span) == starts[i + 1] - 2:
            cases["spanning-pieces"] = (span, i + 1)
        span3 = p[-1:] + nxt + (pieces[i + 2][:1] if i + 2 < len(pieces) else "")
        if "spanning-three-pieces" not in cases and i + 2 < len(pieces) \
                and text.find(span3) == starts[i + 1] - 1:
            cases["spanning-three-pieces"] = (span3, i + 2)
    return cases


STOP_CASES = ("twice-in-one-piece", "at-the-very-start", "whole-first-token", "whole-token",
              "spanning-pieces", "spanning-three-pieces")


@pytest.mark.parametrize("case", STOP_CASES)
def test_stop_strings_end_at_their_first_occurrence(server, greedy_pieces, case):
    cases = stop_cases(greedy_pieces)
    assert case in cases, f"the greedy answer to {STOP_PROMPT!r} has no {case} case: " \
                          f"{greedy_pieces}"
    stop, last_piece = cases[case]
    text = "".join(greedy_pieces)
    want = text[:text.find(stop)]
    body = {"prompt": STOP_PROMPT, "max_tokens": N_STOP_TOKENS, "stop": [stop],
            "ignore_eos": False}
    r = complete(server[0], **body).json()
    got = (r["choices"][0]["text"], r["choices"][0]["finish_reason"],
           r["usage"]["completion_tokens"])
    assert got == (want, "stop", last_piece + 1), f"stop={stop!r}"
    text_streamed, chunks = streamed(server[0], **body)
    assert (text_streamed, chunks[-2]["choices"][0]["finish_reason"]) == (want, "stop")


@pytest.mark.parametrize("stops, pieces, want", [
    (["\n"], ["a", "()\n\n", "b"], "a()"),                # twice in one piece: the first
    (["ab"], ["xabyab"], "x"),
    (["ab"], ["ab", "ab"], ""),                          # at the very start
    (["xy"], ["xy"], ""),                                # the whole first token
    (["cd"], ["ab", "cd", "ef"], "ab"),                  # a whole later token
    (["bcd"], ["ab", "c", "de"], "a"),                   # spanning three pieces
    (["z", "\n"], ["a\nz", "z"], "a"),                   # of two stops, the first to occur
])
def test_stop_matcher_edges(stops, pieces, want):
    assert run_stops(stops, pieces)[:2] == (want, True)


# --- the batch and queue bounds -----------------------------------------------------------------

@pytest.fixture
def small_server(engine):
    """serve(max_batch, queue_size) -> url of a server on the session's engine; its streams
    (`Running`) are closed at the end, passed or failed, so no sequence decodes on."""
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    made, streams = [], []

    def serve(max_batch: int, queue_size: int) -> str:
        scheduler = Scheduler(engine, max_batch=max_batch, queue_size=queue_size)
        scheduler.start()
        thread = ServerThread(make_app(scheduler, "m"))
        made.append((thread, scheduler))
        return thread.url

    serve.streams = streams
    yield serve
    for stream in streams:
        stream.close()
    for thread, scheduler in made:
        deadline = time.monotonic() + 30
        while scheduler.active or scheduler.waiting.qsize():  # cancelled ones finish first
            assert time.monotonic() < deadline, "sequences left running"
            time.sleep(0.05)
        thread.stop()
        scheduler.stop()


class Running:
    """A streamed request admitted and decoding (the response begins once it is admitted):
    `more(n)` reads n more chunks (n more decode steps), `close()` hangs up."""

    def __init__(self, serve, url: str, seed: int):
        serve.streams.append(self)
        self.client = httpx.Client(timeout=TIMEOUT_S)
        request = self.client.build_request("POST", f"{url}/v1/completions", json={
            "prompt": ids(seed, 8), "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True})
        self.response = self.client.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = (line for line in self.response.iter_lines() if line.startswith("data: "))
        self.more(1)

    def more(self, n: int) -> None:
        for _ in range(n):
            assert json.loads(next(self.lines)[6:])["choices"][0]["finish_reason"] is None

    def close(self) -> None:
        self.response.close()
        self.client.close()


class Waiting(threading.Thread):
    """A short request on a thread: `result` is its response once served."""

    def __init__(self, url: str, seed: int):
        super().__init__(daemon=True)
        self.url, self.seed, self.result = url, seed, None
        self.start()

    def run(self) -> None:
        self.result = complete(self.url, prompt=ids(self.seed, 5), max_tokens=2)


def health(url: str) -> tuple[int, int]:
    """(sequences running, requests waiting)."""
    h = httpx.get(f"{url}/health").json()
    return h["active"], h["waiting"]


def settled(url: str, n_requests: int, short: list[Waiting]) -> tuple[int, int]:
    """`health` once all `n_requests` sent are running or waiting, or as soon as one of the
    `short` ones was served (a wrong bound shows at once, whichever it breaks)."""
    deadline = time.monotonic() + TIMEOUT_S
    while sum(h := health(url)) != n_requests:
        if any(w.result is not None for w in short):
            break
        assert time.monotonic() < deadline, f"health {h}: not all {n_requests} requests arrived"
        time.sleep(0.02)
    assert all(w.result is None for w in short), "a request was served past the bounds"
    return h


def test_max_batch_run_and_the_next_waits(small_server):
    url = small_server(2, 4)
    first, second = Running(small_server, url, 10), Running(small_server, url, 11)
    third = Waiting(url, 12)
    assert settled(url, 3, [third]) == (2, 1)
    second.more(5)                       # five more steps: admission ran between each
    assert health(url) == (2, 1)
    assert third.result is None, "a third sequence was served beside max_batch = 2"
    first.close()                        # room for one: the third is admitted and served
    third.join(TIMEOUT_S)
    assert third.result.status_code == 200, third.result.text
    assert third.result.json()["usage"]["completion_tokens"] == 2
    second.more(2)


def test_queue_size_queued_and_the_next_is_503(small_server):
    url = small_server(1, 2)
    running = Running(small_server, url, 20)
    queued = [Waiting(url, 21), Waiting(url, 22)]
    assert settled(url, 3, queued) == (1, 2)
    r = complete(url, prompt=ids(23, 5), max_tokens=2)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "queue_full"
    running.more(3)
    assert health(url) == (1, 2) and all(q.result is None for q in queued)
    running.close()
    for q in queued:                      # both served once the running one is gone
        q.join(TIMEOUT_S)
        assert q.result.status_code == 200, q.result.text
