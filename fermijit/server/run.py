"""`python -m fermijit serve`: load the engine, compile the kernels (single and batched decode),
start the scheduler, run uvicorn until interrupted."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError, env_number


def warm_up(engine, max_batch: int, drafts=None) -> None:
    """Compile (or load) every kernel a request meets: prefill (of 2 tokens, and of
    `warm_prefill_tokens`: ops switch kernels past sizes), decode, sampling and the batched
    steps of 2, 3, 4 and max_batch sequences (the products' kernels differ for 2, 3 and more
    tokens, ops/matvec.py FEW_TOKENS; the scheduler decodes one sequence alone with
    Model.decode, never a batch of 1; max_batch at most `switch_rows`, past which a batch meets
    no other kernel: --max-batch 4096's step of 4096 rows took 4.6 s of the embedded model's
    start, against 0.06 s for the whole warm-up at 8), on throwaway states; with `drafts`
    (speculative.Drafts), a speculative step's. (With a 2-token prefill and a batch of 2 only,
    the first prompt of 8+ tokens loaded 8 more kernels on the reap128 shape and the first
    batches of 3 and of 4 two each, while serving: issue 28 item 4, "ready" means ready.)"""
    from fermijit.engine import Settings, warm_up as engine_warm_up
    from fermijit.model.batch import can_batch, decode_batch
    from fermijit.warm import light_sample

    model = engine.model
    whole = os.environ.get(WARM_WHOLE_ENV) == "1"
    # All on a light copy (one layer of each kind, a few rows of the LM head: the same kernels;
    # the whole model's first layers and head were 0.07 s more of a full-size start on 2
    # cores): the 2-token prefill and decode, the sampler's on logits of the whole vocabulary,
    # a prefill past the sizes, the batched steps.
    light = light_sample(model)
    if whole:
        engine_warm_up(model, np.zeros(2, np.int32), sampler=engine.sampler(Settings()))
    else:
        engine_warm_up(light, np.zeros(2, np.int32))
        engine.sampler(Settings()).sample(np.zeros(model.vocab_size, np.float32))
    n = warm_prefill_tokens(model)
    light.prefill(np.zeros(n, np.int32), light.new_state(n + 1))
    if can_batch(model) and max_batch > 1:
        top = min(max_batch, switch_rows(model))
        sizes = sorted({min(b, top) for b in (2, 3, 4, top)})
        # One set of states for all the steps: a fresh state's first step faults its pages in
        # (~7 ms a row on the reap128 shape, 17 rows).
        states = [light.new_state(len(sizes) + 1) for _ in range(sizes[-1])]
        for rows in sizes:
            decode_batch(light, np.zeros(rows, np.int32),
                         [light.new_state(2) for _ in range(rows)] if whole else states[:rows])
    if drafts is not None:
        from fermijit import speculative

        speculative.warm_up(model, engine.sampler(Settings()), drafts)


# FERMIJIT_WARM_WHOLE=1: the warm-up as before issue 28 item 4's last change (the 2-token prefill
# and decode on the whole model's first layers and its whole head, each batched step on fresh
# states): the device's start bench's A/B (tests/fermijit/server/start_bench.py).
WARM_WHOLE_ENV = "FERMIJIT_WARM_WHOLE"


def switch_rows(model) -> int:
    """Rows (a prompt's tokens, a batched step's sequences) past which the ops meet no other
    kernel. Ops switch kernels past sizes: omp.ROWS_MIN rows (the router, the GDN gates, the
    query | gate split), 2^15-2^16 elements of [T, hidden] or wider arrays (ops/embedding.py,
    rmsnorm.py, rope.py, l2norm.py): the rows where [T, hidden] holds 2^16 (32 on the reap128
    shape, 171 on the embedded model; tests/fermijit/server/test_warm_up.py checks longer prompts
    and larger batches load nothing)."""
    from fermijit.jit import omp

    return max(omp.ROWS_MIN, -(-(1 << 16) // model.hidden))


def warm_prefill_tokens(model) -> int:
    """The warm-up prompt's tokens: long enough that a longer prompt's prefill meets no other
    kernel (`switch_rows`), short enough to fit the context."""
    return max(1, min(model.max_context - 1, switch_rows(model)))


# Seconds: Python's switch interval while the start's threads share the GIL (the CPU kernels'
# warm-up here, the GPU's preparation on its thread: both run Python between calls that release
# the GIL, and a thread coming back from one waits for the GIL up to the interval, 5 ms by
# default, while the other runs Python: issue 28 item 4, the CPU kernels' load 1.1 s alone, 2.1 s
# beside the GPU's start on the H200's host). The default again once ready.
# FERMIJIT_START_SWITCH_S sets it (0: Python's default).
START_SWITCH_S = 0.0002
START_SWITCH_ENV = "FERMIJIT_START_SWITCH_S"


@contextlib.contextmanager
def start_switch_interval():
    """sys.setswitchinterval(START_SWITCH_S) inside the block, as it was after it."""
    before = sys.getswitchinterval()
    interval = env_number(START_SWITCH_ENV, START_SWITCH_S) or before
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def serve(model_dir: Path, host: str, port: int, api_key: str | None, max_batch: int,
          queue_size: int, cache_settings, prefill: str = "auto", gpu_mem: str | None = None,
          pin_budget: str | None = None, verbose: bool = False,
          max_image_tokens: int | None = None, kv=None, kv_mem: int | None = None,
          speculative: bool | None = None, drafts=None, origins: tuple[str, ...] = ()) -> None:
    """`speculative`: draft with the MTP head (None: where the model has one and it pays), as
    `drafts` says (speculative.Drafts); `origins`: the web pages that may call it (CORS)."""
    from fermijit.engine import Engine
    from fermijit.jit import cpu, gpu_early
    from fermijit.model import safetensors_io
    from fermijit.model.convert import checks_beside
    from fermijit.prefill import hybrid
    from fermijit.server.app import check_api_key, check_origins, make_app
    from fermijit.server.scheduler import Scheduler
    from fermijit.speculative import engine_drafts

    hybrid.parse_bytes(gpu_mem), hybrid.parse_bytes(pin_budget)  # bad: before loading
    check_api_key(api_key)
    check_origins(origins)
    raise_fd_limit()
    sock = listen(host, port)  # a port in use: before loading too
    err = sys.stderr
    start = time.perf_counter()
    began = start - seconds_since_exec()  # the process's exec, on perf_counter's clock
    made: dict = {}

    def prepare_gpu(model) -> None:
        """The GPU's preparation on its thread from as soon as the model is loaded (its expert
        registration, 0.64 s at full size on the H200's host, holds no GIL), beside the rest of
        the load and the CPU kernels' warm-up (issue 28 item 4); then the scheduler's
        page-locked hand-off room and GDN states (scheduler.ready_to_serve: made after "ready",
        the first request waited for them)."""
        from fermijit.server import kv_budget
        from fermijit.server.scheduler import ready_to_serve

        # Before anything is made for max_batch sequences (the warm-up, the GDN pool)
        kv_budget.check_batch(model, max_batch, kv_budget.budget_of(kv_mem))
        prefiller = made["prefiller"] = hybrid.make(model, prefill, gpu_mem, pin_budget, verbose,
                                                    err)
        made["gpu"] = stack.enter_context(hybrid.preparing(
            prefiller, lambda: ready_to_serve(prefiller, model, max_batch)))

    with contextlib.ExitStack() as stack:
        stack.enter_context(start_switch_interval())  # left last: after the GPU's thread
        stack.enter_context(checks_beside())  # the load's checks beside the warm-up, awaited
        stack.enter_context(safetensors_io.populate_after())  # the weights' pages after it
        engine = Engine.load(model_dir, cache_settings, show_progress=True,
                             warn=lambda line: print(line, file=err, flush=True), kv=kv,
                             speculative=speculative, on_model=prepare_gpu)
        engine.prefiller = made["prefiller"]
        drafts = engine_drafts(engine, drafts)
        gc.freeze()  # what the imports and the load made, off the collector (cli.py main)
        gc.enable()
        times = {"imports": start - began, "load": time.perf_counter() - start}
        # On a thread that ends: the scheduler's is then the only one whose kernels fork
        cpu.on_a_passing_thread(lambda: warm_up(engine, max_batch, drafts))
        times["kernels"] = time.perf_counter() - start - times["load"]
        gpu_thread_s = time.perf_counter() - start  # the warm-up's end: then the GPU's wait
    scheduler = Scheduler(engine, max_batch, queue_size, kv_mem, drafts,
                          gdn_pool=made["gpu"].get("then"))
    said = f", MTP drafts {drafts.n}" if drafts is not None else ""
    parts = ", ".join(f"{k} {v:.2f}" for k, v in times.items())
    gpu = made["gpu"]
    if gpu.get("seconds") is not None:  # the GPU's beside the rest, from when it began
        parts += f", gpu prefill {gpu['seconds']:.2f} from {gpu['started'] - began:.2f}"
        if "then_s" in gpu:  # its hand-off room and the pool's states, ahead or after
            parts += f", gpu room {gpu['then_s']:.2f} from {gpu['then_started'] - began:.2f}"
    early = gpu_early.registration()
    if early is not None:  # the model file registered from exec on (cli.py): when, how much used
        parts += (f", early registration {early['ended'] - early['began']:.2f} from "
                  f"{early['began'] - began:.2f}, early chunks {early['chunks']}, "
                  f"adopted {early['adopted']}")
    parts += f", waited for the gpu {time.perf_counter() - start - gpu_thread_s:.2f}"
    # From the process's exec (its imports included: issue 28 item 4 counts them), not from here
    print(f"ready in {time.perf_counter() - began:.2f} s ({parts}); serving "
          f"on http://{host}:{sock.getsockname()[1]}/v1 (batch {max_batch}, queue {queue_size}"
          f"{said}{', API key required' if api_key else ''})", file=err, flush=True)
    scheduler.start()
    try:
        config = uvicorn_config(make_app(scheduler, model_name(model_dir), api_key,
                                         max_image_tokens, origins),
                                timeout_graceful_shutdown=2)
        try:
            http_server(config, answers_at_stop=True).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop
            print("stopped", file=err, flush=True)
    finally:
        scheduler.stop()


def seconds_since_exec() -> float:
    """Seconds since this process was exec'd (its start time in /proc/self/stat, in clock ticks
    since boot, against CLOCK_BOOTTIME: 10 ms steps); 0 where /proc cannot say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name
        ticks = int(fields[19])  # field 22, starttime; the split began at field 3
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME)
                   - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


