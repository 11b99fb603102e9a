"""One server for the module's tests: the embedded model behind uvicorn in a thread, on
127.0.0.1 and a port the OS picks, and a second app on the same scheduler that wants an API key."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

API_KEY = "sk-test-key"
MAX_BATCH = 8


class Running:
    """A uvicorn server running `app` in a thread, on a socket bound here (no race for a port)."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="session")
def engine():
    from fermijit.engine import DEFAULT_MODEL, Engine
    from fermijit.server.run import warm_up

    e = Engine.load(DEFAULT_MODEL)
    warm_up(e, MAX_BATCH)
    return e


@pytest.fixture(scope="module")
def server(engine):
    """(base url, api-key url, scheduler)."""
    from fermijit.server.app import make_app
    from fermijit.server.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=MAX_BATCH, queue_size=256)
    scheduler.start()
    open_server = Running(make_app(scheduler, "default_model"))
    keyed = Running(make_app(scheduler, "default_model", api_key=API_KEY))
    yield open_server.url, keyed.url, scheduler
    open_server.stop()
    keyed.stop()
    scheduler.stop()
