"""`python -m fermijit bench serve`: the server under load, through HTTP.

An in-process server (the scheduler and uvicorn on 127.0.0.1, as `serve` runs them, its prompts
prefilled by `--prefill cpu|gpu|auto`) gets, each a fresh prompt of random token ids (no cache
hits), `ignore_eos` so each generates exactly what it is asked:
  - time to first token of one prompt alone at each of `--ttft-lengths` (those that fit);
  - C streamed completions at once, for C in 1, 2, 4, 8: time to first token (mean and max over
    the streams: 8 prompts arriving together against one alone says whether they were prefilled
    together), the aggregate decode rate, sum(N - 1) / (last stream's end - last stream's first
    token) (all C decode together over that span), and the wall time;
  - the other streams during a long prefill: DURING_STREAMS streams decoding, then a prompt of
    `--long-prompt` tokens arrives; their chunk rate while it prefills (its arrival to its first
    token) against their rate over the same span before it arrived;
  - a chat's second turn, its time to first token with the snapshot prefix cache and without
    (the engine's cache switched off for that request), interleaved `repeat` times, medians;
  - this process's peak RSS (the model, the server and the client).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError

CONCURRENCY = (1, 2, 4, 8)
TTFT_LENGTHS = (1024, 4096, 16384)
DURING_STREAMS = 4
DURING_SLACK = 64  # context left free beside the long prompt
DURING_TOKENS = 4096  # at most, per decoding stream (the KV cache is allocated for them)
# The second turn's words: Python-docs prose, so the default model's tokenizer sees real text.
CHAT_TEXT = ("The with statement wraps a block in the methods of a context manager, so that a "
             "file opened at its start is closed at its end, even when an exception is raised. ")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _stream(client, body: dict) -> dict:
    """One streamed request: its times to first token and to the end, and its token counts."""
    start = time.perf_counter()
    first, usage = None, None
    async with client.stream("POST", "/v1/chat/completions" if "messages" in body
                             else "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise FermijitError(f"bench serve: HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise FermijitError(f"bench serve: {chunk['error']['message']}")
            if first is None and chunk["choices"] and (
                    chunk["choices"][0].get("text") or chunk["choices"][0].get("delta", {})
                    .get("content")):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"start": start, "first": first or end, "end": end, "usage": usage}


async def _round(client, prompts: list[list[int]], n_tokens: int) -> dict:
    runs = await asyncio.gather(*(_stream(client, {
        "prompt": p, "max_tokens": n_tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True}}) for p in prompts))
    start = min(r["start"] for r in runs)
    ttft = [r["first"] - r["start"] for r in runs]
    n_generated = sum(r["usage"]["completion_tokens"] for r in runs)
    decode_span = max(r["end"] for r in runs) - max(r["first"] for r in runs)
    return {"streams": len(prompts), "ttft_mean_s": statistics.mean(ttft),
            "ttft_max_s": max(ttft), "generated": n_generated,
            "decode_tok_per_s": (n_generated - len(runs)) / decode_span if decode_span else 0.0,
            "wall_s": max(r["end"] for r in runs) - start}


async def _ttft_alone(client, vocab: int, lengths, rng) -> list[dict]:
    rows = []
    for n in lengths:
        run = await _stream(client, {"prompt": rng.integers(0, vocab, n).tolist(),
                                     "max_tokens": 2, "temperature": 0, "stream": True,
                                     "ignore_eos": True, "stream_options": {"include_usage": True}})
        rows.append({"prompt_tokens": n, "ttft_s": run["first"] - run["start"]})
    return rows


async def _during_long_prefill(client, vocab: int, n_prompt: int, n_long: int, max_tokens: int,
                               rng) -> dict:
    """DURING_STREAMS streams decode; once each has streamed, a prompt of `n_long` tokens
    arrives. Their chunks per second from its arrival to its first token, against the same
    span's length just before it arrived."""
    stamps: list[float] = []

    async def decode_stream(first_chunk: asyncio.Event):
        body = {"prompt": rng.integers(0, vocab, n_prompt).tolist(), "temperature": 0,
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise FermijitError(f"bench serve: HTTP {r.status_code}: {await r.aread()}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
                    first_chunk.set()

    firsts = [asyncio.Event() for _ in range(DURING_STREAMS)]
    tasks = [asyncio.create_task(decode_stream(e)) for e in firsts]
    try:
        for e in firsts:  # a stream that failed ends the wait with its error
            waiting = asyncio.create_task(e.wait())
            await asyncio.wait([waiting, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                if t.done():
                    t.result()
        await asyncio.sleep(1.0)  # all decoding together
        long = await _stream(client, {"prompt": rng.integers(0, vocab, n_long).tolist(),
                                      "max_tokens": 1, "temperature": 0, "stream": True,
                                      "ignore_eos": True})
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    arrive, first = long["start"], long["first"]
    span = first - arrive
    during = sum(arrive <= t < first for t in stamps) / span
    before = sum(arrive - span <= t < arrive for t in stamps) / min(span, arrive - stamps[0])
    return {"streams": DURING_STREAMS, "long_prompt_tokens": n_long, "long_ttft_s": span,
            "chunks_per_s_before": before, "chunks_per_s_during": during,
            "during_over_before": during / before if before else float("nan")}


async def _second_turn(client, scheduler, n_chat_tokens: int, repeat: int, rng) -> dict:
    """Time to first token of a chat's second turn, with and without the cache (interleaved)."""
    tokenizer = scheduler.engine.tokenizer
    words = CHAT_TEXT.split()
    with_s, without_s, info = [], [], {}
    for _ in range(repeat):
        # A fresh first message each time (its words shuffled), about n_chat_tokens long.
        text = ""
        while tokenizer.encode(text).size < n_chat_tokens:
            text += " ".join(rng.permutation(words)) + ". "
        turn = [{"role": "user", "content": text}]
        first = await _stream(client, {"messages": turn, "max_tokens": 16, "temperature": 0,
                                       "stream": True, "stream_options": {"include_usage": True}})
        answer = await client.post("/v1/chat/completions", json={
            "messages": turn, "max_tokens": 16, "temperature": 0})
        turn = turn + [{"role": "assistant",
                        "content": answer.json()["choices"][0]["message"]["content"]},
                       {"role": "user", "content": "And how does that work for sockets?"}]
        body = {"messages": turn, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        cached = await _stream(client, body)
        cache, scheduler.engine.cache = scheduler.engine.cache, None  # idle: no request runs
        try:
            uncached = await _stream(client, body)
        finally:
            scheduler.engine.cache = cache
        with_s.append(cached["first"] - cached["start"])
        without_s.append(uncached["first"] - uncached["start"])
        info = {"first_turn_prompt_tokens": first["usage"]["prompt_tokens"],
                "prompt_tokens": cached["usage"]["prompt_tokens"],
                "cached_tokens": cached["usage"]["prompt_tokens_details"]["cached_tokens"]}
    return {**info, "ttft_cached_s": statistics.median(with_s),
            "ttft_uncached_s": statistics.median(without_s), "repeat": repeat}


def measure(model_dir: Path, n_prompt: int, n_tokens: int, n_chat_tokens: int,
            repeat: int, prefill: str = "auto", gpu_mem: str | None = None,
            pin_budget: str | None = None, ttft_lengths=TTFT_LENGTHS,
            n_long: int = 8192) -> dict:
    import httpx

    from fermijit.engine import Engine, peak_rss_bytes
    from fermijit.jit import cpu
    from fermijit.prefill import hybrid
    from fermijit.server.app import make_app
    from fermijit.server.run import ServerThread, warm_up
    from fermijit.server.scheduler import Scheduler

    _progress(f"loading {model_dir}")
    engine = Engine.load(Path(model_dir))
    max_batch = max(CONCURRENCY)
    engine.prefiller = hybrid.make(engine.model, prefill, gpu_mem, pin_budget)
    with hybrid.preparing(engine.prefiller):  # on a thread that ends, as serve's (run.py)
        cpu.on_a_passing_thread(lambda: warm_up(engine, max_batch))
    scheduler = Scheduler(engine, max_batch=max_batch, queue_size=4 * max_batch)
    scheduler.start()
    server = ServerThread(make_app(scheduler, model_dir.name))
    rng = np.random.default_rng(0)
    vocab = engine.model.vocab_size

    def prompts(n):
        return [rng.integers(0, vocab, n_prompt).tolist() for _ in range(n)]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as client:
            _progress("warm-up round")
            await _round(client, prompts(2), 2)
            rounds = []
            for c in CONCURRENCY:
                _progress(f"{c} concurrent streams")
                rounds.append(await _round(client, prompts(c), n_tokens))
            fits = [n for n in ttft_lengths if n + 2 <= engine.model.max_context]
            _progress(f"time to first token at {fits} prompt tokens")
            ttft = await _ttft_alone(client, vocab, fits, rng)
            during = None
            if n_long + DURING_SLACK <= engine.model.max_context:
                _progress(f"{DURING_STREAMS} streams decoding while a {n_long}-token prompt "
                          "prefills")
                during = await _during_long_prefill(
                    client, vocab, n_prompt, n_long,
                    min(engine.model.max_context - n_prompt - DURING_SLACK, DURING_TOKENS), rng)
            _progress("a chat's second turn, with and without the cache")
            second = await _second_turn(client, scheduler, n_chat_tokens, repeat, rng)
            return rounds, ttft, during, second

    try:
        rounds, ttft, during, second = asyncio.run(run())
    finally:
        server.stop()
        scheduler.stop()
    return {"model": str(model_dir), "prompt_tokens": n_prompt, "tokens_per_stream": n_tokens,
            "prefill": engine.prefiller.name, "rounds": rounds, "ttft_alone": ttft,
            "during_long_prefill": during, "second_turn": second,
            "prefilled_tokens": dict(engine.prefiller.n_prefilled),
            "peak_rss": peak_rss_bytes()}


def run(model_dir: Path | None, synthetic: str | None, n_prompt: int, n_tokens: int,
        n_chat_tokens: int, repeat: int, as_json: bool, **options) -> dict:
    """`options`: measure's prefill, gpu_mem, pin_budget, ttft_lengths, n_long."""
    from fermijit.jit import cpu

    if model_dir is not None:
        report = measure(Path(model_dir), n_prompt, n_tokens, n_chat_tokens, repeat, **options)
    else:
        from fermijit.model import synth

        with tempfile.TemporaryDirectory(prefix="fermijit-synth-") as tmp:
            _progress(f"building {synthetic} in {tmp}")
            written = synth.synth(synthetic, Path(tmp) / synthetic)
            report = measure(written.path, n_prompt, n_tokens, n_chat_tokens, repeat, **options)
    report["isa"], report["threads"] = cpu.selected_isa().label, cpu.configure_threads(None)
    print(json.dumps(report, indent=2) if as_json else table(report))
    return report


def table(r: dict) -> str:
    lines = [f"bench serve: {r['model']} ({r['isa']}, {r['threads']} threads, --prefill "
             f"{r['prefill']}): prompts of {r['prompt_tokens']} random tokens, "
             f"{r['tokens_per_stream']} generated per stream",
             f"{'streams':>7}  {'TTFT mean':>9}  {'TTFT max':>8}  {'decode tok/s':>12}  "
             f"{'per stream':>10}  {'wall s':>6}"]
    for x in r["rounds"]:
        lines.append(f"{x['streams']:>7}  {x['ttft_mean_s']:>8.3f}s  {x['ttft_max_s']:>7.3f}s  "
                     f"{x['decode_tok_per_s']:>12.1f}  "
                     f"{x['decode_tok_per_s'] / x['streams']:>10.1f}  {x['wall_s']:>6.2f}")
    one, eight = r["rounds"][0], r["rounds"][-1]
    lines.append(f"{eight['streams']} prompts arriving together: the last first token after "
                 f"{eight['ttft_max_s'] / one['ttft_mean_s']:.2f}x one prompt's")
    for x in r["ttft_alone"]:
        lines.append(f"time to first token, {x['prompt_tokens']:>6} prompt tokens alone: "
                     f"{x['ttft_s']:8.3f} s")
    d = r["during_long_prefill"]
    if d is not None:
        lines.append(f"{d['streams']} streams while a {d['long_prompt_tokens']}-token prompt "
                     f"prefills ({d['long_ttft_s']:.2f} s to its first token): "
                     f"{d['chunks_per_s_during']:.1f} chunks/s, before it "
                     f"{d['chunks_per_s_before']:.1f} ({d['during_over_before']:.2f}x)")
    lines.append(f"prompt tokens prefilled: {r['prefilled_tokens']}; peak RSS "
                 f"{r['peak_rss'] / 2**30:.2f} GiB")
    s = r["second_turn"]
    lines.append(f"chat second turn: {s['prompt_tokens']} prompt tokens, {s['cached_tokens']} "
                 f"from the cache (the first turn's prompt: {s['first_turn_prompt_tokens']}); "
                 f"time to first token {s['ttft_cached_s']:.3f} s with the cache, "
                 f"{s['ttft_uncached_s']:.3f} s without "
                 f"({s['ttft_uncached_s'] / s['ttft_cached_s']:.1f}x; median of {s['repeat']})")
    return "\n".join(lines)
