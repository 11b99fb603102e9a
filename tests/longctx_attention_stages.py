"""Decode attention at long context by stage (issue 31 item 3), one process: a token's attention
over LAYERS full-size Q8_0 caches (tests/longctx_attention_ab.py's), the kernel as it is and
with one stage left out each (outputs wrong: timing only): the keys' transposition (AVX-512 VNNI:
the block's buffers left as they were, so the keys are never read), the scores, the online
softmax, the weighted values; medians of 7 interleaved rounds, ns a key-head of thread time, and
each stage's share as the full kernel's time less the kernel without it. On the 2-core Zen 5,
16k keys, 1 thread: 59 ns a key-head; without the transposition 43 (the keys' first read from
memory is most of it: the transposition's instructions cut by a third gained 0.5-2 %), without
the scores 45, the softmax 49, the weighted values 36.

Usage: python tests/longctx_attention_stages.py [KEYS [THREADS]]  (16384, all)"""
from __future__ import annotations

import os
import sys

# Run as a script from tests/: that folder first on the path would shadow the package
# (tests/fermijit); longctx_attention_ab is imported from it by name.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, HERE)

import longctx_attention_ab as ab  # noqa: E402
from fermijit.jit import cpu  # noqa: E402
from fermijit.jit.cpu import Isa, kernel  # noqa: E402


@kernel
def _keys_stale(k, hkv, jb, n, buffers):
    return buffers


@kernel
def _scores_none(q, k, t, hkv, jb, n, p):
    pass


@kernel
def _softmax_none(p, n, a, m_t, l_t):
    pass


@kernel
def _weighted_none(p, v, v_rows, v0, hkv, jb, n, a, tile):
    pass


def main(argv: list[str]) -> None:
    n_keys, threads, rng, q, gate, position = ab.token_inputs(argv)
    layers = ab.caches(n_keys, rng)
    left_out = {"scores": dict(_scores=_scores_none),
                "softmax": dict(_online_softmax=_softmax_none),
                "weighted values": dict(_weighted=_weighted_none)}
    if cpu.selected_isa() is not Isa.SSSE3:  # the ISAs whose keys are transposed
        left_out["transposition"] = dict(_staged_keys=_keys_stale)
    runs = {"full": ab.token_attention(layers, q, gate, position)[0]}
    for name, over in left_out.items():
        label = "q8-stages-no-" + name.replace(" ", "-")
        runs["no " + name] = ab.token_attention(layers, q, gate, position,
                                                ab.labelled_kernel(label, **over))[0]
    times = ab.interleaved_medians(runs)
    key_heads = ab.LAYERS * ab.HKV * n_keys
    full = times["full"]
    print(f"decode attention by stage: {n_keys} keys, {ab.LAYERS} layers, {threads} threads, isa "
          f"{cpu.selected_isa().label}; medians of 7 rounds, ns a key-head of thread time")
    for name, t in times.items():
        print(f"  {name:<20} {1e3 * t:7.3f} ms {1e9 * t * threads / key_heads:7.1f} ns"
              + ("" if name == "full" else
                 f"   the stage ~{1e9 * (full - t) * threads / key_heads:5.1f} ns"))


if __name__ == "__main__":
    main(sys.argv[1:])