# A request's head (its line and headers) must arrive within this of the connection opening, or
# of the previous response on a kept-alive one (issue 30 item 3: uvicorn waits for ever, and
# 19,900 half-open connections were held); the body has app.py BODY_TIMEOUT_S.
HEADER_TIMEOUT_S = 10.0


def uvicorn_config(app, timeout_graceful_shutdown: float):
    import uvicorn

    return uvicorn.Config(app, log_level="warning", http=_head_timeout_protocol(),
                          timeout_graceful_shutdown=timeout_graceful_shutdown)


def _head_timeout_protocol():
    """uvicorn's HTTP/1.1 protocol (h11), which closes a connection whose request head is not
    whole HEADER_TIMEOUT_S after it began waiting for one."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        head_timer = None

        def _wait_for_head(self) -> None:
            self._stop_waiting()
            self.head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_too_late)

        def _stop_waiting(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_too_late(self) -> None:
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._wait_for_head()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a head arrived: the body's turn
                self._stop_waiting()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_head()

        def connection_lost(self, exc) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


LISTEN_BACKLOG = 2048  # uvicorn's default


def raise_fd_limit() -> None:
    """The soft limit of open files raised to the hard one: each client holds a descriptor, and
    a soft limit of 1024 (a common default) under a hard one far above it is a limit on clients
    nobody chose (what servers commonly do)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Out of descriptors (`ulimit -n`), asyncio's accept() logged "socket.accept() out of system
