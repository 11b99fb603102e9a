"""Hostile images over HTTP (issue 30 items 1, 2 and 9), on the tiny VLM with the real model's
pixel bounds: an image whose header claims 11500x11500 pixels is a 400 before it is decoded
(it was decoded, resized and run through the tower on the scheduler's only thread, stopping
every completion for minutes), as are images past --max-image-tokens or the context; a normal
image request answers the same text afterwards."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest

from fermijit.engine import Engine
from tests.fermijit.server.test_hostile import assert_error
from tests.fermijit.test_hostile_images import REAL_MAX_PIXELS
from tests.model import vision_oracle as vo

MAX_IMAGE_TOKENS = 64


def _uri(im) -> str:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from PIL import Image

    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    root = tmp_path_factory.mktemp("hostile-serve-images")
    scheduler = Scheduler(Engine.load(vo.converted_model(root, REAL_MAX_PIXELS)), max_batch=4,
                          queue_size=16)
    scheduler.start()
    server = ServerThread(make_app(scheduler, "vlm", max_image_tokens=MAX_IMAGE_TOKENS))
    yield {"url": server.url, "picture": _uri(vo.images()[0]),
           "huge": _uri(Image.new("1", (11500, 11500))),
           "big": _uri(Image.new("RGB", (96, 96)))}  # 144 tokens at 8x8 pixels a token
    server.stop()
    scheduler.stop()


def _ask(url, uri, max_tokens=5):
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "cat"}]}]})


@pytest.fixture(scope="module")
def reference(vlm):
    r = _ask(vlm["url"], vlm["picture"])
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.fixture
def no_decoding(monkeypatch):
    from fermijit.model import image

    def decode(self):
        raise AssertionError(f"{self.label} was decoded")

    monkeypatch.setattr(image.Encoded, "decode", decode)


def test_an_image_claiming_11500x11500_is_400_before_decoding(vlm, reference, no_decoding):
    start = time.perf_counter()
    r = _ask(vlm["url"], vlm["huge"])
    assert_error(r, 400, f"makes 262144 image tokens, more than the {MAX_IMAGE_TOKENS} allowed")
    assert time.perf_counter() - start < 30


def test_images_past_max_image_tokens_are_400(vlm, reference, no_decoding):
    assert_error(_ask(vlm["url"], vlm["big"]), 400, "more than the 64 allowed")


def test_an_image_prompt_past_the_context_is_400_before_decoding(vlm, reference, no_decoding):
    """A picture within the budget, max_tokens past the context."""
    r = _ask(vlm["url"], vlm["picture"], max_tokens=10 ** 6)
    assert_error(r, 400, "maximum context length")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_normal_image_answers_the_same_afterwards(vlm, reference):
    r = _ask(vlm["url"], vlm["picture"])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference
