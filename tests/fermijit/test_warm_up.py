"""The warm-up runs a sample of the layers (one of each kind), yet loads every kernel the whole
model's prefill and decode then use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fermijit
from fermijit import engine, warm
from fermijit.jit import cpu
from fermijit.model import synth
from fermijit.model.forward import load_model
from tests.model.test_synth import SMALL
from tests.numerics import assert_close

# In a fresh interpreter (this one has compiled everything already): after the warm-up, a prefill
# and decode of the whole 8-layer model may not compile or load any kernel.
PROBE = """
import sys
import numpy as np
from numba.core.dispatcher import Dispatcher
from fermijit import engine
from fermijit.model.forward import load_model
_, model = load_model(sys.argv[1])
engine.warm_up(model, np.arange(3, 5))
loaded = []
compile_ = Dispatcher.compile
def watched(self, sig):
    n = len(self.overloads)
    try:
        return compile_(self, sig)
    finally:
        if len(self.overloads) > n:  # a kernel compiled or loaded from the cache now
            loaded.append(self.py_func.__qualname__)
Dispatcher.compile = watched
state = model.new_state(8)
model.decode(int(np.argmax(model.prefill(np.arange(5, 7), state))), state)
print(len(loaded), loaded)
"""


def test_sample_has_each_layer_kind_and_shares_weights(tmp_path):
    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "m", layers=8, overrides=SMALL,
                show_progress=False)
    _, model = load_model(tmp_path / "m")
    sample = engine.kernel_sample(model)
    assert sample.is_attention == (False, False, False, True)
    assert all(a is b for a, b in zip(sample.layers, model.layers))
    assert len(model.layers) == 8 and model.is_attention[-1]

    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "m")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "0", r.stdout


def test_a_k_quant_mixs_layers_of_another_format_are_kinds_of_their_own(tmp_path):
    """Q4_K_M gives layer 2 of 4 (GDN) Q6_K down and value projections, so no joined input
    projection: its kernels are not layer 0's, and both samples take it (the server's extra
    warm-ups took layers 0 and 3 only)."""
    from tests.model.test_synth import SMALL_K

    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "m", layers=4, overrides=SMALL_K,
                mix="q4_k_m", show_progress=False)
    _, model = load_model(tmp_path / "m")
    assert model.is_attention == (False, False, False, True)
    assert model.layers[0].joined_in is not None and model.layers[2].joined_in is None
    assert warm.first_of_each_kind(model) == [0, 2, 3]
    assert warm.light_sample(model).is_attention == (False, False, True)
    assert engine.kernel_sample(model) is model
    assert warm.weight_formats(model.layers[0]) == warm.weight_formats(model.layers[1])


# --- first runs with helper processes (fermijit/warm.py) ----------------------------------------

# argv: model, where to save the logits, mode. Modes: "helped" (a helper runs every job into the
# empty cache first, then the warm-up must find every kernel there), "plain" (the warm-up as a
# run does it, helpers as FERMIJIT_COMPILE_WORKERS says), "failing" (its helper is given a
# directory with no model), "killed" (its helper is killed 3 s after it starts). Prints the
# kernels compiled and loaded by the warm-up and then the whole model's prefill and decode.
RUN = """
import gc, os, signal, sys, threading
import numpy as np
from numba.core.dispatcher import Dispatcher
from fermijit import warm
from fermijit.model.forward import load_model
path, out, mode = sys.argv[1:]
_, model = load_model(path)
helpers = []
if mode == "helped":
    h = warm.Helpers(warm.kernel_sample(model), warm.WARM_UP_TOKENS)
    h.start()
    helpers = list(h.processes)
    helpers[0].wait()  # it runs every job: this process has started none
    h.stop()
    os.environ[warm.WORKERS_ENV] = "0"
if mode == "failing":
    model.source = path + "-missing"
start = warm.Helpers.start
def start_watched(self):
    start(self)
    helpers.extend(self.processes)
    for p in self.processes if mode == "killed" else ():
        threading.Timer(3.0, os.kill, (p.pid, signal.SIGKILL)).start()
