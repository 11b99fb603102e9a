"""`python -m fermijit bench decode --speculative mtp`: speculative decoding with the model's MTP
head against plain greedy decoding, in one run.

Greedy text, both ways, from the same prompts (a text file's windows, or a built-in paragraph):
tok/s, the tokens per verify step and the acceptance, and a check that the texts are identical.
Then the costs of the parts, timed interleaved (ROUNDS rounds of CALLS calls each: this
machine is shared) on the last prompt's state: a decode token, a verify step of N+1 rows, a draft
(the head's row and N-1 chained ones); each part's best round in ms, and the verify step's and
the draft's ratios to a token as the medians of each round's ratio to that round's token. The
verify step is timed with its rollback to the first row (every draft rejected, as random weights
do; its share reported apart: an accepted draft skips it). Bytes are counted as bench decode counts them
(model/token_bytes.py): the weights a step reads, the routed experts those the routers chose
(watched on the steps timed), plus the GDN states' traffic (a token reads and writes them once,
as does a verify step of 2 rows, its last row left pending: ops/gdn_rows.py; one of R > 2 rows
reads them once and writes them R times: the saves, then the live state); per accepted token,
a step's bytes over its tokens. Verify bytes over a token's is the byte-bound ratio: what the
verify step would cost a token's time if both ran at the same read bandwidth (R rows of random
routing select E (1 - (1 - k/E)^R) distinct experts a layer on average: 15.5 of REAP-128's 128
for 2 rows, against a token's 8).

Projection at the acceptance users report (0.7-0.8, one draft): a step makes 1 + a tokens, so
    speedup = (1 + a) * t_decode / (t_verify + t_draft)
and, leaving the draft out as the speed-up target is stated (the verify step alone),
    speedup_verify = (1 + a) * t_decode / t_verify.
Random weights (a synthetic model) accept nothing: there, the step costs and the projection are
the measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError

ROUNDS = 7          # interleaved timing rounds; the best counts
SPLIT_ROUNDS = 3    # more of them, each step of the plans timed apart (Costs.split)
CALLS = 5           # calls of each part per round
ACCEPTANCE = (0.7, 0.8)  # what users report for Qwen3.6's head (issue 32)
PROMPT_TEXT = (
    "To read a file in Python, open it with the built-in open() function, which returns a file "
    "object. The with statement closes the file when the block ends, even if an exception is "
    "raised. Reading the whole file at once uses read(); iterating over the file object yields "
    "one line at a time, which keeps memory small for large files. ")


def prompts(model_dir: Path, model, text: Path | None, n_prompts: int, n_tokens: int):
    """`n_prompts` prompts of `n_tokens` tokens: windows spread over `text`, or the built-in
    paragraph repeated (random ids where the model has no tokenizer)."""
    from fermijit.evaluate import read_text
    from fermijit.model.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer(model_dir)
    except FermijitError:
        tokenizer = None
    if text is not None and tokenizer is None:
        raise FermijitError(f"--text needs the model's tokenizer ({model_dir} has none)")
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, model.vocab_size, n_tokens).astype(np.int32)
                for _ in range(n_prompts)]
    ids = tokenizer.encode(read_text(text) if text is not None else PROMPT_TEXT * 64)
    if ids.size < n_tokens:
        ids = np.resize(ids, n_tokens)
    starts = np.linspace(0, ids.size - n_tokens, n_prompts).astype(int)
    return [ids[s:s + n_tokens].astype(np.int32) for s in starts]


def _generate(model, prompt, n_tokens, drafts):
    """Greedy tokens after `prompt`, plainly (drafts None) or speculatively: (tokens, the
    engine's Stats)."""
    from fermijit import engine

    context = prompt.size + n_tokens + 1
    return engine.generate(model, prompt, _greedy(model), n_tokens, context, frozenset(),
                           lambda t: None, drafts=drafts)


@dataclasses.dataclass
class Costs:
    decode_ms: float
    verify_ms: float
    draft_ms: float
    decode_bytes: int
    verify_bytes: int
    draft_bytes: int
    rollback_ms: float = float("nan")  # of verify_ms: the rollback to its first row
    experts: tuple = (0.0, 0.0)        # distinct routed experts a layer: a token, a verify step
    # Each round's verify and draft time over the same round's decode time (the parts run one
    # after another): the ratios taken within a round, so the machine's bandwidth drifting
    # between rounds cancels (the best rounds of each part apart could come from different
    # phases: ratios 0.93-1.71x in one session, issue 32).
    verify_ratios: list = dataclasses.field(default_factory=list)
    draft_ratios: list = dataclasses.field(default_factory=list)
    # Per step, by its plan's labels (model/forward.py, model/batch.py: a kernel's calls, the
    # rollback): ms in decode and in verify, the best of SPLIT_ROUNDS rounds of CALLS each.
    split: dict = dataclasses.field(default_factory=dict)


def step_costs(model, prompt, drafts) -> Costs:
    """The parts of a step on `prompt`'s state, timed interleaved, and the bytes they read."""
    from fermijit.model import batch
    from fermijit.bench.decode import gdn_state_nbytes
    from fermijit.model.token_bytes import token_bytes
    from fermijit.speculative import Speculator

    n_draft = drafts.n
    rows = n_draft + 1
    plain = model.new_state(prompt.size + 2)
    token = int(np.argmax(model.prefill(prompt, plain)))
    state = model.new_state(prompt.size + rows + n_draft + 2, mtp=True)
    model.prefill(prompt, state)
    ws, saves = batch.BatchWorkspace(model, rows), batch.GdnSaves(model, rows)
    speculator = Speculator(model, _greedy(model), drafts)
    waiting = state.hidden.copy()
    proposed = [token] * n_draft

    def decode():
        model.decode(token, plain)
        plain.position -= 1

    rolled = [0.0]  # the rollbacks' seconds, in the round being timed

    def verify():
        batch.decode_rows(model, [token] + proposed, [state] * rows, ws, [saves] * rows)
        start = time.perf_counter()
        batch.rollback(model, state, saves, rows, 1)
        rolled[0] += time.perf_counter() - start
        state.position -= 1
        state.hidden = waiting.copy()

    def draft():
        nonlocal proposed
        proposed, _ = speculator.draft(state, token, n_draft)
        state.hidden = waiting.copy()

    parts = {"decode": decode, "verify": verify, "draft": draft}
    best = dict.fromkeys(parts, float("inf"))
    for f in parts.values():
        f()
    rollback = float("inf")  # in the verify step's best round
    rounds = {name: [] for name in parts}
    for _ in range(ROUNDS):
        for name, f in parts.items():
            rolled[0] = 0.0
            start = time.perf_counter()
            for _ in range(CALLS):
                f()
            took = (time.perf_counter() - start) / CALLS
            if took < best[name] and name == "verify":
                rollback = rolled[0] / CALLS
            best[name] = min(best[name], took)
            rounds[name].append(took)
    split = _split({"decode": decode, "verify": verify}, rolled)
    selected = {}

    def watched(part):
        seen = []
        model.moe_observer = lambda w, xn, ids, weights: seen.append(
            (id(w), int(np.unique(ids).size)))
        try:
            parts[part]()
        finally:
            model.moe_observer = None
        return seen

    for part in parts:
        selected[part] = watched(part)
    tb = token_bytes(model, [n for _, n in selected["decode"]])
    tv = token_bytes(model, [n for _, n in selected["verify"]])
    gdn_state = gdn_state_nbytes(plain)
    head = model.mtp
    per_expert = sum(a.nbytes for a in head.layer.experts.routed) // \
        head.layer.experts.routed[0].shape[0]
    dense = sum(a.nbytes for a in _arrays_of(head))
    draft_experts = sum(n for _, n in selected["draft"]) * per_expert
    head_rows = (drafts.vocab or model.vocab_size) / model.vocab_size  # a draft vocabulary's
    mean = lambda part: float(np.mean([n for _, n in selected[part]]))  # noqa: E731
    return Costs(1e3 * best["decode"], 1e3 * best["verify"], 1e3 * best["draft"],
                 tb.total + 2 * gdn_state,
                 tv.total + (2 if rows == 2 else 1 + rows) * gdn_state,
                 dense + draft_experts + int(n_draft * head_rows * tb.lm_head),
                 1e3 * rollback, (mean("decode"), mean("verify")),
                 [v / d for d, v in zip(rounds["decode"], rounds["verify"])],
                 [v / d for d, v in zip(rounds["decode"], rounds["draft"])], split)


def _split(parts: dict, rolled: list) -> dict:
    """{label: [ms in decode, ms in verify]}: each plan step timed on its own (a kernel's calls
    summed by label), interleaved rounds, each label's best round; the rollback as `rollback`.
    Where a verify step's time goes beside a token's (issue 32 item 4). The plans' kernels
    one by one (forward.JOIN_STEPS off meanwhile: the plans made again), not joined a layer a
    dispatch as they run."""
    from fermijit.model import batch, forward

    acc: dict = {}
    saved = forward.run_steps, batch.run_steps

    def timed_steps(steps):
        for label, fn, args in steps:
            start = time.perf_counter()
            fn(*args)
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - start

    best: dict = {}
    forward.run_steps = batch.run_steps = timed_steps
    joined, forward.JOIN_STEPS = forward.JOIN_STEPS, False
    try:
        for _ in range(SPLIT_ROUNDS):
            for i, f in enumerate(parts.values()):
                acc.clear()
                rolled[0] = 0.0
                for _ in range(CALLS):
                    f()
                if i:
                    acc["rollback"] = rolled[0]
                for label, took in acc.items():
                    row = best.setdefault(label, [float("inf")] * len(parts))
                    row[i] = min(row[i], 1e3 * took / CALLS)
    finally:
        forward.run_steps, batch.run_steps = saved
        forward.JOIN_STEPS = joined
    return {label: [0.0 if t == float("inf") else round(t, 4) for t in row]
            for label, row in sorted(best.items(), key=lambda kv: -max(
                t for t in kv[1] if t != float("inf")))}


def _arrays_of(head):
    """The head's arrays but its routed experts (counted as the routers select them)."""
    from fermijit.model.token_bytes import arrays

    routed = {id(a) for a in head.layer.experts.routed}
    return [a for a in arrays(head) if id(a) not in routed]


def run(model_dir: Path, report: dict, text: Path | None, n_prompts: int, drafts,
        as_json: bool) -> dict:
    """`drafts` a speculative.Drafts."""
    from fermijit import engine
    from fermijit.model.forward import load_model

    load_before = os.getloadavg()[0]  # this machine may be shared: the figures' conditions
    _, model = load_model(model_dir)
    if model.mtp is None:
        raise FermijitError(f"--speculative mtp: {model_dir} has no MTP head (mtp.* weights)")
    n_prompt, n_tokens = report["prompt_tokens"], report["decode_tokens"]
    if n_prompt + n_tokens + 2 * drafts.n + 4 > model.max_context:
        raise FermijitError(f"prompt plus tokens exceed the context of {model.max_context}")
    chosen = prompts(model_dir, model, text, n_prompts, n_prompt)
    engine.warm_up(model, chosen[0])
    from fermijit import speculative

    speculative.warm_up(model, _greedy(model), drafts)
    plain_s = spec_s = 0.0
    n_plain = n_spec = steps = drafted = accepted = 0
    identical = True
    for prompt in chosen:
        want, stats = _generate(model, prompt, n_tokens, None)
        got, spec = _generate(model, prompt, n_tokens, drafts)
        identical &= got == want
        plain_s += stats.decode_s
        n_plain += stats.n_decode_tokens
        spec_s += spec.decode_s
        n_spec += spec.n_decode_tokens
        steps += spec.speculative.steps
        drafted += spec.speculative.drafted
        accepted += spec.speculative.accepted
    costs = step_costs(model, chosen[-1], drafts)
    a = accepted / drafted if drafted else float("nan")
    per_step = n_spec / steps
    verify_ratio = float(np.median(costs.verify_ratios))
    step_ratio = verify_ratio + float(np.median(costs.draft_ratios))  # of a token's time
    report.update({
        "model": str(model_dir), "draft": drafts.n, "draft_vocab": drafts.vocab,
        "load_1min": [load_before, os.getloadavg()[0]],
        "prompts": len(chosen),
        "text": None if text is None else str(text), "identical_text": bool(identical),
        "plain_tok_s": n_plain / plain_s, "speculative_tok_s": n_spec / spec_s,
        "speedup": (n_spec / spec_s) / (n_plain / plain_s),
        "tokens_per_step": per_step, "acceptance": a, "steps": steps,
        "costs": {k: v for k, v in dataclasses.asdict(costs).items()
                  if k not in ("split", "experts")},
        "experts_per_layer": list(costs.experts),
        "split": costs.split,
        "verify_of_decode": verify_ratio,  # the median of the rounds' paired ratios
        "verify_of_decode_iqr": [float(np.percentile(costs.verify_ratios, q)) for q in (25, 75)],
        "verify_bytes_of_decode": costs.verify_bytes / costs.decode_bytes,  # the byte bound
        "experts_random": random_experts(model, drafts.n + 1),
        "draft_of_decode": float(np.median(costs.draft_ratios)),
        "bytes_per_token_plain": costs.decode_bytes,
        "bytes_per_accepted_token": (costs.verify_bytes + costs.draft_bytes) / per_step,
        "projection": [{"acceptance": x,
                        "speedup": (1 + x) / step_ratio,
                        "speedup_verify_only": (1 + x) / verify_ratio}
                       for x in ACCEPTANCE] if drafts.n == 1 else None,
    })
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return report


def random_experts(model, n_rows: int) -> float:
    """Distinct routed experts a layer that n_rows rows of independent uniform routing select
    on average: E (1 - (1 - k/E)^R)."""
    E, k = model.n_experts, model.top_k
    return E * (1 - (1 - k / E) ** n_rows)


def _greedy(model):
    from fermijit.ops.sampling import Sampler

    return Sampler(model.vocab_size, temperature=0, top_k=0, top_p=1.0, seed=0)


def format_report(r: dict) -> str:
    c, mb = r["costs"], 1e6
    lines = [
        f"model {r['model']}",
        f"cpu {r['cpu']}, isa {r['isa']} (decode {r['decode_isa']}), {r['threads']} threads, "
        f"load {r['load_1min'][0]:.1f} -> {r['load_1min'][1]:.1f}",
        f"{r['prompts']} prompts of {r['prompt_tokens']} tokens "
        f"({r['text'] or 'built-in text'}), {r['decode_tokens']} greedy tokens each, "
        f"{r['draft']} draft(s) a step"
        + (f" from the first {r['draft_vocab']} ids" if r["draft_vocab"] else ""),
        f"{'plain decode':<28} {r['plain_tok_s']:9.2f} tok/s",
        f"{'speculative (mtp)':<28} {r['speculative_tok_s']:9.2f} tok/s  "
        f"({r['speedup']:.2f}x; text identical: {'yes' if r['identical_text'] else 'NO'})",
        f"{'tokens per step':<28} {r['tokens_per_step']:9.2f}      "
        f"(acceptance {100 * r['acceptance']:.1f}% over {r['steps']} steps)",
        f"{'decode token':<28} {c['decode_ms']:9.2f} ms  ({c['decode_bytes'] / mb:.1f} MB read)",
        f"{'verify step, ' + str(r['draft'] + 1) + ' rows':<28} {c['verify_ms']:9.2f} ms  "
        f"({r['verify_of_decode']:.3f}x a token, the median of {len(c['verify_ratios'])} "
        f"rounds' paired ratios, IQR {r['verify_of_decode_iqr'][0]:.3f}-"
        f"{r['verify_of_decode_iqr'][1]:.3f}; {c['verify_bytes'] / mb:.1f} MB: "
        f"{r['verify_bytes_of_decode']:.2f}x a token's, the byte bound; its rollback "
        f"{c.get('rollback_ms', float('nan')):.2f} ms)",
        f"{'experts a layer':<28} {r['experts_per_layer'][0]:9.2f} a token, "
        f"{r['experts_per_layer'][1]:.2f} a verify step (random routing: "
        f"{r['experts_random']:.2f})",
        f"{'draft':<28} {c['draft_ms']:9.2f} ms  ({r['draft_of_decode']:.2f}x a token; "
        f"{c['draft_bytes'] / mb:.1f} MB)",
        f"{'bytes per token':<28} {r['bytes_per_token_plain'] / mb:9.1f} MB plain, "
        f"{r['bytes_per_accepted_token'] / mb:.1f} MB speculative",
    ]
    if r["projection"]:
        lines.append("projection, speedup = (1 + a) * t_decode / (t_verify + t_draft)  "
                     "[verify alone: (1 + a) * t_decode / t_verify]")
        lines += [f"  a = {p['acceptance']:.1f}: {p['speedup']:.2f}x  "
                  f"[{p['speedup_verify_only']:.2f}x]" for p in r["projection"]]
    if r.get("split"):
        lines.append(format_split(r["split"]))
    return "\n".join(lines)


def format_split(split: dict) -> str:
    """Costs.split as a table: each label's ms in a decode token and in the verify step."""
    lines = [f"  {'split, ms (best round)':<24} {'token':>8} {'verify':>8} {'ratio':>6}"]
    for label, (d, v) in split.items():
        ratio = f"{v / d:6.2f}" if d else f"{'-':>6}"
        lines.append(f"  {label:<24} {d:8.3f} {v:8.3f} {ratio}")
    d, v = (sum(row[i] for row in split.values()) for i in (0, 1))
    lines.append(f"  {'sum':<24} {d:8.3f} {v:8.3f} {v / d:6.2f}")
    return "\n".join(lines)
