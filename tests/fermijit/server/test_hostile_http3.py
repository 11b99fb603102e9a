"""The HTTP surface as vLLM's and llama.cpp's users hit it (a third sweep): their sampling
extensions, which this server does not implement, are refused unless neutral (they were ignored,
the answer silently not the one asked for); a queued request whose client left gives its place
back; assistant tool calls in a chat's history are refused as tools are."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from fermijit import FermijitError

from tests.fermijit.server.test_hostile import (GREEDY, _text, assert_error,  # noqa: F401
                                                reference, url)  # the fixtures

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


# What each would have changed, and its neutral value (sent by clients at their defaults).
EXTENSIONS = {
    "min_p": (0.5, 0.0), "repetition_penalty": (1.2, 1.0), "min_tokens": (5, 0),
    "stop_token_ids": ([5], []), "guided_json": ({"type": "object"}, None),
    "repeat_penalty": (1.1, 1.0), "typical_p": (0.5, 1.0), "mirostat": (2, 0),
    "grammar": ("root ::= \"a\"", ""), "json_schema": ({"type": "object"}, {}),
}


def test_sampling_extensions_are_400_unless_neutral(url, reference):
    for name, (value, neutral) in EXTENSIONS.items():
        for path, body in (("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)):
            r = httpx.post(f"{url}{path}", json={**body, name: value}, timeout=60)
            error = assert_error(r, 400, f"'{name}' is not supported")
            assert error["param"] == name and error["code"] == "unsupported_parameter"
            r = httpx.post(f"{url}{path}", json={**body, name: neutral}, timeout=60)
            assert r.status_code == 200, (name, neutral, r.text)
    assert _text(url) == reference


def test_assistant_tool_calls_are_400(url, reference):
    """Tools are not supported: an assistant turn's tool calls were dropped from the history,
    the model shown a conversation the client did not send."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "user", "content": "and?"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=60)
    assert_error(r, 400, "tool calls")
    messages[1]["tool_calls"] = []  # as some clients send a plain turn
    messages[1]["content"] = "hello"
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    assert _text(url) == reference


def test_chat_template_kwargs_reach_the_template(url, server):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking) are the template's variables, for
    chats only, never one the server sets; they were a 400 (and before that ignored)."""
    tokenizer = server[2].engine.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}"
                               "no thinking here {% endif %}" + template)
    try:
        def prompt_tokens(**body):
            r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, **body}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain = prompt_tokens()
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
        assert prompt_tokens(chat_template_kwargs={}) == plain
    finally:
        tokenizer.chat_template = template
    for variables, message in (({"messages": []}, "'messages'"), ({"a b": 1}, "'a b'"),
                               ([1], "chat_template_kwargs")):
        r = httpx.post(f"{url}/v1/chat/completions",
                       json={**CHAT, "chat_template_kwargs": variables}, timeout=60)
        assert_error(r, 400, message)
    r = httpx.post(f"{url}/v1/completions",
                   json={**GREEDY, "chat_template_kwargs": {"enable_thinking": False}}, timeout=60)
    assert_error(r, 400, "chat completions only")


def test_allowed_origins_get_cors_and_others_do_not(server, url):
    """--allow-origin: a browser page of that origin may call the API (its preflight answered
    before the key's check, the answers marked for it); without it, or from another origin,
    the browser is told nothing (a preflight 405 / 400, no Access-Control-Allow-Origin)."""
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from tests.fermijit.server.conftest import API_KEY

    page = "http://localhost:3000"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight, timeout=10)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    allowed = ServerThread(make_app(server[2], "m", API_KEY, origins=(page,)))
    try:
        r = httpx.options(f"{allowed.url}/v1/chat/completions", headers=preflight, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == page
        allowed_headers = r.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed_headers and "x-stainless-os" in allowed_headers
        r = httpx.post(f"{allowed.url}/v1/completions", json=GREEDY, timeout=60,
                       headers={"Origin": page, "Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = httpx.options(f"{allowed.url}/v1/chat/completions", timeout=10,
                          headers={**preflight, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    finally:
        allowed.stop()
    with pytest.raises(FermijitError, match="--allow-origin"):
        make_app(server[2], "m", origins=("localhost:3000",))


def test_llama_cpp_s_n_predict_and_random_seed(url):
    """llama.cpp's clients send n_predict (its max_tokens; -1: none) and seed -1 ("a random
    seed"): n_predict was a 400 and -1 the fixed seed 1."""
    def completion(**body):
        r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "ignore_eos": True, **body},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    assert completion(n_predict=3, max_tokens=None)["usage"]["completion_tokens"] == 3
    assert completion(n_predict=-1, max_tokens=2)["usage"]["completion_tokens"] == 2
    for body, message in (({"n_predict": 3, "max_tokens": 5}, "differ"),
                          ({"n_predict": 0}, "'n_predict'")):
        assert_error(httpx.post(f"{url}/v1/completions", json={**GREEDY, **body}, timeout=60),
                     400, message)
    sampled = dict(temperature=2.0, max_tokens=16)
    texts = {completion(seed=-1, **sampled)["choices"][0]["text"] for _ in range(3)}
    assert len(texts) > 1  # three random seeds (the same seed thrice: one text)
    assert len({completion(seed=7, **sampled)["choices"][0]["text"] for _ in range(2)}) == 1


