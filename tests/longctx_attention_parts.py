"""Decode attention at long context in its parts (issue 31 item 3), one process: a token's
attention over LAYERS full-size Q8_0 caches (tests/longctx_attention_ab.py's), the kernel as it
is against its merge of the key ranges' partials (its second fork) as it was before session 33
(`combine_head_as_was`: every range's running maximum and sum stored, into one line for all
heads; MERGE_FLOATS 32768: 8 threads at 16k), the merge as it is on those 8 threads, and
without a merge (outputs wrong: timing only), at THREADS, half of them and 1 thread; then the
merge alone on partials in cache, as it is and as it was. Medians of 7 interleaved rounds. First the host's CPU
topology (/sys). On the GPU machine's host (16 threads, 16k keys, before session 33's change to
the stores) the kernel took 5.35 ms a token, without its merge 4.46 (8 threads 8.08 / 7.14,
1 thread 69.4 / 68.6); the partials prefetched 4 ranges ahead and the merge on 16 threads 5.18
against 5.51 as it was, 4.43 without (the prefetch alone 5.62: left out).

Usage: python tests/longctx_attention_parts.py [KEYS [THREADS]]  (16384, all)"""
from __future__ import annotations

import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, HERE)
import numba  # noqa: E402
import numpy as np  # noqa: E402

import longctx_attention_ab as ab  # noqa: E402
from fermijit.jit import cpu, omp  # noqa: E402
from fermijit.jit.cpu import bind, kernel  # noqa: E402
from fermijit.ops import attention  # noqa: E402


def topology() -> str:
    """CPUs, their hyperthread siblings and cores as /sys tells them."""
    def read(path):
        try:
            return open(path).read().strip()
        except OSError:
            return "?"
    cpus = sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda p: int(p[27:]))
    siblings = {read(f"{c}/topology/thread_siblings_list") for c in cpus}
    cores = {(read(f"{c}/topology/physical_package_id"), read(f"{c}/topology/core_id"))
             for c in cpus}
    mhz = [line.split(":")[1].strip() for line in open("/proc/cpuinfo") if "MHz" in line]
    return (f"{len(cpus)} CPUs, {len(cores)} cores, sibling sets {sorted(siblings)[:4]}..., "
            f"MHz {mhz[:4]}")


def _no_merge(thread, n_threads, args):
    """A merge share that merges nothing."""


@kernel(fastmath=False)
def combine_head_as_was(acc, m, l, start, gate, o, th):
    """attention.combine_head before session 33."""
    Hq = o.shape[1]
    t, h = th // Hq, th % Hq
    for s in range(1, attention.n_ranges(start + t + 1)):
        m[0, t, h], l[0, t, h] = attention._merge_row(
            acc[0, t, h], m[0, t, h], l[0, t, h], acc[s, t, h], m[s, t, h], l[s, t, h])
    attention._finish_row(acc[0, t, h], l[0, t, h], gate[t, h], o[t, h])


def merge_variant(name: str, combine, merge_floats=None):
    """ab.labelled_kernel's kernel with the merge share `combine` (and MERGE_FLOATS)."""
    return ab.labelled_kernel(f"q8_{cpu.selected_isa().label}-{name}", combine=combine,
                              merge_floats=merge_floats)


def _merges(acc, m, l, start, gate, o, reps, cap):
    for _ in range(reps):
        fork_combine(cap, (acc, m, l, start, gate, o))  # noqa: F821 (forking_kernel's)


def merge_alone(name: str, combine):
    """A kernel running the merge fork `reps` times over the same partials."""
    return omp.forking_kernel(bind(_merges, name), fork_combine=combine,
                              capped=("fork_combine",))()


def main(argv: list[str]) -> None:
    print(topology(), flush=True)
    n_keys, threads, rng, q, gate, position = ab.token_inputs(argv)
    layers = ab.caches(n_keys, rng)
    was = bind(attention._combine_share, "as-was", combine_head=combine_head_as_was)
    arms = {"kernel": ab.token_attention(layers, q, gate, position)[0],
            "merge as was": ab.token_attention(layers, q, gate, position,
                                               merge_variant("was", was, 32768))[0],
            "merge, 8 thr": ab.token_attention(layers, q, gate, position, merge_variant(
                "m8", attention._combine_share, 32768))[0],
            "no merge": ab.token_attention(layers, q, gate, position,
                                           merge_variant("nomerge", _no_merge))[0]}
    for run in arms.values():
        run()
    key_heads = ab.LAYERS * ab.HKV * n_keys
    print(f"decode attention in parts: {n_keys} keys, {ab.LAYERS} layers, isa "
          f"{cpu.selected_isa().label}; medians of 7 interleaved rounds", flush=True)
    for n in sorted({threads, max(1, threads // 2), 1}, reverse=True):
        numba.set_num_threads(n)
        for name, t in ab.interleaved_medians(arms).items():
            print(f"  {n:2d} threads, {name:<14} {1e3 * t:7.3f} ms {1e9 * t * n / key_heads:7.1f} "
                  "ns", flush=True)
    # The merge alone: one token's partials of 16 heads (in cache, written by this thread)
    R = attention.n_ranges(n_keys + 1)
    acc = rng.standard_normal((R, 1, ab.HQ, ab.D)).astype(np.float32)
    m = rng.standard_normal((R, 1, ab.HQ)).astype(np.float32)
    l = rng.random((R, 1, ab.HQ)).astype(np.float32) + 1
    o = np.empty((1, ab.HQ, ab.D), np.float32)
    merges = {"merge": merge_alone("merge", attention._combine_share),
              "merge as was": merge_alone("merge-was", was)}
    print(f"the merge alone: {R} ranges of {ab.HQ} heads, a thread a head (at most)", flush=True)
    for n in sorted({threads, max(1, threads // 2), 1}, reverse=True):
        numba.set_num_threads(n)
        runs = {name: (lambda fn=fn, n=n: fn(acc, m, l, n_keys, gate, o, 20, n))
                for name, fn in merges.items()}
        for name, t in ab.interleaved_medians(runs, calls=5).items():
            print(f"  {n:2d} threads, {name:<14} {1e6 * t / 20:7.1f} us", flush=True)
    numba.set_num_threads(threads)


if __name__ == "__main__":
    main(sys.argv[1:])
