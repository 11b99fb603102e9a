"""`generate --image` (fermijit/engine.py, model/multimodal.py) on the tiny VLM, fp32 and 4-bit:
the continuation is what the engine's loop makes from the image prompt, and a bad image file is
one line on stderr with exit code 2."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.engine import Engine, Settings
from fermijit.model import convert
from tests.cli import run_cli
from tests.fermijit.test_generate import assert_one_line_error
from tests.model import tiny
from tests.model import vision_oracle as vo

PROMPT = "the cat"
FLAGS = ("--threads", "1", "--temperature", "0", "--max-tokens", "5")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    hf = vo.write_model(root / "hf")
    q4 = root / "q4"
    convert.convert(hf, q4, show_progress=False)
    pictures = []
    for k, im in enumerate(vo.images()[:2]):
        pictures.append(root / f"image{k}.png")
        im.save(pictures[-1])
    text_only = tiny.write_checkpoint(root / "text", weights={
        k: v for k, v in tiny.random_weights().items() if not k.startswith("model.visual.")})
    return {"hf": hf, "q4": q4, "images": pictures, "text": text_only, "root": root}


def expected(directory, images) -> list[int]:
    engine = Engine.load(directory)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    prompt = engine.image_prompt([{"role": "user", "content": content}], list(images))
    assert prompt.rows.size > 0
    tokens, _ = engine.generate(prompt, Settings(max_tokens=5, temperature=0.0), lambda t: None)
    return engine.tokenizer.decode(tokens)


@pytest.mark.parametrize("kind", ["hf", "q4"])
@pytest.mark.parametrize("n_images", [1, 2])
def test_generate_with_images(monkeypatch, capsys, setup, kind, n_images):
    images = setup["images"][:n_images]
    args = [a for p in images for a in ("--image", p)]
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", setup[kind], PROMPT,
                             *args, *FLAGS)
    assert code == 0, err
    assert f"{n_images} image(s)" in err and "vision tower (CPU)" in err
    assert out == expected(setup[kind], images)


def test_images_change_the_answer(setup):
    """The images reach the model: another image, other logits."""
    engine = Engine.load(setup["hf"])
    logits = []
    for image in setup["images"]:
        prompt = engine.image_prompt([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": PROMPT}]}], [image])
        state = engine.model.new_state(prompt.size)
        from fermijit.model import multimodal
        logits.append(multimodal.prefill(engine.model, prompt, state))
    assert np.abs(logits[0] - logits[1]).max() > 1e-2 * np.abs(logits[0]).max()


def _bad_files(root):
    from PIL import Image

    (root / "notes.png").write_text("not an image at all")
    good = (root / "image0.png").read_bytes()
    (root / "cut.png").write_bytes(good[:len(good) // 2])
    Image.new("1", (12000, 12000)).save(root / "bomb.png")  # 144 Mpx in a few kB
    Image.new("RGB", (1000, 4)).save(root / "thin.png")


BAD = {"missing": ("nowhere.png", "no such file"),
       "not an image": ("notes.png", "not an image file"),
       "truncated": ("cut.png", "cannot decode it"),
       "bomb": ("bomb.png", "decompression bomb"),
       "aspect": ("thin.png", "aspect ratio 250 is beyond 200")}


@pytest.mark.parametrize("case", BAD)
def test_bad_image_is_one_line(monkeypatch, capsys, setup, case):
    if not (setup["root"] / "bomb.png").exists():
        _bad_files(setup["root"])
    name, message = BAD[case]
    assert_one_line_error(*run_cli(monkeypatch, capsys, "generate", "--model", setup["hf"],
                                   PROMPT, "--image", setup["root"] / name, *FLAGS), message)


def test_a_bomb_warns_nothing(setup):
    """Pillow's own DecompressionBombWarning would be lines on stderr before the error."""
    import warnings

    from fermijit import FermijitError
    from fermijit.model import image

    if not (setup["root"] / "bomb.png").exists():
        _bad_files(setup["root"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FermijitError, match="decompression bomb"):
            image.open_image(setup["root"] / "bomb.png")


def test_text_model_with_an_image_is_one_line(monkeypatch, capsys, setup):
    assert_one_line_error(*run_cli(monkeypatch, capsys, "generate", "--model", setup["text"],
                                   PROMPT, "--image", setup["images"][0], *FLAGS),
                          "has no vision tower")


def test_data_uri_images(setup):
    """What the server gets (OpenAI image_url parts): the same image as from the file; bad URIs
    are one FermijitError line."""
    import base64

    from fermijit import FermijitError
    from fermijit.model import image

    path = setup["images"][0]
    uri = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    a, b = image.from_data_uri(uri).decode(), image.open_image(path).decode()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for bad, message in (("http://example.com/x.png", "expected a data:"),
                         ("data:image/png;base64,@@@", "not valid base64"),
                         ("data:image/png;base64," + base64.b64encode(b"GIF89a").decode(),
                          "cannot decode|not an image")):
        with pytest.raises(FermijitError, match=message):
            image.from_data_uri(bad).decode()


def test_images_with_prefill_auto(monkeypatch, capsys, setup):
    """--prefill gpu|auto puts the tower on the GPU where one is usable (tests/gpu_vision.sh);
    the prompt itself is prefilled on the CPU, so no GPU prefill is set up for it."""
    from fermijit.model import vision_gpu

    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", setup["hf"], PROMPT,
                             "--image", setup["images"][0], "--prefill", "auto", *FLAGS)
    assert code == 0, err
    assert "gpu prefill" not in err
    assert f"vision tower ({'GPU' if vision_gpu.usable() else 'CPU'})" in err
    assert out == expected(setup["hf"], setup["images"][:1])
