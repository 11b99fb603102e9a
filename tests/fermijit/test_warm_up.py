"""The warm-up runs a sample of the layers (one of each kind), yet loads every kernel the whole
model's prefill and decode then use."""

from __future__ import annotations

import subprocess
import sys

from fermijit import engine
from fermijit.model import synth
from fermijit.model.forward import load_model
from tests.model.test_synth import SMALL

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
