"""`python -m fermijit bench longctx`: prefill and decode at long context: for each
prompt length (default 1k, 4k, 16k, 32k), the prompt's CPU prefill tok/s (and the GPU's, where
there is one), the decode tok/s after it, the KV cache's bytes and the process's memory; a table
and JSON.

One random prompt, prefilled on the CPU once: each length's prefill time is the cumulative time
of the passes up to it (the passes are PREFILL_BLOCK tokens from position 0 whatever the prompt's
length, so this is the time of a prompt of that length). Decode at each length is held to decode
at DECODE_BASE positions (issue 31: 85 % of it at 16k), and the two are measured in paired
windows: a window of decode tokens at DECODE_BASE positions and one at the length, in turn
(A B B A ...), each state rewound before its window (its position and GDN states put back: the
window decodes the same positions, the same bits, again), for --pairs pairs. The figure is the
median of the pairs' ratios, shown with their spread: measured minutes apart, the two rates
varied more than the ratio sought (bench/decode.py, paired windows). The GPU prefill, asked for
with --gpu, runs each length as a prompt of its own (kernels warm, best of GPU_REPEATS).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError

LENGTHS = (1024, 4096, 16384, 32768)
DECODE_BASE = 64       # positions of the short-context decode rate the long ones are held to
PAIRS = 5              # windows at each length, each paired with one at DECODE_BASE (as --pairs)
FIRST_TOKEN = 1        # every window decodes greedily from this token
PROFILE_TOKENS = 3     # profiled tokens at the base and at each length (the fastest shown)
GPU_REPEATS = 2


def _progress(what: str) -> None:
    print(f"bench longctx: {what}", file=sys.stderr, flush=True)


class Rewound:
    """A state and the way back to where it is now: its position and its GDN states (the
    recurrent state and conv window, which decode overwrites). KV rows past the position are never
    read, and decode writes them again."""

    def __init__(self, state):
        from fermijit.model.state import GdnState

        self.state, self.position = state, state.position
        self.saved = [(a, a.copy()) for s in state.layers if isinstance(s, GdnState)
                      for a in s.arrays]

    def rewind(self):
        """The state as it was made (returned)."""
        self.state.position = self.position
        for array, kept in self.saved:
            array[...] = kept
        return self.state

    def warmed(self, model):
        """The state rewound after one token decoded from it, untimed: decode makes its plan
        again for another state, and finds the caches holding the other's rows."""
        model.decode(FIRST_TOKEN, self.rewind())
        return self.rewind()


def paired_decode(model, base: Rewound, at_length: Rewound, n_tokens: int,
                  n_pairs: int) -> dict:
    """Decode `n_tokens` tokens at `base` and at `at_length` in turn, `n_pairs` windows each,
    every window from its state as it was made (both are left so), after a token untimed: each
    window's tok/s (all its tokens over their time), the pairs' ratios (at_length's of base's)
    and their median."""
    from fermijit.bench.decode import alternate, decode_tokens, pair_ratios

    def window(rewound: Rewound) -> float:
        times, _ = decode_tokens(model, rewound.warmed(model), FIRST_TOKEN, n_tokens)
        return n_tokens / sum(times)

    pairs = alternate(range(n_pairs), lambda _: window(base), lambda _: window(at_length),
                      swap=True)
    base.rewind()
    at_length.rewind()
    ratios = pair_ratios(pairs)
    return {"base_tok_s": [a for a, _ in pairs], "tok_s": [b for _, b in pairs],
            "ratios": ratios, "ratio": float(np.median(ratios))}


