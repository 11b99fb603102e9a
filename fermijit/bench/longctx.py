"""`python -m fermijit bench longctx`: prefill and decode at long context: for each
prompt length (default 1k, 4k, 16k, 32k), the prompt's CPU prefill tok/s (and the GPU's, where
there is one), the decode tok/s after it, the KV cache's bytes and the process's memory; a table
and JSON.

One random prompt, prefilled on the CPU once: each length's prefill time is the cumulative time
of the passes up to it (the passes are PREFILL_BLOCK tokens from position 0 whatever the prompt's
length, so this is the time of a prompt of that length), and its decode runs on a copy of the
state there. Decode is also timed at DECODE_BASE positions in the same run: decode at 16k is
to keep 85 % of that rate, so both are measured under the same load. The GPU prefill,
asked for with --gpu, runs each length as a prompt of its own (kernels warm, best of GPU_REPEATS).
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
DECODE_TOKENS = 16     # decode tokens timed per length (their median)
GPU_REPEATS = 2


def _progress(what: str) -> None:
    print(f"bench longctx: {what}", file=sys.stderr, flush=True)


def _decode_tok_s(model, state, n_tokens: int) -> float:
    """Decode n_tokens greedy tokens from a copy of `state`: tokens per second of the median."""
    state = state.copy(state.position + n_tokens + 1)
    token, times = 1, []
    for _ in range(n_tokens):
        start = time.perf_counter()
        token = int(np.argmax(model.decode(token, state)))
        times.append(time.perf_counter() - start)
    return 1 / float(np.median(times))


def run(model_dir: Path | None, synthetic: str | None, lengths: tuple[int, ...],
        n_decode: int, use_gpu: bool, threads: int | None, as_json: bool, kv=None,
        out=None, err=None) -> dict:
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
    model = bench_prefill.load(model_dir, synthetic, err, kv)
    if lengths[-1] + n_decode + 1 > model.max_context:
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
              "rows": []}

    state = model.new_state(lengths[-1] + n_decode + 1)
    base = min(DECODE_BASE, lengths[0])
    model.prefill(tokens[:base], state)
    _progress(f"decode at {base} positions")
    report["decode_base"] = {"positions": base,
                             "tok_s": _decode_tok_s(model, state, n_decode)}
    # The cumulative prefill from position 0 again, timed: the base state was only for decode.
    state = model.new_state(lengths[-1] + n_decode + 1)
    prefill_s = 0.0
    for n in lengths:
        _progress(f"CPU prefill to {n} tokens")
        start = time.perf_counter()
        model.prefill(tokens[state.position:n], state)
        prefill_s += time.perf_counter() - start
        _progress(f"decode at {n} positions")
        decode = _decode_tok_s(model, state, n_decode)
        row = {"tokens": n, "cpu_prefill_s": prefill_s, "cpu_prefill_tok_s": n / prefill_s,
               "decode_tok_s": decode,
               "decode_of_base": decode / report["decode_base"]["tok_s"],
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
                  + f", decode {decode:.2f} tok/s ({100 * row['decode_of_base']:.1f} % of "
                  f"{base} positions)")
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
             f"{base['tok_s']:.2f} tok/s",
             f"{'tokens':>8} {'cpu prefill tok/s':>18} {'of first':>9}"
             + (f" {'gpu prefill tok/s':>18}" if has_gpu else "")
             + f" {'decode tok/s':>13} {'of base':>8} {'KV MiB':>9} {'RSS MiB':>9}"]
    for row in r["rows"]:
        lines.append(f"{row['tokens']:8d} {row['cpu_prefill_tok_s']:18.2f} "
                     f"{100 * row['cpu_prefill_of_first']:8.1f}%"
                     + (f" {row.get('gpu_prefill_tok_s', float('nan')):18.1f}" if has_gpu else "")
                     + f" {row['decode_tok_s']:13.2f} {100 * row['decode_of_base']:7.1f}%"
                     f" {row['kv_nbytes'] / mib:9.1f} {row['rss'] / mib:9.0f}")
    lines.append(f"peak RSS {r['peak_rss'] / mib:.0f} MiB")
    return "\n".join(lines)
