"""A soak of `python -m fermijit serve` as real clients use it: the real server process, driven for
minutes by threads of clients doing, mixed at random (seeded), chat and completions streamed and
not, stop strings, max_tokens 1..200, seeded sampling, identical requests at once, prompts at the
context's edge and past --kv-mem, queue-full bursts, and clients that leave at every moment (after
the head, half-way through the body, mid-prefill, mid-stream) or trickle their head (slowloris).

    python -m tests.fermijit.server.soak --model fermijit/default_model --minutes 3 \
        [--max-batch 4 --queue-size 8 --kv-mem 8M --speculative mtp --seed 1 -- SERVE-FLAGS]

Checks, each a failure (exit 1) when broken: no client call hangs (each has a deadline); greedy
and seeded answers equal the same request's answer alone, under load and after it (seeded ones
only without drafts: speculative sampling draws otherwise); stop strings never reach the text; a
stream ends with [DONE]; the server's stderr has nothing but its start and stop lines; its RSS
at the end is near its RSS after the first quarter (no leak); /health shows nothing active or
waiting once the clients are done, and a request of the whole context runs then (the budget
whole again); SIGTERM (or --signal SIGINT) with requests in flight ends the process within
STOP_S, each of them answered whole (server_stopping). A tool, not part of the test run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

CALL_S = 120.0     # a client call past this is a hang
START_S = 600.0    # the server's start (cold Numba caches compile for minutes on 2 cores)
STOP_S = 15.0      # SIGTERM to exit, streams in flight
SETTLE_S = 30.0    # the clients done, to /health showing nothing active or waiting
LEAK_BYTES = 48 << 20  # RSS growth from the first quarter's end to the last's: a leak
WORDS = ("the cat sat on the mat and then it ran to the door because a dog barked loud near "
         "old house where people live with many books about code and numbers café naïve 日本語 "
         "の 🐈 — «quoted»").split()
STOPS = (" the", "\n", "e", ".", " and", "ing", "é", "の")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Server:
    def __init__(self, args, extra: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(args.log or f"/tmp/soak-{self.port}.err")
        cmd = [sys.executable, "-m", "fermijit", "serve", "--model", args.model, "--port",
               str(self.port), "--threads", str(args.threads), "--max-batch",
               str(args.max_batch), "--queue-size", str(args.queue_size),
               "--speculative", args.speculative, *extra]
        if args.kv_mem:
            cmd += ["--kv-mem", args.kv_mem]
        print("server:", " ".join(cmd), file=sys.stderr, flush=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited {self.proc.returncode}:\n{self.stderr()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("serve did not come up")
            time.sleep(0.5)

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


# --- the clients ---------------------------------------------------------------------------------

class Results:
    def __init__(self):
        self.lock = threading.Lock()
        self.count = collections.Counter()    # action -> requests
        self.outcome = collections.Counter()  # (action, outcome) -> n
        self.latency = collections.defaultdict(list)
        self.failures: list[str] = []

    def add(self, action: str, outcome: str, seconds: float | None = None,
            failure: str | None = None):
        with self.lock:
            self.count[action] += 1
            self.outcome[(action, outcome)] += 1
            if seconds is not None:
                self.latency[action].append(seconds)
            if failure is not None:
                self.failures.append(f"{action}: {failure}")


def body_of(case: dict) -> tuple[str, dict]:
    """(path, JSON body) of a request case."""
    body = {k: v for k, v in case.items() if k not in ("chat", "text")}
    if case["chat"]:
        body["messages"] = (case["text"] if isinstance(case["text"], list)
                            else [{"role": "user", "content": case["text"]}])
        return "/v1/chat/completions", body
    body["prompt"] = case["text"]
    return "/v1/completions", body


def call(url: str, case: dict) -> tuple[int, str, dict]:
    """(status, text, the final JSON: usage and finish_reason, or the error); raises on a
    hang (httpx.TimeoutException) or a broken stream (AssertionError)."""
    path, body = body_of(case)
    timeout = httpx.Timeout(CALL_S, connect=30)
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=timeout)
        j = r.json()
        if r.status_code != 200:
            return r.status_code, "", j
        c = j["choices"][0]
        text = c["message"]["content"] if case["chat"] else c["text"]
        return 200, text, {"finish_reason": c["finish_reason"], "usage": j["usage"]}
    parts, final, done = [], {}, False
    deadline = time.monotonic() + CALL_S
    with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", r.json()
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout("the stream went on past CALL_S")
            if not line:
                continue
            assert line.startswith("data: "), f"not an SSE line: {line[:80]!r}"
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            assert not done, "an event after [DONE]"
            j = json.loads(data)
            if "error" in j:
                final = j
                continue
            if j.get("usage"):
                final["usage"] = j["usage"]
            for c in j["choices"]:
                piece = c["delta"].get("content") if case["chat"] else c["text"]
                parts.append(piece or "")
                if c["finish_reason"]:
                    final["finish_reason"] = c["finish_reason"]
    assert done, "the stream ended without [DONE]"
    return 200, "".join(parts), final


def raw_request(url: str, case: dict) -> tuple[bytes, bytes]:
    """The request's head and body as bytes on the wire."""
    path, body = body_of(case)
    data = json.dumps(body).encode()
    port = int(url.rsplit(":", 1)[1])
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    return head, data


