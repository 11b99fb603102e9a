"""`python -m fermijit serve` as a user runs it: a subprocess that loads the embedded model,
answers on its port, and exits cleanly on Ctrl-C; a port in use is one line and exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

START_S = 180  # loading and warming the kernels from Numba's cache: ~5 s here, more when cold


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "fermijit", "serve", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def wait_until_up(proc, port) -> None:
    """Until `serve` (proc, on port) answers /health, for at most START_S."""
    deadline = time.monotonic() + START_S
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.2)


def test_serve_answers_and_stops_on_ctrl_c():
    port = _free_port()
    proc = _serve("--port", port, "--max-batch", 2, "--no-cache",
                  env={"FERMIJIT_API_KEY": "k"})
    try:
        wait_until_up(proc, port)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"prompt": "import os", "max_tokens": 3, "temperature": 0}
        assert httpx.post(url, json=body).status_code == 401  # the key came from the env
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "serving on" in err and out == ""


def test_the_socket_listens_before_uvicorn_runs():
    """A client connecting right after the "serving on" line queues, it is not refused."""
    from fermijit.server.run import listen

    sock = listen("127.0.0.1", 0)
    try:
        socket.create_connection(sock.getsockname(), timeout=5).close()
    finally:
        sock.close()


def test_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = _serve("--port", s.getsockname()[1])
        _, err = proc.communicate(timeout=START_S)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1].startswith("Error: cannot serve on 127.0.0.1:")


def test_a_bad_allow_origin_is_one_line_and_exit_2():
    proc = _serve("--allow-origin", "localhost:3000/chat")
    _, err = proc.communicate(timeout=START_S)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1].startswith("Error: --allow-origin must be * or")
