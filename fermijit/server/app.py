"""The Starlette app: POST /v1/chat/completions and /v1/completions (JSON or server-sent events),
GET /v1/models and /health. Requests are checked here (protocol.py), made ready on worker
threads (prompts.py: tokenised, images decoded, the context checked) and handed to the
scheduler; its events come back through an asyncio queue. A streaming client that disconnects cancels its
sequence (Starlette cancels the response's task, whose `finally` sets the job's flag); a
non-streaming one is polled while it waits."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from pathlib import Path

import anyio

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fermijit import FermijitError
from fermijit.server import prompts, protocol
from fermijit.server.protocol import ApiError, Failed, Finished, Started, Text
from fermijit.server.scheduler import QueueFull, Scheduler

# The body cap follows the context (issue 30 item 2): a prompt the context can hold is at most
# max_context tokens, at a few bytes each in JSON (English ~4; a \uXXXX escape 6 per character);
# past the cap (4.3 MiB for the real model's 262144 positions, 288 KiB for the embedded model's
# 2048) a 413, before anything is tokenised. A model with a vision tower takes images too.
BODY_BASE_BYTES = 256 << 10
BODY_BYTES_PER_TOKEN = 16
DISCONNECT_POLL_S = 0.5
CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection (logs only)
# Requests made ready (tokenised, images decoded: server/prompts.py) at once, each on a thread
# of its own. Few: the scheduler's decode wants the cores, and a request waits here cheaply.
PREPARE_THREADS = 2


def max_body_bytes(max_context: int, has_images: bool) -> int:
    from fermijit.model.image import MAX_DATA_URI_CHARS

    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_context + (
        MAX_DATA_URI_CHARS if has_images else 0)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_json(request: Request, limit: int):
    """The body as JSON, read with the CLI's rules (model/files.py parse_json: depth, integer
    digits, no NaN or duplicate keys), at most `limit` bytes."""
    from fermijit.model.files import parse_json

    too_large = ApiError(413, f"the request body is over {limit} bytes", code="too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    try:
        return parse_json(bytes(body), "the request body")
    except FermijitError as e:
        raise ApiError(400, str(e), code="invalid_json") from None


def make_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
             max_image_tokens: int | None = None) -> Starlette:
    created = int(time.time())
    engine = scheduler.engine
    body_limit = max_body_bytes(engine.model.max_context, engine.has_vision)
    preparing = anyio.CapacityLimiter(PREPARE_THREADS)

    def client_error(e: FermijitError) -> ApiError:
        """A model-side failure as a 400 that names the model, not where it lives."""
        message = str(e)
        if engine.directory is not None:
            for path in {str(engine.directory), str(Path(engine.directory).resolve())}:
                message = message.replace(path, model_name)
        return ApiError(400, message)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def next_event(events: asyncio.Queue, request: Request, job: protocol.Job):
        """The next event, or None (the job cancelled) if the client disconnects meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    return None

    async def complete(request: Request, is_chat: bool):
        try:
            check_key(request)
            job = protocol.parse(await _read_json(request, body_limit), is_chat)
            # Off the event loop and off the scheduler's thread (server/prompts.py).
            await anyio.to_thread.run_sync(prompts.prepare, engine, job, max_image_tokens,
                                           limiter=preparing)
        except ApiError as e:
            return _error(e)
        except FermijitError as e:
            return _error(client_error(e))
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: the server is stopping
                job.cancelled.set()

        job.emit = emit
        try:
            scheduler.submit(job)
        except QueueFull:
            return _error(ApiError(503, "the server is busy: its queue is full; retry later",
                                   code="queue_full", kind="server_error"))
        first = await next_event(events, request, job)
        if first is None:
            return Response(status_code=CLIENT_GONE)
        if isinstance(first, Failed):
            return _error(first.error)
        assert isinstance(first, Started)
        rid = protocol.new_id(is_chat)
        if job.stream:
            return StreamingResponse(_sse(job, events, rid, is_chat, model_name),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        parts = []
        try:
            while True:
                event = await next_event(events, request, job)
                if isinstance(event, Text):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    return JSONResponse(protocol.response(is_chat, rid, model_name,
                                                          "".join(parts), event))
                elif event is None:
                    return Response(status_code=CLIENT_GONE)
                else:
                    return _error(event.error)
        finally:
            job.cancelled.set()  # a no-op when finished; stops the sequence otherwise

    async def chat_completions(request: Request):
        return await complete(request, True)

    async def completions(request: Request):
        return await complete(request, False)

    async def models(request: Request):
        try:
            check_key(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "fermijit"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "active": len(scheduler.active),
                             "waiting": scheduler.waiting.qsize()})

    async def not_found(request: Request, exc: HTTPException):
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                f"{exc.detail}", code="not_found"))

    return Starlette(exception_handlers={404: not_found, 405: not_found}, routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ])


async def _sse(job: protocol.Job, events: asyncio.Queue, rid: str, is_chat: bool, model: str):
    """The chunks of one streamed completion, as server-sent events, then [DONE]."""
    created = int(time.time())

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if is_chat:  # the role first, as OpenAI does
            yield sse(protocol.chunk(is_chat, rid, model, created, "", is_first=True))
        while True:
            event = await events.get()
            if isinstance(event, Text):
                yield sse(protocol.chunk(is_chat, rid, model, created, event.text))
            elif isinstance(event, Finished):
                yield sse(protocol.chunk(is_chat, rid, model, created, None if is_chat else "",
                                         event.reason))
                if job.include_usage:
                    yield sse(protocol.chunk(is_chat, rid, model, created, None,
                                             usage_=protocol.usage(event), has_choice=False))
                break
            else:  # failed mid-stream: the status is sent already; OpenAI's error as an event
                yield sse(event.error.body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a no-op when finished; the client went away otherwise