def profiled(model, base: Rewound, at_length: Rewound) -> dict:
    """Where a token at the length spends more than at the base: a token profiled op by op
    (bench/profile.py; decode's steps one by one, forward.JOIN_STEPS off meanwhile, so attention
    is an op of its own) at each, PROFILE_TOKENS in turn, the fastest of each. {op: {"base",
    "length": ms, "idle": ms threads idle in its parallel regions at the length}}, the token
    last, ops by their growth."""
    from fermijit.bench import profile as profiler
    from fermijit.model import forward

    fastest: list = [None, None]
    joined, forward.JOIN_STEPS = forward.JOIN_STEPS, False
    try:
        for _ in range(PROFILE_TOKENS):
            for i, rewound in enumerate((base, at_length)):
                rows = profiler.profile_token(model, FIRST_TOKEN, rewound.warmed(model))
                if fastest[i] is None or rows[-1]["ms"] < fastest[i][-1]["ms"]:
                    fastest[i] = rows
    finally:
        forward.JOIN_STEPS = joined
        base.rewind()
        at_length.rewind()
    by_op = [{r["op"]: r for r in rows} for rows in fastest]
    out = {op: {"base": by_op[0][op]["ms"] if op in by_op[0] else 0.0,
                "length": r["ms"], "idle": r.get("split", {}).get("idle", 0.0)}
           for op, r in by_op[1].items()}
    token = out.pop("token")
    return dict(sorted(out.items(), key=lambda kv: kv[1]["base"] - kv[1]["length"])) | {
        "token": token}


def run(model_dir: Path | None, synthetic: str | None, lengths: tuple[int, ...],
        n_decode: int, use_gpu: bool, threads: int | None, as_json: bool, kv=None,
        out=None, err=None, n_pairs: int = PAIRS) -> dict:
    """`n_decode`: decode tokens a window; `n_pairs`: windows at each length (and as many at
    DECODE_BASE positions, paired with them)."""
    from fermijit.bench import prefill as bench_prefill
    from fermijit.bench.decode import memory_now
    from fermijit.engine import warm_up
    from fermijit.jit import cpu
    from fermijit.model.forward import PREFILL_BLOCK

    out, err = out or sys.stdout, err or sys.stderr
    n_threads = cpu.configure_threads(threads)
    lengths = tuple(sorted(set(lengths)))
    if not lengths or lengths[0] < 1:
        raise FermijitError(f"--lengths must be positive prompt lengths, got {list(lengths)}")
    if n_decode < 1 or n_pairs < 1:
        raise FermijitError(f"--decode-tokens and --pairs must be at least 1, got {n_decode} "
                            f"and {n_pairs}")
    model = bench_prefill.load(model_dir, synthetic, err, kv)
    if lengths[-1] + n_decode > model.max_context:
        raise FermijitError(f"a prompt of {lengths[-1]} plus {n_decode} tokens exceeds the "
                            f"model's context of {model.max_context}")
    gpu_pf = None
    if use_gpu:
        from fermijit.prefill import hybrid

        gpu_pf = hybrid.GpuPrefiller(model, err=err)
        if not gpu_pf.prepare():
            raise FermijitError(f"the GPU prefill could not start: {gpu_pf.broken}")
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, lengths[-1]).astype(np.int32)
    _progress("warming up")
    warm_up(model, tokens, min(PREFILL_BLOCK, lengths[-1]))
    report = {"model": str(model_dir or synthetic), "kv_cache": model.kv_kind.value,
              "isa": cpu.selected_isa().label, "threads": n_threads, "decode_tokens": n_decode,
              "pairs": n_pairs, "rows": []}

    base = min(DECODE_BASE, lengths[0])
    base_state = model.new_state(base + n_decode)
    model.prefill(tokens[:base], base_state)
    at_base = Rewound(base_state)
    state = model.new_state(lengths[-1] + n_decode)
    prefill_s, base_rates = 0.0, []
    for n in lengths:
        _progress(f"CPU prefill to {n} tokens")
        start = time.perf_counter()
        model.prefill(tokens[state.position:n], state)
        prefill_s += time.perf_counter() - start
        _progress(f"decode at {n} and {base} positions, {n_pairs} pairs of {n_decode} tokens")
        at_length = Rewound(state)
        paired = paired_decode(model, at_base, at_length, n_decode, n_pairs)
        _progress(f"profiles of {PROFILE_TOKENS} tokens at {n} and {base} positions")
        ops = profiled(model, at_base, at_length)
        base_rates += paired["base_tok_s"]
        row = {"tokens": n, "cpu_prefill_s": prefill_s, "cpu_prefill_tok_s": n / prefill_s,
               "decode_tok_s": float(np.median(paired["tok_s"])),
               "base_tok_s": float(np.median(paired["base_tok_s"])),
               "decode_of_base": paired["ratio"], "paired": paired, "profile_ms": ops,
               "kv_nbytes": n * state.position_nbytes, "rss": memory_now()["rss"]}
        if gpu_pf is not None:
            _progress(f"GPU prefill of {n} tokens")
            times = []
            for _ in range(GPU_REPEATS):
                gpu_state = model.new_state(n)
                start = time.perf_counter()
                gpu_pf.run(tokens[:n], gpu_state)
                times.append(time.perf_counter() - start)
                del gpu_state
            row |= {"gpu_prefill_s": min(times), "gpu_prefill_tok_s": n / min(times)}
        report["rows"].append(row)
        _progress(f"{n} tokens: CPU prefill {row['cpu_prefill_tok_s']:.1f} tok/s"
                  + (f", GPU {row['gpu_prefill_tok_s']:.1f}" if gpu_pf is not None else "")
                  + f", decode {row['decode_tok_s']:.2f} tok/s, "
                  f"{100 * row['decode_of_base']:.1f} % of {base} positions (median of pairs "
                  + ", ".join(f"{100 * x:.1f}" for x in paired["ratios"]) + ")")
    report["decode_base"] = {"positions": base, "tok_s": float(np.median(base_rates))}
    report["peak_rss"] = memory_now()["peak"]
    first = report["rows"][0]
    for row in report["rows"]:
        row["cpu_prefill_of_first"] = row["cpu_prefill_tok_s"] / first["cpu_prefill_tok_s"]
    print(json.dumps(report, indent=2) if as_json else format_report(report), file=out)
    return report


