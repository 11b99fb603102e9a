"""Where one decode token's time goes, op by op, with Python and dispatch apart from kernel time.

Installed for the profiled token only (normal decode runs untouched): every public function of
the op modules the forward calls is wrapped with a timer (an op called inside another op counts
to the outer one), numpy products of fp32 weights in `forward.linear` count as an op of their own,
and Numba's dispatcher is given a timed `__call__`, so the time inside compiled code is known per
op. Numba's own dispatch (typing the arguments, finding the overload) happens inside that call:
it is measured on an empty kernel in the same run and moved to the Python side. The kernel time
is split by what the threads did (jit.omp.Regions): compiled code outside parallel regions (one
thread works), Numba's own prange launches (kernels compiled parallel: threads, not split), and
inside the regions work, threads idle, and fork/join.
"""

from __future__ import annotations

import importlib
import time
import types

import numba
import numpy as np

from fermijit.jit import omp

OP_MODULES = ("embedding", "rmsnorm", "attention", "attention_step", "conv1d", "gated_delta",
              "gdn_step", "kv_quant", "l2norm", "matvec", "moe", "residual_step", "rope", "router",
              "fp32_rows")
GLUE = "forward glue (Python, numpy copies and adds)"
DISPATCH_SAMPLES = 20000


class _Clock:
    def __init__(self):
        # op -> [calls, seconds, kernel seconds, kernel calls, prange kernels' seconds, calls]
        self.rows: dict[str, list] = {}
        self.regions: dict[str, omp.Regions] = {}  # op -> its parallel regions (omp.Regions)
        self.active: str | None = None
        self.kernel_s = 0.0
        self.kernel_calls = 0
        self.prange_s = 0.0
        self.prange_calls = 0

    def timed(self, name, fn):
        def wrapper(*args, **kwargs):
            label = name(*args) if callable(name) else name
            if self.active is not None or label is None:
                return fn(*args, **kwargs)
            return self.run(label, fn, args, kwargs)
        return wrapper

    def run(self, label, fn, args, kwargs=None):
        """fn(*args, **kwargs), its time counted to `label` (an op called inside: to `label`)."""
        self.active = label
        k0, c0, p0, q0 = self.kernel_s, self.kernel_calls, self.prange_s, self.prange_calls
        r0 = omp.Regions.now()
        start = time.perf_counter()
        try:
            return fn(*args, **(kwargs or {}))
        finally:
            dt = time.perf_counter() - start
            regions = omp.Regions.now() - r0
            self.active = None
            row = self.rows.setdefault(label, [0, 0.0, 0.0, 0, 0.0, 0])
            row[0] += 1
            row[1] += dt
            row[2] += self.kernel_s - k0
            row[3] += self.kernel_calls - c0
            row[4] += self.prange_s - p0
            row[5] += self.prange_calls - q0
            if label in self.regions:
                regions = self.regions[label] + regions
            self.regions[label] = regions


def _dispatch_seconds() -> float:
    """One call of an empty compiled function on an array: Numba's dispatch alone."""
    import numba

    @numba.njit(nogil=True)
    def empty(a):
        return a.shape[0]

    a = np.zeros(4, np.float32)
    empty(a)
    start = time.perf_counter()
    for _ in range(DISPATCH_SAMPLES):
        empty(a)
    return (time.perf_counter() - start) / DISPATCH_SAMPLES


def profile_token(model, token: int, state) -> list[dict]:
    """Decode `token` once with every op timed; rows sorted by time, the glue and the total last.
    Each row: op, calls, ms, kernel_ms, python_ms (Python and dispatch), and us_per_call."""
    # Decode's plan names its steps (model/forward.py): the ops' functions stay unwrapped, so a
    # plan made during this token holds no timer of this profile.
    return profile_call(model.decode, token, state, wrap_ops=False)


def profile_prefill(model, tokens, state) -> list[dict]:
    """`profile_token`'s rows for a prefill of `tokens` (prefill's kernels launch their own
    threads too, through Numba's prange: those count in the `prange` column, unsplit)."""
    return profile_call(model.prefill, tokens, state)


