"""The server under attack (issue 30 items 2, 3 and 9): hostile requests are each one OpenAI-style
4xx JSON with a one-line message, they do not stall the streams already running, and afterwards
a normal request answers the same text as before them."""

from __future__ import annotations

import json
import threading
import time

import httpx
import numpy as np
import pytest

PROMPT = "To read a file in Python,"
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
# The largest wait between two chunks of a running stream while hostile requests arrive
# (issue 30 item 2: four 4 MB prompts froze one for 22.9 s when the scheduler's thread
# tokenised them). A decode step of the default model takes ~10-70 ms here under load; on two
# cores the attack's own work (3.9 MB bodies read, 60 KB prompts tokenised) takes cores from the
# decode's threads: gaps of 0.3-0.9 s measured with the suite running beside it. On a slower
# machine the bound is twenty of its steps, measured before the attack.
MAX_CHUNK_GAP_S = 2.0
STEPS_PER_GAP = 20


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
    while len(times) < 6 and streamer.is_alive():  # the stream's own pace, before the attack
        time.sleep(0.01)
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
    begin = time.perf_counter()
    for t in attackers:
        t.start()
    for t in attackers:
        t.join()
    end = time.perf_counter()
    # The window is from the last chunk before the attack to the first one after it (the
    # attack can be over within one decode step, so chunks during it alone prove nothing).
    deadline = end + 10 * MAX_CHUNK_GAP_S
    while not any(t > end for t in times) and time.perf_counter() < deadline:
        time.sleep(0.01)
    stop.set()
    streamer.join(120)
    for r in results:
        assert_error(r, (400, 413))
    after = [t for t in times if t > end]
    assert after, "the stream did not go on after the requests were answered"
    window = [t for t in times if t <= begin][-1:] + [t for t in times if begin < t <= end]
    window.append(after[0])
    gaps = [b - a for a, b in zip(window, window[1:])]
    step = float(np.median(np.diff([t for t in times if t <= begin])))
    limit = max(MAX_CHUNK_GAP_S, STEPS_PER_GAP * step)
    print(f"attack {end - begin:.3f} s, largest gap {max(gaps):.3f} s over {len(gaps)} gaps "
          f"(a step {step * 1e3:.0f} ms)")
    assert max(gaps) < limit, f"the stream stopped for {max(gaps):.2f} s (limit {limit:.2f} s)"
    assert _text(url) == reference


