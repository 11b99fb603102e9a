"""Images against transformers (tests/model/vision_oracle.py, MODEL.md §7): the preprocessing,
the vision tower, the MRoPE positions and the logits after images, stored and live; then the
prompt building, the 4-bit path and what a bad image file gives.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import image as mi
from fermijit.model import multimodal as mm
from fermijit.model.config import load_config
from fermijit.model.forward import load_model
from fermijit.model.state import KvKind
from tests.model import oracle
from tests.model import vision_oracle as vo
from tests.model.oracle import assert_rel
from tests.numerics import assert_close

# The bounds (max|diff| / max|expected|): 1e-4 for the tower and for the text logits in
# fp32. Measured against the golden: tower 6.1e-7, prompt logits 3.9e-7 to 6.7e-7, decode up to
# 8.2e-7 (on the chaotic UNIT text model the prompt logits came to 2.2e-5).
EMBED_REL = 1e-4
LOGITS_REL = 1e-4
# The same resize and arithmetic in numpy as in transformers: equal but for fp32 rounding of
# (x - mean) / std (measured 0.0).
PIXEL_ATOL = 1e-6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(directory, config, text model, tower) of the tiny VLM in fp32."""
    directory = vo.write_model(tmp_path_factory.mktemp("vlm") / vo.MODEL.name)
    cfg, model = load_model(directory, kv=KvKind.F32)  # the oracle's fp32 cache
    return directory, cfg, model, mm.load_tower(directory, cfg)


@pytest.fixture(scope="module", params=["golden", "live"])
def expected(request, vlm):
    if request.param == "golden":
        return vo.golden()
    if not oracle.has_transformers():
        pytest.skip("torch and transformers >= 5.24 are not importable: goldens stand in")
    return vo.live(vlm[0])


@pytest.fixture(scope="module")
def processed(vlm):
    settings = mi.image_settings(vlm[0], vlm[1].vision_config)
    return [mi.preprocess(mi.to_rgb(im), settings) for im in vo.images()]


def test_preprocessing_equals_the_processor(expected, processed):
    for k, (im, pixels, grid) in enumerate(zip(processed, expected.pixel_values,
                                               expected.grids)):
        assert im.grid == tuple(int(n) for n in grid), f"image {k}: grid"
        assert_close(f"image {k} pixel values", pixels, im.patches, PIXEL_ATOL, 0)


def test_tower_matches(expected, vlm, processed):
    tower = vlm[3]
    for k, im in enumerate(processed):
        assert_rel(f"image {k} embeddings", expected.embeds[k], tower.encode([im]), EMBED_REL)
    both = tower.encode(processed[:2])  # two images: each attends within itself
    assert_rel("two images", np.concatenate(expected.embeds[:2]), both, EMBED_REL)


@pytest.mark.parametrize("name", vo.PROMPTS)
def test_prompt_positions_and_logits(expected, vlm, processed, name):
    _, cfg, model, tower = vlm
    want = expected.prompts[name]
    ids, order = vo.prompt_ids(name, [im.n_tokens for im in processed], cfg)
    np.testing.assert_array_equal(ids, want["ids"])
    images = [processed[k] for k in order]
    prompt = mm.build(ids, images, tower.encode(images), cfg)
    np.testing.assert_array_equal(prompt.positions, want["positions"], "MRoPE positions")
    assert prompt.rope_delta == want["rope_delta"]
    state = model.new_state(ids.size + vo.N_DECODE)
    logits = mm.prefill(model, prompt, state, all_logits=True)
    assert_rel("prompt logits", want["logits"], logits[want["rows"]], LOGITS_REL)
    decode = []
    for token in want["tokens"]:  # teacher-forced: positions continue at position + delta
        decode.append(model.decode(int(token), state).copy())
    assert_rel("decode logits", want["decode_logits"], np.stack(decode), LOGITS_REL)


def test_the_positions_matter(vlm, processed):
    """Plain 1-D positions (or none of the image embeddings) move the logits far past the
    tolerance: the test above can tell."""
    _, cfg, model, tower = vlm
    ids, order = vo.prompt_ids("two", [im.n_tokens for im in processed], cfg)
    images = [processed[k] for k in order]
    prompt = mm.build(ids, images, tower.encode(images), cfg)
    right = mm.prefill(model, prompt, model.new_state(ids.size))
    flat = dataclasses.replace(prompt, positions=np.tile(np.arange(ids.size), (3, 1)),
                               rope_delta=0)
    blank = dataclasses.replace(prompt, embeds=np.zeros_like(prompt.embeds))
    for wrong in (flat, blank):
        logits = mm.prefill(model, wrong, model.new_state(ids.size))
        assert oracle.rel_error(right, logits) > 100 * LOGITS_REL


