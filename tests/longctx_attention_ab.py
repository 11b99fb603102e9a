"""Decode attention at long context, A/B in one process (issue 31 item 3; tests/gpu_longctx.sh
paired16k runs it on the GPU machine's host): a token's attention over LAYERS full-size Q8_0
caches (Hq 16, Hkv 2, D 256; 10 layers at 16k keys are 189 MB, past a last-level cache, as in
decode, whose weights flush it), timed in rounds taken in turn (A B B A ...), the median of the
rounds' ratios. First where the time goes (issue 31 item 3: 4.23 ms a token at 16 threads against
~1.9 ms of bytes): the read probe's GB/s and the bytes' bound, the kernel's ns a key-head of thread
time over the cold caches against a hot set (one layer of 8192 keys, 9 MB, in L3: compute alone),
and at half the threads; ~equal ns cold and hot means the kernel is compute-bound there
(on the 2-core Zen 5: 74 vs 72 ns, 2.3-4.7x the bound), not waiting on memory. Then the A/Bs:
  merge     the key ranges' partials merged by Numba's scalar loop against attention_simd.merged_row
            (16 floats at a time; the same bits)
  claimed   omp.set_dynamic(True), the default, against False: where attention's share takes
            its items (a kv head's 256-key ranges) by jit/omp.py first_run / next_run (branch
            long31-claimed), claimed runs after an equal static half against each thread's
            contiguous equal run; where it does not (main), the same code twice (a noise check)
  prefetch  the kernel compiled without its prefetches of the next 64-key block
            (ops/attention_simd.py PREFETCH_KEYS = 0) against the kernel as it is (issue 31
            item 3: at 1 thread on a Zen 4, 88 -> 59 ns a key-head)
  huge      the caches in transparent huge pages (madvise) against ordinary 4 KB pages (the
            state's caches: model/state.py `reserved`), both with the default schedule
Each arm's outputs are checked to have the same bits.

Usage: python tests/longctx_attention_ab.py [KEYS [THREADS [ROUNDS]]]  (16384, all, 12)
"""

from __future__ import annotations

import mmap
import os
import sys
import time

# Run as a script from tests/: that folder first on the path would shadow the package
# (tests/fermijit).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import numba  # noqa: E402
import numpy as np  # noqa: E402

from fermijit.jit import cpu, omp  # noqa: E402
from fermijit.jit.cpu import Isa, bind, kernel  # noqa: E402
from fermijit.bench import kernels as bench_kernels  # noqa: E402
from fermijit.ops import attention, attention_simd, kv_quant  # noqa: E402

LAYERS = 10
HQ, HKV, D = 16, 2, 256
# One layer's keys in the hot set: 9 MB, within a last-level cache; with a layer's fixed costs
# (forks, merge) over as many keys as possible (2048 keys: those costs were 2/3 of its time here).
HOT_KEYS = 8192
ROUND_S = 0.05  # seconds an arm's timing in a round takes at least (as many tokens' attention)


def allocator(huge: bool):
    """kv_quant.empty's allocate: anonymous mappings of their own (as model/state.py `reserved`),
    advised into transparent huge pages or kept in 4 KB ones."""
    def allocate(shape, dtype):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        return np.frombuffer(m, dtype).reshape(shape)

    return allocate


def huge_page_bytes() -> int:
    """The process's memory in transparent huge pages (/proc/self/smaps_rollup; 0 unknown)."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def caches(n_keys: int, rng) -> list:
    """LAYERS (k, v) Q8Rows of n_keys + 1 positions in 4 KB pages, random rows."""
    out = []
    for _ in range(LAYERS):
        kv = [kv_quant.empty((HKV, n_keys + 1, D), allocator(False)) for _ in range(2)]
        for start in range(0, n_keys + 1, 4096):
            n = min(4096, n_keys + 1 - start)
            for rows in kv:
                kv_quant.store(rng.standard_normal((n, HKV, D)).astype(np.float32), rows, start)
        out.append(kv)
    return out


def in_huge_pages(layers) -> list:
    """A copy of every layer's rows in transparent huge pages."""
    out = []
    for kv in layers:
        pair = []
        for rows in kv:
            made = kv_quant.empty(rows.qs.shape, allocator(True))
            made.qs[...], made.d[...] = rows.qs, rows.d
            pair.append(made)
        out.append(pair)
    return out