def profile_call(fn, *args, wrap_ops: bool = True) -> list[dict]:
    """`fn(*args)` (a decode or a prefill) with every op timed: `profile_token`'s rows.
    `wrap_ops`: time the op modules' public functions (else only decode's plan steps)."""
    from numba.core import dispatcher as numba_dispatcher
    from numba import _dispatcher

    from fermijit.model import forward

    omp.cycles_per_second()  # measured once, before the dispatcher is timed: it calls a kernel
    clock = _Clock()
    patched: list[tuple[object, str, object]] = []

    def patch(owner, attr, wrapper):
        patched.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, wrapper)

    for short in OP_MODULES if wrap_ops else ():
        module = importlib.import_module(f"fermijit.ops.{short}")
        for attr, op in list(vars(module).items()):
            if isinstance(op, types.FunctionType) and op.__module__ == module.__name__ \
                    and not attr.startswith("_") and attr != "reference":
                patch(module, attr, clock.timed(f"{short}.{attr}", op))
    if wrap_ops:
        patch(forward, "linear", clock.timed(
            lambda x, w, out, act=None: "linear fp32 (numpy)" if isinstance(w, np.ndarray)
            else None, forward.linear))

    def timed_steps(steps):  # decode's plan (model/forward.py): each step under its op's name
        for label, step, args in steps:
            clock.run(label, step, args)

    patch(forward, "run_steps", timed_steps)

    base_call = _dispatcher.Dispatcher.__call__

    def timed_call(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return base_call(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - start
            clock.kernel_s += dt
            clock.kernel_calls += 1
            if self.targetoptions.get("parallel"):
                clock.prange_s += dt
                clock.prange_calls += 1

    patch(numba_dispatcher.Dispatcher, "__call__", timed_call)
    try:
        omp.Regions.start()
        start = time.perf_counter()
        fn(*args)
        total = time.perf_counter() - start
    finally:
        regions = omp.Regions.stop()
        for owner, attr, old in reversed(patched):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)

    dispatch_s = _dispatch_seconds()  # after: its 20000 serial calls let the thread team sleep
    rows = []
    for op, (calls, secs, kern, kcalls, prange_s, pcalls) in clock.rows.items():
        kernel = max(0.0, kern - kcalls * dispatch_s)
        prange_s = min(kernel, max(0.0, prange_s - pcalls * dispatch_s))
        rows.append({"op": op, "calls": calls, "ms": 1e3 * secs, "kernel_ms": 1e3 * kernel,
                     "python_ms": 1e3 * (secs - kernel), "us_per_call": 1e6 * secs / calls,
                     "split": split(clock.regions[op], 1e3 * kernel, 1e3 * prange_s)})
    rows.sort(key=lambda r: -r["ms"])
    in_ops = sum(r["ms"] for r in rows)
    glue = 1e3 * total - in_ops
    rows.append({"op": GLUE, "calls": None, "ms": glue, "kernel_ms": 0.0, "python_ms": glue,
                 "us_per_call": None})
    kernel_ms = sum(r["kernel_ms"] for r in rows)
    rows.append({"op": "token", "calls": sum(r["calls"] or 0 for r in rows), "ms": 1e3 * total,
                 "kernel_ms": kernel_ms, "python_ms": sum(r["python_ms"] for r in rows),
                 "us_per_call": None, "dispatch_us": 1e6 * dispatch_s,
                 "threads": numba.get_num_threads(),
                 "split": split(regions, kernel_ms, sum(r["split"]["prange"] for r in rows
                                                         if "split" in r))})
    return rows


def split(regions: "omp.Regions", kernel_ms: float, prange_ms: float = 0.0) -> dict:
    """A token's kernel time by what the threads did (ms): `serial`, compiled code outside the
    jit.omp regions (one thread works, the team waits); `prange`, the calls of kernels compiled
    parallel (Numba's own prange launches: on the threads, but not split, and counted here
    whole); in the regions, `work` (the threads' mean busy time), `idle` (threads waiting for
    the slowest share) and `fork_join` (the rest of the calling thread's time there); and the
    regions' count."""
    return {"regions": regions.count, "prange": prange_ms,
            "serial": max(0.0, kernel_ms - prange_ms - 1e3 * regions.wall_s),
            "work": 1e3 * regions.busy_mean_s, "idle": 1e3 * regions.idle_s,
            "fork_join": 1e3 * regions.fork_join_s}


class _Missing:
    pass


_MISSING = _Missing()


def format_split(token: dict) -> str:
    """The token row's time split as one line."""
    s = token["split"]
    return (f"{token['threads']} threads: Python and dispatch {token['python_ms']:.2f} ms, "
            f"kernels serial {s['serial']:.2f}, prange {s['prange']:.2f}, in {s['regions']} "
            f"parallel regions: work {s['work']:.2f}, idle {s['idle']:.2f}, fork/join "
            f"{s['fork_join']:.2f}")


def format_rows(rows: list[dict], what: str = "one decode token") -> str:
    total = rows[-1]["ms"]
    lines = [f"profile of {what} (Numba dispatch {rows[-1]['dispatch_us']:.2f} us a "
             f"call, counted as Python)",
             f"{'op':<40} {'calls':>5} {'ms':>8} {'%':>6} {'kernel':>8} {'python':>7} "
             f"{'us/call':>8} | kernel ms: {'serial':>6} {'prange':>6} {'work':>7} {'idle':>6} "
             f"{'fork':>6}"]
    for r in rows:
        calls = "" if r["calls"] is None else str(r["calls"])
        per = "" if r["us_per_call"] is None else f"{r['us_per_call']:8.1f}"
        s = r.get("split")
        parts = (f" | {'':>10} {s['serial']:6.2f} {s['prange']:6.2f} {s['work']:7.2f} "
                 f"{s['idle']:6.2f} {s['fork_join']:6.2f}" if s else "")
        lines.append(f"{r['op'][:40]:<40} {calls:>5} {r['ms']:8.2f} {100 * r['ms'] / total:5.1f}% "
                     f"{r['kernel_ms']:8.2f} {r['python_ms']:7.2f} {per:>8}{parts}")
    lines.append("  " + format_split(rows[-1]))
    return "\n".join(lines)