def format_report(r: dict) -> str:
    mib = 2 ** 20
    has_gpu = any("gpu_prefill_tok_s" in row for row in r["rows"])
    base = r["decode_base"]
    lines = [f"model {r['model']}, KV cache {r['kv_cache']}, isa {r['isa']}, "
             f"{r['threads']} threads; decode at {base['positions']} positions "
             f"{base['tok_s']:.2f} tok/s (median of its windows); decode in {r['pairs']} pairs "
             f"of windows of {r['decode_tokens']} tokens, at {base['positions']} positions and "
             f"at the length",
             f"{'tokens':>8} {'cpu prefill tok/s':>18} {'of first':>9}"
             + (f" {'gpu prefill tok/s':>18}" if has_gpu else "")
             + f" {'decode tok/s':>13} {'of base':>8} {'pairs min-max':>14} {'KV MiB':>9} "
             f"{'RSS MiB':>9}"]
    for row in r["rows"]:
        ratios = row["paired"]["ratios"]
        lines.append(f"{row['tokens']:8d} {row['cpu_prefill_tok_s']:18.2f} "
                     f"{100 * row['cpu_prefill_of_first']:8.1f}%"
                     + (f" {row.get('gpu_prefill_tok_s', float('nan')):18.1f}" if has_gpu else "")
                     + f" {row['decode_tok_s']:13.2f} {100 * row['decode_of_base']:7.1f}%"
                     f" {100 * min(ratios):6.1f}-{100 * max(ratios):5.1f}%"
                     f" {row['kv_nbytes'] / mib:9.1f} {row['rss'] / mib:9.0f}")
    lines.append(f"peak RSS {r['peak_rss'] / mib:.0f} MiB; 'of base': the median of the pairs' "
                 f"ratios, decode at the length of decode at {base['positions']} positions")
    for row in r["rows"]:
        lines.append(format_growth(row["profile_ms"], base["positions"], row["tokens"]))
    return "\n".join(lines)


GROWTH_ROWS = 6  # ops shown, those that grew most


def format_growth(ops: dict, base: int, n: int) -> str:
    """`profiled`'s ops that grew most from the base to the length, and the token."""
    lines = [f"a token at {n} positions against {base}, op by op (ms; the fastest of "
             f"{PROFILE_TOKENS} profiled tokens each, steps one by one; idle: threads waiting in "
             f"the op's parallel regions at {n})",
             f"{'op':<40} {'at ' + str(base):>9} {'at ' + str(n):>9} {'extra':>8} {'idle':>7}"]
    shown = [op for op in ops if op != "token"][:GROWTH_ROWS] + ["token"]
    for op in shown:
        o = ops[op]
        lines.append(f"{op[:40]:<40} {o['base']:9.2f} {o['length']:9.2f} "
                     f"{o['length'] - o['base']:+8.2f} {o['idle']:7.2f}")
    return "\n".join(lines)
