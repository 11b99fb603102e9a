"""`python -m fermijit bench llama-cpp`: fermijit and llama.cpp on the same weights and cores, side
by side.

Each round runs, at each thread count, one fresh `python -m fermijit bench decode` process and
one fresh `llama-bench` process (`-p P -n N -r 1`: prefill of P tokens, then N generated tokens;
llama-bench's own warm-up run first, fermijit's warm-up likewise), in alternating order from round
to round so that neither always runs on the warmer or quieter machine. The GGUF is the fermijit
model's own export (`fermijit export`, model/gguf_export.py): the same quantised bytes per token.
Reported: each engine's median decode and prefill tok/s per thread count, the ratio of the
medians, and the median of the per-round ratios (the pairs ran minutes apart at most); fermijit's
decode against the read ceiling (paired windows, as `bench decode` measures it).

llama-bench generates from an empty context (its depth 0), fermijit after its P-token prompt:
at P = 512 the attention over the cache is ~1 % of a full-size token's bytes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError

ENGINES = ("fermijit", "llama.cpp")


def _progress(what: str) -> None:
    print(f"bench llama-cpp: {what}", file=sys.stderr, flush=True)


def fermijit_command(model_dir: Path, threads: int, n_prompt: int, n_tokens: int,
                     extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "fermijit", *extra, "bench", "decode", "--model",
            str(model_dir), "--threads", str(threads), "--prompt-tokens", str(n_prompt),
            "--tokens", str(n_tokens), "--json"]


def llama_command(llama_bench: Path, gguf: Path, threads: int, n_prompt: int,
                  n_tokens: int) -> list[str]:
    return [str(llama_bench), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
            "-n", str(n_tokens), "-r", "1", "-o", "json"]


def _run(command: list[str], timeout_s: float, env=None) -> str:
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise FermijitError(f"{command[0]} ran past {timeout_s:.0f} s") from None
    except OSError as e:
        raise FermijitError(f"cannot run {command[0]}: {e.strerror}") from None
    if r.returncode != 0:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        raise FermijitError(f"{Path(command[0]).name} failed (rc {r.returncode}): {tail}")
    return r.stdout


def parse_llama(stdout: str, n_prompt: int, n_tokens: int) -> dict:
    """llama-bench's JSON: its prefill (pp) and generation (tg) tests' mean tok/s."""
    try:
        tests = json.loads(stdout)
        pp = next(t for t in tests if t["n_prompt"] == n_prompt and t["n_gen"] == 0)
        tg = next(t for t in tests if t["n_gen"] == n_tokens and t["n_prompt"] == 0)
        return {"prefill_tok_s": float(pp["avg_ts"]), "decode_tok_s": float(tg["avg_ts"]),
                "build": f"{tests[0].get('build_commit', '?')} ({tests[0].get('cpu_info', '')})"}
    except (ValueError, KeyError, StopIteration, TypeError, IndexError):
        raise FermijitError(f"llama-bench printed no pp{n_prompt} and tg{n_tokens} results in "
                            f"JSON: {stdout[:200]!r}") from None


def parse_fermijit(stdout: str) -> dict:
    try:
        r = json.loads(stdout)
        return {k: float(r[k]) for k in ("decode_tok_s", "prefill_tok_s", "of_ceiling",
                                          "of_ceiling_paired", "read_gbs")}
    except (ValueError, KeyError, TypeError):
        raise FermijitError(f"fermijit bench decode printed no report: {stdout[:200]!r}") from None


def run(model_dir: Path, gguf: Path, llama_bench: Path, thread_counts: tuple[int, ...],
        rounds: int, n_prompt: int, n_tokens: int, as_json: bool,
        fermijit_flags: tuple[str, ...] = (), timeout_s: float = 900.0) -> dict:
    """Interleaved rounds of both engines at each thread count; the report (also printed)."""
    if not Path(model_dir).is_dir():
        raise FermijitError(f"no such model directory: {model_dir}")
    if not Path(gguf).is_file():
        raise FermijitError(f"no such GGUF file: {gguf} (write one: fermijit export MODEL FILE)")
    found = shutil.which(str(llama_bench))
    if found is None:
        raise FermijitError(f"no llama-bench at {llama_bench}")
    from fermijit.jit import cpu

    env = cpu.child_env()
    runs = []
    for r in range(rounds):
        for threads in thread_counts:
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            for engine in order:
                _progress(f"round {r + 1}/{rounds}, {threads} threads, {engine}")
                start = time.perf_counter()
                if engine == "fermijit":
                    result = parse_fermijit(_run(fermijit_command(
                        model_dir, threads, n_prompt, n_tokens, fermijit_flags), timeout_s, env))
                else:
                    result = parse_llama(_run(llama_command(
                        Path(found), gguf, threads, n_prompt, n_tokens), timeout_s), n_prompt,
                        n_tokens)
                runs.append({"round": r, "threads": threads, "engine": engine,
                             "wall_s": time.perf_counter() - start, **result})
    report = {"model": str(model_dir), "gguf": str(gguf), "llama_bench": found,
              "prompt_tokens": n_prompt, "decode_tokens": n_tokens, "rounds": rounds,
              "fermijit_flags": list(fermijit_flags), "runs": runs,
              "summary": summarise(runs, thread_counts)}
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return report


def summarise(runs: list[dict], thread_counts) -> list[dict]:
    """Per thread count: each engine's medians, their ratio, the median per-round ratio."""
    rows = []
    for threads in thread_counts:
        mine = [r for r in runs if r["threads"] == threads]
        by = {e: [r for r in mine if r["engine"] == e] for e in ENGINES}
        row = {"threads": threads}
        for what in ("decode_tok_s", "prefill_tok_s"):
            med = {e: float(np.median([r[what] for r in by[e]])) for e in ENGINES}
            paired = [f[what] / l[what] for f, l in zip(by["fermijit"], by["llama.cpp"])]
            row[what] = med
            row[what.replace("_tok_s", "_ratio")] = med["fermijit"] / med["llama.cpp"]
            row[what.replace("_tok_s", "_ratio_per_round")] = float(np.median(paired))
        row["fermijit_of_ceiling_paired"] = float(np.median(
            [r["of_ceiling_paired"] for r in by["fermijit"]]))
        rows.append(row)
    return rows


def format_report(r: dict) -> str:
    lines = [f"fermijit {r['model']} vs llama.cpp {r['gguf']} ({r['llama_bench']}), "
             f"{r['rounds']} rounds, prompt {r['prompt_tokens']}, {r['decode_tokens']} tokens "
             f"(medians; ratio: fermijit / llama.cpp)",
             f"{'threads':>7} {'decode fj':>10} {'llama':>8} {'ratio':>6} {'/round':>6} "
             f"{'fj ceil':>7} {'prefill fj':>10} {'llama':>8} {'ratio':>6} {'/round':>6}"]
    for s in r["summary"]:
        d, p = s["decode_tok_s"], s["prefill_tok_s"]
        lines.append(f"{s['threads']:>7} {d['fermijit']:10.2f} {d['llama.cpp']:8.2f} "
                     f"{s['decode_ratio']:6.2f} {s['decode_ratio_per_round']:6.2f} "
                     f"{100 * s['fermijit_of_ceiling_paired']:6.1f}% {p['fermijit']:10.2f} "
                     f"{p['llama.cpp']:8.2f} {s['prefill_ratio']:6.2f} "
                     f"{s['prefill_ratio_per_round']:6.2f}")
    return "\n".join(lines)