@contextlib.contextmanager
def _a_request_left_queued(engine, queue_size: int):
    """A server whose scheduler is not started (requests wait), and one request in its queue
    whose client left (timed out): (scheduler, server), the job seen cancelled."""
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=1, queue_size=queue_size)
    server = ServerThread(make_app(scheduler, "m"))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=1)
        deadline = time.monotonic() + 10
        while not scheduler.waiting.queue[0].cancelled.is_set():  # the app saw it go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield scheduler, server
    finally:
        server.stop()
        scheduler.stop()


def test_a_queued_request_whose_client_left_gives_its_place_back(engine, reference):
    """A queue of one, its request's client gone (timed out): the job stayed queued, cancelled,
    until a batch place freed, and every request meanwhile was a 503 "queue full" (on the real
    model, for as long as the running streams took)."""
    with _a_request_left_queued(engine, 1) as (scheduler, server):
        deadline = time.monotonic() + 10
        results = []
        waiter = threading.Thread(target=lambda: results.append(
            httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=60)))
        waiter.start()
        while not results and not any(not j.cancelled.is_set() for j in scheduler.waiting.queue):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        scheduler.start()
        waiter.join(60)
        assert results[0].status_code == 200, results[0].text
        assert results[0].json()["choices"][0]["text"] == reference


def test_health_counts_only_the_waiting_requests_whose_clients_are_there(engine):
    """/health's "waiting" counted a request whose client had left (cancelled) until the queue
    was cleared or the job taken."""
    with _a_request_left_queued(engine, 2) as (scheduler, server):
        assert scheduler.waiting.qsize() == 1
        assert httpx.get(f"{server.url}/health", timeout=10).json()["waiting"] == 0