def tile_range(label: str, **over):
    """attention._kernel's Q8_0 tile range for the process's ISA, with `over` in place of its
    bindings: compiled under `label` by its first call (settings such as
    attention_simd.PREFETCH_KEYS read then; attention._kernel's label: its own code)."""
    isa = cpu.selected_isa()
    staged, weighted = (kernel(f, variant=label, VALUES_IN_REGISTERS=isa is not Isa.SSSE3)
                        for f in (attention._staged_q8, attention._weighted_q8))
    scores, keys = attention.q8_score_kernels(isa, label)
    bindings = dict(_scores=scores, _staged=staged, _staged_keys=keys, _weighted=weighted)
    return kernel(attention._tile_range, variant=label, **{**bindings, **over})


def labelled_kernel(label: str, n_ranges=None, combine=None, merge_floats=None, **over):
    """The Q8_0 decode kernel of the process's ISA as attention._kernel makes it, under labels of
    its own, over `tile_range(label, **over)` (tests/longctx_attention_stages.py leaves stages
    out); `n_ranges`: a kernel in place of attention.n_ranges where the ranges' size is another
    (tests/longctx_attention_ranges.py, with RANGE_KEYS in `over`); `combine`, `merge_floats`: a
    merge share and MERGE_FLOATS in place of attention's (tests/longctx_attention_parts.py)."""
    ranged = {} if n_ranges is None else {"n_ranges": n_ranges}
    if combine is None:
        combine = attention._combine_share if n_ranges is None else bind(
            attention._combine_share, label,
            combine_head=kernel(attention.combine_head.py_func, variant=label, **ranged))
    body = ranged if merge_floats is None else {**ranged, "MERGE_FLOATS": merge_floats}
    return omp.forking_kernel(
        bind(attention._decode_body, label + "-decode", **body),
        fork=bind(attention.attend_share, label, _tile_range=tile_range(label, **over), **ranged),
        fork_combine=combine, capped=("fork", "fork_combine"), chunked=("fork",))()


def unprefetched_kernel():
    """labelled_kernel compiled by its first call, which the caller makes with
    attention_simd.PREFETCH_KEYS = 0 (no prefetches)."""
    return labelled_kernel(f"q8_{cpu.selected_isa().label}-noprefetch")


@kernel(fastmath=False)
def _merge_scalar(a, m, l, a_r, m_r, l_r):
    """attention._merge_row as it was: Numba's loop, left scalar."""
    m_new = max(m, m_r)
    c, c_r = np.exp(m - m_new), np.exp(m_r - m_new)
    for d in range(a.shape[0]):
        a[d] = c * a[d] + c_r * a_r[d]
    return m_new, c * l + c_r * l_r


def scalar_merge_kernel():
    """The Q8_0 decode kernel of the process's ISA with the scalar merge (its items' share the
    process's own)."""
    isa = cpu.selected_isa()
    label = f"q8_{isa.label}-scalar-merge"
    combine = kernel(attention.combine_head.py_func, variant=label, _merge_row=_merge_scalar)
    return omp.forking_kernel(
        bind(attention._decode_body, label + "-decode"),
        fork=bind(attention.attend_share, f"q8_{isa.label}",
                  _tile_range=tile_range(f"q8_{isa.label}")),
        fork_combine=bind(attention._combine_share, label, combine_head=combine),
        capped=("fork", "fork_combine"), chunked=("fork",))()


