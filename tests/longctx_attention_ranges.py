"""Decode attention at long context against its key-range size and its prefetches (issue 31 item
3), one process: a token's attention over LAYERS full-size Q8_0 caches
(tests/longctx_attention_ab.py's) with ops/attention.py RANGE_KEYS as it is and with other sizes
(kernels compiled under labels of their own, ranges' scratch sized for them), then with the
default size and ops/attention_simd.py's prefetches into L1 (PREFETCH_TO 3) or twice as far
ahead (PREFETCH_KEYS 128), at THREADS and at 1 thread; medians of interleaved rounds, ns a
key-head of thread time. A range is decode's unit of work over the threads: at 16k keys and
256 keys a range, 16 threads take 8 ranges each, and the op's threads idled ~12 % of it on the GPU
machine's host (a thread that ran slower waits out a whole range at the end); shorter ranges cost
more partials to merge. Outputs are compared with the default size's (other bits: the ranges
are where the online softmax restarts).

Usage: python tests/longctx_attention_ranges.py [KEYS [THREADS [SIZES]]]  (16384, all, 128,64)"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, HERE)
import numba  # noqa: E402
import numpy as np  # noqa: E402

import longctx_attention_ab as ab  # noqa: E402
from fermijit.jit import cpu  # noqa: E402
from fermijit.jit.cpu import kernel  # noqa: E402
from fermijit.ops import attention, attention_simd, kv_quant  # noqa: E402


def ranged_kernel(keys: int, name: str):
    """The Q8_0 decode kernel of the process's ISA with RANGE_KEYS = keys, and its n_ranges,
    under labels of `name`'s."""
    n_ranges = kernel(attention.n_ranges.py_func, variant=f"r{keys}", RANGE_KEYS=keys)
    return (ab.labelled_kernel(f"q8_{cpu.selected_isa().label}-{name}", n_ranges=n_ranges,
                               RANGE_KEYS=keys), n_ranges)


def token_attention(layers, q, gate, position, keys: int, name: str):
    """A token's attention over the layers with ranges of `keys` (decode's steps: the queries
    rounded, then the kernel), and its outputs; the process's own kernel for name "default"."""
    if name == "default":
        return ab.token_attention(layers, q, gate, position)
    fn, n_ranges = ranged_kernel(keys, name)
    T, S = 1, layers[0][0].shape[1]
    R = n_ranges(S)
    f32 = np.float32
    scratch = (np.empty((R, T, ab.HQ, ab.D), f32), np.empty((R, T, ab.HQ), f32),
               np.empty((R, T, ab.HQ), f32))
    nb = ab.D // kv_quant.BLOCK
    rounded = (np.empty((T, ab.HQ, ab.D), np.int8), np.empty((T, ab.HQ, nb), f32),
               np.empty((T, ab.HQ, nb), np.int32))
    outs = [np.empty((1, ab.HQ, ab.D), f32) for _ in layers]

    def run():
        for (k, v), o in zip(layers, outs):
            attention._quantize_queries_one(q, *rounded, 0, T)
            fn(rounded, (k.qs, k.d), (v.qs, v.d), position, *scratch, gate, o)

    return run, outs


def main(argv: list[str]) -> None:
    n_keys, threads, rng, q, gate, position = ab.token_inputs(argv)
    sizes = [int(x) for x in argv[2].split(",")] if len(argv) > 2 else [128, 64]
    layers = ab.caches(n_keys, rng)
    default = attention.RANGE_KEYS
    plan = ([("default", default, {})] + [(f"r{k}", k, {}) for k in sizes]
            + [("l1", default, {"PREFETCH_TO": 3}), ("ahead128", default, {"PREFETCH_KEYS": 128})])
    arms = {}
    for name, keys, settings in plan:
        run, outs = token_attention(layers, q, gate, position, keys, name)
        was = {k: getattr(attention_simd, k) for k in settings}
        for k, v in settings.items():
            setattr(attention_simd, k, v)
        try:
            run()  # compiled here, with the settings
        finally:
            for k, v in was.items():
                setattr(attention_simd, k, v)
        arms[f"{name} ({keys} keys{''.join(f', {k} {v}' for k, v in settings.items())})"] = (
            run, outs)
    base = next(iter(arms.values()))[1]
    for name, (_, outs) in arms.items():
        worst = max(float(np.max(np.abs(o - b)) / np.max(np.abs(b))) for o, b in zip(outs, base))
        print(f"{name}: largest difference from the default's {worst:.2e} of the largest output")
    key_heads = ab.LAYERS * ab.HKV * n_keys
    print(f"decode attention by key range: {n_keys} keys, {ab.LAYERS} layers, isa "
          f"{cpu.selected_isa().label}; medians of 7 interleaved rounds, ns a key-head of thread "
          "time", flush=True)
    for n in sorted({threads, 1}, reverse=True):
        numba.set_num_threads(n)
        times = ab.interleaved_medians({name: run for name, (run, _) in arms.items()})
        for name, t in times.items():
            print(f"  {n:2d} threads, {name:<40} {1e3 * t:7.3f} ms "
                  f"{1e9 * t * n / key_heads:7.1f} ns", flush=True)
    numba.set_num_threads(threads)


if __name__ == "__main__":
    main(sys.argv[1:])
