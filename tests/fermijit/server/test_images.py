"""Images over HTTP (issue 17 item 3): OpenAI `image_url` content parts with data: URIs, on the
tiny VLM (4-bit), give the continuation `generate --image` makes from the same image; a broken
image is a 400 and the server keeps serving."""

from __future__ import annotations

import base64
import io

import pytest

from fermijit.engine import Engine, Settings
from fermijit.model import convert
from tests.model import vision_oracle as vo

openai = pytest.importorskip("openai")

PROMPT = "the cat"
N_TOKENS = 5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(engine, base url, data URIs of two images)."""
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    root = tmp_path_factory.mktemp("serve-images")
    convert.convert(vo.write_model(root / "hf"), root / "q4", show_progress=False)
    engine = Engine.load(root / "q4")
    uris = []
    for im in vo.images()[:2]:
        buf = io.BytesIO()
        im.save(buf, "PNG")
        uris.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    scheduler = Scheduler(engine, max_batch=4, queue_size=16)
    scheduler.start()
    server = ServerThread(make_app(scheduler, "vlm"))
    yield engine, server.url, uris
    server.stop()
    scheduler.stop()


def _content(uris):
    return ([{"type": "image_url", "image_url": {"url": u}} for u in uris]
            + [{"type": "text", "text": PROMPT}])


def _expected(engine, uris) -> str:
    from fermijit.model import image

    prompt = engine.image_prompt([{"role": "user", "content": [{"type": "image"} for _ in uris]
                                   + [{"type": "text", "text": PROMPT}]}],
                                 [image.from_data_uri(u) for u in uris])
    tokens, _ = engine.generate(prompt, Settings(max_tokens=N_TOKENS, temperature=0.0),
                                lambda t: None)
    return engine.tokenizer.decode(tokens), prompt.size


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_parts_answer_as_generate_does(vlm, n_images):
    engine, url, uris = vlm
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="vlm", max_tokens=N_TOKENS, temperature=0,
                                       messages=[{"role": "user",
                                                  "content": _content(uris[:n_images])}])
    text, n_prompt = _expected(engine, uris[:n_images])
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == n_prompt and r.usage.prompt_tokens_details.cached_tokens == 0


def test_image_prompts_are_never_served_from_the_cache(vlm):
    """An image's placeholder ids do not say which image it was, so image prompts are neither
    snapshotted nor restored: the same request twice prefills all of it twice."""
    _, url, uris = vlm
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    runs = [client.chat.completions.create(model="vlm", max_tokens=N_TOKENS, temperature=0,
                                           messages=[{"role": "user", "content": _content(uris)}])
            for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in runs] == [0, 0]
    assert runs[0].choices[0].message.content == runs[1].choices[0].message.content


def test_a_broken_image_is_400(vlm):
    _, url, uris = vlm
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    cut = uris[0][:len(uris[0]) // 2]
    cut = cut[:len(cut) - len(cut) % 4]  # still base64, a truncated PNG
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="vlm", max_tokens=N_TOKENS, temperature=0,
                                       messages=[{"role": "user", "content": _content([cut])}])
    ok = client.chat.completions.create(model="vlm", max_tokens=1, temperature=0,
                                        messages=[{"role": "user", "content": PROMPT}])
    assert ok.choices[0].finish_reason in ("stop", "length")
