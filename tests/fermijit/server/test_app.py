"""The server through the official OpenAI client and raw HTTP (issue 14 items 1, 2, 4): chat and
completions, streamed and not, stop strings, seeds, the prefix cache across turns, bad requests
(400 and the server keeps serving), 401, 413, 503, context overflow, a client that disconnects."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.fermijit.server.conftest import API_KEY

openai = pytest.importorskip("openai")

PROMPT = "To read a file in Python,"
N_TOKENS = 12  # short answers: the module stays well under a minute on 2 cores


@pytest.fixture(scope="module")
def client(server):
    url, _, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(client, prompt=PROMPT, max_tokens=N_TOKENS, **kwargs):
    return client.completions.create(model="default_model", prompt=prompt,
                                      max_tokens=max_tokens, temperature=0, **kwargs)


def _streamed(client, create, **kwargs) -> tuple[str, list]:
    chunks = list(create(stream=True, **kwargs))
    choices = [c.choices[0] for c in chunks if c.choices]
    texts = [getattr(ch, "text", None) or getattr(getattr(ch, "delta", None), "content", None)
             or "" for ch in choices]
    return "".join(texts), chunks


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["default_model"]
    assert client.models.retrieve("default_model").id == "default_model"
    missing = httpx.get(f"{server[0]}/v1/models/other/model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = httpx.get(f"{server[0]}/health").json()
    assert health["status"] == "ok"


def test_completion_streamed_and_not_agree(client):
    whole = _greedy(client)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == N_TOKENS
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + N_TOKENS
    text, chunks = _streamed(client, client.completions.create, model="m", prompt=PROMPT,
                             max_tokens=N_TOKENS, temperature=0)
    assert text == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_and_not_agree(client):
    messages = [{"role": "system", "content": "You answer about Python."},
                {"role": "user", "content": "How do I open a file?"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=N_TOKENS,
                                           temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.usage.completion_tokens == N_TOKENS
    text, chunks = _streamed(client, client.chat.completions.create, model="m",
                             messages=messages, max_tokens=N_TOKENS, temperature=0,
                             stream_options={"include_usage": True})
    assert text == message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == N_TOKENS and not chunks[-1].choices


def test_stop_strings_end_the_text_and_never_stream(client):
    text = _greedy(client).choices[0].text
    stop = text[len(text) // 3:len(text) // 3 + 3]  # three characters from inside the answer
    want = text[:text.find(stop)]
    for create_stream in (False, True):
        if create_stream:
            got, chunks = _streamed(client, client.completions.create, model="m", prompt=PROMPT,
                                    max_tokens=N_TOKENS, temperature=0, stop=[stop, "\x00"])
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = _greedy(client, stop=[stop, "\x00"])
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (want, "stop"), f"stream={create_stream}, stop={stop!r}"


def test_seeds_reproduce_samples(client):
    def sample(seed):
        return client.completions.create(model="m", prompt=PROMPT, max_tokens=N_TOKENS,
                                         temperature=1.0, top_p=0.9, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # a seed changes the draw


def test_second_chat_turn_prefills_only_its_new_tokens(client):
    turn = [{"role": "user", "content": "What does the with statement do with files?"}]
    first = client.chat.completions.create(model="m", messages=turn, max_tokens=N_TOKENS,
                                           temperature=0)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And for sockets?"}]
    second = client.chat.completions.create(model="m", messages=turn, max_tokens=N_TOKENS,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


BAD_BODIES = {
    "not json": b"{bad",
    "not an object": b"[1, 2]",
    "no messages": b'{"model": "m"}',
    "messages not a list": b'{"messages": "hi"}',
    "message without role": b'{"messages": [{"content": "hi"}]}',
    "role unknown": b'{"messages": [{"role": "robot", "content": "hi"}]}',
    "content a number": b'{"messages": [{"role": "user", "content": 5}]}',
    "max_tokens a string": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}',
    "max_tokens zero": b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
    "temperature a bool": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": true}',
    "temperature too high": b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 9}',
    "top_p zero": b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}',
    "seed a float": b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1.5}',
    "stop a number": b'{"messages": [{"role": "user", "content": "hi"}], "stop": 3}',
    "five stops": b'{"messages": [{"role": "user", "content": "hi"}], '
                  b'"stop": ["a", "b", "c", "d", "e"]}',
    "stream a string": b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    "n is 2": b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}',
    "not utf-8": b'{"messages": [{"role": "user", "content": "\xff"}]}',
    "a penalty": b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}',
    "logprobs": b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true}',
    "tools": b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "x"}]}',
    "image from the web": b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                          b'"image_url": {"url": "https://example.com/a.png"}}]}]}',
    "image not base64": b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                        b'"image_url": {"url": "data:image/png;base64,@@@"}}]}]}',
    "image on a text model": b'{"messages": [{"role": "user", "content": [{"type": "image_url", '
                             b'"image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}',
    "part of no kind": b'{"messages": [{"role": "user", "content": [{"type": "audio"}]}]}',
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_bad_requests_are_400_and_the_server_keeps_serving(server, client, body):
    r = httpx.post(f"{server[0]}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert _greedy(client, max_tokens=1).choices[0].text


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1, frequency_penalty=0, presence_penalty=0.0,
                                       logprobs=False, user="someone")
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bad_completion_prompts_are_400(server):
    for prompt in (None, 5, [], ["a", "b"], [1, "x"], [10 ** 9]):
        r = httpx.post(f"{server[0]}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400, (prompt, r.text)


def test_context_overflow_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        _greedy(client, max_tokens=10 ** 6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="m", prompt="word " * 5000, max_tokens=1)


def test_unknown_routes_are_openai_errors(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, f"{server[0]}{path}")
        assert r.status_code == status and r.json()["error"]["message"]


def test_body_over_the_limit_is_413(server):
    """The cap follows the context: the embedded model's 2048 positions, no images."""
    from fermijit.server.app import max_body_bytes

    limit = max_body_bytes(server[2].engine.model.max_context, has_images=False)
    assert limit < 1 << 20
    r = httpx.post(f"{server[0]}/v1/completions", content=b" " * (limit + 1))
    assert r.status_code == 413


