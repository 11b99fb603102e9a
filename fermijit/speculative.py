"""Speculative decoding with the model's own MTP head (MODEL.md §10): the head drafts
N tokens, the model verifies them in one step over the sequence's next positions, and what it
rejects is rolled back, so the text is the model's own.

A step, with the model at position P, its state waiting on hidden states [P-k, P) and `token`
(sampled, not yet fed):
  draft   the head's waiting rows (their next tokens: the k-1 accepted last step, and `token`)
          give d_1; each further draft chains the head on its own output (model/mtp.py);
  verify  one `decode_rows` step over [token, d_1 .. d_N] at positions P .. P+N (the batched
          decode's kernels: each row bit for bit `Model.decode`, the GDN state advanced token by
          token, its state after every row but the last saved; of one draft, the recurrent
          state left after the first row, the last row's update pending: GdnState);
  accept  greedy: d_i while it is the argmax of the logits before it, then that argmax;
          sampling: ops.sampling.speculative, the standard rejection rule (the tokens are
          distributed as without drafts);
  undo    `rollback` to the last accepted token: GDN states from the saves (or the pending
          row dropped), the position (and so the KV length) back; the head's rows past P are
          rewritten by the next draft.
At temperature 0 the tokens are then exactly greedy decoding's (tests/fermijit/test_speculative.py).

Dimensions: as model/forward.py; N drafts a step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit import FermijitError
from fermijit.model import batch, mtp
from fermijit.ops import sampling

MAX_DRAFT = 8  # --draft: the head is one layer; chained drafts' acceptance falls quickly
# `--speculative auto` (generate, serve) drafts only where it is projected to pay: a step makes
# 1 + a tokens for a verify step and a draft, so speed-up = (1 + a) / (verify + draft) in tokens'
# time (bench speculative's projection), at the acceptance users report for this head (0.7-0.8).
# Measured with `bench decode --speculative mtp`: the full-size REAP-128 shape on the H200's
# 16-core host, 16 threads, medians of 3 fresh-process rounds (session 19): a 2-row verify step
# 1.52x a token, the draft 0.25x: 0.99x at a = 0.75. The token itself got faster that session
# (22 ms, was 35-40: the whole team kept by capped forks, claimed runs), the verify step less so
# (34 ms, was 48-56): its MoE reads the union of two tokens' experts (2x a token's, as its bytes),
# its GDN rows 2.2x a token's GDN step. Session 18: 1.36x and 0.21x (1.11x); 2 threads on the
# 2-core machine: verify 1.36-1.39x. Auto wants PAYS_MIN_SPEEDUP, not just above 1: the
# acceptance is what users report for the real head (none measured here: random weights), and
# in the server a step of several streams also runs each head's catch-up rows, not measured at
# full size. So auto is off at full size; `--speculative mtp` turns it on. Session 25, the same
# host (Emerald Rapids), 5 rounds: verify 1.388x (so 1.07x with the session-19 draft); 2 threads
# on the 2-core machine 1.32x.
# The default model (9.4 MB a token, per-row work dominates) 0.6x: PAYS_MIN_BYTES.
EXPECTED_ACCEPTANCE = 0.75
VERIFY_COST, DRAFT_COST = 1.39, 0.25  # in a decode token's time, at full size, 16 threads
PAYS_MIN_SPEEDUP = 1.15
# Smaller models (fewer bytes a token than this) pay less still: per-row work dominates them.
PAYS_MIN_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Drafts:
    """How a step drafts: `n` tokens (chained after the first), from the first `vocab` ids only
    (model/mtp.py lm_head_rows; None: the whole vocabulary)."""

    n: int = 1
    vocab: int | None = None

    def __post_init__(self):
        if not 1 <= self.n <= MAX_DRAFT:
            raise FermijitError(f"--draft must be between 1 and {MAX_DRAFT}, got {self.n}")
        if self.vocab is not None and self.vocab < 1:
            raise FermijitError(f"--draft-vocab must be at least 1, got {self.vocab}")


def engine_drafts(engine, drafts: Drafts | None = None) -> Drafts | None:
    """What a server built on `engine` drafts: `drafts` (default one a step) where the engine
    was loaded for speculative decoding, else None."""
    if not engine.speculative:
        return None
    return Drafts() if drafts is None else drafts


@dataclasses.dataclass
class Counts:
    """What the drafts did (bench decode and the generate summary report them)."""

    steps: int = 0       # verify steps
    drafted: int = 0     # draft tokens proposed
    accepted: int = 0    # of them accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


class Speculator:
    """Draft-and-verify of one sequence. `step` advances the state by the tokens it accepts;
    `truncate` takes back the last ones of a step (the generation stopped inside it);
    `settle` computes the head's rows of every fed token but the last (before a snapshot)."""

    def __init__(self, model, sampler, drafts: Drafts = Drafts()):
        if model.mtp is None:
            raise FermijitError("--speculative mtp: the model has no MTP head (mtp.* weights)")
        if not batch.can_batch(model):
            raise FermijitError("--speculative mtp needs a 4-bit fermijit model (convert it)")
        self.model, self.sampler, self.n_draft = model, sampler, drafts.n
        self.draft_vocab = None if drafts.vocab in (None, model.vocab_size) else drafts.vocab
        if self.draft_vocab is not None:
            mtp.lm_head_rows(model, self.draft_vocab)  # checks it against the model
        self.is_greedy = sampler.temperature == 0
        self.counts = Counts()
        self._spaces: dict[int, tuple[batch.BatchWorkspace, batch.GdnSaves]] = {}
        self._tail: list[int] = []   # fed tokens whose head rows wait: the drafts accepted
        self._last: tuple[int, int] | None = None  # (rows, kept) of the last step
        self._logits: np.ndarray | None = None     # its logits [rows, V], a workspace's view

    def _space(self, n_rows: int):
        space = self._spaces.get(n_rows)
        if space is None:
            space = self._spaces[n_rows] = (batch.BatchWorkspace(self.model, n_rows),
                                            batch.GdnSaves(self.model, n_rows))
        return space

    def _probabilities(self, logits) -> np.ndarray:
        """The sampler's distribution over the vocabulary from `logits` ([V], or a draft
        vocabulary's first ids: 0 past them)."""
        s = self.sampler
        p = sampling.probabilities(logits, s.temperature, min(s.top_k, logits.size), s.top_p)
        return p if p.size == s.vocab_size else np.pad(p, (0, s.vocab_size - p.size))

    def draft(self, state, token: int, n: int) -> tuple[list[int], list[np.ndarray]]:
        """n drafts after `token` and, when sampling, the distributions they were drawn from."""
        tokens = self._tail + [token]
        if state.hidden is None or state.hidden.shape[0] != len(tokens):
            raise FermijitError(f"speculative: {len(tokens)} tokens for the head's "
                                f"{0 if state.hidden is None else state.hidden.shape[0]} "
                                f"waiting hidden states")
        out, logits = mtp.consume(self.model, state, tokens, vocab=self.draft_vocab,
                                  like_decode=True)
        drafts, dists = [], []
        for i in range(n):
            if self.is_greedy:
                drafts.append(int(np.argmax(logits)))
            else:
                dists.append(self._probabilities(logits))
                drafts.append(sampling.draw(dists[-1], self.sampler.rng.random()))
            if i + 1 < n:
                out, logits = mtp.chain(self.model, state, state.position + i, drafts[-1],
                                        out[-1], self.draft_vocab, like_decode=True)
        self._tail = []
        return drafts, dists

    def step(self, state, token: int) -> tuple[list[int], np.ndarray]:
        """Feed `token` and the drafts the model accepts: (the accepted drafts and the token
        after them, the logits that token was sampled from). The state has then seen `token`
        and the accepted drafts."""
        n = min(self.n_draft, state.context - state.position - 1)
        if n < 1:  # the context's last position: a plain decode (its hidden state waits)
            logits = self.model.decode(token, state)[None]
            self._tail.append(token)
            self._last, self._logits = (1, 1), logits
            self.counts.steps += 1
            return [self.sampler.sample(logits[0])], logits[0]
        drafts, q = self.draft(state, token, n)
        ws, saves = self._space(n + 1)
        logits = batch.decode_rows(self.model, [token] + drafts, [state] * (n + 1), ws,
                                   [saves] * (n + 1))
        if self.is_greedy:
            n_ok = 0
            while n_ok < n and drafts[n_ok] == int(np.argmax(logits[n_ok])):
                n_ok += 1
            nxt = int(np.argmax(logits[n_ok]))
        else:
            p = [self._probabilities(row) for row in logits]
            n_ok, nxt = sampling.speculative(p, q, drafts, self.sampler.rng)
        batch.rollback(self.model, state, saves, n + 1, n_ok + 1)
        self._tail = drafts[:n_ok]
        self._last, self._logits = (n + 1, n_ok + 1), logits
        self.counts.steps += 1
        self.counts.drafted += n
        self.counts.accepted += n_ok
        return drafts[:n_ok] + [nxt], logits[n_ok]

    def truncate(self, state, n_fed: int) -> np.ndarray:
        """Keep only the first `n_fed` tokens the last step fed (>= 1: its `token`); returns
        the logits after them."""
        if self._last is None:
            raise FermijitError("speculative: no step to take back")
        rows, kept = self._last
        if not 1 <= n_fed <= kept:
            raise FermijitError(f"speculative: keep {n_fed} of the {kept} tokens fed")
        if n_fed < kept:
            _, saves = self._space(rows)
            batch.rollback(self.model, state, saves, kept, n_fed)
            self._tail = self._tail[:len(self._tail) - (kept - n_fed)]
            self._last = (rows, n_fed)
        return self._logits[n_fed - 1]

    def fed(self, token: int) -> None:
        """`token` was fed by a step of another kind (a server's batched decode): its head row
        waits for the next draft."""
        self._tail.append(token)
        self._last = None

    def settle(self, state) -> None:
        """The head's rows of the fed tokens that wait on it, all but the last position's, so
        that the state is as a prefill leaves it (what the snapshot cache stores)."""
        if self._tail:
            mtp.consume(self.model, state, self._tail, with_logits=False, like_decode=True)
            self._tail = []


