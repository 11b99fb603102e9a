"""Hostile images (issue 30 items 1 and 9) on the tiny VLM: an image's tokens are known from its
header and checked against the context and `--max-image-tokens` before it is decoded; a FIFO, a
directory or a link to /dev/zero is said as what it is; each is one line and exit 2, and a
normal run afterwards answers what it answered before."""

from __future__ import annotations

import os
import time

import pytest

from tests.cli import run_cli
from tests.fermijit.test_hardening import assert_one_line
from tests.model import vision_oracle as vo

PROMPT = "the cat"
FLAGS = ("--threads", "1", "--temperature", "0", "--max-tokens", "4")
# What the real model's processor allows (model/image.py DEFAULT_MAX_PIXELS): a large image is
# resized to 16.7 M pixels, 262,144 tokens at the tiny tower's 8x8 pixels per token.
REAL_MAX_PIXELS = 16777216
# Claims 11500x11500 (132 M pixels, under MAX_SOURCE_PIXELS) in 16 KB: bilevel, all black.
BOMB_SIDE = 11500


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-images")
    q4 = vo.converted_model(root, REAL_MAX_PIXELS)
    picture = root / "cat.png"
    vo.images()[0].save(picture)
    from PIL import Image

    Image.new("1", (BOMB_SIDE, BOMB_SIDE)).save(root / "huge.png")
    return {"model": q4, "picture": picture, "root": root}


@pytest.fixture
def no_decoding(monkeypatch):
    """Fails the test if any image is decoded."""
    from fermijit.model import image

    def decode(self):
        raise AssertionError(f"{self.label} was decoded")

    monkeypatch.setattr(image.Encoded, "decode", decode)


def _generate(monkeypatch, capsys, vlm, image, *flags):
    return run_cli(monkeypatch, capsys, "generate", "--model", vlm["model"], PROMPT,
                   "--image", image, *FLAGS, *flags)


def test_a_normal_image_runs(monkeypatch, capsys, vlm):
    code, out, err = _generate(monkeypatch, capsys, vlm, vlm["picture"])
    assert code == 0 and out, err
    vlm["answer"] = out


def test_an_image_claiming_11500x11500_is_refused_before_decoding(monkeypatch, capsys, vlm,
                                                                   no_decoding):
    """Item 1: it was decoded, resized to 16.7 M pixels and made into patches (minutes, GBs)
    before its tokens were compared with the context."""
    assert (vlm["root"] / "huge.png").stat().st_size < 64 << 10
    start = time.perf_counter()
    code, _, err = _generate(monkeypatch, capsys, vlm, vlm["root"] / "huge.png")
    assert_one_line(code, err, f"({BOMB_SIDE}x{BOMB_SIDE}) makes 262144 image tokens, more than "
                               f"the 2048 allowed (--max-image-tokens)")
    assert time.perf_counter() - start < 30


def test_images_past_the_context_are_refused_before_decoding(monkeypatch, capsys, vlm,
                                                             no_decoding):
    """Within --max-image-tokens, past the context (the tiny model's 4224 positions)."""
    code, _, err = _generate(monkeypatch, capsys, vlm, vlm["root"] / "huge.png",
                             "--max-image-tokens", "10000000")
    assert_one_line(code, err, "more than the context")


def test_images_past_max_image_tokens(monkeypatch, capsys, vlm, no_decoding):
    code, _, err = _generate(monkeypatch, capsys, vlm, vlm["picture"], "--max-image-tokens", "3")
    assert_one_line(code, err, "image tokens, more than the 3 allowed")


@pytest.mark.parametrize("kind", ["fifo", "directory", "link to /dev/zero", "dangling link"])
def test_an_image_that_is_no_file_says_what_it_is(monkeypatch, capsys, vlm, tmp_path, kind):
    path = tmp_path / "x.png"
    message = {"fifo": "not a regular file (a FIFO)", "directory": "(a directory)",
               "link to /dev/zero": "(a character device)", "dangling link": "no such file"}
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero" if kind == "link to /dev/zero" else tmp_path / "nothing")
    code, out, err = _generate(monkeypatch, capsys, vlm, path)
    assert_one_line(code, err, message[kind])
    assert f"image {path}" in err


def test_a_normal_image_answers_the_same_afterwards(monkeypatch, capsys, vlm):
    if "answer" not in vlm:
        pytest.skip("runs after test_a_normal_image_runs")
    code, out, err = _generate(monkeypatch, capsys, vlm, vlm["picture"])
    assert code == 0 and out == vlm["answer"], err


def test_the_cli_default_is_the_library_default():
    from fermijit import cli
    from fermijit.model import image

    assert cli.DEFAULT_MAX_IMAGE_TOKENS == image.DEFAULT_MAX_IMAGE_TOKENS

