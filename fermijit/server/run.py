"""`python -m fermijit serve`: load the engine, compile the kernels (single and batched decode),
start the scheduler, run uvicorn until interrupted."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError


def warm_up(engine, max_batch: int, drafts=None) -> None:
    """Compile (or load) every kernel a request meets: prefill, decode, sampling and the batched
    step at 1 and 2 sequences (grouped launches differ from 1 row on), on throwaway states; with
    `drafts` (speculative.Drafts), a speculative step's."""
    from fermijit.engine import Settings, kernel_sample, warm_up as engine_warm_up
    from fermijit.model.batch import can_batch, decode_batch

    model = engine.model
    engine_warm_up(model, np.zeros(2, np.int32), sampler=engine.sampler(Settings()))
    if can_batch(model):
        sample = kernel_sample(model)
        for n in sorted({1, min(2, max_batch)}):
            states = [sample.new_state(2) for _ in range(n)]
            decode_batch(sample, np.zeros(n, np.int32), states)
    if drafts is not None:
        from fermijit import speculative

        speculative.warm_up(model, engine.sampler(Settings()), drafts)


def serve(model_dir: Path, host: str, port: int, api_key: str | None, max_batch: int,
          queue_size: int, cache_settings, prefill: str = "cpu", gpu_mem: str | None = None,
          pin_budget: str | None = None, verbose: bool = False, speculative: bool | None = None,
          drafts=None) -> None:
    """`speculative`: draft with the MTP head (None: where the model has one), as `drafts`
    says (speculative.Drafts)."""
    import uvicorn

    from fermijit import hybrid
    from fermijit.engine import Engine
    from fermijit.server.app import make_app
    from fermijit.server.scheduler import Scheduler

    hybrid.parse_bytes(gpu_mem), hybrid.parse_bytes(pin_budget)  # bad: before loading
    sock = listen(host, port)  # a port in use: before loading too
    err = sys.stderr
    start = time.perf_counter()
    engine = Engine.load(model_dir, cache_settings, show_progress=True,
                         warn=lambda line: print(line, file=err, flush=True),
                         speculative=speculative)
    if engine.speculative and drafts is None:
        from fermijit.speculative import Drafts
        drafts = Drafts()
    drafts = drafts if engine.speculative else None
    warm_up(engine, max_batch, drafts)
    engine.prefiller = hybrid.make(engine.model, prefill, gpu_mem, pin_budget, verbose, err)
    if prefill != "cpu":
        engine.prefiller.prepare()
    scheduler = Scheduler(engine, max_batch, queue_size, drafts)
    said = f", MTP drafts {drafts.n}" if drafts is not None else ""
    print(f"loaded {model_dir} and its kernels in {time.perf_counter() - start:.1f} s; serving "
          f"on http://{host}:{sock.getsockname()[1]}/v1 (batch {max_batch}, queue {queue_size}"
          f"{said}{', API key required' if api_key else ''})", file=err, flush=True)
    scheduler.start()
    try:
        config = uvicorn.Config(make_app(scheduler, model_name(model_dir), api_key),
                                log_level="warning", timeout_graceful_shutdown=2)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop
            print("stopped", file=err, flush=True)
    finally:
        scheduler.stop()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: any free port), or a one-line FermijitError; uvicorn's own
    binding logs and exits on failure."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise FermijitError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None
    return sock


def model_name(model_dir: Path) -> str:
    """The id /v1/models lists: the model directory's name."""
    return Path(model_dir).resolve().name


class ServerThread:
    """uvicorn serving `app` on a thread, on 127.0.0.1 and a port the OS picks (bound here, so no
    race for it): for the tests and `bench serve`."""

    def __init__(self, app, start_timeout_s: float = 30):
        import uvicorn

        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=1))
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