def test_text_only_prompt_equals_prefill(vlm, monkeypatch):
    """Without images the multimodal prefill is the text one, over several blocks."""
    from fermijit.model import forward

    monkeypatch.setattr(forward, "PREFILL_BLOCK", 16)
    _, cfg, model, _ = vlm
    ids = np.random.default_rng(3).integers(0, 300, 40)
    prompt = mm.build(ids, [], None, cfg)
    assert prompt.rope_delta == 0
    np.testing.assert_array_equal(prompt.positions, np.tile(np.arange(40), (3, 1)))
    a = mm.prefill(model, prompt, model.new_state(40), all_logits=True)
    b = model.prefill(ids, model.new_state(40), all_logits=True)
    assert_close("logits", b, a, 0, 0)


def test_images_across_prefill_blocks(vlm, processed, monkeypatch):
    """Blocks of 7 tokens cut the images' runs: the same logits as one block, and a prompt
    continued on a state that has seen one (positions offset by its position and delta)."""
    from fermijit.model import forward

    _, cfg, model, tower = vlm
    ids, order = vo.prompt_ids("two", [im.n_tokens for im in processed], cfg)
    images = [processed[k] for k in order]
    prompt = mm.build(ids, images, tower.encode(images), cfg)
    whole = mm.prefill(model, prompt, model.new_state(2 * ids.size), all_logits=True)
    monkeypatch.setattr(forward, "PREFILL_BLOCK", 7)
    state = model.new_state(2 * ids.size)
    cut = mm.prefill(model, prompt, state, all_logits=True)
    assert_close("blocks of 7", whole, cut, 1e-4, 1e-4)
    # the same prompt again after it: its positions start at position + delta
    again = mm.prefill(model, prompt, state)
    assert state.rope_delta == 2 * prompt.rope_delta
    assert np.isfinite(again).all()


def test_render_places_images_before_the_text(vlm, processed):
    directory, cfg, _, _ = vlm
    from fermijit.model.tokenizer import Tokenizer

    tok = Tokenizer(directory)
    images = processed[:2]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image_url"},
                                             {"type": "text", "text": "the cat"}]}]
    ids = mm.render(tok, messages, images, cfg)
    start = list(ids).index(cfg.vision_start_token_id)
    run = mm.image_ids(cfg, images[0]) + mm.image_ids(cfg, images[1])
    assert list(ids[start:start + len(run)]) == run
    assert list(ids[:start]) == list(tok.encode(tok.render_chat(
        [{"role": "user", "content": ""}]).split("<|im_end|>")[0], add_special_tokens=False))
    assert tok.decode(ids[start + len(run):]).startswith("the cat")
    with pytest.raises(FermijitError, match="2 image parts for 1 images"):
        mm.render(tok, messages, images[:1], cfg)
    with pytest.raises(FermijitError, match="type 'audio'"):
        mm.render(tok, [{"role": "user", "content": [{"type": "audio"}]}], [], cfg)


def test_4bit_model_with_images(vlm, processed, tmp_path):
    """convert keeps the tower (f16): the converted model's tower and logits stay near fp32's."""
    from fermijit.model import convert

    directory, cfg, model, tower = vlm
    dst = tmp_path / "q4"
    convert.convert(directory, dst, show_progress=False)
    cfg4, model4 = load_model(dst)
    tower4 = mm.load_tower(dst, cfg4)
    assert tower4 is not None
    assert all(a.dtype in (np.float16, np.float32) for a in tower4.weights.values())
    im = processed[0]
    # f16 weights: measured 1.2e-3 of the largest embedding
    assert_rel("f16 tower", tower.encode([im]), tower4.encode([im]), 5e-3)
    ids, order = vo.prompt_ids("one", [p.n_tokens for p in processed], cfg)
    prompt = mm.build(ids, [im], tower4.encode([im]), cfg4)
    logits = mm.prefill(model4, prompt, model4.new_state(ids.size))
    assert np.isfinite(logits).all() and logits.shape == (model4.vocab_size,)


def test_text_model_has_no_tower(tmp_path):
    from tests.model import tiny

    cfg = load_config(tiny.write_checkpoint(tmp_path / "t"))
    weights = tiny.random_weights()
    directory = tiny.write_checkpoint(tmp_path / "text", weights={
        k: v for k, v in weights.items() if not k.startswith("model.visual.")})
    assert mm.load_tower(directory, cfg) is None
    from fermijit.engine import Engine

    with pytest.raises(FermijitError, match="has no vision tower"):
        Engine.load(directory).image_prompt([{"role": "user", "content": [{"type": "image"}]}],
                                            [mi.Image((1, 4, 4), 2, np.zeros((16, 96),
                                                                               np.float32))])