def connect(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=CALL_S)
    return sock


class Soak:
    def __init__(self, server: Server, args, rng_seed: int):
        self.server, self.args = server, args
        self.url = server.url
        self.results = Results()
        self.seed = rng_seed
        self.references: list[tuple[dict, str]] = []   # (case, its answer alone)
        self.max_context = 2048
        self.edge_start = [random.Random(rng_seed).randrange(1, 8000) for _ in range(2048)]
        # Speculative decoding samples by the rejection rule (fermijit/speculative.py): a
        # seeded request's tokens are distributed as without drafts, not the same draws, so
        # only greedy answers are compared where it drafts.
        self.is_speculative = "MTP drafts" in server.stderr()

    def text(self, rng: random.Random, n_words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n_words))

    def case(self, rng: random.Random) -> dict:
        c = {"chat": rng.random() < 0.5, "text": self.text(rng, rng.randint(1, 60)),
             "max_tokens": rng.randint(1, 200), "stream": rng.random() < 0.5}
        if rng.random() < 0.5:
            c["temperature"] = 0
            if rng.random() < 0.5:
                c["seed"] = 0  # what clients send by default (benchmarks, SDK wrappers)
        else:
            c["temperature"], c["seed"] = round(rng.uniform(0.3, 1.2), 2), rng.randint(0, 99)
        if rng.random() < 0.2:
            c["top_p"] = rng.choice([0.5, 0.9, 1])
        if rng.random() < 0.2:
            c["top_k"] = rng.choice([0, 1, 5, 40])
        if rng.random() < 0.3:
            c["stop"] = rng.sample(STOPS, rng.randint(1, 3))
        if c["stream"] and rng.random() < 0.5:
            c["stream_options"] = {"include_usage": True}
        return c

    def make_references(self, n: int) -> None:
        """Answers alone: `n` short requests, `n` long ones sharing a system prompt (snapshots at
        its block boundaries, resumed by the others), and `n` chats' second turns (resumed from
        the snapshot of their first)."""
        rng = random.Random(self.seed)
        system = self.text(rng, 700)
        cases = []
        for i in range(3 * n):
            c = self.case(rng)
            c["max_tokens"] = rng.randint(1, 60)
            if i % 3 == 1:
                c.update(chat=True, text=[{"role": "system", "content": system},
                                          {"role": "user", "content": self.text(rng, 20)}])
            elif i % 3 == 2:
                first = dict(c, chat=True, stream=False,
                             text=[{"role": "user", "content": self.text(rng, 40)}])
                status, answer, final = call(self.url, first)
                assert status == 200 or final["error"]["code"] == "kv_memory_exceeded", final
                c.update(chat=True, text=first["text"] + [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": self.text(rng, 10)}])
            cases.append(c)
        for c in cases:
            status, text, final = call(self.url, c)
            if final.get("error", {}).get("code") == "kv_memory_exceeded":
                continue  # a small --kv-mem never holds it
            assert status == 200, (status, final)
            self.references.append((c, text))

    # Each action: one client's one thing to do; records its outcome.

    def check(self, action: str, case: dict, started: float, want: str | None = None) -> None:
        r = self.results
        try:
            status, text, final = call(self.url, case)
        except httpx.TimeoutException as e:
            return r.add(action, "HANG", None, f"{type(e).__name__} on {case}")
        except (httpx.TransportError, AssertionError, json.JSONDecodeError, KeyError) as e:
            return r.add(action, "broken", None, f"{type(e).__name__}: {e} on {case}")
        seconds = time.monotonic() - started
        if status != 200:
            code = final.get("error", {}).get("code")
            bad = status >= 500 and code not in ("queue_full", "kv_memory_full")
            return r.add(action, f"{status} {code}", seconds,
                         f"{status} {final} on {case}" if bad else None)
        if "error" in final:
            return r.add(action, "error mid-stream", seconds, f"{final} on {case}")
        reason = final.get("finish_reason")
        usage = final.get("usage")
        problem = None
        if reason not in ("stop", "length"):
            problem = f"finish_reason {reason!r}"
        elif any(s in text for s in case.get("stop", ())):
            problem = f"a stop string in the text {text!r}"
        elif usage is not None and usage["completion_tokens"] > case["max_tokens"]:
            problem = f"{usage['completion_tokens']} tokens past max_tokens"
        elif case.get("stream") and case.get("stream_options") and usage is None:
            problem = "no usage chunk"
        elif want is not None and text != want:
            problem = f"MISMATCH: {text!r} != alone {want!r}"
        r.add(action, "mismatch" if problem and problem.startswith("MISMATCH") else
              "bad" if problem else "ok", seconds, problem and f"{problem} on {case}")

    def normal(self, rng):
        self.check("normal", self.case(rng), time.monotonic())

    def reference(self, rng):
        case, want = rng.choice(self.references)
        if self.is_speculative and case["temperature"]:
            want = None  # sampled with drafts: distributed as without, not the same draws
        case = dict(case, stream=rng.random() < 0.5)
        self.check("reference", case, time.monotonic(), want)

    def identical(self, rng):
        """Several clients send the same request at the same moment (prefix cache races)."""
        case, want = rng.choice(self.references)
        if self.is_speculative and case["temperature"]:
            want = None  # alone, drafts; together, batched steps
        k = rng.randint(2, 5)
        barrier = threading.Barrier(k)

        def one(stream):
            barrier.wait(10)
            self.check("identical", dict(case, stream=stream), time.monotonic(), want)

        threads = [threading.Thread(target=one, args=(rng.random() < 0.5,)) for _ in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def leave_stream(self, rng):
        """Reads a few events of a stream, then closes its connection."""
        case = dict(self.case(rng), stream=True, max_tokens=rng.randint(20, 200))
        head, data = raw_request(self.url, case)
        started = time.monotonic()
        try:
            with connect(self.url) as sock:
                sock.sendall(head + data)
                got, want = b"", rng.randint(0, 2000)
                while len(got) < want:
                    piece = sock.recv(256)
                    if not piece or not got and piece[:12] != b"HTTP/1.1 200":
                        break  # a 503 (the queue, --kv-mem): not a stream to leave
                    got += piece
            self.results.add("leave_stream", "ok" if got or not want else "refused",
                             time.monotonic() - started)
        except socket.timeout:
            self.results.add("leave_stream", "HANG", None, f"no bytes in {CALL_S} s: {case}")

    def leave_waiting(self, rng):
        """Sends a request (non-streamed, or streamed with a long prompt) and closes after a
        random moment: mid-queue, mid-prefill, mid-decode."""
        case = dict(self.case(rng), text=self.text(rng, rng.randint(100, 400)),
                    max_tokens=rng.randint(50, 200))
        head, data = raw_request(self.url, case)
        with connect(self.url) as sock:
            sock.sendall(head + data)
            time.sleep(rng.uniform(0, 1.5))
        self.results.add("leave_waiting", "ok")

    def leave_early(self, rng):
        """Closes after the head, or half-way through the body, at once or after a stall."""
        head, data = raw_request(self.url, self.case(rng))
        kind = rng.choice(["head", "half"])
        with connect(self.url) as sock:
            sock.sendall(head if kind == "head" else head + data[:len(data) // 2])
            time.sleep(rng.uniform(0, 3))
        self.results.add(f"leave_after_{kind}", "ok")

    def slow_head(self, rng):
        """Trickles its head a byte a second: the server must close it (run.py HEADER_TIMEOUT_S,
        10 s)."""
        head, _ = raw_request(self.url, self.case(rng))
        started = time.monotonic()
        with connect(self.url) as sock:
            for b in head[:-2]:
                try:
                    sock.sendall(bytes([b]))
                except OSError:
                    break
                readable, _, _ = select.select([sock], [], [], 1)
                try:
                    if readable and sock.recv(1) == b"":  # closed by the server
                        break
                except OSError:  # reset by the server: closed too
                    break
                if time.monotonic() - started > 40:
                    return self.results.add("slow_head", "HANG", None,
                                            "a head trickled for 40 s was not closed")
        self.results.add("slow_head", "closed", time.monotonic() - started)

    def edge(self, rng):
        """A prompt of token ids at the context's edge: exactly filling it, or one past (400)."""
        n_prompt = rng.randint(self.max_context - 300, self.max_context - 1)
        max_tokens = self.max_context - n_prompt + (rng.random() < 0.3)
        # Mostly a shared start: prompts at the edge resumed from each other's snapshots
        n_own = n_prompt if rng.random() < 0.3 else rng.randint(1, 64)
        ids = self.edge_start[:n_prompt - n_own] + [rng.randrange(1, 8000) for _ in range(n_own)]
        case = {"chat": False, "text": ids, "max_tokens": max_tokens, "temperature": 0,
                "stream": rng.random() < 0.5}
        started = time.monotonic()
        try:
            status, _, final = call(self.url, case)
        except httpx.TimeoutException:
            return self.results.add("edge", "HANG", None, f"{n_prompt} + {max_tokens}")
        over = n_prompt + case["max_tokens"] > self.max_context
        code = final.get("error", {}).get("code") if status != 200 else None
        ok = (status == 400 and code == "context_length_exceeded") if over else (
            status == 200 or code in ("queue_full", "kv_memory_full", "kv_memory_exceeded"))
        self.results.add("edge", f"{status} {code or ''}".strip(), time.monotonic() - started,
                         None if ok else f"{n_prompt} + {case['max_tokens']}: {status} {final}")

    def burst(self, rng):
        """More requests at once than the batch and the queue hold: 503s, the rest answered."""
        n = self.args.max_batch + self.args.queue_size + rng.randint(1, 8)
        threads = [threading.Thread(target=self.check, args=(
            "burst", dict(self.case(rng), max_tokens=rng.randint(1, 30)), time.monotonic()))
            for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    BAD = [b"{", b"[]", b'{"prompt": 5}', b'{"prompt": "a", "n": 2}',
           b'{"prompt": "a", "logprobs": 3}', b'{"prompt": "a", "max_tokens": 0}',
           b'{"prompt": "a", "temperature": "hot"}', b'{"prompt": "\\ud800"}',
           b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": '
           b'{"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}',
           b'{"messages": []}', b'{"prompt": [99999999]}', b'{"prompt": "a", "stop": ["", "b"]}']

    def bad(self, rng):
        """A malformed or unsupported request: a 4xx, never a 500."""
        data = rng.choice(self.BAD)
        path = "/v1/chat/completions" if b"messages" in data else "/v1/completions"
        started = time.monotonic()
        try:
            r = httpx.post(self.url + path, content=data, timeout=CALL_S,
                           headers={"Content-Type": "application/json"})
        except httpx.TimeoutException:
            return self.results.add("bad", "HANG", None, f"{data!r}")
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        self.results.add("bad", str(r.status_code), time.monotonic() - started,
                         None if ok else f"{data!r}: {r.status_code} {r.text[:200]}")

    def slow_reader(self, rng):
        """Asks for a long stream and reads it slowly, a little at a time."""
        case = dict(self.case(rng), stream=True, max_tokens=rng.randint(100, 200))
        head, data = raw_request(self.url, case)
        started = time.monotonic()
        with connect(self.url) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(head + data)
            tail = b""
            while time.monotonic() - started < CALL_S:
                time.sleep(rng.uniform(0, 0.5))
                piece = sock.recv(512)
                if not tail and piece[:12] != b"HTTP/1.1 200":  # a 503: the queue is full
                    return self.results.add("slow_reader", piece[9:12].decode())
                tail = tail[-16:] + piece
                if not piece or b"[DONE]" in tail:
                    return self.results.add("slow_reader", "ok" if piece else "closed early",
                                            time.monotonic() - started,
                                            None if piece else f"closed before [DONE]: {case}")
        self.results.add("slow_reader", "HANG", None, f"no [DONE] in {CALL_S} s: {case}")

    def session(self, rng):
        """A client on one kept-alive connection (the OpenAI SDK's pool): requests, a 400, a
        413, a stream it leaves after a few events, then a greedy reference on the same
        connection, which must still answer as alone."""
        started = time.monotonic()
        try:
            with httpx.Client(base_url=self.url, timeout=CALL_S) as client:
                for _ in range(rng.randint(2, 6)):
                    kind = rng.choice(["ok", "bad", "large", "leave"])
                    path, body = body_of(dict(self.case(rng), max_tokens=rng.randint(1, 20)))
                    if kind == "bad":
                        body["max_tokens"] = 0
                    if kind == "large":
                        body = {"prompt": "a" * 400_000}
                    if kind == "leave":
                        with client.stream("POST", path, json=dict(body, stream=True)) as r:
                            for i, _ in enumerate(r.iter_lines()):
                                if i == 3:
                                    break
                        continue
                    r = client.post(path, json=body)
                    want = {"ok": (200, 503), "bad": (400,), "large": (413,)}[kind]
                    if r.status_code not in want:
                        return self.results.add("session", f"{r.status_code}", None,
                                                f"{kind}: {r.status_code} {r.text[:200]}")
                case, want = rng.choice(self.references)
                if self.is_speculative and case["temperature"]:
                    want = None
                path, body = body_of(dict(case, stream=False))
                r = client.post(path, json=body)
        except httpx.TimeoutException as e:
            return self.results.add("session", "HANG", None, f"{type(e).__name__}")
        if r.status_code != 200:
            return self.results.add("session", f"{r.status_code}", time.monotonic() - started,
                                    None if r.status_code == 503 else r.text[:200])
        c = r.json()["choices"][0]
        text = c["message"]["content"] if case["chat"] else c["text"]
        self.results.add("session", "ok" if want in (None, text) else "mismatch",
                         time.monotonic() - started,
                         None if want in (None, text) else f"MISMATCH {text!r} != {want!r}")

    def health(self, rng):
        started = time.monotonic()
        try:
            r = httpx.get(self.url + rng.choice(["/health", "/v1/models"]), timeout=CALL_S)
            self.results.add("health", str(r.status_code), time.monotonic() - started,
                             None if r.status_code == 200 else r.text)
        except httpx.TimeoutException:
            self.results.add("health", "HANG", None, "GET timed out")

    ACTIONS = {"normal": 30, "reference": 20, "identical": 5, "leave_stream": 10,
               "leave_waiting": 8, "leave_early": 6, "slow_head": 1, "edge": 4, "burst": 1,
               "health": 4, "bad": 4, "slow_reader": 2,
               "session": 4}

    def client(self, index: int, until: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        names, weights = zip(*self.ACTIONS.items())
        while time.monotonic() < until:
            name = rng.choices(names, weights)[0]
            try:
                getattr(self, name)(rng)
            except Exception as e:  # noqa: BLE001 - the driver's own bugs reported, not hidden
                self.results.add(name, "driver error", None, f"{type(e).__name__}: {e}")

    def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        threads = [threading.Thread(target=self.client, args=(i, until), daemon=True)
                   for i in range(self.args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 3 * CALL_S)
            if t.is_alive():
                self.results.add("client", "HANG", None, "a client thread never returned")


# --- after the soak ------------------------------------------------------------------------------

def settle(server: Server) -> dict:
    deadline = time.monotonic() + SETTLE_S
    while True:
        h = server.health()
        if h["active"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def stop_with_streams(server: Server, sig=signal.SIGTERM) -> list[str]:
    """Streams and non-streamed requests in flight, then `sig`: the process ends within STOP_S,
    each stream with OpenAI's error event and [DONE], each other request a 503."""
    problems, answers = [], []
    case = {"chat": False, "text": "a long story about the cat", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True}

    def client(stream: bool):
        head, data = raw_request(server.url, dict(case, stream=stream))
        got = b""
        try:
            with connect(server.url) as sock:
                sock.settimeout(STOP_S + 5)
                sock.sendall(head + data)
                while piece := sock.recv(65536):
                    got += piece
        except OSError as e:
            got += f" [{type(e).__name__}]".encode()
        answers.append((stream, got))

    def half_body():  # a client still sending its body
        head, data = raw_request(server.url, dict(case, stream=False))
        with connect(server.url) as sock:
            sock.settimeout(STOP_S + 5)
            sock.sendall(head + data[:len(data) // 2])
            try:
                answers.append((False, sock.recv(65536)))
            except OSError as e:
                answers.append((False, f"[{type(e).__name__}]".encode()))

    threads = [threading.Thread(target=client, args=(i % 2 == 0,), daemon=True)
               for i in range(4)] + [threading.Thread(target=half_body, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(3)
    started = time.monotonic()
    server.proc.send_signal(sig)
    try:
        code = server.proc.wait(STOP_S)
        if code not in (0, -sig):
            problems.append(f"exit code {code} after {sig.name}")
    except subprocess.TimeoutExpired:
        problems.append(f"still running {STOP_S} s after {sig.name}")
        server.proc.kill()
        server.proc.wait()
    stopped_s = time.monotonic() - started
    for t in threads:
        t.join(5)
    for stream, got in answers:
        # Answered whole: a stream to its last chunk, a JSON body (503 server_stopping where it
        # was running; one --kv-mem or the queue refused at once is answered too)
        clean = got.startswith(b"HTTP/1.1 ") and (
            got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") or got.endswith(b"}}"))
        if not clean:
            problems.append(f"{'a stream' if stream else 'a request'} in flight at {sig.name} "
                            f"ended {got[:12]!r}...{got[-60:]!r}")
    if not any(b"server_stopping" in got for _, got in answers):
        problems.append(f"no request in flight at {sig.name} was answered server_stopping")
    if len(answers) < len(threads):
        problems.append(f"{len(threads) - len(answers)} clients hung at {sig.name}")
    print(f"{sig.name} with {len(threads)} requests in flight: exit {server.proc.returncode} in "
          f"{stopped_s:.1f} s", flush=True)
    return problems


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="fermijit/default_model")
    p.add_argument("--minutes", type=float, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--queue-size", type=int, default=8)
    p.add_argument("--kv-mem", default="")
    p.add_argument("--speculative", default="auto", choices=["auto", "mtp", "none"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGINT"])
    p.add_argument("--log", help="the server's stderr (default /tmp/soak-PORT.err)")
    p.add_argument("serve_flags", nargs="*", help="more flags for serve, after --")
    args = p.parse_args()

    server = Server(args, args.serve_flags)
    failures: list[str] = []
    try:
        soak = Soak(server, args, args.seed)
        rss_start = server.rss()
        soak.make_references(6)
        rss_warm = server.rss()
        rss_after = []  # after each quarter, the clients done
        t0 = time.monotonic()
        for _ in range(4):
            soak.run(args.minutes * 15)
            h = settle(server)
            if h["active"] or h["waiting"]:
                failures.append(f"/health after the clients were done: {h}")
            rss_after.append(server.rss())
        soak_s = time.monotonic() - t0
        # Alone again: the same answers as before the load.
        for case, want in soak.references:
            _, text, _ = call(server.url, case)
            if text != want and not (soak.is_speculative and case["temperature"]):
                failures.append(f"after the soak, alone: {text!r} != {want!r} on {case}")
        failures += budget_whole(server, args)
        if rss_after[-1] - rss_after[1] > LEAK_BYTES:  # the first quarter fills the caches
            failures.append(f"RSS grew {(rss_after[-1] - rss_after[1]) >> 20} MiB over the "
                            f"second half")
        failures += stop_with_streams(server, getattr(signal, args.signal))
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    log = server.stderr()
    # Any line but the start's and the stop's: a traceback, uvicorn's ERROR, asyncio's warnings
    bad_lines = [line for line in log.splitlines() if not re.match(r"ready in |stopped$", line)]
    if bad_lines:
        failures.append(f"{len(bad_lines)} unexpected lines in {server.log_path}: "
                        f"{bad_lines[:3]}")
    r = soak.results
    failures = r.failures + failures
    print(f"\n{sum(r.count.values())} requests in {soak_s / 60:.1f} min, {args.clients} clients "
          f"(batch {args.max_batch}, queue {args.queue_size}, kv-mem {args.kv_mem or 'default'}"
          f", speculative {args.speculative}, seed {args.seed})")
    print(f"{'action':<16} {'n':>5} {'p50 s':>7} {'p99 s':>7}  outcomes")
    for action, n in sorted(r.count.items()):
        lat = r.latency[action]
        outs = ", ".join(f"{o} {k}" for (a, o), k in sorted(r.outcome.items()) if a == action)
        print(f"{action:<16} {n:>5} {quantile(lat, .5):>7.2f} {quantile(lat, .99):>7.2f}  {outs}")
    mib = 1 << 20
    print(f"RSS MiB: start {rss_start / mib:.0f}, after the references {rss_warm / mib:.0f}, "
          f"after each quarter {', '.join(f'{r / mib:.0f}' for r in rss_after)}")
    print(f"server log: {server.log_path} ({len(log.splitlines())} lines, "
          f"{sum('WARNING' in x for x in log.splitlines())} warnings)")
    for f in failures[:30]:
        print("FAIL", f[:400])
    print("FAILED" if failures else "OK", f"({len(failures)} failures)")
    return 1 if failures else 0


def budget_whole(server: Server, args) -> list[str]:
    """A request as large as the context (prompt + max_tokens 2048 positions) runs once all
    have ended: the budget is whole again (unless --kv-mem cannot ever hold it: a 400)."""
    ids = list(range(1, 1001))
    case = {"chat": False, "text": ids, "max_tokens": 1048, "temperature": 0, "stream": False}
    try:
        path, body = body_of(case)
        r = httpx.post(server.url + path, json=body, timeout=CALL_S)
    except httpx.TimeoutException:
        return ["the whole-budget request hung"]
    code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
    if r.status_code == 200 or code == "kv_memory_exceeded":
        return []
    return [f"a whole-context request after the soak: {r.status_code} {r.text[:200]}"]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
