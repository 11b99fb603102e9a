"""Defects the soak of the real server found (tests/fermijit/server/soak.py: many clients for
minutes, overlapping, leaving at every moment), each reproduced small. The scheduler is driven
on the test's thread where the order of its steps matters."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.server.protocol import Failed, Finished, Job, Text

N_TOKENS = 4


def job(prompt, seed: int = 7) -> tuple[Job, list]:
    events: list = []
    return Job(is_chat=False, prompt=prompt, max_tokens=N_TOKENS, temperature=0.8, top_p=None,
               top_k=None, seed=seed, stop=(), stream=False, include_usage=False,
               ids=np.asarray(prompt, np.int32), emit=events.append), events


def answer(events: list) -> str:
    assert not any(isinstance(e, Failed) for e in events), events
    assert isinstance(events[-1], Finished), events
    return "".join(e.text for e in events if isinstance(e, Text))


def run(scheduler) -> None:
    while scheduler.prefilling or scheduler.active or scheduler.waiting.qsize():
        scheduler._admit()
        if scheduler.prefilling:
            scheduler._prefill_chunk()
        if scheduler.active:
            scheduler._step()


def test_identical_requests_prefilled_together_both_answer(engine):
    """The same seeded request twice at once (a client's retry, a benchmark's fixed seed): the
    second resumed from the snapshot the first took mid-prompt and both ended in one chunk,
    second first. Removing it from the prompts prefilling compared Sequences by value (the
    dataclass's ==), through their equal Jobs down to their token arrays: a ValueError, a 500
    for every prompt of that chunk. A sequence is itself: compared by identity."""
    from fermijit.cache.prefix_cache import PrefixCache
    from fermijit.engine import Engine
    from fermijit.prefill.hybrid import CPU_CHUNK_TOKENS
    from fermijit.server.scheduler import Scheduler

    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 8000, CPU_CHUNK_TOKENS + 40)]
    alone_engine = Engine(engine.model, engine.tokenizer, None)
    alone = Scheduler(alone_engine, max_batch=4)
    first, events = job(prompt)
    alone.submit(first)
    run(alone)
    want = answer(events)

    own = Engine(engine.model, engine.tokenizer, PrefixCache("test", mem_bytes=1 << 30,
                                                              snapshot_every=CPU_CHUNK_TOKENS))
    scheduler = Scheduler(own, max_batch=4)
    (a, a_events), (b, b_events) = job(prompt), job(prompt)
    scheduler.submit(a)
    scheduler._admit()
    scheduler._prefill_chunk()  # its first CPU_CHUNK_TOKENS, snapshotted at their end
    scheduler.submit(b)
    scheduler._admit()          # resumed from that snapshot: its rest is a's
    assert scheduler.prefilling[1].n_cached == CPU_CHUNK_TOKENS
    run(scheduler)
    assert answer(a_events) == answer(b_events) == want


def test_sigterm_answers_the_requests_in_flight_and_exits():
    """SIGTERM (docker stop, systemd) with a stream, a non-streamed request and a body half
    sent in flight: each client gets an answer saying the server stopped (the stream OpenAI's
    error event and [DONE], the others a 503), the process exits at once and logs no ERROR. It
    cut them after uvicorn's 2 s grace (the stream mid-chunk, the request with no response at
    all, the half body a plain-text 500 and a traceback in the log) and logged "ERROR: Cancel 3
    running task(s)"."""
    import concurrent.futures
    import json
    import signal
    import socket
    import time

    import httpx

    from tests.fermijit.server.test_cli_serve import _free_port, _serve, wait_until_up

    port = _free_port()
    proc = _serve("--port", port, "--max-batch", 2, "--threads", 2)
    url = f"http://127.0.0.1:{port}/v1/completions"
    long = {"prompt": "a story", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    try:
        wait_until_up(proc, port)

        def streamed() -> list[str]:
            lines = []
            with httpx.stream("POST", url, json={**long, "stream": True}, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3:  # decoding: now stop the server
                        proc.send_signal(signal.SIGTERM)
            return lines

        half = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = json.dumps(long).encode()
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body[:len(body) // 2]))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(httpx.post, url, json=long, timeout=30)
            lines = streamed()
            answered = waiting.result()
        with half:
            head = half.recv(4096)  # the status line and headers; the JSON after
        assert head.startswith(b"HTTP/1.1 503"), head
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_stopping"
        assert answered.status_code == 503
        assert answered.json()["error"]["code"] == "server_stopping"
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "ERROR" not in err and "Traceback" not in err, err


def test_a_stream_reset_with_tokens_waiting_is_written_once(engine, caplog):
    """A client that resets its stream (a browser tab closed, a killed process) while tokens
    wait to be sent (the event loop busy: the scheduler makes tokens faster than it writes
    them): the server wrote each waiting token's event to the dead socket, and asyncio logged
    "socket.send() raised exception." past its fifth (4 such lines in an 8.7 min soak). The
    events waiting are sent in one write: one to a dead socket at most."""
    import json
    import logging
    import socket
    import struct
    import time

    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread
    from fermijit.server.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=2, queue_size=2)
    scheduler.start()
    server = ServerThread(make_app(scheduler, "m"))
    loop = server.server.servers[0].get_loop()
    try:
        body = json.dumps({"prompt": "a story", "max_tokens": 400, "ignore_eos": True,
                           "stream": True, "temperature": 0}).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            loop.call_soon_threadsafe(time.sleep, 0.5)  # busy: tokens wait to be written
            time.sleep(0.2)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset
            time.sleep(1.0)
        deadline = time.monotonic() + 30
        while scheduler.active:  # the sequence stopped: its client is gone
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        server.stop()
        scheduler.stop()
    assert not [r for r in caplog.records if "socket.send() raised" in r.getMessage()]


def test_a_chat_rendering_beside_leaves_the_schedulers_allocations_alone():
    """A request's chat template renders on its handler's thread (server/prompts.py). Its
    memory bound had been RLIMIT_AS set to the address space in use plus 1 GiB for the render:
    the process's limit, so the scheduler's thread, admitting a sequence meanwhile, could
    reserve at most 1 GiB more (a full-size KV cache past ~90k positions, model/state.py
    reserved, failed: a 500 for a request unrelated to the chat). Off the main thread the
    sandbox's own bounds hold instead (model/tokenizer.py)."""
    import resource
    import threading

    from fermijit.engine import DEFAULT_MODEL
    from fermijit.model.state import reserved
    from fermijit.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(DEFAULT_MODEL)
    # A render of ~0.1 s (each output piece is checked against the limits)
    tokenizer.chat_template = ("{% for i in range(300) %}{% for j in range(1000) %}{{ j }}"
                               "{% endfor %}{% endfor %}{{ messages[0].content }}")
    rendering = threading.Thread(target=tokenizer.render_chat,
                                 args=([{"role": "user", "content": "hi"}],))
    rendering.start()
    limit = resource.getrlimit(resource.RLIMIT_AS)
    failures = n_tries = 0
    while rendering.is_alive():
        n_tries += 1
        assert resource.getrlimit(resource.RLIMIT_AS) == limit
        try:
            reserved((3 << 29,), np.uint8)  # 1.5 GiB of address space, as a long KV cache's
        except (MemoryError, OSError):
            failures += 1
    rendering.join()
    assert n_tries and failures == 0, (n_tries, failures)


def test_a_kv_memory_refusal_names_sizes_that_differ(engine):
    """A soak at --kv-mem 2M was refused with "need 2 MiB ... more than the server's --kv-mem
    of 2 MiB" (2.5 and 2.0 rounded to whole MiB)."""
    import re

    from fermijit.server import kv_budget
    from fermijit.server.protocol import ApiError

    model = engine.model
    need = model.state_nbytes(1520, mtp=True)  # the soak ran speculative decoding
    budget = 2 << 20
    assert budget < need < budget + (1 << 20)
    with pytest.raises(ApiError) as e:
        kv_budget.admit(model, 1520, [], budget, mtp=True)
    sizes = re.findall(r"([\d.]+) MiB", e.value.message)
    assert len(sizes) == 2 and float(sizes[0]) > float(sizes[1]), e.value.message