def test_api_key_is_required_when_set(server):
    _, keyed_url, _ = server
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=key or "x", max_retries=0)
        if not key:
            r = httpx.post(f"{keyed_url}/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert r.status_code == 401
            continue
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="m", prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=API_KEY, max_retries=0)
    assert good.completions.create(model="m", prompt=PROMPT, max_tokens=1).choices[0].text
    assert httpx.get(f"{keyed_url}/health").status_code == 200  # health needs no key


def test_full_queue_is_503(engine):
    """A scheduler that is not running: its queue of one fills, the next request is refused."""
    from starlette.testclient import TestClient

    from fermijit.server import protocol
    from fermijit.server.app import make_app
    from fermijit.server.scheduler import QueueFull, Scheduler

    scheduler = Scheduler(engine, max_batch=1, queue_size=1)
    scheduler.submit(protocol.parse({"prompt": "a"}, is_chat=False))
    with pytest.raises(QueueFull):
        scheduler.submit(protocol.parse({"prompt": "a"}, is_chat=False))
    r = TestClient(make_app(scheduler, "m")).post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"


def test_client_disconnect_stops_its_sequence(server):
    url, _, scheduler = server
    cancelled = scheduler.n_cancelled
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 1500, "stream": True,
                            "temperature": 0}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            data = next(line for line in lines if line.startswith("data: "))
            assert json.loads(data[6:])["choices"]
    deadline = time.monotonic() + 20
    while scheduler.n_cancelled == cancelled or scheduler.active:
        assert time.monotonic() < deadline, "the sequence kept decoding after its client left"
        time.sleep(0.05)