HOSTILE_BODIES = {
    # item 3: each was a 500 (text/plain, or JSON from the scheduler) on main
    "nested 100000 deep": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    "a 5000-digit integer": (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    "a token id of 2**63": (b'{"prompt": [1, 9223372036854775808], "max_tokens": 1}', 400),
    "a token id of -2**63 - 1": (b'{"prompt": [-9223372036854775809], "max_tokens": 1}', 400),
    "a lone surrogate": (b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400),
    "a lone surrogate in a chat": (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    "a lone surrogate in a stop": (b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 1}', 400),
    "NaN": (b'{"prompt": "a", "temperature": NaN}', 400),
    "a duplicate key": (b'{"prompt": "a", "prompt": "b"}', 400),
    "an empty body": (b"", 400),
}


@pytest.mark.parametrize("body", HOSTILE_BODIES.values(), ids=HOSTILE_BODIES.keys())
def test_hostile_bodies_are_4xx_json(url, reference, body):
    content, status = body
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert_error(r, status)
    assert _text(url) == reference


@pytest.fixture
def server_log():
    """Records uvicorn's error log (where an exception in the app lands, with its traceback)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _raw(url: str):
    import socket

    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n")


def test_a_client_gone_while_sending_its_body_leaves_no_traceback(url, reference, server_log):
    """Item 3: 30 lines of traceback each on main (301 after a slow-client run)."""
    for _ in range(3):
        with _raw(url) as s:
            s.sendall(HEAD + b'{"prompt": "a", ')
        time.sleep(0.3)
    time.sleep(0.5)
    assert not [r for r in server_log if r.exc_info or r.levelname == "ERROR"], \
        [r.getMessage() for r in server_log]
    assert _text(url) == reference


def test_a_slow_head_is_closed(url, reference, monkeypatch):
    """Item 3: a connection that sends part of a request head, or nothing, was held for ever."""
    from fermijit.server import run

    monkeypatch.setattr(run, "HEADER_TIMEOUT_S", 0.5)
    with _raw(url) as silent, _raw(url) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert silent.recv(100) == b"" and slow.recv(100) == b""  # closed by the server
        assert time.monotonic() - start < 10
    assert _text(url) == reference


def test_a_slow_body_is_408(url, reference, monkeypatch):
    from fermijit.server import app

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.5)
    with _raw(url) as s:
        s.sendall(HEAD + b'{"prompt": ')
        reply = b""
        while piece := s.recv(4096):  # the server closes: the body was never whole
            reply += piece
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b'"code":"timeout"' in reply
    assert _text(url) == reference


def test_an_empty_api_key_is_refused_at_start(engine):
    from fermijit import FermijitError
    from fermijit.server.app import make_app
    from fermijit.server.scheduler import Scheduler

    with pytest.raises(FermijitError, match="--api-key is empty"):
        make_app(Scheduler(engine), "m", api_key="")


def test_an_empty_api_key_is_one_line(monkeypatch, capsys):
    from fermijit.server import run
    from tests.cli import run_cli
    from tests.fermijit.test_hardening import assert_one_line

    def listen(host, port):
        raise AssertionError("serve went on to listen")  # (and would serve for ever)

    monkeypatch.setattr(run, "listen", listen)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--api-key", "", "--port", "0")
    assert_one_line(code, err, "--api-key is empty")


def test_an_internal_error_is_500_json_naming_no_path(url, reference, server, monkeypatch):
    from fermijit.server import prompts

    def broken(engine, job, max_image_tokens=None):
        raise RuntimeError(f"{engine.directory}/x.bin is broken")

    monkeypatch.setattr(prompts, "prepare", broken)
    r = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60)
    monkeypatch.undo()
    error = assert_error(r, 500)
    assert error["type"] == "server_error"
    assert str(server[2].engine.directory) not in error["message"]
    assert _text(url) == reference


def test_errors_name_the_model_not_its_path(url, server):
    """An image sent to the embedded (text) model: the error said the model's directory."""
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}]})
    error = assert_error(r, 400, "default_model has no vision tower")
    assert str(server[2].engine.directory) not in error["message"]


def test_a_non_streaming_client_gone_mid_answer_stops_its_sequence(url, reference, server):
    """A non-streamed answer's tokens keep its handler busy, and the client was looked at only
    in a pause of DISCONNECT_POLL_S: one that closed mid-answer was decoded on to max_tokens
    (2000 tokens, 38 s here), holding its batch slot and its KV memory."""
    scheduler = server[2]
    n_cancelled = scheduler.n_cancelled
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}).encode()
    with _raw(url) as s:
        s.sendall(HEAD.replace(b"1000", str(len(body)).encode()) + body)
        deadline = time.monotonic() + 60
        while not scheduler.active and time.monotonic() < deadline:  # decoding
            time.sleep(0.01)
        assert scheduler.active
    while (scheduler.active or scheduler.prefilling) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.n_cancelled == n_cancelled + 1
    assert _text(url) == reference


@pytest.mark.parametrize("flags, message", [
    (("--max-batch", "100000"), "--max-batch 100000: that many requests hold at least"),
    (("--kv-mem", "0"), "more than --kv-mem's 0 MiB (which holds 0 such requests)"),
])
def test_a_batch_the_kv_memory_cannot_hold_is_refused_at_start(monkeypatch, capsys, flags,
                                                               message):
    """--max-batch 100000 made the warm-up's states for that many (1.7 GB, over a minute, no
    request served; the GPU's state pool at full size: the OOM killer); --kv-mem 0 served,
    every request a 400."""
    from fermijit.server import run
    from tests.cli import run_cli
    from tests.fermijit.test_hardening import assert_one_line

    def warm_up(*args, **kwargs):
        raise AssertionError("serve went on to warm up")

    monkeypatch.setattr(run, "warm_up", warm_up)
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--port", "0", "--prefill", "cpu",
                           "--threads", "1", *flags)
    assert_one_line(code, err, message)