def where_time_goes(run, n_keys: int, nbytes: int, threads: int, rng, rounds: int) -> None:
    """The probe's GB/s and the bytes' bound; the kernel's ns a key-head of thread time cold
    (`run`: LAYERS layers of n_keys), hot (one layer of HOT_KEYS keys, in cache) and cold at half
    the threads; medians of interleaved rounds."""
    global LAYERS
    was, LAYERS = LAYERS, 1
    try:
        hot_run, _ = token_attention(caches(HOT_KEYS, rng), *hot_inputs(rng))
    finally:
        LAYERS = was
    hot_run()
    probe = bench_kernels.ReadProbe(512 << 20)
    half = max(1, threads // 2)

    def seconds(f, calls):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        return (time.perf_counter() - start) / calls

    def at(n, f):
        def g():
            numba.set_num_threads(n)
            try:
                f()
            finally:
                numba.set_num_threads(threads)
        return g

    arms = {"cold": (run, LAYERS * HKV * n_keys, threads),
            "hot": (hot_run, HKV * HOT_KEYS, threads),
            f"cold, {half} threads": (at(half, run), LAYERS * HKV * n_keys, half)}
    times = {name: [] for name in arms}
    gbs = []
    for i in range(max(3, rounds // 2)):
        gbs.append(probe.gbs(2))
        for name, (f, _, _) in (arms.items() if i % 2 == 0 else reversed(arms.items())):
            f()
            calls = max(2, int(ROUND_S / max(seconds(f, 1), 1e-6)))
            times[name].append(seconds(f, calls))
    g = float(np.median(gbs))
    cold = float(np.median(times["cold"]))
    print(f"where the time goes: read probe {g:.1f} GB/s, the caches' {nbytes / 1e6:.0f} MB bound "
          f"{1e3 * nbytes / g / 1e9:.2f} ms; the kernel {1e3 * cold:.2f} ms "
          f"({cold / (nbytes / g / 1e9):.2f}x the bound)", flush=True)
    for name, (_, key_heads, n) in arms.items():
        t = float(np.median(times[name]))
        print(f"  {name:<18} {1e3 * t:7.3f} ms a token's attention, {1e9 * t * n / key_heads:6.1f} "
              f"ns a key-head of thread time", flush=True)


def hot_inputs(rng):
    q, gate = (rng.standard_normal((1, HQ, D)).astype(np.float32) for _ in range(2))
    return q, gate, np.array([HOT_KEYS], np.int64)


def token_inputs(argv: list[str]):
    """The scripts' KEYS and THREADS from argv (16384, all; the threads configured), a random
    generator, and a decode token's query, gate and position after the keys."""
    n_keys = int(argv[0]) if argv else 16384
    threads = cpu.configure_threads(int(argv[1]) if len(argv) > 1 else None)
    rng = np.random.default_rng(31)
    q, gate = (rng.standard_normal((1, HQ, D)).astype(np.float32) for _ in range(2))
    return n_keys, threads, rng, q, gate, np.array([n_keys], np.int64)


def interleaved_medians(runs: dict, rounds: int = 7, calls: int = 3) -> dict:
    """Each run's median seconds a call over `rounds` rounds taken in turn (forwards, then
    backwards), each timing `calls` calls after an untimed one (which compiles at the first;
    then the other arms' data out of the caches)."""
    times = {name: [] for name in runs}
    for i in range(rounds):
        for name, run in (runs.items() if i % 2 == 0 else reversed(runs.items())):
            run()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def token_attention(layers, q, gate, position, decode_kernel=None):
    """A function running decode's attention steps over every layer (as decode's plan calls
    them; `decode_kernel` in place of attention.decode's), and the outputs it writes."""
    outs = [np.empty((1, HQ, D), np.float32) for _ in layers]
    shared: dict = {}
    steps = [(label, decode_kernel if decode_kernel and label == "attention.decode" else fn, args)
             for (k, v), o in zip(layers, outs)
             for label, fn, args in attention.decode_launch(q, k, v, gate, position, o,
                                                            shared=shared)]

    def run():
        for _, fn, args in steps:
            fn(*args)

    return run, outs


def ab(name: str, a, b, rounds: int) -> None:
    """Time a() and b() (each running a token's attention) in rounds A B B A ..., each timing as
    many calls as fill ROUND_S; print the medians and the median of the ratios a/b (> 1: b
    faster)."""
    a()
    start = time.perf_counter()
    b()
    calls = max(3, int(ROUND_S / (time.perf_counter() - start)))
    pairs = []
    for i in range(rounds):
        timed = []
        for f in ((a, b) if i % 2 == 0 else (b, a)):
            f()  # one untimed: the other arm's schedule or pages were in the caches
            start = time.perf_counter()
            for _ in range(calls):
                f()
            timed.append((time.perf_counter() - start) / calls)
        pairs.append(tuple(timed) if i % 2 == 0 else tuple(reversed(timed)))
    ratios = [x / y for x, y in pairs]
    print(f"{name}: A {1e3 * np.median([x for x, _ in pairs]):.2f} ms, B "
          f"{1e3 * np.median([y for _, y in pairs]):.2f} ms a token's attention ({calls} a "
          f"timing); A/B median {np.median(ratios):.3f} ("
          + ", ".join(f"{r:.3f}" for r in ratios) + ")", flush=True)


def main(argv: list[str]) -> None:
    n_keys, threads, rng, q, gate, position = token_inputs(argv)
    rounds = int(argv[2]) if len(argv) > 2 else 12
    t0 = time.perf_counter()
    small = caches(n_keys, rng)
    run, outs = token_attention(small, q, gate, position)
    print(f"decode attention at {n_keys} keys, {LAYERS} layers of Hq {HQ}, Hkv {HKV}, D {D} "
          f"(Q8_0, {sum(r.qs.nbytes + r.d.nbytes for kv in small for r in kv) / 1e6:.0f} MB), "
          f"{threads} threads, isa {cpu.selected_isa().label}; caches made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    run()
    nbytes = sum(r.qs.nbytes + r.d.nbytes for kv in small for r in kv)
    where_time_goes(run, n_keys, nbytes, threads, rng, rounds)

    run_scalar, outs_scalar = token_attention(small, q, gate, position, scalar_merge_kernel())
    run_scalar()
    same = all(np.array_equal(o, w) for o, w in zip(outs_scalar, outs))
    print(f"scalar merge: the same bits: {same}")
    ab("scalar merge (A) vs merged_row (B)", run_scalar, run, rounds)

    run_plain, outs_plain = token_attention(small, q, gate, position, unprefetched_kernel())
    was, attention_simd.PREFETCH_KEYS = attention_simd.PREFETCH_KEYS, 0
    try:
        run_plain()  # compiled here (a first call), with no prefetches
    finally:
        attention_simd.PREFETCH_KEYS = was
    same = all(np.array_equal(o, w) for o, w in zip(outs_plain, outs))
    print(f"unprefetched kernel: the same bits: {same}")
    ab("no prefetch (A) vs prefetch (B)", run_plain, run, rounds)


    def schedule(dynamic: bool):
        def f():
            previous = omp.set_dynamic(dynamic, from_team=1)  # claimed at every team
            try:
                run()
            finally:
                omp.set_dynamic(*previous)
        return f

    static, claimed = schedule(False), schedule(True)
    static()
    want = [o.copy() for o in outs]
    claimed()
    same = all(np.array_equal(o, w) for o, w in zip(outs, want))
    print(f"claimed runs: the same bits as static ones: {same}")
    ab("static (A) vs claimed (B)", static, claimed, rounds)

    huge_before = huge_page_bytes()
    huge = in_huge_pages(small)  # the same rows: both arms attend over the same values
    run_huge, outs_huge = token_attention(huge, q, gate, position)
    run_huge()
    same = all(np.array_equal(o, w) for o, w in zip(outs_huge, outs))
    granted = huge_page_bytes() - huge_before
    print(f"huge pages: {granted / 2**20:.0f} MiB granted to the mappings of the copies' "
          f"{sum(r.qs.nbytes + r.d.nbytes for kv in huge for r in kv) / 2**20:.0f} MiB; the "
          f"same bits as in 4 KB pages: {same}")
    ab("4 KB pages (A) vs huge pages (B)", run, run_huge, rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