def pays(model) -> bool:
    """Whether speculative decoding is projected to pay on `model`: a model reading at least
    PAYS_MIN_BYTES a token, and the measured step costs' projected speed-up at least
    PAYS_MIN_SPEEDUP (see VERIFY_COST). A model `token_bytes` does not count (an HF checkpoint's fp32 experts): no;
    `--speculative mtp` turns it on either way."""
    from fermijit.model.token_bytes import token_bytes

    try:
        per_token = token_bytes(model, [model.top_k] * len(model.layers)).total
    except FermijitError:
        return False
    speedup = (1 + EXPECTED_ACCEPTANCE) / (VERIFY_COST + DRAFT_COST)
    return per_token >= PAYS_MIN_BYTES and speedup >= PAYS_MIN_SPEEDUP


def warm_up(model, sampler, drafts: Drafts) -> None:
    """Compile (or load) the kernels of a speculative step (the head's rows, a verify step of
    n + 1 rows, a rollback) on the warm-up's sample of the model (fermijit/warm.py) and a
    throwaway state; `sampler` a twin of the real one (drafting draws from its generator), and
    the settling of a kept draft's pending GDN row (model/state.py GdnState: the next step of
    another kind applies it)."""
    from fermijit.model.state import GdnState
    from fermijit.warm import kernel_sample

    sample = kernel_sample(model)
    state = sample.new_state(drafts.n + 4, mtp=True)
    sample.prefill(np.zeros(2, np.int32), state)
    speculator = Speculator(sample, sampler, drafts)
    tokens, _ = speculator.step(state, 0)
    speculator.step(state, tokens[-1])
    layer = next((s for s in state.layers if isinstance(s, GdnState) and s.pending is not None),
                 None)
    if layer is not None:  # kept or not, a row marked pending: its settle kernel loaded too
        layer.pending.is_set[0] = 1
        layer.settle()
