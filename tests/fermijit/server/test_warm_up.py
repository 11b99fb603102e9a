"""`serve`'s warm-up (fermijit/server/run.py warm_up) loads every kernel its first requests meet:
in a fresh process, after it, requests alone of 2 to 600 prompt tokens and 2, 3, 4 and 8 together
(the batched steps) compile or load no kernel (issue 28 item 4: the start's kernels, and no first
request paying for more)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")

# Records every kernel compiled or loaded from here on, in `seen`.
HOOK = """
seen = []
compile_ = dispatch.Dispatcher.compile
def compile(self, sig):
    seen.append(f"{self.py_func.__qualname__}{sig}")
    return compile_(self, sig)
dispatch.Dispatcher.compile = compile
"""

SCRIPT = """
import concurrent.futures
import httpx
from fermijit.engine import DEFAULT_MODEL, Engine
from fermijit.jit import dispatch
from fermijit.server.app import make_app
from fermijit.server.run import ServerThread, warm_up
from fermijit.server.scheduler import Scheduler

engine = Engine.load(DEFAULT_MODEL)
warm_up(engine, 8)
""" + HOOK + """scheduler = Scheduler(engine, max_batch=8)
scheduler.start()
server = ServerThread(make_app(scheduler, "m"))
def request(prompt):
    return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}).status_code
codes = [request([1, 2])]
for n in (8, 40, 200, 600):  # past every size where an op takes another kernel
    codes.append(request([7 + k % 50 for k in range(n)]))
for n in (2, 3, 4, 8):       # batched steps of as many rows
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        codes += list(pool.map(request, [[3 + k, 4] for k in range(n)]))
server.stop()
scheduler.stop()
print(codes, seen)
"""


def test_no_kernel_is_loaded_after_the_warm_up():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{[200] * 22} []", out.stdout


SPECULATIVE_SCRIPT = """
import numpy as np
from fermijit import speculative
from fermijit.engine import DEFAULT_MODEL, Engine, Settings
from fermijit.jit import dispatch
from fermijit.model.state import GdnState
from fermijit.server.run import warm_up

engine = Engine.load(DEFAULT_MODEL)
drafts = speculative.Drafts()
warm_up(engine, 8, drafts)
""" + HOOK + """model = engine.model
state = model.new_state(64, mtp=True)
model.prefill(np.array([5, 6, 7, 8], np.int32), state)
speculator = speculative.Speculator(model, engine.sampler(Settings()), drafts)
token = 9
for _ in range(6):
    tokens, _ = speculator.step(state, token)
    token = tokens[-1]
gdn = [s for s in state.layers if isinstance(s, GdnState)]
gdn[0].pending.is_set[0] = 1  # a kept draft's row, whatever these drafts did
speculator.settle(state)
model.decode(token, state)    # plain decode after the steps settles every GDN layer
print(seen)
"""


def test_speculative_warm_up_loads_the_steps_and_the_settling():
    """With MTP drafts (the default model has its head): after the warm-up, speculative steps,
    a pending GDN row settled and a plain token load no kernel."""
    out = subprocess.run([sys.executable, "-c", SPECULATIVE_SCRIPT], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


BATCH_SCRIPT = """
import numpy as np
from fermijit.engine import DEFAULT_MODEL, Engine
from fermijit.jit import dispatch
from fermijit.model.batch import decode_batch
from fermijit.server.run import switch_rows, warm_up

engine = Engine.load(DEFAULT_MODEL)
model = engine.model
warm_up(engine, 4096)
""" + HOOK + """rows = switch_rows(model)
for n in (rows, rows + 1, 3 * rows):  # batches past the warm-up's largest step
    decode_batch(model, np.zeros(n, np.int32), [model.new_state(2) for _ in range(n)])
print(seen)
"""


def test_a_large_max_batch_warms_up_at_most_switch_rows_sequences(engine, monkeypatch):
    """--max-batch 4096's warm-up stepped a batch of 4096 sequences (4.6 s of the embedded
    model's start against 0.06 s at 8): past `switch_rows` a batch meets no other kernel."""
    from fermijit.model import batch
    from fermijit.server.run import switch_rows, warm_up

    steps = []
    step = batch.decode_batch
    monkeypatch.setattr(batch, "decode_batch",
                        lambda model, tokens, states, *a: steps.append(len(states))
                        or step(model, tokens, states, *a))
    warm_up(engine, 4096)
    assert steps == [2, 3, 4, switch_rows(engine.model)]
    steps.clear()
    warm_up(engine, 8)
    assert steps == [2, 3, 4, 8]


def test_no_kernel_is_loaded_by_batches_larger_than_the_warm_ups():
    out = subprocess.run([sys.executable, "-c", BATCH_SCRIPT], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
