"""The server under attack (issue 30 items 2, 3 and 9): hostile requests are each one OpenAI-style
4xx JSON with a one-line message, they do not stall the streams already running, and afterwards
a normal request answers the same text as before them."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

PROMPT = "To read a file in Python,"
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
# The largest wait between two chunks of a running stream while hostile requests arrive
# (issue 30 item 2: four 4 MB prompts froze one for 22.9 s when the scheduler's thread
# tokenised them). A decode step of the default model takes ~10-40 ms here under load.
MAX_CHUNK_GAP_S = 1.0


def _text(url: str, body: dict = GREEDY) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_error(r: httpx.Response, status: int | tuple[int, ...], message: str = "") -> dict:
    """An OpenAI-style error: the status, JSON, a one-line message (naming no server path)."""
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert error["message"] and "\n" not in error["message"], error
    assert message in error["message"], error
    assert "/" + "tmp" not in error["message"] and "site-packages" not in error["message"]
    return error


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def reference(url):
    """What a normal request answers before any attack."""
    return _text(url)


def _stream_times(url: str, body: dict, started: threading.Event, stop: threading.Event,
                  times: list[float], texts: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            times.append(time.perf_counter())
            texts.append(choices[0]["text"] if choices else "")
            started.set()
            if stop.is_set():
                return


def test_a_stream_keeps_going_while_hostile_prompts_arrive(url, reference):
    """Item 2: prompts of 3.9 MB (over the body cap) and of ~60 KB (within it, but past the
    2048-token context) through both endpoints, four at once, while a stream runs: each is a 4xx
    JSON, and the stream's chunks never stop for MAX_CHUNK_GAP_S."""
    body = {"prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started, stop, times, texts = threading.Event(), threading.Event(), [], []
    streamer = threading.Thread(target=_stream_times, args=(url, body, started, stop, times,
                                                           texts))
    streamer.start()
    assert started.wait(60)
    hostile = []
    for size in (3_900_000, 60_000):
        words = "word " * (size // 5)
        hostile += [("/v1/completions", {"prompt": words, "max_tokens": 1}),
                    ("/v1/chat/completions",
                     {"messages": [{"role": "user", "content": words}], "max_tokens": 1})] * 2
    results: list = [None] * len(hostile)

    def attack(k: int) -> None:
        path, request = hostile[k]
        results[k] = httpx.post(f"{url}{path}", json=request, timeout=120)

    attackers = [threading.Thread(target=attack, args=(k,)) for k in range(len(hostile))]
    first = len(times)
    for t in attackers:
        t.start()
    for t in attackers:
        t.join()
    last = len(times)
    time.sleep(0.2)
    stop.set()
    streamer.join(120)
    for r in results:
        assert_error(r, (400, 413))
    assert last > first + 1, "the stream did not go on while the requests were answered"
    gaps = [b - a for a, b in zip(times[first:last], times[first + 1:last + 1])]
    print(f"largest gap {max(gaps):.3f} s over {len(gaps)} chunks")
    assert max(gaps) < MAX_CHUNK_GAP_S, f"the stream stopped for {max(gaps):.2f} s"
    assert _text(url) == reference