warm.Helpers.start = start_watched
warm.warm_up(model, np.arange(3, 5))
state = model.new_state(8)
logits = [model.prefill(np.arange(5, 9), state)]
logits.append(model.decode(int(np.argmax(logits[0])), state))
np.save(out, np.stack(logits))
kernels = [d for d in gc.get_objects() if isinstance(d, Dispatcher)]
print(sum(sum(d.stats.cache_misses.values()) for d in kernels),
      sum(sum(d.stats.cache_hits.values()) for d in kernels),
      *[p.returncode for p in helpers])
"""


def _start(model, out, mode, cache, workers=None):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    env.pop(warm.WORKERS_ENV, None)
    if workers is not None:
        env[warm.WORKERS_ENV] = str(workers)
    return subprocess.Popen([sys.executable, "-c", RUN, str(model), str(out), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p):
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    return [int(v) for v in out.split()]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "m"
    synth.synth("qwen3.6-35b-a3b-reap128", path, layers=4, overrides=SMALL, show_progress=False)
    return path


@pytest.mark.slow
def test_kernels_compiled_by_a_helper_are_loaded_and_compute_the_same(small_model, tmp_path):
    """A helper running the jobs alone fills the cache with every kernel the warm-up, prefill and
    decode need; loaded, they give bit for bit what kernels compiled by a run itself give when
    loaded. (Two runs sharing a cache at once: tests/fermijit/jit/test_jit_dispatch.py.)"""
    misses, hits, helper_rc = _finish(_start(small_model, tmp_path / "h.npy", "helped",
                                             tmp_path / "helped", workers=1))
    assert helper_rc == 0 and misses == 0 and hits > 0

    *_, failed_rc = _finish(_start(small_model, tmp_path / "a.npy", "failing", tmp_path / "own",
                                   workers=1))
    assert failed_rc != 0  # its helper could not load a model; the run compiled everything
    misses, hits = _finish(_start(small_model, tmp_path / "c.npy", "plain", tmp_path / "own"))
    assert misses == 0 and hits > 0
    assert np.array_equal(np.load(tmp_path / "h.npy"), np.load(tmp_path / "c.npy"))


@pytest.mark.slow
def test_a_helper_killed_mid_compile_costs_time_not_results(small_model, tmp_path):
    misses, _, killed_rc = _finish(_start(small_model, tmp_path / "k.npy", "killed",
                                          tmp_path / "cache", workers=1))
    assert killed_rc == -signal.SIGKILL and misses > 0  # this run compiled what was missing
    _finish(_start(small_model, tmp_path / "w.npy", "plain", tmp_path / "cache", workers=0))
    killed, warm_ = np.load(tmp_path / "k.npy"), np.load(tmp_path / "w.npy")
    # Kernels compiled in this process may round differently from their cached code in the last
    # bits (jit/cpu.py FASTMATH: attention's reassociation, ~2e-7).
    assert_close("logits", warm_, killed, atol=1e-5, rtol=1e-5)
    assert np.argmax(killed[0]) == np.argmax(warm_[0])


ORPHAN = """
import sys, time
import numpy as np
from fermijit import warm
from fermijit.model.forward import load_model
_, model = load_model(sys.argv[1])
h = warm.Helpers(warm.kernel_sample(model), 2)
h.start()
print(*[p.pid for p in h.processes], flush=True)
time.sleep(600)
"""


def test_helpers_stop_when_their_process_dies(small_model, tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), **{warm.WORKERS_ENV: "2"})
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(small_model)], env=env,
                              stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent, killed, cannot reap it)


@pytest.mark.parametrize("isa", [i.label for i in cpu.PREFERENCE if cpu.supported(i)])
def test_a_helper_starts_for_every_isa(small_model, tmp_path, isa):
    """A helper given no jobs: it must get as far as the model (`--isa ssse3` is refused once
    anything has compiled, and importing the ops did compile)."""
    (tmp_path / "claims").mkdir()
    p = subprocess.Popen([sys.executable, "-c", "from fermijit.warm import helper_main; "
                          "helper_main()", str(Path(fermijit.__file__).resolve()),
                          str(small_model), str(tmp_path / "claims"), "2", isa, isa, "1"],
                         stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = p.stderr.read()  # stdin stays open: a closed one tells a helper to stop at once
    assert p.wait(timeout=300) == 0, err[-2000:]
    p.stdin.close()