# resource" and the OSError's traceback for every connection waiting in the backlog, and again
# after each one-second retry while the clients stayed: 237,524 tracebacks (1.4 million lines)
# in 20 s of 60 idle clients under `ulimit -n 40`, the event loop busy logging them (a request
# then took 20 s). The connections still wait in the backlog until descriptors are free, as
# asyncio means; said in one line at most every ACCEPT_WARN_S.
ACCEPT_WARN_S = 60.0


def loop_errors():
    """An event loop's exception handler: out of descriptors to accept connections with, one
    line on stderr at most every ACCEPT_WARN_S instead of a traceback per connection; asyncio's
    retry of accept() that was pending when the stop closed the socket (scheduled a second after
    running out), nothing: it found the socket's descriptor -1 and logged a traceback at the
    stop (seen once in the out-of-descriptors test, tests/fermijit/test_hostile_env.py); anything
    else, the loop's default (a logged traceback)."""
    import errno
    import resource

    said_at = [-ACCEPT_WARN_S]

    def handle(loop, context) -> None:
        e = context.get("exception")
        if _accept_retry_after_stop(context):
            return
        if not (isinstance(e, OSError) and "socket" in context
                and e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)):
            loop.default_exception_handler(context)
        elif time.monotonic() - said_at[0] >= ACCEPT_WARN_S:
            said_at[0] = time.monotonic()
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            print(f"warning: cannot accept connections: {e.strerror} (ulimit -n {limit}); new "
                  f"clients wait until others close", file=sys.stderr, flush=True)

    return handle