def test_a_stop_string_past_max_stop_chars_is_400(url, reference):
    """The scheduler's thread holds back the text that could still grow into a stop string,
    at a cost per token quadratic in its length (StopMatcher.push): a stop string of the
    greedy answer's first 30000 characters and one more took 9 ms a token from every stream,
    and a body of the real model's (4.3 MiB) allows a million."""
    from fermijit.server.protocol import MAX_STOP_CHARS
    from fermijit.server.scheduler import StopMatcher

    r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "stop": ["x" * MAX_STOP_CHARS]},
                   timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions",
                   json={**GREEDY, "stop": ["a", "x" * (MAX_STOP_CHARS + 1)]}, timeout=60)
    assert_error(r, 400, f"at most {MAX_STOP_CHARS} characters")
    # the worst a stop string within the bound costs: its whole length held back, token by token
    matcher = StopMatcher(("ab" * (MAX_STOP_CHARS // 2 - 1) + "Z",))
    start = time.perf_counter()
    for _ in range(MAX_STOP_CHARS // 2 - 1):
        assert matcher.push("ab") == ("", False)
    assert time.perf_counter() - start < 2.0  # ~0.1 s here
    assert _text(url) == reference


@pytest.mark.parametrize("key", ["sk-\u00ff", "sk-\u20ac", " sk", "sk\t", "sk\x01"])
def test_an_api_key_no_client_can_send_is_refused_at_start(engine, key):
    """A key of non-ASCII characters: httpx (the openai client) cannot send it, curl sends its
    UTF-8 bytes, which the server (reading headers as latin-1) never matched; leading or
    trailing white space is stripped from the header: every request was a 401."""
    from fermijit import FermijitError
    from fermijit.server.app import make_app
    from fermijit.server.scheduler import Scheduler

    with pytest.raises(FermijitError, match="--api-key must be printable ASCII"):
        make_app(Scheduler(engine), "m", api_key=key)


def test_a_wrong_method_is_405_method_not_allowed(url):
    """It said code "not_found", and without the Allow header HTTP asks of a 405."""
    for method, path, allowed in (("GET", "/v1/chat/completions", "POST"),
                                  ("PUT", "/v1/completions", "POST"),
                                  ("POST", "/v1/models", "GET")):
        r = httpx.request(method, f"{url}{path}", timeout=60)
        error = assert_error(r, 405, f"{method} {path}")
        assert error["code"] == "method_not_allowed"
        assert allowed in r.headers["allow"]
    assert_error(httpx.get(f"{url}/v1/nothing", timeout=60), 404)["code"] == "not_found"


def test_a_stream_gone_while_its_prompt_prefills_stops_at_the_next_chunk(engine, reference):
    """The client of a streamed completion hangs up while its prompt is prefilled in chunks
    (slowed here to 0.2 s each): no chunk after the next is prefilled, the sequence never
    decodes, and the server answers as before. (Nothing is sent to a completion's client
    before its first token, so only the disconnect listener of Starlette's streaming response
    sees it go: ASGI spec 2.4 would leave it to the first token's send.)"""
    import numpy as np

    from fermijit.prefill.hybrid import CpuPrefiller
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    class Slow(CpuPrefiller):
        chunk_tokens = 64

        def prefill_batch(self, items, align=None):
            calls.append(time.monotonic())
            time.sleep(0.2)
            return super().prefill_batch(items, align)

    calls = []
    scheduler = Scheduler(engine, max_batch=2, queue_size=2)
    scheduler._prefiller = lambda: scheduler._cpu()
    scheduler._cpu_prefiller = Slow(engine.model)
    scheduler.start()
    server = ServerThread(make_app(scheduler, "m"))
    try:
        prompt = [int(t) for t in np.random.default_rng(0).integers(1, 8192, 1500)]
        n_cancelled, n_steps = scheduler.n_cancelled, scheduler.n_steps
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 5, "stream": True}) as r:
            assert r.status_code == 200
            time.sleep(0.5)
        gone = time.monotonic()
        while scheduler.prefilling or scheduler.active:
            assert time.monotonic() < gone + 10, "the prompt was prefilled on"
            time.sleep(0.05)
        assert len([t for t in calls if t > gone]) <= 1
        assert scheduler.n_cancelled == n_cancelled + 1 and scheduler.n_steps == n_steps
        assert len(calls) < 1500 // 64
        r = httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=60)
        assert r.json()["choices"][0]["text"] == reference
    finally:
        server.stop()
        scheduler.stop()


def test_max_tokens_and_max_completion_tokens_that_differ_are_400(url):
    """max_tokens won silently (vLLM takes max_completion_tokens, OpenAI's newer name)."""
    both = {**CHAT, "max_tokens": 1, "max_completion_tokens": 3}
    error = assert_error(httpx.post(f"{url}/v1/chat/completions", json=both, timeout=60), 400,
                         "max_completion_tokens")
    assert error["param"] == "max_completion_tokens"
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={**CHAT, "max_tokens": 2, "max_completion_tokens": 2, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        **CHAT, "max_tokens": None, "max_completion_tokens": 2, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 2


def test_streamed_text_with_unicode_line_separators_stays_one_line_an_event():
    """JSON leaves U+2028, U+2029 and U+0085 (NEL) raw, and Python's str.splitlines (httpx's
    iter_lines: the usual hand-written SSE client) splits lines there: a token's text holding
    one cut its event's JSON in two."""
    import asyncio
    import json

    from fermijit.server import protocol
    from fermijit.server.app import _sse

    text = "a\u2028b\u2029c\x85d\r\ne"
    job = protocol.parse({"prompt": "x", "stream": True}, False)

    async def events():
        queue = asyncio.Queue()
        for event in (protocol.Text(text), protocol.Finished("stop", 1, 0, 1)):
            queue.put_nowait(event)
        return "".join([piece async for piece in _sse(job, queue, "cmpl-1", False, "m")])

    lines = httpx.Response(200, content=asyncio.run(events()).encode()).iter_lines()
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[0])["choices"][0]["text"] == text
