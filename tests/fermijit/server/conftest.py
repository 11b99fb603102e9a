"""One server for the module's tests: the embedded model behind uvicorn in a thread, on
127.0.0.1 and a port the OS picks, and a second app on the same scheduler that wants an API key."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

API_KEY = "sk-test-key"
MAX_BATCH = 8


@pytest.fixture(scope="session")
def engine():
    from fermijit.engine import DEFAULT_MODEL, Engine
    from fermijit.jit import cpu
    from fermijit.server.run import warm_up

    e = Engine.load(DEFAULT_MODEL)
    cpu.on_a_passing_thread(lambda: warm_up(e, MAX_BATCH))  # as serve does
    return e


@pytest.fixture(scope="module")
def server(engine):
    """(base url, api-key url, scheduler)."""
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=MAX_BATCH, queue_size=256)
    scheduler.start()
    open_server = ServerThread(make_app(scheduler, "default_model"))
    keyed = ServerThread(make_app(scheduler, "default_model", api_key=API_KEY))
    yield open_server.url, keyed.url, scheduler
    open_server.stop()
    keyed.stop()
    scheduler.stop()
