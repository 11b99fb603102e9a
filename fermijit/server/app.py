"""The Starlette app: POST /v1/chat/completions and /v1/completions (JSON or server-sent events),
GET /v1/models, /v1/models/{id} and /health. Requests are checked here (protocol.py), made ready
on worker threads (prompts.py: tokenised, images decoded, the context checked) and handed to the
scheduler; its events come back through an asyncio queue. A streaming client that disconnects
cancels its sequence (Starlette cancels the response's task, whose `finally` sets the job's
flag); a non-streaming one is polled while it waits. Every error is OpenAI's error JSON, naming
the model and never the server's paths."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
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
# A body must arrive within this (issue 30 item 3: 450 slow clients were held for ever); the
# head of a request has its own deadline (server/run.py HEADER_TIMEOUT_S). 64 MiB of images in
# it is ~1.1 MB/s.
BODY_TIMEOUT_S = 60.0
# What JSON leaves raw but Python's str.splitlines (httpx's iter_lines, the usual SSE client
# by hand) splits lines at: escaped in events, or a token's text cuts its event's JSON in two.
LINE_SEPARATORS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def max_body_bytes(max_context: int, has_images: bool) -> int:
    from fermijit.model.image import MAX_DATA_URI_CHARS

    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_context + (
        MAX_DATA_URI_CHARS if has_images else 0)


async def _read_json(request: Request, limit: int, reading: set):
    """The body as JSON, read with the CLI's rules (model/files.py parse_json: depth, integer
    digits, no NaN or duplicate keys), at most `limit` bytes. Its deadline's cancel scope is
    in `reading` meanwhile: cancelled, the server is stopping."""
    from fermijit.model.files import parse_json

    too_large = ApiError(413, f"the request body is over {limit} bytes", code="too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    try:
        with anyio.fail_after(BODY_TIMEOUT_S) as scope:
            reading.add(scope)
            try:
                async for piece in request.stream():
                    body += piece
                    if len(body) > limit:
                        raise too_large
            finally:
                reading.discard(scope)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                       code="timeout") from None
    if scope.cancelled_caught:  # cancelled before its deadline: by `stop`
        raise protocol.server_stopping()
    try:
        return parse_json(bytes(body), "the request body")
    except FermijitError as e:
        raise ApiError(400, str(e), code="invalid_json") from None


def check_api_key(api_key: str | None) -> None:
    if api_key == "":  # every request was a 401 while the banner said no key was needed
        raise FermijitError("--api-key is empty: give a key, or leave it out to accept any")
    # What no client could send in its Authorization header: every request a 401 (httpx sends
    # ASCII only, curl UTF-8 bytes, read as latin-1 here; a header loses its outer spaces).
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()
                                    and api_key == api_key.strip()):
        raise FermijitError("--api-key must be printable ASCII, without spaces around it")


def check_origins(origins) -> None:
    """--allow-origin: "*" or an origin (scheme://host[:port], what a browser sends)."""
    for origin in origins:
        scheme, _, rest = origin.partition("://")
        if origin != "*" and not (scheme in ("http", "https") and rest and "/" not in rest
                                  and rest.isprintable() and " " not in rest):
            raise FermijitError(f"--allow-origin must be * or scheme://host[:port], got "
                                f"{origin!r}")


def make_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
             max_image_tokens: int | None = None, origins: tuple[str, ...] = ()) -> Starlette:
    """`origins`: the web pages' origins allowed to call the API from a browser (CORS; "*" any);
    none by default, as a browser then refuses every page but the API's own."""
    check_api_key(api_key)
    check_origins(origins)
    created = int(time.time())
    engine = scheduler.engine
    body_limit = max_body_bytes(engine.model.max_context, engine.has_vision)
    preparing = anyio.CapacityLimiter(PREPARE_THREADS)
    reading: set[anyio.CancelScope] = set()  # the bodies being read (`_read_json`)
    # Where the model and its snapshots live is the server's business: errors name the model.
    hidden = {}
    if engine.directory is not None:
        hidden = {str(Path(engine.directory).resolve()): model_name,
                  str(engine.directory): model_name}
    if engine.cache is not None and engine.cache.disk is not None:
        hidden[str(engine.cache.disk.dir)] = "the snapshot cache"

    def named(e: ApiError) -> ApiError:
        message = e.message
        for path, name in hidden.items():
            message = message.replace(path, name)
        return e if message == e.message else ApiError(e.status, message, e.param, e.code,
                                                       e.kind)

    def error(e: ApiError, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(named(e).body(), status_code=e.status, headers=headers)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def next_event(events: asyncio.Queue, request: Request, job: protocol.Job):
        """The next event, or None (the job cancelled) if the client disconnects meanwhile. The
        client is looked at every DISCONNECT_POLL_S, also while events keep coming: a
        non-streamed answer's tokens do, so its client was never seen to go and its sequence
        decoded on to max_tokens (2000 tokens, 38 s, after the client had closed)."""
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if event is None or time.monotonic() >= request.state.poll_at:
                request.state.poll_at = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    job.cancelled.set()
                    return None
            if event is not None:
                return event

    async def complete(request: Request, is_chat: bool):
        try:
            check_key(request)
            job = protocol.parse(await _read_json(request, body_limit, reading), is_chat)
            # Off the event loop and off the scheduler's thread (server/prompts.py).
            await anyio.to_thread.run_sync(prompts.prepare, engine, job, max_image_tokens,
                                           limiter=preparing)
        except ApiError as e:
            return error(e)
        except FermijitError as e:  # the model's side: a bad image, a chat template's limits
            return error(ApiError(400, str(e)))
        except ClientDisconnect:  # gone while sending its body: nothing to answer, no traceback
            return Response(status_code=CLIENT_GONE)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event) -> None:
            if isinstance(event, Failed):
                event = Failed(named(event.error))
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: the server is stopping
                job.cancelled.set()

        job.emit = emit
        request.state.poll_at = time.monotonic() + DISCONNECT_POLL_S
        try:
            scheduler.submit(job)
        except QueueFull:
            return error(ApiError(503, "the server is busy: its queue is full; retry later",
                                  code="queue_full", kind="server_error"))
        except ApiError as e:  # the server is stopping
            return error(e)
        first = await next_event(events, request, job)
        if first is None:
            return Response(status_code=CLIENT_GONE)
        if isinstance(first, Failed):
            return error(first.error)
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
                    return error(event.error)
        finally:
            job.cancelled.set()  # a no-op when finished; stops the sequence otherwise

    async def chat_completions(request: Request):
        return await complete(request, True)

    async def completions(request: Request):
        return await complete(request, False)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "fermijit"}

    async def models(request: Request):
        try:
            check_key(request)
        except ApiError as e:
            return error(e)
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request):
        """GET /v1/models/{id}: the OpenAI client's models.retrieve."""
        try:
            check_key(request)
            if request.path_params["model_id"] != model_name:
                raise ApiError(404, f"the model {request.path_params['model_id']!r} does not "
                                    f"exist (this server has {model_name!r})", "model",
                               "model_not_found")
        except ApiError as e:
            return error(e)
        return JSONResponse(card)

    async def health(request: Request):
        prefiller = scheduler.engine.prefiller
        return JSONResponse({"status": "ok", "active": len(scheduler.active),
                             "waiting": scheduler.n_waiting(),
                             "prefilled_tokens": dict(getattr(prefiller, "n_prefilled", {}))})

    async def not_found(request: Request, exc: HTTPException):
        code = "method_not_allowed" if exc.status_code == 405 else "not_found"
        return error(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                               f"{exc.detail}", code=code),
                     exc.headers)  # a 405's Allow

    async def internal(request: Request, exc: Exception):
        """A bug: the traceback goes to the log (uvicorn), the client gets OpenAI's error JSON."""
        return error(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"))

    async def stop() -> None:
        """The server is stopping (run.py http_server): every request in flight is answered
        a 503 now, those whose bodies are arriving and those the scheduler holds (its
        Scheduler.stop, off the event loop: after its current step), rather than cut by
        uvicorn once its grace is over (a stream mid-chunk, a request with no response at
        all, a body half read a 500 and a traceback in the log)."""
        for scope in list(reading):
            scope.cancel()
        await anyio.to_thread.run_sync(scheduler.stop)

    handlers = {404: not_found, 405: not_found, Exception: internal}
    # A browser's preflight (OPTIONS) is answered before routing and the key's check: it carries
    # no Authorization header. Any request header: the OpenAI SDK in a browser sends its own
    # (x-stainless-*), which a list would have refused.
    cors = [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"])] if origins else []
    app = Starlette(exception_handlers=handlers, middleware=cors, routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ])
    app.state.stop = stop
    return app


async def _sse(job: protocol.Job, events: asyncio.Queue, rid: str, is_chat: bool, model: str):
    """The chunks of one streamed completion, as server-sent events, then [DONE]."""
    created = int(time.time())

    def sse(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False).translate(LINE_SEPARATORS)}\n\n"

    def of(event) -> tuple[str, bool]:
        """The event's server-sent events, and whether they end the stream."""
        if isinstance(event, Text):
            return sse(protocol.chunk(is_chat, rid, model, created, event.text)), False
        if isinstance(event, Finished):
            out = sse(protocol.chunk(is_chat, rid, model, created, None if is_chat else "",
                                     event.reason))
            if job.include_usage:
                out += sse(protocol.chunk(is_chat, rid, model, created, None,
                                          usage_=protocol.usage(event), has_choice=False))
            return out + "data: [DONE]\n\n", True
        # failed mid-stream: the status is sent already; OpenAI's error as an event
        return sse(event.error.body()) + "data: [DONE]\n\n", True

    try:
        if is_chat:  # the role first, as OpenAI does
            yield sse(protocol.chunk(is_chat, rid, model, created, "", is_first=True))
        is_over = False
        while not is_over:
            # The events waiting in one write: where the loop fell behind the scheduler, each
            # was a write, and a client reset meanwhile had them all written to its dead socket
            # (asyncio logged "socket.send() raised exception." past the fifth).
            out, is_over = of(await events.get())
            while not is_over and not events.empty():
                more, is_over = of(events.get_nowait())
                out += more
            yield out
    finally:
        job.cancelled.set()  # a no-op when finished; the client went away otherwise
