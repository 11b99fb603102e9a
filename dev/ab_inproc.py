"""In-process A/B of the chunked shares' schedules (static equal runs vs claimed runs): one
model, one state, windows of W greedy tokens alternating static | dynamic (order swapped every
pair), so load drift hits both; prints each side's median ms a token and the median ratio of
paired windows. Also checks that both schedules decode the same greedy tokens. Usage:
  python dev/ab_inproc.py MODEL THREADS [PAIRS] [W]"""
import statistics as st
import sys
import time

import numpy as np

from fermijit.jit import cpu, omp
from fermijit.model.forward import load_model

model_dir, threads = sys.argv[1], int(sys.argv[2])
pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 8
w = int(sys.argv[4]) if len(sys.argv) > 4 else 6
cpu.configure_threads(threads)
_, model = load_model(model_dir)
rng = np.random.default_rng(0)
prompt = rng.integers(0, 1000, 32).tolist()


def window(dynamic, token, state):
    omp.set_dynamic(dynamic)
    times, toks = [], []
    for _ in range(w):
        t0 = time.perf_counter()
        token = int(np.argmax(model.decode(token, state)))
        times.append(time.perf_counter() - t0)
        toks.append(token)
    return st.median(times), toks, token


def fresh():
    state = model.new_state(len(prompt) + 2 * (pairs + 1) * w + 4)
    return state, int(np.argmax(model.prefill(prompt, state)))


# Same tokens either way: each schedule from the same prompt.
s1, t1 = fresh()
s2, t2 = fresh()
_, a, _ = window(False, t1, s1)
_, b, _ = window(True, t2, s2)
assert a == b, (a, b)
state, token = fresh()
window(True, token, state)  # warm
ms = {False: [], True: []}
ratios = []
for p in range(pairs):
    order = (False, True) if p % 2 == 0 else (True, False)
    got = {}
    for dyn in order:
        m, _, token = window(dyn, token, state)
        got[dyn] = m
        ms[dyn].append(1e3 * m)
    ratios.append(got[False] / got[True])
print(f"threads {threads}: static {st.median(ms[False]):.2f} ms/token, dynamic "
      f"{st.median(ms[True]):.2f}; static/dynamic paired median {st.median(ratios):.3f} "
      f"(pairs {[round(r, 3) for r in ratios]}); same greedy tokens: yes")