def _accept_retry_after_stop(context) -> bool:
    """Whether `context` is a ValueError of asyncio's `_start_serving` (its accept retry) on a
    closed socket. The handle's callback and arguments are asyncio's own attributes: nothing
    public names the callback a handle runs."""
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    return (isinstance(context.get("exception"), ValueError)
            and getattr(callback, "__name__", None) == "_start_serving"
            and any(isinstance(a, socket.socket) and a.fileno() == -1
                    for a in getattr(handle, "_args", None) or ()))


def http_server(config, answers_at_stop: bool = False):
    """A uvicorn.Server for `config` whose event loop reports errors as `loop_errors` says (one
    line when out of descriptors to accept connections with). With
    `answers_at_stop` (serve's), on SIGTERM or Ctrl-C it stops taking connections, then has the
    app answer every request in flight a 503 (app.py make_app's `stop`: its scheduler stopped
    for good), then lets uvicorn wait for the responses: they end at once, where uvicorn alone
    cut them after its grace (timeout_graceful_shutdown) and logged an ERROR."""
    import asyncio

    import uvicorn

    handle = loop_errors()

    class Server(uvicorn.Server):
        async def serve(self, sockets=None) -> None:
            asyncio.get_running_loop().set_exception_handler(handle)
            await super().serve(sockets)

        async def shutdown(self, sockets=None) -> None:
            if answers_at_stop:
                for server in self.servers:
                    server.close()
                for sock in sockets or []:
                    sock.close()
                await self.config.app.state.stop()
            await super().shutdown(sockets)

    return Server(config)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: any free port) and listening, or a one-line FermijitError;
    uvicorn's own binding logs and exits on failure. Listening here, not when uvicorn starts: a
    client that connects as soon as "serving on" is printed waits in the backlog instead of being
    refused (seen: a warm server's first request refused on the GPU machine)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        raise FermijitError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def model_name(model_dir: Path) -> str:
    """The id /v1/models lists: the model directory's name, as text (a name of bytes that are
    not UTF-8, which Python holds as lone surrogates, failed every JSON answer naming the
    model: a 500 and a traceback; such bytes read as U+FFFD)."""
    name = Path(model_dir).resolve().name
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class ServerThread:
    """uvicorn serving `app` on a thread, on 127.0.0.1 and a port the OS picks (bound here, so no
    race for it): for the tests and `bench serve`."""

    def __init__(self, app, start_timeout_s: float = 30):
        import uvicorn

        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = http_server(uvicorn_config(app, timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="fermijit-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise FermijitError("the HTTP server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()
