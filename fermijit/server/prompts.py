"""A request's prompt made ready on the request handler's threads, before the scheduler sees it:
the chat template rendered, the text tokenised, images decoded and run
through the vision tower, and a prompt the context cannot hold refused. The scheduler's one
thread then only prefills and decodes: four 4 MB prompts tokenised there stopped every running
stream for 22.9 s, an image bomb for 5 minutes.

`prepare` runs in a worker thread; what it costs the scheduler is the GIL, which the
tokenizer (model/tokenizer.py `encode`), Pillow and numpy let go of while they work.
"""

from __future__ import annotations

import numpy as np

from fermijit import engine as engine_module
from fermijit.server import protocol
from fermijit.server.protocol import ApiError, Job


def prepare(engine, job: Job, max_image_tokens: int | None = None) -> None:
    """Fill `job.ids` (and `job.image_prompt` for a chat with images: more than
    `max_image_tokens`, default model/image.py's, is a 400 before any is decoded); ApiError(400)
    when the prompt is bad, empty or past the context, FermijitError (a 400 too) from the
    model's side."""
    if job.images:
        job.image_prompt = _image_prompt(engine, job, max_image_tokens)
        job.ids = job.image_prompt.ids
    else:
        job.ids = _tokens(engine, job)
    check_context(int(job.ids.size), job, engine.model.max_context)


def check_context(n_prompt: int, job: Job, max_context: int) -> None:
    if n_prompt == 0:
        raise ApiError(400, "the prompt is empty (no tokens)", "prompt")
    if not engine_module.fits(n_prompt, job.max_tokens, max_context):
        raise protocol.context_overflow(n_prompt, job.max_tokens, max_context, job.is_chat)


def _tokens(engine, job: Job) -> np.ndarray:
    tokenizer = engine.tokenizer
    if job.is_chat:
        return tokenizer.encode(tokenizer.render_chat(job.prompt, variables=job.template_kwargs),
                                add_special_tokens=False)
    if isinstance(job.prompt, str):
        return tokenizer.encode(job.prompt)
    vocab = engine.model.vocab_size
    if not all(0 <= t < vocab for t in job.prompt):  # Python ints: no overflow at 2**63
        raise ApiError(400, f"token ids must be in [0, {vocab})", "prompt")
    return np.asarray(job.prompt, np.int32)


def _image_prompt(engine, job: Job, max_image_tokens: int | None):
    """The chat with its images (model/multimodal.py Prompt); a bad image, or images past the
    budget or the context (known from their headers, before decoding), is a 400."""
    from fermijit.model import image

    max_context = engine.model.max_context
    engine.vision_tower()  # a model without one says so before any image is read
    images = [image.from_data_uri(uri, f"image {k}") for k, uri in enumerate(job.images)]
    return engine.image_prompt(job.prompt, images, None, max_image_tokens,
                               check=lambda n_prompt: check_context(n_prompt, job, max_context),
                               variables=job.template_kwargs)
